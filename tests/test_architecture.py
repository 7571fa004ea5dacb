"""The import table of docs/ARCHITECTURE.md holds for the code: imports only flow downward.

The table's "may import" column is parsed from the document itself, so the documented layering
and the code cannot drift apart silently: an import the table does not allow fails here, naming
the file and line, and so does a table row for a package that no longer exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCH = REPO / "docs" / "ARCHITECTURE.md"


def _table() -> dict[str, set[str]]:
    """{package: packages it may import}, from the "Packages and their jobs" table."""
    text = ARCH.read_text()
    section = text.split("## Packages and their jobs", 1)[1].split("\n## ", 1)[0]
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        m = re.match(r"^\| `(\w+)` \|.*\| ([^|]*) \|\s*$", line)
        if not m:
            continue
        cell = m.group(2).strip()
        # "pipeline (demo, context recall)": the parenthesis says why, the first word is the package
        cell = re.sub(r"\([^)]*\)", "", cell)
        allowed[m.group(1)] = {w.strip() for w in cell.split(",") if w.strip() and w.strip() != "—"}
    return allowed


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every absolute import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


TABLE = _table()


def test_table_lists_every_package_and_only_packages():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench"}
    assert set(TABLE) == packages, (
        f"docs/ARCHITECTURE.md's package table lists {sorted(TABLE)}, the repository has {sorted(packages)}")
    for pkg, deps in TABLE.items():
        assert deps <= set(TABLE), f"{pkg} may import unknown packages {sorted(deps - set(TABLE))}"


@pytest.mark.parametrize("package", sorted(TABLE))
def test_imports_flow_downward(package):
    project = set(TABLE)
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, mod in _imports(path):
            if mod in project and mod != package and mod not in TABLE[package]:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {mod}")
    assert not bad, (f"{package} may import only {sorted(TABLE[package]) or 'nothing'} "
                     f"(docs/ARCHITECTURE.md):\n" + "\n".join(bad))


def test_table_is_acyclic():
    seen: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(pkg: str, path: list[str]) -> None:
        if seen.get(pkg) == 1:
            raise AssertionError("import cycle in docs/ARCHITECTURE.md: " + " -> ".join(path + [pkg]))
        if seen.get(pkg) == 2:
            return
        seen[pkg] = 1
        for dep in sorted(TABLE[pkg]):
            visit(dep, path + [pkg])
        seen[pkg] = 2

    for pkg in sorted(TABLE):
        visit(pkg, [])


def test_bench_scripts_cannot_shadow_a_package():
    """`python bench/X.py` puts bench/ first on sys.path: a bench/pipeline.py would hide the package."""
    shadowing = sorted(p.name for p in (REPO / "bench").glob("*.py") if p.stem in TABLE)
    assert not shadowing, f"bench scripts named like project packages: {shadowing}"
