"""Every memory-read path timed at what a training step pays for it, host and device apart.

    # H200, sized for < 4 min
    .venv/bin/python -m bench.kernels.read_paths --device cuda
    # part `read_paths` of device_check.py
    .venv/bin/python -m bench.kernels.read_paths --device cuda --budget-s 200
    # tiny shapes, every path and check
    .venv/bin/python -m bench.kernels.read_paths --device cpu --quick

Issue 58: on an H100 bench/kernels/kernel_ops.py put the fused memory attention at 0.31x SDPA on
gathered blocks (moc) and 0.24x (hkv), the fused FFN memory at 0.42-0.50x gather + bmm. Two things
in those figures are not what training pays. (a) Their baselines index the bank parameter directly,
so autograd zeroes and scatters a dense bank-sized gradient (0.24-0.35 ms of the baseline's time),
while training gathers the batch's unique rows with F.embedding(unique_ids, bank.flatten(1),
sparse=True) (MoC's LatentBank) and gets a sparse COO gradient over those rows. (b) CUDA events
around a call enclose its host work (the kernel's reference table is ~170 dispatched ops: 1.35 ms
of host time for 0.05 ms of device work at moc), which in a training step overlaps the device work
of the layers around it. Here every candidate reads with the gradient layout training uses, and
host and device time are reported apart.

Scenarios (shapes of kernel_ops.CUDA_SIZES / CPU_SIZES and ffn.CUDA_SIZES / CPU_SIZES):
  moc       seed 000 Table 5: B 8, H = H_kv = 12, S 1024, D 64, 64-token chapters, k 65, N 4,097,
            bf16, unweighted
  moc_bias  the same with router weights, weight_mode "bias" (MoC's default)
  moc_mix   the same, weight_mode "mix"
  hkv       3 levels of a 16-ary tree of 128-slot KV blocks, GQA 32/8, S 2048, B 8, unweighted:
            one call over each path's 3 blocks, exact because every sequence reads every level
  ffn       the FFN memory of bench.kernels.ffn: B 16, S 1024, d 768, W 320, one block per level of
            a 3-level 8-ary tree
Candidates (attention):
  kernel               memory_attention, sparse_grad=True on the bank parameter (its table built
                       in the call; on the CPU impl="reference")
  kernel_shared_table  the same with the table built outside the timing (memory_attention_table),
                       as a model's layers share one
  gather_sdpa          the FAIR baseline: the batch's unique rows gathered by
                       F.embedding(sparse=True) from (N, T·H_kv·D) tables, then SDPA ("bias": a
                       float attn_mask of log-weights, today's only standard path for weights;
                       "mix": SDPA per block over the queries repeated per block, the reads summed
                       with the weights)
  gather_sdpa_dense    kernel_ops.gather_sdpa (the bank indexed directly, dense bank gradient), for
                       continuity with issue 58; it has no "mix"
  sdpa_wide            kernels.memory_attention.memory_attention_sdpa: the widened-head exact path
                       (q' = [q, 1, 1], k' = [k, hi, lo], hi + lo = log w / scale), sparse_grad=True
  flex                 kernels.memory_attention.memory_attention_flex: FlexAttention reading the
                       bank in place through a BlockMask from the block table (eager on the CPU;
                       raises for "mix")
Candidates (ffn): kernel (ffn_memory, sparse_grad=True), kernel_shared_table (ffn_memory_table
outside the timing), gather_bmm (FAIR: unique-row sparse gather, then training/model.py's
FeedForward formula on the gathered (B, k·W, d) memories), gather_bmm_dense (bench.kernels.ffn's
baseline, dense bank gradient). A candidate that raises is recorded with its reason, as is one
skipped when --budget-s runs out.

Timing, per candidate and pass (forward without autograd; forward+backward with gradients to q /
x, the banks and the weights), --runs interleaved repetitions (A B, B A, ...), medians:
  device_ms  CUDA: torch.profiler (CUDA activity), the summed durations of the device's kernels,
             copies and memsets in one call. Not CUDA events behind a spin kernel that keeps the
             device busy until the host is ahead: most paths synchronise inside a call (torch.unique
             in the gathered baselines, the sparse gradient's row count in backward), and at each
             sync the device waits for the host's next launches; events would count that stall,
             the summed kernel time does not (nor the launch gaps a busy training step hides).
             Each profiled call is bracketed by a synchronize and a marker kernel
             (torch.cuda._sleep's spin_kernel), which splits the device timeline into calls by
             order alone; without the markers, the device events are assigned to the host's
             record_function range of each call (`device_attribution`). All on one stream, so
             nothing is counted twice. CPU: the call's wall time (the CPU is synchronous).
  host_ms    perf_counter from the call's start until it returns, with no final synchronize: the
             host's own cost, including any wait at a sync inside the call
  wall_ms    synchronize, CUDA events around the call, synchronize: kernel_ops' figure
vs_fair_baseline {device, wall}: the fair baseline's time over the candidate's (> 1: faster).
errors: relative (Frobenius) errors of the output and every gradient against the fp32 reference
(memory_attention_naive / ffn_memory_naive) on a slice (the first sequence's first 128 tokens and
the blocks it reads): the candidate runs at full shape with the upstream gradient zero outside the
slice, so its gradients on the slice's rows are the reference's. The fair baseline's bank gradient
must be sparse COO (checked in that run, `baseline_grad_layout`). health: a plain GEMM's rate on the
device (bf16 8192³ on CUDA, torch's fp32 sgemm on the CPU) beside each fair baseline's achieved rate
on device time (bench.common.baseline_health), so a handicapped baseline is visible.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.common import (
    baseline_health,
    command_line,
    finish,
    fmt,
    loadavg,
    log,
    machine_meta,
    print_aligned,
    results_dir,
    results_path,
    torch_sgemm_gflops,
    write_results,
)
from bench.kernels.ffn import CPU_SIZES as FFN_CPU_SIZES
from bench.kernels.ffn import CUDA_SIZES as FFN_CUDA_SIZES
from bench.kernels.ffn import gather_bmm
from bench.kernels.ffn import make_problem as ffn_problem
from bench.kernels.kernel_ops import (
    CPU_SIZES,
    CUDA_SIZES,
    attn_flops,
    gather_sdpa,
    hkv_problem,
    moc_problem,
)
from memtree.kernels.memory_attention import (
    memory_attention,
    memory_attention_flex,
    memory_attention_naive,
    memory_attention_sdpa,
    memory_attention_table,
)

# scenario -> (bench, problem, weight mode); the three moc scenarios share one problem
SCENARIOS = {
    "moc": ("attention", "moc", None),
    "moc_bias": ("attention", "moc", "bias"),
    "moc_mix": ("attention", "moc", "mix"),
    "hkv": ("attention", "hkv", None),
    "ffn": ("ffn", "ffn", None),
}
PASSES = (("forward", False), ("forward_backward", True))
FAIR = {"attention": "gather_sdpa", "ffn": "gather_bmm"}
BANKS = ("bank_k", "bank_v", "w1", "w2", "w3")
SLICE_B, SLICE_S = 1, 128  # what the fp32 reference of the error check reads
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # relative error vs fp32, per dtype
MARK = "spin_kernel"  # torch.cuda._sleep's kernel, which no read path launches
RANGE = "read_paths:call:"


# ------------------------------------------------------------------------ fair baselines
def unique_rows(tables: list[Tensor], idx: Tensor, shape: tuple[int, ...]) -> list[Tensor]:
    """Each (N, P) table's rows for idx (B, k) as (B, k, *shape), gathered as training does: the
    batch's U unique rows once by F.embedding(sparse=True), so each table's gradient is a sparse
    COO over those rows (MoC's LatentBank; training.bank's gathered read has the same layout)."""
    ids, inv = torch.unique(idx, return_inverse=True)  # (U,), (B, k); U is read on the host
    return [F.embedding(ids, t, sparse=True).view(-1, *shape)[inv] for t in tables]


def _mix_sdpa(q: Tensor, kg: Tensor, vg: Tensor, w: Tensor) -> Tensor:
    """weight_mode "mix" in standard ops: each block's own softmax is an SDPA over that block
    alone, so the queries are repeated per block; the k reads are then summed with the weights."""
    b, k, t, h_kv, d = kg.shape
    h, s = q.shape[1:3]
    qq = q[:, None].expand(b, k, h, s, d).reshape(b * k, h, s, d)
    kk, vv = (x.reshape(b * k, t, h_kv, d).transpose(1, 2) for x in (kg, vg))  # (B·k, H_kv, T, D)
    o = F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=h != h_kv)  # (B·k, H, S, D)
    # a bmm over k, so the sum accumulates in fp32 even for bf16 reads
    return torch.einsum("bk,bkn->bn", w.to(o.dtype), o.reshape(b, k, -1)).view(b, h, s, d)


def fair_gather_sdpa(mode: str | None, shape: tuple[int, int, int]) -> Callable:
    """SDPA on each sequence's blocks gathered by `unique_rows` from (N, T·H_kv·D) tables."""
    t, h_kv, _ = shape

    def fn(q, bank_k, bank_v, idx, w=None):
        kg, vg = unique_rows([bank_k, bank_v], idx, shape)  # (B, k, T, H_kv, D)
        if mode == "mix":
            return _mix_sdpa(q, kg, vg, w)
        kg, vg = (x.flatten(1, 2).transpose(1, 2) for x in (kg, vg))  # (B, H_kv, k·T, D)
        mask = None
        if mode == "bias":  # (B, 1, 1, k·T) log-weights on every token of their block
            mask = torch.log(w).repeat_interleave(t, dim=1)[:, None, None, :].to(q.dtype)
        return F.scaled_dot_product_attention(
            q, kg, vg, attn_mask=mask, enable_gqa=q.shape[1] != h_kv
        )

    return fn


def fair_gather_bmm(shape: tuple[int, int]) -> Callable:
    """training/model.py FeedForward's memory branch on blocks gathered by `unique_rows`."""

    def fn(x, w1, w2, w3, idx):
        w1, w2, w3 = (g.flatten(1, 2) for g in unique_rows([w1, w2, w3], idx, shape))  # (B, k·W, d)
        return (F.silu(x @ w1.mT) * (x @ w2.mT)) @ w3

    return fn


# ---------------------------------------------------------------------------- candidates
@dataclass
class Cand:
    fn: Callable | None
    flat_bank: bool = False  # bank leaves (N, P), as training's embedding tables
    reason: str | None = None  # why it cannot run (import failed, no such mode)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:600]


def attention_cands(p: dict, mode: str | None, cuda: bool) -> dict[str, Cand]:
    impl = {} if cuda else {"impl": "reference"}
    wm = mode or "bias"

    def kernel(table=None):
        return lambda q, bk, bv, i, w=None: memory_attention(
            q, bk, bv, i, w, weight_mode=wm, sparse_grad=True, table=table, **impl
        )

    cands = {"kernel": Cand(kernel())}
    try:
        table = memory_attention_table(
            p["q"], p["bank_k"], p["bank_v"], p["idx"], p["w"] if mode else None, **impl
        )
        cands["kernel_shared_table"] = Cand(kernel(table))
    except Exception as e:  # noqa: BLE001
        cands["kernel_shared_table"] = Cand(None, reason=_why(e))
    cands["gather_sdpa"] = Cand(
        fair_gather_sdpa(mode, tuple(p["bank_k"].shape[1:])), flat_bank=True
    )
    cands["gather_sdpa_dense"] = (
        Cand(None, reason="n/a: kernel_ops.gather_sdpa has no mix mode")
        if mode == "mix"
        else Cand(gather_sdpa)
    )
    cands["sdpa_wide"] = Cand(
        lambda q, bk, bv, i, w=None: memory_attention_sdpa(
            q, bk, bv, i, w, weight_mode=wm, sparse_grad=True
        )
    )
    compile_ = None if cuda else False  # eager on the CPU, the path's own default on CUDA
    cands["flex"] = Cand(
        lambda q, bk, bv, i, w=None: memory_attention_flex(
            q, bk, bv, i, w, weight_mode=wm, compile=compile_
        )
    )
    return cands


def ffn_cands(p: dict, cuda: bool) -> dict[str, Cand]:
    # imported here: kernels.ffn_memory imports triton, which only its candidates need
    from memtree.kernels.ffn_memory import ffn_memory, ffn_memory_table

    impl = {} if cuda else {"impl": "reference"}
    table = ffn_memory_table(p["idx"], p["w1"].shape[0])
    return {
        "kernel": Cand(lambda x, a, b, c, i: ffn_memory(x, a, b, c, i, sparse_grad=True, **impl)),
        "kernel_shared_table": Cand(
            lambda x, a, b, c, i: ffn_memory(x, a, b, c, i, sparse_grad=True, table=table, **impl)
        ),
        "gather_bmm": Cand(fair_gather_bmm(tuple(p["w1"].shape[1:])), flat_bank=True),
        "gather_bmm_dense": Cand(gather_bmm),
    }


# -------------------------------------------------------------------------------- cases
@dataclass
class Case:
    """One scenario's problem: a candidate's fresh leaves, one call, the upstream gradient."""

    bench: str
    p: dict
    names: tuple[str, ...]  # the leaves in call order; "w" last when weighted
    mode: str | None
    flops: dict[str, float]
    dtype: str

    def leaves(self, c: Cand, grad: bool) -> list[Tensor]:
        # fresh per call, so each backward creates its gradients as a training step does
        return [
            (self.p[n].flatten(1) if c.flat_bank and n in BANKS else self.p[n])
            .detach()
            .requires_grad_(grad)
            for n in self.names
        ]

    def call(self, c: Cand, leaves: list[Tensor], grad: bool, dy: Tensor | None = None) -> Tensor:
        with torch.set_grad_enabled(grad):
            if self.bench == "attention":
                q, bk, bv, *w = leaves
                y = c.fn(q, bk, bv, self.p["idx"], *w)
            else:
                y = c.fn(*leaves, self.p["idx"])
            if grad:
                y.backward(self.p["dy"] if dy is None else dy)
        return y


def attention_case(problem: dict, mode: str | None, sz: dict, dtype: str) -> Case:
    kt = sz["k"] * sz["T"] if "k" in sz else sz["levels"] * sz["T"]
    names = ("q", "bank_k", "bank_v") + (("w",) if mode else ())
    return Case(
        "attention", problem, names, mode, attn_flops(sz["B"], sz["H"], sz["S"], kt, sz["D"]), dtype
    )


def ffn_case(sz: dict, device: str) -> Case:
    raw = ffn_problem(sz, device)
    p = {
        "x": raw["x"],
        "w1": raw["banks"][0],
        "w2": raw["banks"][1],
        "w3": raw["banks"][2],
        "idx": raw["idx"],
        "dy": raw["dy"],
        "n": raw["n_blocks"],
    }
    fwd = 6.0 * sz["B"] * sz["S"] * sz["levels"] * sz["W"] * sz["d"]  # bench.kernels.ffn's count
    return Case(
        "ffn",
        p,
        ("x", "w1", "w2", "w3"),
        None,
        {"forward": fwd, "forward_backward": 3 * fwd},
        sz["dtype"],
    )


# ------------------------------------------------------------------------------- checks
def _rel(got: Tensor, want: Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def _rows(grad: Tensor | None, shape: tuple[int, ...], sel: Tensor, name: str) -> Tensor:
    """A bank gradient (sparse or dense, (N, P) or (N, *shape)) on the rows sel, densely."""
    if grad is None:
        raise RuntimeError(f"no gradient reached {name}")
    return (grad.to_dense() if grad.is_sparse else grad).reshape(-1, *shape)[sel]


def _layout(grad: Tensor | None) -> str | None:
    return None if grad is None else str(grad.layout).removeprefix("torch.")


def check_errors(case: Case, c: Cand) -> tuple[dict[str, float], str | None]:
    """(relative errors against the fp32 reference on the slice, the bank gradient's layout)."""
    p, idx = case.p, case.p["idx"]
    b0, s0 = min(SLICE_B, idx.shape[0]), min(SLICE_S, p["dy"].shape[-2])
    sl = (
        (slice(0, b0), slice(None), slice(0, s0))
        if case.bench == "attention"
        else (slice(0, b0), slice(0, s0))
    )
    dy = torch.zeros_like(p["dy"])
    dy[sl] = p["dy"][sl]
    leaves = case.leaves(c, True)
    y = case.call(c, leaves, True, dy=dy)
    sel, local = torch.unique(idx[:b0], return_inverse=True)  # (U0,), (b0, k): the slice's blocks
    banks = [n for n in case.names if n in BANKS]
    ref = [p[n][sel] if n in BANKS else p[n][:b0] if n == "w" else p[n][sl] for n in case.names]
    ref = [t.detach().float().requires_grad_() for t in ref]
    if case.bench == "attention":
        q, bk, bv, *w = ref
        yr = memory_attention_naive(q, bk, bv, local, *w, weight_mode=case.mode or "bias")
    else:
        from memtree.kernels.ffn_memory import ffn_memory_naive

        yr = ffn_memory_naive(*ref, local)
    yr.backward(dy[sl].float())
    errs = {"out": _rel(y[sl], yr)}
    for n, leaf, r in zip(case.names, leaves, ref, strict=True):
        if n in BANKS:
            got = _rows(leaf.grad, tuple(p[n].shape[1:]), sel, n)
        elif leaf.grad is None:
            raise RuntimeError(f"no gradient reached {n}")
        else:
            got = leaf.grad[:b0] if n == "w" else leaf.grad[sl]
        errs["dweights" if n == "w" else f"d{n}"] = _rel(got, r.grad)
    errs["max"] = max(errs.values())
    return errs, _layout(leaves[case.names.index(banks[0])].grad)


# ------------------------------------------------------------------------------- timing
def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def host_wall_ms(case: Case, c: Cand, grad: bool, cuda: bool) -> tuple[float, float]:
    """(host, wall) ms of one call; see the module docstring."""
    leaves = case.leaves(c, grad)
    if not cuda:
        t0 = time.perf_counter()
        case.call(c, leaves, grad)
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record()
    t0 = time.perf_counter()
    case.call(c, leaves, grad)
    host = (time.perf_counter() - t0) * 1e3
    e1.record()
    torch.cuda.synchronize()
    return host, e0.elapsed_time(e1)


def split_device_events(events, n: int) -> tuple[list[list[float]], str]:
    """Per call, the durations (us) of its device events; and how they were assigned."""
    cuda_t = torch.autograd.DeviceType.CUDA
    dev = sorted(
        (
            e
            for e in events
            if e.device_type == cuda_t
            and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(RANGE)
        ),
        key=lambda e: e.time_range.start,
    )
    marks = [i for i, e in enumerate(dev) if MARK in e.name]
    if len(marks) == n:
        ends = marks[1:] + [len(dev)]
        return [
            [e.time_range.elapsed_us() for e in dev[a + 1 : b]] for a, b in zip(marks, ends)
        ], "markers"
    ranges = sorted(
        (e for e in events if e.device_type != cuda_t and e.name.startswith(RANGE)),
        key=lambda e: int(e.name[len(RANGE) :]),
    )
    if len(ranges) != n:
        raise RuntimeError(
            f"profiler: {len(marks)} markers, {len(ranges)} call ranges for {n} calls"
        )
    starts = [r.time_range.start for r in ranges]
    out: list[list[float]] = [[] for _ in range(n)]
    for e in dev:
        j = bisect_right(starts, e.time_range.start) - 1
        if MARK not in e.name and j >= 0 and e.time_range.start <= ranges[j].time_range.end:
            out[j].append(e.time_range.elapsed_us())
    return out, "ranges"


def device_ms(
    case: Case, cands: dict[str, Cand], alive: list[str], grad: bool, runs: int
) -> tuple[dict[str, list[float]], dict[str, list[int]], str]:
    """Profiled calls, interleaved: per candidate each call's summed device time and event count."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    calls: list[str] = []
    with torch.profiler.profile(activities=acts) as prof:
        for r in range(runs):
            for v in alive if r % 2 == 0 else alive[::-1]:
                leaves = case.leaves(cands[v], grad)
                torch.cuda.synchronize()
                torch.cuda._sleep(1000)  # the marker: ~1 us
                with torch.profiler.record_function(f"{RANGE}{len(calls)}"):
                    case.call(cands[v], leaves, grad)
                    torch.cuda.synchronize()
                calls.append(v)
    per_call, how = split_device_events(prof.events(), len(calls))
    times: dict[str, list[float]] = {v: [] for v in alive}
    counts: dict[str, list[int]] = {v: [] for v in alive}
    for v, durs in zip(calls, per_call, strict=True):
        times[v].append(sum(durs) / 1e3)
        counts[v].append(len(durs))
    return times, counts, how


def _free(cuda: bool) -> None:
    if cuda:
        torch.cuda.empty_cache()


def time_case(case: Case, cands: dict[str, Cand], args, deadline: float) -> tuple[dict, dict]:
    """{variant: {pass: figures or {"reason"}}} and {pass: how device events were assigned}."""
    cuda = args.device == "cuda"
    why = {v: c.reason for v, c in cands.items()}
    res: dict[str, dict[str, Any]] = {v: {} for v in cands}
    how: dict[str, str] = {}
    for pname, grad in PASSES:
        alive = []
        for v, c in cands.items():
            if why[v] is None and time.monotonic() > deadline:
                res[v][pname] = {"reason": "skipped: budget"}
                continue
            if why[v] is None:
                try:  # warm-up: compiles, autotuning, the allocator's pools
                    for _ in range(args.warmup):
                        case.call(c, case.leaves(c, grad), grad)
                    _sync(cuda)
                except Exception as e:  # noqa: BLE001 (a failing path is a result)
                    why[v] = _why(e)
                    _free(cuda)
                    log(f"  {v} {pname}: {why[v][:200]}")
            if why[v] is not None:
                res[v][pname] = {"reason": why[v]}
                continue
            alive.append(v)
        host: dict[str, list[float]] = {v: [] for v in alive}
        wall: dict[str, list[float]] = {v: [] for v in alive}
        for r in range(args.runs):
            for v in alive if r % 2 == 0 else alive[::-1]:
                if why[v] is not None:
                    continue
                try:
                    h, w = host_wall_ms(case, cands[v], grad, cuda)
                except Exception as e:  # noqa: BLE001
                    why[v] = _why(e)
                    res[v][pname] = {"reason": why[v]}
                    _free(cuda)
                    continue
                host[v].append(h)
                wall[v].append(w)
        alive = [v for v in alive if why[v] is None]
        if cuda and alive:
            try:
                dev, count, how[pname] = device_ms(case, cands, alive, grad, args.runs)
            except Exception as e:  # noqa: BLE001 (host and wall figures still stand)
                dev, count, how[pname] = {}, {}, f"failed: {_why(e)}"
        else:
            dev, count, how[pname] = wall, {}, "cpu: synchronous, device time = wall time"
        for v in alive:
            res[v][pname] = {
                "host_ms": statistics.median(host[v]),
                "wall_ms": statistics.median(wall[v]),
                "device_ms": statistics.median(dev[v]) if dev.get(v) else None,
                "device_events": statistics.median(count[v]) if count.get(v) else None,
                "runs": args.runs,
            }
    return res, how


# ---------------------------------------------------------------------------- scenarios
def gemm_gflops(cuda: bool, dtype: torch.dtype) -> dict[str, Any]:
    """The device's plain GEMM rate, the yardstick of the baselines' health."""
    if not cuda:
        return {
            "gflops": torch_sgemm_gflops(n=1024, repeats=3),
            "what": "torch fp32 matmul 1024³, CPU",
        }
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = []
    for i in range(7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ a
        e1.record()
        torch.cuda.synchronize()
        if i >= 2:
            ms.append(e0.elapsed_time(e1))
    return {
        "gflops": 2 * n**3 / statistics.median(ms) / 1e6,
        "what": f"torch {dtype} matmul {n}³ on the GPU, CUDA events, median of 5",
    }


def run_scenario(
    name: str, case: Case, cands: dict[str, Cand], args, deadline: float, gemm: float
) -> tuple[dict, list[dict]]:
    t0 = time.perf_counter()
    fair = FAIR[case.bench]
    timed, how = time_case(case, cands, args, deadline)
    summary: dict[str, Any] = {
        "weight_mode": case.mode,
        "dtype": case.dtype,
        "flops": case.flops,
        "fair_baseline": fair,
        "tolerance": TOLERANCE[case.dtype],
        "unique_blocks": int(case.p["idx"].unique().numel()),
        "device_attribution": how,
        "candidates": {},
    }
    for v, c in cands.items():
        info: dict[str, Any] = {
            "reason": next((r["reason"] for r in timed[v].values() if "reason" in r), None)
        }
        if "host_ms" in timed[v].get("forward_backward", {}):
            try:
                info["errors"], info["grad_layout"] = check_errors(case, c)
            except Exception as e:  # noqa: BLE001
                info["errors"] = {"error": _why(e)}
                _free(args.device == "cuda")
            if v == fair:  # what makes it the fair baseline: training's sparse bank gradient
                summary["baseline_grad_layout"] = info.get("grad_layout")
                summary["baseline_grad_sparse"] = info.get("grad_layout") == "sparse_coo"
                if not summary["baseline_grad_sparse"]:
                    log(
                        f"  CHECK FAILED: {fair}'s bank gradient is {info.get('grad_layout')}, "
                        "not sparse_coo"
                    )
        summary["candidates"][v] = info
    rows = []
    for v in cands:
        for pname, _ in PASSES:
            r, base = timed[v][pname], timed[fair][pname]
            ratio = {
                k: (base[k] / r[k] if base.get(k) and r.get(k) else None)
                for k in ("device_ms", "wall_ms")
            }
            errs = summary["candidates"][v].get("errors")
            if errs and pname == "forward" and "out" in errs:
                errs = {"out": errs["out"]}
            dev = r.get("device_ms")
            rows.append(
                {
                    "bench": "memory_attention" if case.bench == "attention" else "ffn_memory",
                    "scenario": name,
                    "variant": v,
                    "pass": pname,
                    "device_ms": dev,
                    "host_ms": r.get("host_ms"),
                    "wall_ms": r.get("wall_ms"),
                    "device_events": r.get("device_events"),
                    "tflops_device": case.flops[pname] / dev / 1e9 if dev else None,
                    "vs_fair_baseline": {"device": ratio["device_ms"], "wall": ratio["wall_ms"]},
                    "errors": errs,
                    "reason": r.get("reason"),
                }
            )
    summary["health"] = {
        pname: baseline_health(fair, row["tflops_device"] * 1e3, gemm)
        for pname, _ in PASSES
        for row in rows
        if row["variant"] == fair and row["pass"] == pname and row["tflops_device"]
    }
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    return summary, rows


def skipped(name: str, bench: str, variants: list[str], reason: str) -> list[dict]:
    return [
        {
            "bench": "memory_attention" if bench == "attention" else "ffn_memory",
            "scenario": name,
            "variant": v,
            "pass": pname,
            "device_ms": None,
            "host_ms": None,
            "wall_ms": None,
            "device_events": None,
            "tflops_device": None,
            "vs_fair_baseline": {"device": None, "wall": None},
            "errors": None,
            "reason": reason,
        }
        for v in variants
        for pname, _ in PASSES
    ]


ATTN_VARIANTS = [
    "kernel",
    "kernel_shared_table",
    "gather_sdpa",
    "gather_sdpa_dense",
    "sdpa_wide",
    "flex",
]
FFN_VARIANTS = ["kernel", "kernel_shared_table", "gather_bmm", "gather_bmm_dense"]


# --------------------------------------------------------------------------------- main
def print_table(rows: list[dict]) -> None:
    cols = (
        "scenario",
        "variant",
        "pass",
        "device_ms",
        "host_ms",
        "wall_ms",
        "x dev",
        "x wall",
        "max err",
        "note",
    )
    cells = []
    for r in rows:
        errs = r["errors"] or {}
        err = errs.get("max", errs.get("out")) if "error" not in errs else "failed"
        cells.append(
            [
                r["scenario"],
                r["variant"],
                r["pass"],
                fmt(r["device_ms"]),
                fmt(r["host_ms"]),
                fmt(r["wall_ms"]),
                fmt(r["vs_fair_baseline"]["device"]),
                fmt(r["vs_fair_baseline"]["wall"]),
                f"{err:.1e}" if isinstance(err, float) else fmt(err),
                (r["reason"] or errs.get("error") or "")[:70],
            ]
        )
    print_aligned(cols, cells, last_width=70)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=None,
        help="timed repetitions per candidate (median; default 10, 3 with --quick)",
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed calls first (default 2, 1 with --quick)"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny shapes (kernel_ops.CPU_SIZES): a check, not a measurement",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds after which the candidates not yet started are skipped",
    )
    ap.add_argument(
        "--only", choices=list(SCENARIOS), action="append", help="this scenario only (repeatable)"
    )
    ap.add_argument(
        "--out",
        default=None,
        help="JSON (default bench/kernels/results/read-paths-DEVICE-DATE.json)",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    args.runs = args.runs or (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    cuda = args.device == "cuda"
    start = time.monotonic()
    deadline = start + args.budget_s if args.budget_s is not None else float("inf")
    tiny = args.quick or not cuda
    sz, fsz = (CPU_SIZES, FFN_CPU_SIZES) if tiny else (CUDA_SIZES, FFN_CUDA_SIZES)
    out = results_path(
        args.out,
        f"read-paths-{args.device}-{_dt.date.today().isoformat()}.json",
        results_dir(__file__),
    )
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    dtype = getattr(torch, sz["dtype"])
    gemm = gemm_gflops(cuda, dtype)
    results: dict[str, Any] = {
        "meta": {
            "command": command_line(),
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "triton": triton_version,
            "args": vars(args),
            "sizes": {"attention": sz, "ffn": fsz},
            "loadavg_start": loadavg(),
            "host": machine_meta(),
            "timing": {
                "device_ms": "CUDA: summed device event durations per call (torch.profiler), "
                "CPU: wall time",
                "host_ms": "perf_counter, call start to return, no final sync",
                "wall_ms": "sync, CUDA events around the call, sync",
            },
        },
        "health": {"gemm": gemm},
        "scenarios": {},
        "rows": [],
    }
    problems: dict[str, dict] = {}
    for name in [s for s in SCENARIOS if s in (args.only or SCENARIOS)]:
        bench, prob, mode = SCENARIOS[name]
        variants = ATTN_VARIANTS if bench == "attention" else FFN_VARIANTS
        if time.monotonic() > deadline:
            results["rows"] += skipped(name, bench, variants, "skipped: budget")
            results["scenarios"][name] = {"skipped": "budget"}
            continue
        log(f"{name}: {sz.get(prob, fsz)} mode {mode}")
        try:
            if bench == "attention":
                if prob not in problems:
                    make = moc_problem if prob == "moc" else hkv_problem
                    problems = {
                        prob: make(sz[prob], args.device, dtype)
                    }  # one problem held at a time
                case = attention_case(problems[prob], mode, sz[prob], sz["dtype"])
                cands = attention_cands(case.p, mode, cuda)
            else:
                problems = {}
                case = ffn_case(fsz, args.device)
                cands = ffn_cands(case.p, cuda)
            summary, rows = run_scenario(name, case, cands, args, deadline, gemm["gflops"])
        except Exception as e:  # noqa: BLE001 (the other scenarios still run)
            results["rows"] += skipped(name, bench, variants, f"scenario failed: {_why(e)}")
            results["scenarios"][name] = {"error": _why(e)}
            _free(cuda)
            continue
        summary["sizes"] = sz[prob] if bench == "attention" else fsz
        results["scenarios"][name] = summary
        results["rows"] += rows
        write_results(results, out)  # what is measured so far survives a timeout
        log(f"{name} done in {summary['seconds']} s ({time.monotonic() - start:.0f} s in all)")
    results["meta"]["seconds"] = round(time.monotonic() - start, 1)
    return finish(results, out, print_table)


if __name__ == "__main__":
    sys.exit(main())
