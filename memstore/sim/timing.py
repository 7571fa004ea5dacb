"""What `calibrate` and `validate` share: the tier fit, the calibration banks, cold reads.

- The fit: ``seconds = latency + bytes / bandwidth`` by least squares on relative residuals
  (`fit_latency_bandwidth`; per tier, `fit_tier` over `SizeTiming`s gives a `TierFit`).
- The calibration banks: one single-level bank per target size whose one block's record is
  exactly that size (`calibration_anchor`, `write_calibration_bank`, random values from
  `random_init`).
- Cold reads through the real store: `store_tiers` (tiers with no cache, O_DIRECT on flash),
  `Cold` (drops a level file's cached pages before each read where O_DIRECT is not used) and
  `drop_cache`.

`memstore.sim.calibrate` re-exports the public names, as callers import them from there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from memtree.geometry import (
    AnchorShape,
    MemoryConfig,
)
from memtree.memstore.format import is_url, level_path
from memtree.memstore.store import MemoryStore, TierConfig
from memtree.memstore.writer import write_bank

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES: tuple[int, ...] = (
    4 * KiB,
    16 * KiB,
    64 * KiB,
    256 * KiB,
    1 * MiB,
    4 * MiB,
    16 * MiB,
    32 * MiB,
)
_HEAD_DIM = 256  # calibration anchor: one kv block of w keys + w values of 256 bf16 = 1024·w bytes
_BYTES_PER_W = 2 * _HEAD_DIM * 2


def tier_kind(name: str) -> str:
    """Store backend for a profile tier name: "ram" and "disk" are themselves, anything else is
    flash."""
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
        raise ValueError(
            f"fit: nbytes and seconds must be 1-D and equally long, got {x.shape} and {y.shape}"
        )
    if np.unique(x).size < 2:
        raise ValueError(
            f"fit: need timings at two or more distinct sizes, got sizes {sorted(set(x.tolist()))}"
        )
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
            f"fit: time does not grow with size (slope {slope:.3g} s/B): bandwidth is not "
            "resolvable; use a wider range of sizes or more repeats"
        )
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
        return cls(
            nbytes=int(nbytes),
            n=int(s.size),
            median_s=float(np.median(s)),
            p10_s=float(np.percentile(s, 10)),
            p90_s=float(np.percentile(s, 90)),
            min_s=float(s.min()),
            mean_s=float(s.mean()),
        )


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
        return {
            "name": self.name,
            "kind": self.kind,
            "method": self.method,
            "latency_s": self.latency_s,
            "bandwidth_bps": self.bandwidth_bps,
            "max_rel_error": self.max_rel_error,
            "timings": [asdict(t) | {"fit_s": self.predict(t.nbytes)} for t in self.timings],
        }


def fit_tier(
    name: str, samples: Mapping[int, Sequence[float]], *, kind: str | None = None, method: str = ""
) -> TierFit:
    """Medians per size of raw fetch timings {nbytes: [seconds, …]} → fitted TierFit."""
    timings = tuple(SizeTiming.of(n, s) for n, s in sorted(samples.items()))
    lat, bw = fit_latency_bandwidth([t.nbytes for t in timings], [t.median_s for t in timings])
    return TierFit(
        name=name,
        kind=kind or tier_kind(name),
        method=method,
        timings=timings,
        latency_s=lat,
        bandwidth_bps=bw,
    )


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
        raise ValueError(
            f"calibration size {nbytes} must be a positive multiple of 4096 (the slot alignment)"
        )
    anchor = AnchorShape(
        name=f"calibrate-{nbytes}",
        n_layers=1,
        d_model=_HEAD_DIM,
        n_heads=1,
        head_dim=_HEAD_DIM,
        ffn_dim=1,
        vocab_size=1,
        qk_norm="none",
    )
    return anchor, nbytes // _BYTES_PER_W


def write_calibration_bank(root: str | os.PathLike, nbytes: int, n_blocks: int, *, seed: int = 0):
    """A one-level bf16 bank of n_blocks blocks of exactly nbytes each (no generic slot)."""
    anchor, w = calibration_anchor(nbytes)
    mem = MemoryConfig(multipliers=(w,), type="kv", branching=max(2, int(n_blocks)))
    info = write_bank(
        root,
        anchor=anchor,
        memory=mem,
        dtype="bf16",
        generic=False,
        init=random_init(seed),
        extra={"purpose": "memtree memstore calibrate"},
    )
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


class Cold:
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
                why = "O_DIRECT refused by the filesystem; " if kind == "flash" and direct else ""
                self.methods[level] = (
                    f"{why}buffered read, posix_fadvise(DONTNEED) before each read"
                )
                self.fds.append(fd)
            else:
                self.methods[level] = "fsspec read (no control over caches below it)"

    def __call__(self) -> None:
        for fd in self.fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def store_tiers(names: Sequence[str], direct: bool) -> tuple[TierConfig, ...]:
    return tuple(
        TierConfig(
            name=n, kind=tier_kind(n), cache_bytes=0, direct=direct and tier_kind(n) == "flash"
        )
        for n in names
    )
