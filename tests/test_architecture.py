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
# the stage folders, installed as memtree.<stage> (pyproject.toml's package-dir)
STAGES = ("pipeline", "clustering", "memstore", "training", "kernels", "eval")


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


def _local(name: str) -> str:
    """A module's name inside the repository: `memtree.training.hf` is `training.hf` (the
    folder it lives in); the bottom layer's modules keep theirs (`memtree.io`)."""
    head, _, rest = name.partition(".")
    if head == "memtree" and rest and rest.split(".")[0] in STAGES:
        return rest
    return name


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, package) of every absolute import in the file, at any depth: the stage folder a
    `memtree.<stage>` import reaches, else the top-level module (`memtree`, `torch`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, _local(a.name).split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "memtree":
                out += [
                    (node.lineno, a.name if a.name in STAGES else "memtree") for a in node.names
                ]
            else:
                out.append((node.lineno, _local(node.module).split(".")[0]))
    return out


TABLE = _table()


def test_table_lists_every_package_and_only_packages():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench"}
    assert set(TABLE) == packages, (
        f"docs/ARCHITECTURE.md's package table lists {sorted(TABLE)}, the repository has "
        f"{sorted(packages)}"
    )
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
    assert not bad, (
        f"{package} may import only {sorted(TABLE[package]) or 'nothing'} "
        f"(docs/ARCHITECTURE.md):\n" + "\n".join(bad)
    )


def test_table_is_acyclic():
    seen: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(pkg: str, path: list[str]) -> None:
        if seen.get(pkg) == 1:
            raise AssertionError(
                "import cycle in docs/ARCHITECTURE.md: " + " -> ".join(path + [pkg])
            )
        if seen.get(pkg) == 2:
            return
        seen[pkg] = 1
        for dep in sorted(TABLE[pkg]):
            visit(dep, path + [pkg])
        seen[pkg] = 2

    for pkg in sorted(TABLE):
        visit(pkg, [])


def test_bench_scripts_cannot_shadow_a_package():
    """A script run by its path (`python bench/<topic>/X.py`) puts its folder first on sys.path: a
    bench/<topic>/memtree.py would hide the one import name the project installs (its stages are
    memtree.<stage>, which no script can hide)."""
    shadowing = sorted(p.name for p in (REPO / "bench").rglob("*.py") if p.stem == "memtree")
    assert not shadowing, f"bench scripts named like the project's import name: {shadowing}"


def _bare_stage_imports(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, name) of every absolute import of a stage by its folder's name (`import training`,
    `from eval.x import y`) rather than through the namespace (`memtree.training`)."""
    out = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            else []
        )
        out += [(node.lineno, n) for n in names if n.split(".")[0] in STAGES]
    return out


def test_every_stage_is_imported_through_the_memtree_namespace():
    """The stages install as memtree.<stage> only. Run from the repository's root, a bare
    `import training` would still resolve (the folder is on sys.path there) and load a second copy
    of the module, so nothing here would fail, while the installed wheel has no such name."""
    files = [
        p
        for top in (*STAGES, "memtree", "tests", "bench")
        for p in sorted((REPO / top).rglob("*.py"))
    ]
    assert len(files) > 200
    bad = [
        f"{p.relative_to(REPO)}:{line} imports {name}"
        for p in files
        for line, name in _bare_stage_imports(p.read_text(), str(p))
    ]
    assert not bad, "import these as memtree.<stage>:\n" + "\n".join(bad)
    assert _bare_stage_imports(
        "import eval.cli\nfrom kernels import x\nfrom memtree.eval import y\n"
        "import memtree.training\n"
    ) == [(1, "eval.cli"), (2, "kernels")]


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(source: str, me: str, project: set[str]) -> list[tuple[int, str]]:
    """(line, module.name) of every `_name` (not dunder) of another project module that the
    source of module `me` imports by name or reaches as an attribute of an imported module."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the project module or object it stands for
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and _local(node.module).split(".")[0] in project
        ):
            module = _local(node.module)
            for a in node.names:
                if _private(a.name) and module != me:
                    out.append((node.lineno, f"{module}.{a.name}"))
                bound[a.asname or a.name] = _local(f"{node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _local(a.name).split(".")[0] in project:
                    # `import memtree.training.hf as hf` binds hf; without `as`, the name bound is
                    # memtree, whose attributes are stages, not a module's private names
                    bound[a.asname or a.name.split(".")[0]] = (
                        _local(a.name) if a.asname else a.name.split(".")[0]
                    )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and bound.get(node.value.id, me) != me
        ):
            out.append((node.lineno, f"{bound[node.value.id]}.{node.attr}"))
    return sorted(out)


@pytest.mark.parametrize("package", sorted(TABLE) + ["bench"])
def test_no_module_uses_another_modules_private_names(package):
    """A `_name` is its module's own: a helper another module needs is made public where it
    lives (issue #39 found such back-doors, which the import table cannot see). The benchmark
    scripts are held to it too; their own helper modules (`bench.common`, `bench.<topic>.<module>`)
    are bench's."""
    found = [
        f"{path.relative_to(REPO)}:{line} uses {name}"
        for path in sorted((REPO / package).rglob("*.py"))
        for line, name in _private_uses(path.read_text(), _module(path), set(TABLE))
    ]
    assert not found, "\n".join(found)


def test_the_private_name_check_sees_both_forms():
    """The check above fails on the two forms it looks for, and passes a module's own names."""
    source = (
        "from memtree.training.hf import _secret, load_hf_causal_lm\n"
        "import memtree.memstore.store as st\n"
        "from memtree.training import model\n"
        "st._ranges([1]); model._gain_norm; model.__name__\n"
    )
    assert _private_uses(source, "training.x", set(TABLE)) == [
        (1, "training.hf._secret"),
        (4, "memstore.store._ranges"),
        (4, "training.model._gain_norm"),
    ]
    assert (
        _private_uses("from memtree.training.hf import _secret\n", "training.hf", set(TABLE)) == []
    )


def _import_graph(project: set[str]) -> dict[str, set[str]]:
    """{module: the project modules it imports, at any depth (function-level too)}. `from pkg
    import sub` of a submodule depends on the submodule, not on the package's __init__."""
    mods = {_module(p): p for pkg in project for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                module = _local(node.module)
                subs = {_local(f"{node.module}.{a.name}") for a in node.names} & mods.keys()
                deps |= subs
                if module in mods and len(subs) < len(node.names):
                    deps.add(module)
            elif isinstance(node, ast.Import):
                deps |= {_local(a.name) for a in node.names} & mods.keys()
        graph[name] = deps - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    """No two modules import each other, however indirectly, not even from inside a function
    (memstore.format and memstore.locking did, until write_bank moved to memstore.writer)."""
    assert _cycles(_import_graph(set(TABLE))) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# each stage's sub-packages that belong to its core; every other sub-package is a system's folder
CORE_FOLDERS = {"training": {"callbacks", "generate", "layers"}, "memstore": {"sim"}, "eval": set()}


def _systems(stage: str) -> list[str]:
    return sorted(
        p.parent.name
        for p in (REPO / stage).glob("*/__init__.py")
        if p.parent.name not in CORE_FOLDERS[stage]
    )


SYSTEMS = _systems("training")


def _stage_imports(source: str, stage: str) -> list[tuple[int, str]]:
    """(line, stage.X) of every import of one of the stage's sub-modules or sub-packages."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = _local(node.module)
            names = [module] if module != stage else [f"{stage}.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names if n.startswith(f"{stage}.")]
        elif isinstance(node, ast.Import):
            out += [
                (node.lineno, _local(a.name))
                for a in node.names
                if _local(a.name).startswith(f"{stage}.")
            ]
    return out


def _training_imports(source: str) -> list[tuple[int, str]]:
    return _stage_imports(source, "training")


def _system_of(module: str, systems: list[str] = SYSTEMS) -> str | None:
    part = module.split(".")[1]
    return part if part in systems else None


def _core_imports_of_systems(stage: str) -> list[str]:
    """Imports of a system folder by the stage's core, or by another system's folder."""
    systems = _systems(stage)
    bad = []
    for path in sorted((REPO / stage).rglob("*.py")):
        rel = path.relative_to(REPO / stage).parts
        mine = rel[0] if len(rel) > 1 and rel[0] in systems else None
        for line, mod in _stage_imports(path.read_text(), stage):
            other = _system_of(mod, systems)
            if other is not None and other != mine:
                who = f"system {mine}/" if mine else "the core"
                bad.append(f"{stage}/{'/'.join(rel)}:{line} ({who}) imports {mod}")
    return bad


def test_training_core_never_imports_a_system():
    """training/'s core (its top-level modules, callbacks/, layers/) imports no system folder,
    and no system folder imports another: a system can be read or removed without touching the
    trainer. The folders are read off the disk, so a new one is covered at once."""
    assert {"finetune", "context", "camelot"} <= set(SYSTEMS), SYSTEMS
    bad = _core_imports_of_systems("training")
    assert not bad, "\n".join(bad)


def test_memstore_core_never_imports_a_system():
    """memstore/'s core (the bank, its store and tools, sim/) imports no system's store
    (camelot/: CAMELoT's associative memory; context/: the context bank), and neither imports
    the other, as in training/."""
    assert {"camelot", "context"} <= set(_systems("memstore")), _systems("memstore")
    bad = _core_imports_of_systems("memstore")
    assert not bad, "\n".join(bad)


def test_eval_core_never_imports_a_system():
    """eval/'s core (the paper's experiments, the demo, the scorers, its cli.py) imports no
    system's experiment (camelot/, context/, finetune/: each registers its own commands), and no
    system folder imports another."""
    assert {"camelot", "context", "finetune"} <= set(_systems("eval")), _systems("eval")
    bad = _core_imports_of_systems("eval")
    assert not bad, "\n".join(bad)


def test_the_system_check_sees_an_import():
    """The check above finds both import forms of a system module."""
    tree = (
        "from memtree.training.finetune.lora import add_lora\nimport memtree.training.context.vae\n"
        "from memtree.training import camelot\n"
    )
    found = [m for _, m in _training_imports(tree)]
    assert found == ["training.finetune.lora", "training.context.vae", "training.camelot"]
    assert [_system_of(m) for m in found] == ["finetune", "context", "camelot"]
    assert _system_of("training.layers.moc") is None and _system_of("training.model") is None


def test_the_trainer_never_imports_generation():
    """training/generate/ (running what a run trained) sits on the model and the store; nothing
    else in training/ imports it, so the trainer stays free of inference code."""
    bad = []
    for path in sorted((REPO / "training").rglob("*.py")):
        rel = path.relative_to(REPO / "training").parts
        if rel[0] == "generate":
            continue
        bad += [
            f"{path.relative_to(REPO)}:{line} imports {mod}"
            for line, mod in _training_imports(path.read_text())
            if mod.startswith("training.generate")
        ]
    assert bad == []
