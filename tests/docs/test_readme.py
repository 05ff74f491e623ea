"""The README stays a short guide that matches the tree, and the docs pages stay true.

- README.md has at most 450 lines, and its test command is the one CI runs.
- docs/INTERFACES.md's module map names only paths that exist, and every module and package of
  titanext/ at every depth.
- Every relative link in README.md and docs/*.md points to an existing file (and heading).
- docs/configuration.md holds the reference generated from ``--help``, so every config key is
  documented; the own-model page shows the shipped example script.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests import REPO_ROOT
from titanext.config import docs as config_docs

ROOT = REPO_ROOT
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """Markdown without fenced code blocks and inline code (links and headings live outside)."""
    return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors of a markdown page (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _blocks(page, heading: str) -> list[str]:
    text = page.read_text(encoding="utf-8")
    section = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, f"{page.name} has no '## {heading}' section"
    blocks = re.findall(r"```\n(.*?)```", section.group(1), re.S)
    assert blocks, f"{page.name}'s {heading} section has no code block"
    return blocks


INTERFACES = ROOT / "docs" / "INTERFACES.md"


def _layout_paths() -> list[str]:
    """The paths docs/INTERFACES.md's module map lists."""
    blocks = _blocks(INTERFACES, "Module map")
    return [line.split()[0] for block in blocks for line in block.splitlines()
            if line.startswith("titanext/")]


def test_readme_is_at_most_450_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= 450, f"README.md has {n} lines; move details into a docs/ page"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = next(line for line in ci.splitlines() if "pytest" in line and "pip install" in line)
    assert command.strip() in README.read_text(encoding="utf-8")


def test_layout_paths_exist():
    missing = [p for p in _layout_paths() if not (ROOT / p).exists()
               or p.endswith("/") != (ROOT / p).is_dir()]
    assert not missing, ("docs/INTERFACES.md's module map names paths that are not in the tree: "
                         f"{missing}")


def test_layout_lists_every_module_and_package():
    listed = set(_layout_paths())
    package = ROOT / "titanext"
    present = {f"titanext/{p.relative_to(package).as_posix()}" + ("/" if p.is_dir() else "")
               for p in package.rglob("*")
               if "__pycache__" not in p.parts and "assets" not in p.parent.parts
               and (p.is_dir() or (p.suffix == ".py" and
                                   (p.name != "__init__.py" or p.parent == package)))}
    absent = sorted(present - listed)
    assert not absent, ("docs/INTERFACES.md's module map misses these (add one line each): "
                        f"{absent}")
    assert len(listed) == len(_layout_paths()), "docs/INTERFACES.md's module map lists a path twice"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(
                dest.read_text(encoding="utf-8")):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files or headings: {broken}"


def test_link_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n[ok](a.md#title) [bad](b.md) [bad2](a.md#nope)\n"
                                   "```\n[in code](c.md)\n```\n")
    text = (tmp_path / "a.md").read_text()
    targets = _LINK.findall(_prose(text))
    assert targets == ["a.md#title", "b.md", "a.md#nope"]
    assert _anchors(text) == {"title"}


def test_configuration_page_is_generated_from_help():
    page = ROOT / config_docs.PAGE
    text = page.read_text(encoding="utf-8")
    assert config_docs.BEGIN_MARK in text and config_docs.END_MARK in text
    fresh = config_docs.update_page(text, config_docs.reference_markdown())
    assert text == fresh, f"{config_docs.PAGE} is stale: run `{config_docs.UPDATE_COMMAND}`"


def test_configuration_page_documents_every_config_key():
    from titanext.config import SECTIONS

    text = (ROOT / config_docs.PAGE).read_text(encoding="utf-8")
    missing = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)
               if f"### `[{s}]`" not in text or f"| `{f.name}` |" not in text]
    assert not missing, missing


def test_config_docs_refuses_help_it_cannot_parse():
    with pytest.raises(ValueError, match="unknown shape"):
        config_docs.reference_markdown("usage: x\n\nintro\n[job]  doc\nsomething else\n")
    md = config_docs.reference_markdown(
        "usage: x\n\nintro\n[job]  Jobs.\n  --job.a_b  (integer, default 1; >= 1)\n"
        "      Uses *_x keys | <dir>.\n")
    assert "| `a_b` | integer, default 1; &gt;= 1 | Uses \\*\\_x keys \\| &lt;dir&gt;. |" in md


def test_own_model_page_shows_the_shipped_script():
    page = (ROOT / "docs" / "own_model.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    assert block.strip() in (ROOT / "examples" / "own_model.py").read_text(encoding="utf-8")
