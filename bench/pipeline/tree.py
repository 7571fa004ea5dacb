"""The `tree` and `balance` benchmarks of bench/pipeline/pipeline_stages.py:
clustering.tree.build_tree against flat faiss.Kmeans (speed, leaf NMI / purity), and the max/mean
cluster size per level of a default-TreeConfig tree."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import loadavg, log, row
from bench.pipeline.common import corpus_docs, gmm_sphere
from memtree.clustering.embed import embed_texts, load_embedder
from memtree.clustering.tree import build_tree, level_stats
from memtree.config import to_dict
from memtree.pipeline.config import TreeConfig


# ---------------------------------------------------------------------------------- helpers
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
    m = load_embedder(device="cpu", max_seq_length=max_seq_length)
    log(f"embedding {n} corpus documents (max_seq_length={max_seq_length}) for the quality set")
    t0 = time.perf_counter()
    x = embed_texts(m, [d["text"] for d in docs], strategy="truncate", batch_size=64)
    secs = time.perf_counter() - t0
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(cache, x)
    return {"x": x, "labels": labels, "domains": domains, "seconds": round(secs, 2), "cached": None}


# ------------------------------------------------------------------------------------- tree
def _tree_speed(S: dict) -> tuple[dict, list[dict]]:
    """Build time of build_tree against flat k-means with as many centroids, interleaved, and
    their leaf quality, on the synthetic mixture."""
    L, B, niter = S["tree_levels"], S["tree_branching"], S["kmeans_niter"]
    k = B**L
    n = S["tree_speed_points"]
    rows: list[dict] = []
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
    return speed, rows


def _tree_quality(S: dict, q: dict) -> tuple[dict, list[dict]]:
    """Leaf NMI / purity of build_tree against flat k-means on real MiniLM embeddings, at trees
    whose leaf count a flat k-means of that many points can have."""
    niter = S["kmeans_niter"]
    xr, labr = q["x"], q["labels"]
    rows: list[dict] = []
    quality = {
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
        quality["trees"].append(t)
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
    return quality, rows


def bench_tree(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    res: dict[str, Any] = {"loadavg_start": loadavg()}
    # speed (and quality) on the synthetic mixture
    res["speed_synthetic"], rows = _tree_speed(S)
    # quality on real MiniLM embeddings of the synthetic corpus
    q = real_embeddings(S["quality_docs"], S["quality_max_seq_length"], ctx["cache"])
    res["quality_real"], quality_rows = _tree_quality(S, q)
    ctx["real_quality"] = q
    res["loadavg_end"] = loadavg()
    return res, rows + quality_rows


# ---------------------------------------------------------------------------------- balance
def balance_tree(S: dict, ctx: dict) -> dict:
    """The default-TreeConfig tree on synthetic data (built once per run, shared with assign)."""
    if "balance_tree" in ctx:
        return ctx["balance_tree"]
    tc = TreeConfig(levels=S["balance_levels"], branching=S["balance_branching"])
    n = S["balance_points"]
    x, _ = gmm_sphere(n, seed=2)
    log(
        f"balance: build_tree {tc.levels}x{tc.branching} (TreeConfig defaults otherwise) on {n} "
        "points"
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
