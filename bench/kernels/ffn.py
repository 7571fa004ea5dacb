"""Benchmark of the fused FFN-memory op against the gather + batched-matmul formulation.

    # realistic shape, timed
    .venv/bin/python -m bench.kernels.ffn --device cuda --runs 20
    .venv/bin/python -m bench.kernels.ffn --device cpu               # tiny shape: correctness only

Candidate: `kernels.ffn_memory.ffn_memory` (Triton on CUDA), with sparse bank gradients
(the default) and with dense ones. Baseline: training/model.py's formulation — the
sequence's blocks gathered out of the bank into a (B, k·W, d) copy, then
`(silu(x @ w1.mT) * (x @ w2.mT)) @ w3` — with autograd's dense bank gradient. Both run
forward and forward+backward (gradients to x and the three banks), interleaved
(A B, B A, ...) and timed with CUDA events; figures are medians over `runs`. Peak
memory is the allocator's peak above what the inputs hold; TFLOP/s counts the useful
matmul FLOPs (6·B·S·k·W·d forward, 3x that forward+backward; the kernel's recomputation
in backward is not counted). On CPU the op dispatches to the pure-torch reference, so the
timings there only time that reference; the run checks the outputs and gradients of the
reference and (under TRITON_INTERPRET=1, which the standalone run sets) of the Triton
kernels against the baseline.

`run_ffn(args)` is imported by bench/kernels/kernel_ops.py; it needs `args.device` and `args.runs`.
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import (
    elapsed_ms,
    fmt,
    log,
    peak_mib,
)

# B sequences of S tokens, d_model, memory width W per block (~1/10 of a 3,072-wide
# FFN), k blocks per sequence (one per level of a 3-level tree with this branching).
CUDA_SIZES = {
    "B": 16,
    "S": 1024,
    "d": 768,
    "W": 320,
    "levels": 3,
    "branching": 8,
    "dtype": "bfloat16",
    "warmup": 3,
}
CPU_SIZES = {
    "B": 3,
    "S": 63,
    "d": 64,
    "W": 40,
    "levels": 3,
    "branching": 2,
    "dtype": "float32",
    "warmup": 1,
}


def make_problem(sz: dict, device: str, seed: int = 0) -> dict:
    """Bank of every level's blocks (N = Σ branching^ℓ) and one root-to-leaf path per sequence."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, sz["dtype"])
    b, s, d, w, br = sz["B"], sz["S"], sz["d"], sz["W"], sz["branching"]
    sizes = [br**lvl for lvl in range(1, sz["levels"] + 1)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    leaf = torch.randint(0, sizes[-1], (b,), generator=g)
    # Level-ℓ ancestor of the leaf; the lower levels are shared by many sequences.
    idx = torch.stack(
        [off + leaf // br ** (len(sizes) - 1 - i) for i, off in enumerate(offsets)], 1
    )
    n = sum(sizes)
    banks = [(torch.randn(n, w, d, generator=g) / d**0.5).to(device, dtype) for _ in range(3)]
    x = torch.randn(b, s, d, generator=g).to(device, dtype)
    dy = torch.randn(b, s, d, generator=g).to(device, dtype)
    return {
        "x": x,
        "banks": banks,
        "idx": idx.to(device),
        "dy": dy,
        "n_blocks": n,
        "unique_blocks": int(idx.unique().numel()),
    }


def gather_bmm(x, w1, w2, w3, idx):
    """training/model.py's FFN-memory branch on blocks gathered out of the bank."""
    w1, w2, w3 = (w[idx].flatten(1, 2) for w in (w1, w2, w3))  # (B, k·W, d) copies
    return (F.silu(x @ w1.mT) * (x @ w2.mT)) @ w3


def _ffn_memory():
    """kernels.ffn_memory, imported when first needed: it imports triton and defines its
    kernels, which must come after main() settles TRITON_INTERPRET."""
    from memtree.kernels import ffn_memory

    return ffn_memory


def _variants(impl: str, p: dict | None = None) -> dict:
    """The timed candidates; with the problem p also the fused op with its pair table built
    once beforehand, as a model's layers share one per level and step (training.model)."""
    ffn = _ffn_memory()
    ffn_memory = ffn.ffn_memory
    shared = {}
    if p is not None:
        table = ffn.ffn_memory_table(p["idx"], p["n_blocks"])
        shared = {
            "fused_shared_table": lambda x, a, b, c, i: ffn_memory(
                x, a, b, c, i, impl=impl, table=table
            )
        }
    return {
        "gather_bmm": gather_bmm,
        "fused_sparse": lambda x, a, b, c, i: ffn_memory(x, a, b, c, i, impl=impl),
        "fused_dense": lambda x, a, b, c, i: ffn_memory(
            x, a, b, c, i, sparse_grad=False, impl=impl
        ),
        **shared,
    }


def _leaves(p: dict) -> list:
    return [p["x"].detach().requires_grad_(), *(b.detach().requires_grad_() for b in p["banks"])]


def _run(fn, p: dict, backward: bool) -> list:
    """One call; returns the output and (if backward) the densified gradients."""
    leaves = _leaves(p) if backward else [p["x"], *p["banks"]]
    with torch.set_grad_enabled(backward):
        y = fn(*leaves, p["idx"])
        if not backward:
            return [y]
        y.backward(p["dy"])
    return [y.detach(), *(t.grad.to_dense() if t.grad.is_sparse else t.grad for t in leaves)]


def _rel_err(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm().clamp(min=1e-30))


def _errors(fn, p: dict) -> dict[str, float]:
    """Relative error of fn's output and gradients against the baseline's, both fp32."""
    p32 = {
        **p,
        "x": p["x"].float(),
        "banks": [b.float() for b in p["banks"]],
        "dy": p["dy"].float(),
    }
    ref = _run(gather_bmm, p32, backward=True)
    got = _run(fn, p, backward=True)
    names = ("y", "dx", "dw1", "dw2", "dw3")
    with torch.no_grad():
        return {n: _rel_err(g, r) for n, g, r in zip(names, got, ref)}


def run_ffn(args: argparse.Namespace) -> dict[str, Any]:
    """Time and check the fused FFN-memory op on args.device; returns every figure measured."""
    ffn_kernel = _ffn_memory().kernel
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available")
    sz = dict(CUDA_SIZES if device == "cuda" else CPU_SIZES)
    p = make_problem(sz, device)
    b, s, d, w, k = sz["B"], sz["S"], sz["d"], sz["W"], sz["levels"]
    fwd_flops = 6.0 * b * s * k * w * d
    passes = {"forward": (False, fwd_flops), "forward_backward": (True, 3 * fwd_flops)}
    variants = _variants("auto", p)
    log(
        f"ffn_memory on {device}: B={b} S={s} d={d} W={w} k={k} N={p['n_blocks']} "
        f"({p['unique_blocks']} distinct blocks referenced) {sz['dtype']}"
    )

    times: dict[str, dict[str, list[float]]] = {v: {ps: [] for ps in passes} for v in variants}
    for pname, (bwd, _) in passes.items():
        for fn in variants.values():
            for _ in range(sz["warmup"]):
                _run(fn, p, bwd)
        order = list(variants)
        for r in range(args.runs):  # interleaved, alternating direction, so drift hits all variants
            for v in order if r % 2 == 0 else order[::-1]:
                times[v][pname].append(elapsed_ms(partial(_run, variants[v], p, bwd), device))

    rows = []
    for v in variants:
        peak = peak_mib(partial(_run, variants[v], p, True), device)
        for pname, (_, flops) in passes.items():
            ms = statistics.median(times[v][pname])
            base = statistics.median(times["gather_bmm"][pname])
            rows.append(
                {
                    "variant": v,
                    "pass": pname,
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "speedup_vs_gather": base / ms,
                    "peak_mib": peak if pname == "forward_backward" else None,
                    "runs": args.runs,
                }
            )

    errors = {"reference" if device != "cuda" else "triton": _errors(variants["fused_sparse"], p)}
    if device == "cpu" and ffn_kernel.interpreting():
        errors["triton_interpreter"] = _errors(_variants("triton")["fused_sparse"], p)
    return {
        "bench": "ffn_memory",
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "timed": "triton kernels" if device == "cuda" else "pure-torch reference (CPU dispatch)",
        "sizes": {**sz, "n_blocks": p["n_blocks"], "unique_blocks": p["unique_blocks"]},
        "flops": {pname: f for pname, (_, f) in passes.items()},
        "rows": rows,
        "max_rel_err_vs_gather": errors,
        "versions": {"torch": torch.__version__, "triton": _triton_version()},
    }


def _triton_version() -> str:
    import triton

    return triton.__version__


def print_result(result: dict) -> None:
    for r in result["rows"]:
        print(
            f"{r['variant']:<13} {r['pass']:<17} {fmt(r['ms'])} ms  {fmt(r['tflops'])} TFLOP/s  "
            f"{fmt(r['speedup_vs_gather'])}x vs gather  peak {fmt(r['peak_mib'])} MiB"
        )
    for impl, errs in result["max_rel_err_vs_gather"].items():
        print(
            f"relative error vs gather ({impl}): "
            + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--runs", type=int, default=10, help="timed repetitions per variant (median)")
    args = ap.parse_args(argv)
    if args.device == "cpu":  # lets the correctness check run the Triton kernels too
        os.environ.setdefault("TRITON_INTERPRET", "1")
    print_result(run_ffn(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
