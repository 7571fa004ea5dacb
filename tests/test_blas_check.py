"""The host check before the tree stage (clustering.blas) and the node fits' GEMM backends
(clustering.gemm): the kernel FAISS's OpenBLAS runs is named, a fallback kernel is reported with its
figure and the fix, `dask.blas=force` fixes it for the pipeline's workers, and every GEMM backend
builds the same tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from memtree.clustering import blas, gemm
from memtree.clustering.tree import build_tree

WANT = blas.safe_coretype(blas.cpu_flags()[1])
needs_avx2 = pytest.mark.skipif(
    WANT is None, reason="a CPU without AVX2 has no fallback OpenBLAS kernel"
)


def _check_in_subprocess(mode: str, env: dict[str, str]) -> dict:
    """check_host in a fresh interpreter (OpenBLAS reads OPENBLAS_CORETYPE once, at load)."""
    code = (
        "import json, os; from memtree.clustering.blas import check_host; "
        f"r = check_host(mode={mode!r}); "
        "r['env_after'] = os.environ.get('OPENBLAS_CORETYPE'); print(json.dumps(r))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_probe_names_each_blas_kernel_and_its_speed():
    env = {
        k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
    }
    r = blas.probe_subprocess(env)
    owners = {lib["owner"]: lib for lib in r["libraries"]}
    assert "faiss" in owners and "numpy" in owners, r["libraries"]
    assert r["faiss_kernel"] == owners["faiss"]["architecture"] and r["faiss_kernel"]
    assert r["faiss_search_gflops"] > 0 and r["sgemm_gflops"] > 0
    g = r["gemm"]
    assert set(g["gflops"]) == {"numpy", "torch", "faiss"} and g["threads"] == 1
    assert all(e < 1e-5 for e in g["max_rel_error"].values())
    fits = g["fits"]  # the choice rests on timed node fits, one per backend
    assert set(fits["seconds"]) == {"numpy", "torch", "faiss"} and all(
        v > 0 for v in fits["seconds"].values()
    )
    assert (
        g["choice"] == fits["choice"] == gemm.choose({k: 1 / v for k, v in fits["seconds"].items()})
    )


@needs_avx2
def test_a_fallback_kernel_is_reported_with_its_figure_and_the_fix():
    env = dict(os.environ, OPENBLAS_CORETYPE="Prescott")
    r = _check_in_subprocess("fix", env)
    # the environment's choice is left alone, and said to be a fallback, with the figure and the fix
    assert r["faiss_kernel"] == "Prescott" and r["fallback"] and r["action"] == "none"
    assert r["env_after"] == "Prescott"
    msg = r["message"]
    assert (
        msg.startswith("WARNING BLAS") and "Prescott" in msg and f"OPENBLAS_CORETYPE={WANT}" in msg
    )
    assert f"{r['faiss_gflops']} GFLOP/s" in msg
    forced = _check_in_subprocess("force", env)
    assert forced["action"] == f"set OPENBLAS_CORETYPE={WANT}" and forced["env_after"] == WANT
    assert not forced["fallback"] and forced["faiss_kernel"].lower() in blas.FAST_KERNELS
    assert forced["before"]["faiss_kernel"] == "Prescott"
    assert forced["faiss_gflops"] > forced["before"]["faiss_search_gflops"]
    assert "replacing the environment's Prescott (dask.blas=force)" in forced["message"]
    warn = _check_in_subprocess("warn", env)
    assert warn["action"] == "none" and "dask.blas=warn" in warn["message"]


def test_no_fallback_no_change():
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    r = _check_in_subprocess("fix", env)
    if r["fallback"] or r.get(
        "before"
    ):  # "before": the fix replaced a fallback this host's FAISS picked itself
        pytest.skip(
            "this host's FAISS runs a fallback kernel itself "
            f"({(r.get('before') or r)['faiss_kernel']})"
        )
    assert r["action"] == "none" and r["env_after"] is None and r["message"].startswith("BLAS: ")


def test_every_gemm_backend_builds_the_same_tree():
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((24, 48)).astype(np.float32)
    x = (centres[rng.integers(24, size=6000)] + 0.6 * rng.standard_normal((6000, 48))).astype(
        np.float32
    )
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ref_tree, ref_paths = build_tree(x, levels=2, branching=6, seed=0, gemm_backend="numpy")
    for name in ("torch", "faiss"):
        tree, paths = build_tree(x, levels=2, branching=6, seed=0, gemm_backend=name)
        assert (paths == ref_paths).all(), name
        for a, b in zip(tree.centroids, ref_tree.centroids, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_the_library_and_the_pipeline_choose_the_gemm_the_same_way():
    """build_tree and build_tree_bottomup default to "auto", resolved by the function the pipeline
    falls back on (`resolve_gemm`, the host's timed and kept choice); the tree says what ran."""
    import inspect

    from memtree.clustering.blas import best_gemm, resolve_gemm
    from memtree.clustering.bottomup import build_tree_bottomup

    for builder in (build_tree, build_tree_bottomup):
        assert inspect.signature(builder).parameters["gemm_backend"].default == "auto"
    rng = np.random.default_rng(2)
    x = rng.standard_normal((600, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    tree, _ = build_tree(x, levels=2, branching=3, seed=0, n_jobs=2)
    assert tree.meta["gemm"] == resolve_gemm("auto", 2) == best_gemm(2) in gemm.BACKENDS
    tree, _ = build_tree_bottomup(x, levels=2, branching=3, seed=0)
    assert tree.meta["gemm"] == best_gemm(1)
    tree, _ = build_tree(x, levels=2, branching=3, seed=0, gemm_backend="torch")
    assert tree.meta["gemm"] == "torch"


@pytest.mark.parametrize("name", gemm.BACKENDS)
def test_matmul_takes_the_views_the_node_fits_pass(name):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((100, 63), dtype=np.float32)
    c = rng.standard_normal((5, 63), dtype=np.float32)
    out = np.zeros((100, 8), dtype=np.float32)
    onehot = np.eye(5, dtype=np.float32)[rng.integers(5, size=100)]
    sums = np.zeros((63, 8), dtype=np.float32)
    with gemm.using(name):
        gemm.matmul(x, c.T, out[:, :5])  # a transposed operand into a strided output
        gemm.matmul(x.T, onehot, sums[:, :5])
        one = np.zeros((1, 5), dtype=np.float32)
        gemm.matmul(x[:1], c.T, one)
    np.testing.assert_allclose(out[:, :5], x @ c.T, rtol=1e-5, atol=1e-5)
    assert not out[:, 5:].any()
    np.testing.assert_allclose(sums[:, :5], x.T @ onehot, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(one, x[:1] @ c.T, rtol=1e-5, atol=1e-5)


def test_an_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown GEMM backend 'blis'"), gemm.using("blis"):
        pass


def test_the_pipeline_records_the_check_in_its_tree_stage_and_report(pipeline_run):
    out, markers, _, _ = pipeline_run
    host = markers["tree"]["stats"]["host"]
    assert host["faiss_kernel"] and host["gemm"] in gemm.BACKENDS
    # the session's cluster was started by the test, not the pipeline: it can only warn
    assert host["action"] == "none"
    report = (out / "report" / "report.md").read_text()
    # tree.gemm defaults to auto: the fits ran on the choice kept for this host (this session's
    # cache)
    assert host["gemm_used"] == host["gemm"] == host["gemm_choice"]["choice"]
    assert host["gemm_choice"]["path"] == str(blas.choice_path())
    assert (
        "## BLAS" in report
        and host["message"] in report
        and f"**{host['gemm']}** (`tree.gemm`)" in report
    )
    assert json.loads((out / "report" / "report.json").read_text())["host"]["gemm"] == host["gemm"]


@pytest.mark.slow  # a pipeline with its own LocalCluster: ~60 s alone; .ci/run runs it
@needs_avx2
def test_force_fixes_the_kernel_for_the_pipelines_own_workers(tmp_path, monkeypatch):
    from memtree.config import load_config
    from memtree.pipeline.config import PipelineConfig
    from memtree.pipeline.corpus.topical import CorpusSpec, generate_corpus
    from memtree.pipeline.run import run_pipeline
    from tests.conftest import PIPELINE_OVERRIDES, write_jsonl

    corpus = write_jsonl(
        tmp_path / "c.jsonl", list(generate_corpus(CorpusSpec(n_docs=160, seed=5)))
    )
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Prescott")  # an image that pins the fallback
    cfg = load_config(
        PipelineConfig,
        {"out": str(tmp_path / "run"), "ingest": {"inputs": [str(corpus)]}},
        [*PIPELINE_OVERRIDES, "dask.blas=force", "dask.n_workers=1", "tree.gemm=auto"],
    )
    logs: list[str] = []
    markers = run_pipeline(cfg, until="tree", log=logs.append)
    host = markers["tree"]["stats"]["host"]
    assert (
        host["action"] == f"set OPENBLAS_CORETYPE={WANT}"
        and os.environ["OPENBLAS_CORETYPE"] == WANT
    )
    assert host["before"]["faiss_kernel"] == "Prescott" and not host["fallback"]
    # tree.gemm=auto: the check's timed choice
    assert host["gemm_used"] == host["gemm"] in gemm.BACKENDS
    assert any(
        m.startswith("[tree] BLAS: FAISS's OpenBLAS picked the fallback kernel Prescott")
        for m in logs
    )


def _fits(choice: str) -> dict:
    return {"choice": choice, "seconds": {"numpy": 1.0, choice: 0.5}, "threads": 1}


def test_the_gemm_choice_is_timed_once_per_host_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTREE_CACHE_DIR", str(tmp_path / "cache"))
    # the key below is the unset one's, whatever the host sets
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    path = tmp_path / "cache" / "gemm-choice.json"
    assert blas.choice_path() == path
    key = blas.host_key(1, {"faiss": "Zen", "numpy": "Zen"})
    first = blas.remember_choice(key, _fits("torch"))
    assert first["choice"] == "torch" and not first["stored"] and first["path"] == str(path)
    doc = json.loads(path.read_text())
    assert (
        doc["format"] == "memtree-gemm-choice"
        and doc["version"] == 1
        and doc["entries"][key]["choice"] == "torch"
    )
    # a later run on the host keeps the first timing, whatever it measures now
    again = blas.remember_choice(key, _fits("faiss"))
    assert (
        again["choice"] == "torch"
        and again["stored"]
        and again["measured_at"] == first["measured_at"]
    )
    # another caller count, another kernel or another OPENBLAS_CORETYPE is another host for the
    # choice
    assert blas.host_key(2, {"faiss": "Zen", "numpy": "Zen"}) != key
    assert blas.host_key(1, {"faiss": "Prescott", "numpy": "Zen"}) != key
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    assert blas.host_key(1, {"faiss": "Zen", "numpy": "Zen"}) != key
    monkeypatch.delenv("OPENBLAS_CORETYPE")
    assert blas.stored_choice(key)["choice"] == "torch"
    # a damaged file is named, with what to do
    path.write_text("{not json")
    with pytest.raises(
        ValueError, match=r"gemm-choice\.json: not a readable memtree-gemm-choice file.*delete it"
    ):
        blas.stored_choice(key)
    path.write_text(json.dumps({"format": "memtree-gemm-choice", "version": 9, "entries": {}}))
    with pytest.raises(ValueError, match="version 9, this memtree reads 1"):
        blas.stored_choice(key)


def test_best_gemm_reads_the_kept_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTREE_CACHE_DIR", str(tmp_path))
    chosen = blas.best_gemm(1)  # timed (nothing kept yet) and kept
    assert chosen in gemm.BACKENDS
    doc = json.loads(blas.choice_path().read_text())
    ((key, entry),) = doc["entries"].items()
    assert entry["choice"] == chosen and set(entry["seconds"]) == set(gemm.available())
    # what is kept is what is used: two different kept choices, each returned (a timing could give
    # only one)
    for other in ("faiss", "torch"):
        doc["entries"][key]["choice"] = other
        blas.choice_path().write_text(json.dumps(doc))
        assert blas.best_gemm(1) == other
