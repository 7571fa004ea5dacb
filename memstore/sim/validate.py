"""Check the fetch simulator against real fetches: `validate` a calibrated profile.

`validate` writes a realistic multi-level bank, fetches random root-to-leaf paths from it through
`MemoryStore` with cold reads (cache 0, O_DIRECT or DONTNEED, as `memstore.sim.calibrate.measure`
reads) and compares the measured latency with `simulate_fetch` on the profile, whole paths and
level by level (`Validation`); `format_validation` prints it. `memstore.sim.calibrate`
re-exports both, as callers import them from there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from memtree.geometry import (
    AnchorShape,
    human_bytes,
    stored_bytes,
)
from memtree.geometry import plan as make_plan
from memtree.memstore.format import level_path, read_manifest
from memtree.memstore.locking import remove_bank
from memtree.memstore.merge import relocate_level
from memtree.memstore.sim.latency import Policy, level_placement, memory_levels, simulate_fetch
from memtree.memstore.sim.profiles import (
    HardwareProfile,
    load_profile,
)
from memtree.memstore.sim.timing import Cold, drop_cache, random_init, store_tiers, tier_kind
from memtree.memstore.store import MemoryStore
from memtree.memstore.writer import write_bank

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
    unflatten_mean_s: (
        float  # sum over levels of codec.unflatten (views of the flat block per tensor)
    )
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


def _fast_levels_profile(
    profile: HardwareProfile, level_bytes: Sequence[int], fast_levels: int
) -> HardwareProfile:
    """The profile with its fastest tier's capacity cut to hold exactly the first fast_levels
    levels."""
    if len(profile.tiers) < 2:
        return profile
    cap = sum(level_bytes[:fast_levels])
    t0 = replace(
        profile.tiers[0], capacity_gb=(cap + 0.5) / 1e9
    )  # rounds back to cap or cap + 1 bytes
    return replace(profile, tiers=(t0, *profile.tiers[1:]))


def _time_path_fetches(
    store: MemoryStore,
    cold: Cold,
    levels: Sequence[int],
    branching: int,
    n_levels: int,
    rng: np.random.Generator,
    warmup: int,
    n_fetches: int,
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
        sim = simulate_fetch(
            p,
            replace(prof, tiers=tuple(replace(t, capacity_gb=None) for t in prof.tiers)),
            dtype,
            mapping,
        )
    if any(tier_kind(t) == "disk" for t in mapping.values()) and disk_dir is None:
        raise ValueError(f"placement {mapping} puts a level on the disk tier; give disk_dir")
    workdir = Path(workdir)
    root = workdir / "validate-bank"
    rng = np.random.default_rng(seed)
    try:
        write_bank(
            root,
            anchor=p.anchor,
            memory=p.memory,
            dtype=dtype,
            init=random_init(seed),
            extra={"purpose": "memtree memstore calibrate --validate"},
        )
        for lv, t in mapping.items():
            if tier_kind(t) == "disk":
                relocate_level(root, lv, str(disk_dir))
        info = read_manifest(root)
        for lv in info.levels.values():
            drop_cache(level_path(root, lv))
        used = [t.name for t in prof.tiers if t.name in set(mapping.values())]
        with MemoryStore(
            root, tiers=store_tiers(used, direct), placement=mapping, verify=verify
        ) as store:
            cold = Cold(store, direct)
            whole, per_level, unflat = _time_path_fetches(
                store,
                cold,
                [lv.level for lv in levels],
                branching,
                p.memory.n_levels,
                rng,
                warmup,
                n_fetches,
            )
            methods = dict(cold.methods)
            p_codecs = {lv.level: store.codec(lv.level) for lv in levels}
    finally:
        if not keep:
            remove_bank(root)
    rows = []
    for lf in sim.levels:
        m = np.asarray(per_level[lf.level])
        rows.append(
            {
                "level": lf.level,
                "tier": lf.tier,
                "block_bytes": lf.block_bytes,
                "bank_bytes": lf.bank_bytes,
                "simulated_s": lf.seconds,
                "measured_mean_s": float(m.mean()),
                "measured_median_s": float(np.median(m)),
                "ratio": lf.seconds / float(m.mean()),
                "n_tensors": len(p_codecs[lf.level].layout),
                "unflatten_mean_s": float(np.mean(unflat[lf.level])),
            }
        )
    w = np.asarray(whole)
    return Validation(
        profile=prof.name,
        anchor=p.anchor.name,
        multipliers=tuple(p.memory.multipliers),
        branching=branching,
        dtype=dtype,
        verify=verify,
        placement=dict(mapping),
        methods=methods,
        n_fetches=n_fetches,
        fetch_bytes=sim.fetch_bytes,
        simulated_s=sim.seconds,
        measured_mean_s=float(w.mean()),
        measured_median_s=float(np.median(w)),
        measured_flat_mean_s=float(sum(r["measured_mean_s"] for r in rows)),
        unflatten_mean_s=float(sum(r["unflatten_mean_s"] for r in rows)),
        levels=tuple(rows),
    )


def format_validation(v: Validation) -> str:
    """Simulated vs measured latency per level and per path, as `calibrate --validate` prints
    them."""
    head = (
        f"validate: {v.anchor} memory ({','.join(map(str, v.multipliers))}) branching "
        f"{v.branching} {v.dtype}, {v.n_fetches} cold path fetches "
        f"of {human_bytes(v.fetch_bytes)} (verify={v.verify})"
    )
    lines = [head]
    for r in v.levels:
        lines.append(
            f"  L{r['level']} on {r['tier']:<6} {human_bytes(r['block_bytes']):>9}: simulated "
            f"{r['simulated_s'] * 1e3:8.3f} ms, measured mean {r['measured_mean_s'] * 1e3:8.3f} ms "
            f"(median {r['measured_median_s'] * 1e3:.3f}), ratio {r['ratio']:.2f}; unflatten into "
            f"{r['n_tensors']} tensors {r['unflatten_mean_s'] * 1e3:.3f} ms"
        )
    lines.append(
        f"  path: simulated {v.simulated_s * 1e3:.3f} ms, measured store.fetch mean "
        f"{v.measured_mean_s * 1e3:.3f} ms (median {v.measured_median_s * 1e3:.3f}); "
        f"simulated/measured = {v.ratio:.3f}; vs the sum of per-level fetch_flat "
        f"{v.measured_flat_mean_s * 1e3:.3f} ms: {v.ratio_flat:.3f} (fetch also unflattens each "
        f"block into its tensors: {v.unflatten_mean_s * 1e3:.3f} ms, not in the simulator's model)"
    )
    return "\n".join(lines)
