"""Calibrate a hardware profile on this machine through the real store, and check the simulator against it.

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memtree.config import to_dict
from memtree.geometry import (
    AnchorShape,
    MemoryConfig,
    block_layout,
    get_anchor,
    human_bytes,
    stored_bytes,
)
from memtree.geometry import plan as make_plan
from memtree.io import atomic_write_text
from memtree.memstore.format import RecordCodec, is_url, level_path, read_manifest
from memtree.memstore.locking import remove_bank
from memtree.memstore.merge import relocate_level
from memtree.memstore.sim.latency import Policy, level_placement, memory_levels, simulate_fetch
from memtree.memstore.sim.profiles import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    HardwareProfile,
    TierProfile,
    load_profile,
)
from memtree.memstore.store import MemoryStore, TierConfig
from memtree.memstore.writer import write_bank

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES: tuple[int, ...] = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB)
_HEAD_DIM = 256  # calibration anchor: one kv block of w keys + w values of 256 bf16 = 1024·w bytes
_BYTES_PER_W = 2 * _HEAD_DIM * 2


def tier_kind(name: str) -> str:
    """Store backend for a profile tier name: "ram" and "disk" are themselves, anything else is flash."""
    return name if name in ("ram", "disk") else "flash"


# --------------------------------------------------------------------------- fitting


def fit_latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``seconds = latency + nbytes / bandwidth`` → (latency_s, bandwidth B/s).

    Residuals are relative (each point weighted by 1/seconds) so a 4 KiB read counts
    as much as a 32 MiB one. A negative intercept is clamped to 0 and the slope refitted.
    """
    x = np.asarray(nbytes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"fit: nbytes and seconds must be 1-D and equally long, got {x.shape} and {y.shape}")
    if np.unique(x).size < 2:
        raise ValueError(f"fit: need timings at two or more distinct sizes, got sizes {sorted(set(x.tolist()))}")
    if not (np.isfinite(y).all() and (y > 0).all() and (x > 0).all()):
        raise ValueError("fit: sizes and timings must be positive and finite")
    w = 1.0 / y
    A = np.stack([w, x * w], axis=1)
    (lat, slope), *_ = np.linalg.lstsq(A, np.ones_like(y), rcond=None)
    if lat < 0:
        lat = 0.0
        xw = x * w
        slope = float(xw.sum() / (xw * xw).sum())
    if not slope > 0:
        raise ValueError(
            f"fit: time does not grow with size (slope {slope:.3g} s/B): bandwidth is not resolvable; "
            "use a wider range of sizes or more repeats")
    return float(lat), float(1.0 / slope)


@dataclass(frozen=True)
class SizeTiming:
    """Fetch timings of one block size on one tier (seconds)."""

    nbytes: int
    n: int
    median_s: float
    p10_s: float
    p90_s: float
    min_s: float
    mean_s: float

    @classmethod
    def of(cls, nbytes: int, samples: Sequence[float]) -> SizeTiming:
        s = np.asarray(samples, dtype=np.float64)
        if s.size == 0:
            raise ValueError(f"no timings for size {nbytes}")
        return cls(nbytes=int(nbytes), n=int(s.size), median_s=float(np.median(s)),
                   p10_s=float(np.percentile(s, 10)), p90_s=float(np.percentile(s, 90)),
                   min_s=float(s.min()), mean_s=float(s.mean()))


@dataclass(frozen=True)
class TierFit:
    """A tier's per-size medians and the fitted latency/bandwidth."""

    name: str
    kind: str
    method: str
    timings: tuple[SizeTiming, ...]
    latency_s: float
    bandwidth_bps: float  # bytes per second

    def predict(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bps

    @property
    def max_rel_error(self) -> float:
        """Largest |fit − median| / median over the sizes."""
        return max(abs(self.predict(t.nbytes) - t.median_s) / t.median_s for t in self.timings)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "method": self.method, "latency_s": self.latency_s,
                "bandwidth_bps": self.bandwidth_bps, "max_rel_error": self.max_rel_error,
                "timings": [asdict(t) | {"fit_s": self.predict(t.nbytes)} for t in self.timings]}


def fit_tier(name: str, samples: Mapping[int, Sequence[float]], *, kind: str | None = None,
             method: str = "") -> TierFit:
    """Medians per size of raw fetch timings {nbytes: [seconds, …]} → fitted TierFit."""
    timings = tuple(SizeTiming.of(n, s) for n, s in sorted(samples.items()))
    lat, bw = fit_latency_bandwidth([t.nbytes for t in timings], [t.median_s for t in timings])
    return TierFit(name=name, kind=kind or tier_kind(name), method=method, timings=timings, latency_s=lat,
                   bandwidth_bps=bw)


# --------------------------------------------------------------------------- banks


def random_init(seed: int):
    g = torch.Generator().manual_seed(seed)

    def init(level: int, cluster: int, codec) -> torch.Tensor:
        # random values so no layer below us (filesystem, virtual disk) can shortcut zeros
        return torch.rand(codec.params, generator=g) - 0.5

    return init


def calibration_anchor(nbytes: int) -> tuple[AnchorShape, int]:
    """(anchor, multiplier w) whose single kv block is exactly nbytes in bf16."""
    if nbytes <= 0 or nbytes % 4096:
        raise ValueError(f"calibration size {nbytes} must be a positive multiple of 4096 (the slot alignment)")
    anchor = AnchorShape(name=f"calibrate-{nbytes}", n_layers=1, d_model=_HEAD_DIM, n_heads=1, head_dim=_HEAD_DIM,
                         ffn_dim=1, vocab_size=1, qk_norm="none")
    return anchor, nbytes // _BYTES_PER_W


def write_calibration_bank(root: str | os.PathLike, nbytes: int, n_blocks: int, *, seed: int = 0):
    """A one-level bf16 bank of n_blocks blocks of exactly nbytes each (no generic slot)."""
    anchor, w = calibration_anchor(nbytes)
    mem = MemoryConfig(multipliers=(w,), type="kv", branching=max(2, int(n_blocks)))
    info = write_bank(root, anchor=anchor, memory=mem, dtype="bf16", generic=False, init=random_init(seed),
                      extra={"purpose": "memtree memstore calibrate"})
    assert info.level(1).record_bytes == nbytes == info.level(1).stride
    drop_cache(level_path(info.root, info.level(1)))
    return info


def drop_cache(path: str) -> None:
    """Ask the kernel to forget a file's cached pages (they are clean after write_bank's fsync)."""
    if is_url(path) or not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- store plumbing


class _Cold:
    """Per level of an open store: what keeps its reads cold, and the name of that method."""

    def __init__(self, store: MemoryStore, direct: bool) -> None:
        self.fds: list[int] = []
        self.methods: dict[int, str] = {}
        for level, L in store.levels.items():
            kind = store.tiers[L.tier].kind
            if kind == "ram":
                self.methods[level] = "ram: level file loaded at open, record copied per fetch"
                continue
            fd = getattr(L.reader, "fd", None)
            if fd is None and hasattr(L.reader, "f"):
                try:
                    fd = L.reader.f.fileno()
                except (AttributeError, OSError, ValueError):
                    fd = None  # an fsspec file of a remote store
            if kind == "flash" and getattr(L.reader, "direct", False):
                self.methods[level] = "O_DIRECT pread (page cache bypassed)"
            elif fd is not None and hasattr(os, "posix_fadvise"):
                why = ("O_DIRECT refused by the filesystem; " if kind == "flash" and direct else "")
                self.methods[level] = f"{why}buffered read, posix_fadvise(DONTNEED) before each read"
                self.fds.append(fd)
            else:
                self.methods[level] = "fsspec read (no control over caches below it)"

    def __call__(self) -> None:
        for fd in self.fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _store_tiers(names: Sequence[str], direct: bool) -> tuple[TierConfig, ...]:
    return tuple(TierConfig(name=n, kind=tier_kind(n), cache_bytes=0, direct=direct and tier_kind(n) == "flash")
                 for n in names)


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
        return {"host": self.host, "date": self.date, "settings": self.settings, "profile": to_dict(self.profile),
                "fits": [f.to_dict() for f in self.fits]}


def _default_capacity_gb(name: str, where: Path, last: bool) -> tuple[float | None, str]:
    """Assumed capacity of a measured tier (None = unbounded) and the note saying so."""
    if name == "ram" and not last:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return round(phys / 4 / 1e9, 2), f"capacity: assumed 1/4 of this machine's {phys / 1e9:.1f} GB RAM"
    if last:  # as in the shipped profiles, the slowest tier takes whatever does not fit above it
        return None, "capacity: unbounded (the slowest measured tier takes whatever does not fit)"
    free = shutil.disk_usage(where).free
    return round(free / 1e9, 1), f"capacity: free space on its filesystem at calibration ({free / 1e9:.1f} GB)"


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def measure_tensor_us(repeats: int = 200) -> float:
    """Microseconds per tensor to split a flat block into its per-layer views (what `fetch(path)` does
    for every level, hits included), on an openlm-160m FFN block of 105 tensors."""
    layout = tuple(block_layout(get_anchor("openlm-160m"), MemoryConfig(multipliers=(4,)), 1))
    codec = RecordCodec(layout, "bf16")
    flat = torch.zeros(codec.params, dtype=torch.bfloat16)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        codec.unflatten(flat)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / len(layout) * 1e6


def _measure_plan(tiers: Sequence[str], sizes: Sequence[int], disk_dir, repeats: int) -> tuple[list[str], list[int]]:
    """The tiers (fastest first, disk added with disk_dir) and sorted sizes `measure` times;
    ValueError for what cannot be measured or fitted."""
    tiers = list(dict.fromkeys(tiers))
    if disk_dir is not None and "disk" not in tiers:
        tiers.append("disk")
    tiers.sort(key=lambda t: ("ram", "flash", "disk").index(tier_kind(t)))  # a profile lists tiers fastest first
    if "disk" in tiers and disk_dir is None:
        raise ValueError("the disk tier needs disk_dir (where to put the level file it reads)")
    if not tiers:
        raise ValueError("calibrate: no tiers to measure")
    sizes = sorted({int(s) for s in sizes})
    if len(sizes) < 2:
        raise ValueError(f"calibrate: need two or more sizes to fit latency and bandwidth, got {sizes}")
    for s in sizes:
        calibration_anchor(s)
    if repeats < 1:
        raise ValueError(f"calibrate: repeats must be >= 1, got {repeats}")
    return tiers, sizes


def _time_cold_fetches(stores: Mapping[tuple[str, int], tuple[MemoryStore, _Cold, int]], rng: np.random.Generator,
                       warmup: int, repeats: int) -> dict[tuple[str, int], list[float]]:
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


def _tier_profiles(fits: Sequence[TierFit], source: str, capacity_gb: Mapping[str, float | None] | None,
                   workdir: Path, disk_dir) -> list[TierProfile]:
    """Each fitted tier as a profile tier; capacity as given, else from the filesystem it was
    measured on. source: the provenance text, with {method}, {error} and {capacity} to fill."""
    out = []
    for f in fits:
        if capacity_gb is not None and f.name in capacity_gb:
            cap, cap_note = capacity_gb[f.name], "capacity: given"
        else:
            where = Path(disk_dir) if f.name == "disk" and not is_url(str(disk_dir)) else workdir
            cap, cap_note = _default_capacity_gb(f.name, where, last=f is fits[-1])
        out.append(TierProfile(name=f.name, bandwidth_gbps=_sig(f.bandwidth_bps / 1e9),
                               latency_us=_sig(f.latency_s * 1e6), capacity_gb=cap,
                               source=source.format(method=f.method, error=f.max_rel_error, capacity=cap_note)))
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
    """Measure the tiers and fit a profile; see the module docstring. `progress(msg)` gets log lines."""
    say = progress or (lambda _msg: None)
    tiers, sizes = _measure_plan(tiers, sizes, disk_dir, repeats)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    stores: dict[tuple[str, int], tuple[MemoryStore, _Cold, int]] = {}
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
                relocate_level(droot, 1, str(Path(disk_dir) / f"calibrate-{s}") if not is_url(str(disk_dir))
                               else str(disk_dir).rstrip("/") + f"/calibrate-{s}")
                drop_cache(level_path(droot, read_manifest(droot).level(1)))
            for t in tiers:
                bank = droot if t == "disk" else root
                store = MemoryStore(bank, tiers=_store_tiers([t], direct), placement={1: t}, verify=verify)
                stores[(t, s)] = (store, _Cold(store, direct), store.info.level(1).n_blocks)
        say(f"timing {len(stores)} (tier, size) pairs × {warmup}+{repeats} random fetches, interleaved")
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
    source = (f"measured by memtree memstore calibrate on {host} {date}: MemoryStore.fetch_flat of random "
              f"uncached blocks ({{method}}; verify={verify}; cache 0), {len(sizes)} sizes "
              f"{human_bytes(sizes[0])}-{human_bytes(sizes[-1])} x {repeats} fetches, medians fitted by "
              f"relative least squares (max fit error {{error:.0%}}). {{capacity}}.")
    tier_profiles = _tier_profiles(fits, source, capacity_gb, workdir, disk_dir)
    profile = HardwareProfile(name=name, description=f"{host}: measured by memtree memstore calibrate, {date}",
                              tiers=tuple(tier_profiles), cache_gb=cache_gb, tensor_us=_sig(measure_tensor_us()))
    settings = {"tiers": tiers, "sizes": sizes, "repeats": repeats, "warmup": warmup, "direct": direct,
                "disk_dir": None if disk_dir is None else str(disk_dir), "bank_bytes": bank_bytes,
                "verify": verify, "seed": seed, "workdir": str(workdir),
                "seconds": round(time.perf_counter() - t_start, 1)}
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
        "# Hardware profile for `memtree memstore simulate-fetch` (memstore/sim/latency.py), MEASURED on this machine",
        "# by `memtree memstore calibrate` (memstore/sim/calibrate.py). Units are decimal: GB/s, microseconds,",
        "# GB. Per tier: median seconds of MemoryStore.fetch_flat per block size, and the fit",
        "# seconds = latency + bytes / bandwidth (capacities and cache_gb are assumptions, not measured).",
        f"# settings: {json.dumps(cal.settings, sort_keys=True)}",
    ]
    for f in cal.fits:
        lines.append(f"#   {f.name} ({f.method}):")
        lines.append(f"#     {'bytes':>10} {'median us':>11} {'p10 us':>10} {'p90 us':>10} {'fit us':>10} {'err':>6}")
        for t in f.timings:
            fit = f.predict(t.nbytes)
            lines.append(f"#     {t.nbytes:>10} {t.median_s * 1e6:>11.1f} {t.p10_s * 1e6:>10.1f} "
                         f"{t.p90_s * 1e6:>10.1f} {fit * 1e6:>10.1f} {(fit - t.median_s) / t.median_s:>+6.0%}")
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
    lines.append(f"cache_gb: {_yaml_num(p.cache_gb)}  # RAM for the session cache of fetched blocks (assumed)")
    lines.append(f"tensor_us: {_yaml_num(p.tensor_us)}  # CPU per layer tensor when a block is attached (measured)")
    return "\n".join(lines) + "\n"


def write_profile(cal: Calibration, out: str | os.PathLike) -> HardwareProfile:
    """Write the profile YAML atomically and return it as `load_profile` reads it back."""
    out = Path(out)
    if out.suffix not in (".yaml", ".yml"):
        raise ValueError(f"profile path {out} must end in .yaml or .yml (load_profile reads it by suffix)")
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
    """Measure this machine's tiers through the real store → HardwareProfile (written to `out` if given).

    Further keywords go to `measure` (warmup, bank_bytes, verify, keep, name, capacity_gb, cache_gb,
    progress). Use `measure` to get the per-size timings too.
    """
    cal = measure(workdir, tiers=tiers, sizes=sizes, repeats=repeats, direct=direct, disk_dir=disk_dir,
                  seed=seed, **kw)
    return write_profile(cal, out) if out is not None else cal.profile


# --------------------------------------------------------------------------- validate


@dataclass(frozen=True)
class Validation:
    """Measured vs simulated latency of cold path fetches on a multi-level bank."""

    profile: str
    anchor: str
    multipliers: tuple[int, ...]
    branching: int
    dtype: str
    verify: str
    placement: dict[int, str]
    methods: dict[int, str]
    n_fetches: int
    fetch_bytes: int
    simulated_s: float
    measured_mean_s: float  # store.fetch(path): unflattened tensors, as a model attaches them
    measured_median_s: float
    measured_flat_mean_s: float  # sum over levels of store.fetch_flat
    unflatten_mean_s: float  # sum over levels of codec.unflatten (views of the flat block per tensor)
    levels: tuple[dict[str, Any], ...]

    @property
    def ratio(self) -> float:
        """simulated / measured mean of store.fetch(path): 1.0 is a perfect prediction."""
        return self.simulated_s / self.measured_mean_s

    @property
    def ratio_flat(self) -> float:
        return self.simulated_s / self.measured_flat_mean_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["placement"] = {str(k): v for k, v in self.placement.items()}
        d["methods"] = {str(k): v for k, v in self.methods.items()}
        d["ratio"] = self.ratio
        d["ratio_flat"] = self.ratio_flat
        return d


def _fast_levels_profile(profile: HardwareProfile, level_bytes: Sequence[int], fast_levels: int) -> HardwareProfile:
    """The profile with its fastest tier's capacity cut to hold exactly the first fast_levels levels."""
    if len(profile.tiers) < 2:
        return profile
    cap = sum(level_bytes[:fast_levels])
    t0 = replace(profile.tiers[0], capacity_gb=(cap + 0.5) / 1e9)  # rounds back to cap or cap + 1 bytes
    return replace(profile, tiers=(t0, *profile.tiers[1:]))


def _time_path_fetches(store: MemoryStore, cold: _Cold, levels: Sequence[int], branching: int, n_levels: int,
                       rng: np.random.Generator, warmup: int, n_fetches: int
                       ) -> tuple[list[float], dict[int, list[float]], dict[int, list[float]]]:
    """Seconds of n_fetches cold `fetch(path)` calls of random root-to-leaf paths (after warmup
    untimed ones) and, on other random paths, of each level's `fetch_flat` (freeing included)
    and its `unflatten` apart: (whole, {level: fetch_flat}, {level: unflatten}). levels: the
    levels holding memory, of a tree n_levels deep."""
    B, L = branching, n_levels
    whole: list[float] = []
    per_level: dict[int, list[float]] = {lv: [] for lv in levels}
    unflat: dict[int, list[float]] = {lv: [] for lv in levels}
    for i in range(warmup + n_fetches):
        leaf = int(rng.integers(B**L))
        path = [leaf // B ** (L - k) for k in range(1, L + 1)]
        cold()
        t0 = time.perf_counter()
        store.fetch(path)
        dt = time.perf_counter() - t0
        if i >= warmup:
            whole.append(dt)
        leaf = int(rng.integers(B**L))
        for lv in levels:
            cold()
            t0 = time.perf_counter()
            flat = store.fetch_flat(lv, leaf // B ** (L - lv))
            t1 = time.perf_counter()
            store.codec(lv).unflatten(flat)  # what fetch(path) adds per level
            t2 = time.perf_counter()
            del flat  # freeing the block belongs to its fetch, as in `measure`
            t3 = time.perf_counter()
            if i >= warmup:
                per_level[lv].append((t1 - t0) + (t3 - t2))
                unflat[lv].append(t2 - t1)
    return whole, per_level, unflat


def validate(
    profile: HardwareProfile | str | os.PathLike,
    workdir: str | os.PathLike,
    *,
    anchor: AnchorShape | str = "openlm-160m",
    multipliers: Sequence[int] = (64, 16, 4),
    memory_type: str = "ffn",
    branching: int = 4,
    dtype: str = "bf16",
    n_fetches: int = 40,
    warmup: int = 3,
    placement: Policy | None = None,
    fast_levels: int | None = 1,
    direct: bool = True,
    verify: str = "always",
    disk_dir: str | os.PathLike | None = None,
    seed: int = 0,
    keep: bool = False,
) -> Validation:
    """Fetch random paths from a real multi-level bank and compare with `simulate_fetch`.

    Default bank: the openlm-160m anchor with FFN memory (64, 16, 4), branching 4, bf16:
    blocks of 6.9 / 1.7 / 0.43 MB, 27.5 MB per level. Placement: `placement` if given
    (a policy or {level: tier}); otherwise, with `fast_levels=k`, the profile's fastest tier
    is given room for exactly the first k levels and the rest placed hierarchically (so a
    RAM + flash profile puts level 1 in RAM and the deeper levels on flash, the §3 layout);
    `fast_levels=None` keeps the profile's capacities. Reads are cold: cache 0, O_DIRECT
    (or DONTNEED) as in `measure`. Each fetch is timed as users run it (`store.fetch(path)`),
    and separately level by level (`fetch_flat`, then `unflatten` timed on its own) on other
    random paths: `ratio` compares with the former, `ratio_flat` with the latter.
    """
    prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    p = make_plan(anchor, tuple(multipliers), type=memory_type, branching=branching)
    levels = memory_levels(p)
    bank_bytes = [lv.n_blocks * stored_bytes(lv.block_params, dtype) for lv in levels]
    if placement is None and fast_levels is not None:
        prof = _fast_levels_profile(prof, bank_bytes, fast_levels)
    mapping = level_placement(p, prof, dtype, "hierarchical" if placement is None else placement)
    try:
        sim = simulate_fetch(p, prof, dtype, mapping)
    except ValueError:  # only the flat baseline can fail to fit; it plays no part here
        sim = simulate_fetch(p, replace(prof, tiers=tuple(replace(t, capacity_gb=None) for t in prof.tiers)),
                             dtype, mapping)
    if any(tier_kind(t) == "disk" for t in mapping.values()) and disk_dir is None:
        raise ValueError(f"placement {mapping} puts a level on the disk tier; give disk_dir")
    workdir = Path(workdir)
    root = workdir / "validate-bank"
    rng = np.random.default_rng(seed)
    try:
        write_bank(root, anchor=p.anchor, memory=p.memory, dtype=dtype, init=random_init(seed),
                   extra={"purpose": "memtree memstore calibrate --validate"})
        for lv, t in mapping.items():
            if tier_kind(t) == "disk":
                relocate_level(root, lv, str(disk_dir))
        info = read_manifest(root)
        for lv in info.levels.values():
            drop_cache(level_path(root, lv))
        used = [t.name for t in prof.tiers if t.name in set(mapping.values())]
        with MemoryStore(root, tiers=_store_tiers(used, direct), placement=mapping, verify=verify) as store:
            cold = _Cold(store, direct)
            whole, per_level, unflat = _time_path_fetches(store, cold, [lv.level for lv in levels], branching,
                                                          p.memory.n_levels, rng, warmup, n_fetches)
            methods = dict(cold.methods)
            p_codecs = {lv.level: store.codec(lv.level) for lv in levels}
    finally:
        if not keep:
            remove_bank(root)
    rows = []
    for lf in sim.levels:
        m = np.asarray(per_level[lf.level])
        rows.append({"level": lf.level, "tier": lf.tier, "block_bytes": lf.block_bytes, "bank_bytes": lf.bank_bytes,
                     "simulated_s": lf.seconds, "measured_mean_s": float(m.mean()),
                     "measured_median_s": float(np.median(m)), "ratio": lf.seconds / float(m.mean()),
                     "n_tensors": len(p_codecs[lf.level].layout),
                     "unflatten_mean_s": float(np.mean(unflat[lf.level]))})
    w = np.asarray(whole)
    return Validation(
        profile=prof.name, anchor=p.anchor.name, multipliers=tuple(p.memory.multipliers), branching=branching,
        dtype=dtype, verify=verify, placement=dict(mapping), methods=methods, n_fetches=n_fetches,
        fetch_bytes=sim.fetch_bytes, simulated_s=sim.seconds, measured_mean_s=float(w.mean()),
        measured_median_s=float(np.median(w)),
        measured_flat_mean_s=float(sum(r["measured_mean_s"] for r in rows)),
        unflatten_mean_s=float(sum(r["unflatten_mean_s"] for r in rows)), levels=tuple(rows))


# --------------------------------------------------------------------------- text


def format_calibration(cal: Calibration) -> str:
    """Per tier: the per-size timings, the fit and its largest error, as `memtree memstore calibrate` prints them."""
    lines = []
    for f in cal.fits:
        lines += [f"{f.name}: {f.method}",
                  f"  {'size':>9} {'median':>11} {'p10':>11} {'p90':>11} {'fit':>11} {'err':>6}"]
        for t in f.timings:
            fit = f.predict(t.nbytes)
            lines.append(f"  {human_bytes(t.nbytes):>9} {t.median_s * 1e6:>9.1f}us {t.p10_s * 1e6:>9.1f}us "
                         f"{t.p90_s * 1e6:>9.1f}us {fit * 1e6:>9.1f}us {(fit - t.median_s) / t.median_s:>+6.0%}")
        lines.append(f"  fit: latency {f.latency_s * 1e6:.1f} us, bandwidth {f.bandwidth_bps / 1e9:.3f} GB/s "
                     f"(max error {f.max_rel_error:.0%})")
    return "\n".join(lines)


def format_validation(v: Validation) -> str:
    """Simulated vs measured latency per level and per path, as `calibrate --validate` prints them."""
    head = (f"validate: {v.anchor} memory ({','.join(map(str, v.multipliers))}) branching {v.branching} "
            f"{v.dtype}, {v.n_fetches} cold path fetches of {human_bytes(v.fetch_bytes)} (verify={v.verify})")
    lines = [head]
    for r in v.levels:
        lines.append(f"  L{r['level']} on {r['tier']:<6} {human_bytes(r['block_bytes']):>9}: simulated "
                     f"{r['simulated_s'] * 1e3:8.3f} ms, measured mean {r['measured_mean_s'] * 1e3:8.3f} ms "
                     f"(median {r['measured_median_s'] * 1e3:.3f}), ratio {r['ratio']:.2f}; unflatten into "
                     f"{r['n_tensors']} tensors {r['unflatten_mean_s'] * 1e3:.3f} ms")
    lines.append(f"  path: simulated {v.simulated_s * 1e3:.3f} ms, measured store.fetch mean "
                 f"{v.measured_mean_s * 1e3:.3f} ms (median {v.measured_median_s * 1e3:.3f}); "
                 f"simulated/measured = {v.ratio:.3f}; vs the sum of per-level fetch_flat "
                 f"{v.measured_flat_mean_s * 1e3:.3f} ms: {v.ratio_flat:.3f} (fetch also unflattens each block "
                 f"into its tensors: {v.unflatten_mean_s * 1e3:.3f} ms, not in the simulator's model)")
    return "\n".join(lines)


__all__ = [
    "DEFAULT_SIZES", "Calibration", "SizeTiming", "TierFit", "Validation", "calibrate", "calibration_anchor",
    "fit_latency_bandwidth", "fit_tier", "format_calibration", "format_validation", "measure", "profile_yaml",
    "tier_kind", "validate", "write_calibration_bank", "write_profile",
]
