"""Cost of a write into a full context bank (memstore/context/bank.py): exact vs cluster-scoped
merging.

    .venv/bin/python -m bench.systems.context_bank --quick      # < 1 min: N = 256, 1,024
    .venv/bin/python -m bench.systems.context_bank              # N = 256 … 4,096
    .venv/bin/python -m bench.systems.context_bank --sizes 512 --latent 16 --dim 256 --writes 32

A bank is filled to its capacity N (entries of --latent tokens × --dim, Gaussian clusters so the
k-means clusters mean something), then --writes appends are timed: each one merges a pair first.
merge_scope "all" searches every pair (the exact rule: O(N²·L·d) per write); "cluster" searches
pairs inside one k-means cluster (§10.2; k = --clusters, default √N) with per-cluster distances
cached until the cluster changes. Both runs are in the same process; the ratio all / cluster is
printed per N, with how often the cluster-scoped merge picked a pair no farther apart than the
exact one would have (the exact pair is recomputed on a copy, untimed). Wall clock on the CPU,
--threads torch threads (default 1). The JSON (`--out`, default
bench/systems/results/context-bank-<date>.json) holds every figure.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as _dt
import math
import statistics
import time

import torch

from bench.common import finish, log, results_dir, results_path, run_meta
from memtree.memstore.context.bank import ContextBank, ContextBankConfig

# The columns of the printed table.
COLUMNS = [
    "n",
    "clusters",
    "all_ms",
    "cluster_ms",
    "speedup",
    "exact_pair_found",
    "distance_vs_exact_median",
]


def _fill(cfg: ContextBankConfig, n: int, seed: int) -> ContextBank:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(cfg.n_clusters, 1, cfg.dim, generator=g) * 3.0  # (k, 1, d)
    bank = ContextBank(cfg)
    for i in range(n):
        c = centers[i % cfg.n_clusters]
        bank.append(c + torch.randn(cfg.n_latent, cfg.dim, generator=g), session="fill")
    bank.recluster()
    return bank


def run(n: int, args: argparse.Namespace) -> dict:
    k = args.clusters or max(2, round(math.sqrt(n)))
    row: dict = {
        "n": n,
        "clusters": k,
        "latent": args.latent,
        "dim": args.dim,
        "writes": args.writes,
    }
    g = torch.Generator().manual_seed(1)
    new = [torch.randn(args.latent, args.dim, generator=g) * 3.0 for _ in range(args.writes)]
    for scope in ("all", "cluster"):
        cfg = ContextBankConfig(
            dim=args.dim, n_latent=args.latent, capacity=n, n_clusters=k, top_k=1, merge_scope=scope
        )
        bank = _fill(cfg, n, seed=0)
        times, ratios = [], []
        for x in new:
            if (
                scope == "cluster"
            ):  # how far apart the scoped pair is, against the exact closest pair
                ref = copy.deepcopy(bank)
                ref.cfg = dataclasses.replace(cfg, merge_scope="all")
                exact = ref._closest_pair()[2]
            t = time.perf_counter()
            bank.append(x, session="w")
            times.append(time.perf_counter() - t)
            if scope == "cluster":
                ratios.append(bank.log[-1]["distance"] / max(exact, 1e-12))
        row[f"{scope}_ms"] = 1000 * statistics.median(times)
        if scope == "cluster":
            row["distance_vs_exact_median"] = statistics.median(ratios)
            row["exact_pair_found"] = sum(r <= 1.0 + 1e-9 for r in ratios) / len(ratios)
        log(f"N={n} k={k} {scope}: {row[f'{scope}_ms']:.2f} ms per write")
    row["speedup"] = row["all_ms"] / row["cluster_ms"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", default=None, help="comma-separated capacities N")
    p.add_argument("--latent", type=int, default=16)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--clusters", type=int, default=0, help="k (0: √N)")
    p.add_argument("--writes", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else ([256, 1024] if args.quick else [256, 1024, 4096])
    )
    day = _dt.date.today().isoformat()
    out = results_path(
        args.out, f"context-bank-{day}{'-quick' if args.quick else ''}.json", results_dir(__file__)
    )
    results = {"meta": run_meta(args, threads=args.threads), "rows": [run(n, args) for n in sizes]}
    return finish(results, out, COLUMNS)


if __name__ == "__main__":
    raise SystemExit(main())
