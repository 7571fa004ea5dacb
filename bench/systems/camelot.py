"""Overhead per token of CAMELoT's memory (seed 001) over a frozen model's windowed forward.

    .venv/bin/python -m bench.systems.camelot --quick          # < 2 min: tiny shape, small M list
    # full: tiny + d768 shapes, M 256 … 65,536
    .venv/bin/python -m bench.systems.camelot
    .venv/bin/python -m bench.systems.camelot --shapes tiny --slots 256,4096 --windows 4 \
        --out /tmp/c.json

Two parts, both against a baseline measured in the same run:

  memory  one layer's memory alone (`AssociativeMemory.read` + `write` of one window's keys and
          values, no model): ms per window for M slots per layer and KV head, search "exact"
          (torch), "faiss-flat" (IndexFlatIP) and "faiss-ivf" (IndexIVFFlat, √M lists, 8
          probed), plus the Memorizing baseline's FIFO kNN cache (exact). Reported also as µs
          per token for all of the shape's layers and as a ratio to the base forward's time
          per token of that shape (measured in this run): the memory's share of the overhead.
  e2e     `training.camelot.longdoc.longdoc_token_nll` over a document of --windows windows of L
          tokens on memtree's AnchorLM (random weights, frozen): methods base / xl /
          memorizing / camelot, memory on every layer. Each method's time is measured
          interleaved with base's (base, method, method, base, ...) and the ratio taken to that
          adjacent base time, so outside load hits both alike.

Memories start FULL (steady state; filling 65,536 slots takes 512 windows): random slot keys
and values, counts 1..4, ages 0..49; the first window after that is a warm-up (it also trains
the IVF index) and is not timed. The memory-alone keys are clustered random vectors (some
tokens consolidate, most are novel); in e2e the keys are the model's own. Times are wall
clock on the CPU, medians over --repeats; the machine load is recorded before and after.
torch and FAISS run on --threads (default 1) threads: on a shared 2-core machine two OpenMP
threads against outside load made every method, base included, 20-100x slower.
The JSON (`--out`, default bench/systems/results/camelot-<date>-<machine>.json) holds every figure
and the sizes used.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from bench.common import (
    command_line,
    finish,
    fmt,
    loadavg,
    log,
    pressure,
    print_aligned,
    results_dir,
    results_path,
    write_results,
)
from memtree.geometry import AnchorShape, get_anchor
from memtree.memstore.camelot.memory import AssociativeMemory, CamelotConfig, FifoKNNCache
from memtree.training.camelot.longdoc import longdoc_token_nll, new_memory
from memtree.training.model import AnchorLM, ModelConfig

# Anchor shapes (training/model.py's AnchorLM): "tiny" is the demo's anchor (4 layers × d 128,
# 4 heads × 32); "d768" a GPT-2-small-sized one (12 × 768, 12 heads × 64).
SHAPES = {
    "tiny": {"anchor": "tiny"},
    "d768": {"n_layers": 12, "d_model": 768, "n_heads": 12, "head_dim": 64, "ffn_dim": 3072},
}
SEARCHES = {
    "exact": {"search": "exact"},
    "faiss-flat": {"search": "faiss", "faiss_index": "flat"},
    "faiss-ivf": {"search": "faiss", "faiss_index": "ivf"},
}


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "shapes": ["tiny"],
            "slots": [256, 4096],
            "e2e_slots": [256, 4096],
            "window": 128,
            "windows": 2,
            "repeats": 2,
            "memory_windows": 3,
            "vocab": 8192,
            "max_gb": 1.0,
        }
    return {
        "shapes": ["tiny", "d768"],
        "slots": [256, 1024, 4096, 16384, 65536],
        "e2e_slots": [256, 4096, 65536],
        "window": 128,
        "windows": 3,
        "repeats": 3,
        "memory_windows": 5,
        "vocab": 8192,
        "max_gb": 2.0,
    }


def anchor_of(shape: str, vocab: int):
    spec = SHAPES[shape]
    if "anchor" in spec:
        return replace(get_anchor(spec["anchor"]), vocab_size=vocab)
    return AnchorShape(name=shape, vocab_size=vocab, **spec)


def fill(mem, gen) -> None:
    """Put a full memory in place (module docstring): random keys / values, counts, ages."""
    if isinstance(mem, AssociativeMemory | FifoKNNCache):
        mem.keys.copy_(torch.randn(mem.keys.shape, generator=gen))
        mem.values.copy_(torch.randn(mem.values.shape, generator=gen))
    if isinstance(mem, AssociativeMemory):
        mem.counts.copy_(torch.randint(1, 5, mem.counts.shape, generator=gen))
        mem.ages.copy_(torch.randint(0, 50, mem.ages.shape, generator=gen))
        mem.filled.fill_(True)
    elif isinstance(mem, FifoKNNCache):
        mem.cursor, mem.size = 0, mem.cfg.slots
    if hasattr(mem, "_search"):
        mem._search.changed()


def table_gb(n_layers: int, heads: int, dim: int, slots: int, window: int) -> float:
    """Keys + values of every layer plus one (H, L, M) similarity matrix, fp32."""
    return (n_layers * heads * slots * dim * 2 + heads * window * slots) * 4 / 1e9


# ------------------------------------------------------------------------------ base forward
def base_per_token(model, doc, window: int) -> float:
    t0 = time.perf_counter()
    longdoc_token_nll(model, doc, method="base", window=window)
    return (time.perf_counter() - t0) / (len(doc) - 1)


# ---------------------------------------------------------------------------- memory alone
def bench_memory(
    S: dict, shape: str, base_s: float, n_layers: int, heads: int, dim: int
) -> list[dict]:
    L, rows = S["window"], []
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(heads, 4 * max(S["slots"]), dim, generator=g)
    wins = []
    for _ in range(S["memory_windows"] + 1):
        pick = torch.randint(centers.shape[1], (heads, L), generator=g)
        k = torch.gather(centers, 1, pick[..., None].expand(-1, -1, dim)) + 0.15 * torch.randn(
            heads, L, dim, generator=g
        )
        wins.append((k, torch.randn(heads, L, dim, generator=g)))
    variants = [("camelot", s) for s in SEARCHES] + [("memorizing", "exact")]
    for m in S["slots"]:
        if table_gb(1, heads, dim, m, L) > S["max_gb"]:
            log(f"memory {shape} M={m}: skipped (over --max-gb)")
            continue
        for kind, search in variants:
            cfg = CamelotConfig(slots=m, **SEARCHES[search])
            cls = AssociativeMemory if kind == "camelot" else FifoKNNCache
            mem = cls(cfg, kv_heads=heads, head_dim=dim)
            fill(mem, torch.Generator().manual_seed(1))
            times = []
            for i, (k, v) in enumerate(wins):
                t0 = time.perf_counter()
                _, match = mem.read(k)
                mem.write(k, v, match)
                if i:  # the first window is a warm-up (and trains the IVF index)
                    times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            us_tok = ms * 1e3 * n_layers / L
            rows.append(
                {
                    "part": "memory",
                    "shape": shape,
                    "method": kind,
                    "search": search,
                    "slots": m,
                    "ms_per_window_layer": ms,
                    "us_per_token": us_tok,
                    "base_us_per_token": base_s * 1e6,
                    "ratio": us_tok / (base_s * 1e6),
                    "stats": dict(mem.stats),
                    "times_s": times,
                }
            )
            log(
                f"memory {shape} {kind}/{search} M={m}: {ms:.2f} ms per window and layer "
                f"({rows[-1]['ratio']:.2f}x base per token, {n_layers} layers)"
            )
            del mem
    return rows


# ------------------------------------------------------------------------------ end to end
def bench_e2e(S: dict, shape: str, model, n_layers: int, heads: int, dim: int) -> list[dict]:
    L, W = S["window"], S["windows"]
    g = torch.Generator().manual_seed(2)
    doc = torch.randint(S["vocab"], (W * L + 1,), generator=g)
    warm = torch.randint(S["vocab"], (L + 1,), generator=g)
    configs = [("xl", "-", 4096), ("memorizing", "exact", 4096)]
    configs += [("camelot", s, m) for m in S["e2e_slots"] for s in SEARCHES]
    rows = []
    for method, search, m in configs:
        if method != "xl" and table_gb(n_layers, heads, dim, m, L) > S["max_gb"]:
            log(f"e2e {shape} {method}/{search} M={m}: skipped (memory over --max-gb)")
            continue
        cfg = CamelotConfig(slots=m, **SEARCHES.get(search, {}))
        mem = new_memory(model, method, cfg)
        fill_gen = torch.Generator().manual_seed(1)
        for layer in mem.layers.values():
            fill(layer, fill_gen)
        longdoc_token_nll(model, warm, method=method, window=L, memory=mem)  # warm-up, IVF training
        t_base, t_meth = [], []
        for r in range(S["repeats"]):
            for which in ("base", method) if r % 2 == 0 else (method, "base"):
                t0 = time.perf_counter()
                if which == "base":
                    longdoc_token_nll(model, doc, method="base", window=L)
                else:
                    longdoc_token_nll(model, doc, method=method, window=L, memory=mem)
                (t_base if which == "base" else t_meth).append(
                    (time.perf_counter() - t0) / (len(doc) - 1)
                )
        b, t = statistics.median(t_base), statistics.median(t_meth)
        rows.append(
            {
                "part": "e2e",
                "shape": shape,
                "method": method,
                "search": search,
                "slots": None if method == "xl" else m,
                "us_per_token": t * 1e6,
                "base_us_per_token": b * 1e6,
                "ratio": t / b,
                "stats": mem.stats(),
                "times_s": t_meth,
                "base_times_s": t_base,
            }
        )
        log(
            f"e2e {shape} {method}/{search} M={m}: {t * 1e6:.0f} us/token vs base {b * 1e6:.0f} "
            f"({t / b:.2f}x)"
        )
        del mem
    return rows


def print_table(rows: list[dict]) -> None:
    cols = [
        ("part", "part"),
        ("shape", "shape"),
        ("method", "method"),
        ("search", "search"),
        ("slots", "M"),
        ("ms_per_window_layer", "ms/window/layer"),
        ("us_per_token", "us/token"),
        ("base_us_per_token", "base us/token"),
        ("ratio", "ratio"),
    ]
    print_aligned([h for _, h in cols], [[fmt(r.get(k)) for k, _ in cols] for r in rows])
    print(
        "\nratio: e2e = method / base time per token (adjacent runs); memory = the memory alone, "
        "read + write on every layer, per token / base forward per token"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small variant (< 2 min)")
    ap.add_argument("--shapes", help=f"comma-separated among {sorted(SHAPES)}")
    ap.add_argument("--slots", help="M list for the memory-alone part, e.g. 256,4096,65536")
    ap.add_argument("--e2e-slots", help="M list for the end-to-end part")
    ap.add_argument("--windows", type=int, help="windows of L tokens per timed document (e2e)")
    ap.add_argument("--repeats", type=int, help="timed repetitions per e2e method (median)")
    ap.add_argument(
        "--memory-windows", type=int, help="timed windows per memory-alone case (median)"
    )
    ap.add_argument("--window", type=int, help="L, tokens per window (default 128)")
    ap.add_argument("--vocab", type=int, help="vocabulary size of the random anchors")
    ap.add_argument("--max-gb", type=float, help="skip cases whose memory tables exceed this")
    ap.add_argument("--only", choices=("memory", "e2e"), action="append", help="run only this part")
    # One thread by default: on a shared 2-core machine, two spinning OpenMP threads against
    # someone else's load cost 10-100x on these small ops (measured), drowning the comparison.
    ap.add_argument("--threads", type=int, default=1, help="torch / FAISS threads (default 1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    S = sizes(args.quick)
    for key in ("windows", "repeats", "memory_windows", "window", "vocab", "max_gb"):
        if getattr(args, key) is not None:
            S[key] = getattr(args, key)
    for key in ("shapes", "slots", "e2e_slots"):
        val = getattr(args, key)
        if val:
            S[key] = [x if key == "shapes" else int(x) for x in val.split(",")]
    bad = [s for s in S["shapes"] if s not in SHAPES]
    if bad:
        ap.error(f"--shapes: unknown {bad}; known {sorted(SHAPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import faiss

        faiss.omp_set_num_threads(torch.get_num_threads())
        faiss_version = faiss.__version__
    except ImportError:  # pragma: no cover
        ap.error("faiss is not installed")

    host = platform.node() or "cpu"
    date = _dt.date.today().isoformat()
    # a --quick run never overwrites the full run's figures (docs/BENCHMARKS.md cites that file)
    stem = f"camelot-quick-{date}-{host}" if args.quick else f"camelot-{date}-{host}"
    out = results_path(args.out, f"{stem}.json", results_dir(__file__))
    results: dict[str, Any] = {
        "meta": {
            "command": command_line(),
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "quick": args.quick,
            "machine": {
                "host": host,
                "platform": platform.platform(),
                "processor": platform.processor(),
                "cpu_count": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
            },
            "torch": torch.__version__,
            "faiss": faiss_version,
            "sizes": S,
            "loadavg_start": loadavg(),
            "pressure_start": pressure(),
        },
        "shapes": {},
        "rows": [],
    }
    parts = args.only or ["memory", "e2e"]
    with torch.no_grad():
        for shape in S["shapes"]:
            a = anchor_of(shape, S["vocab"])
            torch.manual_seed(0)
            model = AnchorLM(ModelConfig(anchor=a, max_seq_len=2 * S["window"])).eval()
            doc = torch.randint(S["vocab"], (S["windows"] * S["window"] + 1,))
            base_per_token(model, doc[: S["window"] + 1], S["window"])  # warm-up
            base_s = statistics.median(
                base_per_token(model, doc, S["window"]) for _ in range(S["repeats"])
            )
            results["shapes"][shape] = {
                "anchor": a.__dict__,
                "params": a.params(),
                "base_us_per_token": base_s * 1e6,
                "loadavg": loadavg(),
            }
            log(
                f"{shape}: {a.n_layers} layers x d {a.d_model}, {a.kv_heads} KV heads x "
                f"{a.head_dim}: "
                f"base {base_s * 1e6:.0f} us/token"
            )
            if "memory" in parts:
                results["rows"] += bench_memory(
                    S, shape, base_s, a.n_layers, a.kv_heads, a.head_dim
                )
                write_results(results, out)
            if "e2e" in parts:
                results["rows"] += bench_e2e(S, shape, model, a.n_layers, a.kv_heads, a.head_dim)
                write_results(results, out)
            del model
    return finish(results, out, print_table)


if __name__ == "__main__":
    sys.exit(main())
