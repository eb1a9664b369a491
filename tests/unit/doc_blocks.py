"""The runnable blocks of README.md and docs/*.md, and how their output excerpts are matched.

The convention (docs/testing.md): a fence whose info string is ``console runnable`` (optionally
``exit=N``) holds ``$ `` command lines, a trailing ``\\`` continuing one, and below each command
lines of its output that must appear. Shared by the doc test (tests/multirank/test_docs.py)
and the unit tests of the pages' links and of this parser."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?"
# what an excerpt line is cut into: elisions, numbers, rules (----, ====) and spaces
_TOKENS = re.compile(rf"(\.\.\.|…|{NUMBER}|[-=]{{3,}}|\s+)")


@dataclass(frozen=True)
class Command:
    line: int  # 1-based line of the ``$`` in its page
    text: str  # what bash runs: continuation lines joined
    expect: tuple[str, ...]  # output excerpt lines shown under it


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository: README.md, docs/run.md
    line: int  # 1-based line of the opening fence
    exit: int  # the exit status every command must return
    commands: tuple[Command, ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages(repo: Path = REPO) -> list[Path]:
    """README.md and every top-level docs page (docs/upstream/ holds transcriptions, no runs)."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def _fences(lines: list[str]):
    """(line index of the opening fence, its info string, body lines) of each fenced block."""
    i = 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != m.group(1):
            end += 1
        yield i, m.group(2).strip(), lines[i + 1:end]
        i = end + 1


def _commands(start: int, body: list[str], where: str) -> tuple[Command, ...]:
    """The ``$`` lines of one block (``start``: the fence's line index) with their excerpts."""
    found: list[tuple[int, str, list[str]]] = []
    j = 0
    while j < len(body):
        line = body[j]
        if line.startswith("$ "):
            first, text = j, line[2:]
            while text.endswith("\\") and j + 1 < len(body):
                j += 1
                text = text[:-1] + " " + body[j].strip()
            found.append((start + 2 + first, text, []))
        elif line.strip():
            if not found:
                raise ValueError(f"{where}: output line before any `$ ` command: {line!r}")
            found[-1][2].append(line)
        j += 1
    return tuple(Command(n, text, tuple(expect)) for n, text, expect in found)


def blocks(path: Path, repo: Path = REPO) -> list[Block]:
    """Every ``console runnable`` block of one page."""
    lines = path.read_text().splitlines()
    page = path.relative_to(repo).as_posix()
    out = []
    for start, info, body in _fences(lines):
        words = info.split()
        if words[:1] != ["console"] or "runnable" not in words:
            continue
        exits = [int(w.split("=", 1)[1]) for w in words if w.startswith("exit=")]
        commands = _commands(start, body, f"{page}:{start + 1}")
        if not commands:
            raise ValueError(f"{page}:{start + 1}: a runnable block without a `$ ` command")
        out.append(Block(page, start + 1, exits[0] if exits else 0, commands))
    return out


def all_blocks(repo: Path = REPO) -> list[Block]:
    return [b for p in pages(repo) for b in blocks(p, repo)]


def excerpt_pattern(line: str) -> re.Pattern:
    """An excerpt line as a regex: any number for a number, any rule for a rule, any run of
    spaces for one, anything for ``...``; the rest literally."""
    out = []
    for part in _TOKENS.split(line.strip()):
        if not part:
            continue
        if part in ("...", "…"):
            out.append(".*")
        elif part.isspace():
            out.append(r"\s+")
        elif re.fullmatch(NUMBER, part):
            out.append(NUMBER)
        elif re.fullmatch(r"[-=]{3,}", part):
            out.append(r"[-=]{3,}")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


def missing_lines(expect: tuple[str, ...], output: str) -> list[str]:
    """The excerpt lines no line of ``output`` matches (a line of only ``...`` is skipped)."""
    lines = output.splitlines()
    missing = []
    for want in expect:
        if want.strip() in ("...", "…"):
            continue
        pattern = excerpt_pattern(want)
        if not any(pattern.search(got) for got in lines):
            missing.append(want)
    return missing
