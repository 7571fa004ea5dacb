"""Benchmarks of the clustering pipeline, each against its baseline in the same run.

    .venv/bin/python bench/pipeline.py            # full run (~14 min on 2 idle CPU cores)
    .venv/bin/python bench/pipeline.py --quick    # small variant (a few minutes)
    .venv/bin/python bench/pipeline.py --only tree --out /tmp/tree.json

Benchmarks (see bench/README.md for what each one compares):

  embed    pipeline Dask embed path (run_pipeline(..., until="embed"), `embed_seconds`)
           vs SentenceTransformer.encode on the same window texts           target >= 0.9x
  tree     clustering.tree.build_tree (3 levels x 16) vs flat faiss.Kmeans (4,096 centroids):
           speed (target >= 5x) and leaf NMI / purity (target: hierarchical within 5% of flat)
  assign   greedy clustering.route.route vs exhaustive nearest leaf (faiss.IndexFlatL2) at
           65,536 leaves: throughput ratio (target >= 100x) and agreement rate
  balance  max/mean cluster size per level of a default-TreeConfig tree  target <= 1.2
  e2e      end-to-end run_pipeline documents/second and peak RSS of the process tree

Every figure written to the JSON (`--out`) says which data it was measured on. Nothing is
extrapolated: a figure is either measured here or absent.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
from _common import (  # bench/ is on sys.path when run as a script
    REPO,
    finish,
    fmt,
    loadavg,
    log,
    wait_quiet,
    write_results,
)

DIM = 384  # all-MiniLM-L6-v2
BENCHES = ("embed", "tree", "assign", "balance", "e2e")


# ------------------------------------------------------------------------------------ sizes
def sizes(quick: bool) -> dict[str, Any]:
    """Every size the benchmarks use; recorded verbatim in the JSON."""
    if quick:
        return {
            "embed_docs": 200,
            "embed_partition_docs": 50,
            "embed_rounds": 1,
            "timing_rounds": 2,
            "tree_speed_points": 20_000,
            "tree_levels": 3,
            "tree_branching": 8,
            "kmeans_niter": 20,
            "quality_docs": 640,
            "quality_max_seq_length": 128,
            "quality_trees": [(2, 8)],
            "assign_queries": 2_000,
            "assign_levels": 4,
            "assign_branching": 16,
            "balance_points": 5_120,
            "balance_levels": 3,
            "balance_branching": 8,
            "real_balance_tree": (2, 8),
            "e2e_docs": 600,
            "e2e_levels": 3,
            "e2e_branching": 8,
            "e2e_window_tokens": 512,
            "e2e_seq_len": 512,
            "e2e_max_seq_length": 128,
            "e2e_baseline_windows": 64,
        }
    return {
        "embed_docs": 1000,
        "embed_partition_docs": 125,
        "embed_rounds": 2,
        "timing_rounds": 2,
        "tree_speed_points": 100_000,
        "tree_levels": 3,
        "tree_branching": 16,
        "kmeans_niter": 20,
        "quality_docs": 3000,
        "quality_max_seq_length": 128,
        "quality_trees": [(2, 8), (2, 16)],
        "assign_queries": 20_000,
        "assign_levels": 4,
        "assign_branching": 16,
        "balance_points": 655_360,
        "balance_levels": 4,
        "balance_branching": 16,
        "real_balance_tree": (3, 8),
        "e2e_docs": 10000,
        "e2e_levels": 3,
        "e2e_branching": 8,
        "e2e_window_tokens": 512,
        "e2e_seq_len": 512,
        "e2e_max_seq_length": 128,
        "e2e_baseline_windows": 256,
    }


# ---------------------------------------------------------------------------------- helpers
def n_cores() -> int:
    return os.cpu_count() or 1


def row(
    bench: str,
    metric: str,
    value: Any,
    *,
    data: str,
    baseline: Any = None,
    ratio: float | None = None,
    target: str = "",
    met: bool | None = None,
    unit: str = "",
) -> dict:
    return {
        "bench": bench,
        "metric": metric,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "ratio": ratio,
        "target": target,
        "met": met,
        "data": data,
    }


def print_table(rows: list[dict]) -> None:
    cols = [
        ("bench", "bench"),
        ("metric", "metric"),
        ("value", "measured"),
        ("baseline", "baseline"),
        ("ratio", "ratio"),
        ("target", "target"),
        ("met", "met"),
        ("data", "data"),
    ]
    cells = [
        [fmt(r[k]) + (f" {r['unit']}" if k == "value" and r["unit"] else "") for k, _ in cols]
        for r in rows
    ]
    for c in cells:
        c[6] = {"yes": "MET", "no": "NOT MET", "-": "-"}[c[6]]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
        for i, (_, h) in enumerate(cols)
    ]
    widths[-1] = min(widths[-1], 60)
    line = "  ".join(h.ljust(w) for (_, h), w in zip(cols, widths))
    print(line)
    print("-" * len(line))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))


def purity(labels: np.ndarray, clusters: np.ndarray) -> float:
    """Fraction of points whose cluster's majority label is their own label."""
    _, lab = np.unique(labels, return_inverse=True)
    _, cl = np.unique(clusters, return_inverse=True)
    table = np.zeros((cl.max() + 1, lab.max() + 1), dtype=np.int64)
    np.add.at(table, (cl, lab), 1)
    return float(table.max(1).sum() / len(labels))


def nmi(labels: np.ndarray, clusters: np.ndarray) -> float:
    from sklearn.metrics import normalized_mutual_info_score

    return float(normalized_mutual_info_score(labels, clusters))


def gmm_sphere(
    n: int,
    seed: int,
    *,
    dim: int = DIM,
    domains: int = 16,
    topics: int = 4,
    topic_spread: float = 0.8,
    point_spread: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """A labelled Gaussian mixture on the unit sphere shaped like the corpus: 16 domains x 4
    topics = 64 components. Domain centres are uniform on the sphere; a topic centre is its
    domain centre plus Gaussian noise of norm ~topic_spread, renormalised; a point is its topic
    centre plus noise of norm ~point_spread, renormalised (within-topic cosine ~0.5, like MiniLM
    embeddings of one subtopic). Returns (x (n, dim) float32, labels (n,) int64 in [0, 64))."""
    rng = np.random.default_rng(seed)
    dom = rng.standard_normal((domains, dim)).astype(np.float32)
    dom /= np.linalg.norm(dom, axis=1, keepdims=True)
    top = np.repeat(dom, topics, axis=0) + topic_spread / math.sqrt(dim) * rng.standard_normal(
        (domains * topics, dim)
    ).astype(np.float32)
    top /= np.linalg.norm(top, axis=1, keepdims=True)
    labels = rng.integers(0, domains * topics, size=n)
    x = np.empty((n, dim), dtype=np.float32)
    step = 65536
    for s in range(0, n, step):
        e = min(n, s + step)
        xb = top[labels[s:e]] + point_spread / math.sqrt(dim) * rng.standard_normal(
            (e - s, dim), dtype=np.float32
        )
        xb /= np.linalg.norm(xb, axis=1, keepdims=True)
        x[s:e] = xb
    return x, labels.astype(np.int64)


def flat_kmeans(x: np.ndarray, k: int, *, niter: int, seed: int) -> tuple[np.ndarray, float, dict]:
    """faiss.Kmeans with `k` centroids on all of x; returns (labels, seconds, params).

    max_points_per_centroid is set to ceil(n / k) so that FAISS trains on *every* point (by
    default it subsamples to 256 x k points; with k=4,096 that cap is 1,048,576 and would not
    bite at n <= 1M, but setting it makes the data identical to what build_tree sees, whose
    leaf-level nodes use all of their points). min_points_per_centroid=1 silences the warning
    for small n. The final assignment of all points (one more nearest-centroid pass) is timed
    too, since build_tree also returns every point's leaf.
    """
    import faiss

    n, d = x.shape
    params = {
        "k": k,
        "niter": niter,
        "seed": seed,
        "nredo": 1,
        "spherical": False,
        "max_points_per_centroid": math.ceil(n / k),
        "min_points_per_centroid": 1,
        "omp_threads": faiss.omp_get_max_threads(),
    }
    t0 = time.perf_counter()
    km = faiss.Kmeans(
        d,
        k,
        niter=niter,
        seed=seed,
        nredo=1,
        spherical=False,
        verbose=False,
        max_points_per_centroid=params["max_points_per_centroid"],
        min_points_per_centroid=1,
    )
    km.train(x)
    _, lab = km.index.search(x, 1)
    return lab[:, 0].astype(np.int64), time.perf_counter() - t0, params


def corpus_docs(n: int, seed: int = 0) -> list[dict]:
    from pipeline.corpus import CorpusSpec, generate_corpus

    return list(generate_corpus(CorpusSpec(n_docs=n, seed=seed)))


def write_jsonl(docs: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)


def real_embeddings(n: int, max_seq_length: int, cache_dir: Path) -> dict[str, Any]:
    """MiniLM embeddings (truncate, batch 64, normalised) of the first n corpus documents (seed 0),
    with labels domain x topic; cached on disk keyed by (n, max_seq_length)."""
    docs = corpus_docs(n)
    pairs = sorted({(d["domain"], d["topic"]) for d in docs})
    index = {p: i for i, p in enumerate(pairs)}
    labels = np.array([index[(d["domain"], d["topic"])] for d in docs], dtype=np.int64)
    domains = np.array([sorted({d["domain"] for d in docs}).index(d["domain"]) for d in docs])
    cache = cache_dir / f"corpus-seed0-n{n}-msl{max_seq_length}.npy"
    if cache.is_file():
        x = np.load(cache)
        return {"x": x, "labels": labels, "domains": domains, "seconds": None, "cached": str(cache)}
    from clustering.embed import embed_texts, load_embedder

    m = load_embedder(device="cpu", max_seq_length=max_seq_length)
    log(f"embedding {n} corpus documents (max_seq_length={max_seq_length}) for the quality set")
    t0 = time.perf_counter()
    x = embed_texts(m, [d["text"] for d in docs], strategy="truncate", batch_size=64)
    secs = time.perf_counter() - t0
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(cache, x)
    return {"x": x, "labels": labels, "domains": domains, "seconds": round(secs, 2), "cached": None}


def pipeline_cfg(root: Path, inputs: list[str], **sections: Any):
    from pipeline.config import (
        DaskConfig,
        EmbedConfig,
        IngestConfig,
        PackConfig,
        PipelineConfig,
        TreeConfig,
        WindowConfig,
    )

    kinds = {
        "ingest": IngestConfig,
        "window": WindowConfig,
        "embed": EmbedConfig,
        "tree": TreeConfig,
        "pack": PackConfig,
        "dask": DaskConfig,
    }
    sections = {"ingest": {}, "embed": {"device": "cpu"}, **sections}
    sections["ingest"] = {**sections["ingest"], "inputs": inputs}
    parts = {k: kinds[k](**v) for k, v in sections.items()}
    return PipelineConfig(out=str(root), progress=False, **parts)


def quiet(_msg: str) -> None:
    pass


# ------------------------------------------------------------------------------------ embed
def bench_embed(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    """Pipeline embed stage vs direct encode, interleaved (A B, B A, ...) so that load from other
    processes on the machine hits both sides alike; the ratio is of the summed times."""
    import pyarrow.parquet as pq

    from clustering.embed import embed_texts, load_embedder
    from memtree.config import to_dict
    from pipeline.dask_utils import dask_client
    from pipeline.run import run_pipeline

    n_docs, part, rounds = S["embed_docs"], S["embed_partition_docs"], S["embed_rounds"]
    work = Path(tempfile.mkdtemp(prefix="memtree-bench-embed-", dir=ctx["tmp"]))
    write_jsonl(corpus_docs(n_docs), work / "corpus.jsonl")
    cfg = pipeline_cfg(
        work / "run",
        [str(work / "corpus.jsonl")],
        ingest={"partition_docs": part},
        embed={"device": "cpu"},
    )
    e = cfg.embed
    res: dict[str, Any] = {
        "docs": n_docs,
        "partition_docs": part,
        "embed_config": to_dict(e),
        "window_tokens": cfg.window.window_tokens,
        "rounds": rounds,
        "dask": {
            "n_workers": cfg.dask.n_workers or n_cores(),
            "threads_per_worker": cfg.dask.threads_per_worker,
        },
        "loadavg_start": loadavg(),
    }
    import torch

    torch.set_num_threads(n_cores())
    pipe_runs: list[dict] = []
    direct_runs: list[dict] = []
    with dask_client(cfg.dask) as client:
        log(f"embed: ingest/tokenizer/window for {n_docs} docs")
        markers = run_pipeline(cfg, until="window", client=client, log=quiet)
        wparts = markers["window"]["stats"]["parts"]
        texts: list[str] = []
        for p in wparts:
            texts += pq.read_table(work / "run" / "window" / p["file"], columns=["text"])[
                "text"
            ].to_pylist()
        n = len(texts)

        def pipeline_once(label: str) -> float:
            shutil.rmtree(work / "run" / "embed", ignore_errors=True)
            la = loadavg()
            st = run_pipeline(cfg, until="embed", client=client, log=quiet)["embed"]["stats"]
            assert st["n"] == n, (st["n"], n)
            pipe_runs.append({"kind": label, "seconds": st["embed_seconds"], "loadavg_before": la})
            log(
                f"embed:   pipeline ({label}) {st['embed_seconds']:.1f}s = {n / st['embed_seconds']:.2f} win/s"
            )
            return st["embed_seconds"]

        def direct_once() -> float:
            la = loadavg()
            t0 = time.perf_counter()
            embed_texts(model, texts, strategy=e.strategy, batch_size=e.batch_size)
            secs = time.perf_counter() - t0
            direct_runs.append({"seconds": secs, "loadavg_before": la})
            log(f"embed:   direct encode {secs:.1f}s = {n / secs:.2f} win/s")
            return secs

        log(f"embed: {n} windows; pipeline embed stage with cold workers (model load included)")
        cold_s = pipeline_once("cold")
        t0 = time.perf_counter()
        model = load_embedder(e.model, device="cpu", max_seq_length=e.max_seq_length)
        load_s = time.perf_counter() - t0
        embed_texts(model, texts[:16], strategy=e.strategy, batch_size=e.batch_size)  # warm-up
        log(
            f"embed: {rounds} interleaved rounds of warm pipeline embed vs direct encode "
            f"({torch.get_num_threads()} torch threads)"
        )
        for r in range(rounds):
            for which in ("direct", "pipe") if r % 2 == 0 else ("pipe", "direct"):
                direct_once() if which == "direct" else pipeline_once("warm")
    base = embed_texts(model, texts[:256], strategy=e.strategy, batch_size=e.batch_size)
    pipe = np.load(work / "run" / "embed" / "embeddings.npy")[:256]
    cos = float(np.min(np.sum(pipe * base, axis=1)))
    warm_s = sum(r["seconds"] for r in pipe_runs if r["kind"] == "warm")
    direct_s = sum(r["seconds"] for r in direct_runs)
    warm_rate, base_rate = n * rounds / warm_s, n * rounds / direct_s
    cold_rate = n / cold_s
    base_cold_rate = n / (direct_runs[0]["seconds"] + load_s)
    res.update(
        windows=n,
        n_partitions=len(wparts),
        pipeline_runs=pipe_runs,
        direct_runs=direct_runs,
        direct_model_load_seconds=round(load_s, 3),
        torch_threads=torch.get_num_threads(),
        pipeline_warm_windows_per_s=warm_rate,
        direct_windows_per_s=base_rate,
        pipeline_cold_windows_per_s=cold_rate,
        direct_with_load_windows_per_s=base_cold_rate,
        ratio_warm=warm_rate / base_rate,
        ratio_cold=cold_rate / base_cold_rate,
        per_round_ratio_warm=[
            d["seconds"] / p["seconds"]
            for d, p in zip(direct_runs, [r for r in pipe_runs if r["kind"] == "warm"])
        ],
        min_cosine_pipeline_vs_direct_first256=cos,
        loadavg_end=loadavg(),
    )
    data = (
        f"{n} windows of {n_docs} corpus docs (window 2048 tok), MiniLM max_seq_length="
        f"{e.max_seq_length}, batch {e.batch_size}; {len(wparts)} parquet partitions, "
        f"{res['dask']['n_workers']} workers x 1 thread vs encode with {torch.get_num_threads()} "
        f"threads; {rounds} interleaved rounds"
    )
    rows = [
        row(
            "embed",
            "pipeline embed throughput (warm workers)",
            warm_rate,
            unit="win/s",
            baseline=round(base_rate, 2),
            ratio=warm_rate / base_rate,
            target=">= 0.9x",
            met=warm_rate / base_rate >= 0.9,
            data=data,
        ),
        row(
            "embed",
            "pipeline embed throughput (cold: worker start + model load incl.)",
            cold_rate,
            unit="win/s",
            baseline=round(base_cold_rate, 2),
            ratio=cold_rate / base_cold_rate,
            target="(info; baseline: 1st direct round + its model load)",
            data=data.replace(f"; {rounds} interleaved rounds", "; one run"),
        ),
        row(
            "embed",
            "min cosine(pipeline emb, direct emb), first 256 windows",
            cos,
            data=data,
            target="(info; same vectors expected)",
        ),
    ]
    shutil.rmtree(work, ignore_errors=True)
    return res, rows


# ------------------------------------------------------------------------------------- tree
def bench_tree(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    from clustering.tree import build_tree

    L, B, niter = S["tree_levels"], S["tree_branching"], S["kmeans_niter"]
    k = B**L
    n = S["tree_speed_points"]
    res: dict[str, Any] = {"loadavg_start": loadavg()}
    rows: list[dict] = []

    # --- speed (and quality) on the synthetic mixture
    x, lab = gmm_sphere(n, seed=1)
    data_syn = f"synthetic: {n:,} pts, 384-d GMM on the unit sphere, 64 labelled comps (16x4)"
    rounds = S["timing_rounds"]
    hier_runs: list[float] = []
    flat_runs: list[float] = []
    for r in range(rounds):  # interleaved (A B, B A, ...): load from other processes hits both
        for which in ("hier", "flat") if r % 2 == 0 else ("flat", "hier"):
            if which == "hier":
                log(f"tree: build_tree levels={L} branching={B} on {n} synthetic points")
                t0 = time.perf_counter()
                _tree, paths = build_tree(x, levels=L, branching=B, seed=0)
                hier_runs.append(time.perf_counter() - t0)
            else:
                log(f"tree: faiss.Kmeans k={k} niter={niter} on the same points")
                flat_lab, secs, fparams = flat_kmeans(x, k, niter=niter, seed=0)
                flat_runs.append(secs)
    hier_s, flat_s = float(np.mean(hier_runs)), float(np.mean(flat_runs))
    hier_leaf = paths[:, -1]
    speed = {
        "points": n,
        "levels": L,
        "branching": B,
        "leaves": k,
        "build_tree_params": {
            "batch_size": 6400,
            "steps": 20,
            "balance_factor": 1.1,
            "min_points_per_child": 2,
            "seed": 0,
        },
        "hier_seconds": hier_s,
        "flat_seconds": flat_s,
        "flat_params": fparams,
        "hier_runs_seconds": hier_runs,
        "flat_runs_seconds": flat_runs,
        "rounds": rounds,
        "speedup": flat_s / hier_s,
        "hier_nmi": nmi(lab, hier_leaf),
        "flat_nmi": nmi(lab, flat_lab),
        "hier_purity": purity(lab, hier_leaf),
        "flat_purity": purity(lab, flat_lab),
        "hier_nonempty_leaves": len(np.unique(hier_leaf)),
        "flat_nonempty_leaves": len(np.unique(flat_lab)),
    }
    res["speed_synthetic"] = speed
    rows.append(
        row(
            "tree",
            f"build time (mean of {rounds}), hierarchical {L}x{B} vs flat k={k}",
            hier_s,
            unit="s",
            baseline=round(flat_s, 2),
            ratio=flat_s / hier_s,
            target=">= 5x faster",
            met=flat_s / hier_s >= 5,
            data=data_syn + f"; faiss niter={niter}, "
            f"max_points_per_centroid=ceil(n/k)={fparams['max_points_per_centroid']} (all points)",
        )
    )
    for metric in ("nmi", "purity"):
        h, f = speed[f"hier_{metric}"], speed[f"flat_{metric}"]
        rows.append(
            row(
                "tree",
                f"leaf {metric.upper() if metric == 'nmi' else metric} vs 64 labels, {k} leaves",
                h,
                baseline=round(f, 4),
                ratio=h / f,
                target=">= 0.95x flat",
                met=h / f >= 0.95,
                data=data_syn,
            )
        )
    del x

    # --- quality on real MiniLM embeddings of the synthetic corpus
    q = real_embeddings(S["quality_docs"], S["quality_max_seq_length"], ctx["cache"])
    xr, labr = q["x"], q["labels"]
    res["quality_real"] = {
        "docs": len(xr),
        "max_seq_length": S["quality_max_seq_length"],
        "n_labels": len(np.unique(labr)),
        "embed_seconds": q["seconds"],
        "embeddings_from_cache": q["cached"],
        "trees": [],
    }
    data_real = (
        f"real: MiniLM emb. of {len(xr):,} corpus docs (seed 0, max_seq_length="
        f"{S['quality_max_seq_length']}), labels domain x topic (64)"
    )
    for lv, br in S["quality_trees"]:
        kk = br**lv
        log(f"tree: quality on real embeddings, hierarchical {lv}x{br} vs flat k={kk}")
        t0 = time.perf_counter()
        _, pr = build_tree(xr, levels=lv, branching=br, seed=0)
        hs = time.perf_counter() - t0
        fl, fs, fp = flat_kmeans(xr, kk, niter=niter, seed=0)
        hl = pr[:, -1]
        # The domain (16) labels against the level-1 clusters are a bonus diagnostic.
        t = {
            "levels": lv,
            "branching": br,
            "leaves": kk,
            "hier_seconds": hs,
            "flat_seconds": fs,
            "flat_params": fp,
            "hier_nmi": nmi(labr, hl),
            "flat_nmi": nmi(labr, fl),
            "hier_purity": purity(labr, hl),
            "flat_purity": purity(labr, fl),
        }
        res["quality_real"]["trees"].append(t)
        for metric in ("nmi", "purity"):
            h, f = t[f"hier_{metric}"], t[f"flat_{metric}"]
            rows.append(
                row(
                    "tree",
                    f"leaf {metric.upper() if metric == 'nmi' else metric} vs 64 labels, "
                    f"{lv}x{br}={kk} leaves vs flat k={kk}",
                    h,
                    baseline=round(f, 4),
                    ratio=h / f,
                    target=">= 0.95x flat",
                    met=h / f >= 0.95,
                    data=data_real,
                )
            )
    ctx["real_quality"] = q
    res["loadavg_end"] = loadavg()
    return res, rows


# ----------------------------------------------------------------------------------- assign
def constructed_tree(levels: int, branching: int, seed: int, radii: list[float]):
    """A random valid tree: level-1 centroids uniform on the sphere; every child is its parent
    plus Gaussian noise of norm ~radii[l-2], renormalised, so children cluster around parents
    (the geometry hierarchical k-means produces) and greedy routing can find the nearest leaf."""
    from clustering.tree import Tree

    rng = np.random.default_rng(seed)
    c = rng.standard_normal((branching, DIM)).astype(np.float32)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    cents = [c]
    for lvl in range(2, levels + 1):
        parent = np.repeat(cents[-1], branching, axis=0)
        c = parent + radii[lvl - 2] / math.sqrt(DIM) * rng.standard_normal(parent.shape).astype(
            np.float32
        )
        c /= np.linalg.norm(c, axis=1, keepdims=True)
        cents.append(c.astype(np.float32))
    valid = [np.ones(branching**lvl, dtype=bool) for lvl in range(1, levels + 1)]
    return Tree(levels, branching, DIM, cents, valid, [], meta={})


def greedy_vs_exhaustive(tree, xq: np.ndarray, rounds: int) -> dict:
    import faiss

    from clustering.route import route

    leaves = tree.centroids[-1]
    ids = np.flatnonzero(tree.valid[-1])
    g_runs: list[float] = []
    e_runs: list[float] = []
    for r in range(rounds):  # interleaved, as in the tree benchmark
        for which in ("greedy", "exh") if r % 2 == 0 else ("exh", "greedy"):
            t0 = time.perf_counter()
            if which == "greedy":
                paths = route(tree, xq)
                g_runs.append(time.perf_counter() - t0)
            else:
                index = faiss.IndexFlatL2(tree.dim)
                index.add(np.ascontiguousarray(leaves[ids]))
                _dist, ind = index.search(np.ascontiguousarray(xq), 1)
                e_runs.append(time.perf_counter() - t0)
    g_s, e_s = float(np.mean(g_runs)), float(np.mean(e_runs))
    exh = ids[ind[:, 0]]
    greedy = paths[:, -1]
    gd = ((xq.astype(np.float64) - leaves[greedy].astype(np.float64)) ** 2).sum(1)
    ed = ((xq.astype(np.float64) - leaves[exh].astype(np.float64)) ** 2).sum(1)
    n = len(xq)
    return {
        "queries": n,
        "valid_leaves": len(ids),
        "greedy_seconds": g_s,
        "greedy_runs_seconds": g_runs,
        "exhaustive_runs_seconds": e_runs,
        "exhaustive_seconds": e_s,
        "greedy_per_s": n / g_s,
        "exhaustive_per_s": n / e_s,
        "throughput_ratio": e_s / g_s,
        "agreement": float(np.mean(greedy == exh)),
        "agreement_by_distance": float(np.mean(gd <= ed * (1 + 1e-6) + 1e-9)),
        "mean_sq_dist_greedy": float(gd.mean()),
        "mean_sq_dist_exhaustive": float(ed.mean()),
        "faiss_omp_threads": faiss.omp_get_max_threads(),
    }


def routing_rows(r: dict, n_leaves: int, data: str) -> list[dict]:
    """Throughput and agreement rows of one greedy-vs-exhaustive comparison."""
    return [
        row(
            "assign",
            f"routing throughput, greedy vs exhaustive, {n_leaves:,} leaves",
            r["greedy_per_s"],
            unit="pts/s",
            baseline=round(r["exhaustive_per_s"], 1),
            ratio=r["throughput_ratio"],
            target=">= 100x",
            met=r["throughput_ratio"] >= 100,
            data=data,
        ),
        row("assign", "agreement greedy leaf == exhaustive nearest leaf", r["agreement"],
            data=data, target="(info)"),
    ]


def bench_assign(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    L, B, nq = S["assign_levels"], S["assign_branching"], S["assign_queries"]
    res: dict[str, Any] = {"loadavg_start": loadavg()}
    rows: list[dict] = []
    radii = [0.6, 0.35, 0.2][: L - 1]
    q_radius = 0.1
    log(f"assign: constructed {L}x{B} tree ({B**L} leaves), {nq} queries")
    tree = constructed_tree(L, B, seed=7, radii=radii)
    rng = np.random.default_rng(8)
    leaf = rng.integers(0, B**L, size=nq)
    xq = tree.centroids[-1][leaf] + q_radius / math.sqrt(DIM) * rng.standard_normal(
        (nq, DIM)
    ).astype(np.float32)
    xq /= np.linalg.norm(xq, axis=1, keepdims=True)
    r = greedy_vs_exhaustive(tree, xq.astype(np.float32), S["timing_rounds"])
    r.update(tree="constructed", child_noise_norms=radii, query_noise_norm=q_radius)
    res["constructed"] = r
    data_c = (
        f"constructed {L}x{B} tree ({B**L:,} leaves; child = parent + noise of norm "
        f"{radii}, renormalised); {nq:,} queries = random leaf + noise {q_radius}"
    )
    rows += routing_rows(r, B**L, data_c)

    # The default-config tree built on synthetic data (shared with the balance benchmark).
    built = ctx.get("balance_tree") or balance_tree(S, ctx)
    tree_b, gen = built["tree"], built["gen"]
    # gmm_sphere draws the mixture from its seed; held-out points must come from the same
    # mixture, so draw n_build + nq points with the build seed and keep the tail.
    xall, _ = gmm_sphere(gen["n"] + nq, seed=gen["seed"])
    xq2 = xall[gen["n"] :]
    del xall
    lb, bb = tree_b.levels, tree_b.branching
    log(f"assign: built {lb}x{bb} tree ({bb**lb} leaves), {nq} held-out queries")
    r2 = greedy_vs_exhaustive(tree_b, xq2, S["timing_rounds"])
    r2.update(tree="built", build=gen)
    res["built"] = r2
    data_b = (
        f"tree built by build_tree (default TreeConfig params, {lb}x{bb}) on {gen['n']:,} "
        f"synthetic GMM pts; {nq:,} held-out pts of the same mixture"
    )
    rows += routing_rows(r2, bb**lb, data_b)
    rows.append(
        row(
            "assign",
            "mean sq. L2 to leaf, greedy / exhaustive",
            r2["mean_sq_dist_greedy"],
            baseline=round(r2["mean_sq_dist_exhaustive"], 4),
            ratio=r2["mean_sq_dist_greedy"] / r2["mean_sq_dist_exhaustive"],
            data=data_b,
            target="(info)",
        )
    )
    res["loadavg_end"] = loadavg()
    return res, rows


# ---------------------------------------------------------------------------------- balance
def balance_tree(S: dict, ctx: dict) -> dict:
    """The default-TreeConfig tree on synthetic data (built once per run, shared with assign)."""
    from clustering.tree import build_tree
    from memtree.config import to_dict
    from pipeline.config import TreeConfig

    if "balance_tree" in ctx:
        return ctx["balance_tree"]
    tc = TreeConfig(levels=S["balance_levels"], branching=S["balance_branching"])
    n = S["balance_points"]
    x, _ = gmm_sphere(n, seed=2)
    log(
        f"balance: build_tree {tc.levels}x{tc.branching} (TreeConfig defaults otherwise) on {n} points"
    )
    t0 = time.perf_counter()
    tree, _ = build_tree(
        x,
        levels=tc.levels,
        branching=tc.branching,
        batch_size=tc.batch_size,
        steps=tc.steps,
        balance_factor=tc.balance_factor,
        min_points_per_child=tc.min_points_per_child,
        seed=0,
    )
    secs = time.perf_counter() - t0
    del x
    ctx["balance_tree"] = {
        "tree": tree,
        "seconds": secs,
        "config": to_dict(tc),
        "gen": {"n": n, "seed": 2, "kind": "gmm_sphere"},
    }
    return ctx["balance_tree"]


def balance_rows(stats: list[dict], data: str) -> list[dict]:
    """One max/mean row per tree level."""
    return [
        row(
            "balance",
            f"max/mean size, level {s['level']} (mean {s['mean_size']:.1f}, "
            f"max {s['max_size']}, min {s['min_size']}, empty {s['n_empty']})",
            s["balance_ratio"],
            target="<= 1.2",
            met=s["balance_ratio"] <= 1.2,
            data=data,
        )
        for s in stats
    ]


def bench_balance(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    from clustering.tree import build_tree, level_stats

    res: dict[str, Any] = {"loadavg_start": loadavg()}
    rows: list[dict] = []
    bt = balance_tree(S, ctx)
    st = level_stats(bt["tree"])
    res["synthetic"] = {
        "config": bt["config"],
        "points": bt["gen"]["n"],
        "build_seconds": bt["seconds"],
        "level_stats": st,
    }
    tc = bt["config"]
    data = (
        f"synthetic GMM, {bt['gen']['n']:,} pts; TreeConfig defaults "
        f"({tc['levels']}x{tc['branching']}, batch {tc['batch_size']}, steps {tc['steps']}, "
        f"balance_factor {tc['balance_factor']})"
    )
    rows += balance_rows(st, data)

    q = ctx.get("real_quality") or real_embeddings(
        S["quality_docs"], S["quality_max_seq_length"], ctx["cache"]
    )
    lv, br = S["real_balance_tree"]
    log(f"balance: build_tree {lv}x{br} on {len(q['x'])} real embeddings")
    tree, _ = build_tree(q["x"], levels=lv, branching=br, seed=0)
    st2 = level_stats(tree)
    res["real"] = {
        "docs": len(q["x"]),
        "levels": lv,
        "branching": br,
        "max_seq_length": S["quality_max_seq_length"],
        "level_stats": st2,
    }
    data2 = (
        f"real: MiniLM emb. of {len(q['x']):,} corpus docs, build_tree {lv}x{br}, "
        "other params default"
    )
    rows += balance_rows(st2, data2)
    res["loadavg_end"] = loadavg()
    return res, rows


# -------------------------------------------------------------------------------------- e2e
class RssSampler(threading.Thread):
    """Samples the summed RSS of a process and all its descendants every `interval` s."""

    def __init__(self, pid: int, interval: float = 0.5):
        super().__init__(daemon=True)
        import psutil

        self.root = psutil.Process(pid)
        self.interval = interval
        self.stop_evt = threading.Event()
        self.peak_total = 0
        self.peak_root = 0
        self.peak_children = 0
        self.max_procs = 0
        self.samples = 0
        self.timeline: list[tuple[float, int, int]] = []  # (unix time, root RSS, descendants' RSS)

    def run(self) -> None:
        import psutil

        while not self.stop_evt.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.Error:
                break
            root_rss, child_rss = 0, 0
            for p in procs:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                if p.pid == self.root.pid:
                    root_rss = rss
                else:
                    child_rss += rss
            self.peak_total = max(self.peak_total, root_rss + child_rss)
            self.peak_root = max(self.peak_root, root_rss)
            self.peak_children = max(self.peak_children, child_rss)
            self.max_procs = max(self.max_procs, len(procs))
            self.samples += 1
            self.timeline.append((time.time(), root_rss, child_rss))
            self.stop_evt.wait(self.interval)

    def stop(self) -> None:
        self.stop_evt.set()
        self.join()


def e2e_child(spec_path: str) -> int:
    """Runs in a fresh interpreter (so its RSS is the pipeline's alone): the whole pipeline."""
    from pipeline.run import run_pipeline

    spec = json.loads(Path(spec_path).read_text())
    S = spec["sizes"]
    root = Path(spec["root"])
    cfg = pipeline_cfg(
        root,
        [spec["corpus"]],
        window={"window_tokens": S["e2e_window_tokens"]},
        embed={"device": "cpu", "max_seq_length": S["e2e_max_seq_length"]},
        tree={"levels": S["e2e_levels"], "branching": S["e2e_branching"], "auto_reduce": True},
        pack={"seq_len": S["e2e_seq_len"]},
    )
    t0 = time.perf_counter()
    markers = run_pipeline(cfg, log=quiet)
    secs = time.perf_counter() - t0
    from memtree.config import to_dict

    Path(spec["result"]).write_text(
        json.dumps({"seconds": secs, "config": to_dict(cfg), "markers": markers}, default=str)
    )
    return 0


def bench_e2e(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    import pyarrow.parquet as pq

    n_docs = S["e2e_docs"]
    work = Path(tempfile.mkdtemp(prefix="memtree-bench-e2e-", dir=ctx["tmp"]))
    write_jsonl(corpus_docs(n_docs), work / "corpus.jsonl")
    spec = {
        "sizes": S,
        "root": str(work / "run"),
        "corpus": str(work / "corpus.jsonl"),
        "result": str(work / "result.json"),
    }
    (work / "spec.json").write_text(json.dumps(spec))
    res: dict[str, Any] = {"docs": n_docs, "loadavg_start": loadavg()}
    log(
        f"e2e: run_pipeline on {n_docs} docs in a child process (levels {S['e2e_levels']}, "
        f"branching {S['e2e_branching']}, window {S['e2e_window_tokens']}, seq_len {S['e2e_seq_len']}, "
        f"embed max_seq_length {S['e2e_max_seq_length']})"
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--_e2e-child", str(work / "spec.json")],
        cwd=str(REPO),
    )
    sampler = RssSampler(proc.pid, 0.5)
    sampler.start()
    rc = proc.wait()
    wall = time.perf_counter() - t0
    sampler.stop()
    if rc != 0:
        raise RuntimeError(f"e2e child failed with exit status {rc}")
    out = json.loads((work / "result.json").read_text())
    mk = out["markers"]
    stage_s = {k: v["seconds"] for k, v in mk.items()}
    n_win = mk["window"]["stats"]["n_windows"]
    docs_kept = mk["ingest"]["stats"]["kept"]
    secs = out["seconds"]
    res.update(
        docs_kept=docs_kept,
        windows=n_win,
        tokens=mk["window"]["stats"]["n_tokens"],
        run_pipeline_seconds=secs,
        child_wall_seconds=wall,
        stage_seconds=stage_s,
        docs_per_s=n_docs / secs,
        windows_per_s=n_win / secs,
        embed_stage=mk["embed"]["stats"],
        tree=mk["tree"]["stats"],
        shards={k: v for k, v in mk["shards"]["stats"].items()},
        peak_rss_total_bytes=sampler.peak_total,
        peak_rss_driver_bytes=sampler.peak_root,
        peak_rss_children_bytes=sampler.peak_children,
        rss_samples=sampler.samples,
        max_processes=sampler.max_procs,
        config=out["config"],
    )
    # Baseline: the same MiniLM (same max_seq_length) encoding a sample of the run's own windows
    # directly, i.e. the rate at which the embedding alone could go on this machine right now.
    from clustering.embed import embed_texts, load_embedder

    texts: list[str] = []
    for p in mk["window"]["stats"]["parts"]:
        texts += pq.read_table(work / "run" / "window" / p["file"], columns=["text"])[
            "text"
        ].to_pylist()
    k = S["e2e_baseline_windows"]
    sample = [texts[i] for i in np.linspace(0, len(texts) - 1, num=min(k, len(texts))).astype(int)]
    import torch

    torch.set_num_threads(n_cores())
    m = load_embedder(device="cpu", max_seq_length=S["e2e_max_seq_length"])
    embed_texts(m, sample[:8])  # warm-up
    t0 = time.perf_counter()
    embed_texts(m, sample, strategy="truncate", batch_size=64)
    b_s = time.perf_counter() - t0
    direct_rate = len(sample) / b_s
    res["direct_encode_sample"] = {
        "windows": len(sample),
        "seconds": b_s,
        "windows_per_s": direct_rate,
    }
    res["loadavg_end"] = loadavg()
    gib = 1024**3
    data = (
        f"{n_docs:,} corpus docs -> {n_win:,} windows; levels {S['e2e_levels']} x branching "
        f"{S['e2e_branching']}, window/seq_len {S['e2e_window_tokens']}, embed max_seq_length "
        f"{S['e2e_max_seq_length']}; LocalCluster {n_cores()} workers x 1 thread"
    )
    rows = [
        row(
            "e2e",
            "run_pipeline documents/second (all 8 stages, incl. cluster start)",
            n_docs / secs,
            unit="docs/s",
            data=data,
            target="(issue: 50k docs; not run at that scale)",
        ),
        row(
            "e2e",
            "run_pipeline windows/second vs direct encode of a window sample",
            n_win / secs,
            unit="win/s",
            baseline=round(direct_rate, 2),
            ratio=(n_win / secs) / direct_rate,
            target="(info: embed-bound ceiling)",
            data=data + f"; baseline sample {len(sample)} windows",
        ),
        row(
            "e2e",
            "run_pipeline wall time",
            secs,
            unit="s",
            data=data,
            target="(info) stages: " + ", ".join(f"{k} {v:.0f}s" for k, v in stage_s.items()),
        ),
        row(
            "e2e",
            "peak RSS, driver + Dask workers (summed, 0.5 s samples)",
            round(sampler.peak_total / gib, 2),
            unit="GiB",
            data=data,
            target=f"(info) driver {sampler.peak_root / gib:.2f} GiB, "
            f"children {sampler.peak_children / gib:.2f} GiB",
        ),
    ]
    for s in mk["tree"]["stats"]["level_stats"]:
        rows.append(
            row(
                "e2e",
                f"tree balance max/mean, level {s['level']} (mean {s['mean_size']:.1f}, "
                f"max {s['max_size']})",
                s["balance_ratio"],
                target="<= 1.2",
                met=s["balance_ratio"] <= 1.2,
                data=f"real: e2e run's tree on {n_win:,} windows",
            )
        )
    shutil.rmtree(work, ignore_errors=True)
    return res, rows


# ------------------------------------------------------------------------------------- main
def machine() -> dict:
    import faiss
    import psutil
    import torch

    mem = round(psutil.virtual_memory().total / 1024**3, 1)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "faiss": faiss.__version__,
        "numpy": np.__version__,
        "cores": n_cores(),
        "memory_gib": mem,
        "cuda_available": bool(torch.cuda.is_available()),
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small, fast variant")
    ap.add_argument(
        "--only", choices=BENCHES, action="append", help="run only this benchmark (repeatable)"
    )
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "pipeline.json"))
    ap.add_argument(
        "--cache-dir",
        default=os.path.join(tempfile.gettempdir(), "memtree-bench-cache"),
        help="where real MiniLM embeddings of the quality corpus are cached",
    )
    ap.add_argument("--tmp", default=None, help="scratch directory for pipeline runs")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one size from sizes() (e.g. --set e2e_docs=3000); recorded in the JSON",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each benchmark, wait up to SECONDS for the 1-minute load average to "
        "drop below the core count (other work on the machine skews timings)",
    )
    ap.add_argument("--_e2e-child", dest="e2e_child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.e2e_child:
        return e2e_child(args.e2e_child)

    S = sizes(args.quick)
    for kv in args.set:
        key, _, val = kv.partition("=")
        if key not in S:
            ap.error(f"--set {kv}: unknown size {key!r}; sizes: {sorted(S)}")
        S[key] = json.loads(val) if val[:1] in "[{" or val.replace(".", "", 1).isdigit() else val
        if isinstance(S[key], list) and S[key] and isinstance(S[key][0], list):
            S[key] = [tuple(v) for v in S[key]]
    selected = args.only or list(BENCHES)
    ctx: dict[str, Any] = {"cache": Path(args.cache_dir), "tmp": args.tmp}
    if args.tmp:
        Path(args.tmp).mkdir(parents=True, exist_ok=True)
    started = _dt.datetime.now().astimezone()
    results: dict[str, Any] = {
        "meta": {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started": started.isoformat(timespec="seconds"),
            "quick": args.quick,
            "machine": machine(),
            "sizes": S,
            "loadavg_start": loadavg(),
        },
        "benchmarks": {},
        "rows": [],
    }
    fns = {
        "embed": bench_embed,
        "tree": bench_tree,
        "assign": bench_assign,
        "balance": bench_balance,
        "e2e": bench_e2e,
    }
    # balance runs before assign (assign reuses its tree); results are printed in BENCHES order.
    order = [b for b in ("embed", "tree", "balance", "assign", "e2e") if b in selected]
    all_rows: dict[str, list[dict]] = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in order:
        waited = wait_quiet(args.wait_quiet)
        t0 = time.perf_counter()
        log(f"=== {name} (load average {loadavg()})")
        res, rows = fns[name](S, ctx)
        res["waited_for_quiet_s"] = waited
        res["bench_seconds"] = round(time.perf_counter() - t0, 1)
        results["benchmarks"][name] = res
        all_rows[name] = rows
        results["rows"] = [r for b in BENCHES if b in all_rows for r in all_rows[b]]
        write_results(results, out)  # partial results survive
        log(f"=== {name} done in {res['bench_seconds']}s")
    return finish(results, out, print_table)


if __name__ == "__main__":
    sys.exit(main())
