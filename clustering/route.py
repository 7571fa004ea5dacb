"""Greedy root-to-leaf routing: embeddings or texts → cluster paths.

`route` is the one function that turns an embedding into a path; the
pipeline's assign stage, the trainer's data and every query-time lookup go
through it, so identical text always fetches identical memories. Cost is
levels × branching distance computations per point (vs. B^L for an
exhaustive nearest-leaf search).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memtree.clustering.embed import embed_texts, embedder_from_meta
from memtree.clustering.route_core import CACHE_BYTES, faiss_installed, route_step
from memtree.clustering.tree import Tree


def route(tree: Tree, x: np.ndarray, *, batch_size: int = 262144) -> np.ndarray:
    """Paths of the rows of x (n, dim) → (n, levels) int64 global cluster ids per level.

    Column l-1 is the level-l cluster id in [0, B^l); the last column is the leaf id.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != tree.dim:
        raise ValueError(f"route: expected embeddings of shape (n, {tree.dim}), got {x.shape}")
    n = x.shape[0]
    paths = np.empty((n, tree.levels), dtype=np.int64)
    B, row_bytes = tree.branching, 4 * tree.dim
    # FAISS's per-pair dots at every level, never numpy GEMMs in between (route_core.GEMM_ROWS:
    # their BLAS threads would spin against FAISS's OpenMP threads): 38 ms against 62.
    backend = "faiss" if faiss_installed() else "numpy"
    for s in range(0, n, batch_size):
        xb = np.ascontiguousarray(x[s : s + batch_size])
        # Points are visited in the order perm, sorted by their level-`by` cluster. A level
        # reads, for the points of one such cluster, the B^(level - by) centroids below it: when
        # they outgrow the cache the points are sorted again, by parent, so that runs of
        # consecutive points read the same few centroids. At 65,536 leaves and 20,000 points that
        # is one sort, before level 3: FAISS's per-pair dots at the leaves take 9.7 ms in that
        # order against 16.7 unsorted (AMD EPYC, 2 cores). FAISS reads the rows in place
        # (route_step's `rows`); the numpy backend's grouped GEMMs want them copied in order. A
        # point's path does not depend on the order: route_step settles near ties alone, in float64.
        perm, xs, by = np.arange(len(xb)), xb, 0
        parent = np.zeros(len(xb), dtype=np.int64)
        for lvl in range(1, tree.levels + 1):
            if by < lvl - 1 and B ** (lvl - by) * row_bytes > CACHE_BYTES:
                order = np.argsort(parent, kind="stable")
                perm, parent, by = perm[order], parent[order], lvl - 1
                xs = xb if backend == "faiss" else xb[perm]
            rows = perm if by and backend == "faiss" else None
            parent = route_step(
                tree.centroids[lvl - 1],
                tree.valid[lvl - 1],
                xs,
                parent,
                B,
                sq_norms=tree.sq_norms(lvl),
                backend=backend,
                rows=rows,
            )
            paths[s + perm, lvl - 1] = parent
    return paths


def route_texts(
    tree: Tree, texts: Sequence[str], *, model=None, device: str = "auto"
) -> np.ndarray:
    """Embed texts exactly as the tree's windows were embedded, then route → (n, levels)."""
    return route(tree, embed_like_tree(tree, texts, model=model, device=device))


def embed_like_tree(
    tree: Tree, texts: Sequence[str], *, model=None, device: str = "auto"
) -> np.ndarray:
    """texts → (n, dim) float32 embeddings, made as the tree's windows were (its embedder meta)."""
    emb = tree.meta.get("embedder", {})
    model = model or embedder_from_meta(emb, tree.path, device=device)
    return embed_texts(
        model,
        list(texts),
        strategy=emb.get("strategy", "truncate"),
        batch_size=int(emb.get("batch_size", 64)),
    )
