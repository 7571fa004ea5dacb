"""Benchmarks of the memory store (memstore), each against its baseline in the same run.

    # full suite 3 times (~2 min; ~3.5 GB of banks per run, deleted)
    .venv/bin/python -m bench.memstore.memstore_io
    # small variant (seconds)
    .venv/bin/python -m bench.memstore.memstore_io --quick --runs 1
    .venv/bin/python -m bench.memstore.memstore_io --only flat --out /tmp/flat.json

Benchmarks (see bench/README.md for what each one compares):

  throughput  MemoryStore.fetch_flat from the flash tier (O_DIRECT, verify="always") vs plain
              O_DIRECT os.preadv of the same offsets and sizes into one aligned buffer
                                                                          target >= 0.8x
  flat        random-block fetch latency of a bank with 100x the blocks vs a small bank, same
              block size, O_DIRECT                                        target <= 1.2x
  calibrate   memstore.sim.calibrate on this machine, then validate: simulate_fetch on the measured
              profile vs real cold path fetches of a 3-level bank
                                                target: simulated/measured within 20%
  session     per-level cache hit rates of a real store on a Zipf trace vs simulate_session's
              (same ByteLRU policy)                                        target: equal

The suite runs --runs times (default 3); the final table gives per-figure medians over the runs.
Every figure written to the JSON (`--out`, default bench/memstore/results/memstore-<date>.json) says
which bank it was measured on. Nothing is extrapolated.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    command_line,
    loadavg,
    log,
    machine_basics,
    pressure,
    print_targets,
    results_dir,
    results_path,
    wait_quiet,
    write_results,
)
from memtree.geometry import MemoryConfig, get_anchor, plan, stored_bytes
from memtree.memstore.format import level_path
from memtree.memstore.sim.calibrate import (
    drop_cache,
    format_calibration,
    format_validation,
    measure,
    random_init,
    validate,
    write_profile,
)
from memtree.memstore.sim.latency import simulate_session, zipf_trace
from memtree.memstore.sim.profiles import HardwareProfile, TierProfile
from memtree.memstore.store import MemoryStore, TierConfig
from memtree.memstore.writer import write_bank

BENCHES = ("throughput", "flat", "calibrate", "session")
MiB = 1 << 20


# ------------------------------------------------------------------------------------ sizes
def sizes(quick: bool) -> dict[str, Any]:
    """Every size the benchmarks use; recorded verbatim in the JSON."""
    if quick:
        return {
            "anchor": "openlm-160m",
            "throughput_multiplier": 16,  # 1.7 MB blocks
            "throughput_branching": 4,
            "throughput_fetches": 16,
            "rounds": 2,
            "flat_multiplier": 4,  # 430 kB blocks
            "flat_small_branching": 4,  # level 2: 16 blocks
            "flat_big_branching": 13,  # level 2: 169 blocks
            "flat_fetches": 40,
            "calibrate_sizes": [4096, 65536, 1 << 20, 4 << 20],
            "calibrate_repeats": 8,
            "calibrate_bank_bytes": 16 * MiB,
            "validate_multipliers": [64, 16, 4],
            "validate_branching": 4,
            "validate_fetches": 20,
            "session_multipliers": [64, 16, 4],
            "session_branching": 4,
            "session_queries": 200,
            "session_cache_bytes": 16 * MiB,
        }
    return {
        "anchor": "openlm-160m",
        "throughput_multiplier": 64,  # the 160M model's level-2 FFN block: 6,881,280 B in bf16
        "throughput_branching": 6,  # level 2: 36 blocks, 248 MB
        "throughput_fetches": 60,
        "rounds": 3,
        "flat_multiplier": 16,  # 1,720,320 B blocks
        "flat_small_branching": 4,  # level 2: 16 blocks, 27.5 MB
        "flat_big_branching": 41,  # level 2: 1,681 blocks, 2.89 GB (105x)
        "flat_fetches": 150,
        "calibrate_sizes": [4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 32 << 20],
        "calibrate_repeats": 30,
        "calibrate_bank_bytes": 64 * MiB,
        "validate_multipliers": [64, 16, 4],
        "validate_branching": 4,
        "validate_fetches": 60,
        "session_multipliers": [64, 16, 4],
        "session_branching": 4,
        "session_queries": 1000,
        "session_cache_bytes": 16 * MiB,
    }


# ---------------------------------------------------------------------------------- helpers
def judge(rule: tuple | None, value: Any, baseline: Any, ratio: float | None) -> bool | None:
    """Whether a row meets its target: ("ge", x) / ("le", x) / ("between", lo, hi) on the ratio,
    ("eq",) on value == baseline."""
    if rule is None:
        return None
    if rule[0] == "eq":
        return value == baseline
    if ratio is None:
        return False
    return {
        "ge": lambda: ratio >= rule[1],
        "le": lambda: ratio <= rule[1],
        "between": lambda: rule[1] <= ratio <= rule[2],
    }[rule[0]]()


def row(
    bench: str,
    metric: str,
    value: Any,
    *,
    data: str,
    baseline: Any = None,
    ratio: float | None = None,
    target: str = "",
    rule: tuple | None = None,
    unit: str = "",
) -> dict:
    return {
        "bench": bench,
        "metric": metric,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "ratio": ratio,
        "target": target,
        "rule": rule,
        "met": judge(rule, value, baseline, ratio),
        "data": data,
    }


def _median(xs: list) -> Any:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return float(np.median(xs)) if all(isinstance(x, (int, float)) for x in xs) else xs[0]


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """One row per metric over several runs: medians of value, baseline and ratio (each taken on
    its own), the ratio's range, and the target judged on the medians ("eq" rules: in every run)."""
    out = []
    for rows in zip(*runs, strict=True):
        r = dict(rows[0])
        for k in ("value", "baseline", "ratio"):
            r[k] = _median([x[k] for x in rows])
        ratios = [x["ratio"] for x in rows if x["ratio"] is not None]
        r["ratio_range"] = [min(ratios), max(ratios)] if ratios else None
        r["runs"] = len(rows)
        if r["rule"] is not None and r["rule"][0] == "eq":
            r["met"] = all(x["met"] for x in rows)
        else:
            r["met"] = judge(r["rule"], r["value"], r["baseline"], r["ratio"])
        out.append(r)
    return out


def print_table(rows: list[dict]) -> None:
    print_targets(rows, unit_on_baseline=True)


def write_bank_for(root: Path, anchor: str, multipliers: list[int], branching: int, seed: int):
    """A bf16 FFN bank with random values (the calibration's init), page cache dropped
    afterwards."""
    t0 = time.perf_counter()
    info = write_bank(
        root,
        anchor=get_anchor(anchor),
        memory=MemoryConfig(multipliers=tuple(multipliers), branching=branching),
        dtype="bf16",
        init=random_init(seed),
    )
    for lv in info.levels.values():
        drop_cache(level_path(info.root, lv))
    size = sum(lv.file_bytes for lv in info.levels.values())
    log(f"wrote {root.name}: {size / 1e9:.3f} GB in {time.perf_counter() - t0:.1f} s")
    return info


def flash_store(root: Path, *, verify: str = "always", cache_bytes: int = 0):
    return MemoryStore(
        root,
        tiers=(TierConfig(name="flash", kind="flash", cache_bytes=cache_bytes, direct=True),),
        placement="hierarchical",
        verify=verify,
    )


def _direct_of(store) -> bool:
    return all(getattr(L.reader, "direct", False) for L in store.levels.values())


# ------------------------------------------------------------------------- 1. throughput
def bench_throughput(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    m, B = S["throughput_multiplier"], S["throughput_branching"]
    root = ctx["work"] / "throughput-bank"
    info = write_bank_for(root, S["anchor"], [0, m], B, seed=1)
    lv = info.level(2)
    data = (
        f"{S['anchor']} FFN level-2 bank (m={m}, branching {B}): {lv.n_blocks} blocks of "
        f"{lv.record_bytes:,} B bf16, {lv.file_bytes / 1e9:.3f} GB"
    )
    path = level_path(info.root, lv)
    rng = np.random.default_rng(0)
    n = S["throughput_fetches"]
    store = flash_store(root)
    store_nv = flash_store(root, verify="never")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, lv.stride)
    buf[:] = bytes(
        lv.stride
    )  # touched once: the baseline's buffer is resident, as a reading loop's would be

    def cand(seq):
        for c in seq:
            store.fetch_flat(2, int(c))

    def cand_never(seq):
        for c in seq:
            store_nv.fetch_flat(2, int(c))

    def raw(seq):
        for c in seq:
            os.preadv(fd, [buf], int(c) * lv.stride)

    def raw_fresh(
        seq,
    ):  # the store's allocation pattern: a new anonymous mmap per read, no checksum
        for c in seq:
            b = mmap.mmap(-1, lv.stride)
            os.preadv(fd, [b], int(c) * lv.stride)
            b.close()

    def raw_heap(
        seq,
    ):  # a new buffer per read from the heap (np.empty, aligned slice): freed memory is reused
        for c in seq:
            a = np.empty(lv.stride + 4096, dtype=np.uint8)
            off = -a.ctypes.data % 4096
            os.preadv(fd, [a[off : off + lv.stride]], int(c) * lv.stride)

    variants = {
        "store": cand,
        "raw": raw,
        "raw_fresh_mmap": raw_fresh,
        "raw_heap_buffer": raw_heap,
        "store_verify_never": cand_never,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for r in range(S["rounds"]):
            seq = rng.integers(lv.n_blocks, size=n)
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for k in order:
                t0 = time.perf_counter()
                variants[k](seq)
                times[k].append(time.perf_counter() - t0)
        direct = _direct_of(store)
    finally:
        os.close(fd)
        store.close()
        store_nv.close()
        shutil.rmtree(root, ignore_errors=True)
    nbytes = n * lv.record_bytes
    gbps = {k: nbytes * len(v) / sum(v) / 1e9 for k, v in times.items()}
    ratio = gbps["store"] / gbps["raw"]
    res = {
        "data": data,
        "direct": direct,
        "fetches_per_round": n,
        "rounds": S["rounds"],
        "block_bytes": lv.record_bytes,
        "seconds": times,
        "gbps": gbps,
        "ratio": ratio,
    }
    rows = [
        row(
            "throughput",
            "fetch_flat GB/s, flash O_DIRECT, verify=always vs raw O_DIRECT preadv (same offsets)",
            gbps["store"],
            baseline=gbps["raw"],
            ratio=ratio,
            target=">= 0.8x",
            rule=("ge", 0.8),
            unit="GB/s",
            data=data,
        ),
        row(
            "throughput",
            "  attribution: raw O_DIRECT into a fresh mmap per read (store's allocation), no "
            "checksum",
            gbps["raw_fresh_mmap"],
            baseline=gbps["raw"],
            ratio=gbps["raw_fresh_mmap"] / gbps["raw"],
            target="(info)",
            unit="GB/s",
            data=data,
        ),
        row(
            "throughput",
            "  attribution: raw O_DIRECT into a new np.empty heap buffer per read (aligned slice)",
            gbps["raw_heap_buffer"],
            baseline=gbps["raw"],
            ratio=gbps["raw_heap_buffer"] / gbps["raw"],
            target="(info)",
            unit="GB/s",
            data=data,
        ),
        row(
            "throughput",
            "  attribution: fetch_flat with verify=never",
            gbps["store_verify_never"],
            baseline=gbps["raw"],
            ratio=gbps["store_verify_never"] / gbps["raw"],
            target="(info)",
            unit="GB/s",
            data=data,
        ),
    ]
    if not direct:
        rows[0]["target"] += " (O_DIRECT refused: not comparable)"
    return res, rows


# ------------------------------------------------------------------------------- 2. flat
def bench_flat(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    m = S["flat_multiplier"]
    small_b, big_b = S["flat_small_branching"], S["flat_big_branching"]
    block = stored_bytes(plan(S["anchor"], (0, m)).levels[1].block_params, "bf16")
    need = (big_b**2 + small_b**2 + 2) * block
    free = shutil.disk_usage(ctx["work"]).free
    if free < 2 * need:
        raise RuntimeError(
            f"flat: needs {need / 1e9:.2f} GB of banks; only {free / 1e9:.1f} GB free at "
            f"{ctx['work']}"
        )
    small_root, big_root = ctx["work"] / "flat-small", ctx["work"] / "flat-big"
    small = write_bank_for(small_root, S["anchor"], [0, m], small_b, seed=2)
    big = write_bank_for(big_root, S["anchor"], [0, m], big_b, seed=3)
    ns, nb = small.level(2).n_blocks, big.level(2).n_blocks
    data = (
        f"{S['anchor']} FFN level-2 banks (m={m}), blocks of {block:,} B bf16: small {ns} blocks "
        f"({small.level(2).file_bytes / 1e9:.3f} GB) vs big {nb:,} blocks "
        f"({big.level(2).file_bytes / 1e9:.2f} GB)"
    )
    rng = np.random.default_rng(1)
    t = {"small": [], "big": []}
    stores = {"small": flash_store(small_root), "big": flash_store(big_root)}
    n_blocks = {"small": ns, "big": nb}
    try:
        direct = all(_direct_of(s) for s in stores.values())
        for i in range(S["flat_fetches"] + 2):
            for k in ("small", "big") if i % 2 == 0 else ("big", "small"):
                c = int(rng.integers(n_blocks[k]))
                t0 = time.perf_counter()
                stores[k].fetch_flat(2, c)
                dt = time.perf_counter() - t0
                if i >= 2:  # two warm-up fetches each
                    t[k].append(dt)
    finally:
        for s in stores.values():
            s.close()
        shutil.rmtree(small_root, ignore_errors=True)
        shutil.rmtree(big_root, ignore_errors=True)
    st = {
        k: {
            "mean_s": float(np.mean(v)),
            "median_s": float(np.median(v)),
            "p90_s": float(np.percentile(v, 90)),
            "n": len(v),
        }
        for k, v in t.items()
    }
    ratio = st["big"]["mean_s"] / st["small"]["mean_s"]
    ratio_med = st["big"]["median_s"] / st["small"]["median_s"]
    res = {
        "data": data,
        "direct": direct,
        "block_bytes": block,
        "blocks": n_blocks,
        "stats": st,
        "ratio_mean": ratio,
        "ratio_median": ratio_med,
        "seconds": t,
    }
    rows = [
        row(
            "flat",
            f"random fetch latency, mean: {nb:,}-block bank vs {ns}-block bank ({nb / ns:.0f}x "
            "blocks)",
            st["big"]["mean_s"] * 1e3,
            baseline=st["small"]["mean_s"] * 1e3,
            ratio=ratio,
            target="<= 1.2x",
            rule=("le", 1.2),
            unit="ms",
            data=data,
        ),
        row(
            "flat",
            "  same, median",
            st["big"]["median_s"] * 1e3,
            baseline=st["small"]["median_s"] * 1e3,
            ratio=ratio_med,
            target="(info)",
            unit="ms",
            data=data,
        ),
    ]
    return res, rows


# -------------------------------------------------------------------------- 3. calibrate
def bench_calibrate(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    work = ctx["work"] / "calibrate"
    cal = measure(
        work,
        sizes=S["calibrate_sizes"],
        repeats=S["calibrate_repeats"],
        bank_bytes=S["calibrate_bank_bytes"],
        progress=log,
    )
    print(format_calibration(cal), flush=True)
    prof_path = ctx["out"].with_name(ctx["out"].stem + "-profile.yaml")
    prof = write_profile(cal, prof_path)
    ctx["profile"] = prof
    v = validate(
        prof,
        work,
        anchor=S["anchor"],
        multipliers=S["validate_multipliers"],
        branching=S["validate_branching"],
        n_fetches=S["validate_fetches"],
    )
    print(format_validation(v), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    data = (
        f"validate bank: {v.anchor} FFN ({','.join(map(str, v.multipliers))}), branching "
        f"{v.branching}, bf16; "
        f"placement {v.placement}; {v.n_fetches} random cold paths"
    )
    rows = []
    for f in cal.fits:
        cdata = (
            f"calibration banks, {len(f.timings)} sizes x {S['calibrate_repeats']} fetches; "
            f"{f.method}"
        )
        rows += [
            row(
                "calibrate",
                f"fitted {f.name} latency",
                f.latency_s * 1e6,
                target="(info)",
                unit="us",
                data=cdata,
            ),
            row(
                "calibrate",
                f"fitted {f.name} bandwidth",
                f.bandwidth_bps / 1e9,
                target="(info)",
                unit="GB/s",
                data=cdata,
            ),
            row(
                "calibrate",
                f"  {f.name}: max |fit - median| / median over the sizes",
                f.max_rel_error,
                target="(info)",
                data=cdata,
            ),
        ]
    rows.append(
        row(
            "calibrate",
            "path fetch: simulate_fetch vs measured store.fetch mean",
            v.simulated_s * 1e3,
            baseline=v.measured_mean_s * 1e3,
            ratio=v.ratio,
            target="0.8-1.2x",
            rule=("between", 0.8, 1.2),
            unit="ms",
            data=data,
        )
    )
    rows.append(
        row(
            "calibrate",
            "  same vs measured sum of per-level fetch_flat means",
            v.simulated_s * 1e3,
            baseline=v.measured_flat_mean_s * 1e3,
            ratio=v.ratio_flat,
            target="(info)",
            unit="ms",
            data=data,
        )
    )
    for r in v.levels:
        rows.append(
            row(
                "calibrate",
                f"  level {r['level']} on {r['tier']} ({r['block_bytes']:,} B): simulated vs "
                "fetch_flat mean",
                r["simulated_s"] * 1e3,
                baseline=r["measured_mean_s"] * 1e3,
                ratio=r["ratio"],
                target="(info)",
                unit="ms",
                data=data,
            )
        )
    rows.append(
        row(
            "calibrate",
            "  unflatten (fetch's per-tensor views, not simulated), sum over levels: "
            + " + ".join(f"{r['n_tensors']}" for r in v.levels)
            + " tensors",
            v.unflatten_mean_s * 1e3,
            target="(info)",
            unit="ms",
            data=data,
        )
    )
    res = {"calibration": cal.to_dict(), "profile_path": str(prof_path), "validation": v.to_dict()}
    return res, rows


# ---------------------------------------------------------------------------- 4. session
def bench_session(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    mult, B = S["session_multipliers"], S["session_branching"]
    budget = S["session_cache_bytes"]
    root = ctx["work"] / "session-bank"
    write_bank_for(root, S["anchor"], mult, B, seed=4)
    p = plan(S["anchor"], tuple(mult), branching=B)
    trace = zipf_trace(S["session_queries"], B, len(mult), seed=0)
    per_query: dict[str, list[float]] = {"fetch": [], "fetch_flat": []}
    # Two stores over the same bank, each with its own caches, replay the trace in lockstep (the
    # order
    # alternating per query, so outside load hits both alike): one as a model attaches blocks
    # (fetch(path): tensors per layer), one with flat=True (no unflatten). Same trace, same hits.
    stores = {mode: flash_store(root, cache_bytes=budget) for mode in per_query}
    try:
        for i, path in enumerate(trace):
            ids = [int(c) for c in path]
            for mode in ("fetch", "fetch_flat") if i % 2 == 0 else ("fetch_flat", "fetch"):
                t0 = time.perf_counter()
                stores[mode].fetch(ids, flat=mode == "fetch_flat")
                per_query[mode].append(time.perf_counter() - t0)
        caches = {
            mode: {int(k): v for k, v in st.stats()["levels"].items()}
            for mode, st in stores.items()
        }
        direct = all(_direct_of(st) for st in stores.values())
    finally:
        for st in stores.values():
            st.close()
        shutil.rmtree(root, ignore_errors=True)
    # Hit rates do not depend on the profile; latencies are only predicted with the calibrated one.
    calibrated = ctx.get("profile")
    prof = calibrated or HardwareProfile(
        name="placeholder", tiers=(TierProfile(name="flash", bandwidth_gbps=1.0, latency_us=100.0),)
    )
    levels = [lv.level for lv in p.levels if lv.multiplier]
    # what simulate-fetch predicts: one cache of `budget` shared by all levels — the store's layout
    # too
    # (one LRU per tier, shared by the levels on it; here every level is on flash)
    shared = simulate_session(p, prof, trace, "bf16", budget, policy={lv: "flash" for lv in levels})
    shared_hits = dict(zip(levels, shared.hier_level_hit.mean(axis=0).tolist(), strict=True))
    shared_copy = simulate_session(
        p, prof, trace, "bf16", budget, policy={lv: "flash" for lv in levels}, count_cache_copy=True
    )
    store_hits = {lv: caches["fetch"][lv]["hit_rate"] for lv in levels}
    same_flat = store_hits == {lv: caches["fetch_flat"][lv]["hit_rate"] for lv in levels}
    data = (
        f"{S['anchor']} FFN ({','.join(map(str, mult))}), branching {B}, bf16, all levels on "
        "flash (O_DIRECT), "
        f"cache {budget / MiB:.0f} MiB; zipf_trace({len(trace)} queries, seed 0)"
    )
    rows = []
    for lv in levels:
        rows.append(
            row(
                "session",
                f"level {lv} hit rate: store (per-tier cache) vs simulate_session",
                store_hits[lv],
                baseline=shared_hits[lv],
                ratio=store_hits[lv] / shared_hits[lv] if shared_hits[lv] else None,
                target="equal",
                rule=("eq",),
                data=data,
            )
        )
    measured = float(np.mean(per_query["fetch"]))
    measured_flat = float(np.mean(per_query["fetch_flat"]))
    sim_pl = float(shared.hier_seconds.mean())
    if calibrated is None:
        rows.append(
            row(
                "session",
                "mean per query, measured fetch(path) / fetch(path, flat=True) (no calibrated "
                "profile in this run: no prediction)",
                measured * 1e3,
                baseline=measured_flat * 1e3,
                target="(info)",
                unit="ms",
                data=data,
            )
        )
    else:
        rows += session_latency_rows(
            sim_pl, float(shared_copy.hier_seconds.mean()), measured, measured_flat, data
        )
    res = {
        "data": data,
        "direct": direct,
        "profile": prof.name if calibrated else None,
        "store_hit_rate": store_hits,
        "sim_shared_hit_rate": shared_hits,
        "store_levels": caches,
        "hit_rates_same_with_flat_true": same_flat,
        "measured_mean_s": measured,
        "measured_flat_mean_s": measured_flat,
        "sim_mean_s": sim_pl if calibrated else None,
        "sim_copy_mean_s": float(shared_copy.hier_seconds.mean()) if calibrated else None,
        "per_query_s": per_query,
    }
    return res, rows


def session_latency_rows(
    sim_pl: float, sim_copy: float, measured: float, measured_flat: float, data: str
) -> list[dict]:
    rows = []
    rows.append(
        row(
            "session",
            "mean per query: simulate_session on the calibrated profile vs measured fetch(path)",
            sim_pl * 1e3,
            baseline=measured * 1e3,
            ratio=sim_pl / measured,
            target="(info)",
            unit="ms",
            data=data,
        )
    )
    rows.append(
        row(
            "session",
            "  same vs measured fetch(path, flat=True)",
            sim_pl * 1e3,
            baseline=measured_flat * 1e3,
            ratio=sim_pl / measured_flat,
            target="(info)",
            unit="ms",
            data=data,
        )
    )
    rows.append(
        row(
            "session",
            "  hits charged a copy (count_cache_copy) vs measured flat=True",
            sim_copy * 1e3,
            baseline=measured_flat * 1e3,
            ratio=sim_copy / measured_flat,
            target="(info)",
            unit="ms",
            data=data,
        )
    )
    return rows


# ------------------------------------------------------------------------------------- main
def machine(work: Path) -> dict:
    import psutil

    dev = os.stat(work).st_dev
    fs = next(
        (
            p
            for p in psutil.disk_partitions(all=True)
            if os.path.exists(p.mountpoint) and os.stat(p.mountpoint).st_dev == dev
        ),
        None,
    )
    return machine_basics(
        workdir=str(work),
        disk_free_gb=round(shutil.disk_usage(work).free / 1e9, 1),
        filesystem=None
        if fs is None
        else {"device": fs.device, "mountpoint": fs.mountpoint, "fstype": fs.fstype},
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small, fast variant")
    ap.add_argument(
        "--only", choices=BENCHES, action="append", help="run only this benchmark (repeatable)"
    )
    date = _dt.date.today().isoformat()
    ap.add_argument(
        "--out", default=None, help="JSON (default bench/memstore/results/memstore-DATE.json)"
    )
    ap.add_argument(
        "--workdir",
        default=os.path.join(tempfile.gettempdir(), "memtree-bench-memstore"),
        help="scratch directory for the banks (on the flash device to measure); removed afterwards",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each benchmark, wait up to SECONDS for the 1-minute load average to drop "
        "below "
        "the core count (other work on the machine skews timings)",
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=3,
        help="repeat the whole suite this many times; the final table gives medians (default 3)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one size from sizes() (JSON value); recorded in the JSON",
    )
    args = ap.parse_args(argv)
    S = sizes(args.quick)
    for kv in args.set:
        key, _, val = kv.partition("=")
        if key not in S:
            ap.error(f"--set {kv}: unknown size {key!r}; sizes: {sorted(S)}")
        S[key] = json.loads(val) if val[:1] in "[{0123456789" else val
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out = results_path(args.out, f"memstore-{date}.json", results_dir(__file__))
    ctx: dict[str, Any] = {"work": work, "out": out}
    selected = args.only or list(BENCHES)
    results: dict[str, Any] = {
        "meta": {
            "command": command_line(),
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "quick": args.quick,
            "runs": args.runs,
            "machine": machine(work),
            "sizes": S,
            "loadavg_start": loadavg(),
            "pressure_start": pressure(("cpu", "io")),
        },
        "runs": [],
        "rows": [],
    }
    fns = {
        "throughput": bench_throughput,
        "flat": bench_flat,
        "calibrate": bench_calibrate,
        "session": bench_session,
    }
    try:
        for k in range(args.runs):
            run: dict[str, Any] = {"benchmarks": {}, "rows": []}
            results["runs"].append(run)
            ctx.pop("profile", None)
            for name in [b for b in BENCHES if b in selected]:
                waited = wait_quiet(args.wait_quiet)
                t0 = time.perf_counter()
                before = {
                    "loadavg": loadavg(),
                    "pressure": pressure(("cpu", "io")),
                    "waited_for_quiet_s": waited,
                }
                log(
                    f"=== run {k + 1}/{args.runs}: {name} (load average {before['loadavg']}, "
                    f"pressure avg10 {before['pressure']})"
                )
                res, rows = fns[name](S, ctx)
                res["load_before"] = before
                res["load_after"] = {"loadavg": loadavg(), "pressure": pressure(("cpu", "io"))}
                res["bench_seconds"] = round(time.perf_counter() - t0, 1)
                run["benchmarks"][name] = res
                run["rows"] += rows
                write_results(results, out)  # partial results survive
                log(f"=== {name} done in {res['bench_seconds']}s (load average {loadavg()})")
            print()
            print_table(run["rows"])
            print()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["rows"] = median_rows([r["rows"] for r in results["runs"]])
    results["meta"]["finished"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    results["meta"]["loadavg_end"] = loadavg()
    write_results(results, out)
    if args.runs > 1:
        print(
            f"medians over {args.runs} runs (ratio range in brackets); each row's median value, "
            "baseline and "
            "ratio are taken separately"
        )
        print_table(results["rows"])
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
