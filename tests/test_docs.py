"""The README and docs/ stay true: links resolve, the engine reference covers every argument, the
README stays short, and no page reads like a development log.

Fast and light: it reads markdown files and imports only workbench.config.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 250
# Files that a command writes: named in the failure message so the fix is obvious.
GENERATED = {"results/README.md": "python -m workbench.bench table"}

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")

# Phrases that tell how the project was developed rather than what the software does.
# Case-insensitive; each is precise enough not to hit ordinary prose about the software.
DEV_LOG = [
    r"\bruns? \d+\b",                     # "run 14", "runs 11-12"
    r"\b(?:the|this|that|our) VM\b",
    r"\bdevelopment VM\b",
    r"\bthe issue\b",
    r"\bissue #?\d+\b",
    r"\bCI run once\b",
    r"\b(?:first|last|a|one) CI run\b",
    r"\bearlier versions?\b",
    r"\bearlier runs?\b",
    r"\bprevious versions?\b",
    r"\bsessions?\b",
    r"\bwe first\b",
    r"\bround of work\b",
    r"\bwork in progress\b",
]


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(path: Path):
    """(line number, text) of the lines outside fenced code blocks, inline code removed."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, INLINE_CODE.sub("", line)


def links(path: Path):
    """(line number, target) of every markdown link and image in a page's prose."""
    for number, line in prose_lines(path):
        for match in LINK.finditer(line):
            yield number, match.group(1)


def is_relative(target: str) -> bool:
    return not (target.startswith("#") or target.startswith("mailto:") or "://" in target)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The heading anchors of a markdown page (GitHub numbers repeated ones -1, -2, ...)."""
    found, seen = set(), {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            slug = github_anchor(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_the_pages_exist():
    names = {p.name for p in DOCS.glob("*.md")}
    for name in ("engine.md", "architecture.md", "performance.md", "course.md", "testing.md",
                 "kernels.md"):
        assert name in names, f"docs/{name} is missing"


def test_every_relative_link_resolves():
    broken = []
    for page in pages():
        for number, target in links(page):
            if not is_relative(target):
                continue
            path = target.split("#", 1)[0]
            if not path:
                continue
            resolved = (page.parent / path).resolve()
            if not resolved.exists():
                rel = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved
                hint = GENERATED.get(str(rel))
                broken.append(f"{page.relative_to(ROOT)}:{number}: {target}"
                              + (f" (written by `{hint}`)" if hint else ""))
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_links_into_pages_name_existing_headings():
    broken = []
    for page in pages():
        for number, target in links(page):
            if not is_relative(target) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            resolved = (page.parent / path).resolve()
            if resolved.suffix == ".md" and resolved.is_file() and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)


def config_field_names(cls) -> list[str]:
    """EngineConfig's fields; a field that holds a nested config dataclass contributes its own."""
    names = []
    for f in dataclasses.fields(cls):
        default = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            names += config_field_names(type(default))
        else:
            names.append(f.name)
    return names


def test_engine_reference_names_every_engine_argument():
    from workbench.config import EngineConfig
    text = (DOCS / "engine.md").read_text(encoding="utf-8")
    names = config_field_names(EngineConfig)
    assert names, "EngineConfig has no fields?"
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, ("docs/engine.md does not document these EngineConfig fields (as "
                         "`name`): " + ", ".join(missing))


def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines, at most {README_MAX_LINES}: "
                                       "move reference material into docs/")


@pytest.mark.parametrize("pattern", DEV_LOG)
def test_no_development_log(pattern):
    regex = re.compile(pattern, re.IGNORECASE)
    hits = [f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
            for page in pages()
            for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
            if regex.search(line)]
    assert not hits, (f"development-log phrase /{pattern}/: say what the software does and why, "
                      "in the present tense, or link the results file\n" + "\n".join(hits))


def test_performance_page_keeps_the_generated_block_markers():
    lines = (DOCS / "performance.md").read_text(encoding="utf-8").splitlines()
    begin, end = "<!-- results-table:begin -->", "<!-- results-table:end -->"
    assert lines.count(begin) == 1 and lines.count(end) == 1, \
        "docs/performance.md needs each results-table marker once, on a line of its own"
    assert lines.index(begin) < lines.index(end), "results-table:begin must come before :end"
