"""A store's open levels and the block cache its fetches share.

`OpenLevels` opens every memory level of a bank on the tier the placement policy gives it
(`memstore.placement`, `memstore.tiers`), with the level's digests and its refused mask (the
slots the blocking policy refuses; `memstore.policy`). Flash and disk tiers keep an LRU of
decoded blocks (`memstore.cache.ByteLRU`), one byte budget per tier shared by the levels it
holds: consecutive queries of a session share shallow levels, which is where the cache pays.

One read (`read`) is the cache, else the tier, the digest check (a mismatch names the level,
cluster and file) and the decode; every read is counted per tier and per level. After a
journaled commit, `written` brings the open levels in line with the new records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from memtree.memstore.cache import ByteLRU
from memtree.memstore.format import (
    DIGEST_BYTES,
    BankError,
    BankInfo,
    LevelInfo,
    corrupt_message,
    digest,
    level_path,
    sums_name,
)
from memtree.memstore.placement import TierBudget, place_levels
from memtree.memstore.stats import TierStats
from memtree.memstore.tiers import LevelReader, RamReader, TierConfig, open_reader

Verify = Literal["always", "once", "never"]


@dataclass
class Level:
    info: LevelInfo
    tier: str
    reader: LevelReader
    sums: bytearray
    mask: np.ndarray  # refused (blocked or deleted) slots
    cache: ByteLRU | None
    verified: set[int] = field(default_factory=set)
    hits: int = 0  # cache hits for this level (the tier's cache is shared by its levels)
    misses: int = 0


class OpenLevels:
    """Every memory level of one bank, open on its tier: `placement` {level: tier name},
    `levels` {level: Level}, `caches` {tier name: ByteLRU}, `codecs` {level: codec}."""

    def __init__(
        self,
        root: Path,
        info: BankInfo,
        tiers: Mapping[str, TierConfig],
        placement_rule: str | Mapping[int, str],
        tier_stats: Mapping[str, TierStats],
        mask: Callable[[LevelInfo], np.ndarray],
    ) -> None:
        self.root, self.info, self.tier_stats = root, info, tier_stats
        level_bytes = {lv.level: lv.file_bytes for lv in info.levels.values()}
        self.placement = place_levels(
            level_bytes,
            [TierBudget(name=t.name, capacity_bytes=t.capacity_bytes) for t in tiers.values()],
            placement_rule,
        )
        self.codecs = {lv: info.codec(lv) for lv in info.levels}
        self.caches: dict[str, ByteLRU] = {}
        self.levels: dict[int, Level] = {}
        try:
            for lv in info.levels.values():
                tname = self.placement[lv.level]
                tier = tiers[tname]
                reader = open_reader(tier, level_path(root, lv), lv, tier_stats[tname])
                if tname not in self.caches and tier.kind != "ram" and tier.cache_bytes > 0:
                    self.caches[tname] = ByteLRU(
                        tier.cache_bytes
                    )  # one budget per tier, shared by its levels
                self.levels[lv.level] = Level(
                    info=lv,
                    tier=tname,
                    reader=reader,
                    sums=bytearray((root / sums_name(lv)).read_bytes()),
                    mask=mask(lv),
                    cache=self.caches.get(tname),
                )
        except BaseException:
            self.close()  # the levels opened so far: their files would stay open otherwise
            raise

    def read(
        self, L: Level, slot: int, verify: Verify, out_dtype: torch.dtype | None
    ) -> torch.Tensor:
        """Slot `slot` of level `L` decoded: from its tier's cache, else read, checked and
        cached."""
        key = (L.info.level, slot)
        if L.cache is not None:
            hit = L.cache.get(key)
            stats = self.tier_stats[L.tier]
            if hit is not None:
                stats.cache_hits += 1
                L.hits += 1
                return (
                    hit.clone()
                )  # callers may edit what they fetch; the cached block must not change
            stats.cache_misses += 1
            L.misses += 1
        rec = L.reader.read(slot)
        if verify == "always" or (verify == "once" and slot not in L.verified):
            if digest(rec) != bytes(L.sums[slot * DIGEST_BYTES : (slot + 1) * DIGEST_BYTES]):
                raise BankError(corrupt_message(self.info, L.info, slot))
            L.verified.add(slot)
        t = self.codecs[L.info.level].decode(rec, out_dtype)
        if L.cache is not None:
            L.cache.put(key, t, t.numel() * t.element_size())
            return t.clone()
        return t

    def written(self, info: BankInfo, writes: Iterable[tuple[int, int, bytes]]) -> None:
        """The journaled commit of `writes` [(level, slot, record)] published `info`: update the
        digests, forget what was verified or cached of those slots, and patch RAM copies."""
        self.info = info
        for lv, slot, rec in writes:
            L = self.levels[lv]
            L.sums[slot * DIGEST_BYTES : (slot + 1) * DIGEST_BYTES] = digest(rec)
            L.verified.discard(slot)
            if L.cache is not None:
                L.cache.discard((lv, slot))
            if isinstance(L.reader, RamReader):
                L.reader.write(slot, rec)

    def remask(
        self, mask: Callable[[LevelInfo], np.ndarray], levels: Iterable[int] | None = None
    ) -> None:
        """Recompute the refused masks (of `levels`, default all) after a policy change."""
        for lv in self.levels if levels is None else levels:
            self.levels[lv].mask = mask(self.levels[lv].info)

    def close(self) -> None:
        for L in self.levels.values():
            L.reader.close()
        self.levels = {}
