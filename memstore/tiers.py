"""Storage tiers and their backends: where a level's records are read from.

A `TierConfig` names one tier (fastest first in a store's list) and its kind; `open_reader`
opens a level's file on the backend of that kind:

- RAM: the level file loaded into memory at open (counted as the tier's `load_bytes`).
- flash: a local file read with `pread`, optionally O_DIRECT so the page cache is bypassed
  (falling back to buffered reads where the filesystem refuses it).
- disk: a slower store, any local path or fsspec URL, read through fsspec.

Every backend reads whole records of one slot and counts reads and bytes in its tier's
`TierStats`. Which level goes to which tier is `memstore.placement`'s; caching decoded blocks
and checking digests is `memstore.levels`'.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Literal

import fsspec
import numpy as np

from memtree.memstore.format import ALIGN, BankError, LevelInfo, is_url
from memtree.memstore.stats import TierStats


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """One storage tier. Tiers are listed fastest first."""

    name: str
    kind: Literal["ram", "flash", "disk"]
    capacity_bytes: int | None = None  # placement budget; None = unbounded
    cache_bytes: int = 0  # LRU of decoded blocks (flash/disk); RAM needs none
    direct: bool = False  # flash: O_DIRECT reads, bypassing the page cache


DEFAULT_TIERS: tuple[TierConfig, ...] = (
    TierConfig(name="ram", kind="ram", capacity_bytes=1 << 30),
    TierConfig(name="flash", kind="flash", cache_bytes=256 << 20),
)


class LevelReader:
    """Reads whole records of one level from where its file lives."""

    def __init__(self, path: str, lv: LevelInfo, stats: TierStats) -> None:
        self.path, self.lv, self.stats = path, lv, stats

    def read(self, slot: int) -> memoryview:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RamReader(LevelReader):
    def __init__(self, path: str, lv: LevelInfo, stats: TierStats) -> None:
        super().__init__(path, lv, stats)
        with open_any(path) as f:
            self.buf = bytearray(f.read())
        stats.load_bytes += len(self.buf)

    def read(self, slot: int) -> memoryview:
        off = slot * self.lv.stride
        self.stats.reads += 1
        self.stats.bytes_read += self.lv.record_bytes
        # a copy: cached tensors must not alias a buffer that edits overwrite
        return memoryview(bytearray(self.buf[off : off + self.lv.record_bytes]))

    def write(self, slot: int, record: bytes) -> None:
        off = slot * self.lv.stride
        self.buf[off : off + len(record)] = record


class FlashReader(LevelReader):
    def __init__(self, path: str, lv: LevelInfo, stats: TierStats, direct: bool) -> None:
        super().__init__(path, lv, stats)
        flags = os.O_RDONLY
        self.direct = direct and hasattr(os, "O_DIRECT")
        if self.direct:
            flags |= os.O_DIRECT
        try:
            self.fd = os.open(path, flags)
        except OSError as e:
            if not self.direct:
                raise
            # filesystems such as tmpfs refuse O_DIRECT; fall back to buffered reads
            self.direct = False
            self.fd = os.open(path, os.O_RDONLY)
            del e

    def read(self, slot: int) -> memoryview:
        n = self.lv.stride if self.direct else self.lv.record_bytes
        # O_DIRECT needs an aligned buffer: an aligned window of a heap array (a fresh mmap
        # per read would fault in and zero every page, halving throughput)
        raw = np.empty(n + ALIGN, dtype=np.uint8)
        start = (-raw.ctypes.data) % ALIGN
        buf = memoryview(raw[start : start + n])
        got = os.preadv(self.fd, [buf], slot * self.lv.stride)
        if got < self.lv.record_bytes:
            raise BankError(
                f"{self.path}: short read at level {self.lv.level} slot {slot} ({got} of "
                f"{self.lv.record_bytes} bytes); file truncated?"
            )
        self.stats.reads += 1
        self.stats.bytes_read += got
        return buf[: self.lv.record_bytes]

    def close(self) -> None:
        os.close(self.fd)


class DiskReader(LevelReader):
    def __init__(self, path: str, lv: LevelInfo, stats: TierStats) -> None:
        super().__init__(path, lv, stats)
        self.f = open_any(path, block_size=0)
        self.lock = threading.Lock()

    def read(self, slot: int) -> memoryview:
        with self.lock:
            self.f.seek(slot * self.lv.stride)
            data = self.f.read(self.lv.record_bytes)
        if len(data) < self.lv.record_bytes:
            raise BankError(
                f"{self.path}: short read at level {self.lv.level} slot {slot}; file truncated?"
            )
        self.stats.reads += 1
        self.stats.bytes_read += len(data)
        return memoryview(bytearray(data))

    def close(self) -> None:
        self.f.close()


def open_any(path: str, **kw):
    """A binary file object for a local path or an fsspec URL (`block_size=0`: unbuffered)."""
    if is_url(path):
        return fsspec.open(path, "rb", **kw).open()
    return open(path, "rb", buffering=0 if kw.get("block_size") == 0 else -1)


def open_reader(tier: TierConfig, path: str, lv: LevelInfo, stats: TierStats) -> LevelReader:
    """Level `lv`'s file at `path`, opened on the backend of `tier`'s kind."""
    if tier.kind == "ram":
        return RamReader(path, lv, stats)
    if tier.kind == "flash":
        if is_url(path):
            raise BankError(f"level {lv.level} lives at {path}; a flash tier needs a local file")
        return FlashReader(path, lv, stats, tier.direct)
    return DiskReader(path, lv, stats)
