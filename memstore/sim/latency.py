"""On-device fetch-latency simulator for hierarchical memory banks (seed 002 §3, Fig. 5).

§3 argues that hierarchical memories suit devices whose storage is a stack of
tiers of increasing size and decreasing speed (RAM, flash, external disk):
shallow levels (small banks, large blocks, shared by many queries) live on fast
tiers, deep levels spill to slow ones, and in a session consecutive queries
share their shallow levels, so only the deep blocks need swapping. This module
puts numbers on that argument for a given anchor, memory configuration and
hardware profile, against a flat bank of the same fetch size.

Model (deliberately simple, every term visible):
- Bank sizes come from `memstore.geometry` and tier assignment from
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
  a copy at the fastest tier's bandwidth with `count_cache_copy`.

Hardware profiles are versioned YAML files (`memstore/profiles/*.yaml`, format
`memtree-hw-profile`, version 1) loaded through `memtree.config`, so unknown
keys are errors that name the key. Everything here is deterministic.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memstore.cache import ByteLRU
from memstore.geometry import (
    DTYPES,
    MEMORY_TYPES,
    LevelPlan,
    Plan,
    block_layout,
    human,
    human_bytes,
    parse_multipliers,
    stored_bytes,
)
from memstore.geometry import plan as make_plan
from memstore.placement import TierBudget, place_levels
from memtree.config import ConfigError, load_config, to_dict
from memtree.io import atomic_path, atomic_write_json, atomic_write_text

PROFILE_FORMAT = "memtree-hw-profile"
PROFILE_VERSION = 1
PROFILES_DIR = Path(__file__).with_name("profiles")

# A level → tier mapping for explicit placement, or a policy name.
Policy = str | Mapping[int, str]


# ---------------------------------------------------------------------------
# Hardware profiles


@dataclass(frozen=True, kw_only=True)
class TierProfile:
    """One storage tier. Units are decimal: GB/s, µs, GB (None = unbounded)."""

    name: str
    bandwidth_gbps: float
    latency_us: float
    capacity_gb: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tier name must not be empty")
        if not (math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps > 0):
            raise ValueError(f"tier {self.name!r}: bandwidth_gbps must be positive, got {self.bandwidth_gbps}")
        if not (math.isfinite(self.latency_us) and self.latency_us >= 0):
            raise ValueError(f"tier {self.name!r}: latency_us must be non-negative, got {self.latency_us}")
        if self.capacity_gb is not None and not self.capacity_gb >= 0:
            raise ValueError(f"tier {self.name!r}: capacity_gb must be non-negative or null, got {self.capacity_gb}")

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.capacity_gb is None else round(self.capacity_gb * 1e9)

    def read_seconds(self, nbytes: int) -> float:
        """Seconds for one contiguous read of nbytes."""
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbps * 1e9)


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """A device: tiers fastest first, and the RAM budget for the session cache."""

    format: str = PROFILE_FORMAT
    version: int = PROFILE_VERSION
    name: str
    description: str = ""
    tiers: tuple[TierProfile, ...]
    cache_gb: float = 0.0
    # Host CPU per tensor handed to the model when a block is attached: `fetch(path)` builds one
    # view per layer tensor of every level (hits included). 0 leaves it out (the shipped profiles);
    # `memtree memstore calibrate` measures it.
    tensor_us: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tensor_us) and self.tensor_us >= 0):
            raise ValueError(f"profile {self.name!r}: tensor_us must be non-negative, got {self.tensor_us}")
        if self.format != PROFILE_FORMAT:
            raise ValueError(f"format {self.format!r} is not {PROFILE_FORMAT!r}")
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version {self.version} is not supported (this memtree reads {PROFILE_VERSION})")
        if not self.tiers:
            raise ValueError(f"profile {self.name!r}: needs at least one tier")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"profile {self.name!r}: tier names must be unique, got {names}")
        if not (math.isfinite(self.cache_gb) and self.cache_gb >= 0):
            raise ValueError(f"profile {self.name!r}: cache_gb must be non-negative, got {self.cache_gb}")

    @property
    def cache_bytes(self) -> int:
        return round(self.cache_gb * 1e9)

    def tier(self, name: str) -> TierProfile:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ValueError(f"profile {self.name!r} has no tier {name!r}")

    def budgets(self) -> list[TierBudget]:
        return [TierBudget(name=t.name, capacity_bytes=t.capacity_bytes) for t in self.tiers]


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name ("phone", "laptop") or a profile YAML by path."""
    p = Path(name_or_path)
    if isinstance(name_or_path, str) and name_or_path in shipped_profiles():
        p = PROFILES_DIR / f"{name_or_path}.yaml"
    elif not (p.is_file() or p.suffix in (".yaml", ".yml")):
        raise ConfigError(f"unknown hardware profile {str(name_or_path)!r}; shipped: {shipped_profiles()} "
                          "(or give a path to a profile YAML)")
    return load_config(HardwareProfile, p)


# ---------------------------------------------------------------------------
# Placement and single fetch


def memory_levels(p: Plan) -> list[LevelPlan]:
    """Levels that carry memory (m_l > 0): the ones a fetch reads."""
    levels = [lv for lv in p.levels if lv.multiplier > 0]
    if not levels:
        raise ValueError(f"memory config {p.memory.multipliers} has no non-zero level: nothing to fetch")
    return levels


def pinned(p: Plan, tier: str) -> dict[int, str]:
    """An explicit placement of every memory-carrying level on one tier."""
    return {lv.level: tier for lv in memory_levels(p)}


def _policy_name(policy: Policy) -> str:
    return "explicit" if isinstance(policy, Mapping) else str(policy)


def level_placement(p: Plan, profile: HardwareProfile, dtype: str, policy: Policy = "hierarchical") -> dict[int, str]:
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
            "profile": self.profile, "dtype": self.dtype, "policy": self.policy,
            "fetch_bytes": self.fetch_bytes, "seconds": self.seconds, "speedup": self.speedup,
            "levels": [asdict(lv) for lv in self.levels], "flat": asdict(self.flat),
        }


def attach_seconds(p: Plan, level: int, profile: HardwareProfile) -> float:
    """CPU time to hand one level's block to the model as per-layer tensors."""
    if not profile.tensor_us:
        return 0.0
    return len(block_layout(p.anchor, p.memory, level)) * profile.tensor_us * 1e-6


def flat_baseline(p: Plan, profile: HardwareProfile, dtype: str, tier: str | None = None) -> FlatBaseline:
    """The flat bank, on the fastest tier that holds it, or on `tier` (checked against its capacity)."""
    deepest = memory_levels(p)[-1]
    fetch = p.fetch_bytes(dtype)
    n_blocks = p.memory.n_blocks(deepest.level)
    bank = n_blocks * fetch
    policy: Policy = "flat" if tier is None else {deepest.level: tier}
    placed = place_levels({deepest.level: bank}, profile.budgets(), policy)[deepest.level]
    return FlatBaseline(level=deepest.level, n_blocks=n_blocks, block_bytes=fetch, bank_bytes=bank, tier=placed,
                        seconds=profile.tier(placed).read_seconds(fetch)
                        + sum(attach_seconds(p, lv.level, profile) for lv in memory_levels(p)))


def simulate_fetch(p: Plan, profile: HardwareProfile, dtype: str = "bf16", policy: Policy = "hierarchical",
                   *, flat_tier: str | None = None) -> FetchResult:
    """One cold fetch of a path: per-level reads on their tiers vs the flat baseline.

    `policy` places the hierarchical bank's levels; `flat_tier` pins the flat
    bank (default: the fastest tier that holds it).
    """
    tiers = level_placement(p, profile, dtype, policy)
    levels = []
    for lv in memory_levels(p):
        block = stored_bytes(lv.block_params, dtype)
        levels.append(LevelFetch(level=lv.level, tier=tiers[lv.level], block_bytes=block,
                                 bank_bytes=lv.n_blocks * block,
                                 seconds=profile.tier(tiers[lv.level]).read_seconds(block)
                                 + attach_seconds(p, lv.level, profile)))
    return FetchResult(profile=profile.name, dtype=dtype, policy=_policy_name(policy), levels=tuple(levels),
                       flat=flat_baseline(p, profile, dtype, flat_tier))


# ---------------------------------------------------------------------------
# Traces


def validate_trace(p: Plan, trace: np.ndarray) -> np.ndarray:
    """Check a trace fits the plan's tree: (n ≥ 1, L) in-range, nested global ids."""
    t = np.asarray(trace)
    L, B = p.memory.n_levels, p.memory.branching
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] != L:
        raise ValueError(f"trace: expected a non-empty (n, {L}) array of cluster paths, got shape {t.shape}")
    if not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"trace: cluster ids must be integers, got dtype {t.dtype}")
    t = t.astype(np.int64)
    for level in range(1, L + 1):
        col = t[:, level - 1]
        if col.min() < 0 or col.max() >= B**level:
            raise ValueError(f"trace: level-{level} ids must lie in [0, {B**level}) for branching {B}, "
                             f"got [{col.min()}, {col.max()}] (does the tree's branching match --branching?)")
        if level > 1 and (col // B != t[:, level - 2]).any():
            row = int(np.flatnonzero(col // B != t[:, level - 2])[0])
            raise ValueError(f"trace: row {row} is not a nested path: level-{level} id {col[row]} is not a child "
                             f"of level-{level - 1} id {t[row, level - 2]}")
    return t


def zipf_trace(n_queries: int, branching: int, levels: int, *, exponent: float = 1.1, stay: float = 0.8,
               shared_levels: int | None = None, seed: int = 0) -> np.ndarray:
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
        raise ValueError(f"zipf_trace: need n_queries >= 1, branching >= 2, levels >= 1; got "
                         f"{n_queries}, {branching}, {levels}")
    if not 0.0 <= stay <= 1.0 or exponent < 0:
        raise ValueError(f"zipf_trace: need 0 <= stay <= 1 and exponent >= 0; got stay={stay}, exponent={exponent}")
    shared = min(2, levels - 1) if shared_levels is None else shared_levels
    if not 0 <= shared <= levels:
        raise ValueError(f"zipf_trace: shared_levels must be in [0, {levels}], got {shared}")
    n_leaves = branching**levels
    if n_leaves > 1 << 26:
        raise ValueError(f"zipf_trace: {n_leaves:,} leaves is too many to tabulate; use fewer levels or branching")
    rng = np.random.default_rng(seed)
    weights = np.empty(n_leaves)
    weights[rng.permutation(n_leaves)] = np.arange(1, n_leaves + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    stays = rng.random(n_queries) < stay
    u = rng.random(n_queries)
    span = branching ** (levels - shared)  # leaves under one shared prefix; contiguous since ids nest
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


def trace_from_texts(tree_dir: str | Path, texts: Sequence[str], *, model: Any = None,
                     device: str = "auto") -> np.ndarray:
    """Route real query texts through a clustering tree → (n, levels) global ids."""
    from clustering.route import route_texts  # loads the embedder; only needed for real queries
    from clustering.tree import load_tree

    return route_texts(load_tree(tree_dir), texts, model=model, device=device)


def load_trace(path: str | Path) -> np.ndarray:
    """A trace from .npy ((n, L) integers) or .jsonl (one path per line: a list or {"path": [...]})."""
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
            if not isinstance(row, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in row):
                raise ValueError(f"{p}:{i}: expected a list of integer cluster ids or {{\"path\": [...]}}")
            if rows and len(row) != len(rows[0]):
                raise ValueError(f"{p}:{i}: path has {len(row)} levels, earlier lines have {len(rows[0])}")
            rows.append(row)
        t = np.array(rows, dtype=np.int64)
    else:
        raise ValueError(f"trace {p}: expected a .npy or .jsonl file")
    if t.ndim != 2 or t.shape[0] == 0 or not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"trace {p}: expected a non-empty 2-D integer array, got shape {t.shape} dtype {t.dtype}")
    return t.astype(np.int64)


# ---------------------------------------------------------------------------
# Sessions


def _latency_stats(seconds: np.ndarray, hits: int, lookups: int, nbytes: np.ndarray) -> dict[str, float | int]:
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
        hier = _latency_stats(self.hier_seconds, int(self.hier_level_hit.sum()), self.hier_level_hit.size,
                              self.hier_bytes)
        flat = _latency_stats(self.flat_seconds, int(self.flat_hit.sum()), self.flat_hit.size, self.flat_bytes)
        return {"hierarchical": hier, "flat": flat,
                "speedup_mean": flat["mean_s"] / hier["mean_s"] if hier["mean_s"] > 0 else math.inf}

    def to_dict(self, *, per_query: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "profile": self.profile, "dtype": self.dtype, "policy": self.policy, "cache_bytes": self.cache_bytes,
            "count_cache_copy": self.count_cache_copy, "levels": list(self.levels), "tiers": list(self.tiers),
            "flat_tier": self.flat_tier, "summary": self.summary(),
        }
        if per_query:
            out["per_query"] = {
                "hierarchical": {"seconds": self.hier_seconds.tolist(), "bytes_read": self.hier_bytes.tolist(),
                                 "hits": self.hier_hits.tolist(), "misses": self.hier_misses.tolist(),
                                 "level_seconds": self.hier_level_seconds.tolist(),
                                 "level_hit": self.hier_level_hit.tolist()},
                "flat": {"seconds": self.flat_seconds.tolist(), "bytes_read": self.flat_bytes.tolist(),
                         "hit": self.flat_hit.tolist()},
            }
        return out


def simulate_session(p: Plan, profile: HardwareProfile, trace: np.ndarray, dtype: str = "bf16",
                     cache_bytes: int | None = None, *, policy: Policy = "hierarchical",
                     flat_tier: str | None = None, count_cache_copy: bool = False) -> SessionResult:
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
    miss_s = [profile.tier(placement[lv.level]).read_seconds(b) + a for lv, b, a in zip(mem, block, attach, strict=True)]
    ram = profile.tiers[0]
    # A hit still copies the block out of the cache when asked to count it (bandwidth only, no seek).
    hit_s = [(b / (ram.bandwidth_gbps * 1e9) if count_cache_copy else 0.0) + a for b, a in zip(block, attach, strict=True)]
    flat_hit_s = flat.block_bytes / (ram.bandwidth_gbps * 1e9) if count_cache_copy else 0.0

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
                level_s[i, j] = miss_s[j]
                hier_bytes[i] += block[j]
                cache.put(key, True, block[j])
        key = int(t[i, flat.level - 1])
        if flat_cache.get(key) is not None:
            flat_hit[i], flat_s[i] = True, flat_hit_s
        else:
            flat_s[i], flat_bytes[i] = flat.seconds, flat.block_bytes
            flat_cache.put(key, True, flat.block_bytes)
    return SessionResult(
        profile=profile.name, dtype=dtype, policy=_policy_name(policy), cache_bytes=budget,
        count_cache_copy=count_cache_copy, levels=tuple(lv.level for lv in mem),
        tiers=tuple(placement[lv.level] for lv in mem), hier_seconds=level_s.sum(axis=1), hier_bytes=hier_bytes,
        hier_level_seconds=level_s, hier_level_hit=level_hit, flat_tier=flat.tier, flat_seconds=flat_s,
        flat_bytes=flat_bytes, flat_hit=flat_hit,
    )


# ---------------------------------------------------------------------------
# Sweeps


def config_label(multipliers: Sequence[int]) -> str:
    return ",".join(map(str, multipliers))


def sweep(anchor: str, configs: Sequence[Sequence[int]], profile: HardwareProfile, *, type: str = "ffn",
          dtype: str = "bf16", policy: str = "hierarchical", pin_tier: str | None = None, branching: int = 16,
          trace: np.ndarray | None = None, n_queries: int = 0, seed: int = 0, cache_bytes: int | None = None,
          count_cache_copy: bool = False) -> list[dict[str, Any]]:
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
            "profile": profile.name, "config": config_label(mult), "multipliers": list(mult),
            "fetch_params": p.fetch_params, "fetch_bytes": f.fetch_bytes, "bank_bytes": p.bank_bytes(dtype),
            "flat_bank_bytes": f.flat.bank_bytes, "tiers": {str(lv.level): lv.tier for lv in f.levels},
            "flat_tier": f.flat.tier, "hierarchical_s": f.seconds, "flat_s": f.flat.seconds, "speedup": f.speedup,
        }
        t = trace if trace is not None else (
            zipf_trace(n_queries, branching, len(mult), seed=seed) if n_queries > 0 else None)
        if t is not None:
            s = simulate_session(p, profile, t, dtype, cache_bytes, policy=placement, flat_tier=pin_tier,
                                 count_cache_copy=count_cache_copy).summary()
            row["session"] = {
                "hierarchical_mean_s": s["hierarchical"]["mean_s"], "flat_mean_s": s["flat"]["mean_s"],
                "hierarchical_hit_rate": s["hierarchical"]["hit_rate"], "flat_hit_rate": s["flat"]["hit_rate"],
            }
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# Reports


@dataclass(frozen=True, kw_only=True)
class ProfileResults:
    """Everything simulated for one hardware profile, as `write_report` consumes it."""

    profile: HardwareProfile
    fetch: FetchResult
    session: SessionResult | None = None
    sweep: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"profile": to_dict(self.profile), "fetch": self.fetch.to_dict(),
                "session": self.session.to_dict() if self.session else None, "sweep": list(self.sweep)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def format_table(results: Sequence[ProfileResults]) -> str:
    """Markdown summary: placement, single fetch, session and sweep per profile."""
    lines: list[str] = []
    for r in results:
        f = r.fetch
        lines += [f"## {r.profile.name}: {r.profile.description}".rstrip(": "), ""]
        tiers = ", ".join(f"L{lv.level} ({human_bytes(lv.bank_bytes)}) → {lv.tier}" for lv in f.levels)
        flat_bank = f"flat bank ({human_bytes(f.flat.bank_bytes)}, {f.flat.n_blocks:,} blocks) → {f.flat.tier}"
        lines += [f"placement ({f.policy}): {tiers}; {flat_bank}", ""]
        per_level = " + ".join(f"L{lv.level} {_ms(lv.seconds)}" for lv in f.levels)
        head = "| bank | fetch | single fetch (ms) |"
        rule = "|---|---:|---:|"
        hier = f"| hierarchical | {human_bytes(f.fetch_bytes)} | {_ms(f.seconds)} ({per_level}) |"
        flat = f"| flat | {human_bytes(f.flat.block_bytes)} | {_ms(f.flat.seconds)} |"
        if r.session is not None:
            s = r.session.summary()
            head += " session mean (ms) | warm mean (ms) | p50 (ms) | p95 (ms) | hit rate | read/query |"
            rule += "---:|---:|---:|---:|---:|---:|"

            def cols(st: dict[str, Any]) -> str:
                return (f" {_ms(st['mean_s'])} | {_ms(st['warm_mean_s'])} | {_ms(st['p50_s'])} | "
                        f"{_ms(st['p95_s'])} | {st['hit_rate']:.1%} | {human_bytes(st['bytes_read_mean'])} |")

            hier += cols(s["hierarchical"])
            flat += cols(s["flat"])
        lines += [head, rule, hier, flat, ""]
        lines.append(f"single-fetch speedup (flat / hierarchical): {f.speedup:.1f}×"
                     + (f"; session mean speedup: {r.session.summary()['speedup_mean']:.1f}× over "
                        f"{r.session.hier_seconds.size} queries, cache {human_bytes(r.session.cache_bytes)}"
                        if r.session is not None else ""))
        lines.append("")
        if r.sweep:
            has_session = "session" in r.sweep[0]
            lines += ["| config | fetched params | fetch | bank | flat bank | hierarchical (ms) | flat (ms) | speedup |"
                      + (" session hier (ms) | session flat (ms) |" if has_session else ""),
                      "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if has_session else "")]
            for row in r.sweep:
                line = (f"| ({row['config']}) | {human(row['fetch_params'])} | {human_bytes(row['fetch_bytes'])} | "
                        f"{human_bytes(row['bank_bytes'])} | {human_bytes(row['flat_bank_bytes'])} | "
                        f"{_ms(row['hierarchical_s'])} | {_ms(row['flat_s'])} | {row['speedup']:.1f}× |")
                if has_session:
                    line += f" {_ms(row['session']['hierarchical_mean_s'])} | {_ms(row['session']['flat_mean_s'])} |"
                lines.append(line)
            lines.append("")
    return "\n".join(lines)


def _tier_colors(results: Sequence[ProfileResults]) -> dict[str, str]:
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
    names: list[str] = []
    for r in results:
        names += [t.name for t in r.profile.tiers if t.name not in names]
    return {n: palette[i % len(palette)] for i, n in enumerate(names)}


def _save(fig: Any, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


def _plot_fetch(results: Sequence[ProfileResults], path: Path) -> None:
    # A bare Figure renders with Agg and touches no global pyplot state.
    from matplotlib.figure import Figure

    colors = _tier_colors(results)
    fig = Figure(figsize=(4.2 * len(results), 4.5), layout="constrained")
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    for ax, r in zip(axes, results):
        f = r.fetch
        top = max(f.seconds, f.flat.seconds) * 1e3
        bottom = 0.0
        for lv in f.levels:
            h = lv.seconds * 1e3
            ax.bar(0, h, bottom=bottom, color=colors[lv.tier], edgecolor="white", width=0.6)
            if h > 0.05 * top:  # a label in a sliver would overprint its neighbours
                ax.text(0, bottom + h / 2, f"L{lv.level}", ha="center", va="center", fontsize=8, color="white")
            bottom += h
        ax.text(0, bottom, f"{bottom:.1f} ms", ha="center", va="bottom", fontsize=9)
        flat_ms = f.flat.seconds * 1e3
        ax.bar(1, flat_ms, color=colors[f.flat.tier], edgecolor="white", width=0.6)
        ax.text(1, flat_ms, f"{flat_ms:.1f} ms", ha="center", va="bottom", fontsize=9)
        ax.set_xticks([0, 1], ["hierarchical", "flat"])
        ax.set_ylabel("single fetch latency (ms)")
        ax.set_title(f"{r.profile.name}: fetch {human_bytes(f.fetch_bytes)}")
        ax.margins(y=0.12)
        used = [t.name for t in r.profile.tiers if t.name in {lv.tier for lv in f.levels} | {f.flat.tier}]
        ax.legend(handles=[_patch(colors[n], n) for n in used], title="tier", fontsize=8)
    _save(fig, path)


def _patch(color: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=color, label=label)


def _plot_session(results: Sequence[ProfileResults], path: Path) -> None:
    from matplotlib.figure import Figure

    sessions = [(r.profile.name, r.session) for r in results if r.session is not None]
    fig = Figure(figsize=(9, 3.2 * len(sessions)), layout="constrained")
    axes = fig.subplots(len(sessions), 1, squeeze=False)[:, 0]
    for ax, (name, s) in zip(axes, sessions):
        q = np.arange(s.hier_seconds.size)
        summ = s.summary()
        # Flat first, so the (much lower) hierarchical trace is drawn on top of it.
        for bank, sec, color in (("flat", s.flat_seconds, "#C44E52"), ("hierarchical", s.hier_seconds, "#4C72B0")):
            mean_ms = summ[bank]["mean_s"] * 1e3
            ax.plot(q, sec * 1e3, lw=0.7, color=color, label=f"{bank} (mean {mean_ms:.2f} ms)")
            ax.axhline(mean_ms, color=color, ls="--", lw=1)
        ax.set_xlabel("query")
        ax.set_ylabel("fetch latency (ms)")
        ax.set_title(f"{name}: session, cache {human_bytes(s.cache_bytes)}")
        ax.legend(fontsize=8, loc="upper right")
    _save(fig, path)


def _plot_sweep(results: Sequence[ProfileResults], path: Path) -> None:
    from matplotlib.figure import Figure

    rs = [r for r in results if r.sweep]
    fig = Figure(figsize=(5 * len(rs), 4.5), layout="constrained")
    axes = fig.subplots(1, len(rs), squeeze=False)[0]
    for ax, r in zip(axes, rs):
        x = [row["fetch_params"] for row in r.sweep]
        ax.vlines(x, [row["hierarchical_s"] * 1e3 for row in r.sweep], [row["flat_s"] * 1e3 for row in r.sweep],
                  color="#BBBBBB", lw=1, zorder=0)
        ax.scatter(x, [row["hierarchical_s"] * 1e3 for row in r.sweep], marker="o", color="#4C72B0",
                   label="hierarchical")
        ax.scatter(x, [row["flat_s"] * 1e3 for row in r.sweep], marker="s", color="#C44E52", label="flat")
        for row in r.sweep:
            ax.annotate(f"({row['config']})", (row["fetch_params"], row["hierarchical_s"] * 1e3), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("fetched parameters")
        ax.set_ylabel("single fetch latency (ms)")
        ax.set_title(f"{r.profile.name}: sweep")
        ax.legend(fontsize=8)
    _save(fig, path)


def write_report(results: Sequence[ProfileResults], out_dir: str | Path, *,
                 meta: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Write results.json, report.md and PNGs (fetch; session and sweep when present) → {name: path}."""
    if not results:
        raise ValueError("write_report: no results")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "table": out / "report.md", "fetch_png": out / "fetch.png"}
    atomic_write_json(paths["json"], {"meta": dict(meta or {}), "results": [r.to_dict() for r in results]})
    atomic_write_text(paths["table"], format_table(results) + "\n")
    _plot_fetch(results, paths["fetch_png"])
    if any(r.session is not None for r in results):
        paths["session_png"] = out / "session.png"
        _plot_session(results, paths["session_png"])
    if any(r.sweep for r in results):
        paths["sweep_png"] = out / "sweep.png"
        _plot_sweep(results, paths["sweep_png"])
    return paths


# ---------------------------------------------------------------------------
# CLI (`memtree simulate-fetch`)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", action="append", dest="profiles", metavar="phone|laptop|PATH",
                        help="hardware profile (repeatable; default: phone and laptop)")
    parser.add_argument("--anchor", default="openlm-160m", help="anchor preset (default openlm-160m)")
    parser.add_argument("--memory", default="256,64,16,0", help="multipliers per level (default 256,64,16,0)")
    parser.add_argument("--type", default="ffn", choices=MEMORY_TYPES, help="memory type (default ffn)")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES, help="storage dtype (default bf16)")
    parser.add_argument("--policy", default="hierarchical", choices=("hierarchical", "flat"),
                        help="placement of the hierarchical bank's levels (default hierarchical)")
    parser.add_argument("--pin-tier", metavar="TIER",
                        help="store both banks on this one tier, e.g. disk (Fig. 5 right); overrides --policy")
    parser.add_argument("--branching", type=int, default=16, help="tree branching (default 16)")
    parser.add_argument("--trace", default="zipf", metavar="zipf|PATH.npy|PATH.jsonl",
                        help="query trace: synthetic Zipf sessions (default) or a file of cluster paths")
    parser.add_argument("--queries-file", help="real queries, one per line (needs --tree); overrides --trace")
    parser.add_argument("--tree", help="clustering tree directory to route --queries-file through")
    parser.add_argument("--n-queries", type=int, default=1000, help="queries in a zipf trace (default 1000)")
    parser.add_argument("--cache-gb", type=float, help="session cache budget (default: the profile's cache_gb)")
    parser.add_argument("--count-cache-copy", action="store_true",
                        help="charge cache hits a copy at the fastest tier's bandwidth")
    parser.add_argument("--sweep", help='memory configs to compare, e.g. "256,64,16,0;0,16,4,1;5376,0,0,0"')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/simulate-fetch", help="output directory (default runs/simulate-fetch)")


def _cli_trace(args: argparse.Namespace, levels: int) -> tuple[np.ndarray, str]:
    if args.queries_file:
        if not args.tree:
            raise ValueError("--queries-file needs --tree (the clustering tree to route the queries through)")
        qf = Path(args.queries_file)
        if not qf.is_file():
            raise FileNotFoundError(f"queries file not found: {qf}")
        texts = [line.strip() for line in qf.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not texts:
            raise ValueError(f"{qf}: no queries (one per line)")
        return trace_from_texts(args.tree, texts), f"queries:{qf}"
    if args.tree:
        raise ValueError("--tree is only used with --queries-file")
    if args.trace == "zipf":
        return zipf_trace(args.n_queries, args.branching, levels, seed=args.seed), "zipf"
    return load_trace(args.trace), f"file:{args.trace}"


def run_simulate(args: argparse.Namespace) -> int:
    profiles = [load_profile(name) for name in (args.profiles or ["phone", "laptop"])]
    mult = parse_multipliers(args.memory)
    p = make_plan(args.anchor, mult, type=args.type, branching=args.branching)
    trace, trace_kind = _cli_trace(args, p.memory.n_levels)
    cache_bytes = None if args.cache_gb is None else round(args.cache_gb * 1e9)
    configs = [parse_multipliers(c) for c in args.sweep.split(";") if c.strip()] if args.sweep else []
    placement: Policy = pinned(p, args.pin_tier) if args.pin_tier else args.policy
    results = []
    for prof in profiles:
        rows: list[dict[str, Any]] = []
        if configs:
            # A zipf trace is redrawn per config so configs of other depths can be swept too.
            rows = sweep(args.anchor, configs, prof, type=args.type, dtype=args.dtype, policy=args.policy,
                         pin_tier=args.pin_tier, branching=args.branching,
                         trace=None if trace_kind == "zipf" else trace, n_queries=args.n_queries, seed=args.seed,
                         cache_bytes=cache_bytes, count_cache_copy=args.count_cache_copy)
        results.append(ProfileResults(
            profile=prof, fetch=simulate_fetch(p, prof, args.dtype, placement, flat_tier=args.pin_tier),
            session=simulate_session(p, prof, trace, args.dtype, cache_bytes, policy=placement,
                                     flat_tier=args.pin_tier, count_cache_copy=args.count_cache_copy),
            sweep=tuple(rows)))
    meta = {"anchor": args.anchor, "memory": list(mult), "type": args.type, "dtype": args.dtype,
            "policy": args.policy, "pin_tier": args.pin_tier, "branching": args.branching, "trace": trace_kind,
            "n_queries": int(trace.shape[0]), "seed": args.seed, "count_cache_copy": args.count_cache_copy,
            "plan": p.to_dict()}
    paths = write_report(results, args.out, meta=meta)
    print(format_table(results))
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0
