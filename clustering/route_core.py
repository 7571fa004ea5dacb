"""The greedy routing step, shared by tree construction and routing.

Kept free of the Tree class so that `clustering.tree` (which builds trees by
routing points level by level) and `clustering.route` (which routes with a
finished tree) make literally the same decision: a point reaches the same
cluster at build time, at training time and at query time.

Each point is scored against its parent's B children only. With FAISS
installed, the dot products come from `faiss.fvec_inner_products_by_idx` (one
SIMD dot per (point, child) pair, over OpenMP threads, reading the centroids in
place); without it, points are sorted by parent and each group is one small
GEMM. The two differ only in float32 rounding (~1e-7 here), far below TIE_GAP,
and every near tie is settled in float64, so both return the float64 argmin.
"""

from __future__ import annotations

import functools

import numpy as np

# A float32 score gap below this (scores ||c||² − 2·x·c of unit-scale vectors, d ≤ a few
# thousand: float32 rounding stays under 1e-5) is settled again in float64.
TIE_GAP = 1e-4
# Mean points per parent from which `backend="auto"` scores a group with one GEMM rather than
# FAISS's per-pair dots, when the points are sorted by parent (the GEMMs then take views) or
# the children outgrow CACHE_BYTES. Measured at d = 384, 20,000 points (ms; FAISS / GEMMs):
# sorted, 5.4 / 3.8 at 1,250 per parent; unsorted, 6.1 / 9.1 at 1,250 per parent, whose
# children (384 KB) stay in cache, but 22 / 15 at 78 per parent over 4,096 children (6 MB).
# In a whole route at 65,536 leaves, 48 (GEMMs at 78 sorted points per parent) beat 256.
GEMM_ROWS = 48
# Centroid bytes that stay in cache while points read them in any order (about a core's L2:
# 2 MiB on this project's Sapphire Rapids host); beyond it unsorted points are grouped.
CACHE_BYTES = 1 << 20


@functools.cache
def _faiss():
    """FAISS, imported on first use (not at start-up of every command that imports routing),
    or None: an optional dependency (the cpu/gpu extras); the numpy path gives the same result."""
    try:
        import faiss
    except ImportError:  # pragma: no cover - exercised where FAISS is absent
        return None
    return faiss


def squared_norms(centroids: np.ndarray) -> np.ndarray:
    """(k, d) → (k,) float32 ||c||², the per-centroid term of every routing score."""
    c32 = np.ascontiguousarray(centroids, dtype=np.float32)
    return np.einsum("nd,nd->n", c32, c32)


def route_step(
    centroids: np.ndarray,
    valid: np.ndarray,
    x: np.ndarray,
    parent: np.ndarray,
    branching: int,
    *,
    sq_norms: np.ndarray | None = None,
    backend: str = "auto",
) -> np.ndarray:
    """Nearest valid child (L2) of each point's parent.

    centroids: (B^l, d) level-l centroids; valid: (B^l,) bool; x: (n, d);
    parent: (n,) level-(l-1) ids; sq_norms: (B^l,) `squared_norms(centroids)` when the
    caller keeps them (a Tree does: at 65,536 leaves they cost ~10 ms per call to recompute).
    backend: "auto" (FAISS when installed), "faiss" or "numpy". Returns (n,) level-l ids.

    Every point whose best and second-best float32 scores lie within TIE_GAP is scored again
    in float64, alone: the result is the float64 argmin of ||c||² − 2·x·c, and it depends
    neither on what else is in the batch nor on the backend.
    """
    n = x.shape[0]
    if n == 0:
        return np.empty(0, dtype=np.int64)
    B = branching
    c32 = np.ascontiguousarray(centroids, dtype=np.float32)
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    parent = np.asarray(parent, dtype=np.int64)
    ok = valid.reshape(-1, B)
    used = np.flatnonzero(np.bincount(parent, minlength=len(ok)))
    dead = ~ok[used].any(1)
    if dead.any():
        raise ValueError(f"routing reached cluster {int(used[np.flatnonzero(dead)[0]])} with no valid children "
                         "(corrupt tree?)")
    norms = squared_norms(c32) if sq_norms is None else sq_norms
    # Large groups of points sorted by parent are faster as GEMMs on views; small groups (~5
    # points per parent at the last level of a 65,536-leaf tree) and unsorted points as FAISS's
    # per-pair dots.
    big = n >= GEMM_ROWS * len(used)
    in_cache = len(used) * B * c32.shape[1] * 4 <= CACHE_BYTES
    grouped = big and (not in_cache or bool((parent[1:] >= parent[:-1]).all()))
    use_faiss = backend == "faiss" or (backend == "auto" and not grouped and _faiss() is not None)
    scores = _dots_faiss(c32, x32, parent, B) if use_faiss else _dots_grouped(c32, x32, parent, B)
    scores *= -2.0
    scores += norms.reshape(-1, B)[parent]  # (n, B)
    if not ok.all():
        scores[~ok[parent]] = np.inf
    best = np.argmin(scores, axis=1)
    if B > 1:
        two = np.partition(scores, 1, axis=1)[:, :2]
        close = np.flatnonzero(two[:, 1] - two[:, 0] < TIE_GAP)
        if len(close):
            close = close[np.argsort(parent[close], kind="stable")]
            best[close] = _exact(centroids, valid, x[close], parent[close], B)
    return parent * B + best


def _dots_faiss(c32: np.ndarray, x32: np.ndarray, parent: np.ndarray, B: int) -> np.ndarray:
    """(n, B) float32 x_i · c[parent_i·B + j]. Measured at 65,536 leaves, 20,000 points: 13 ms
    against 31 ms for the grouped GEMMs, whose ~4,096 groups of ~5 rows cost a Python call each."""
    n, d = x32.shape
    ids = np.ascontiguousarray(parent[:, None] * B + np.arange(B)[None, :])  # (n, B) int64
    out = np.empty((n, B), dtype=np.float32)
    faiss = _faiss()
    faiss.fvec_inner_products_by_idx(faiss.swig_ptr(out), faiss.swig_ptr(x32), faiss.swig_ptr(c32),
                                     faiss.swig_ptr(ids), d, n, B)
    return out


def _dots_grouped(c32: np.ndarray, x32: np.ndarray, parent: np.ndarray, B: int) -> np.ndarray:
    """The same dots without FAISS: points sorted by parent, one float32 GEMM per group against
    its parent's B children, read in place (no (n, B, d) gather)."""
    n = x32.shape[0]
    if (parent[1:] >= parent[:-1]).all():  # already grouped (level 1, or presorted points): no copy
        order, sp = None, parent
    else:
        order = np.argsort(parent, kind="stable")
        sp = parent[order]
    starts = np.flatnonzero(np.r_[True, sp[1:] != sp[:-1]])
    ends = np.r_[starts[1:], n]
    dots = np.empty((n, B), dtype=np.float32)
    for s, e, p in zip(starts.tolist(), ends.tolist(), sp[starts].tolist()):
        rows = x32[s:e] if order is None else x32[order[s:e]]
        np.matmul(rows, c32[p * B : p * B + B].T, out=dots[s:e])
    if order is None:
        return dots
    out = np.empty_like(dots)
    out[order] = dots
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
