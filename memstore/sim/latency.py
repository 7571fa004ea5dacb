"""On-device fetch-latency simulator for hierarchical memory banks (seed 002 §3, Fig. 5).

§3 argues that hierarchical memories suit devices whose storage is a stack of
tiers of increasing size and decreasing speed (RAM, flash, external disk):
shallow levels (small banks, large blocks, shared by many queries) live on fast
tiers, deep levels spill to slow ones, and in a session consecutive queries
share their shallow levels, so only the deep blocks need swapping. This module
puts numbers on that argument for a given anchor, memory configuration and
hardware profile, against a flat bank of the same fetch size.

Model (deliberately simple, every term visible):
- Bank sizes come from `memtree.geometry` and tier assignment from
  `memstore.placement`, the same code the real store uses.
- One block read on a tier costs latency_us·1e-6 + bytes / (bandwidth_gbps·1e9)
  seconds: one contiguous read per level, as the store lays blocks out. A path
  fetch reads its memory-carrying levels one after another (the costs add).
- Flat baseline: one level indexed by the query's cluster at the deepest
  memory-carrying level, each block holding the whole fetch; its bank is
  n_blocks(deepest) × fetch bytes, placed with the "flat" policy (the fastest
  tier that holds all of it), and a fetch is one read of the fetch bytes.
- Sessions: blocks go through a `memstore.cache.ByteLRU` keyed by
  (level, cluster) (the flat baseline by its cluster); a hit costs nothing, or
  with `count_cache_copy` a copy at the fastest tier's bandwidth, which a miss
  that the cache keeps pays too: the store hands out a copy of what it caches
  (a caller may edit its block), on the miss that fills it as on every hit.

Traces are (n, L) arrays of nested cluster paths: synthetic Zipf sessions, real
queries routed through a clustering tree, or files.

Hardware profiles are versioned YAML files (`memstore/yamls/profiles/*.yaml`, format
`memtree-hw-profile`, version 1) loaded by `memstore.sim.profiles`; the report
is written by `memstore.sim.report`. Everything here is deterministic.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memtree.clustering.route import route_texts
from memtree.clustering.tree import load_tree
from memtree.geometry import LevelPlan, Plan, block_layout, stored_bytes
from memtree.geometry import plan as make_plan
from memtree.memstore.cache import ByteLRU
from memtree.memstore.placement import place_levels
from memtree.memstore.sim.profiles import HardwareProfile

# A level → tier mapping for explicit placement, or a policy name.
Policy = str | Mapping[int, str]


# ---------------------------------------------------------------------------
# Placement and single fetch


def memory_levels(p: Plan) -> list[LevelPlan]:
    """Levels that carry memory (m_l > 0): the ones a fetch reads."""
    levels = [lv for lv in p.levels if lv.multiplier > 0]
    if not levels:
        raise ValueError(
            f"memory config {p.memory.multipliers} has no non-zero level: nothing to fetch"
        )
    return levels


def pinned(p: Plan, tier: str) -> dict[int, str]:
    """An explicit placement of every memory-carrying level on one tier."""
    return {lv.level: tier for lv in memory_levels(p)}


def _policy_name(policy: Policy) -> str:
    return "explicit" if isinstance(policy, Mapping) else str(policy)


def level_placement(
    p: Plan, profile: HardwareProfile, dtype: str, policy: Policy = "hierarchical"
) -> dict[int, str]:
    """{level: tier name} for the memory-carrying levels."""
    bank = {lv.level: lv.n_blocks * stored_bytes(lv.block_params, dtype) for lv in memory_levels(p)}
    return place_levels(bank, profile.budgets(), policy)


@dataclass(frozen=True, kw_only=True)
class LevelFetch:
    level: int
    tier: str
    block_bytes: int
    bank_bytes: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class FlatBaseline:
    """The flat bank of equal fetch size: indexed by the cluster at `level`."""

    level: int
    n_blocks: int
    block_bytes: int
    bank_bytes: int
    tier: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class FetchResult:
    profile: str
    dtype: str
    policy: str
    levels: tuple[LevelFetch, ...]
    flat: FlatBaseline

    @property
    def fetch_bytes(self) -> int:
        return sum(lv.block_bytes for lv in self.levels)

    @property
    def seconds(self) -> float:
        return sum(lv.seconds for lv in self.levels)

    @property
    def speedup(self) -> float:
        return self.flat.seconds / self.seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "dtype": self.dtype,
            "policy": self.policy,
            "fetch_bytes": self.fetch_bytes,
            "seconds": self.seconds,
            "speedup": self.speedup,
            "levels": [asdict(lv) for lv in self.levels],
            "flat": asdict(self.flat),
        }


def attach_seconds(p: Plan, level: int, profile: HardwareProfile) -> float:
    """CPU time to hand one level's block to the model as per-layer tensors."""
    if not profile.tensor_us:
        return 0.0
    return len(block_layout(p.anchor, p.memory, level)) * profile.tensor_us * 1e-6


def flat_baseline(
    p: Plan, profile: HardwareProfile, dtype: str, tier: str | None = None
) -> FlatBaseline:
    """The flat bank, on the fastest tier that holds it, or on `tier` (checked against its
    capacity)."""
    deepest = memory_levels(p)[-1]
    fetch = p.fetch_bytes(dtype)
    n_blocks = p.memory.n_blocks(deepest.level)
    bank = n_blocks * fetch
    policy: Policy = "flat" if tier is None else {deepest.level: tier}
    placed = place_levels({deepest.level: bank}, profile.budgets(), policy)[deepest.level]
    return FlatBaseline(
        level=deepest.level,
        n_blocks=n_blocks,
        block_bytes=fetch,
        bank_bytes=bank,
        tier=placed,
        seconds=profile.tier(placed).read_seconds(fetch)
        + sum(attach_seconds(p, lv.level, profile) for lv in memory_levels(p)),
    )


def simulate_fetch(
    p: Plan,
    profile: HardwareProfile,
    dtype: str = "bf16",
    policy: Policy = "hierarchical",
    *,
    flat_tier: str | None = None,
) -> FetchResult:
    """One cold fetch of a path: per-level reads on their tiers vs the flat baseline.

    `policy` places the hierarchical bank's levels; `flat_tier` pins the flat
    bank (default: the fastest tier that holds it).
    """
    tiers = level_placement(p, profile, dtype, policy)
    levels = []
    for lv in memory_levels(p):
        block = stored_bytes(lv.block_params, dtype)
        levels.append(
            LevelFetch(
                level=lv.level,
                tier=tiers[lv.level],
                block_bytes=block,
                bank_bytes=lv.n_blocks * block,
                seconds=profile.tier(tiers[lv.level]).read_seconds(block)
                + attach_seconds(p, lv.level, profile),
            )
        )
    return FetchResult(
        profile=profile.name,
        dtype=dtype,
        policy=_policy_name(policy),
        levels=tuple(levels),
        flat=flat_baseline(p, profile, dtype, flat_tier),
    )


# ---------------------------------------------------------------------------
# Traces


def validate_trace(p: Plan, trace: np.ndarray) -> np.ndarray:
    """Check a trace fits the plan's tree: (n ≥ 1, L) in-range, nested global ids."""
    t = np.asarray(trace)
    L, B = p.memory.n_levels, p.memory.branching
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] != L:
        raise ValueError(
            f"trace: expected a non-empty (n, {L}) array of cluster paths, got shape {t.shape}"
        )
    if not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"trace: cluster ids must be integers, got dtype {t.dtype}")
    t = t.astype(np.int64)
    for level in range(1, L + 1):
        col = t[:, level - 1]
        if col.min() < 0 or col.max() >= B**level:
            raise ValueError(
                f"trace: level-{level} ids must lie in [0, {B**level}) for branching {B}, got "
                f"[{col.min()}, {col.max()}] (does the tree's branching match --branching?)"
            )
        if level > 1 and (col // B != t[:, level - 2]).any():
            row = int(np.flatnonzero(col // B != t[:, level - 2])[0])
            raise ValueError(
                f"trace: row {row} is not a nested path: level-{level} id {col[row]} is not a "
                f"child of level-{level - 1} id {t[row, level - 2]}"
            )
    return t


def zipf_trace(
    n_queries: int,
    branching: int,
    levels: int,
    *,
    exponent: float = 1.1,
    stay: float = 0.8,
    shared_levels: int | None = None,
    seed: int = 0,
) -> np.ndarray:
    """A synthetic session of topical queries → (n_queries, levels) int64 nested global ids.

    Leaf popularity is Zipf: the leaf of rank r has weight r**-exponent, ranks
    assigned to leaves by a seeded permutation (popular leaves are spread over
    the tree, not all under cluster 0). The first query draws a leaf from that
    distribution. Each next query, with probability `stay`, keeps the previous
    query's first `shared_levels` levels (its topic; default min(2, levels-1))
    and draws its leaf from the Zipf restricted to that subtree; otherwise it
    draws a fresh leaf. So consecutive queries mostly share shallow blocks and
    differ in deep ones, the pattern §3 describes.
    """
    if n_queries < 1 or branching < 2 or levels < 1:
        raise ValueError(
            "zipf_trace: need n_queries >= 1, branching >= 2, "
            f"levels >= 1; got {n_queries}, {branching}, {levels}"
        )
    if not 0.0 <= stay <= 1.0 or exponent < 0:
        raise ValueError(
            "zipf_trace: need 0 <= stay <= 1 and exponent "
            f">= 0; got stay={stay}, exponent={exponent}"
        )
    shared = min(2, levels - 1) if shared_levels is None else shared_levels
    if not 0 <= shared <= levels:
        raise ValueError(f"zipf_trace: shared_levels must be in [0, {levels}], got {shared}")
    n_leaves = branching**levels
    if n_leaves > 1 << 26:
        raise ValueError(
            f"zipf_trace: {n_leaves:,} leaves is too many "
            "to tabulate; use fewer levels or branching"
        )
    rng = np.random.default_rng(seed)
    weights = np.empty(n_leaves)
    weights[rng.permutation(n_leaves)] = np.arange(1, n_leaves + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    stays = rng.random(n_queries) < stay
    u = rng.random(n_queries)
    span = branching ** (
        levels - shared
    )  # leaves under one shared prefix; contiguous since ids nest
    leaves = np.empty(n_queries, dtype=np.int64)
    for i in range(n_queries):
        if i > 0 and stays[i]:
            lo = int(leaves[i - 1]) // span * span
            hi = lo + span
        else:
            lo, hi = 0, n_leaves
        base = cdf[lo - 1] if lo else 0.0
        x = base + u[i] * (cdf[hi - 1] - base)
        leaves[i] = min(max(int(np.searchsorted(cdf, x, side="right")), lo), hi - 1)
    return np.stack([leaves // branching ** (levels - lv) for lv in range(1, levels + 1)], axis=1)


def trace_from_texts(
    tree_dir: str | Path, texts: Sequence[str], *, model: Any = None, device: str = "auto"
) -> np.ndarray:
    """Route real query texts through a clustering tree → (n, levels) global ids."""
    return route_texts(load_tree(tree_dir), texts, model=model, device=device)


def load_trace(path: str | Path) -> np.ndarray:
    """A trace from .npy ((n, L) integers) or .jsonl (one path per line: a list or {"path":
    [...]})."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace file not found: {p}")
    if p.suffix == ".npy":
        t = np.load(p, allow_pickle=False)
    elif p.suffix == ".jsonl":
        rows = []
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i}: not valid JSON ({e})") from None
            row = rec.get("path") if isinstance(rec, dict) else rec
            if not isinstance(row, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in row
            ):
                raise ValueError(
                    f'{p}:{i}: expected a list of integer cluster ids or {{"path": [...]}}'
                )
            if rows and len(row) != len(rows[0]):
                raise ValueError(
                    f"{p}:{i}: path has {len(row)} levels, earlier lines have {len(rows[0])}"
                )
            rows.append(row)
        t = np.array(rows, dtype=np.int64)
    else:
        raise ValueError(f"trace {p}: expected a .npy or .jsonl file")
    if t.ndim != 2 or t.shape[0] == 0 or not np.issubdtype(t.dtype, np.integer):
        raise ValueError(
            f"trace {p}: expected a non-empty 2-D integer "
            f"array, got shape {t.shape} dtype {t.dtype}"
        )
    return t.astype(np.int64)


# ---------------------------------------------------------------------------
# Sessions


def _latency_stats(
    seconds: np.ndarray, hits: int, lookups: int, nbytes: np.ndarray
) -> dict[str, float | int]:
    return {
        "n_queries": int(seconds.size),
        "mean_s": float(seconds.mean()),
        "p50_s": float(np.percentile(seconds, 50)),
        "p95_s": float(np.percentile(seconds, 95)),
        "max_s": float(seconds.max()),
        "cold_s": float(seconds[0]),
        # The paper's "swap" figure: queries after the first, whose shallow blocks may be cached.
        "warm_mean_s": float(seconds[1:].mean()) if seconds.size > 1 else float(seconds[0]),
        "hit_rate": hits / lookups if lookups else 0.0,
        "bytes_read_total": int(nbytes.sum()),
        "bytes_read_mean": float(nbytes.mean()),
    }


@dataclass(frozen=True, kw_only=True, eq=False)  # holds arrays: field-wise == would be ambiguous
class SessionResult:
    """Per-query costs of a trace. Per-level arrays have one column per memory-carrying level."""

    profile: str
    dtype: str
    policy: str
    cache_bytes: int
    count_cache_copy: bool
    levels: tuple[int, ...]
    tiers: tuple[str, ...]
    hier_seconds: np.ndarray  # (n,)
    hier_bytes: np.ndarray  # (n,) bytes read from storage (misses only)
    hier_level_seconds: np.ndarray  # (n, k)
    hier_level_hit: np.ndarray  # (n, k) bool
    flat_tier: str
    flat_seconds: np.ndarray  # (n,)
    flat_bytes: np.ndarray  # (n,)
    flat_hit: np.ndarray  # (n,) bool

    @property
    def hier_hits(self) -> np.ndarray:
        return self.hier_level_hit.sum(axis=1)

    @property
    def hier_misses(self) -> np.ndarray:
        return self.hier_level_hit.shape[1] - self.hier_hits

    def summary(self) -> dict[str, Any]:
        hier = _latency_stats(
            self.hier_seconds,
            int(self.hier_level_hit.sum()),
            self.hier_level_hit.size,
            self.hier_bytes,
        )
        flat = _latency_stats(
            self.flat_seconds, int(self.flat_hit.sum()), self.flat_hit.size, self.flat_bytes
        )
        return {
            "hierarchical": hier,
            "flat": flat,
            "speedup_mean": flat["mean_s"] / hier["mean_s"] if hier["mean_s"] > 0 else math.inf,
        }

    def to_dict(self, *, per_query: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "profile": self.profile,
            "dtype": self.dtype,
            "policy": self.policy,
            "cache_bytes": self.cache_bytes,
            "count_cache_copy": self.count_cache_copy,
            "levels": list(self.levels),
            "tiers": list(self.tiers),
            "flat_tier": self.flat_tier,
            "summary": self.summary(),
        }
        if per_query:
            out["per_query"] = {
                "hierarchical": {
                    "seconds": self.hier_seconds.tolist(),
                    "bytes_read": self.hier_bytes.tolist(),
                    "hits": self.hier_hits.tolist(),
                    "misses": self.hier_misses.tolist(),
                    "level_seconds": self.hier_level_seconds.tolist(),
                    "level_hit": self.hier_level_hit.tolist(),
                },
                "flat": {
                    "seconds": self.flat_seconds.tolist(),
                    "bytes_read": self.flat_bytes.tolist(),
                    "hit": self.flat_hit.tolist(),
                },
            }
        return out


def simulate_session(
    p: Plan,
    profile: HardwareProfile,
    trace: np.ndarray,
    dtype: str = "bf16",
    cache_bytes: int | None = None,
    *,
    policy: Policy = "hierarchical",
    flat_tier: str | None = None,
    count_cache_copy: bool = False,
) -> SessionResult:
    """Replay a trace of paths through a byte-budgeted LRU (default budget: the profile's cache_gb).

    Hierarchical and flat banks each get their own cache of that budget.
    """
    t = validate_trace(p, trace)
    budget = profile.cache_bytes if cache_bytes is None else int(cache_bytes)
    placement = level_placement(p, profile, dtype, policy)
    flat = flat_baseline(p, profile, dtype, flat_tier)
    mem = memory_levels(p)
    block = [stored_bytes(lv.block_params, dtype) for lv in mem]
    attach = [attach_seconds(p, lv.level, profile) for lv in mem]
    miss_s = [
        profile.tier(placement[lv.level]).read_seconds(b) + a
        for lv, b, a in zip(mem, block, attach, strict=True)
    ]
    ram = profile.tiers[0]
    # A hit still copies the block out of the cache when asked to count it (bandwidth only, no
    # seek).
    copy_s = [b / (ram.bandwidth_gbps * 1e9) if count_cache_copy else 0.0 for b in block]
    hit_s = [c + a for c, a in zip(copy_s, attach, strict=True)]
    flat_copy_s = flat.block_bytes / (ram.bandwidth_gbps * 1e9) if count_cache_copy else 0.0
    flat_hit_s = flat_copy_s

    n, k = t.shape[0], len(mem)
    level_s = np.zeros((n, k))
    level_hit = np.zeros((n, k), dtype=bool)
    hier_bytes = np.zeros(n, dtype=np.int64)
    flat_s = np.zeros(n)
    flat_hit = np.zeros(n, dtype=bool)
    flat_bytes = np.zeros(n, dtype=np.int64)
    cache, flat_cache = ByteLRU(budget), ByteLRU(budget)
    for i in range(n):
        for j, lv in enumerate(mem):
            key = (lv.level, int(t[i, lv.level - 1]))
            if cache.get(key) is not None:
                level_hit[i, j], level_s[i, j] = True, hit_s[j]
            else:
                # a block the cache keeps (it fits the budget) is handed out as a copy, as a hit is
                level_s[i, j] = miss_s[j] + (copy_s[j] if block[j] <= budget else 0.0)
                hier_bytes[i] += block[j]
                cache.put(key, True, block[j])
        key = int(t[i, flat.level - 1])
        if flat_cache.get(key) is not None:
            flat_hit[i], flat_s[i] = True, flat_hit_s
        else:
            flat_s[i] = flat.seconds + (flat_copy_s if flat.block_bytes <= budget else 0.0)
            flat_bytes[i] = flat.block_bytes
            flat_cache.put(key, True, flat.block_bytes)
    return SessionResult(
        profile=profile.name,
        dtype=dtype,
        policy=_policy_name(policy),
        cache_bytes=budget,
        count_cache_copy=count_cache_copy,
        levels=tuple(lv.level for lv in mem),
        tiers=tuple(placement[lv.level] for lv in mem),
        hier_seconds=level_s.sum(axis=1),
        hier_bytes=hier_bytes,
        hier_level_seconds=level_s,
        hier_level_hit=level_hit,
        flat_tier=flat.tier,
        flat_seconds=flat_s,
        flat_bytes=flat_bytes,
        flat_hit=flat_hit,
    )


# ---------------------------------------------------------------------------
# Sweeps


def config_label(multipliers: Sequence[int]) -> str:
    return ",".join(map(str, multipliers))


def sweep(
    anchor: str,
    configs: Sequence[Sequence[int]],
    profile: HardwareProfile,
    *,
    type: str = "ffn",
    dtype: str = "bf16",
    policy: str = "hierarchical",
    pin_tier: str | None = None,
    branching: int = 16,
    trace: np.ndarray | None = None,
    n_queries: int = 0,
    seed: int = 0,
    cache_bytes: int | None = None,
    count_cache_copy: bool = False,
) -> list[dict[str, Any]]:
    """One row per memory config: single-fetch latencies and, with a trace, session means.

    `pin_tier` stores both banks on that one tier (Fig. 5 right) instead of
    placing them by `policy`. `trace` is replayed for every config (all must
    then have its depth); without one, `n_queries` > 0 draws a `zipf_trace`
    per config with `seed`.
    """
    rows = []
    for mult in configs:
        p = make_plan(anchor, tuple(mult), type=type, branching=branching)
        placement = pinned(p, pin_tier) if pin_tier else policy
        f = simulate_fetch(p, profile, dtype, placement, flat_tier=pin_tier)
        row: dict[str, Any] = {
            "profile": profile.name,
            "config": config_label(mult),
            "multipliers": list(mult),
            "fetch_params": p.fetch_params,
            "fetch_bytes": f.fetch_bytes,
            "bank_bytes": p.bank_bytes(dtype),
            "flat_bank_bytes": f.flat.bank_bytes,
            "tiers": {str(lv.level): lv.tier for lv in f.levels},
            "flat_tier": f.flat.tier,
            "hierarchical_s": f.seconds,
            "flat_s": f.flat.seconds,
            "speedup": f.speedup,
        }
        t = (
            trace
            if trace is not None
            else (zipf_trace(n_queries, branching, len(mult), seed=seed) if n_queries > 0 else None)
        )
        if t is not None:
            s = simulate_session(
                p,
                profile,
                t,
                dtype,
                cache_bytes,
                policy=placement,
                flat_tier=pin_tier,
                count_cache_copy=count_cache_copy,
            ).summary()
            row["session"] = {
                "hierarchical_mean_s": s["hierarchical"]["mean_s"],
                "flat_mean_s": s["flat"]["mean_s"],
                "hierarchical_hit_rate": s["hierarchical"]["hit_rate"],
                "flat_hit_rate": s["flat"]["hit_rate"],
            }
        rows.append(row)
    return rows
