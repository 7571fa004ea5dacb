"""The store's counters: reads, bytes and cache hits per tier, refused blocks served per level.

`MemoryStore.stats()` reports them with the placement, each tier's cache and each level's own
hit rate; `reset_stats()` zeroes them (bytes loaded into RAM at open are kept: they describe the
open, not the fetches since). The counters outlive reloads: a store that reopened its levels
after another process's edit keeps counting where it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from memtree.memstore.cache import ByteLRU


@dataclass
class TierStats:
    reads: int = 0
    bytes_read: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    load_bytes: int = 0  # bytes read to fill a RAM tier at open

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class StoreStats:
    """The counters of one open store: `tiers` {tier name: TierStats}, `refused_served`
    {level: fetches answered with the fallback because the block is blocked or deleted}."""

    def __init__(self, tier_names: Iterable[str]) -> None:
        self.tiers = {name: TierStats() for name in tier_names}
        self.refused_served: dict[int, int] = {}

    def report(
        self, placement: Mapping[int, str], caches: Mapping[str, ByteLRU], levels: Mapping[int, Any]
    ) -> dict[str, Any]:
        """The `MemoryStore.stats()` dict; `levels` are the open levels (tier, hits, misses)."""
        return {
            "tiers": {n: s.as_dict() for n, s in self.tiers.items()},
            "placement": {str(k): v for k, v in placement.items()},
            "refused_served": {str(k): v for k, v in self.refused_served.items()},
            "caches": {name: c.stats() for name, c in caches.items()},
            "levels": {
                str(k): {
                    "tier": L.tier,
                    "cache_hits": L.hits,
                    "cache_misses": L.misses,
                    "hit_rate": L.hits / (L.hits + L.misses) if L.hits + L.misses else 0.0,
                }
                for k, L in levels.items()
            },
        }

    def reset(self, caches: Mapping[str, ByteLRU], levels: Mapping[int, Any]) -> None:
        for s in self.tiers.values():
            s.reads = s.bytes_read = s.cache_hits = s.cache_misses = 0
        for c in caches.values():
            c.hits = c.misses = c.evictions = 0
        for L in levels.values():
            L.hits = L.misses = 0
        self.refused_served = {lv: 0 for lv in levels}


def blocked_fraction(levels: Mapping[int, Any]) -> float:
    """Share of the open levels' parameters that is refused (blocked or deleted)."""
    total = sum(L.info.n_blocks * L.info.params for L in levels.values())
    refused = sum(int(L.mask.sum()) * L.info.params for L in levels.values())
    return refused / total if total else 0.0
