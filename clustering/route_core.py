"""The greedy routing step, shared by tree construction and routing.

Kept free of the Tree class so that `clustering.tree` (which builds trees by
routing points level by level) and `clustering.route` (which routes with a
finished tree) run literally the same arithmetic: a point reaches the same
cluster at build time, at training time and at query time.
"""

from __future__ import annotations

import numpy as np

# A float32 score gap below this (scores ||c||² − 2·x·c of unit-scale vectors, d ≤ a few
# thousand: float32 rounding stays under 1e-5) is settled again in float64.
TIE_GAP = 1e-4


def route_step(
    centroids: np.ndarray, valid: np.ndarray, x: np.ndarray, parent: np.ndarray, branching: int
) -> np.ndarray:
    """Nearest valid child (L2) of each point's parent.

    centroids: (B^l, d) level-l centroids; valid: (B^l,) bool; x: (n, d);
    parent: (n,) level-(l-1) ids. Returns (n,) level-l ids.

    Points are sorted by parent so each group is one small float32 GEMM against its parent's B
    children, read in place (no (n, B, d) gather, no float64 copy of the centroids). Every
    point whose best and second-best float32 scores lie within TIE_GAP is scored again in
    float64, alone: the result is the float64 argmin of ||c||² − 2·x·c, and it does not depend
    on what else is in the batch.
    """
    n = x.shape[0]
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    B = branching
    c32 = np.ascontiguousarray(centroids, dtype=np.float32)
    order = np.argsort(parent, kind="stable")
    sorted_parent = parent[order]
    xs = np.ascontiguousarray(x[order], dtype=np.float32)
    starts = np.flatnonzero(np.r_[True, sorted_parent[1:] != sorted_parent[:-1]])
    ends = np.r_[starts[1:], n]
    used = sorted_parent[starts]
    norms = np.einsum("nd,nd->n", c32, c32).reshape(-1, B)[used]  # (groups, B)
    ok = valid.reshape(-1, B)[used]  # (groups, B)
    dead = ~ok.any(1)
    if dead.any():
        raise ValueError(f"routing reached cluster {int(used[np.flatnonzero(dead)[0]])} with no valid children "
                         "(corrupt tree?)")
    dots = np.empty((n, B), dtype=np.float32)
    for s, e, p in zip(starts.tolist(), ends.tolist(), used.tolist()):  # one call per group: its cost is the loop's
        np.matmul(xs[s:e], c32[p * B : p * B + B].T, out=dots[s:e])
    group_of = np.repeat(np.arange(len(used)), ends - starts)
    scores = norms[group_of] - 2.0 * dots  # (n, B)
    if not ok.all():
        scores[~ok[group_of]] = np.inf
    best = np.argmin(scores, axis=1)
    two = np.partition(scores, 1, axis=1)[:, :2] if B > 1 else None
    if two is not None:
        close = np.flatnonzero(two[:, 1] - two[:, 0] < TIE_GAP)
        if len(close):
            best[close] = _exact(centroids, valid, x[order[close]], sorted_parent[close], B)
    out[order] = sorted_parent * B + best
    return out


def _exact(centroids: np.ndarray, valid: np.ndarray, x: np.ndarray, parent: np.ndarray, B: int) -> np.ndarray:
    """Float64 argmin of ||c||² − 2·x·c among each row's parent's valid children: (k, d), (k,)
    → (k,) child offsets in [0, B). Rows arrive sorted by parent; each parent's B centroids are
    cast once and scored against its rows in one GEMM. (Gathering B centroids per row instead
    moves k·B·d float64 values: on the synthetic built 4 × 16 tree, where many held-out points
    sit near a cell boundary, routing ran at 84,562 points/s that way, 216,657 this way.)"""
    out = np.empty(len(parent), dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, parent[1:] != parent[:-1]])
    ends = np.r_[starts[1:], len(parent)]
    for s, e in zip(starts.tolist(), ends.tolist()):
        lo = int(parent[s]) * B
        c = centroids[lo : lo + B].astype(np.float64)  # (B, d)
        sc = (c * c).sum(1)[None, :] - 2.0 * (x[s:e].astype(np.float64) @ c.T)  # (rows, B)
        sc[:, ~valid[lo : lo + B]] = np.inf
        out[s:e] = np.argmin(sc, axis=1)
    return out
