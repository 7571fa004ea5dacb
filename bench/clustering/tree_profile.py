"""Where the tree build's time goes, beside FAISS's `two_level_clustering` (issue 71's profile).

    # 100,000 points, 3 × 16 = 4,096 leaves
    .venv/bin/python -m bench.clustering.tree_profile
    .venv/bin/python -m bench.clustering.tree_profile --n 20000 --levels 2

On `gmm_hierarchy(n, seed)` (bench/pipeline/common.py, the tree targets' data), in one process:
1. each BLAS's sgemm GFLOP/s at the node fits' shapes (one thread; `clustering.gemm.measure`) and
   at a large square (2,048², all threads), so a reader sees the host kind a figure came from;
2. `build_tree` wall time on the pipeline's thread count and on one thread, per level;
3. the one-thread build under cProfile: seconds per part of the fit (the node fits' GEMMs, the
   nearest-centroid argmin and its float64 rescoring, the App. C split rule, the cell equalisation,
   k-means++, restarts' distortion, the routing of each level) and the GEMMs' own GFLOP/s, counted
   by timing every `clustering.gemm.matmul` call with its shape;
4. `faiss.contrib.clustering.two_level_clustering` the same way (its time is FAISS's: k-means
   training and flat searches, on FAISS's OpenMP threads).
JSON: --out, default bench/clustering/results/tree-profile-<date>.json.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import itertools
import pstats
import time
import warnings
from collections import defaultdict

from bench.common import (
    finish,
    host_gemm,
    log,
    results_dir,
    results_path,
    run_meta,
)
from bench.pipeline.common import gmm_hierarchy
from memtree.clustering import gemm
from memtree.clustering import kmeans as km
from memtree.clustering.tree import build_tree, fit_level, level_cell_size, level_cell_slack

# cProfile's "file:function" (own time, callees excluded) → the part of the fit it is; first match
PARTS = (
    ("torch.mm", "GEMM"),
    ("gemm.py:", "GEMM"),
    ("tree_profile.py:timed", "GEMM"),
    ("from_numpy", "GEMM"),
    ("kmeans.py:next_batch", "drawing each step's batch"),
    ("kmeans.py:_nearest", "nearest centroid (argmin, float64 rescoring)"),
    ("argmin", "nearest centroid (argmin, float64 rescoring)"),
    ("partition", "nearest centroid (argmin, float64 rescoring)"),
    ("kmeans.py:seed", "k-means++"),
    ("kmeans_pp", "k-means++"),
    ("kmeans.py:balance", "App. C split rule"),
    ("kmeans.py:counts", "App. C split rule"),
    ("equaliz", "cell equalisation"),
    ("relocate", "cell equalisation"),
    ("kmeans.py:rows_of", "cell equalisation"),
    ("distortion", "restarts: distortion"),
    ("route_core.py", "routing each level"),
    ("fvec_inner", "routing each level"),
    ("kmeans.py:", "the EM loop's own Python (kmeans.py)"),
    ("tree.py:", "the tree's own Python (tree.py)"),
)


def part_of(function: str) -> str:
    return next((part for key, part in PARTS if key in function), "other (numpy, Python)")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=37)
    ap.add_argument("--levels", type=int, default=3)
    ap.add_argument("--branching", type=int, default=16)
    ap.add_argument("--gemm", default="auto", choices=["auto", *gemm.BACKENDS])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    meta = run_meta(args)
    x, _ = gmm_hierarchy(args.n, args.seed, levels=args.levels, branching=args.branching)
    from memtree.clustering.blas import best_gemm

    backend = best_gemm() if args.gemm == "auto" else args.gemm
    host = host_gemm()
    node, square = host["node_measure"], host["square_2048_gflops_all_threads"]
    log(f"the fits run on {backend}")

    n, dim, B = x.shape[0], x.shape[1], args.branching

    def in_this_thread(level, nodes, parent_c, *, strict):
        # build_tree's own fitter, without its thread pool, so that cProfile sees the fit: one
        # fit_level per level with the caps the default fitter gives (the same tree, its docstring)
        with gemm.using(backend), km.single_threaded():
            return fit_level(
                x,
                nodes,
                parent_c[[p for p, _ in nodes]],
                branching=B,
                min_points_per_child=2,
                batch_size=6400,
                steps=20,
                balance_factor=1.1,
                equalize_steps=40,
                seed=0,
                level=level,
                cell_size=level_cell_size(n, B, level),
                cell_slack=level_cell_slack(1.1, level, args.levels, strict),
                strict_balance=strict,
            )

    def build(n_jobs: int, fit_nodes=None):
        marks = [time.perf_counter()]
        build_tree(
            x,
            fit_nodes=fit_nodes,
            levels=args.levels,
            branching=args.branching,
            gemm_backend=backend,
            n_jobs=n_jobs,
            on_level=lambda lv: marks.append(time.perf_counter()),
        )
        return [b - a for a, b in itertools.pairwise(marks)]

    build(2)  # warm: imports, the GEMM backend's first call
    wall2 = build(2)
    log(f"build_tree, 2 threads: {sum(wall2):.2f} s, per level {[round(s, 2) for s in wall2]}")

    # Every GEMM of the fit, timed with its shape (one thread: all of them on this thread).
    calls: dict[str, list[float]] = defaultdict(
        lambda: [0, 0.0, 0.0]
    )  # shape class → [calls, s, flops]
    inner = gemm.matmul

    def timed(a, b, out):
        t = time.perf_counter()
        r = inner(a, b, out)
        m, k = a.shape
        cls = (
            "x·cᵀ, nearest centroids"
            if k == dim
            else "xᵀ·onehot, cluster sums"
            if m == dim
            else f"other ({m} × {k} × {b.shape[1]})"
        )
        c = calls[cls]
        c[0], c[1], c[2] = c[0] + 1, c[1] + time.perf_counter() - t, c[2] + 2.0 * m * k * b.shape[1]
        return r

    gemm.matmul = timed
    try:
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        wall1 = build(1, in_this_thread)
        prof.disable()
        total1 = time.perf_counter() - t0
    finally:
        gemm.matmul = inner
    stats = pstats.Stats(prof)
    parts: dict[str, float] = defaultdict(float)
    top = []
    entries = stats.stats.items()  # type: ignore[attr-defined]
    for (file, _, name), (_, ncalls, tottime, cumtime, _) in entries:
        fn = f"{file.split('/')[-1]}:{name}"
        parts[part_of(fn)] += tottime
        top.append(
            {
                "function": fn,
                "part": part_of(fn),
                "calls": ncalls,
                "own_s": tottime,
                "cum_s": cumtime,
            }
        )
    top.sort(key=lambda r: -r["own_s"])
    gemms = [
        {"shape": k, "calls": int(v[0]), "seconds": v[1], "gflops": v[2] / max(v[1], 1e-12) / 1e9}
        for k, v in sorted(calls.items(), key=lambda kv: -kv[1][1])
    ]
    log(
        f"build_tree, 1 thread (profiled): {total1:.2f} s, per level {[round(s, 2) for s in wall1]}"
    )
    for g in gemms:
        log(
            f"  GEMM {g['shape']}: {g['calls']} calls, {g['seconds']:.2f} s, {g['gflops']:.1f} "
            "GFLOP/s"
        )

    import faiss
    from faiss.contrib.clustering import two_level_clustering

    k1 = 64 if args.levels == 3 else 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        two_level_clustering(x, k1, args.branching**args.levels)
        two = time.perf_counter() - t
        fprof = cProfile.Profile()
        fprof.enable()
        two_level_clustering(x, k1, args.branching**args.levels)
        fprof.disable()
    fstats = pstats.Stats(fprof)
    ftop = sorted(
        (
            {"function": f"{f.split('/')[-1]}:{n}", "calls": c, "own_s": tt, "cum_s": ct}
            for (f, _, n), (_, c, tt, ct, _) in fstats.stats.items()
        ),  # type: ignore[attr-defined]
        key=lambda r: -r["own_s"],
    )[:12]
    log(f"two_level_clustering ({faiss.omp_get_max_threads()} FAISS threads): {two:.2f} s")

    rows = [
        {"part": p, "seconds_1_thread": s, "share": s / max(sum(parts.values()), 1e-12)}
        for p, s in sorted(parts.items(), key=lambda kv: -kv[1])
    ]
    results = {
        "meta": {
            **meta,
            "n": args.n,
            "levels": args.levels,
            "branching": args.branching,
            "gemm": backend,
            "node_gemm": node,
            "square_sgemm_gflops": square,
        },
        "build_2_threads_s": wall2,
        "build_1_thread_s": wall1,
        "two_level_s": two,
        "gemms": gemms,
        "rows": rows,
        "top": top[:25],
        "two_level_top": ftop,
        "ratio_two_level_over_tree_2_threads": two / sum(wall2),
    }
    day = _dt.date.today().isoformat()
    return finish(
        results,
        results_path(args.out, f"tree-profile-{day}.json", results_dir(__file__)),
        ["part", "seconds_1_thread", "share"],
    )


if __name__ == "__main__":
    raise SystemExit(main())
