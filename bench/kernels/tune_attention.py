"""Tile-size sweep of the memory-attention kernels on a GPU (the numbers behind Launch.choose).

    # moc and hkv shapes of bench/kernels/kernel_ops.py
    python -m bench.kernels.tune_attention
    python -m bench.kernels.tune_attention --scenario moc --runs 50

Each candidate launch (BLOCK_M, BLOCK_N, warps, stages) replaces Launch.choose for one
measurement; the output is checked against SDPA on the gathered blocks (relative error), and
forward and forward+backward are timed with triton.testing.do_bench (median, ms), the
baseline in the same run. CUDA only: the interpreter's timings mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

from bench.common import finish, log
from bench.kernels.kernel_ops import CUDA_SIZES, gather_sdpa, hkv_problem, moc_problem
from memtree.kernels.memory_attention import memory_attention

CANDIDATES = {
    "block_m": (64, 128),
    "block_n": (32, 64),
    "num_warps": (4, 8),
    "num_stages": (2, 3),
}


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def sweep(scenario: str, runs: int) -> list[dict]:
    from triton.testing import do_bench

    from memtree.kernels.memory_attention import kernel as K  # imports triton (GPU only)

    sz = CUDA_SIZES[scenario]
    p = (moc_problem if scenario == "moc" else hkv_problem)(sz, "cuda", torch.bfloat16)
    q, bk, bv, idx, dy = p["q"], p["bank_k"], p["bank_v"], p["idx"], p["dy"]
    b, h, s, d = q.shape
    t = bk.shape[1]
    flops = 4 * b * h * s * idx.shape[-1] * t * d
    ref = gather_sdpa(q, bk, bv, idx)

    def fwd_bwd(fn):
        leaves = [x.detach().requires_grad_() for x in (q, bk, bv)]
        fn(*leaves, idx).backward(dy)

    rows = [
        {
            "scenario": scenario,
            "variant": "sdpa_gather",
            "rel_err": 0.0,
            "forward_ms": do_bench(
                lambda: gather_sdpa(q, bk, bv, idx), rep=runs, return_mode="median"
            ),
            "fwd_bwd_ms": do_bench(lambda: fwd_bwd(gather_sdpa), rep=runs, return_mode="median"),
        }
    ]
    original = K.Launch.choose
    try:
        for bm, bn, w, st in itertools.product(*CANDIDATES.values()):
            if bn > t:
                continue
            cfg = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st}

            def choose(*a, _cfg=cfg, **kw):
                base = original(*a, **kw)
                return dataclasses.replace(base, **_cfg, even_t=t % _cfg["block_n"] == 0)

            K.Launch.choose = choose
            K.clear_caches()  # the per-shape launch cache would keep the last configuration's tiles
            row = {"scenario": scenario, "variant": "kernel", **cfg}
            try:
                out = memory_attention(q, bk, bv, idx)
                row["rel_err"] = _rel(out, ref)
                row["forward_ms"] = do_bench(
                    lambda: memory_attention(q, bk, bv, idx), rep=runs, return_mode="median"
                )
                row["fwd_bwd_ms"] = do_bench(
                    lambda: fwd_bwd(memory_attention), rep=runs, return_mode="median"
                )
            # out of shared memory or registers: recorded, not fatal
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
            log(row)
    finally:
        K.Launch.choose = original
        K.clear_caches()
    for r in rows:
        if "forward_ms" in r:
            r["forward_tflops"] = flops / r["forward_ms"] / 1e9
            r["fwd_bwd_tflops"] = 3.5 * flops / r["fwd_bwd_ms"] / 1e9
    return rows


def profile(scenario: str, out_dir: Path) -> None:
    """Where one forward+backward spends its time at the current Launch.choose: each CUDA
    kernel's device time against the host time of the whole call (plan() builds the
    reference table with torch ops, once per call in forward, no host syncs)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    from triton.testing import do_bench

    from memtree.kernels.memory_attention import kernel as K  # imports triton (GPU only)

    sz = CUDA_SIZES[scenario]
    p = (moc_problem if scenario == "moc" else hkv_problem)(sz, "cuda", torch.bfloat16)
    q, bk, bv, idx, dy = p["q"], p["bank_k"], p["bank_v"], p["idx"], p["dy"]
    leaves = [x.detach().requires_grad_() for x in (q, bk, bv)]
    plan_ms = do_bench(lambda: K.plan(q, bk, bv, idx, None), rep=25, return_mode="median")
    print(f"{scenario}: plan() alone {plan_ms:.3f} ms")
    for _ in range(3):
        memory_attention(*leaves, idx).backward(dy)
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            memory_attention(*leaves, idx).backward(dy)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
    print(table)
    (out_dir / f"profile-{scenario}.txt").write_text(table)


def print_table(all_rows: list[dict]) -> None:
    for sc in dict.fromkeys(r["scenario"] for r in all_rows):
        rows = [r for r in all_rows if r["scenario"] == sc and "forward_ms" in r]
        base = next(r for r in rows if r["variant"] == "sdpa_gather")
        print(
            f"\n{sc}: sdpa_gather fwd {base['forward_ms']:.3f} ms, "
            f"fwd+bwd {base['fwd_bwd_ms']:.3f} ms"
        )
        print("block_m block_n warps stages   fwd_ms  fwd_TF  fb_ms   fb_vs_sdpa  rel_err")
        for r in sorted(
            (r for r in rows if r["variant"] == "kernel"), key=lambda r: r["fwd_bwd_ms"]
        )[:12]:
            print(
                f"{r['block_m']:7d} {r['block_n']:7d} {r['num_warps']:5d} {r['num_stages']:6d}"
                f" {r['forward_ms']:8.3f} {r['forward_tflops']:7.1f} {r['fwd_bwd_ms']:7.3f}"
                f" {base['fwd_bwd_ms'] / r['fwd_bwd_ms']:9.2f}x {r['rel_err']:.1e}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=("moc", "hkv"), action="append")
    ap.add_argument("--runs", type=int, default=25, help="do_bench repetition time (ms)")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="profile one forward+backward per scenario instead of sweeping",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    results = {
        "meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__},
        "rows": [],
    }
    for sc in args.scenario or ("moc", "hkv"):
        if args.profile:
            profile(sc, Path(args.out).parent)
        else:
            results["rows"] += sweep(sc, args.runs)
    if args.profile:
        return 0
    return finish(results, Path(args.out), print_table)


if __name__ == "__main__":
    sys.exit(main())
