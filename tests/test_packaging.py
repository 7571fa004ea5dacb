"""memtree installs cleanly beside its dependencies and exposes one CLI."""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from memtree import STAGES

REPO = Path(__file__).resolve().parents[1]


def test_top_level_kernels_package_does_not_confuse_transformers():
    # transformers probes for an unrelated hub package named `kernels`; ours must not be taken for
    # it.
    from transformers.utils import import_utils

    import memtree.kernels  # noqa: F401  (ours, importable)

    assert not import_utils.is_kernels_available()
    from transformers import AutoModel

    from memtree.clustering.embed import default_model_path, embed_texts, load_embedder

    AutoModel.from_pretrained(default_model_path(), local_files_only=True)
    m = load_embedder(None, device="cpu", max_seq_length=64)
    e = embed_texts(m, ["a star orbits a galaxy", "bake the dough in the oven"])
    assert e.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)


def test_mean_strategy_covers_the_whole_window():
    from memtree.clustering.embed import embed_texts, load_embedder

    m = load_embedder(None, device="cpu", max_seq_length=32)
    head = "The telescope observed a distant nebula. " * 6
    a = "Sourdough bread needs flour, water and patience. " * 12
    t = embed_texts(m, [head + a, head], strategy="truncate")
    mean = embed_texts(m, [head + a, head], strategy="mean")
    # Truncation sees only the first 32 word pieces: both texts embed the same.
    assert np.allclose(t[0], t[1], atol=1e-5)
    assert not np.allclose(mean[0], mean[1], atol=1e-3)
    np.testing.assert_allclose(np.linalg.norm(mean, axis=1), 1.0, rtol=1e-5)


def test_cli_lists_subcommands_and_names_bad_input(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "memtree", "--help"], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0 and "pipeline" in r.stdout and "demo" in r.stdout
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "memtree",
            "pipeline",
            "run",
            f"out={tmp_path / 'r'}",
            "tree.levelz=2",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 1 and "tree.levelz" in r.stderr


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_package_data_ships_every_stage_config():
    # Each stage keeps its YAMLs in <stage>/yamls/, a data folder rather than a package: a wheel
    # carries them only if pyproject.toml's package-data patterns name them.
    table = _setuptools()["package-data"]
    missing = []
    for folder in sorted(REPO.glob("*/yamls")):
        pkg = folder.parent
        pats = [*table.get("*", []), *table.get(f"memtree.{pkg.name}", [])]
        shipped = {f for pat in pats for f in pkg.glob(pat)}
        missing += [
            str(f.relative_to(REPO)) for f in folder.rglob("*") if f.is_file() and f not in shipped
        ]
    assert not missing, f"not in pyproject.toml's package-data: {missing}"


def _folders_to_ship() -> set[str]:
    """memtree.<dotted> of every folder of memtree/ and the stages that holds a module or data."""
    out = set()
    for top in ("memtree", *STAGES):
        for d in [REPO / top, *(p for p in (REPO / top).rglob("*") if p.is_dir())]:
            if d.name == "__pycache__" or not any(
                f.is_file() and f.suffix in (".py", ".yaml", ".json", ".jsonl") for f in d.iterdir()
            ):
                continue
            rel = d.relative_to(REPO).parts
            out.add(".".join(rel) if top == "memtree" else ".".join(("memtree", *rel)))
    return out


def test_pyproject_lists_every_package_under_the_one_namespace():
    """pyproject.toml names each package (the stages map under memtree, which find cannot do):
    a folder added on disk and not listed would be missing from the wheel."""
    cfg = _setuptools()
    assert set(cfg["packages"]) == _folders_to_ship()
    assert cfg["package-dir"] == {f"memtree.{s}": s for s in sorted(STAGES)}


def _site_packages(venv: Path) -> Path:
    return next(venv.glob("lib/python*/site-packages"))


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """A fresh venv with the wheel built from this tree installed (no dependencies: those come from
    this environment as plain path lines) → (venv, its site-packages, the folders added)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    # built from a copy of what the wheel is made of: setuptools' build/ folder in the checkout
    # would carry files of an earlier build (a module since moved) into this one
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    for top in ("memtree", *STAGES):
        shutil.copytree(REPO / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("memtree-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    before = {p.name for p in _site_packages(venv).iterdir()}
    r = subprocess.run(
        [
            venv / "bin" / "python",
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    site = _site_packages(venv)
    added = {p.name for p in site.iterdir()} - before
    # the dependencies come from this environment (a path line: its own .pth files, among them the
    # editable install of this checkout, are not read), so nothing is downloaded
    deps = [p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir()]
    (site / "zz-memtree-test-deps.pth").write_text("\n".join(map(str, deps)) + "\n")
    return venv, site, added


def _user_folder(tmp_path: Path) -> Path:
    """A user's working folder holding their own eval.py, training/ and kernels.py, which no
    memtree import may pick up."""
    user = tmp_path / "user"
    (user / "training").mkdir(parents=True)
    (user / "training" / "__init__.py").write_text(
        "raise ImportError('the user training/ was imported')\n"
    )
    (user / "eval.py").write_text("raise ImportError('the user eval.py was imported')\n")
    (user / "kernels.py").write_text("raise ImportError('the user kernels.py was imported')\n")
    return user


def test_the_wheel_installs_one_import_name(wheel_venv, tmp_path):
    """A wheel built from this tree, installed into a fresh venv, adds `memtree` and nothing else
    that can be imported; every stage imports from it and `memtree --help` runs, even from a folder
    holding a user's own eval.py, training/ and kernels.py."""
    venv, site, added = wheel_venv
    assert {n for n in added if not n.endswith(".dist-info") and n != "__pycache__"} == {
        "memtree"
    }, added
    assert (next(site.glob("memtree-*.dist-info")) / "top_level.txt").read_text().split() == [
        "memtree"
    ]
    user = _user_folder(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = (
        "import importlib, sys\n"
        f"stages = {[f'memtree.{s}' for s in STAGES]!r}\n"
        "mods = [importlib.import_module(m) for m in stages + ['memtree.training.model', "
        "'memtree.eval.cli',"
        " 'memtree.kernels.memory_attention', 'memtree.pipeline.corpus', 'memtree.memstore.cli']]\n"
        "print('\\n'.join(m.__file__ for m in mods))\n"
    )
    r = subprocess.run(
        [venv / "bin" / "python", "-c", code],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    files = r.stdout.split()
    assert len(files) == len(STAGES) + 5 and all(
        f.startswith(str(site / "memtree")) for f in files
    ), files
    assert (site / "memtree" / "eval" / "yamls" / "tasks").is_dir()
    r = subprocess.run(
        [venv / "bin" / "memtree", "--help"],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pipeline" in r.stdout and "demo" in r.stdout and "memstore" in r.stdout


@pytest.mark.parametrize("launcher", ["composer", "torchrun"])
def test_two_ranks_launch_from_the_installed_wheel(wheel_venv, pipeline_run, tmp_path, launcher):
    """`composer -n 2 -m memtree.training.train …` and `torchrun --nproc-per-node 2 -m …`, run by
    the wheel's venv from a user's folder (its own training/ and eval.py there): both ranks train
    from the installed package, and no stage folder is on their sys.path."""
    venv, site, _ = wheel_venv
    user = _user_folder(tmp_path)
    out = tmp_path / "ddp"
    probe = user / "probe.yaml"  # a config of the user's own, next to the decoys
    probe.write_text(
        f"data:\n  shards: {pipeline_run[0] / 'shards'}\n  batch_size: 4\nmax_duration: 2ba\n"
        f"mode: scratch\nsave_folder: {out}\nmemory:\n  multipliers: [8, 4]\n"
        "model:\n  shape: {n_layers: 1, d_model: 32, n_heads: 1, head_dim: 32, ffn_dim: 64}\n"
    )
    head = (
        ["-m", "composer.cli.launcher", "-n", "2"]
        if launcher == "composer"
        else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK")}
    r = subprocess.run(
        [venv / "bin" / "python", *head, "-m", "memtree.training.train", str(probe)],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    from memtree.memstore.format import verify_bank

    assert verify_bank(out / "bank")["levels"] == [1, 2]
    # The venv reads no .pth of this environment's (its dependencies are path lines), and the user's
    # folder, first on a -m launch's sys.path, holds no memtree: the only one the ranks could import
    # is the wheel's. The same interpreter from the same folder says where that is.
    code = (
        "import sys\n"
        "import memtree.training.train as t; print(t.__file__)\n"
        "print(any(p.endswith('training') for p in sys.path))\n"
    )
    r = subprocess.run(
        [venv / "bin" / "python", "-c", code],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    where, stage_on_path = r.stdout.split()
    assert where == str(site / "memtree" / "training" / "train.py") and stage_on_path == "False"


def test_a_source_checkout_imports_its_stages_without_an_install(tmp_path):
    """`PYTHONPATH=<checkout>` with no install (how bench/device/device_check.py runs on a machine
    with no package index) finds memtree.<stage> in the folders beside memtree/. `-S` keeps site's
    .pth files, among them this checkout's editable install, out; the dependencies come as plain
    paths."""
    deps = [str(p) for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir()]
    env = dict(
        {k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        PYTHONPATH=os.pathsep.join([str(REPO), *deps]),
    )
    code = (
        "import sys, memtree.training.model as m, memtree.eval.cli as c, "
        "memtree.kernels.ffn_memory as k\n"
        "assert not any('editable' in type(f).__module__ for f in sys.meta_path), sys.meta_path\n"
        "print(m.__file__, c.__file__, k.__file__)\n"
    )
    r = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [
        str(REPO / "training" / "model.py"),
        str(REPO / "eval" / "cli.py"),
        str(REPO / "kernels" / "ffn_memory" / "__init__.py"),
    ]


def test_a_second_checkout_on_pythonpath_uses_its_own_stages(tmp_path):
    """With this checkout installed editable, another copy of the source on PYTHONPATH imports
    the stages beside its own memtree/, not the installed checkout's."""
    copy = tmp_path / "copy"
    for top in ("memtree", *STAGES):
        shutil.copytree(REPO / top, copy / top, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict({k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, PYTHONPATH=str(copy))
    code = (
        "import memtree, memtree.training.model as m, memtree.eval as e; "
        "print(memtree.__file__, m.__file__, e.__file__)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [
        str(copy / "memtree" / "__init__.py"),
        str(copy / "training" / "model.py"),
        str(copy / "eval" / "__init__.py"),
    ]
