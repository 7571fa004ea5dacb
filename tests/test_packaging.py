"""memtree installs cleanly beside its dependencies and exposes one CLI."""

import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np


def test_top_level_kernels_package_does_not_confuse_transformers():
    # transformers probes for an unrelated hub package named `kernels`; ours must not be taken for it.
    from transformers.utils import import_utils

    import kernels  # noqa: F401  (ours, importable)

    assert not import_utils.is_kernels_available()
    from transformers import AutoModel

    from clustering.embed import default_model_path, embed_texts, load_embedder

    AutoModel.from_pretrained(default_model_path(), local_files_only=True)
    m = load_embedder(None, device="cpu", max_seq_length=64)
    e = embed_texts(m, ["a star orbits a galaxy", "bake the dough in the oven"])
    assert e.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)


def test_mean_strategy_covers_the_whole_window():
    from clustering.embed import embed_texts, load_embedder

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
    r = subprocess.run([sys.executable, "-m", "memtree", "--help"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0 and "pipeline" in r.stdout and "demo" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "memtree", "pipeline", f"out={tmp_path / 'r'}", "tree.levelz=2"],
        capture_output=True, text=True, check=False,
    )
    assert r.returncode == 1 and "tree.levelz" in r.stderr


def test_package_data_ships_every_stage_config():
    # Each stage keeps its YAMLs in <stage>/yamls/, a data folder rather than a package: a wheel
    # carries them only if pyproject.toml's package-data patterns name them.
    repo = Path(__file__).resolve().parents[1]
    table = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    missing = []
    for folder in sorted(repo.glob("*/yamls")):
        pkg = folder.parent
        shipped = {f for pat in [*table.get("*", []), *table.get(pkg.name, [])] for f in pkg.glob(pat)}
        missing += [str(f.relative_to(repo)) for f in folder.rglob("*") if f.is_file() and f not in shipped]
    assert not missing, f"not in pyproject.toml's package-data: {missing}"
