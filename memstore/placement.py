"""Which storage tier holds which bank level (seed 002 §3, Fig. 5).

Shared by the real store (`memstore.store`) and the fetch simulator
(`memstore.sim.latency`), so a simulated layout is the layout the store would use.

Tiers are given fastest first (RAM, flash, disk …), each with a capacity in
bytes (None = unbounded). Policies:
- "hierarchical" (default, as §3 argues): shallow levels, whose banks are small
  but whose blocks are large and shared by many queries, take the fastest tier
  that still has room; deeper levels spill to slower tiers.
- "flat": the flat-bank baseline; the whole bank is one unit and goes to the
  fastest tier whose capacity holds all of it.
- an explicit {level: tier} mapping, checked against capacities.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TierBudget:
    name: str
    capacity_bytes: int | None = None  # None: unbounded


def place_levels(
    level_bytes: Mapping[int, int],
    tiers: Sequence[TierBudget],
    policy: str | Mapping[int, str] = "hierarchical",
) -> dict[int, str]:
    """Assign each level (with its total bank bytes) to a tier name.

    Levels with zero bytes are left out of the result. Raises ValueError naming
    the level and the capacities when nothing fits.
    """
    if not tiers:
        raise ValueError("placement: no tiers given")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ValueError(f"placement: tier names must be unique, got {names}")
    levels = {lv: int(b) for lv, b in sorted(level_bytes.items()) if b > 0}
    free = {t.name: t.capacity_bytes for t in tiers}

    def take(tier: str, nbytes: int) -> bool:
        cap = free[tier]
        if cap is not None and cap < nbytes:
            return False
        if cap is not None:
            free[tier] = cap - nbytes
        return True

    def describe() -> str:
        return ", ".join(
            f"{t.name}={'unbounded' if t.capacity_bytes is None else f'{t.capacity_bytes:,} B'}"
            for t in tiers
        )

    out: dict[int, str] = {}
    if isinstance(policy, Mapping):
        for lv, nbytes in levels.items():
            tier = policy.get(lv)
            if tier is None:
                raise ValueError(
                    f"placement: level {lv} has no tier in the explicit mapping {dict(policy)}"
                )
            if tier not in free:
                raise ValueError(
                    f"placement: level {lv} mapped to unknown tier {tier!r}; tiers are {names}"
                )
            if not take(tier, nbytes):
                raise ValueError(
                    f"placement: level {lv} ({nbytes:,} B) does "
                    f"not fit on tier {tier!r} ({describe()})"
                )
            out[lv] = tier
        return out
    if policy == "hierarchical":
        for lv, nbytes in levels.items():
            for t in tiers:
                if take(t.name, nbytes):
                    out[lv] = t.name
                    break
            else:
                raise ValueError(
                    f"placement: level {lv} ({nbytes:,} B) fits on no tier ({describe()})"
                )
        return out
    if policy == "flat":
        total = sum(levels.values())
        for t in tiers:
            if take(t.name, total):
                return {lv: t.name for lv in levels}
        raise ValueError(f"placement: the flat bank ({total:,} B) fits on no tier ({describe()})")
    raise ValueError(
        f"placement: policy {policy!r} is not 'hierarchical', 'flat' or a {{level: tier}} mapping"
    )
