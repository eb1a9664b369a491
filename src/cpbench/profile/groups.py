"""Kernel grouping rules as data: ordered (group, regex) rules, the first match wins.

The rules ship as ``groups.yaml`` beside this module; ``load(FILE)`` puts a user's rules
(same format) in front of them, so a user re-files a kernel without editing cpbench. A name
no rule matches is ``other``: it is kept (and listed by name), never dropped.

Groups are ``top/sub`` paths. The top level is fixed (``TOP_GROUPS``) because the
breakdown's priority and the report's columns are defined on it; the subgroups are free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from cpbench.errors import UsageError

TOP_GROUPS = ("attention", "communication", "gemm", "elementwise", "memory", "other")
OTHER = "other"
COMMUNICATION = "communication"
ATTENTION = "attention"


def top(group: str) -> str:
    """``attention/bwd`` → ``attention``."""
    return group.split("/", 1)[0]


@dataclass(frozen=True)
class Rule:
    group: str
    pattern: re.Pattern[str]
    where: str  # file:line, for messages


class Rules:
    """Ordered rules; ``group(name)`` is the first matching rule's group, else ``other``."""

    def __init__(self, rules: tuple[Rule, ...]):
        self.rules = rules
        self._seen: dict[str, str] = {}  # traces repeat a few names thousands of times

    def __len__(self) -> int:
        return len(self.rules)

    def group(self, name: str) -> str:
        found = self._seen.get(name)
        if found is None:
            found = next((r.group for r in self.rules if r.pattern.search(name)), OTHER)
            self._seen[name] = found
        return found

    def rule(self, name: str) -> Rule | None:
        """The rule that decides ``name`` (None: unmatched), to explain a grouping."""
        return next((r for r in self.rules if r.pattern.search(name)), None)


def load(user_file: str | None = None) -> Rules:
    """The shipped rules, after ``user_file``'s when given (UsageError naming the file and
    line of a bad rule)."""
    shipped = resources.files("cpbench.profile").joinpath("groups.yaml").read_text()
    rules = parse(shipped, "groups.yaml")
    if user_file:
        try:
            text = Path(user_file).read_text()
        except OSError as e:
            raise UsageError(f"--groups {user_file}: cannot read it "
                             f"({e.strerror or e}); give a YAML file of rules") from None
        mine = parse(text, user_file)
        if not mine:
            raise UsageError(f"{user_file}: no rules; write `rules:` then items such as "
                             f"`- {{group: attention/fwd, match: 'my_attn_kernel'}}`")
        rules = mine + rules
    return Rules(rules)


def parse(text: str, where: str) -> tuple[Rule, ...]:
    """Rules from YAML text: ``rules:`` (or a bare list) of ``{group, match}`` mappings."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise UsageError(f"{where}{line}: not valid YAML "
                         f"({getattr(e, 'problem', None) or e})") from None
    if root is None:
        return ()
    if isinstance(root, yaml.MappingNode):
        items = {k.value: v for k, v in root.value}
        if set(items) != {"rules"}:
            raise UsageError(f"{where}:{root.start_mark.line + 1}: expected one key, "
                             f"`rules:`, holding a list of {{group, match}} items")
        root = items["rules"]
    if not isinstance(root, yaml.SequenceNode):
        raise UsageError(f"{where}:{root.start_mark.line + 1}: `rules` must be a list of "
                         f"{{group, match}} items")
    return tuple(_rule(node, where) for node in root.value)


def _rule(node: yaml.MappingNode, where: str) -> Rule:
    at = f"{where}:{node.start_mark.line + 1}"
    fields = {k.value: v.value for k, v in node.value} \
        if isinstance(node, yaml.MappingNode) else {}
    if set(fields) != {"group", "match"} or not all(isinstance(v, str) for v in fields.values()):
        raise UsageError(f"{at}: a rule is a mapping with two keys, `group` and `match`, e.g. "
                         f"{{group: attention/fwd, match: 'my_attn_kernel'}}")
    group = fields["group"].strip().strip("/")
    if top(group) not in TOP_GROUPS:
        raise UsageError(f"{at}: group {group!r} is not under one of "
                         f"{', '.join(TOP_GROUPS)} (write e.g. {TOP_GROUPS[0]}/{group})")
    try:
        pattern = re.compile(fields["match"], re.IGNORECASE)
    except re.error as e:
        raise UsageError(f"{at}: bad regex {fields['match']!r} ({e})") from None
    return Rule(group, pattern, at)
