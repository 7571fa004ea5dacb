"""Where a memory read's time goes: host work (op dispatch, the reference table, launches)
against device work (kernels), for the fused reads and their gathered baselines.

    # on the lent GPU (~60 s)
    .venv/bin/python -m bench.kernels.profile_reads --device cuda --out DIR --tables
    .venv/bin/python -m bench.kernels.profile_reads --device cpu --quick --out DIR

The H100 runs of bench/kernels/kernel_ops.py put the fused memory-attention forward at 2.2 ms of
wall time against 0.62 ms of its kernel's device time, and a training step with the fused KV
read at 3x the gathered one; timing alone cannot say which op is to blame. Each case here is
run three ways, after a warm-up:

  enqueue   n calls with no synchronisation: the host's time per call (when it exceeds the
            device's, the GPU idles waiting for the host)
  wall      the same n calls up to the device's completion, per call
  profile   torch.profiler over n calls (CPU and CUDA activities): per call the ops
            dispatched, kernels launched, host syncs, device time, and the top ops by
            self host time and by self device time

Cases (the shapes of bench/kernels/kernel_ops.py and bench/kernels/ffn.py; the small anchor of
bench/training/training_steps.py): memory attention at moc (k = 65, sequence lists) and hkv (one
block per level), fused forward+backward, its table build alone, and SDPA on gathered
blocks; FFN memory fused (sparse and dense bank gradients) and gather + bmm; one training
step with the fused and the gathered KV and FFN reads. Writes profile.json (figures) and, with
--tables, profile.txt (the profiler's tables).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import log, run_meta

SYNC_OPS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::nonzero",
)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _dev_us(e) -> float:
    return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))


def measure(name: str, fn: Callable[[], Any], *, n: int, device: str, text: list[str]) -> dict:
    """Enqueue, wall and profiled figures per call of fn (see the module docstring)."""
    for _ in range(2):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    _sync(device)
    t2 = time.perf_counter()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            fn()
        _sync(device)
    ev = prof.key_averages()
    aten = [e for e in ev if e.key.startswith("aten::")]
    launches = sum(e.count for e in ev if "LaunchKernel" in e.key or e.key == "cuLaunchKernelEx")
    syncs = {e.key: e.count / n for e in ev if e.key in SYNC_OPS}
    # kernels only: a record_function range on the GPU (Optimizer.step#...) spans kernels that
    # are counted on their own
    dev_total = sum(
        e.time_range.elapsed_us()
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and "#" not in e.name
    )

    def top(key: Callable, k: int = 12) -> list[dict]:
        return [
            {
                "op": e.key,
                "calls": e.count / n,
                "self_host_us": e.self_cpu_time_total / n,
                "self_device_us": _dev_us(e) / n,
            }
            for e in sorted(ev, key=key, reverse=True)[:k]
        ]

    python_top = _python_top(fn, n, device) if PYPROFILE else []
    res = {
        "python_top": python_top,
        "enqueue_ms": (t1 - t0) / n * 1e3,
        "wall_ms": (t2 - t0) / n * 1e3,
        "device_ms": dev_total / n / 1e3,
        "aten_ops": sum(e.count for e in aten) / n,
        "launches": launches / n,
        "host_syncs": syncs,
        "top_host": top(lambda e: e.self_cpu_time_total),
        "top_device": top(_dev_us) if device == "cuda" else [],
    }
    log(
        f"{name}: enqueue {res['enqueue_ms']:.3f} ms, wall {res['wall_ms']:.3f} ms, device "
        f"{res['device_ms']:.3f} ms, {res['aten_ops']:.0f} aten ops, {res['launches']:.0f} "
        "launches, "
        f"syncs {syncs or 0}"
    )
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    for s in dict.fromkeys(("self_cpu_time_total", sort)):
        text += [f"==== {name} (per {n} calls), by {s}", ev.table(sort_by=s, row_limit=20), ""]
    return res


PYPROFILE = False  # --pyprofile: also where the host's Python time goes (cProfile)


def _python_top(fn: Callable[[], Any], n: int, device: str, k: int = 30) -> list[dict]:
    """cProfile over n calls: the k functions with the most own (tottime) host time per call,
    and their cumulative time. The torch profiler sees aten ops and launches, not the Python
    around them (argument checks, table views, Triton's launcher), which is what a host-bound
    fused read spends most of its time in."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    _sync(device)
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _) in st.stats.items():
        where = f"{Path(file).name}:{line}({func})" if line else func
        rows.append(
            {"fn": where, "calls": nc / n, "tottime_us": tt / n * 1e6, "cumtime_us": ct / n * 1e6}
        )
    return sorted(rows, key=lambda r: r["tottime_us"], reverse=True)[:k]


def _fresh(leaves: list) -> list:
    """The leaves with no gradient yet: each call then pays for creating its gradients, as one
    training step does, and not for adding into the last call's (a bank-sized add for a dense
    gradient, a growing concatenation for a sparse one)."""
    for t in leaves:
        t.grad = None
    return leaves


def attention_cases(args, out: dict, text: list[str]) -> None:
    from bench.kernels.kernel_ops import (
        CPU_SIZES,
        CUDA_SIZES,
        gather_sdpa,
        hkv_problem,
        moc_problem,
    )
    from memtree.kernels.memory_attention import memory_attention, memory_attention_table
    from memtree.kernels.memory_attention.table import build_table

    sz = CUDA_SIZES if args.device == "cuda" else CPU_SIZES
    dtype = getattr(torch, sz["dtype"]) if args.device == "cuda" else torch.float32
    impl = "auto" if args.device == "cuda" else "reference"
    for shape, make in (("moc", moc_problem), ("hkv", hkv_problem)):
        p = make(sz[shape], args.device, dtype)
        leaves = [p[k].detach().requires_grad_() for k in ("q", "bank_k", "bank_v")]

        def fused(p=p, leaves=leaves):
            memory_attention(*_fresh(leaves), p["idx"], impl=impl).backward(p["dy"])

        shared = memory_attention_table(p["q"], p["bank_k"], p["bank_v"], p["idx"], impl=impl)

        def fused_shared(p=p, leaves=leaves, shared=shared):  # the table built once per step
            memory_attention(*_fresh(leaves), p["idx"], impl=impl, table=shared).backward(p["dy"])

        def fused_fwd(p=p):
            memory_attention(p["q"], p["bank_k"], p["bank_v"], p["idx"], impl=impl)

        def sdpa(p=p, leaves=leaves):
            gather_sdpa(*_fresh(leaves), p["idx"]).backward(p["dy"])

        def table(p=p):
            build_table(p["idx"], None, p["q"].shape[2], p["n"], 64)

        for name, fn in (
            ("fused_fwd_bwd", fused),
            ("fused_shared_table_fwd_bwd", fused_shared),
            ("fused_fwd", fused_fwd),
            ("sdpa_gather_fwd_bwd", sdpa),
            ("table_build", table),
        ):
            out[f"attention_{shape}_{name}"] = measure(
                f"attention {shape} {name}", fn, n=args.n, device=args.device, text=text
            )


def ffn_cases(args, out: dict, text: list[str]) -> None:
    from bench.kernels.ffn import CPU_SIZES, CUDA_SIZES, gather_bmm, make_problem
    from memtree.kernels.ffn_memory import ffn_memory

    p = make_problem(CUDA_SIZES if args.device == "cuda" else CPU_SIZES, args.device)
    impl = "auto" if args.device == "cuda" else "reference"
    leaves = [p["x"].detach().requires_grad_(), *(b.detach().requires_grad_() for b in p["banks"])]
    cases = {
        "fused_sparse": lambda: ffn_memory(*_fresh(leaves), p["idx"], impl=impl),
        "fused_dense": lambda: ffn_memory(*_fresh(leaves), p["idx"], sparse_grad=False, impl=impl),
        "gather_bmm": lambda: gather_bmm(*_fresh(leaves), p["idx"]),
    }
    for name, f in cases.items():
        out[f"ffn_{name}_fwd_bwd"] = measure(
            f"ffn {name}",
            lambda f=f: f().backward(p["dy"]),
            n=args.n,
            device=args.device,
            text=text,
        )


def training_cases(args, out: dict, text: list[str]) -> None:
    from bench.training.steps_models import (
        Trainer,
        anchor_shape,
        fetched_width,
        make_batches,
        split_width,
    )
    from bench.training.training_steps import sizes
    from memtree.geometry import MemoryConfig

    S = sizes(args.quick) | {"device": args.device}
    a = anchor_shape(S)
    mults = split_width(fetched_width(a, S["fetch_fraction"]), S["level_weights"])
    br = S["overhead_branching"]
    batches = make_batches(
        S,
        args.steps + 2,
        seq_len=S["seq_len"],
        n_leaf=br ** len(mults),
        levels=len(mults),
        branching=br,
        seed=S["seed"] + 300,
    )
    for kind in ("kv", "ffn"):
        mem = MemoryConfig(multipliers=mults, type=kind, branching=br)
        for read in ("fused", "gather"):
            tr = Trainer(S, a, mem, read=read)
            it = iter(batches * 100)
            out[f"train_{kind}_{read}"] = measure(
                f"training step {S['anchor']['name']} {kind} {read}",
                lambda tr=tr, it=it: tr.step(next(it)),
                n=args.steps,
                device=args.device,
                text=text,
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU)")
    ap.add_argument("--out", required=True, help="folder for profile.json and profile.txt")
    ap.add_argument("--n", type=int, default=10, help="calls per kernel case")
    ap.add_argument("--steps", type=int, default=4, help="training steps per training case")
    ap.add_argument("--only", choices=("attention", "ffn", "training"), action="append")
    ap.add_argument(
        "--tables",
        action="store_true",
        help="also write profile.txt, the profiler's tables (large; the device check "
        "leaves it out: at most 8 files come back from the device)",
    )
    ap.add_argument(
        "--pyprofile",
        action="store_true",
        help="also the top Python functions by own host time per call (cProfile)",
    )
    args = ap.parse_args(argv)
    global PYPROFILE
    PYPROFILE = args.pyprofile
    if args.quick:
        args.n, args.steps = min(args.n, 2), min(args.steps, 2)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "format": "memtree-profile-reads",
        "version": 1,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "meta": run_meta(args),
        "cases": {},
    }
    text: list[str] = []
    for name, fn in (
        ("attention", attention_cases),
        ("ffn", ffn_cases),
        ("training", training_cases),
    ):
        if args.only and name not in args.only:
            continue
        try:
            fn(args, res["cases"], text)
        except Exception as e:  # noqa: BLE001 (one broken group must not cost the others)
            res.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            log(f"{name}: {type(e).__name__}: {e}")
        files = [(outdir / "profile.json", json.dumps(res, indent=1))]
        if args.tables:
            files.append((outdir / "profile.txt", "\n".join(text)))
        for path, body in files:
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(body)
            os.replace(tmp, path)
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
