"""The benchmark records hold together: docs/BENCHMARKS.md is the "Figures now" page and the index
of the campaign files under docs/benchmarks/, every relative link in the repository's markdown
lands on a file and a heading, headings name scripts that exist, and every Figures-now row links
to the campaign section that measured it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "BENCHMARKS.md"
CAMPAIGNS = ROOT / "docs" / "benchmarks"
FILE_LINK = re.compile(r"\]\(([^)\s]+)\)")
CAMPAIGN_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md$")

HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$")
SCRIPT = re.compile(r"bench/[\w./-]+?\.py")
RUN_AS = re.compile(r"\brun as\s+`?$")
LINK = re.compile(r"\]\(#([^)\s]*)\)")
SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def github_anchor(text: str) -> str:
    """GitHub's heading anchor: the rendered text lowercased, every character but letters,
    digits, '_', '-' and spaces dropped, spaces turned into '-' (unicode letters kept)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(lines: list[str]) -> list[tuple[int, int, str]]:
    """(line number, level, text) of every ATX heading outside fenced code blocks."""
    out, fence = [], None
    for i, line in enumerate(lines, 1):
        m = re.match(r"^\s{0,3}(`{3,}|~{3,})", line)
        if m:
            mark = m.group(1)[0]
            if fence is None:
                fence = mark
            elif fence == mark:
                fence = None
            continue
        if fence is None:
            h = HEADING.match(line)
            if h:
                out.append((i, len(h.group(1)), h.group(2)))
    return out


def anchors(lines: list[str]) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2, ... suffixes on repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    for _, _, text in headings(lines):
        base = github_anchor(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def missing_scripts(lines: list[str], root: Path) -> list[str]:
    """`bench/*.py` named in a heading that is not in the repository; a historical name is
    allowed only right after the words "run as"."""
    bad = []
    for i, _, text in headings(lines):
        for m in SCRIPT.finditer(text):
            if RUN_AS.search(text[: m.start()]):
                continue
            if not (root / m.group(0)).is_file():
                bad.append(f"line {i}: {m.group(0)} in {text!r}")
    return bad


def broken_links(lines: list[str]) -> list[str]:
    known = anchors(lines)
    return [
        f"line {i}: #{a}"
        for i, line in enumerate(lines, 1)
        for a in LINK.findall(line)
        if a not in known
    ]


def broken_file_links(path: Path, root: Path) -> list[str]:
    """Relative links in one markdown file whose file is missing, or whose anchor names no
    heading of the markdown file it points at (URLs with a scheme are not followed)."""
    bad, cache = [], {}
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for target in FILE_LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path.resolve()
            if not dest.exists():
                bad.append(f"{path.relative_to(root)}:{i}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest.read_text(encoding="utf-8").splitlines())
                if anchor not in cache[dest]:
                    bad.append(f"{path.relative_to(root)}:{i}: {target} (no such heading)")
    return bad


def markdown_files(root: Path) -> list[Path]:
    """The repository's own markdown: everything but virtual environments, runs and caches."""
    skip = {
        ".venv",
        "runs",
        ".git",
        "node_modules",
        ".pytest_cache",
        ".ruff_cache",
        "build",
        "dist",
    }
    return sorted(
        p
        for p in root.rglob("*.md")
        if not skip.intersection(p.relative_to(root).parts[:-1])
        and not any(part.endswith(".egg-info") for part in p.relative_to(root).parts)
    )


def figures_now(lines: list[str]) -> list[str]:
    """The lines of the "## Figures now" section, up to the next level-2 heading."""
    start = next(i for i, line in enumerate(lines) if line.rstrip() == "## Figures now")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def table_rows(lines: list[str]) -> list[str]:
    """Body rows of the markdown tables in lines (header and separator rows left out)."""
    rows = []
    for i, line in enumerate(lines):
        if not line.startswith("|") or SEPARATOR.match(line):
            continue
        if i + 1 < len(lines) and SEPARATOR.match(lines[i + 1]):
            continue  # a header row
        rows.append(line)
    return rows


def unlinked_rows(lines: list[str]) -> list[str]:
    return [row for row in table_rows(figures_now(lines)) if not LINK.search(row)]


@pytest.fixture(scope="module")
def doc() -> list[str]:
    return DOC.read_text(encoding="utf-8").splitlines()


def campaign_files() -> list[Path]:
    return sorted(CAMPAIGNS.glob("*.md"))


def test_benchmarks_md_is_the_figures_page_and_the_index(doc):
    assert len(doc) < 200, (
        f"docs/BENCHMARKS.md has {len(doc)} lines; dated sections go to docs/benchmarks/"
    )
    first = next(text for _, level, text in headings(doc) if level == 2)
    assert first == "Figures now"
    assert len(campaign_files()) >= 10
    text = "\n".join(doc)
    unlisted = [p.name for p in campaign_files() if f"](benchmarks/{p.name})" not in text]
    assert not unlisted, "campaign files missing from the index: " + ", ".join(unlisted)


def test_campaign_files_say_theme_machine_and_dates():
    bad = []
    for path in campaign_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        if not CAMPAIGN_NAME.match(path.name):
            bad.append(f"{path.name}: not named date-theme-machine.md")
        if not lines or not lines[0].startswith("# "):
            bad.append(f"{path.name}: does not open with a title")
        for field in ("**Theme:**", "**Machine:**", "**Dates:**"):
            if not any(line.startswith(f"- {field}") for line in lines[:12]):
                bad.append(f"{path.name}: no {field} line at the top")
    assert not bad, "\n".join(bad)


def test_scripts_named_in_headings_exist(doc):
    bad = missing_scripts(doc, ROOT)
    for path in campaign_files():
        bad += [
            f"{path.name} {b}"
            for b in missing_scripts(path.read_text(encoding="utf-8").splitlines(), ROOT)
        ]
    assert not bad, "headings name scripts that do not exist:\n" + "\n".join(bad)


def test_every_relative_markdown_link_resolves():
    files = markdown_files(ROOT)
    assert DOC in files and len(files) > 20
    bad = [b for path in files for b in broken_file_links(path, ROOT)]
    assert not bad, "links that land nowhere:\n" + "\n".join(bad)


def test_every_figures_now_row_links_to_its_campaign_section(doc):
    rows = table_rows(figures_now(doc))
    assert len(rows) >= 40
    bad = [row for row in rows if not re.search(r"\]\(benchmarks/[^)#\s]+\.md#[^)\s]+\)", row)]
    assert not bad, "Figures-now rows without a link to a campaign section:\n" + "\n".join(bad)


def test_the_checks_catch_what_they_are_for(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "real.py").write_text("")
    bad_doc = [
        "# Benchmarks",
        "",
        "## Figures now",
        "",
        "| Figure | Now | Detail |",
        "| --- | --- | --- |",
        "| a | 1 | [detail](#real-benchrealpy-run-as-bencholdpy) |",
        "| b | 2 | no link |",
        "| c | 3 | [detail](#no-such-heading) |",
        "",
        "## Real (bench/real.py; run as bench/old.py)",
        "",
        "## Gone (bench/old.py)",
        "",
        "### Twice",
        "### Twice",
        "[second](#twice-1) [third](#twice-2)",
    ]
    assert missing_scripts(bad_doc, tmp_path) == ["line 13: bench/old.py in 'Gone (bench/old.py)'"]
    assert broken_links(bad_doc) == ["line 9: #no-such-heading", "line 17: #twice-2"]
    assert unlinked_rows(bad_doc) == ["| b | 2 | no link |"]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Real one\n", encoding="utf-8")
    page = tmp_path / "docs" / "b.md"
    page.write_text(
        "[ok](a.md#real-one) [web](https://x.org/y.md#z) [img](../bench/real.py)\n"
        "[gone](a.md#no-such) [missing](c.md) [deep](../../bench/real.py)\n",
        encoding="utf-8",
    )
    assert broken_file_links(page, tmp_path) == [
        "docs/b.md:2: a.md#no-such (no such heading)",
        "docs/b.md:2: c.md (no such file)",
        "docs/b.md:2: ../../bench/real.py (no such file)",
    ]
    assert (
        github_anchor("Issue #37, fifth step (2026-11-28, 13:25–13:33 UTC): `x.y`")
        == "issue-37-fifth-step-2026-11-28-13251333-utc-xy"
    )
    assert (
        github_anchor("… and on the bios demo, 4× the facts") == "-and-on-the-bios-demo-4-the-facts"
    )
    assert github_anchor("`memtree eval --block-documents`") == "memtree-eval---block-documents"
