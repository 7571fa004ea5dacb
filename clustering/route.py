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

from clustering.embed import embed_texts, embedder_from_meta
from clustering.route_core import route_step
from clustering.tree import Tree


def route(tree: Tree, x: np.ndarray, *, batch_size: int = 262144) -> np.ndarray:
    """Paths of the rows of x (n, dim) → (n, levels) int64 global cluster ids per level.

    Column l-1 is the level-l cluster id in [0, B^l); the last column is the leaf id.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != tree.dim:
        raise ValueError(f"route: expected embeddings of shape (n, {tree.dim}), got {x.shape}")
    n = x.shape[0]
    paths = np.empty((n, tree.levels), dtype=np.int64)
    for s in range(0, n, batch_size):
        # The points travel sorted by their current cluster (xs = xb[perm]): each level then
        # reads one parent's children for a run of consecutive points, in cache, and the
        # grouped GEMMs take views instead of gathered copies. Measured at 65,536 leaves and
        # 20,000 points: FAISS's per-pair dots 28 vs 60 ms at the leaves, the 16 GEMMs of
        # level 2 14 vs 92 ms, for one 30 MB row gather per level (~8 ms). A point's path
        # does not depend on the order (route_step settles near ties alone, in float64).
        xb = x[s : s + batch_size]
        xs, perm = xb, np.arange(len(xb))
        parent = np.zeros(len(xb), dtype=np.int64)
        for lvl in range(1, tree.levels + 1):
            ids = route_step(tree.centroids[lvl - 1], tree.valid[lvl - 1], xs, parent, tree.branching,
                             sq_norms=tree.sq_norms(lvl))
            paths[s + perm, lvl - 1] = ids
            if lvl < tree.levels:
                if (ids[1:] >= ids[:-1]).all():
                    parent = ids
                    continue
                order = np.argsort(ids, kind="stable")
                xs, perm, parent = xs[order], perm[order], ids[order]
    return paths


def route_texts(tree: Tree, texts: Sequence[str], *, model=None, device: str = "auto") -> np.ndarray:
    """Embed texts exactly as the tree's windows were embedded, then route → (n, levels)."""
    emb = tree.meta.get("embedder", {})
    model = model or embedder_from_meta(emb, tree.path, device=device)
    x = embed_texts(model, list(texts), strategy=emb.get("strategy", "truncate"),
                    batch_size=int(emb.get("batch_size", 64)))
    return route(tree, x)
