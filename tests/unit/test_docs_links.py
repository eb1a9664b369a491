"""The README is a door: short, every docs page linked from it, every link inside the pages
resolving; and the parser of the doc test's runnable blocks (tests/unit/doc_blocks.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from doc_blocks import REPO, all_blocks, blocks, excerpt_pattern, missing_lines, pages

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", page.read_text(), re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not inside code blocks
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_readme_is_under_200_lines():
    assert len((REPO / "README.md").read_text().splitlines()) < 200


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / t.split("#")[0]).resolve() for t in _links(REPO / "README.md")}
    unlinked = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken


def test_the_readme_links_the_docs_pages_by_path():
    """The unit test above would pass on a README with no links at all."""
    assert sum(t.startswith("docs/") for t in _links(REPO / "README.md")) >= 8


def test_excerpt_numbers_spaces_rules_and_elisions_match_any():
    pattern = excerpt_pattern("  zigzag  |  1.00  | 564.51 ms | PASS |   214.3 %")
    assert pattern.search("zigzag | 2.18 |  7.2e-03 ms |  PASS | 5 %")
    assert not pattern.search("zigzag | 2.18 | 7 ms | FAIL | 5 %")
    assert excerpt_pattern("==== error: unknown ...").search("== nope") is None
    assert excerpt_pattern("===== error: unknown ...").search("=== error: unknown 'x'; choose")
    assert missing_lines(("a 1", "...", "b"), "a 22\nc") == ["b"]


def test_blocks_parse_commands_continuations_excerpts_and_exit(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "x.md"
    page.write_text("text\n```console runnable exit=2\n$ cpbench run \\\n    --nproc 2\n"
                    "error: bad\n$ cpbench report r.jsonl\n```\n```bash\n$ cpbench x\n```\n"
                    "```console\n$ not runnable\n```\n")
    (block,) = blocks(page, tmp_path)
    assert (block.id, block.exit) == ("docs/x.md:2", 2)
    first, second = block.commands
    assert (first.line, first.text, first.expect) == (3, "cpbench run  --nproc 2", ("error: bad",))
    assert (second.line, second.text, second.expect) == (6, "cpbench report r.jsonl", ())


def test_runnable_blocks_run_no_make_and_use_small_sizes():
    """The doc test must stay minutes on 2 cores: no make targets, no 8k+ runs on ranks."""
    for block in all_blocks():
        for command in block.commands:
            assert not command.text.startswith("make"), block.id
            # a block whose commands are refused (exit 2) runs nothing: any size, e.g. the
            # estimate refusing 512K before any rank starts
            if block.exit != 2 and (command.text.startswith("cpbench run")
                                    or " --nproc " in command.text):
                sizes = re.findall(r"--seqlen (\S+)", command.text)
                assert all(s in ("256", "512", "1000", "1k", "2k", "4k") for s in sizes), block.id
