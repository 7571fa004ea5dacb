"""Lookup cost of the product-key memory layer (training/layers/pkm.py) against scoring every slot.

    .venv/bin/python -m bench.systems.pkm --quick       # N = 64², 128² (seconds)
    .venv/bin/python -m bench.systems.pkm               # N = 64² … 512² (262,144 slots)

Candidate: `ProductKeyMemory.lookup` (2·√N sub-key scores and k² candidates per token and head).
Baseline: `exhaustive_lookup`, the same top-k over all N full keys, same layer, same tokens, in
the same run, interleaved (candidate, baseline, baseline, candidate, …). Also checks that both
return the same slots (as sets; rows whose order differs by a float-rounding tie are counted).
Wall clock on the CPU, --threads torch threads (default 1), medians over
--repeats. The JSON (`--out`, default bench/systems/results/pkm-<date>[-quick].json) holds every
figure.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import time

import torch

from bench.common import finish, log, results_dir, results_path, run_meta
from memtree.training.layers.pkm import PKMConfig, ProductKeyMemory

# The columns of the printed table.
COLUMNS = [
    "slots",
    "tokens",
    "product_key_ms",
    "exhaustive_ms",
    "speedup",
    "same_slots",
    "rows_in_other_order",
]


def _ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t)


@torch.no_grad()
def run(n_keys: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    cfg = PKMConfig(n_keys=n_keys, heads=args.heads, k=args.k, key_dim=args.key_dim)
    layer = ProductKeyMemory(cfg, d_model=args.d_model)
    x = torch.randn(args.tokens, args.d_model)
    fast, full = layer.lookup(x), layer.exhaustive_lookup(x)
    # the same slots (as sets); the order can differ where two scores tie to float rounding
    # (s¹ + s² against one dot product with the concatenated key)
    same = bool(torch.equal(fast.indices.sort(-1).values, full.indices.sort(-1).values))
    order_diffs = int((fast.indices != full.indices).any(-1).sum())
    a, b = [], []
    for r in range(args.repeats):
        order = (
            (layer.lookup, layer.exhaustive_lookup)
            if r % 2 == 0
            else (layer.exhaustive_lookup, layer.lookup)
        )
        for fn in order:
            (a if fn == layer.lookup else b).append(_ms(lambda fn=fn: fn(x)))
    row = {
        "slots": cfg.n_slots,
        "n_keys": n_keys,
        "tokens": args.tokens,
        "product_key_ms": statistics.median(a),
        "exhaustive_ms": statistics.median(b),
        "same_slots": same,
        "rows_in_other_order": order_diffs,
        "rows": int(fast.indices[..., 0].numel()),
    }
    row["speedup"] = row["exhaustive_ms"] / row["product_key_ms"]
    log(
        f"N={cfg.n_slots:,}: product keys {row['product_key_ms']:.2f} ms, all slots "
        f"{row['exhaustive_ms']:.2f} ms"
    )
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--n-keys", default=None, help="comma-separated sub-keys per half (N = n²)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--key-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sizes = (
        [int(s) for s in args.n_keys.split(",")]
        if args.n_keys
        else ([64, 128] if args.quick else [64, 128, 256, 512])
    )
    day = _dt.date.today().isoformat()
    out = results_path(
        args.out, f"pkm-{day}{'-quick' if args.quick else ''}.json", results_dir(__file__)
    )
    results = {"meta": run_meta(args, threads=args.threads), "rows": [run(n, args) for n in sizes]}
    return finish(results, out, COLUMNS)


if __name__ == "__main__":
    raise SystemExit(main())
