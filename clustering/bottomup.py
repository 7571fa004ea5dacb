"""A tree built from its leaves up (`tree.method: bottomup`): the leaves fitted flat, then grouped.

The paper's rule (App. C, `clustering.tree.build_tree`) builds the tree root to leaves: each
level is a k-means of the node's points into B balanced children. On the demo corpus (4 fields >
16 domains > 64 subtopics, 3,008 documents) the level-1 split does not follow the fields (field
purity 0.50–0.75 whichever seed), and the balance cap then cuts a domain in two under different
level-1 nodes on some draws: level-2 domain purity 0.93–0.99 with the tree seed, and the demo's
tail gain and blocking follow it (docs/BENCHMARKS.md).

Here the B^L leaves are one balanced k-means of all points (the same node fit, restarts and cell
cap as a top-down node), and each level above groups the level below into nodes of exactly B
children, minimising the level's k-means objective given the leaves: the size-weighted squared
distance of each child's centroid to its parent's. That is the parent level's whole within-cluster
sum of squares less the children's own, so the grouping is the best parent level made of whole
children. The grouping is a tiny problem (B^l points), solved by balanced k-means with an exact
assignment (`scipy.optimize.linear_sum_assignment`), a swap search and many restarts; on the demo
corpus it reaches the same optimum on every draw, where 50 restarts without the swap search did
not. A parent's centroid is the mean of its points (the size-weighted mean of its children's);
points are then routed greedily from the root, the rule every query follows, so paths and sizes
are the routed ones.

Cost: one fit of B^L centroids over all points (the flat k-means a top-down tree avoids) and an
assignment problem of B^(L-1) rows per grouping restart: meant for trees up to MAX_LEAVES leaves.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scipy.optimize import linear_sum_assignment

from memtree.clustering import gemm
from memtree.clustering.kmeans import single_threaded
from memtree.clustering.route import route
from memtree.clustering.tree import CONVERGE_TOL, Tree, compute_tree_id, fit_level, level_cell_size

# The lowest grouping has MAX_LEAVES / B rows: at 256 a restart took 1.5 s on random points (2-core
# Xeon), at 1,024 65 s (the assignment is cubic); larger trees are what the top-down rule is for.
MAX_LEAVES = 1024
# Restarts of the grouping per level; each is k-means++ + exact balanced assignment + swaps.
GROUP_RESTARTS = 64


def build_tree_bottomup(
    x: np.ndarray,
    *,
    levels: int,
    branching: int,
    seed: int = 0,
    restarts: int = 1,
    batch_size: int = 6400,
    steps: int = 20,
    balance_factor: float = 1.1,
    min_points_per_child: int = 2,
    equalize_steps: int = 40,
    converge_tol: float = CONVERGE_TOL,
    on_level: Callable[[int], None] | None = None,
    gemm_backend: str = "auto",
) -> tuple[Tree, np.ndarray]:
    """The tree of x (n, dim) float32 from its leaves up; returns (tree, paths (n, levels)) as
    `build_tree` does. The leaves: one node fit of B^L children (`fit_level`, keyed by (seed,
    levels, 0), `restarts` fits, cells capped at balance_factor × n / B^L); each level above:
    `group_balanced` of the level below (its RNG keyed by (seed, level)). Paths are routed.
    on_level(level) is called as each level is done: the leaves first, then levels L-1 … 1.
    gemm_backend: as `build_tree`'s ("auto", the default, is `clustering.blas.resolve_gemm`)."""
    n, dim = x.shape
    leaves = branching**levels
    if leaves > MAX_LEAVES:
        raise ValueError(
            f"tree.method=bottomup: {branching}^{levels} = {leaves} leaves, more than the "
            f"{MAX_LEAVES} it is meant for (clustering.bottomup.MAX_LEAVES); "
            "use tree.method=topdown"
        )
    if n < leaves * min_points_per_child:
        raise ValueError(
            f"tree.method=bottomup: {n} points for {leaves} leaves; it needs at least "
            f"{leaves * min_points_per_child} (min_points_per_child={min_points_per_child}) "
            "so that every leaf is fitted"
        )
    x = np.asarray(x, dtype=np.float32)
    from memtree.clustering.blas import resolve_gemm  # lazily, as build_tree does

    # the fits below run on this one thread (single_threaded): the choice timed for one caller
    gemm_backend = resolve_gemm(gemm_backend, 1)
    with gemm.using(gemm_backend), single_threaded():
        ((rows, k, splits),) = fit_level(
            x,
            [(0, np.arange(n))],
            x.mean(0, keepdims=True),
            branching=leaves,
            min_points_per_child=min_points_per_child,
            batch_size=batch_size,
            steps=steps,
            balance_factor=balance_factor,
            equalize_steps=equalize_steps,
            restarts=restarts,
            seed=seed,
            level=levels,
            cell_size=level_cell_size(n, branching, levels),
            cell_slack=balance_factor,
            converge_tol=converge_tol,
        )
    leaf_c = rows[:k].astype(np.float64)
    weight = np.zeros(k)  # points nearest each leaf: the grouping's weights
    c32 = leaf_c.astype(np.float32)
    for s in range(0, n, 65536):  # (chunk, k) distances at a time
        d2 = (c32**2).sum(1)[None] - 2.0 * (x[s : s + 65536] @ c32.T)
        weight += np.bincount(d2.argmin(1), minlength=k)
    # Bottom up: per level, the groups' members (indices into the level below) and centroids.
    if on_level:
        on_level(levels)
    cents, wts, kids = [leaf_c], [weight], []
    for level in range(levels - 1, 0, -1):
        lab, _ = group_balanced(
            cents[-1], wts[-1], branching, rng=np.random.default_rng([seed, level])
        )
        g = np.argsort(lab, kind="stable").reshape(-1, branching)  # (B^level, B) children per group
        kids.append(g)
        wts.append(wts[-1][g].sum(1))
        cents.append(
            (cents[-1][g] * wts[-2][g][..., None]).sum(1) / np.maximum(wts[-1], 1e-12)[:, None]
        )
        if on_level:
            on_level(level)
    cents, wts, kids = cents[::-1], wts[::-1], kids[::-1]  # level 1 first; kids[l]: level l+1 → l+2
    # Number top-down: level 1 as grouped, each level's nodes in their parents' order.
    order = [np.arange(branching)]
    for g in kids:
        order.append(g[order[-1]].reshape(-1))
    centroids = [cents[lv][order[lv]].astype(np.float32) for lv in range(levels)]
    valid = [np.ones(branching ** (lv + 1), dtype=bool) for lv in range(levels)]
    tree = Tree(levels, branching, dim, centroids, valid)
    paths = route(tree, x)
    tree.sizes = [
        np.bincount(paths[:, lv], minlength=branching ** (lv + 1)).astype(np.int64)
        for lv in range(levels)
    ]
    tree.meta = {
        "balance_splits": [0] * (levels - 1) + [int(splits)],
        "n_points": n,
        "balance_repairs": [[0, 0]] * levels,
        "method": "bottomup",
        "gemm": gemm_backend,
    }
    tree.meta["tree_id"] = compute_tree_id(tree)
    return tree, paths


def group_balanced(
    c: np.ndarray,
    w: np.ndarray,
    branching: int,
    *,
    restarts: int = GROUP_RESTARTS,
    rng: np.random.Generator,
) -> tuple[np.ndarray, float]:
    """Group m points c (m, d) with weights w (m,) into m / branching groups of exactly
    `branching` members, minimising sum_i w_i ||c_i - g(i)||² with g the groups' weighted means.
    Returns (labels (m,) in [0, m / branching), cost). m must be a multiple of branching."""
    c = np.asarray(c, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    m = len(c)
    if m % branching:
        raise ValueError(f"group_balanced: {m} points do not make groups of {branching}")
    k = m // branching
    if k == 1:
        return np.zeros(m, dtype=np.int64), _cost(c, w, np.zeros(m, dtype=np.int64), 1)
    w = np.where(w > 0, w, 1e-6)  # an empty child still needs a parent
    best_lab, best = None, np.inf
    for _ in range(restarts):
        lab = _swap_search(c, w, _lloyd(c, w, _kmeanspp(c, k, rng), branching), k)
        cost = _cost(c, w, lab, k)
        if best_lab is None or cost < best - 1e-9 * abs(best):  # ties keep the earlier restart
            best_lab, best = lab, cost
    return _canonical(best_lab, k), best


def _kmeanspp(c: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    idx = [int(rng.integers(len(c)))]
    d2 = ((c - c[idx[0]]) ** 2).sum(1)
    for _ in range(1, k):
        p = d2 / d2.sum() if d2.sum() > 0 else None
        idx.append(int(rng.choice(len(c), p=p)))
        d2 = np.minimum(d2, ((c - c[idx[-1]]) ** 2).sum(1))
    return c[idx].copy()


def _means(c: np.ndarray, w: np.ndarray, lab: np.ndarray, k: int) -> np.ndarray:
    tot = np.zeros((k, c.shape[1]))
    np.add.at(tot, lab, c * w[:, None])
    return tot / np.bincount(lab, weights=w, minlength=k)[:, None]


def _cost(c: np.ndarray, w: np.ndarray, lab: np.ndarray, k: int) -> float:
    return float((((c - _means(c, w, lab, k)[lab]) ** 2).sum(1) * w).sum())


def _lloyd(
    c: np.ndarray, w: np.ndarray, cen: np.ndarray, branching: int, steps: int = 100
) -> np.ndarray:
    """Balanced k-means: every assignment step is the exact capacity-B assignment."""
    k = len(cen)
    lab = None
    for _ in range(steps):
        cost = ((c[:, None, :] - cen[None]) ** 2).sum(-1) * w[:, None]  # (m, k)
        rows, cols = linear_sum_assignment(np.repeat(cost, branching, axis=1))
        new = np.empty(len(c), dtype=np.int64)
        new[rows] = cols // branching
        if lab is not None and np.array_equal(new, lab):
            break
        lab = new
        cen = _means(c, w, lab, k)
    return lab


def _swap_search(c: np.ndarray, w: np.ndarray, lab: np.ndarray, k: int) -> np.ndarray:
    """Exchange two members of different groups while that lowers the cost, best exchange first:
    balanced Lloyd stops where no single reassignment helps, which a pair exchange can still.
    A group's cost is S - |M|² / W (S = Σ w|c|², M = Σ w c, W = Σ w), so every pair's change
    comes from one (m, m) product per pass."""
    lab = lab.copy()
    q = c * w[:, None]  # (m, d)
    s = (c * q).sum(1)  # (m,)
    qq = (q * q).sum(1)
    for _ in range(len(c) * len(c)):  # each pass lowers the cost: a bound, never reached
        M = np.zeros((k, c.shape[1]))
        np.add.at(M, lab, q)
        W = np.bincount(lab, weights=w, minlength=k)
        S = np.bincount(lab, weights=s, minlength=k)
        P = M[lab] - q  # (m, d): i's group without i
        pp = (P * P).sum(1)
        dot = P @ q.T  # (m, m): [i, j] = P_i · q_j
        Wi, Si = W[lab], S[lab]
        # i's group losing i and gaining j, for every (i, j)
        new_i = (
            Si[:, None]
            - s[:, None]
            + s[None, :]
            - (pp[:, None] + qq[None, :] + 2 * dot) / (Wi[:, None] - w[:, None] + w[None, :])
        )
        old_i = Si - (M[lab] ** 2).sum(1) / Wi  # (m,): i's group's cost now
        delta = new_i + new_i.T - old_i[:, None] - old_i[None, :]
        delta[lab[:, None] == lab[None, :]] = np.inf
        i, j = np.unravel_index(int(np.argmin(delta)), delta.shape)
        if not delta[i, j] < -1e-9 * max(1.0, float(old_i.sum())):
            return lab
        lab[i], lab[j] = lab[j], lab[i]
    return lab


def _canonical(lab: np.ndarray, k: int) -> np.ndarray:
    """Groups numbered by their first member, so equal partitions get equal labels."""
    first = {}
    for g in lab.tolist():
        first.setdefault(g, len(first))
    return np.array([first[g] for g in lab.tolist()], dtype=np.int64)
