"""The README and docs/: every page linked from the README, every relative link and anchor resolving, the Layout
drawing only what exists, and the generator of docs/config.md (`make docs`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return "\n".join(part for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M)) if i % 2 == 0)


def anchors(path: Path) -> Iterator[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens, -1, -2 ... for
    repeats."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", prose(path.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        yield slug if n == 0 else f"{slug}-{n}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / target.split("#")[0]).resolve() for target in LINK.findall(prose(README.read_text()))}
    assert [p.name for p in PAGES if p.resolve() not in linked] == []


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_and_anchors_resolve(page):
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.exists(), f"{page.name}: {target} does not exist"
        if anchor:
            assert anchor in set(anchors(path)), f"{page.name}: {target} names no heading of {path.name}"


def layout_entries() -> list[str]:
    """The paths the README's Layout drawing names: top-level entries and those one level into rlhf/."""
    block = README.read_text().split("## Layout", 1)[1].split("```", 2)[1]
    names = []
    for line in block.splitlines():
        match = re.match(r"^( {0,2})(\S+)", line)
        if match and not line.startswith("   ") and match.group(2) != "*.py":
            names.append(("rlhf/" if match.group(1) else "") + match.group(2))
    return names


def test_the_layout_draws_what_exists():
    names = layout_entries()
    assert "rlhf/" in names and "rlhf/ppo/" in names
    assert [name for name in names if not (REPO / name).exists()] == []
    packages = {f"rlhf/{p.parent.name}/" for p in (REPO / "rlhf").glob("*/__init__.py")}
    assert sorted(packages - set(names)) == [], "a package of rlhf/ is missing from the README's Layout"


def test_update_reference_writes_between_the_markers(tmp_path):
    from rlhf.config.docs import REFERENCE_END, REFERENCE_START, current_reference, reference_markdown, update_reference

    page = tmp_path / "config.md"
    page.write_text(f"# Config\n\nprose\n\n{REFERENCE_START}\nold table\n{REFERENCE_END}\n\nmore prose\n")
    assert update_reference(page) is True
    assert current_reference(page) == reference_markdown()
    assert page.read_text().startswith("# Config\n\nprose\n\n") and page.read_text().endswith("\n\nmore prose\n")
    assert update_reference(page) is False  # already current
    page.write_text("# Config\n")
    with pytest.raises(ValueError, match="config.md has no <!-- config-reference:start -->"):
        update_reference(page)


def test_rlhf_docs_command(tmp_path, capsys):
    from flows.cli import cmd_docs
    from rlhf.config.docs import REFERENCE_END, REFERENCE_START, current_reference, reference_markdown

    page, metrics = tmp_path / "config.md", tmp_path / "metrics.md"
    page.write_text(f"{REFERENCE_START}\n{REFERENCE_END}\n")
    metrics.write_text((REPO / "docs" / "metrics.md").read_text())
    pages = ["--page", str(page), "--metrics-page", str(metrics)]
    assert cmd_docs(["--write", *pages]) == 0
    assert current_reference(page) == reference_markdown()
    assert capsys.readouterr().out.strip() == f"{page} updated\n{metrics} already current"
    assert cmd_docs(["--write", "--page", str(tmp_path / "missing.md")]) == 2
    assert "missing.md does not exist" in capsys.readouterr().err
    page.write_text("no markers\n")
    assert cmd_docs(["--write", *pages]) == 2
    assert "has no <!-- config-reference:start -->" in capsys.readouterr().err
    assert cmd_docs([]) == 0
    assert capsys.readouterr().out.strip() == reference_markdown()
