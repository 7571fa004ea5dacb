"""Hardware profiles for the fetch-latency simulator: storage tiers and their costs.

A profile is a device: its storage tiers fastest first (RAM, flash, external
disk), each with a sustained bandwidth, a time to first byte and a capacity, and
the RAM budget of the session cache. Profiles are versioned YAML files (format
`memtree-hw-profile`, version 1) loaded through `memtree.config`, so unknown keys
are errors that name the key. The shipped ones (datasheet figures, each number's
source beside it) are memstore's YAMLs, `memstore/yamls/profiles/*.yaml`;
`memstore.sim.calibrate` measures one for this machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from memtree.config import ConfigError, load_config
from memtree.memstore.placement import TierBudget

PROFILE_FORMAT = "memtree-hw-profile"
PROFILE_VERSION = 1
PROFILES_DIR = Path(__file__).parents[1] / "yamls" / "profiles"


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
            raise ValueError(
                f"tier {self.name!r}: bandwidth_gbps must be positive, got {self.bandwidth_gbps}"
            )
        if not (math.isfinite(self.latency_us) and self.latency_us >= 0):
            raise ValueError(
                f"tier {self.name!r}: latency_us must be non-negative, got {self.latency_us}"
            )
        if self.capacity_gb is not None and not self.capacity_gb >= 0:
            raise ValueError(
                f"tier {self.name!r}: capacity_gb must be "
                f"non-negative or null, got {self.capacity_gb}"
            )

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
            raise ValueError(
                f"profile {self.name!r}: tensor_us must be non-negative, got {self.tensor_us}"
            )
        if self.format != PROFILE_FORMAT:
            raise ValueError(f"format {self.format!r} is not {PROFILE_FORMAT!r}")
        if self.version != PROFILE_VERSION:
            raise ValueError(
                f"profile version {self.version} is not "
                f"supported (this memtree reads {PROFILE_VERSION})"
            )
        if not self.tiers:
            raise ValueError(f"profile {self.name!r}: needs at least one tier")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"profile {self.name!r}: tier names must be unique, got {names}")
        if not (math.isfinite(self.cache_gb) and self.cache_gb >= 0):
            raise ValueError(
                f"profile {self.name!r}: cache_gb must be non-negative, got {self.cache_gb}"
            )

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
        raise ConfigError(
            f"unknown hardware profile {str(name_or_path)!r}; shipped: {shipped_profiles()} (or "
            "give a path to a profile YAML)"
        )
    return load_config(HardwareProfile, p)
