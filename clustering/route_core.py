"""The greedy routing step, shared by tree construction and routing.

Kept free of the Tree class so that `clustering.tree` (which builds trees by
routing points level by level) and `clustering.route` (which routes with a
finished tree) run literally the same arithmetic: a point reaches the same
cluster at build time, at training time and at query time.
"""

from __future__ import annotations

import numpy as np


def route_step(
    centroids: np.ndarray, valid: np.ndarray, x: np.ndarray, parent: np.ndarray, branching: int
) -> np.ndarray:
    """Nearest valid child (L2) of each point's parent.

    centroids: (B^l, d) level-l centroids; valid: (B^l,) bool; x: (n, d);
    parent: (n,) level-(l-1) ids. Returns (n,) level-l ids.

    Points are grouped by parent so each group is one small GEMM against its
    parent's B children (no (n, B, d) gather). Scores are ||c||² - 2·x·c in
    float64: a point's result does not depend on what else is in the batch.
    """
    n = x.shape[0]
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    order = np.argsort(parent, kind="stable")
    sorted_parent = parent[order]
    starts = np.flatnonzero(np.r_[True, sorted_parent[1:] != sorted_parent[:-1]])
    ends = np.r_[starts[1:], n]
    for s, e in zip(starts, ends):
        p = int(sorted_parent[s])
        lo = p * branching
        c = centroids[lo : lo + branching].astype(np.float64)
        ok = valid[lo : lo + branching]
        if not ok.any():
            raise ValueError(f"routing reached cluster {p} with no valid children (corrupt tree?)")
        rows = order[s:e]
        scores = (c * c).sum(1)[None, :] - 2.0 * (x[rows].astype(np.float64) @ c.T)
        scores[:, ~ok] = np.inf
        out[rows] = lo + np.argmin(scores, axis=1)
    return out
