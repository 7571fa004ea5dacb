"""Greedy routing throughput at 65,536 leaves against exhaustive nearest-leaf search (issue #16).

    # 4 × 8 tree (4,096 leaves), 2,000 queries
    .venv/bin/python -m bench.clustering.routing --quick
    # 4 × 16 tree (65,536 leaves), 20,000 queries
    .venv/bin/python -m bench.clustering.routing

Candidate: `clustering.route.route` (FAISS's float32 per-pair dots against each point's
parent's children, points visiting the leaves sorted by cluster, float64 re-scoring of near ties).
Baselines in the same run, interleaved: exhaustive search over every leaf (`faiss.IndexFlatL2`,
index build included, as in bench/pipeline/pipeline_stages.py) and the previous routing step kept
here (`float64_route_step`: the same groups scored in float64, the centroids and points cast per
group). Agreement: the candidate's paths against that level-by-level float64 argmin (the issue's
criterion: 100 %) and its leaf against the exhaustive nearest leaf. The tree is the pipeline
benchmark's constructed one (bench/pipeline/assign.py: children = parent + noise, renormalised),
queries a random leaf plus noise. JSON: --out, default
bench/clustering/results/routing-<date>[-quick].json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import statistics
import time

import numpy as np

from bench.common import (
    baseline_health,
    faiss_l2_gflops,
    finish,
    log,
    prepare_blas_env,
    results_dir,
    results_path,
    run_meta,
    sgemm_gflops,
)
from bench.pipeline.assign import constructed_tree
from bench.pipeline.common import DIM
from memtree.clustering.route import route

# Idle time before each timed call, so that no method inherits the previous one's spinning thread
# pools: numpy's OpenBLAS workers (pthreads) spin ~2^28 cycles after a GEMM and FAISS's OpenMP
# threads then share a core with them. Measured on a 2-core AMD EPYC (2026-11-29): route took
# 40-41 ms right after float64_route's numpy GEMMs, 25-33 ms after exhaustive search.
IDLE_S = 0.3

# The columns of the printed table.
COLUMNS = ["leaves", "queries", "method", "seconds", "points_per_s", "route_speedup"]


def float64_route_step(centroids, valid, x, parent, branching):
    """The routing step before issue #16: per parent group, float64 scores ||c||² − 2·x·c."""
    n = x.shape[0]
    out = np.empty(n, dtype=np.int64)
    order = np.argsort(parent, kind="stable")
    sorted_parent = parent[order]
    starts = np.flatnonzero(np.r_[True, sorted_parent[1:] != sorted_parent[:-1]])
    ends = np.r_[starts[1:], n]
    for s, e in zip(starts, ends, strict=True):
        lo = int(sorted_parent[s]) * branching
        c = centroids[lo : lo + branching].astype(np.float64)
        rows = order[s:e]
        scores = (c * c).sum(1)[None, :] - 2.0 * (x[rows].astype(np.float64) @ c.T)
        scores[:, ~valid[lo : lo + branching]] = np.inf
        out[rows] = lo + np.argmin(scores, axis=1)
    return out


def float64_route(tree, x):
    parent = np.zeros(len(x), dtype=np.int64)
    paths = np.empty((len(x), tree.levels), dtype=np.int64)
    for lvl in range(tree.levels):
        parent = float64_route_step(tree.centroids[lvl], tree.valid[lvl], x, parent, tree.branching)
        paths[:, lvl] = parent
    return paths


def exhaustive(tree, x):
    import faiss

    index = faiss.IndexFlatL2(tree.dim)
    index.add(np.ascontiguousarray(tree.centroids[-1]))
    return index.search(np.ascontiguousarray(x), 1)[1][:, 0]


def query_points(tree, nq: int, seed: int = 8) -> np.ndarray:
    """(nq, DIM) unit queries: a random leaf centroid plus noise."""
    rng = np.random.default_rng(seed)
    leaf = rng.integers(0, len(tree.centroids[-1]), size=nq)
    xq = tree.centroids[-1][leaf] + 0.1 / math.sqrt(DIM) * rng.standard_normal((nq, DIM)).astype(
        np.float32
    )
    return (xq / np.linalg.norm(xq, axis=1, keepdims=True)).astype(np.float32)


def measure(*, levels: int, branching: int, nq: int, repeats: int, healthy: bool) -> dict:
    """`route` against the float64 level-by-level reference and exhaustive search, interleaved
    rounds: {rows, runs_seconds, agreement_with_float64_argmin, leaf_agreement_with_exhaustive}.
    No speed-up is given (route_speedup None) unless the FAISS baseline is `healthy`."""
    tree = constructed_tree(levels, branching, seed=7, radii=[0.6, 0.35, 0.2])
    xq = query_points(tree, nq)
    fns = {
        "route": lambda: route(tree, xq),
        "float64_route": lambda: float64_route(tree, xq),
        "exhaustive": lambda: exhaustive(tree, xq),
    }
    route(tree, xq)  # warm-up: first-touch of the tree's pages and the thread pools
    secs: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats):  # interleaved, order alternating
        for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            time.sleep(IDLE_S)
            t = time.perf_counter()
            fns[name]()
            secs[name].append(time.perf_counter() - t)
        log(f"routing round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in secs.items()))
    got, ref, exh = route(tree, xq), float64_route(tree, xq), exhaustive(tree, xq)
    med = {k: statistics.median(v) for k, v in secs.items()}
    rows = [
        {
            "leaves": branching**levels,
            "queries": nq,
            "method": k,
            "seconds": med[k],
            "points_per_s": nq / med[k],
            "route_speedup": med[k] / med["route"] if healthy else None,
        }
        for k in fns
    ]
    out = {
        "rows": rows,
        "runs_seconds": secs,
        "agreement_with_float64_argmin": float((got == ref).all(1).mean()),
        "leaf_agreement_with_exhaustive": float((got[:, -1] == exh).mean()),
    }
    log(
        "agreement with the float64 level-by-level argmin: "
        f"{out['agreement_with_float64_argmin']:.4f}; "
        f"leaf = exhaustive nearest leaf: {out['leaf_agreement_with_exhaustive']:.4f}"
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--blas",
        choices=("auto", "as-is"),
        default="auto",
        help="auto: a healthy BLAS environment for the FAISS baseline (bench/README.md)",
    )
    args = p.parse_args()
    prepare_blas_env(args.blas)  # may re-execute this command
    meta = run_meta(args)  # at the start: when the run began, and the load then
    health = baseline_health("faiss IndexFlatL2 search", faiss_l2_gflops(), sgemm_gflops())
    log(f"baseline health: {health}")
    levels, branching, nq = (4, 8, 2_000) if args.quick else (4, 16, 20_000)
    import faiss

    results = {
        "meta": {**meta, "faiss_threads": faiss.omp_get_max_threads()},
        "health": health,
        **measure(
            levels=levels,
            branching=branching,
            nq=nq,
            repeats=args.repeats,
            healthy=health["healthy"],
        ),
    }
    day = _dt.date.today().isoformat()
    out = results_path(
        args.out, f"routing-{day}{'-quick' if args.quick else ''}.json", results_dir(__file__)
    )
    return finish(results, out, COLUMNS)


if __name__ == "__main__":
    raise SystemExit(main())
