"""Choosing what to block: the best-matching part of the bank for a set of queries (Fig. 6b).

The paper blocks "the best-matching parts of the memory bank" for the
atomic-number probes and reports the drop at 1/16 of the bank. Here the
queries are routed through the same greedy traversal as training; clusters at
a chosen granularity level are ranked by how many queries land in them, and
whole subtrees are blocked in that order until the requested share of the
bank's parameters is refused. `random_block` is the control: the same share,
subtrees drawn at random.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from memtree.clustering.route import route_texts
from memtree.memstore.store import MemoryStore


def subtree_share(store: MemoryStore, level: int) -> float:
    """Share of the bank's parameters inside one level-`level` subtree (that cluster's
    block and all its descendants; shallower levels are shared and not counted)."""
    B = store.info.memory.branching
    total = sum(L.info.n_blocks * L.info.params for L in store.levels.values())
    inside = sum(L.info.params * B ** (lv - level) for lv, L in store.levels.items() if lv >= level)
    return inside / total


def default_level(store: MemoryStore, fraction: float) -> int:
    """The granularity `level=None` blocks at: the shallowest level that holds memory whose one
    subtree is at most `fraction` of the bank (so the share is met without overshooting it), or
    the deepest memory level when even its subtrees are larger. For the paper's banks at 1/16
    that is level 1 (B = 16); for a bank of levels 2 and 3 with B = 4, level 2."""
    _check_fraction(fraction)
    levels = sorted(store.levels)
    return next((lv for lv in levels if subtree_share(store, lv) <= fraction + 1e-9), levels[-1])


def _check_fraction(fraction: float) -> None:
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")


def _check_level(store: MemoryStore, level: int | None, fraction: float) -> int:
    if level is None:
        return default_level(store, fraction)
    if level not in store.levels:
        raise ValueError(
            f"level {level} holds no memory in {store.root} (levels that do: "
            f"{', '.join(map(str, sorted(store.levels)))}); block at one of those, or leave the "
            "level out to derive it from the fraction"
        )
    return level


def _n_subtrees(store: MemoryStore, level: int, fraction: float) -> int:
    _check_fraction(fraction)
    share = subtree_share(store, level)
    # smallest count whose share reaches the fraction (tolerant of float rounding: 16 × 1/16 ==
    # 1/16·16)
    return max(1, int(np.ceil(fraction / share - 1e-9)))


def rank_clusters(paths: np.ndarray, level: int) -> list[tuple[int, int]]:
    """(cluster, queries) at `level`, most queries first; ties by cluster id."""
    ids, counts = np.unique(np.asarray(paths)[:, level - 1], return_counts=True)
    order = sorted(zip(ids.tolist(), counts.tolist(), strict=True), key=lambda t: (-t[1], t[0]))
    return [(int(c), int(n)) for c, n in order]


def adversarial_block(
    store: MemoryStore,
    *,
    paths: np.ndarray | None = None,
    texts: Sequence[str] | None = None,
    tree: Any | None = None,
    fraction: float = 1 / 16,
    level: int | None = None,
    reason: str = "adversarial blocking",
    persist: bool = True,
) -> dict[str, Any]:
    """Block the subtrees the queries route to most, up to `fraction` of the bank.

    Give query `paths` (n, L) directly, or `texts` with the `tree` to route them.
    `level=None` picks the granularity from the fraction (`default_level`). Returns what was
    blocked, the share of the bank refused, and how many of the queries now hit a blocked path.
    No query at all is an error: there is nothing to rank the subtrees by.
    """
    if paths is None:
        if texts is None or tree is None:
            raise ValueError(
                "adversarial_block: give paths, or texts together with the tree to route them"
            )
        if not len(texts):
            raise ValueError(
                "adversarial_block: no query texts to route; nothing to choose the blocks by"
            )
        paths = route_texts(tree, list(texts))
    paths = np.asarray(paths, dtype=np.int64)
    if paths.ndim != 2 or not len(paths):
        raise ValueError(
            "adversarial_block: expected a non-empty (n, levels) array of query paths, got shape "
            f"{paths.shape}; nothing to choose the blocks by"
        )
    level = _check_level(store, level, fraction)
    n = _n_subtrees(store, level, fraction)
    ranked = rank_clusters(paths, level)
    chosen = [c for c, _ in ranked[:n]]
    if len(chosen) < n:  # the queries touch fewer subtrees than the budget allows: fill by id
        B = store.info.memory.branching
        rest = [c for c in range(B**level) if c not in set(chosen)]
        chosen += rest[: n - len(chosen)]
    return _block_report(store, paths, level, chosen, reason, persist)


def random_block(
    store: MemoryStore,
    *,
    fraction: float = 1 / 16,
    level: int | None = None,
    seed: int = 0,
    paths: np.ndarray | None = None,
    reason: str = "random blocking (control)",
    persist: bool = True,
    exclude: Sequence[int] = (),
) -> dict[str, Any]:
    """Control for `adversarial_block`: the same share of the bank, subtrees drawn at random
    among those not in `exclude` (e.g. the adversarial choice, so the control never repeats it).
    `level=None` picks the granularity from the fraction (`default_level`)."""
    level = _check_level(store, level, fraction)
    n = _n_subtrees(store, level, fraction)
    B = store.info.memory.branching
    pool = np.setdiff1d(np.arange(B**level), np.asarray(list(exclude), dtype=np.int64))
    if len(pool) < n:
        raise ValueError(
            f"random_block: {n} subtrees to draw at level "
            f"{level} but only {len(pool)} are not excluded"
        )
    chosen = sorted(np.random.default_rng(seed).choice(pool, size=n, replace=False).tolist())
    return _block_report(
        store, None if paths is None else np.asarray(paths), level, chosen, reason, persist
    )


def _block_report(
    store: MemoryStore,
    paths: np.ndarray | None,
    level: int,
    chosen: list[int],
    reason: str,
    persist: bool,
) -> dict[str, Any]:
    counts = store.block(level, chosen, subtree=True, reason=reason, persist=persist)
    report: dict[str, Any] = {
        "level": level,
        "clusters": chosen,
        "subtree": True,
        "blocks": {str(lv): n for lv, n in sorted(counts.items())},
        "bank_fraction_blocked": store.blocked_fraction(),
    }
    if paths is not None and len(paths):
        hit = np.isin(paths[:, level - 1], chosen)
        report["queries"] = len(paths)
        report["queries_blocked"] = int(hit.sum())
    return report
