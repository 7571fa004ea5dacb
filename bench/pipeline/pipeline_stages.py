"""Benchmarks of the clustering pipeline's stages, each against its baseline in the same run.

    # full run (~14 min on 2 idle CPU cores)
    .venv/bin/python -m bench.pipeline.pipeline_stages
    # small variant (a few minutes)
    .venv/bin/python -m bench.pipeline.pipeline_stages --quick
    .venv/bin/python -m bench.pipeline.pipeline_stages --only tree --out /tmp/tree.json

Benchmarks (see bench/README.md for what each one compares), one module each:

  embed    pipeline Dask embed path (run_pipeline(..., until="embed"), `embed_seconds`)
           vs SentenceTransformer.encode on the same window texts           target >= 0.9x
           (embed.py)
  tree     clustering.tree.build_tree (3 levels x 16) vs flat faiss.Kmeans (4,096 centroids):
           speed (target >= 5x) and leaf NMI / purity (target: hierarchical within 5% of flat)
           (tree.py)
  assign   greedy clustering.route.route vs exhaustive nearest leaf (faiss.IndexFlatL2) at
           65,536 leaves: throughput ratio (target >= 100x) and agreement rate
           (assign.py)
  balance  max/mean cluster size per level of a default-TreeConfig tree  target <= 1.2
           (tree.py)
  e2e      end-to-end run_pipeline documents/second and peak RSS of the process tree
           (e2e.py)

Their shared helpers (rows, synthetic data, corpus files, configs, the RSS sampler) are in
common.py. Every figure written to the JSON (`--out`) says which data it was measured
on. Nothing is extrapolated: a figure is either measured here or absent.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.common import (
    baseline_health,
    command_line,
    faiss_l2_gflops,
    finish,
    loadavg,
    log,
    machine_basics,
    machine_meta,
    prepare_blas_env,
    print_targets,
    results_dir,
    results_path,
    sgemm_gflops,
    wait_quiet,
    write_results,
)
from bench.pipeline.assign import bench_assign
from bench.pipeline.common import n_cores
from bench.pipeline.e2e import bench_e2e
from bench.pipeline.embed import bench_embed
from bench.pipeline.tree import bench_balance, bench_tree

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


# ------------------------------------------------------------------------------------- main
def print_table(rows: list[dict]) -> None:
    print_targets(rows, data_width=60)


def machine() -> dict:
    return machine_basics(cores=n_cores())


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The arguments and the sizes, --set overrides applied."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small, fast variant")
    ap.add_argument(
        "--only", choices=BENCHES, action="append", help="run only this benchmark (repeatable)"
    )
    ap.add_argument(
        "--out", default=None, help="JSON (default bench/pipeline/results/pipeline-DATE.json)"
    )
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
    ap.add_argument(
        "--blas",
        choices=("auto", "as-is"),
        default="auto",
        help="auto: unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE for this command and give FAISS's "
        "OpenBLAS the kernel the CPU can run when it picked a fallback (bench/README.md); "
        "as-is: change nothing (to reproduce a handicapped run)",
    )
    args = ap.parse_args(argv)
    S = sizes(args.quick)
    for kv in args.set:
        key, _, val = kv.partition("=")
        if key not in S:
            ap.error(f"--set {kv}: unknown size {key!r}; sizes: {sorted(S)}")
        S[key] = json.loads(val) if val[:1] in "[{" or val.replace(".", "", 1).isdigit() else val
        if isinstance(S[key], list) and S[key] and isinstance(S[key][0], list):
            S[key] = [tuple(v) for v in S[key]]
    return args, S


def mark_handicapped(rows: list[dict], health: dict) -> None:
    """No speed-up is claimed against a FAISS baseline running far below the machine's sgemm."""
    if health["healthy"]:
        return
    for r in rows:
        if r["bench"] in ("tree", "assign") and r["ratio"] is not None and r["target"]:
            r["met"] = None
            r["target"] += (
                f" (not judged: FAISS ran at {health['fraction_of_sgemm']:.0%} of sgemm, "
                "a handicapped baseline)"
            )


def main(argv: list[str] | None = None) -> int:
    args, S = parse_args(argv)
    prepare_blas_env(args.blas)  # may re-execute this command with a healthier BLAS environment
    log("baseline health: sgemm and FAISS's exhaustive L2 search, GFLOP/s")
    health = baseline_health(
        "faiss IndexFlatL2 search (k-means assignment, exhaustive routing)",
        faiss_l2_gflops(),
        sgemm_gflops(),
    )
    log(f"  {health}")
    selected = args.only or list(BENCHES)
    ctx: dict[str, Any] = {"cache": Path(args.cache_dir), "tmp": args.tmp}
    if args.tmp:
        Path(args.tmp).mkdir(parents=True, exist_ok=True)
    started = _dt.datetime.now().astimezone()
    results: dict[str, Any] = {
        "meta": {
            "command": command_line(),
            "started": started.isoformat(timespec="seconds"),
            "quick": args.quick,
            "machine": machine(),
            "host": machine_meta(),
            "sizes": S,
            "loadavg_start": loadavg(),
        },
        "health": health,
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
    out = results_path(
        args.out, f"pipeline-{_dt.date.today().isoformat()}.json", results_dir(__file__)
    )
    for name in order:
        waited = wait_quiet(args.wait_quiet)
        t0 = time.perf_counter()
        log(f"=== {name} (load average {loadavg()})")
        res, rows = fns[name](S, ctx)
        res["waited_for_quiet_s"] = waited
        res["bench_seconds"] = round(time.perf_counter() - t0, 1)
        results["benchmarks"][name] = res
        mark_handicapped(rows, health)
        all_rows[name] = rows
        results["rows"] = [r for b in BENCHES if b in all_rows for r in all_rows[b]]
        write_results(results, out)  # partial results survive
        log(f"=== {name} done in {res['bench_seconds']}s")
    return finish(results, out, print_table)


if __name__ == "__main__":
    sys.exit(main())
