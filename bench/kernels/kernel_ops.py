"""Benchmarks of the Triton kernels, each against its baselines in the same run.

    # H200 shapes: time, TFLOP/s, memory
    .venv/bin/python -m bench.kernels.kernel_ops --device cuda
    # tiny shapes: correctness + reference
    .venv/bin/python -m bench.kernels.kernel_ops --device cpu
    .venv/bin/python -m bench.kernels.kernel_ops --device cuda --only attention --runs 20

Memory attention (kernels/memory_attention), forward and forward+backward (gradients to q,
bank_k, bank_v and, when weighted, the weights):

  moc    seed 000 Table 5: d=768, 12 query and 12 KV heads (D=64), 64 tokens per chapter,
         top-64 + 1 shared chapter per sequence (k=65), S=1024, B=8, a bank of 4,097
         chapters, bf16. Candidates: memory_attention unweighted, "mix" (MoC's weighted read)
         and "bias". Baselines: SDPA on the explicitly gathered (B, H, k·T, D) blocks
         (unweighted: flash; "bias": the log-weights as a float attn_mask), whose bank
         gradient autograd scatters into a dense bank-sized tensor.
         Target (issue 58, replacing ">= 2x SDPA-on-gather", which the fusing's saving of a few
         passes over the gathered bytes cannot reach at these shapes: docs/BENCHMARKS.md): the
         kernel stays a `memory.read` candidate only where fwd+bwd >= 1.0x SDPA-on-gather;
         forward's share of the bf16 peak is recorded. The fair what-training-pays table
         (unique-row sparse gather, host and device time apart, widened SDPA, Flex) is
         bench/kernels/read_paths.py.
  hkv    a hierarchical KV path: 3 levels of a 16-ary tree (4,368 blocks of 128 slots),
         one block per level per sequence (upper levels shared across the batch), GQA
         32/8 heads, D=64, S=2048, B=8, bf16. Baseline SDPA-on-gather (enable_gqa).
  token  per-token lists (B, S, k) at the moc shape and the same k, with locality: every
         token keeps the shared chapter and swaps a fraction p of its sequence's 64 routed
         chapters for others from the sequence's top-128 (p = 0, 1/8, 1/2), or draws all
         64 at random from the bank ("random", the worst case). Records the mean number of
         unique blocks a query tile touches. Target: within 2x of the sequence-level time.
         Both per-token layouts are timed at every locality: the slot tiles
         (kernel_token_p=..., per_token_layout="tiles") and the block-major items
         (kernel_token_blocks_p=..., per_token_layout="blocks"), whose chunk counts are
         recorded; at "random" the blocks layout's errors against the tiles' (fp32).
         Also the naive per-token formulation (seed 004 §8.3: per-token gathered copies,
         naive.py) against the kernel at B=1 and S=`naive_s`: time and peak memory.

FLOPs counted: 4·B·H·S·k·T·D forward (QKᵀ and PV), 3.5x that forward+backward (the
usual flash-attention convention: backward = 2.5x forward); recomputation is not
counted. Times are medians over --runs interleaved repetitions (CUDA events); peak memory
is the allocator's peak above what the inputs hold. On CPU the op dispatches to the
reference: only the reference is timed, and the Triton kernels (TRITON_INTERPRET=1, set
here) are checked against it on tiny shapes.

The FFN-memory op's benchmark (bench/kernels/ffn.py, `run_ffn`) runs too.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import (
    command_line,
    elapsed_ms,
    finish,
    fmt,
    loadavg,
    log,
    machine_meta,
    peak_mib,
    print_aligned,
    results_dir,
    results_path,
    write_results,
)
from bench.kernels.ffn import run_ffn
from memtree.kernels.memory_attention import (
    memory_attention,
    memory_attention_naive,
    memory_attention_table,
)

BENCHES = ("attention", "ffn")
CUDA_SIZES = {
    "moc": {"B": 8, "H": 12, "H_kv": 12, "S": 1024, "D": 64, "T": 64, "k": 65, "N": 4097},
    "hkv": {"B": 8, "H": 32, "H_kv": 8, "S": 2048, "D": 64, "T": 128, "levels": 3, "branching": 16},
    "token_locality": [0.0, 0.125, 0.5, "random"],
    "naive_s": 256,
    "dtype": "bfloat16",
    "warmup": 3,
}
CPU_SIZES = {
    "moc": {"B": 2, "H": 4, "H_kv": 4, "S": 63, "D": 32, "T": 20, "k": 5, "N": 41},
    "hkv": {"B": 2, "H": 4, "H_kv": 2, "S": 63, "D": 32, "T": 24, "levels": 3, "branching": 2},
    "token_locality": [0.125],
    "naive_s": 63,
    "dtype": "float32",
    "warmup": 1,
}


# ------------------------------------------------------------------------------- problems
def moc_problem(sz: dict, device: str, dtype, seed: int = 0) -> dict:
    """Sequence-level top-(k-1) routed chapters + the shared chapter 0, router weights."""
    g = torch.Generator().manual_seed(seed)
    b, k, n = sz["B"], sz["k"], sz["N"]
    routed = torch.stack([torch.randperm(n - 1, generator=g)[: 2 * (k - 1)] + 1 for _ in range(b)])
    idx = torch.cat([torch.zeros(b, 1, dtype=torch.long), routed[:, : k - 1]], 1)  # (B, k)
    p = _tensors(sz, n, sz["T"], idx, g, device, dtype)
    p["pool"] = routed.to(device)  # (B, 2(k-1)): the sequence's top-2(k-1) chapters
    return p


def hkv_problem(sz: dict, device: str, dtype, seed: int = 0) -> dict:
    """One root-to-leaf path per sequence through a `levels`-deep tree of KV blocks."""
    g = torch.Generator().manual_seed(seed)
    br, lv = sz["branching"], sz["levels"]
    counts = [br ** (i + 1) for i in range(lv)]
    offsets = [sum(counts[:i]) for i in range(lv)]
    leaf = torch.randint(0, counts[-1], (sz["B"],), generator=g)
    idx = torch.stack([off + leaf // br ** (lv - 1 - i) for i, off in enumerate(offsets)], 1)
    return _tensors(sz, sum(counts), sz["T"], idx, g, device, dtype)


def _tensors(sz: dict, n: int, t: int, idx, g, device: str, dtype) -> dict:
    b, h, h_kv, s, d = sz["B"], sz["H"], sz["H_kv"], sz["S"], sz["D"]

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    w = torch.softmax(torch.randn(idx.shape, generator=g), -1)
    return {
        "q": rnd(b, h, s, d),
        "bank_k": rnd(n, t, h_kv, d),
        "bank_v": rnd(n, t, h_kv, d),
        "idx": idx.to(device),
        "w": w.to(device),
        "dy": rnd(b, h, s, d),
        "n": n,
    }


def token_idx(p: dict, s: int, locality, seed: int = 1):
    """(B, S, k) per-token lists derived from the sequence lists (see the module docstring)."""
    g = torch.Generator(device=p["idx"].device).manual_seed(seed)
    seq = p["idx"]  # (B, k), entry 0 shared
    b, k = seq.shape
    if locality == "random":
        routed = torch.randint(1, p["n"], (b, s, k - 1), generator=g, device=seq.device)
    else:
        routed = seq[:, None, 1:].expand(b, s, k - 1).clone()
        swap = torch.rand(b, s, k - 1, generator=g, device=seq.device) < locality
        spare = p["pool"][:, None, k - 1 :].expand(b, s, k - 1)  # never among the top-(k-1)
        routed = torch.where(swap, spare, routed)
    return torch.cat([seq[:, None, :1].expand(b, s, 1), routed], -1)


# ------------------------------------------------------------------------------ candidates
def gather_sdpa(q, bank_k, bank_v, idx, w=None):
    """Baseline: the referenced blocks gathered into (B, H_kv, k·T, D) copies, then SDPA;
    router weights as a float mask of log-weights (the "bias" mode)."""
    h = q.shape[1]
    t, h_kv = bank_k.shape[1:3]
    kg = bank_k[idx].flatten(1, 2).transpose(1, 2)  # (B, H_kv, k·T, D)
    vg = bank_v[idx].flatten(1, 2).transpose(1, 2)
    mask = None
    if w is not None:
        mask = torch.log(w).repeat_interleave(t, dim=1)[:, None, None, :].to(q.dtype)
    return F.scaled_dot_product_attention(q, kg, vg, attn_mask=mask, enable_gqa=h != h_kv)


def _attn_kernel():
    """kernels/memory_attention/kernel.py (reference table, interpreter check), imported when
    first needed: it imports triton, which must come after main() settles TRITON_INTERPRET."""
    from memtree.kernels.memory_attention import kernel

    return kernel


def _attn_blocks():
    """kernels/memory_attention/blocks.py (the item table), imported like `_attn_kernel`."""
    from memtree.kernels.memory_attention import blocks

    return blocks


def _kernel(mode: str | None, **kw) -> Callable:
    def fn(q, bank_k, bank_v, idx, w=None):
        return memory_attention(
            q, bank_k, bank_v, idx, w if mode else None, weight_mode=mode or "bias", **kw
        )

    return fn


def _kernel_shared(p: dict, idx, **kw) -> Callable:
    """The kernel with its table built once beforehand, outside the timing, as a model's
    layers share one table per memory level and step (training.model.ReadTables): the
    per-call cost a training step pays, the build amortised over the layers."""
    table = memory_attention_table(p["q"], p["bank_k"], p["bank_v"], idx)

    def fn(q, bank_k, bank_v, idx, w=None):
        return memory_attention(q, bank_k, bank_v, idx, table=table, **kw)

    return fn


def _naive(q, bank_k, bank_v, idx, w=None):
    return memory_attention_naive(q, bank_k, bank_v, idx)


# --------------------------------------------------------------------------------- timing
def _run(fn, p: dict, idx, backward: bool, weighted: bool) -> list:
    names = ["q", "bank_k", "bank_v"] + (["w"] if weighted else [])
    leaves = {n: p[n].detach().requires_grad_(backward) for n in names}
    with torch.set_grad_enabled(backward):
        y = fn(leaves["q"], leaves["bank_k"], leaves["bank_v"], idx, leaves.get("w"))
        if not backward:
            return [y]
        y.backward(p["dy"])
    return [y.detach(), *(leaves[n].grad for n in names)]


def time_variants(variants: dict, p: dict, runs: int, warmup: int, device: str) -> dict:
    """{variant: {pass: median ms}} for forward and forward+backward, interleaved (A B, B A,
    ...) so drift hits every variant; a variant that runs out of memory gets None."""
    res: dict[str, dict[str, Any]] = {v: {} for v in variants}
    for pname, bwd in (("forward", False), ("forward_backward", True)):
        alive = dict(variants)
        for v, (fn, idx, weighted) in variants.items():
            try:
                for _ in range(warmup):
                    _run(fn, p, idx, bwd, weighted)
            except torch.OutOfMemoryError:
                res[v][pname] = None
                alive.pop(v)
                torch.cuda.empty_cache()
        times: dict[str, list[float]] = {v: [] for v in alive}
        order = list(alive)
        for r in range(runs):
            for v in order if r % 2 == 0 else order[::-1]:
                fn, idx, weighted = alive[v]
                times[v].append(elapsed_ms(partial(_run, fn, p, idx, bwd, weighted), device))
        for v in alive:
            res[v][pname] = statistics.median(times[v])
    for v, (fn, idx, weighted) in variants.items():
        try:
            res[v]["peak_mib"] = peak_mib(partial(_run, fn, p, idx, True, weighted), device)
        except torch.OutOfMemoryError:
            res[v]["peak_mib"] = None
            torch.cuda.empty_cache()
    return res


def errors(fn, ref, p: dict, idx, weighted: bool) -> dict[str, float]:
    """Relative (Frobenius) error of fn's output and gradients against ref's in fp32."""
    p32 = {
        n: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for n, v in p.items()
    }
    got = _run(fn, p, idx, True, weighted)
    want = _run(ref, p32, idx, True, weighted)
    names = ["out", "dq", "dbank_k", "dbank_v", "dweights"]
    res = {}
    for name, g, r in zip(names, got, want):
        diff = (g.to_dense() if g.is_sparse else g).double() - r.double()
        res[name] = float(diff.norm() / r.double().norm().clamp(min=1e-30))
    return res


# ---------------------------------------------------------------------------------- rows
def row(
    bench: str,
    scenario: str,
    variant: str,
    pname: str,
    ms: float | None,
    flops: float | None,
    **extra,
) -> dict:
    return {
        "bench": bench,
        "scenario": scenario,
        "variant": variant,
        "pass": pname,
        "ms": ms,
        "tflops": flops / ms / 1e9 if ms and flops else None,
        "peak_mib": None,
        "vs_baseline": None,
        "target": "",
        "met": None,
        **extra,
    }


def rows_of(scenario: str, res: dict, flops: dict, baseline: str | None) -> list[dict]:
    out = []
    for v, r in res.items():
        for pname in ("forward", "forward_backward"):
            base = res[baseline][pname] if baseline else None
            speedup = base / r[pname] if base and r[pname] and v != baseline else None
            out.append(
                row(
                    "memory_attention",
                    scenario,
                    v,
                    pname,
                    r[pname],
                    flops[pname],
                    peak_mib=r["peak_mib"] if pname == "forward_backward" else None,
                    vs_baseline=speedup,
                )
            )
    return out


def attn_flops(b, h, s, kt, d) -> dict[str, float]:
    fwd = 4.0 * b * h * s * kt * d
    return {"forward": fwd, "forward_backward": 3.5 * fwd}


# ------------------------------------------------------------------------------ scenarios
def _moc(args, sz: dict, p: dict, result: dict) -> list[dict]:
    """Sequence-level lists at MoC's shape: the kernel (unweighted, "bias", "mix") against
    SDPA on gathered blocks; on the CPU the reference alone."""
    m, device, cuda = sz["moc"], args.device, args.device == "cuda"
    fl = attn_flops(m["B"], m["H"], m["S"], m["k"] * m["T"], m["D"])
    log(f"moc: {m} {sz['dtype']}")
    if cuda:
        variants = {
            "sdpa_gather": (gather_sdpa, p["idx"], False),
            "kernel": (_kernel(None), p["idx"], False),
            "kernel_dense_grad": (_kernel(None, sparse_grad=False), p["idx"], False),
            "kernel_shared_table": (_kernel_shared(p, p["idx"]), p["idx"], False),
            "kernel_shared_table_dense_grad": (
                _kernel_shared(p, p["idx"], sparse_grad=False),
                p["idx"],
                False,
            ),
            "sdpa_gather_bias": (gather_sdpa, p["idx"], True),
            "kernel_bias": (_kernel("bias"), p["idx"], True),
            "kernel_mix": (_kernel("mix"), p["idx"], True),
        }
    else:
        variants = {
            "reference": (_kernel(None, impl="reference"), p["idx"], False),
            "reference_mix": (_kernel("mix", impl="reference"), p["idx"], True),
        }
    res = time_variants(variants, p, args.runs, sz["warmup"], device)
    moc_rows = rows_of(
        "moc",
        {v: r for v, r in res.items() if "bias" not in v},
        fl,
        "sdpa_gather" if cuda else None,
    )
    if cuda:
        moc_rows += rows_of(
            "moc", {v: r for v, r in res.items() if "bias" in v}, fl, "sdpa_gather_bias"
        )
        for r in moc_rows:
            if r["variant"] == "kernel" and r["pass"] == "forward_backward":
                r.update(
                    target=">= 1.0x sdpa_gather (else auto never picks it)",
                    met=(r["vs_baseline"] or 0) >= 1,
                )
            if r["variant"] == "kernel" and r["pass"] == "forward" and r["tflops"]:
                frac = r["tflops"] / args.peak_tflops
                r.update(target=f"{frac:.0%} of {args.peak_tflops:g} TFLOP/s (recorded)")
        result["moc_errors_vs_sdpa_gather_fp32"] = errors(
            _kernel(None), gather_sdpa, p, p["idx"], False
        )
    result["moc_unique_blocks"] = int(p["idx"].unique().numel())
    return moc_rows


def _token(args, sz: dict, p: dict, result: dict) -> list[dict]:
    """Per-token lists at the same k, per locality: the unique blocks a tile touches, the
    block-major layout's chunks, and (on a GPU) both layouts' time against the sequence-level
    lists."""
    attn_kernel, attn_blocks = _attn_kernel(), _attn_blocks()
    m, device, cuda = sz["moc"], args.device, args.device == "cuda"
    fl = attn_flops(m["B"], m["H"], m["S"], m["k"] * m["T"], m["D"])
    rows: list[dict] = []
    tok_res: dict[str, Any] = {}
    for loc in sz["token_locality"]:
        tidx = token_idx(p, m["S"], loc)
        _, table = attn_kernel.plan(p["q"], p["bank_k"], p["bank_v"], tidx, None)
        slots = table.group_count.float().mean().item()
        _, items = attn_blocks.plan(p["q"], p["bank_k"], p["bank_v"], tidx, None)
        n_chunks = int(items.n_chunk.item())
        n_items = int((items.item_key < p["n"]).sum().item())
        name, bname = f"kernel_token_p={loc}", f"kernel_token_blocks_p={loc}"
        if cuda:
            variants = {
                "kernel": (_kernel(None), p["idx"], False),
                name: (_kernel(None, per_token_layout="tiles"), tidx, False),
                bname: (_kernel(None, per_token_layout="blocks"), tidx, False),
            }
            res = time_variants(variants, p, args.runs, sz["warmup"], device)
            trow = rows_of("token", res, fl, "kernel")
            for r in trow:
                if r["variant"] in (name, bname):
                    ratio = r["ms"] / res["kernel"][r["pass"]] if r["ms"] else None
                    r.update(
                        slots_per_tile=slots,
                        target="<= 2x sequence-level time",
                        met=ratio is not None and ratio <= 2,
                    )
            rows += [r for r in trow if r["variant"] in (name, bname)]
            if loc == "random":
                tok_res["blocks_errors_vs_tiles_fp32"] = errors(
                    _kernel(None, per_token_layout="blocks"),
                    _kernel(None, per_token_layout="tiles"),
                    p,
                    tidx,
                    False,
                )
        tok_res[str(loc)] = {
            "mean_slots_per_tile": slots,
            "k": m["k"],
            "tokens_per_tile": table.tokens_per_tile,
            "blocks_items": n_items,
            "blocks_chunks": n_chunks,
            "blocks_tokens_per_chunk": items.layout.chunk,
            "blocks_items_per_chunk": n_items / max(n_chunks, 1),
        }
    result["token"] = tok_res
    return rows


def _naive_token(args, sz: dict, p: dict) -> tuple[list[dict], Any]:
    """The naive per-token formulation against the kernel at B=1; also returns its lists."""
    m, device = sz["moc"], args.device
    s1 = sz["naive_s"]
    p1 = {
        n: (v[:1, :, :s1] if n in ("q", "dy") else v[:1] if n in ("idx", "w", "pool") else v)
        for n, v in p.items()
    }
    tidx1 = token_idx(p1, s1, sz["token_locality"][0])
    fl1 = attn_flops(1, m["H"], s1, m["k"] * m["T"], m["D"])
    variants = {"naive_per_token": (_naive, tidx1, False)}
    if device == "cuda":
        variants["kernel_per_token"] = (_kernel(None), tidx1, False)
    res = time_variants(variants, p1, args.runs, sz["warmup"], device)
    rows = [
        dict(r, scenario=f"naive_token B=1 S={s1}")
        for r in rows_of("naive", res, fl1, "naive_per_token")
    ]
    return rows, tidx1


def _hkv(args, sz: dict, ph: dict) -> list[dict]:
    """A hierarchical KV path with GQA: the kernel against SDPA on gathered blocks."""
    hk, device, cuda = sz["hkv"], args.device, args.device == "cuda"
    flh = attn_flops(hk["B"], hk["H"], hk["S"], hk["levels"] * hk["T"], hk["D"])
    log(f"hkv: {hk}, {ph['n']} blocks")
    if cuda:
        variants = {
            "sdpa_gather": (gather_sdpa, ph["idx"], False),
            "kernel": (_kernel(None), ph["idx"], False),
            "kernel_shared_table": (_kernel_shared(ph, ph["idx"]), ph["idx"], False),
        }
    else:
        variants = {"reference": (_kernel(None, impl="reference"), ph["idx"], False)}
    res = time_variants(variants, ph, args.runs, sz["warmup"], device)
    return rows_of("hkv", res, flh, "sdpa_gather" if cuda else None)


def bench_attention(args, sz: dict) -> tuple[dict, list[dict]]:
    device, dtype = args.device, getattr(torch, sz["dtype"])
    result: dict[str, Any] = {
        "sizes": sz,
        "timed": "triton kernels" if device == "cuda" else "pure-torch reference (CPU dispatch)",
    }
    p = moc_problem(sz["moc"], device, dtype)
    rows = _moc(args, sz, p, result)
    rows += _token(args, sz, p, result)
    naive_rows, tidx1 = _naive_token(args, sz, p)
    rows += naive_rows
    ph = hkv_problem(sz["hkv"], device, dtype)
    rows += _hkv(args, sz, ph)
    if device == "cuda":
        result["hkv_errors_vs_sdpa_gather_fp32"] = errors(
            _kernel(None), gather_sdpa, ph, ph["idx"], False
        )
    else:
        result["correctness"] = cpu_correctness(p, ph, tidx1)
    return result, rows


def cpu_correctness(p: dict, ph: dict, tidx) -> dict:
    """Relative errors on the CPU shapes: the reference against SDPA-on-gather, and the
    Triton kernels (interpreter) against the reference, per index and weight mode."""
    attn_kernel = _attn_kernel()
    out = {
        "reference_vs_sdpa_gather": errors(
            _kernel(None, impl="reference"), gather_sdpa, p, p["idx"], False
        ),
        "reference_vs_sdpa_gather_hkv": errors(
            _kernel(None, impl="reference"), gather_sdpa, ph, ph["idx"], False
        ),
    }
    if not attn_kernel.interpreting():
        return out
    for mode in (None, "bias", "mix"):
        for kind, idx, prob in (
            ("seq", p["idx"], p),
            ("token", tidx, p),
            ("token_blocks", tidx, p),
            ("hkv", ph["idx"], ph),
        ):
            if kind.startswith("token"):
                prob = {
                    n: (
                        v[:1, :, : idx.shape[1]]
                        if n in ("q", "dy")
                        else v[:1]
                        if n in ("idx", "w", "pool")
                        else v
                    )
                    for n, v in p.items()
                }
                if mode:
                    prob["w"] = prob["w"][:, None].expand(idx.shape).contiguous()
            layout = "blocks" if kind == "token_blocks" else "auto"
            out[f"triton_{kind}_{mode}"] = errors(
                _kernel(mode, impl="triton", per_token_layout=layout),
                _kernel(mode, impl="reference"),
                prob,
                idx,
                mode is not None,
            )
    return out


def bench_ffn(args, _sz: dict) -> tuple[dict, list[dict]]:
    res = run_ffn(args)
    rows = [
        row(
            "ffn_memory",
            "ffn",
            r["variant"],
            r["pass"],
            r["ms"],
            None,
            tflops=r["tflops"],
            peak_mib=r["peak_mib"],
            vs_baseline=r["speedup_vs_gather"],
        )
        for r in res["rows"]
    ]
    return res, rows


# ---------------------------------------------------------------------------------- main
def print_table(rows: list[dict]) -> None:
    cols = (
        "bench",
        "scenario",
        "variant",
        "pass",
        "ms",
        "tflops",
        "peak_mib",
        "vs_baseline",
        "target",
        "met",
    )
    print_aligned(cols, [[fmt(r.get(c)) for c in cols] for r in rows], rule=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--runs", type=int, default=10, help="timed repetitions per variant (median)")
    ap.add_argument("--only", choices=BENCHES, action="append", help="run only this (repeatable)")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="dense bf16 peak of the GPU (H200 SXM: 989)",
    )
    date = _dt.date.today().isoformat()
    ap.add_argument(
        "--out", default=None, help="JSON (default bench/kernels/results/kernels-DEVICE-DATE)"
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    if args.device == "cpu":  # before triton is first imported: check Triton on CPU too
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    out = results_path(args.out, f"kernels-{args.device}-{date}.json", results_dir(__file__))
    sz = CUDA_SIZES if args.device == "cuda" else CPU_SIZES
    results: dict[str, Any] = {
        "meta": {
            "command": command_line(),
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "peak_tflops": args.peak_tflops,
            "loadavg_start": loadavg(),
            "host": machine_meta(),
        },
        "benchmarks": {},
        "rows": [],
    }
    fns = {"attention": bench_attention, "ffn": bench_ffn}
    selected = [b for b in BENCHES if b in (args.only or BENCHES)]
    for name in selected:
        t0 = time.perf_counter()
        res, rows = fns[name](args, sz)
        res["bench_seconds"] = round(time.perf_counter() - t0, 1)
        results["benchmarks"][name] = res
        results["rows"] += rows
        write_results(results, out)  # partial results
        log(f"=== {name} done in {res['bench_seconds']}s")
    return finish(results, out, print_table)


if __name__ == "__main__":
    sys.exit(main())
