"""Issue #37's targets in one run: embedding, tree build and routing, each against a healthy
baseline.

    # the issue's sizes (~6 minutes on 2 cores)
    .venv/bin/python -m bench.pipeline.pipeline_targets
    # small sizes, to check the script (~1 minute)
    .venv/bin/python -m bench.pipeline.pipeline_targets --quick

One process measures, in this order:
- the baselines' health: FAISS's exhaustive L2 search (the kernel of flat k-means' assignment and
  of exhaustive routing) and torch's float32 matmul (the kernel of raw `encode`), each against a
  plain numpy sgemm in the same run (`bench.common.baseline_health`). No speed-up is claimed against
  a handicapped baseline: its row's ratio is left empty and its target reads "-".
- tree (bench/clustering/tree_targets.py's `measure`): `build_tree(x, levels=3, branching=16)` on
  `gmm_hierarchy(100000, seed)` against flat `faiss.Kmeans` with as many centroids and against
  `two_level_clustering` (64 → 4,096), each then assigning every point; NMI, balance per level,
  balancing's share of the build; and the balance target again on skewed data
  (`skewed_balance`: Zipf-weighted blobs, 3 × 8 and 4 × 8 trees with small leaves).
- routing (bench/clustering/routing.py's `measure`): `route` at 65,536 leaves, 20,000 queries,
against
  `IndexFlatL2` exhaustive search; agreement with the float64 level-by-level argmin.
- embedding (bench/clustering/embed_backends.py's `measure`): the int8 OpenVINO backend against raw
  `SentenceTransformer.encode` at the pipeline's settings (max_seq_length 256; one thread per
  worker, and two), cosine to the torch embeddings.

Prints one table (measured, baseline, ratio, target, met) and writes it with every run's seconds
and the machine's BLAS / OpenMP runtimes to --out (default
bench/pipeline/results/pipeline-targets-<date>.json). BLAS environment: bench/README.md (`--blas
auto` unsets OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE for this command and corrects FAISS's fallback
kernel).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os

from bench.clustering import embed_backends, routing, tree_targets
from bench.common import (
    EMULATIONS,
    baseline_health,
    emulate_blas,
    faiss_l2_gflops,
    finish,
    host_gemm,
    log,
    prepare_blas_env,
    print_targets,
    results_dir,
    results_path,
    run_meta,
    sgemm_gflops,
    torch_sgemm_gflops,
)
from memtree.clustering import gemm

TREE_SPEEDUP, TWO_LEVEL_SPEEDUP, NMI_VS_FLAT, BALANCE = 5.0, 1.0, 0.95, 1.2
ROUTE_SPEEDUP, EMBED_SPEEDUP, EMBED_COSINE = 100.0, 2.0, 0.996


def _met(ok: bool | None) -> str:
    return "-" if ok is None else "yes" if ok else "no"


def target_rows(
    tree: dict, route: dict, embed: dict | None, health: dict, data: dict
) -> list[dict]:
    """The issue's targets as `print_targets` rows: {bench, metric, value, unit, baseline, ratio,
    target, met, data}. A ratio against a handicapped baseline is None and its target unjudged."""
    faiss_ok, torch_ok = health["faiss"]["healthy"], health["torch"]["healthy"]
    t = {r["method"]: r for r in tree["rows"]}
    mt, flat, two = t["build_tree (defaults)"], t["faiss.Kmeans flat"], t["two_level_clustering"]
    levels = sum(1 for k in mt if k.startswith("balance_l"))
    worst_balance = max(mt[f"balance_l{lv}"] for lv in range(1, levels + 1))
    r = {x["method"]: x for x in route["rows"]}
    rows = []

    def add(bench, metric, value, unit, baseline, ratio, target, ok, about):
        rows.append(
            {
                "bench": bench,
                "metric": metric,
                "value": value,
                "unit": unit,
                "baseline": baseline,
                "ratio": ratio,
                "target": target,
                "met": _met(ok),
                "data": about,
            }
        )

    speed = (lambda a, b: a / b) if faiss_ok else (lambda a, b: None)
    vs_flat = speed(flat["seconds"], mt["seconds"])
    vs_two = speed(two["seconds"], mt["seconds"])
    add(
        "tree",
        "build_tree vs flat faiss.Kmeans",
        mt["seconds"],
        "s",
        flat["seconds"],
        vs_flat,
        f">= {TREE_SPEEDUP:g}x",
        None if vs_flat is None else vs_flat >= TREE_SPEEDUP,
        data["tree"],
    )
    add(
        "tree",
        "build_tree vs two_level_clustering",
        mt["seconds"],
        "s",
        two["seconds"],
        vs_two,
        f">= {TWO_LEVEL_SPEEDUP:g}x",
        None if vs_two is None else vs_two >= TWO_LEVEL_SPEEDUP,
        data["tree"],
    )
    if (
        tree_targets.NUMPY_GEMM in t
    ):  # the same build on numpy's GEMM: what the GEMM choice is worth
        on_np = t[tree_targets.NUMPY_GEMM]
        add(
            "tree",
            "build_tree on numpy's GEMM vs flat faiss.Kmeans",
            on_np["seconds"],
            "s",
            flat["seconds"],
            speed(flat["seconds"], on_np["seconds"]),
            "- (before the GEMM choice)",
            None,
            data["tree"],
        )
    add(
        "tree",
        "leaf NMI vs flat",
        mt["nmi"],
        "",
        flat["nmi"],
        mt["nmi"] / flat["nmi"],
        f">= {NMI_VS_FLAT:g}x",
        mt["nmi"] >= NMI_VS_FLAT * flat["nmi"],
        data["tree"],
    )
    add(
        "tree",
        "leaf NMI vs two-level",
        mt["nmi"],
        "",
        two["nmi"],
        mt["nmi"] / two["nmi"],
        "> 1x",
        mt["nmi"] > two["nmi"],
        data["tree"],
    )
    add(
        "tree",
        f"leaf balance, worst of {levels} levels",
        worst_balance,
        "",
        two[f"balance_l{levels}"],
        None,
        f"<= {BALANCE:g}",
        worst_balance <= BALANCE,
        "baseline: two-level's leaves",
    )
    for sk in tree.get("skewed", []):
        add(
            "tree",
            f"leaf balance, worst level, skewed data ({sk['points_per_leaf']:.1f} points per "
            "leaf), "
            f"{sk['mode']}",
            max(sk["balance"]),
            "",
            None,
            None,
            f"<= {BALANCE:g}",
            max(sk["balance"]) <= BALANCE,
            sk["data"],
        )
    add(
        "tree",
        "balancing's share of the build (equalisation, refits)",
        tree["equalize_share"],
        "",
        None,
        None,
        "bounded",
        None,
        data["tree"],
    )
    vs_exh = speed(r["exhaustive"]["seconds"], r["route"]["seconds"])
    add(
        "route",
        "route vs IndexFlatL2 exhaustive",
        r["route"]["seconds"],
        "s",
        r["exhaustive"]["seconds"],
        vs_exh,
        f">= {ROUTE_SPEEDUP:g}x",
        None if vs_exh is None else vs_exh >= ROUTE_SPEEDUP,
        data["route"],
    )
    agree = route["agreement_with_float64_argmin"]
    add(
        "route",
        "paths = float64 argmin",
        agree,
        "",
        None,
        None,
        "1.000",
        agree == 1.0,
        data["route"],
    )
    if embed is None:  # --no-embed
        return rows
    cos = embed["cosine"]["min"]
    for row in embed["rows"]:
        ratio = row["speedup"] if torch_ok else None
        add(
            "embed",
            f"int8 vs encode, {row['setting']}",
            row["int8_docs_per_s"],
            "docs/s",
            row["torch_docs_per_s"],
            ratio,
            f">= {EMBED_SPEEDUP:g}x",
            None if ratio is None else ratio >= EMBED_SPEEDUP,
            data["embed"],
        )
    add(
        "embed",
        "cosine int8 vs torch, min",
        cos,
        "",
        None,
        None,
        f">= {EMBED_COSINE:g}",
        cos >= EMBED_COSINE,
        data["embed"],
    )
    return rows


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="20,000 points 2 x 16, 4,096 leaves, 200 docs"
    )
    p.add_argument("--seed", type=int, default=37, help="the mixture's seed (tuning used 4242)")
    p.add_argument("--tree-repeats", type=int, default=3)
    p.add_argument("--route-repeats", type=int, default=5)
    p.add_argument("--embed-rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--blas",
        choices=("auto", "as-is"),
        default="auto",
        help="auto: a healthy BLAS environment for the FAISS baselines (bench/README.md)",
    )
    p.add_argument(
        "--gemm",
        choices=("auto", *gemm.BACKENDS),
        default="auto",
        help="the node fits' GEMM (clustering.gemm); auto: the fastest, measured once, as the "
        "pipeline does",
    )
    p.add_argument(
        "--no-embed",
        action="store_true",
        help="leave out the embedding targets (tree and routing only)",
    )
    p.add_argument(
        "--emulate",
        choices=EMULATIONS,
        default=None,
        help="another host's BLAS on this one (bench.common.emulate_blas): faiss-fallback, FAISS's "
        "OpenBLAS on Prescott (the Intel Xeon of issue #56); slow-numpy-blas, numpy's on "
        "Prescott; either also times the tree on numpy's GEMM",
    )
    args = p.parse_args()
    emulation = emulate_blas(args.emulate) if args.emulate else None
    if emulation is None:
        prepare_blas_env(args.blas)  # may re-execute this command
    import faiss

    meta = run_meta(
        args, emulation=emulation
    )  # at the start: when the run began, and the load then
    sgemm = sgemm_gflops()
    if emulation is not None and args.emulate == "slow-numpy-blas":
        # numpy's sgemm is the handicapped one here: judge the baselines against torch's
        emulation["numpy_sgemm_gflops"], sgemm = round(sgemm, 1), torch_sgemm_gflops()
        emulation["reference_sgemm"] = f"torch's, {sgemm:.1f} GFLOP/s"
    if emulation is not None:
        log(f"emulation: {emulation}")
    health = {
        "faiss": baseline_health("faiss IndexFlatL2 search", faiss_l2_gflops(), sgemm),
        "torch": baseline_health(
            "torch float32 matmul (encode's GEMMs)", torch_sgemm_gflops(), sgemm
        ),
    }
    log(f"baseline health: {health}")
    host = host_gemm()  # which host kind the figures come from: each BLAS at the node shapes
    if args.quick:
        tree_size, route_size, embed_size = (20_000, 2), (4, 8, 2_000), (200, 128)
    else:
        tree_size, route_size, embed_size = (100_000, 3), (4, 16, 20_000), (1_000, 512)
    tree = tree_targets.measure(
        n=tree_size[0],
        seed=args.seed,
        levels=tree_size[1],
        repeats=args.tree_repeats,
        healthy=health["faiss"]["healthy"],
        gemm_backend=args.gemm,
        numpy_row=emulation is not None,
    )
    log(f"node fits' GEMM: {tree['gemm']}")
    tree["skewed"] = tree_targets.skewed_balance(
        seed=args.seed, sizes=((4_000, 2),) if args.quick else tree_targets.SKEWED
    )
    route = routing.measure(
        levels=route_size[0],
        branching=route_size[1],
        nq=route_size[2],
        repeats=args.route_repeats,
        healthy=health["faiss"]["healthy"],
    )
    embed = (
        None
        if args.no_embed
        else embed_backends.measure(
            n_docs=embed_size[0],
            timed=embed_size[1],
            settings=[(256, 1), (256, 2)],
            rounds=args.embed_rounds,
            quality=False,
        )
    )
    data = {
        "tree": f"gmm_hierarchy({tree_size[0]:,}, seed={args.seed}), {tree_size[1]} x 16, "
        f"median of {args.tree_repeats}, GEMM {tree['gemm']}"
        + (f", EMULATED {args.emulate}" if emulation else ""),
        "route": f"{route_size[1]}^{route_size[0]} leaves, {route_size[2]:,} queries, "
        f"median of {args.route_repeats}",
        "embed": f"{embed_size[1]} synthetic docs timed, cosine over {embed_size[0]}",
    }
    rows = target_rows(tree, route, embed, health, data)
    results = {
        "meta": {**meta, "faiss_threads": faiss.omp_get_max_threads(), "data_seed": args.seed},
        "health": health,
        "host_gemm": host,
        "rows": rows,
        "tree": tree,
        "route": route,
        "embed": embed,
    }
    day = _dt.date.today().isoformat()
    out = results_path(
        args.out,
        f"pipeline-targets-{day}{'-quick' if args.quick else ''}.json",
        results_dir(__file__),
    )
    return finish(results, out, print_targets)


if __name__ == "__main__":
    raise SystemExit(main())
