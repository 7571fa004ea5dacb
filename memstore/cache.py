"""Byte-budgeted LRU cache with hit/miss counters.

Used by the real store (one per tier, holding decoded blocks of the levels on
that tier) and by the fetch simulator (the same policy over block keys; the
simulator keeps one session cache for all levels, so its hit rates equal the
store's when the store's levels share one cached tier). Consecutive queries share shallow levels of
their paths (compositionality, seed 002 §3), which is what this cache exploits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class ByteLRU:
    """LRU over (key → value, nbytes) with a total byte budget.

    An entry larger than the whole budget is never admitted (it would evict
    everything and then itself). A budget of 0 disables caching.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self.used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> Any | None:
        """The cached value (marked most recent) or None; counts a hit or a miss."""
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        if key in self._items:
            self.used -= self._items.pop(key)[1]
        if nbytes > self.capacity:
            return
        while self.used + nbytes > self.capacity and self._items:
            _, (_, old) = self._items.popitem(last=False)
            self.used -= old
            self.evictions += 1
        self._items[key] = (value, nbytes)
        self.used += nbytes

    def discard(self, key: Hashable) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self.used -= item[1]

    def clear(self) -> None:
        self._items.clear()
        self.used = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def stats(self) -> dict[str, int | float]:
        return {
            "capacity_bytes": self.capacity,
            "used_bytes": self.used,
            "entries": len(self._items),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "hit_rate": self.hit_rate,
        }
