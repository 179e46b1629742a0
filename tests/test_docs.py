"""The README is the front door and docs/ holds the rest: every relative link in README.md and
docs/*.md reaches an existing file (and, with a #fragment into a Markdown file, one of its
headings), and the README still opens with the two commands, command 2 being what CI runs."""

import re
from pathlib import Path

import pytest

from .conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str, inline_code: bool = False) -> str:
    """The text outside fenced code blocks; inline code removed unless `inline_code`."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line if inline_code else re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path.read_text(), inline_code=True).splitlines():
        if match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http(s), mailto: not checked here
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
            broken.append(f"{target}: no heading with that anchor in {resolved.name}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_readme_opens_with_the_two_commands_and_ci_runs_command_2():
    readme = (REPO / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    assert readme.index("```bash\n") == readme.index("```"), "the two commands are the README's first code block"
    lines = [line for line in first_block.splitlines() if line.strip()]
    assert [line[:4] for line in lines] == ["# 1.", "pyth", "# 2.", "pyth"], lines
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("python -m venv")]
    assert ci == [lines[3]], "command 2 is exactly what .ci/run runs"


def test_the_readme_is_a_front_door():
    """At most 130 lines: results tables and long explanations live in docs/, linked from it."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 130, f"README.md is {len(lines)} lines; move detail into docs/ and link it"
