"""The greedy routing step, shared by tree construction and routing.

Kept free of the Tree class so that `clustering.tree` (which builds trees by
routing points level by level) and `clustering.route` (which routes with a
finished tree) make literally the same decision: a point reaches the same
cluster at build time, at training time and at query time.

Each point is scored against its parent's B children only. With FAISS
installed, the dot products come from `faiss.fvec_inner_products_by_idx` (one
SIMD dot per (point, child) pair, over OpenMP threads, reading the centroids in
place; `pairwise_indexed_inner_product` when the caller passes the points'
order as row indices); otherwise, or for large groups of points in a tree build,
points are sorted by parent and each group is one small GEMM. The two differ
only in float32 rounding (~1e-7 here), far below TIE_GAP, and every near tie is
settled in float64, so both return the float64 argmin.
"""

from __future__ import annotations

import functools

import numpy as np

from memtree.clustering import gemm

# A float32 score gap below this (scores ||c||² − 2·x·c of unit-scale vectors, d ≤ a few
# thousand: float32 rounding stays under 1e-5) is settled again in float64.
TIE_GAP = 1e-4
# Mean points per parent from which `backend="auto"` scores a group with one GEMM rather than
# FAISS's per-pair dots, when the points are sorted by parent (the GEMMs then take views) or
# the children outgrow CACHE_BYTES. Measured at d = 384, 20,000 points (ms; FAISS / GEMMs):
# sorted, 5.4 / 3.8 at 1,250 per parent; unsorted, 6.1 / 9.1 at 1,250 per parent, whose
# children (384 KB) stay in cache, but 22 / 15 at 78 per parent over 4,096 children (6 MB).
# This serves one-off steps (tree builds); `clustering.route.route` runs FAISS at every level
# instead: numpy's OpenBLAS workers spin after each multithreaded GEMM and take the core that
# FAISS's OpenMP threads need next (a whole route at 65,536 leaves, 20,000 points, 2 cores:
# 62 ms mixed, 38 ms FAISS only, 39 ms mixed with numpy's BLAS on one thread).
GEMM_ROWS = 48
# Centroid bytes that stay in cache while points read them in any order (about a core's L2:
# 2 MiB on this project's Sapphire Rapids host); beyond it unsorted points are grouped.
CACHE_BYTES = 1 << 20


def faiss_installed() -> bool:
    """Whether `backend="faiss"` can run here (FAISS is an optional extra)."""
    return _faiss() is not None


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
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """Nearest valid child (L2) of each point's parent.

    centroids: (B^l, d) level-l centroids; valid: (B^l,) bool; x: (N, d); rows: (n,) int64
    indices into x of the points to route, in this order (None: all N, n = N), so that a caller
    can visit points sorted by parent without copying their rows; parent: (n,) level-(l-1) ids
    of those points; sq_norms: (B^l,) `squared_norms(centroids)` when the caller keeps them (a
    Tree does: at 65,536 leaves they cost ~10 ms per call to recompute).
    backend: "auto" (FAISS when installed), "faiss" or "numpy". Returns (n,) level-l ids.

    Every point whose best and second-best float32 scores lie within TIE_GAP is scored again
    in float64, alone: the result is the float64 argmin of ||c||² − 2·x·c, and it depends
    neither on what else is in the batch nor on the backend.
    """
    parent = np.asarray(parent, dtype=np.int64)
    n = len(parent)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    B = branching
    c32 = np.ascontiguousarray(centroids, dtype=np.float32)
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    ok = valid.reshape(-1, B)
    used = np.flatnonzero(np.bincount(parent, minlength=len(ok)))
    dead = ~ok[used].any(1)
    if dead.any():
        raise ValueError(
            f"routing reached cluster {int(used[np.flatnonzero(dead)[0]])} with no valid children "
            "(corrupt tree?)"
        )
    norms = squared_norms(c32) if sq_norms is None else sq_norms
    # Large groups of points sorted by parent are faster as GEMMs on views; small groups (~5
    # points per parent at the last level of a 65,536-leaf tree) and unsorted points as FAISS's
    # per-pair dots.
    big = n >= GEMM_ROWS * len(used)
    in_cache = len(used) * B * c32.shape[1] * 4 <= CACHE_BYTES
    grouped = big and (not in_cache or bool((parent[1:] >= parent[:-1]).all()))
    use_faiss = backend == "faiss" or (backend == "auto" and not grouped and _faiss() is not None)
    if use_faiss:
        scores = _dots_faiss(c32, x32, parent, B, rows)
    else:
        scores = _dots_grouped(c32, x32 if rows is None else x32[rows], parent, B)
    scores *= -2.0
    scores += norms.reshape(-1, B)[parent]  # (n, B)
    if not ok.all():
        scores[~ok[parent]] = np.inf
    best, first, second = _best_two(scores)
    if B > 1:
        close = np.flatnonzero(second - first < TIE_GAP)
        if len(close):
            close = close[np.argsort(parent[close], kind="stable")]
            best[close] = _exact(
                centroids, valid, x[close if rows is None else rows[close]], parent[close], B
            )
    return parent * B + best


def _best_two(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, B) → (n,) argmin (the first on equality, as np.argmin), the min, and the least of the
    other B − 1 scores (inf when B = 1). Column by column on the (B, n) transpose: numpy's
    reductions along a short last axis are slow (at (20,000, 16): 1.1 ms against 1.8 for
    argmin + masking the best + min, and 2.0 for argmin + np.partition)."""
    st = np.ascontiguousarray(scores.T)  # (B, n)
    first, second = st[0].copy(), np.full(st.shape[1], np.inf, dtype=st.dtype)
    best = np.zeros(st.shape[1], dtype=np.int64)
    hi, lower = np.empty_like(first), np.empty(st.shape[1], dtype=bool)
    for j in range(1, len(st)):
        np.maximum(first, st[j], out=hi)
        np.minimum(second, hi, out=second)
        np.less(st[j], first, out=lower)
        np.copyto(best, j, where=lower)
        np.minimum(first, st[j], out=first)
    return best, first, second


def _dots_faiss(
    c32: np.ndarray, x32: np.ndarray, parent: np.ndarray, B: int, rows: np.ndarray | None = None
) -> np.ndarray:
    """(n, B) float32 x[rows_i] · c[parent_i·B + j] (rows None: x_i). Measured at 65,536 leaves,
    20,000 points: 13 ms against 31 ms for the grouped GEMMs, whose ~4,096 groups of ~5 rows cost
    a Python call each. With rows, the pairs are visited in rows' order without copying x: at the
    leaves, points sorted by parent, 9.7 ms against 14.7 ms to gather their 30 MB first (AMD
    EPYC)."""
    n, d = len(parent), x32.shape[1]
    ids = np.ascontiguousarray(parent[:, None] * B + np.arange(B)[None, :])  # (n, B) int64
    out = np.empty((n, B), dtype=np.float32)
    faiss = _faiss()
    if rows is not None:
        ix = np.repeat(np.asarray(rows, dtype=np.int64), B)  # (n·B,) the row of each pair
        faiss.pairwise_indexed_inner_product(
            d,
            n * B,
            faiss.swig_ptr(x32),
            faiss.swig_ptr(ix),
            faiss.swig_ptr(c32),
            faiss.swig_ptr(ids),
            faiss.swig_ptr(out),
        )
        return out
    faiss.fvec_inner_products_by_idx(
        faiss.swig_ptr(out), faiss.swig_ptr(x32), faiss.swig_ptr(c32), faiss.swig_ptr(ids), d, n, B
    )
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
        gemm.matmul(rows, c32[p * B : p * B + B].T, dots[s:e])
    if order is None:
        return dots
    out = np.empty_like(dots)
    out[order] = dots
    return out


def _exact(
    centroids: np.ndarray, valid: np.ndarray, x: np.ndarray, parent: np.ndarray, B: int
) -> np.ndarray:
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
