"""End to end on real Dask, MiniLM, FAISS and MDS: counts, shards, determinism, resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memtree.config import load_config
from memtree.pipeline.config import PipelineConfig
from memtree.pipeline.run import run_pipeline
from tests.conftest import PIPELINE_OVERRIDES, kill_when_ready

OVERRIDES = PIPELINE_OVERRIDES


@pytest.fixture(scope="module")
def corpus(pipeline_run):
    return pipeline_run[3]


@pytest.fixture(scope="module")
def run_a(pipeline_run):
    return pipeline_run[:3]


def _read_all(out: Path):
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    from memtree.pipeline.shards import open_streams

    clean_stale_shared_memory()
    ds = StreamingDataset(streams=open_streams(out / "shards"), shuffle=False, batch_size=1)
    return [ds[i] for i in range(len(ds))]


def test_end_to_end_counts(run_a, corpus_records):
    # Speed is measured in bench/pipeline/pipeline_stages.py, not asserted here.
    out, markers, _ = run_a
    rep = markers["report"]["stats"]
    assert rep["reconciled"]
    ing = markers["ingest"]["stats"]
    assert ing["records_in"] == len(corpus_records) == ing["kept"] + ing["rejected"]
    assert (out / "report" / "report.md").is_file() and (
        out / "report" / "cluster_sizes.png"
    ).is_file()


def test_every_window_in_exactly_one_sample_with_valid_paths(run_a):
    from memtree.clustering.tree import load_tree

    out, markers, _ = run_a
    tree = load_tree(out / "tree")
    n_windows = markers["window"]["stats"]["n_windows"]
    windows = pa.concat_tables(
        [pq.read_table(out / "window" / p["file"]) for p in markers["window"]["stats"]["parts"]]
    )
    tokens = windows["tokens"].to_pylist()
    seen = []
    eot = markers["tokenizer"]["stats"]["eot_id"]
    samples = _read_all(out)
    assert len(samples) == markers["shards"]["stats"]["n_samples"]
    for s in samples:
        path, wids, b, tok = s["path"], s["window_ids"], s["doc_bounds"], s["tokens"]
        assert len(tok) <= 512 and b[0] == 0 and b[-1] == len(tok) and len(b) == len(wids) + 1
        assert s["leaf"] == path[-1] and path[1] // 8 == path[0]
        assert all(tree.valid[lv][path[lv]] for lv in range(2))
        for j, w in enumerate(wids):
            seg = tok[b[j] : b[j + 1]]
            n = len(tokens[w])
            assert list(seg[:n]) == tokens[w]
            assert len(seg) == n or (len(seg) == n + 1 and seg[-1] == eot)
        seen.extend(wids.tolist())
    assert sorted(seen) == list(range(n_windows))
    # The assignment table and the samples agree on every window's path.
    assign = pa.concat_tables(
        [pq.read_table(p) for p in sorted((out / "assign").glob("part-*.parquet"))]
    )
    leaf = assign["leaf"].to_numpy()
    for s in samples[:50]:
        assert (leaf[s["window_ids"]] == s["leaf"]).all()


def test_query_time_routing_matches_training_assignment(run_a):
    from memtree.clustering.route import route_texts
    from memtree.clustering.tree import load_tree

    out, _, _ = run_a
    tree = load_tree(out / "tree")
    w = pq.read_table(out / "window" / "part-00000.parquet", columns=["text"])["text"].to_pylist()[
        :20
    ]
    a = pq.read_table(out / "assign" / "part-00000.parquet", columns=["path"])["path"].to_pylist()[
        :20
    ]
    got = route_texts(tree, w, device="cpu")
    assert got.tolist() == a


def test_topics_cluster_together(run_a):
    """The default corpus has real topical structure: level-1 clusters are domain-pure."""
    out, markers, _ = run_a
    docs = pa.concat_tables(
        [
            pq.read_table(out / "ingest" / p["file"], columns=["doc_ordinal", "meta"])
            for p in markers["ingest"]["stats"]["parts"]
        ]
    )
    import json

    domain = np.array([json.loads(m)["domain"] for m in docs["meta"].to_pylist()])
    assign = pa.concat_tables(
        [pq.read_table(p) for p in sorted((out / "assign").glob("part-*.parquet"))]
    )
    dom = domain[assign["doc_ordinal"].to_numpy()]
    sub = assign["subtree"].to_numpy()
    purity = sum(
        np.unique(dom[sub == s], return_counts=True)[1].max() for s in np.unique(sub)
    ) / len(sub)
    # 16 domains into 8 clusters: a perfect clustering has purity 0.5; random ~0.07.
    assert purity > 0.35


def test_routing_cells_balanced_on_real_embeddings(run_a):
    from memtree.clustering.tree import build_tree, level_stats

    out, _, _ = run_a
    x = np.load(out / "embed" / "embeddings.npy")
    kw = {"levels": 2, "branching": 8, "batch_size": 1024, "steps": 10, "seed": 0}
    plain = [s["balance_ratio"] for s in level_stats(build_tree(x, equalize_steps=0, **kw)[0])]
    eq = [s["balance_ratio"] for s in level_stats(build_tree(x, equalize_steps=40, **kw)[0])]
    assert eq[1] < plain[1] and max(eq) < 1.35, (plain, eq)


def test_rerun_skips_finished_stages(run_a, corpus, dask_client):
    out, _, _ = run_a
    logs: list[str] = []
    cfg = load_config(
        PipelineConfig, {"out": str(out), "ingest": {"inputs": [str(corpus)]}}, OVERRIDES
    )
    run_pipeline(cfg, client=dask_client, log=logs.append)
    assert all("up to date" in line for line in logs) and len(logs) == 8
    # Changing only the packing reruns shards and report, nothing upstream.
    logs.clear()
    cfg2 = load_config(
        PipelineConfig,
        {"out": str(out), "ingest": {"inputs": [str(corpus)]}},
        [*OVERRIDES, "pack.seq_len=1024"],
    )
    run_pipeline(cfg2, client=dask_client, log=logs.append)
    rerun = [line.split("]")[0][1:] for line in logs if "running" in line]
    assert rerun == ["shards", "report"]
    run_pipeline(cfg, client=dask_client, log=lambda m: None)  # restore for the other tests


@pytest.mark.parametrize("balance", ["tree.strict_balance=true", "tree.balance_target=1.0"])
def test_tree_restarts_run_through_the_dask_fitter(run_a, corpus, dask_client, balance):
    """tree.restarts, tree.strict_balance and the strict refits of tree.balance_target (1.0 puts
    nodes over it) reach the Dask node fits: the pipeline's tree is the one build_tree gives with
    the same settings on the run's embeddings, and only the tree and what depends on it rerun."""
    import numpy as np

    from memtree.clustering.tree import build_tree, load_tree

    out, _, _ = run_a
    logs: list[str] = []
    cfg = load_config(
        PipelineConfig,
        {"out": str(out), "ingest": {"inputs": [str(corpus)]}},
        [*OVERRIDES, "tree.restarts=3", balance],
    )
    markers = run_pipeline(cfg, client=dask_client, log=logs.append)
    assert [line.split("]")[0][1:] for line in logs if "running" in line] == [
        "tree",
        "assign",
        "shards",
        "report",
    ]
    t, x = cfg.tree, np.load(out / "embed" / "embeddings.npy")
    # the tree's bytes are those of the BLAS that ran its GEMMs (float32 rounding): the same one
    # here
    kw = {
        "levels": t.levels,
        "branching": t.branching,
        "batch_size": t.batch_size,
        "steps": t.steps,
        "balance_factor": t.balance_factor,
        "equalize_steps": t.equalize_steps,
        "min_points_per_child": t.min_points_per_child,
        "seed": cfg.seed,
        "gemm_backend": markers["tree"]["stats"]["host"]["gemm_used"],
    }
    ref = build_tree(
        x, restarts=3, strict_balance=t.strict_balance, balance_target=t.balance_target, **kw
    )[0]
    single = build_tree(x, **kw)[0]
    got = load_tree(out / "tree")
    assert got.tree_id == ref.tree_id != single.tree_id
    assert got.meta["config"]["restarts"] == 3
    if t.strict_balance:
        assert got.meta["config"]["strict_balance"] is True
    else:
        refits = [r for r, _ in got.meta["balance_repairs_per_level"]]
        assert (
            sum(refits) > 0 and got.meta["balance_repairs_per_level"] == ref.meta["balance_repairs"]
        )
        assert any("refitted with strict balance" in line for line in logs)
    base = load_config(
        PipelineConfig, {"out": str(out), "ingest": {"inputs": [str(corpus)]}}, OVERRIDES
    )
    run_pipeline(base, client=dask_client, log=lambda m: None)  # restore for the other tests


def test_tree_method_bottomup_through_the_pipeline(run_a, corpus, dask_client):
    """tree.method=bottomup: the pipeline's tree is build_tree_bottomup's on the run's embeddings,
    the assign stage's paths are its routed paths, and only the tree and what follows rerun."""
    from memtree.clustering.bottomup import build_tree_bottomup
    from memtree.clustering.tree import load_tree

    out, _, _ = run_a
    logs: list[str] = []
    cfg = load_config(
        PipelineConfig,
        {"out": str(out), "ingest": {"inputs": [str(corpus)]}},
        [*OVERRIDES, "tree.method=bottomup", "tree.restarts=2"],
    )
    markers = run_pipeline(cfg, client=dask_client, log=logs.append)
    assert [line.split("]")[0][1:] for line in logs if "running" in line] == [
        "tree",
        "assign",
        "shards",
        "report",
    ]
    assert any("level 1 built (bottomup)" in line for line in logs)
    t, x = cfg.tree, np.load(out / "embed" / "embeddings.npy")
    ref, paths = build_tree_bottomup(
        x,
        levels=t.levels,
        branching=t.branching,
        batch_size=t.batch_size,
        steps=t.steps,
        balance_factor=t.balance_factor,
        restarts=2,
        equalize_steps=t.equalize_steps,
        min_points_per_child=t.min_points_per_child,
        seed=cfg.seed,
        gemm_backend=markers["tree"]["stats"]["host"]["gemm_used"],
    )
    got = load_tree(out / "tree")
    assert got.tree_id == ref.tree_id and got.meta["config"]["method"] == "bottomup"
    assigned = pa.concat_tables(
        [pq.read_table(p) for p in sorted((out / "assign").glob("part-*.parquet"))]
    )
    order = np.argsort(assigned["window_ordinal"].to_numpy())
    assert (np.stack(assigned["path"].to_numpy(zero_copy_only=False))[order] == paths).all()
    base = load_config(
        PipelineConfig, {"out": str(out), "ingest": {"inputs": [str(corpus)]}}, OVERRIDES
    )
    run_pipeline(base, client=dask_client, log=lambda m: None)  # restore for the other tests


def _files(root: Path, sub: str) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted((root / sub).rglob("*"))
        if p.is_file() and p.name != "_stage.json"
    }


def test_killed_run_resumes_to_identical_outputs(run_a, corpus, tmp_path):
    """SIGKILL mid-embed, rerun: tree, assignments and shards are byte-identical to run A."""
    out_a, _, _ = run_a
    out_b = tmp_path / "b"
    cmd = [
        sys.executable,
        "-m",
        "memtree",
        "pipeline",
        "run",
        f"out={out_b}",
        f"ingest.inputs=[{corpus}]",
        "dask.n_workers=2",
        *OVERRIDES,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    why = kill_when_ready(
        cmd,
        lambda: any((out_b / ".work").glob("embed-*/parts/part-*.npy")),
        env=env,
        log=tmp_path / "run-b-killed.log",
        timeout=480,
    )
    assert why is None, f"no kill at the first embed part: {why}"
    assert not (out_b / "embed").exists()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[embed] running (resuming)" in r.stdout
    for sub in ("tree", "assign", "shards", "window", "tokenizer"):
        assert _files(out_b, sub) == _files(out_a, sub), sub


def test_local_cluster_workers_keep_the_trim_and_a_fixed_mmap_threshold(dask_client):
    """Dask's nanny sets MALLOC_TRIM_THRESHOLD_; the pipeline's LocalCluster also fixes glibc's
    mmap threshold, so large tensor buffers are not mmap'ed per allocation (11 % of encode)."""
    from memtree.pipeline.dask_utils import MMAP_THRESHOLD

    env = dask_client.run(
        lambda: (
            os.environ.get("MALLOC_TRIM_THRESHOLD_"),
            os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            os.environ.get("OMP_NUM_THREADS"),
        )
    )
    assert len(env) == 2
    assert set(env.values()) == {("65536", str(MMAP_THRESHOLD), "1")}
