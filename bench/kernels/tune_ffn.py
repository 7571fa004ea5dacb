"""Per-kernel device time of the fused FFN-memory read's five Triton kernels across launch
configurations (GPU; on the CPU the interpreter only runs them).

    python -m bench.kernels.tune_ffn --out DIR                        # on the lent GPU, ~1.5 min
    # the interpreter: runs only
    python -m bench.kernels.tune_ffn --out DIR --quick --device cpu

The H100 device check of 2026-11-27 (14:40) put the fused read at 2.46 ms of device time per
forward+backward against gather + bmm's 0.90 at bench/kernels/ffn.py's shape (bf16, B 16,
S 1024, d 768, W 320, one block per level of a 3-level tree): _dx 595 µs, _dw 485, _bwd_h 360,
_down 215, _up 175, i.e. 80-120 TFLOP/s where cuBLAS's bmm kernels beside them ran ~3x faster.
The kernels' tiles (`kernel.launch_configs`) were set offline from register counts and never timed.
So each kernel's configuration is varied here with the others at their current one, every call
runs forward+backward under torch.profiler, and each kernel's own device time is read; the
output and every gradient are checked against the current configuration's. Writes
tune-ffn.json: per row the kernel varied, its configuration, all five kernels' µs per call and
the largest relative error.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import run_meta
from bench.kernels.tuning import kernel_device_us, setup, sweep

KERNELS = ("_up", "_down", "_bwd_h", "_dx", "_dw")
# Candidates per kernel on a GPU: bigger output tiles and reduction steps than the current
# 64 x 64 x 32 with 8 warps, which leave Hopper's tensor cores underfed; keys as in
# kernel.launch_configs.
GPU_CANDIDATES = {
    "up": [
        {"BM": 128, "BW": 64, "BK": 64, "num_warps": 4, "num_stages": 3},
        {"BM": 128, "BW": 128, "BK": 64, "num_warps": 8, "num_stages": 3},
        {"BM": 64, "BW": 128, "BK": 64, "num_warps": 4, "num_stages": 4},
        {"BM": 128, "BW": 64, "BK": 32, "num_warps": 4, "num_stages": 4},
    ],
    "down": [
        {"BM": 128, "BW": 64, "BD": 128, "num_warps": 8, "num_stages": 3},
        {"BM": 128, "BW": 64, "BD": 64, "num_warps": 4, "num_stages": 3},
        {"BM": 64, "BW": 64, "BD": 128, "num_warps": 4, "num_stages": 4},
        {"BM": 128, "BW": 32, "BD": 128, "num_warps": 8, "num_stages": 4},
    ],
    "bwd_h": [
        {"BM": 128, "BW": 64, "BK": 64, "num_warps": 8, "num_stages": 3},
        {"BM": 128, "BW": 64, "BK": 32, "num_warps": 4, "num_stages": 3},
        {"BM": 64, "BW": 64, "BK": 64, "num_warps": 4, "num_stages": 3},
        {"BM": 64, "BW": 128, "BK": 32, "num_warps": 8, "num_stages": 3},
    ],
    "dx": [
        {"BM": 128, "BW": 64, "BD": 128, "num_warps": 8, "num_stages": 3},
        {"BM": 128, "BW": 64, "BD": 64, "num_warps": 4, "num_stages": 3},
        {"BM": 64, "BW": 64, "BD": 128, "num_warps": 4, "num_stages": 4},
        {"BM": 128, "BW": 32, "BD": 128, "num_warps": 8, "num_stages": 4},
    ],
    "dw": [
        {"BW": 128, "BD": 128, "BR": 64, "num_warps": 8, "num_stages": 3},
        {"BW": 64, "BD": 128, "BR": 64, "num_warps": 4, "num_stages": 3},
        {"BW": 128, "BD": 64, "BR": 32, "num_warps": 4, "num_stages": 4},
        {"BW": 64, "BD": 64, "BR": 64, "num_warps": 4, "num_stages": 3},
    ],
}


def problem(device: str, quick: bool) -> dict:
    from bench.kernels.ffn import CPU_SIZES, CUDA_SIZES, make_problem

    return make_problem(CPU_SIZES if quick or device == "cpu" else CUDA_SIZES, device)


def candidates(p: dict, device: str, quick: bool) -> dict[str, list[dict]]:
    """--quick: one other tile size (16 where the current has 32) for a forward and a backward
    kernel, so the interpreter runs in the device check's CPU test."""
    if device == "cuda" and not quick:
        return GPU_CANDIDATES
    from memtree.kernels.ffn_memory.kernel import launch_configs

    return {
        name: [{k: 16 if k.startswith("B") else v for k, v in cfg.items()}]
        for name, cfg in launch_configs(p["x"]).items()
        if name in ("up", "dw")
    }


def run(p: dict, name: str | None, cfg: dict | None, n: int, device: str) -> dict:
    """Forward+backward with kernel `name` at `cfg` (None: all current): µs per kernel, and
    the output and gradients for the error check."""
    from memtree.kernels.ffn_memory import ffn_memory
    from memtree.kernels.ffn_memory.kernel import launch_configs

    table = launch_configs(p["x"])  # the dict the launches read, patched in place
    saved = dict(table)
    if name is not None:
        table[name] = cfg
    leaves = [p["x"].detach().requires_grad_(), *(b.detach().requires_grad_() for b in p["banks"])]

    def step():
        for t in leaves:
            t.grad = None
        y = ffn_memory(*leaves, p["idx"], sparse_grad=False, impl="triton")
        y.backward(p["dy"])
        return y

    try:
        y = step()
        got = [y.detach().float().clone(), *(t.grad.float().clone() for t in leaves)]
        res = kernel_device_us(step, n, device, KERNELS)
    finally:
        table.clear()
        table.update(saved)
    res["sum_us"] = sum(res.get(k + "_us", 0.0) for k in KERNELS)
    return {**res, "out": got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--n", type=int, default=5, help="forward+backward calls profiled per configuration"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = setup(args.device, args.out)
    p = problem(args.device, args.quick)
    todo = [(None, None)] + [
        (name, cfg) for name, cfgs in candidates(p, args.device, args.quick).items() for cfg in cfgs
    ]
    header = {
        "device": args.device,
        "meta": run_meta(args),
        "sizes": {k: v for k, v in p.items() if isinstance(v, int)},
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
    }
    sweep(
        (
            (
                {"kernel": name or "current", "config": cfg},
                "all",
                lambda name=name, cfg=cfg: run(p, name, cfg, args.n, args.device),
            )
            for name, cfg in todo
        ),
        out / "tune-ffn.json",
        header,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
