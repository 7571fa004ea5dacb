"""The `assign` benchmark of bench/pipeline/pipeline_stages.py: greedy clustering.route.route
against the exhaustive nearest leaf (faiss.IndexFlatL2) at 65,536 leaves, on a constructed tree and
on the built default-config tree of the balance benchmark (target: >= 100x throughput)."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from bench.common import loadavg, log, row
from bench.pipeline.common import DIM, gmm_sphere
from bench.pipeline.tree import balance_tree
from memtree.clustering.route import route
from memtree.clustering.tree import Tree


def constructed_tree(levels: int, branching: int, seed: int, radii: list[float]) -> Tree:
    """A random valid tree: level-1 centroids uniform on the sphere; every child is its parent
    plus Gaussian noise of norm ~radii[l-2], renormalised, so children cluster around parents
    (the geometry hierarchical k-means produces) and greedy routing can find the nearest leaf."""
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
        row(
            "assign",
            "agreement greedy leaf == exhaustive nearest leaf",
            r["agreement"],
            data=data,
            target="(info)",
        ),
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
