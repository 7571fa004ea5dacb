"""The clustering tree: format, level-by-level construction, loading.

Geometry: `levels` levels under a root, every node split into at most
`branching` children. Cluster ids are *global per level* and nested: the
children of cluster p at level l-1 are p·B … p·B + B-1 at level l (B =
branching; the root is cluster 0 at level 0). So a leaf id determines the
whole path (id // B^j), and memory banks can address level l by a dense
index in [0, B^l). A node with too few points gets fewer children; the unused
ids are marked invalid and never routed to. Every valid node has ≥ 1 valid
child, so routing always ends at a valid leaf.

On disk (format `memtree-tree`, version 1; see clustering/README.md):
  tree.json             levels, branching, dim, metric, config, embedder, tree_id, per-level
                        stats, file checksums
  centroids-l{l}.npy    (B^l, dim) float32
  valid-l{l}.npy        (B^l,) bool
  sizes-l{l}.npy        (B^l,) int64: build points routed to each cluster
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memtree.clustering import gemm
from memtree.clustering.kmeans import (
    CONVERGE_TOL,
    EQUALIZE_SAMPLE,
    STRICT_SLACK_POINTS,
    fit_nodes_batched,
    single_threaded,
)
from memtree.clustering.route_core import route_step, squared_norms
from memtree.io import (
    atomic_dir,
    atomic_save_npy,
    atomic_write_json,
    check_format,
    read_json,
    sha256_file,
)

TREE_FORMAT = "memtree-tree"
TREE_VERSION = 1
# Batch rows one batched level fit may hold (float32: 192 MiB at dim 384); more nodes go to
# more chunks.
CHUNK_ROWS = 1 << 17
# Strict trees cap inner levels at 1 + this × (balance_factor − 1) of the level's mean
# (`level_cell_slack`), leaving the rest of the headroom to the levels below.
INNER_HEADROOM = 0.5
# The balance target: no cluster at any level over this × its level's mean. The
# default build refits with strict balance only the nodes that would break it (`repair_limit`).
BALANCE_TARGET = 1.2


@dataclass
class Tree:
    levels: int
    branching: int
    dim: int
    centroids: list[np.ndarray]  # level l-1 → (B^l, dim) float32
    valid: list[np.ndarray]  # level l-1 → (B^l,) bool
    sizes: list[np.ndarray] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    path: Path | None = (
        None  # the directory it was loaded from (relative paths in meta resolve here)
    )
    _norms: dict[int, np.ndarray] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def tree_id(self) -> str:
        return self.meta.get("tree_id") or compute_tree_id(self)

    def sq_norms(self, level: int) -> np.ndarray:
        """(B^level,) float32 ||c||² of the level's centroids, computed once per Tree: routing
        scores every point with them, and at 65,536 leaves recomputing costs ~10 ms a call."""
        if level not in self._norms:
            self._norms[level] = squared_norms(self.centroids[level - 1])
        return self._norms[level]

    def n_clusters(self, level: int) -> int:
        return self.branching**level

    def children(self, level: int, parent: int) -> np.ndarray:
        """Global ids at `level` of the valid children of `parent` (a level-1 id)."""
        ids = np.arange(parent * self.branching, (parent + 1) * self.branching)
        return ids[self.valid[level - 1][ids]]


def compute_tree_id(tree: Tree) -> str:
    h = hashlib.sha256()
    h.update(f"{TREE_FORMAT}/{TREE_VERSION}/{tree.levels}/{tree.branching}/{tree.dim}".encode())
    for c, v in zip(tree.centroids, tree.valid):
        h.update(np.ascontiguousarray(c, dtype=np.float32).tobytes())
        h.update(np.ascontiguousarray(v, dtype=np.bool_).tobytes())
    return h.hexdigest()[:24]


def node_children(n_points: int, branching: int, min_points_per_child: int) -> int:
    return max(1, min(branching, n_points // min_points_per_child))


def fit_level(
    x: np.ndarray,
    nodes: Sequence[tuple[int, np.ndarray]],
    fallbacks: np.ndarray,
    *,
    branching: int,
    min_points_per_child: int,
    batch_size: int,
    steps: int,
    balance_factor: float,
    equalize_steps: int = 0,
    restarts: int = 1,
    seed: int,
    level: int,
    cell_size: float | None = None,
    cell_slack: float | None = None,
    converge_tol: float = CONVERGE_TOL,
    strict_balance: bool = False,
) -> list[tuple[np.ndarray, int, int]]:
    """`fit_node` for the nodes (node_id, row indices into x) of one level, fitted together
    (`fit_nodes_batched`); fallbacks[i] is node i's own centroid. Call inside `single_threaded()`.
    cell_size: the level's mean cell in points (`level_cell_size`), which equalisation caps
    every cell against (× cell_slack, `level_cell_slack`; default balance_factor); None caps
    each node against its own mean.

    Each node's RNG is keyed by (seed, level, node) and its arithmetic reads only
    its own rows, so a node's result does not depend on which nodes are fitted
    with it, on which worker, or in what order: it equals `fit_node` on its rows.

    `restarts` > 1 fits each node that many times (restart r > 0 keyed by (seed, level, node, r))
    and keeps the fit with the lowest routing distortion (`distortion`), as FAISS's `nredo` does:
    k-means++ from one seed can leave two true clusters under one centroid, and on small trees
    the routing quality of the whole tree follows the objective (docs/BENCHMARKS.md).
    """
    out: list[tuple[np.ndarray, int, int] | None] = [None] * len(nodes)
    todo = []
    for i, (_, idx) in enumerate(nodes):
        if len(idx):
            todo.append(i)
            continue
        # Reachable by no build point: one child, the parent's own centroid.
        rows = np.zeros((branching, fallbacks.shape[-1]), dtype=np.float32)
        rows[0] = fallbacks[i]
        out[i] = (rows, 1, 0)
    if restarts < 1:
        raise ValueError(f"restarts must be >= 1, got {restarts}")
    members = [nodes[i][1] for i in todo]
    ks = [node_children(len(nodes[i][1]), branching, min_points_per_child) for i in todo]

    def fit(r: int) -> list:
        key = [r] if r else []  # restart 0 keeps the single-fit key: restarts=1 is unchanged
        return fit_nodes_batched(
            x,
            members,
            ks,
            [np.random.default_rng([seed, level, int(nodes[i][0]), *key]) for i in todo],
            batch_size=batch_size,
            steps=steps,
            balance_factor=balance_factor,
            equalize_steps=equalize_steps,
            cell_size=cell_size,
            cell_slack=cell_slack,
            converge_tol=converge_tol,
            strict=strict_balance,
        )

    fits = fit(0)
    if restarts > 1:
        best = [distortion(x, m, f.centroids) for m, f in zip(members, fits)]
        for r in range(1, restarts):
            for j, cand in enumerate(fit(r)):
                d = distortion(x, members[j], cand.centroids)
                if d < best[j]:  # ties keep the earlier restart
                    fits[j], best[j] = cand, d
    for i, fit in zip(todo, fits):
        rows = np.zeros((branching, fallbacks.shape[-1]), dtype=np.float32)
        rows[: fit.k] = fit.centroids
        out[i] = (rows, fit.k, fit.balance_splits)
    return out  # type: ignore[return-value]


def distortion(x: np.ndarray, rows: np.ndarray, centroids: np.ndarray) -> float:
    """Mean squared L2 distance of x[rows] (rows sorted) to their nearest centroid (k, d), the
    k-means objective under the rule routing uses. Nodes above EQUALIZE_SAMPLE rows are scored
    on evenly spaced rows: deterministic, and one bounded float32 copy."""
    if len(rows) > EQUALIZE_SAMPLE:
        rows = rows[:: -(-len(rows) // EQUALIZE_SAMPLE)]
    xs = np.asarray(x[rows], dtype=np.float32)  # (n, d)
    c = np.asarray(centroids, dtype=np.float32)  # (k, d)
    d2 = (
        np.einsum("nd,nd->n", xs, xs)[:, None]
        + np.einsum("kd,kd->k", c, c)[None, :]
        - 2.0 * (xs @ c.T)
    )
    return float(np.maximum(d2.min(1), 0.0).mean(dtype=np.float64))


def fit_node(
    x: np.ndarray,
    *,
    branching: int,
    min_points_per_child: int,
    batch_size: int,
    steps: int,
    balance_factor: float,
    equalize_steps: int = 0,
    restarts: int = 1,
    seed: int,
    level: int,
    node: int,
    fallback: np.ndarray,
    cell_size: float | None = None,
    cell_slack: float | None = None,
    converge_tol: float = CONVERGE_TOL,
    strict_balance: bool = False,
) -> tuple[np.ndarray, int, int]:
    """Centroids of one node's children → ((branching, dim) rows, n valid children, splits).

    The RNG is keyed by (seed, level, node), so a node's result does not depend
    on which worker fits it or in what order; `fit_level` gives the same.
    """
    return fit_level(
        x,
        [(node, np.arange(x.shape[0]))],
        np.asarray(fallback)[None],
        branching=branching,
        min_points_per_child=min_points_per_child,
        batch_size=batch_size,
        steps=steps,
        balance_factor=balance_factor,
        equalize_steps=equalize_steps,
        restarts=restarts,
        seed=seed,
        level=level,
        cell_size=cell_size,
        cell_slack=cell_slack,
        converge_tol=converge_tol,
        strict_balance=strict_balance,
    )[0]


def level_cell_size(n_points: int, branching: int, level: int) -> float:
    """Mean points per cluster at `level` of a full tree over n_points: the size equalisation
    caps every cell against (× balance_factor), the same for every node of the level, so a
    node that inherits a large parent cell does not pass its excess on to its children."""
    return n_points / branching**level


def level_cell_slack(balance_factor: float, level: int, levels: int, strict: bool = False) -> float:
    """Equalisation's cap at `level` of a `levels`-deep tree, as a multiple of the level's mean
    cell (`level_cell_size`): balance_factor at every level, or, for a strict tree, at the
    leaves only and 1 + INNER_HEADROOM × (balance_factor − 1) above them (1.05 for 1.1).

    A node's children share its points, so a parent cell at its cap leaves its children that
    far over their level's mean on average, and a strict node may always reach ⌈n / k⌉ + 1
    points (`kmeans.cell_cap`): with every level capped at balance_factor, the leaves of skewed
    4 × 8 trees (60,000 points, 14.6 per leaf) reached 1.23 × their mean; with inner levels at
    1.05, ≤ 1.16. Three quarters of the headroom (1.075) kept 0.002 more NMI on the 100k-point
    benchmark mixture but left one of two such trees at 1.23 (docs/BENCHMARKS.md). Inner cells
    are hundreds of points or more, where the auction reaches a tight cap in a few rounds."""
    if not strict or level >= levels:
        return balance_factor
    return 1.0 + INNER_HEADROOM * (balance_factor - 1.0)


def level_chunks(sizes: Sequence[int], batch_size: int, n_chunks: int) -> list[range]:
    """Split a level's nodes (sizes in points) into ≥ n_chunks contiguous groups of about equal
    work (rows per EM step, min(size, batch_size)), each holding ≤ CHUNK_ROWS batch rows
    (a batched fit holds one float32 copy of its batch rows) unless one node alone has more."""
    load = np.minimum(np.asarray(sizes, dtype=np.int64), batch_size) + 1
    total = int(load.sum())
    parts = max(1, min(len(load), max(n_chunks, -(-total // CHUNK_ROWS))))
    cut = np.searchsorted(np.cumsum(load), np.arange(1, parts) * total / parts, side="left") + 1
    bounds = np.unique(np.r_[0, np.minimum(cut, len(load)), len(load)])
    return [range(a, b) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


def build_tree(
    x: np.ndarray,
    *,
    levels: int,
    branching: int,
    batch_size: int = 6400,
    steps: int = 20,
    balance_factor: float = 1.1,
    min_points_per_child: int = 2,
    equalize_steps: int = 40,
    strict_balance: bool = False,
    balance_target: float | None = BALANCE_TARGET,
    restarts: int = 1,
    converge_tol: float = CONVERGE_TOL,
    seed: int = 0,
    fit_nodes: Callable[..., Sequence[tuple[np.ndarray, int, int]]] | None = None,
    n_jobs: int | None = None,
    on_level: Callable[[int], None] | None = None,
    gemm_backend: str = "auto",
) -> tuple[Tree, np.ndarray]:
    """Build the tree root-to-leaves on x (n, dim) float32; returns (tree, paths (n, levels)).

    `fit_nodes(level, nodes, parent_c, strict=...)` fits a list of (node_id, member_indices)
    and returns fit_node results in order, with strict balance when `strict`; the default
    fits each level's nodes in batches (`fit_level`), one chunk of nodes per thread on
    `n_jobs` threads (default: all cores); the pipeline passes a Dask-backed one. The tree
    is the same for every n_jobs and every fit_nodes that returns fit_node results (capped
    as the default caps them: `level_cell_size`, `level_cell_slack`).
    strict_balance: every node fitted with inner levels capped tighter and the strict
    equalisation of `kmeans.fit_nodes_batched` (leaves ≤ 1.2 × their mean on skewed data
    with ~15-point leaves, where the paper's rule alone reaches 1.24–1.37; docs/BENCHMARKS.md).
    balance_target: after each level, the nodes whose largest child exceeds `repair_limit`
    × the level's mean cell are fitted again with strict balance, and each keeps whichever
    fit has the smaller largest child; None never refits. Where no node is over, the tree is
    exactly the paper's rule (the demo's trees, the 100k-point benchmark mixture): strict trees
    took the demo's fetched-generic gap from 15.3 to 8.8 points for reasons not found, so only
    the nodes that break the target pay for it. The count of refitted and kept nodes per level
    is in tree.meta["balance_repairs"].
    gemm_backend: the BLAS the default fitter's GEMMs run on (`clustering.gemm`: "numpy",
    "torch", "faiss", or "auto", the default: the fastest on a sample of node fits,
    `clustering.blas.resolve_gemm`, timed once per host and kept, as the pipeline chooses); the
    paths do not depend on it, the centroids only by float32 rounding (~1e-7). A `fit_nodes` of
    the caller's chooses its own.
    """
    n, dim = x.shape
    own_fitter = fit_nodes is None
    if own_fitter:  # a caller's fit_nodes chooses its own BLAS; resolving would only time it
        from memtree.clustering.blas import resolve_gemm

        gemm_backend = resolve_gemm(gemm_backend, n_jobs)
    if balance_target is not None and balance_target < 1.0:
        raise ValueError(f"balance_target must be >= 1.0 or None, got {balance_target!r}")
    params = {
        "branching": branching,
        "min_points_per_child": min_points_per_child,
        "batch_size": batch_size,
        "steps": steps,
        "balance_factor": balance_factor,
        "equalize_steps": equalize_steps,
        "restarts": restarts,
        "converge_tol": converge_tol,
        "seed": seed,
    }
    workers = n_jobs or os.cpu_count() or 1

    def threaded(
        level: int, nodes: list[tuple[int, np.ndarray]], parent_c: np.ndarray, *, strict: bool
    ):
        chunks = level_chunks([len(idx) for _, idx in nodes], batch_size, workers)

        def one(chunk: range):
            part = [nodes[i] for i in chunk]
            return fit_level(
                x,
                part,
                parent_c[[p for p, _ in part]],
                level=level,
                cell_size=level_cell_size(n, branching, level),
                cell_slack=level_cell_slack(balance_factor, level, levels, strict),
                strict_balance=strict,
                **params,
            )

        with (
            gemm.using(gemm_backend),
            single_threaded(),
            ThreadPoolExecutor(max_workers=workers) as ex,
        ):
            return [fit for part in ex.map(one, chunks) for fit in part]

    fit_nodes = fit_nodes or threaded
    centroids: list[np.ndarray] = []
    valid: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    splits: list[int] = []
    repairs: list[list[int]] = []
    parent = np.zeros(n, dtype=np.int64)
    parent_c = x.mean(0, keepdims=True).astype(np.float32) if n else np.zeros((1, dim), np.float32)
    parent_valid = np.ones(1, dtype=bool)
    paths = np.zeros((n, levels), dtype=np.int64)
    for level in range(1, levels + 1):
        order = np.argsort(parent, kind="stable")
        bounds = np.searchsorted(parent[order], np.arange(branching ** (level - 1) + 1))
        nodes = [(p, order[bounds[p] : bounds[p + 1]]) for p in np.flatnonzero(parent_valid)]
        results = list(fit_nodes(level, nodes, parent_c, strict=strict_balance))
        c, v = _level_rows(nodes, results, branching**level, dim)
        child = route_step(c, v, x, parent, branching) if n else parent
        done = [0, 0]
        if balance_target is not None and not strict_balance and n:
            limit = repair_limit(balance_target, balance_factor, n, branching, level, levels)
            results, child, done = _repair_level(
                x,
                nodes,
                results,
                child,
                parent,
                parent_c,
                level,
                limit * level_cell_size(n, branching, level),
                fit_nodes,
                branching,
                dim,
            )
            c, v = _level_rows(nodes, results, branching**level, dim)
        parent = child
        paths[:, level - 1] = parent
        centroids.append(c)
        valid.append(v)
        sizes.append(np.bincount(parent, minlength=branching**level).astype(np.int64))
        splits.append(sum(s for _, _, s in results))
        repairs.append(done)
        parent_c, parent_valid = c, v
        if on_level:
            on_level(level)
    tree = Tree(
        levels,
        branching,
        dim,
        centroids,
        valid,
        sizes,
        meta={"balance_splits": splits, "n_points": n, "balance_repairs": repairs},
    )
    if (
        own_fitter
    ):  # which BLAS ran the GEMMs (not in the tree_id: it moves centroids by rounding only)
        tree.meta["gemm"] = gemm_backend
    tree.meta["tree_id"] = compute_tree_id(tree)
    return tree, paths


def repair_limit(
    balance_target: float,
    balance_factor: float,
    n_points: int,
    branching: int,
    level: int,
    levels: int,
) -> float:
    """The largest child a node at `level` may leave, × the level's mean cell, before
    `build_tree` refits it with strict balance: balance_target at the leaves; above them, less
    the room every level below needs (a strict node's cells may reach ⌈n / k⌉ + 1 points, up
    to STRICT_SLACK_POINTS + 1 over its own mean), so that the leaves can still meet the target.
    Never below the strict inner cap (`level_cell_slack`), which a refit cannot beat.

    On the demo's trees (47-point leaves) that is 1.147 / 1.157 / 1.2 for levels 1 / 2 / 3,
    and no node is over; on 14,081 skewed windows (3 × 8, 27.5 points per leaf) 1.118 / 1.127
    / 1.2, where the paper's rule left level 2 at 1.159 and the leaves at 1.236."""
    room = sum(
        (STRICT_SLACK_POINTS + 1) / level_cell_size(n_points, branching, j)
        for j in range(level + 1, levels + 1)
    )
    return max(balance_target - room, level_cell_slack(balance_factor, level, levels, strict=True))


def _level_rows(
    nodes: Sequence[tuple[int, np.ndarray]],
    results: Sequence[tuple[np.ndarray, int, int]],
    n_cells: int,
    dim: int,
) -> tuple[np.ndarray, np.ndarray]:
    """One level's centroids (n_cells, dim) float32 and valid mask (n_cells,) from its node fits."""
    c = np.zeros((n_cells, dim), dtype=np.float32)
    v = np.zeros(n_cells, dtype=bool)
    for (p, _), (rows, k, _) in zip(nodes, results):
        b = rows.shape[0]
        c[p * b : (p + 1) * b] = rows
        v[p * b : p * b + k] = True
    return c, v


def _repair_level(
    x, nodes, results, child, parent, parent_c, level, limit_points, fit_nodes, branching, dim
):
    """Refit with strict balance the nodes whose largest child holds more than limit_points
    points; keep a refit where its largest child is smaller. Routing scores a point against its
    own parent's children only, so only the refitted nodes' points are routed again, and they
    take the kept refits' assignment. Returns (results, child (n,), [refitted, kept])."""
    n_cells = len(parent_c) * branching
    per_node = np.bincount(child, minlength=n_cells).reshape(-1, branching)  # (P, B)
    over = [i for i, (p, _) in enumerate(nodes) if per_node[p].max() > limit_points]
    if not over:
        return results, child, [0, 0]
    redo = list(fit_nodes(level, [nodes[i] for i in over], parent_c, strict=True))
    trial = list(results)
    for i, r in zip(over, redo):
        trial[i] = r
    c, v = _level_rows(nodes, trial, n_cells, dim)
    rows = np.concatenate([nodes[i][1] for i in over])  # (m,) the refitted nodes' points
    alt = route_step(c, v, x, parent[rows], branching, rows=rows)  # (m,)
    alt_node = np.bincount(alt, minlength=n_cells).reshape(-1, branching)
    kept = [i for i in over if alt_node[nodes[i][0]].max() < per_node[nodes[i][0]].max()]
    out = list(results)
    for i in kept:
        out[i] = trial[i]
    take = np.isin(parent[rows], [nodes[i][0] for i in kept])
    child = child.copy()
    child[rows[take]] = alt[take]
    return out, child, [len(over), len(kept)]


def level_stats(tree: Tree) -> list[dict[str, Any]]:
    out = []
    for lvl in range(1, tree.levels + 1):
        v, s = tree.valid[lvl - 1], tree.sizes[lvl - 1] if tree.sizes else None
        d: dict[str, Any] = {
            "level": lvl,
            "n_clusters": int(tree.branching**lvl),
            "n_valid": int(v.sum()),
        }
        if s is not None and v.any():
            sv = s[v]
            mean = float(sv.mean())
            d.update(
                n_empty=int((sv == 0).sum()),
                min_size=int(sv.min()),
                max_size=int(sv.max()),
                mean_size=mean,
                balance_ratio=float(sv.max() / mean) if mean > 0 else None,
            )
        # Nodes of the level above that received fewer than `branching` children.
        per_parent = v.reshape(-1, tree.branching).sum(1)
        d["parents_with_fewer_children"] = int(
            ((per_parent > 0) & (per_parent < tree.branching)).sum()
        )
        out.append(d)
    return out


def save_tree(
    tree: Tree, out_dir: str | Path, *, config: dict[str, Any], embedder: dict[str, Any]
) -> dict:
    """Write the tree files into out_dir (each atomically); returns tree.json's content.

    A directory that already holds a tree is replaced whole (written beside it, then renamed),
    so a failed write (a full disk) leaves the previous tree loadable, not a mix of the two."""
    out = Path(out_dir)
    if (out / "tree.json").exists():
        with atomic_dir(out) as tmp:
            return _write_tree(tree, tmp, config=config, embedder=embedder)
    out.mkdir(parents=True, exist_ok=True)
    return _write_tree(tree, out, config=config, embedder=embedder)


def _write_tree(tree: Tree, out: Path, *, config: dict[str, Any], embedder: dict[str, Any]) -> dict:
    files: dict[str, str] = {}
    for lvl in range(1, tree.levels + 1):
        for stem, arr in (
            ("centroids", tree.centroids[lvl - 1]),
            ("valid", tree.valid[lvl - 1]),
            ("sizes", tree.sizes[lvl - 1]),
        ):
            name = f"{stem}-l{lvl}.npy"
            atomic_save_npy(out / name, arr)
            files[name] = sha256_file(out / name)
    meta = {
        "format": TREE_FORMAT,
        "version": TREE_VERSION,
        "tree_id": tree.tree_id,
        "levels": tree.levels,
        "branching": tree.branching,
        "dim": tree.dim,
        "metric": "l2",
        "inputs_l2_normalized": True,
        "n_points": int(tree.meta.get("n_points", 0)),
        "balance_splits_per_level": tree.meta.get("balance_splits", []),
        # [nodes refitted with strict balance, refits kept] per level
        # (`build_tree`'s balance_target)
        "balance_repairs_per_level": tree.meta.get("balance_repairs", []),
        "level_stats": level_stats(tree),
        "config": config,
        "embedder": embedder,
        "files": files,
    }
    atomic_write_json(out / "tree.json", meta)
    return meta


def load_tree(path: str | Path, *, verify: bool = True) -> Tree:
    """Load a tree directory (or its tree.json); checks format, version and checksums."""
    p = Path(path)
    d = p.parent if p.name == "tree.json" else p
    meta = read_json(d / "tree.json")
    check_format(meta, TREE_FORMAT, TREE_VERSION, f"{d}/tree.json", what="memtree tree")
    cents, valid, sizes = [], [], []
    for lvl in range(1, meta["levels"] + 1):
        for stem, acc in (("centroids", cents), ("valid", valid), ("sizes", sizes)):
            name = f"{stem}-l{lvl}.npy"
            f = d / name
            if not f.is_file():
                raise FileNotFoundError(f"{f}: missing tree file")
            if verify:
                want, got = meta.get("files", {}).get(name), sha256_file(f)
                if got != want:
                    raise ValueError(
                        f"{f}: checksum mismatch (file changed since the tree was written): "
                        f"sha256 {got}, {d / 'tree.json'} records {want}; the tree is damaged: "
                        "restore the directory from a copy or rebuild it (delete it and re-run "
                        "the `memtree pipeline` command that wrote it)"
                    )
            acc.append(np.load(f, allow_pickle=False))
    B, L = meta["branching"], meta["levels"]
    for lvl, c in enumerate(cents, start=1):
        if c.shape != (B**lvl, meta["dim"]):
            raise ValueError(
                f"{d}/centroids-l{lvl}.npy: shape {c.shape}, expected {(B**lvl, meta['dim'])}"
            )
    return Tree(L, B, meta["dim"], cents, valid, sizes, meta=meta, path=d)
