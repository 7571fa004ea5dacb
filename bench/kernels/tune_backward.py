"""Per-kernel device time of memory attention's forward, dQ and dK/dV kernels across launch
configurations, at the training step's fp32 shapes and at moc's bf16 one (GPU only).

    python -m bench.kernels.tune_backward --out DIR        # on the lent GPU, ~3 min
    # the interpreter: runs only
    python -m bench.kernels.tune_backward --out DIR --quick --device cpu

bench/kernels/profile_reads.py found the dK/dV kernel at 0.75 ms per call in a training step of the
small anchor (fp32, hierarchical KV memory, one block per level per sequence) while the dQ
kernel of the same calls took 21 µs and the gathered path's whole attention backward 77 µs.
Timing the whole op cannot separate the kernels (its host work exceeds their device time),
so each configuration here runs forward+backward under torch.profiler and reads each
kernel's own device time; the dK/dV kernel's registers and spills are read from its compiled
form. Every configuration's gradients are checked against the current Launch.choose's.
Writes tune-backward.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from bench.common import run_meta
from bench.kernels.tuning import kernel_device_us, setup, sweep

# (block_m, block_n, num_warps, num_stages, dkv_chunk); None = Launch.choose as it is
FP32 = [
    None,
    (64, 64, 4, 2, 4),
    (64, 32, 4, 2, 16),
    (32, 64, 4, 2, 16),
    (32, 32, 4, 2, 16),
    (64, 64, 8, 2, 16),
    (64, 64, 4, 1, 16),
    (32, 32, 2, 1, 4),
    (64, 32, 4, 1, 4),
]
BF16 = [
    None,
    (128, 64, 8, 3, 4),
    (64, 64, 4, 3, 16),
    (128, 32, 8, 3, 16),
    (64, 64, 4, 2, 4),
    (128, 64, 4, 3, 16),
]
KERNELS = ("fwd_kernel", "bwd_dq_kernel", "bwd_dkv_kernel")


def problems(device: str, quick: bool) -> list[dict]:
    """The training step's levels (small anchor, fp32: B 8, S 256, 8 heads of 32, one block
    per level per sequence; blocks of 99 / 24 slots at 4 / 64 blocks) and moc (bf16)."""
    g = torch.Generator().manual_seed(0)
    out = []
    shapes = [
        ("train-l1", 8, 8, 256, 32, 99, 4, 1, torch.float32, FP32),
        ("train-l3", 8, 8, 256, 32, 24, 64, 1, torch.float32, FP32),
        ("moc", 8, 12, 1024, 64, 64, 4097, 65, torch.bfloat16, BF16),
    ]
    if quick:
        shapes = [
            (n, 2, 2, 40, 16, 20, 6, k if k == 1 else 3, torch.float32, c[:2])
            for n, *_, k, _, c in shapes[::2]
        ]
    for name, b, h, s, d, t, n, k, dtype, cfgs in shapes:
        if k == 1:
            idx = torch.randint(0, n, (b, 1), generator=g)
        else:
            idx = torch.stack(
                [
                    torch.cat(
                        [
                            torch.zeros(1, dtype=torch.long),
                            torch.randperm(n - 1, generator=g)[: k - 1] + 1,
                        ]
                    )
                    for _ in range(b)
                ]
            )
        q, k_, v, dy = (
            torch.randn(*sh, generator=g).to(device, dtype)
            for sh in ((b, h, s, d), (n, t, h, d), (n, t, h, d), (b, h, s, d))
        )
        out.append(
            {
                "name": name,
                "q": q,
                "k": k_,
                "v": v,
                "dy": dy,
                "idx": idx.to(device),
                "configs": cfgs,
            }
        )
    return out


def run(p: dict, cfg, n: int, device: str) -> dict:
    from memtree.kernels.memory_attention import kernel as K
    from memtree.kernels.memory_attention import memory_attention

    original, run_dkv = K.Launch.choose, K.bwd_dkv_kernel.run
    compiled = {}

    def choose(*a, **kw):
        base = original(*a, **kw)
        if cfg is None:
            return base
        bm, bn, w, st, ch = cfg
        t = p["k"].shape[1]
        return dataclasses.replace(
            base,
            block_m=bm,
            block_n=bn,
            num_warps=w,
            num_stages=st,
            dkv_chunk=ch,
            even_t=t % bn == 0,
        )

    def spy(*a, **kw):
        compiled["dkv"] = run_dkv(*a, **kw)
        return compiled["dkv"]

    leaves = [p[x].detach().requires_grad_() for x in ("q", "k", "v")]

    def step():
        for t in leaves:
            t.grad = None
        memory_attention(*leaves, p["idx"], sparse_grad=False, impl="triton").backward(p["dy"])

    K.Launch.choose, K.bwd_dkv_kernel.run = choose, spy
    K.clear_caches()  # the per-shape launch cache would keep the last configuration's tiles
    try:
        step()
        grads = [t.grad.float().clone() for t in leaves]
        res = kernel_device_us(step, n, device, KERNELS)
    finally:
        K.Launch.choose, K.bwd_dkv_kernel.run = original, run_dkv
        K.clear_caches()
    res = {**res, "out": grads}
    kern = compiled.get("dkv")
    for attr in ("n_regs", "n_spills"):
        try:
            res["dkv_" + attr] = int(getattr(kern, attr))
        except Exception:  # noqa: BLE001 (the interpreter compiles nothing)
            res["dkv_" + attr] = None
    return res


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
    header = {
        "device": args.device,
        "meta": run_meta(args),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
    }
    sweep(
        (
            (
                {"shape": p["name"], "config": cfg or "current"},
                p["name"],
                lambda p=p, cfg=cfg: run(p, cfg, args.n, args.device),
            )
            for p in problems(args.device, args.quick)
            for cfg in p["configs"]
        ),
        out / "tune-backward.json",
        header,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
