"""Calibrate a hardware profile on this machine through the real store, and check the simulator
against it.

`memtree memstore simulate-fetch` predicts fetch latency from a hardware profile
(`memstore.sim.latency`): one block read on a tier costs
``latency + bytes / bandwidth``. The shipped profiles (phone, laptop) are
datasheet figures. `calibrate` measures those two numbers per tier *on this
machine, through the code users run*, and writes a profile in the same format;
`validate` then fetches real paths from a realistic multi-level bank and
compares the measured latency with `simulate_fetch` on the calibrated profile.

How the tiers are measured
- One single-level calibration bank per target size (`memstore.writer.write_bank`,
  bf16, random values): a 1-layer anchor with `kv` memory, head_dim 256 and
  w = size / 1024 learned keys and values, so one block's record is exactly the
  target size (a multiple of 4096, so record = stride and an O_DIRECT read moves
  exactly that many bytes). Each bank holds max(4, bank_bytes / size) blocks.
- Every bank is opened with `memstore.store.MemoryStore`, its level placed on the
  tier under test, `cache_bytes=0`, and timed with `store.fetch_flat` of random
  blocks: what a user's fetch costs, including the store's own work.
  * ram: the level file is loaded at open; a fetch copies the record out.
  * flash: `os.preadv` with O_DIRECT (the page cache is bypassed). Where the
    filesystem refuses O_DIRECT (tmpfs) or with `direct=False`, reads are
    buffered and `posix_fadvise(POSIX_FADV_DONTNEED)` drops the file's cached
    pages before each read; the method used is recorded per tier.
  * disk (with `disk_dir`): the level file is moved there with
    `memstore.merge.relocate_level` and read through the store's disk backend,
    with DONTNEED before each read (local paths; an fsspec URL is read as is).
- `verify="always"` by default, as `MemoryStore` defaults to: the xxh3 check of
  every block read is part of the fetch users run, so the profile includes it.
  Pass `verify="never"` to measure raw reads (then validate the same way).
- Fetches of all (tier, size) pairs are interleaved in a shuffled order, so a
  burst of outside load hits every size alike; the first `warmup` fetches of
  each pair are discarded. Per size the *median* is kept, and
  ``seconds = latency + bytes / bandwidth`` is fitted to the medians by least
  squares on relative residuals (each size counts alike, from 4 KiB to 32 MiB);
  a negative intercept is clamped to zero latency.

Capacities and `cache_gb` are not measured: by default RAM gets a quarter of the
physical memory, the slowest measured tier is unbounded (as disk is in the shipped
profiles, so `memstore simulate-fetch`'s flat baseline always has a home), and a flash
tier above a measured disk gets the free space of its filesystem at calibration;
each tier's `source` says so (`capacity_gb=` overrides).

This module holds `measure` and the profile it writes; the fit, the calibration banks and the
cold reads are `memstore.sim.timing`'s, `validate` is `memstore.sim.validate`'s, and both are
re-exported here for the callers that import them from this module.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shutil
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memtree.config import to_dict
from memtree.geometry import (
    MemoryConfig,
    block_layout,
    get_anchor,
    human_bytes,
)
from memtree.io import atomic_write_text
from memtree.memstore.format import RecordCodec, is_url, level_path, read_manifest
from memtree.memstore.locking import remove_bank
from memtree.memstore.merge import relocate_level
from memtree.memstore.sim.profiles import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    HardwareProfile,
    TierProfile,
    load_profile,
)
from memtree.memstore.sim.timing import (  # noqa: F401  (re-exported: callers import them from here)
    DEFAULT_SIZES,
    Cold,
    KiB,
    MiB,
    SizeTiming,
    TierFit,
    calibration_anchor,
    drop_cache,
    fit_latency_bandwidth,
    fit_tier,
    random_init,
    store_tiers,
    tier_kind,
    write_calibration_bank,
)
from memtree.memstore.sim.validate import Validation, format_validation, validate
from memtree.memstore.store import MemoryStore

# --------------------------------------------------------------------------- calibrate


@dataclass(frozen=True)
class Calibration:
    """Everything `calibrate` measured, and the profile fitted from it."""

    profile: HardwareProfile
    fits: tuple[TierFit, ...]
    host: str
    date: str
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "date": self.date,
            "settings": self.settings,
            "profile": to_dict(self.profile),
            "fits": [f.to_dict() for f in self.fits],
        }


def _default_capacity_gb(name: str, where: Path, last: bool) -> tuple[float | None, str]:
    """Assumed capacity of a measured tier (None = unbounded) and the note saying so."""
    if name == "ram" and not last:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return round(
            phys / 4 / 1e9, 2
        ), f"capacity: assumed 1/4 of this machine's {phys / 1e9:.1f} GB RAM"
    if last:  # as in the shipped profiles, the slowest tier takes whatever does not fit above it
        return None, "capacity: unbounded (the slowest measured tier takes whatever does not fit)"
    free = shutil.disk_usage(where).free
    return round(
        free / 1e9, 1
    ), f"capacity: free space on its filesystem at calibration ({free / 1e9:.1f} GB)"


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def measure_tensor_us(repeats: int = 200) -> float:
    """Microseconds per tensor to split a flat block into its per-layer views (what `fetch(path)`
    does for every level, hits included), on an openlm-160m FFN block of 105 tensors."""
    layout = tuple(block_layout(get_anchor("openlm-160m"), MemoryConfig(multipliers=(4,)), 1))
    codec = RecordCodec(layout, "bf16")
    flat = torch.zeros(codec.params, dtype=torch.bfloat16)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        codec.unflatten(flat)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / len(layout) * 1e6


def _measure_plan(
    tiers: Sequence[str], sizes: Sequence[int], disk_dir, repeats: int
) -> tuple[list[str], list[int]]:
    """The tiers (fastest first, disk added with disk_dir) and sorted sizes `measure` times;
    ValueError for what cannot be measured or fitted."""
    tiers = list(dict.fromkeys(tiers))
    if disk_dir is not None and "disk" not in tiers:
        tiers.append("disk")
    tiers.sort(
        key=lambda t: ("ram", "flash", "disk").index(tier_kind(t))
    )  # a profile lists tiers fastest first
    if "disk" in tiers and disk_dir is None:
        raise ValueError("the disk tier needs disk_dir (where to put the level file it reads)")
    if not tiers:
        raise ValueError("calibrate: no tiers to measure")
    sizes = sorted({int(s) for s in sizes})
    if len(sizes) < 2:
        raise ValueError(
            f"calibrate: need two or more sizes to fit latency and bandwidth, got {sizes}"
        )
    for s in sizes:
        calibration_anchor(s)
    if repeats < 1:
        raise ValueError(f"calibrate: repeats must be >= 1, got {repeats}")
    return tiers, sizes


def _time_cold_fetches(
    stores: Mapping[tuple[str, int], tuple[MemoryStore, Cold, int]],
    rng: np.random.Generator,
    warmup: int,
    repeats: int,
) -> dict[tuple[str, int], list[float]]:
    """Seconds of `repeats` uncached fetches of a random block per (tier, size), the pairs
    interleaved in a fresh random order every round, after `warmup` untimed rounds."""
    samples: dict[tuple[str, int], list[float]] = {k: [] for k in stores}
    keys = list(stores)
    for rep in range(warmup + repeats):
        for i in rng.permutation(len(keys)):
            store, cold, n = stores[keys[i]]
            cluster = int(rng.integers(n))
            cold()
            t0 = time.perf_counter()
            store.fetch_flat(1, cluster)
            dt = time.perf_counter() - t0
            if rep >= warmup:
                samples[keys[i]].append(dt)
    return samples


def _tier_profiles(
    fits: Sequence[TierFit],
    source: str,
    capacity_gb: Mapping[str, float | None] | None,
    workdir: Path,
    disk_dir,
) -> list[TierProfile]:
    """Each fitted tier as a profile tier; capacity as given, else from the filesystem it was
    measured on. source: the provenance text, with {method}, {error} and {capacity} to fill."""
    out = []
    for f in fits:
        if capacity_gb is not None and f.name in capacity_gb:
            cap, cap_note = capacity_gb[f.name], "capacity: given"
        else:
            where = Path(disk_dir) if f.name == "disk" and not is_url(str(disk_dir)) else workdir
            cap, cap_note = _default_capacity_gb(f.name, where, last=f is fits[-1])
        out.append(
            TierProfile(
                name=f.name,
                bandwidth_gbps=_sig(f.bandwidth_bps / 1e9),
                latency_us=_sig(f.latency_s * 1e6),
                capacity_gb=cap,
                source=source.format(method=f.method, error=f.max_rel_error, capacity=cap_note),
            )
        )
    return out


def measure(
    workdir: str | os.PathLike,
    *,
    tiers: Sequence[str] = ("ram", "flash"),
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 30,
    warmup: int = 2,
    direct: bool = True,
    disk_dir: str | os.PathLike | None = None,
    bank_bytes: int = 64 * MiB,
    verify: str = "always",
    seed: int = 0,
    keep: bool = False,
    name: str = "this-machine",
    capacity_gb: Mapping[str, float | None] | None = None,
    cache_gb: float = 0.5,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Measure the tiers and fit a profile; see the module docstring. `progress(msg)` gets log
    lines."""
    say = progress or (lambda _msg: None)
    tiers, sizes = _measure_plan(tiers, sizes, disk_dir, repeats)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    stores: dict[tuple[str, int], tuple[MemoryStore, Cold, int]] = {}
    banks: list[Path] = []
    t_start = time.perf_counter()
    try:
        for s in sizes:
            root = workdir / f"calibrate-{s}"
            n_blocks = max(4, math.ceil(bank_bytes / s))
            say(f"writing calibration bank {root.name}: {n_blocks} blocks of {human_bytes(s)}")
            banks.append(root)
            write_calibration_bank(root, s, n_blocks, seed=seed + s)
            if "disk" in tiers:  # a second copy whose level file lives on the disk
                droot = workdir / f"calibrate-{s}-disk"
                banks.append(droot)
                shutil.copytree(root, droot, dirs_exist_ok=False)
                relocate_level(
                    droot,
                    1,
                    str(Path(disk_dir) / f"calibrate-{s}")
                    if not is_url(str(disk_dir))
                    else str(disk_dir).rstrip("/") + f"/calibrate-{s}",
                )
                drop_cache(level_path(droot, read_manifest(droot).level(1)))
            for t in tiers:
                bank = droot if t == "disk" else root
                store = MemoryStore(
                    bank, tiers=store_tiers([t], direct), placement={1: t}, verify=verify
                )
                stores[(t, s)] = (store, Cold(store, direct), store.info.level(1).n_blocks)
        say(
            f"timing {len(stores)} (tier, size) pairs × "
            f"{warmup}+{repeats} random fetches, interleaved"
        )
        samples = _time_cold_fetches(stores, rng, warmup, repeats)
        methods = {t: stores[(t, sizes[0])][1].methods[1] for t in tiers}
    finally:
        for store, _, _ in stores.values():
            store.close()
        if not keep:
            for b in banks:
                remove_bank(b)
    fits = tuple(fit_tier(t, {s: samples[(t, s)] for s in sizes}, method=methods[t]) for t in tiers)
    host = socket.gethostname()
    date = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    source = (
        f"measured by memtree memstore calibrate on {host} {date}: MemoryStore.fetch_flat of "
        f"random uncached blocks ({{method}}; verify={verify}; cache 0), {len(sizes)} sizes "
        f"{human_bytes(sizes[0])}-{human_bytes(sizes[-1])} x {repeats} fetches, medians fitted by "
        "relative least squares (max fit error {error:.0%}). {capacity}."
    )
    tier_profiles = _tier_profiles(fits, source, capacity_gb, workdir, disk_dir)
    profile = HardwareProfile(
        name=name,
        description=f"{host}: measured by memtree memstore calibrate, {date}",
        tiers=tuple(tier_profiles),
        cache_gb=cache_gb,
        tensor_us=_sig(measure_tensor_us()),
    )
    settings = {
        "tiers": tiers,
        "sizes": sizes,
        "repeats": repeats,
        "warmup": warmup,
        "direct": direct,
        "disk_dir": None if disk_dir is None else str(disk_dir),
        "bank_bytes": bank_bytes,
        "verify": verify,
        "seed": seed,
        "workdir": str(workdir),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    return Calibration(profile=profile, fits=fits, host=host, date=date, settings=settings)


def _yaml_num(x: float | None) -> str:
    if x is None:
        return "null"
    s = np.format_float_positional(float(x), precision=6, unique=True, trim="0")
    return s + "0" if s.endswith(".") else s


def profile_yaml(cal: Calibration) -> str:
    """The profile as YAML in the shipped profiles' layout, the measured medians as comments."""
    p = cal.profile
    lines = [
        (
            "# Hardware profile for `memtree memstore simulate-fetch` "
            "(memstore/sim/latency.py), MEASURED on this machine"
        ),
        (
            "# by `memtree memstore calibrate` (memstore/sim/calibrate.py). "
            "Units are decimal: GB/s, microseconds,"
        ),
        "# GB. Per tier: median seconds of MemoryStore.fetch_flat per block size, and the fit",
        (
            "# seconds = latency + bytes / bandwidth (capacities "
            "and cache_gb are assumptions, not measured)."
        ),
        f"# settings: {json.dumps(cal.settings, sort_keys=True)}",
    ]
    for f in cal.fits:
        lines.append(f"#   {f.name} ({f.method}):")
        lines.append(
            f"#     {'bytes':>10} {'median us':>11} {'p10 us':>10} "
            f"{'p90 us':>10} {'fit us':>10} {'err':>6}"
        )
        for t in f.timings:
            fit = f.predict(t.nbytes)
            lines.append(
                f"#     {t.nbytes:>10} {t.median_s * 1e6:>11.1f} {t.p10_s * 1e6:>10.1f} "
                f"{t.p90_s * 1e6:>10.1f} {fit * 1e6:>10.1f} "
                f"{(fit - t.median_s) / t.median_s:>+6.0%}"
            )
    lines += [
        f"format: {PROFILE_FORMAT}",
        f"version: {PROFILE_VERSION}",
        f"name: {json.dumps(p.name)}",
        f"description: {json.dumps(p.description)}",
        "tiers:  # fastest first",
    ]
    for t in p.tiers:
        lines += [
            f"  - name: {json.dumps(t.name)}",
            f"    bandwidth_gbps: {_yaml_num(t.bandwidth_gbps)}",
            f"    latency_us: {_yaml_num(t.latency_us)}",
            f"    capacity_gb: {_yaml_num(t.capacity_gb)}",
            f"    source: {json.dumps(t.source)}",
        ]
    lines.append(
        f"cache_gb: {_yaml_num(p.cache_gb)}  # RAM for "
        "the session cache of fetched blocks (assumed)"
    )
    lines.append(
        f"tensor_us: {_yaml_num(p.tensor_us)}  # CPU per "
        "layer tensor when a block is attached (measured)"
    )
    return "\n".join(lines) + "\n"


def write_profile(cal: Calibration, out: str | os.PathLike) -> HardwareProfile:
    """Write the profile YAML atomically and return it as `load_profile` reads it back."""
    out = Path(out)
    if out.suffix not in (".yaml", ".yml"):
        raise ValueError(
            f"profile path {out} must end in .yaml or .yml (load_profile reads it by suffix)"
        )
    atomic_write_text(out, profile_yaml(cal))
    return load_profile(out)


def calibrate(
    workdir: str | os.PathLike,
    *,
    tiers: Sequence[str] = ("ram", "flash"),
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 30,
    direct: bool = True,
    disk_dir: str | os.PathLike | None = None,
    seed: int = 0,
    out: str | os.PathLike | None = None,
    **kw: Any,
) -> HardwareProfile:
    """Measure this machine's tiers through the real store → HardwareProfile (written to `out` if
    given).

    Further keywords go to `measure` (warmup, bank_bytes, verify, keep, name, capacity_gb, cache_gb,
    progress). Use `measure` to get the per-size timings too.
    """
    cal = measure(
        workdir,
        tiers=tiers,
        sizes=sizes,
        repeats=repeats,
        direct=direct,
        disk_dir=disk_dir,
        seed=seed,
        **kw,
    )
    return write_profile(cal, out) if out is not None else cal.profile


# --------------------------------------------------------------------------- text


def format_calibration(cal: Calibration) -> str:
    """Per tier: the per-size timings, the fit and its largest error, as `memtree memstore
    calibrate` prints them."""
    lines = []
    for f in cal.fits:
        lines += [
            f"{f.name}: {f.method}",
            f"  {'size':>9} {'median':>11} {'p10':>11} {'p90':>11} {'fit':>11} {'err':>6}",
        ]
        for t in f.timings:
            fit = f.predict(t.nbytes)
            lines.append(
                f"  {human_bytes(t.nbytes):>9} {t.median_s * 1e6:>9.1f}us {t.p10_s * 1e6:>9.1f}us "
                f"{t.p90_s * 1e6:>9.1f}us {fit * 1e6:>9.1f}us "
                f"{(fit - t.median_s) / t.median_s:>+6.0%}"
            )
        lines.append(
            f"  fit: latency {f.latency_s * 1e6:.1f} us, bandwidth {f.bandwidth_bps / 1e9:.3f} "
            f"GB/s (max error {f.max_rel_error:.0%})"
        )
    return "\n".join(lines)


__all__ = [
    "DEFAULT_SIZES",
    "Calibration",
    "SizeTiming",
    "TierFit",
    "Validation",
    "calibrate",
    "calibration_anchor",
    "fit_latency_bandwidth",
    "fit_tier",
    "format_calibration",
    "format_validation",
    "measure",
    "profile_yaml",
    "tier_kind",
    "validate",
    "write_calibration_bank",
    "write_profile",
]
