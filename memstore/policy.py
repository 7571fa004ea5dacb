"""The blocking policy: which blocks a store refuses, and what it serves instead.

`policy.json` (format `memtree-bank-policy` v1) holds the bank's fallback ("zeros" = no memory,
or "generic" = the generic memory) and its blocked blocks as {level: [[start, stop)…]} runs of
global cluster ids. A store refuses a block that is blocked there or deleted in the manifest
(`refused_mask`), before any tier is touched.

`BlockPolicy` is one open store's view: the file as on disk (`disk`), this store's session-only
changes on top (`persist=False` blocks and unblocks, an experiment's fallback; kept over reloads
of the file, never written to it), and the two combined (`effective`), which is what the store
honours.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from memtree.io import atomic_write_json, check_format, read_json
from memtree.memstore.format import GENERIC, BankError, LevelInfo

POLICY_FORMAT = "memtree-bank-policy"
Fallback = Literal["zeros", "generic"]


def id_runs(ids: Iterable[int]) -> list[list[int]]:
    """Sorted ids → [[start, stop), …] runs, for compact policy files and audit entries."""
    out: list[list[int]] = []
    for i in sorted({int(x) for x in ids}):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def read_policy(root: Path) -> dict[str, Any]:
    path = root / "policy.json"
    if not path.exists():
        return {"format": POLICY_FORMAT, "version": 1, "fallback": "zeros", "blocked": {}}
    p = read_json(path)
    check_format(p, POLICY_FORMAT, 1, path, error=BankError)
    if p.get("fallback") not in ("zeros", "generic"):
        raise BankError(f"{path}: fallback {p.get('fallback')!r} is not 'zeros' or 'generic'")
    return p


def apply_blocked(
    policy: dict[str, Any], action: str, targets: Mapping[int, Sequence[int]]
) -> None:
    """Block (`action` "block") or lift (any other) `targets` {level: ids} in `policy`, in place."""
    for lv, ids in targets.items():
        cur = {i for a, b in policy["blocked"].get(str(lv), []) for i in range(a, b)}
        cur = cur | set(ids) if action == "block" else cur - set(ids)
        policy["blocked"][str(lv)] = id_runs(cur)


def refused_mask(
    lv: LevelInfo, policy: Mapping[str, Any], deleted: Mapping[str, Any]
) -> np.ndarray:
    """(n_blocks,) bool: the slots of level `lv` that `policy` blocks or the manifest's `deleted`
    runs erased."""
    mask = np.zeros(lv.n_blocks, dtype=bool)
    for source in (policy["blocked"], deleted):
        for start, stop in source.get(str(lv.level), []):
            lo, hi = max(start - lv.first_cluster, 0), min(stop - lv.first_cluster, lv.n_blocks)
            if lo < hi:
                mask[lo:hi] = True
    return mask


def expand_targets(
    levels: Mapping[int, LevelInfo],
    branching: int,
    level: int,
    clusters: Sequence[int],
    subtree: bool,
) -> dict[int, list[int]]:
    """{level: sorted ids} a block / unblock / delete of `clusters` at `level` covers; with
    `subtree`, every deeper level of `levels` too. The generic memory and ids the level lacks are
    refused."""
    for c in clusters:
        if int(c) == GENERIC:
            raise ValueError(f"level {level}: the generic memory cannot be blocked or deleted")
        levels[level].slot(int(c))  # validates the id
    out = {level: sorted({int(c) for c in clusters})}
    if subtree:
        for deeper in sorted(x for x in levels if x > level):
            span = branching ** (deeper - level)
            out[deeper] = [c * span + j for c in out[level] for j in range(span)]
    return out


def check_fallback_name(fallback: str) -> None:
    if fallback not in ("zeros", "generic"):
        raise ValueError(f"fallback: {fallback!r} is not 'zeros' or 'generic'")


class BlockPolicy:
    """policy.json of the bank at `root` as on disk, and this store's session-only changes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # persist=False (un)blocks and experiment fallbacks, in order: kept over reloads
        self.session: list[tuple[str, Any]] = []
        self.disk: dict[str, Any] = {}
        self.effective: dict[str, Any] = {}

    def load(self) -> None:
        """(Re)read policy.json and recombine it with the session's changes."""
        self.disk = read_policy(self.root)
        self.combine()

    def combine(self) -> None:
        """effective = the bank's policy.json + this store's session-only changes, in order."""
        self.effective = copy.deepcopy(self.disk)
        for action, arg in self.session:
            if action == "fallback":
                self.effective["fallback"] = arg
            else:
                apply_blocked(self.effective, action, arg)

    def save(self) -> None:
        """Write `disk` to policy.json (the session's changes stay out of the file); the caller
        holds the locks that publish it."""
        atomic_write_json(self.root / "policy.json", self.disk)

    def session_entries(self) -> list[dict[str, Any]]:
        """The session's blocks and unblocks shaped as audit entries (`blocked_as_subtree` reads
        them as it reads the audit log)."""
        return [
            {"action": a, "targets": {str(k): id_runs(v) for k, v in t.items()}}
            for a, t in self.session
            if a != "fallback"
        ]

    @property
    def fallback(self) -> Fallback:
        return self.effective["fallback"]
