"""Balanced mini-batch k-means for the nodes of the tree (seed 002, App. C).

Expectation–maximisation with k-means++ initialisation; every step draws
`batch_size` *new* points (a fresh pass over a random permutation, wrapping
when exhausted; the whole node when it is smaller than a batch). After each
assignment step, a cluster holding more than `balance_factor × batch / k`
points has its assignments split evenly at random with the smallest cluster
(Jégou et al., 2010): the two clusters' points are pooled and halved by a
random hyperplane, until no cluster is over the limit. The split pulls small
(or empty) clusters towards dense regions.

That rule balances the training assignments, not the nearest-centroid cells
that routing uses; `equalize_cells` then rescales centroid norms so those
cells come out balanced too (optional, `tree.equalize_steps`), and
`relocate_cells` moves a centroid whose cell stays empty or small into the
largest cell when rescaling cannot (a dense region that k-means++ seeded with
too few centroids).

`fit_nodes_batched` fits many nodes (a tree level, or a chunk of one)
together: their batches lie end to end in one array and every EM step advances
every node. Below level 1 a node is a few hundred to a few thousand points
against ≤ 16 centroids, where fixed costs per call outweighed the arithmetic
(measured: 22 ms per 390-point level-3 node, two thirds of it in 61 FAISS
searches, each building its index). So a node's nearest centroids are one
float32 GEMM (argmin of ||c||² − 2·x·c), every node's cluster sums one sparse
product (`_cluster_sums`), and the rest (argmin, counts, balance check,
centroid update) is one vectorised pass over all nodes' rows; `balance` runs
only for nodes over the limit, and a node whose batch is the whole node stops
stepping once it has converged (`_BatchedFit.fit`). Equalisation changes only
norms, so its dot products are computed once (`_equalize`). A node's
arithmetic reads only its own rows, with operations shaped by that node alone,
and draws only from its own RNG (in the order the per-node FAISS version
drew), so its result does not depend on which nodes share its batch:
`balanced_kmeans` (one node) gives bit for bit what a batched fit gives for
it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import sparse

from memtree.clustering import gemm
from memtree.clustering.route_core import TIE_GAP

EQUALIZE_SAMPLE = 65536
# A node's cells may always exceed its own mean by this factor (`cell_cap`); in strict mode,
# by this many points.
NODE_SLACK = 1.05
STRICT_SLACK_POINTS = 1
# `relocate_cells`' default bar for its own callers; tree builds pass their balance_factor.
RELOCATE_SLACK = 1.2
# Equalisation never grows a norm past this × its k-means norm: a cell that could only be
# trimmed further by a centroid serving a far region gets relocated instead. Strict mode allows
# more: at 4, four of six skewed 4 × 8 trees (384-d, 60,000 points) kept inner nodes whose cells
# sit in one dense region at the bound, their leaves at 1.21–1.37 × the mean; at 8, none
# (docs/BENCHMARKS.md).
MAX_NORM_SCALE = 4.0
STRICT_MAX_NORM_SCALE = 8.0
# Strict mode runs up to this × equalize_steps auction rounds. Most nodes settle in 3–12 rounds
# and stop; a node whose dense region must pass points through a chain of full cells needs more:
# at 40, 3 of 12 skewed 3 × 8 and 4 × 8 trees (384-d) kept such a node, their leaves at
# 1.22–1.34 × the mean; at 200, every level ≤ 1.161 (docs/BENCHMARKS.md).
STRICT_ROUND_FACTOR = 5
# Batch rows fitted together (`_cache_groups`): 6 MiB of float32 at dim 384, about a core's L2.
CACHE_ROWS = 4096
# A whole-node fit (tol > 0) stops after this many steps without its distortion falling by tol.
SETTLE_STEPS = 2
# The tree build's default tol (`converge_tol`): see `_BatchedFit.fit` and docs/BENCHMARKS.md.
CONVERGE_TOL = 3e-3
# Rows gathered per GEMM when equalising on rows of x not already in the batch (bounds the copy).
GATHER_ROWS = 8192


@dataclass(frozen=True)
class NodeFit:
    centroids: np.ndarray  # (k, d) float32
    k: int
    n_points: int
    balance_splits: int  # splits performed across all steps
    steps: int = 0  # EM steps run (fewer than asked once the node converged)


def kmeans_pp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding (Arthur & Vassilvitskii, 2006) on the rows of x."""
    n = x.shape[0]
    centers = np.empty((k, x.shape[1]), dtype=np.float32)
    centers[0] = x[rng.integers(n)]
    d2 = ((x - centers[0]) ** 2).sum(1).astype(np.float64)
    for i in range(1, k):
        total = d2.sum()
        if (
            total <= 0
        ):  # fewer distinct points than k: duplicate seeds are harmless, splits fix them
            j = int(rng.integers(n))
        else:
            j = int(rng.choice(n, p=d2 / total))
        centers[i] = x[j]
        d2 = np.minimum(d2, ((x - centers[i]) ** 2).sum(1))
    return centers


def balance(x: np.ndarray, assign: np.ndarray, k: int, limit: int, rng: np.random.Generator) -> int:
    """Split over-limit clusters evenly with the smallest one, in place; returns the split count.

    The largest and the smallest cluster's points (rows of x) are pooled and
    halved by a random hyperplane: the points are ordered by their projection
    on a random direction and each cluster takes one half. The split is even
    and random as in the paper, and spatial rather than a coin flip per point,
    so the two new means land apart and the nearest-centroid cells used for
    routing inherit the balance (a per-point coin flip gives both clusters the
    same mean, which then collapse). Both clusters end at (big + small) / 2:
    the largest size strictly shrinks and the loop terminates.
    """
    splits = 0
    counts = np.bincount(assign, minlength=k)
    for _ in range(4 * k * k):
        big = int(np.argmax(counts))
        small = int(np.argmin(counts))
        if counts[big] <= limit or counts[big] - counts[small] <= 1:
            break
        members = np.flatnonzero((assign == big) | (assign == small))
        direction = rng.standard_normal(x.shape[1]).astype(np.float32)
        members = members[np.argsort(x[members] @ direction, kind="stable")]
        half = len(members) // 2
        assign[members[:half]] = small
        assign[members[half:]] = big
        counts[small], counts[big] = half, len(members) - half
        splits += 1
    return splits


def equalize_cells(
    x: np.ndarray,
    c: np.ndarray,
    *,
    steps: int,
    slack: float = 1.1,
    cell_size: float | None = None,
    strict: bool = False,
) -> np.ndarray:
    """Rescale centroid norms so no nearest-centroid cell of x holds more than
    floor(slack × cell_size) rows (cell_size: the mean, n / k, by default): c (k, d) → (k, d).

    The App. C rule balances the *training* assignments, but routing is by
    nearest centroid, and the cells of the resulting means are not balanced
    below level 1 (measured max/mean 1.9–4 at levels 2–4). For unit-norm x the
    routing score is ||c||² − 2·x·c, so a centroid's norm acts as a bias on its
    cell: a larger norm gives up the cell's least aligned members first.
    Directions stay the k-means directions; `steps` bounds the rounds of the
    auction in `_equalize`. The best configuration seen (fewest empty cells,
    then smallest maximum) is returned, so the result is never worse on x than
    the k-means centroids. Routing stays plain L2. strict: see `_equalize` and `cell_cap`.
    (One node; `fit_nodes_batched` runs the same rounds for many.)
    """
    k = c.shape[0]
    if steps <= 0 or k < 2:
        return c
    x = np.asarray(x, dtype=np.float32)
    seg = _Segments(np.array([x.shape[0]]))
    cap = np.array([cell_cap(x.shape[0], k, slack, cell_size, strict=strict)])
    return _equalize(
        seg,
        lambda _, a, b: x[a:b],
        c[None].astype(np.float32),
        np.array([k]),
        steps=steps,
        cap=cap,
        strict=strict,
    )[0][0, :k]


def cell_cap(
    n: int, k: int, slack: float, cell_size: float | None = None, *, strict: bool = False
) -> int:
    """Largest cell allowed among k cells of n rows: slack × cell_size (default the mean,
    n / k), never below NODE_SLACK × n / k: a node that arrives near k × the cap (its parent
    cell at the parent's cap) would otherwise need every cell at the cap exactly, which an
    auction that only raises norms cannot reach (measured: 14 of 60 level-3 nodes of the
    100k mixture stopped one or two points over it).

    strict: never below ⌈n / k⌉ + STRICT_SLACK_POINTS instead. With 1.05 × its mean, a node
    whose parent cell sat 1.10 × over the level's mean may reach 1.10 × 1.05, and that
    compounds down the levels (measured on 14,081 real windows, 3 × 8: leaves at 1.236 × the
    mean against the balance target 1.2; 1.164 with the point floor alone; docs/BENCHMARKS.md).
    One point is still 7 % of a 14-point leaf: strict trees also cap inner levels tighter
    (`clustering.tree.level_cell_slack`)."""
    size = n / k if cell_size is None else cell_size
    floor = math.ceil(n / k) + STRICT_SLACK_POINTS if strict else math.ceil(NODE_SLACK * n / k)
    return max(floor, math.floor(slack * size))


def relocate_cells(
    x: np.ndarray,
    c: np.ndarray,
    rng: np.random.Generator,
    *,
    steps: int,
    tries: int | None = None,
    slack: float = RELOCATE_SLACK,
    cell_size: float | None = None,
    equalized: np.ndarray | None = None,
    strict: bool = False,
) -> np.ndarray:
    """Move centroids out of empty or small cells into the largest: c (k, d) → (k, d) float32.

    Norm rescaling (`equalize_cells`) moves cell boundaries locally; it cannot move a centroid
    from one dense region to another. Measured on the synthetic 4 × 16 tree (655,360 points):
    a level-2 node splits one domain of 4 isotropic topics into 16 cells, and k-means++ may give
    a topic 5 centroids and its neighbour 3 (cells of ~2,050 and ~3,400 points around a mean of
    2,560), or leave a centroid with no cell at all; every level below inherits it (level-3
    nodes are balanced within themselves: median max/mean 1.055). Here, while a cell is empty
    or the largest exceeds `slack` × the mean, the smallest cell's centroid is moved into the
    largest: that cell's points are halved by a random hyperplane, as `balance` splits, the two
    halves' means become the two centroids, and the norms are equalised again. The
    configuration with the fewest empty cells, then the smallest maximum, wins, so the result
    is never worse on x than c (or than `equalized`, a candidate the caller already has).

    Moves apply to c's own norms, and each candidate is equalised from them: pass the k-means
    centroids, not ones a failed auction already rescaled. Equalising again from inflated norms
    repeats that auction's stalemate (measured: a level-2 node of a skewed 14k tree kept its
    largest cell at 1.13 × the cap through all 8 moves that way).
    """
    k = c.shape[0]
    raw, cur = c, c
    best, best_key = (
        (equalized, _key(_cells(x, equalized)[1])) if equalized is not None else (c, None)
    )
    moves = k if tries is None else tries  # default: up to one move per centroid
    for move in range(moves + 1):  # the last pass only scores the last move
        cell, sizes = _cells(x, cur)
        key = _key(sizes)
        if best_key is None or key < best_key:
            best, best_key = cur, key
        if (
            move == moves
            or key[0] == 0
            and key[1] <= cell_cap(len(x), k, slack, cell_size, strict=strict)
        ):
            break
        big, small = int(np.argmax(sizes)), int(np.argmin(sizes))
        members = np.flatnonzero(cell == big)
        if len(members) < 2 or big == small:
            break
        members = members[
            np.argsort(
                x[members] @ rng.standard_normal(x.shape[1]).astype(np.float32), kind="stable"
            )
        ]
        half = len(members) // 2
        raw = raw.copy()
        raw[small], raw[big] = x[members[:half]].mean(0), x[members[half:]].mean(0)
        cur = equalize_cells(x, raw, steps=steps, slack=slack, cell_size=cell_size, strict=strict)
    return np.asarray(best, dtype=np.float32)


def _cells(x: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of x (n, d)'s nearest centroid of c (k, d) under the routing score, (n,), and the
    cells' sizes, (k,)."""
    cell = np.argmin((c * c).sum(1)[None, :] - 2.0 * (x @ c.T), axis=1)
    return cell, np.bincount(cell, minlength=c.shape[0])


def _key(sizes: np.ndarray) -> tuple[int, int]:
    """(empty cells, largest cell): the order in which configurations of cells are compared."""
    return int((sizes == 0).sum()), int(sizes.max())


def balanced_kmeans(
    x: np.ndarray,
    k: int,
    *,
    batch_size: int = 6400,
    steps: int = 20,
    balance_factor: float = 1.1,
    equalize_steps: int = 0,
    rng: np.random.Generator,
) -> NodeFit:
    """Fit k centroids to the rows of x (n, d) float32 (rows assumed L2-normalised).

    One node: the same arithmetic as that node in `fit_nodes_batched`.
    """
    return fit_nodes_batched(
        x,
        [np.arange(x.shape[0])],
        [k],
        [rng],
        batch_size=batch_size,
        steps=steps,
        balance_factor=balance_factor,
        equalize_steps=equalize_steps,
    )[0]


def single_threaded():
    """Context limiting BLAS and OpenMP to one thread, for node fits.

    A node's GEMMs are a few MFLOP, where BLAS fan-out costs more than it
    saves and spin-waits badly when other processes share the cores
    (measured with the former FAISS search, 6,400 × 16 × 384: 1.7 ms on one
    thread, 13.7 ms on two under load). Parallelism comes from fitting groups of nodes at once
    (threads or Dask tasks) instead. torch's intra-op pool too, for `clustering.gemm`'s torch
    backend.
    """
    return gemm.one_thread()


def fit_nodes_batched(
    x: np.ndarray,
    members: Sequence[np.ndarray],
    ks: Sequence[int],
    rngs: Sequence[np.random.Generator],
    *,
    batch_size: int = 6400,
    steps: int = 20,
    balance_factor: float = 1.1,
    equalize_steps: int = 0,
    cell_size: float | None = None,
    cell_slack: float | None = None,
    converge_tol: float = 0.0,
    strict: bool = False,
) -> list[NodeFit]:
    """Balanced k-means of many nodes at once: node i is the rows `members[i]` of x
    (n, d) (rows assumed L2-normalised), split into ks[i] clusters with RNG rngs[i].

    Equalisation caps each routing cell at cell_slack × cell_size points (`cell_cap`;
    cell_slack: default balance_factor; cell_size: the tree level's mean cell, so that
    imbalance does not compound down the levels; None: each node's own mean). Node i's result
    depends on (x[members[i]], ks[i], rngs[i], cell_size, cell_slack, strict) alone. strict: the
    equalisation of `_equalize` and `cell_cap` in strict mode. Memory: one
    float32 copy of min(n_i, batch_size) rows per node (and a few floats per
    equalisation row); the rest of x is read in place, in sorted row order.
    Call it inside `single_threaded()`.
    """
    fits: list[NodeFit | None] = [None] * len(members)
    work = []
    for i, (mb, k) in enumerate(zip(members, ks)):
        n = len(mb)
        if n == 0:
            raise ValueError("balanced_kmeans: no points")
        k = max(1, min(int(k), n))
        if k == 1:
            fits[i] = NodeFit(np.asarray(x[mb]).mean(0, keepdims=True).astype(np.float32), 1, n, 0)
        else:
            work.append((i, k))
    for part in _cache_groups([min(len(members[i]), batch_size) for i, _ in work]):
        idx = [work[p][0] for p in part]
        k_arr = np.array([work[p][1] for p in part])
        km = _BatchedFit(
            x, [np.asarray(members[i]) for i in idx], k_arr, [rngs[i] for i in idx], batch_size
        )
        c, splits, ran = km.fit(steps, balance_factor, converge_tol)
        if equalize_steps > 0:
            rounds = equalize_steps * (STRICT_ROUND_FACTOR if strict else 1)
            c = km.equalize(
                c, rounds, balance_factor if cell_slack is None else cell_slack, cell_size, strict
            )
        for j, i in enumerate(idx):
            fits[i] = NodeFit(
                c[j, : k_arr[j]].copy(), int(k_arr[j]), len(members[i]), int(splits[j]), int(ran[j])
            )
    return fits  # type: ignore[return-value]


def _cache_groups(rows: Sequence[int]) -> list[range]:
    """Consecutive groups of nodes whose batches total ≤ CACHE_ROWS rows (a node alone may
    exceed it). Every EM step reads a group's whole batch twice (nearest centroids, then
    cluster sums): a group that stays in the core's cache runs those GEMMs at cache speed
    instead of streaming a level's batches from memory (measured: the 100k-point 3 × 16 build
    ~20 % faster with groups of 4,096 rows than with one group per level chunk)."""
    groups, start, total = [], 0, 0
    for i, r in enumerate(rows):
        if i > start and total + r > CACHE_ROWS:
            groups.append(range(start, i))
            start, total = i, 0
        total += r
    if rows:
        groups.append(range(start, len(rows)))
    return groups


class _Segments:
    """Row layout of nodes laid end to end: node j owns rows off[j]:off[j+1]."""

    def __init__(self, sizes: np.ndarray):
        self.sizes = sizes
        self.off = np.r_[0, np.cumsum(sizes)].astype(np.int64)
        self.node_of_row = np.repeat(np.arange(len(sizes)), sizes)
        self.bounds = list(zip(self.off[:-1].tolist(), self.off[1:].tolist()))

    def counts(self, assign: np.ndarray, kmax: int) -> np.ndarray:
        """(nodes, kmax) number of each node's rows assigned to each of its clusters."""
        flat = self.node_of_row * kmax + assign
        return np.bincount(flat, minlength=len(self.sizes) * kmax).reshape(-1, kmax)


def _cluster_sums(
    xb: np.ndarray, rows: np.ndarray, seg: _Segments, assign: np.ndarray, counts: np.ndarray
) -> np.ndarray:
    """(nodes, kmax, d) float32 sums of each node's rows per cluster: row r of `seg` is
    xb[rows[r]], assigned to its node's cluster assign[r]; counts (nodes, kmax) as
    `seg.counts(assign, kmax)` gives them.

    One sparse product for all nodes, (nodes · kmax, rows of xb) indicators times xb, instead of
    a GEMM xᵀ·onehot per node: those GEMMs are 384 × ~400 × 16, where a BLAS runs at a fraction
    of its speed (measured on a 2-core AVX2 EPYC: 8.2 GFLOP/s, 46 % of the one-thread build with
    the nearest-centroid GEMMs). A cluster's sum adds its rows in row order in float32, from its
    own node's rows alone, so a node's result does not depend on which nodes share the group."""
    kmax = counts.shape[1]
    key = seg.node_of_row * kmax + assign
    order = np.argsort(key, kind="stable")
    indptr = np.r_[0, np.cumsum(counts.ravel())]
    ind = sparse.csr_array(
        (np.ones(len(order), dtype=np.float32), rows[order], indptr),
        shape=(counts.size, xb.shape[0]),
    )
    return np.asarray(ind @ xb, dtype=np.float32).reshape(*counts.shape, xb.shape[1])


def _nearest(
    seg: _Segments, xs: Sequence[np.ndarray], c: np.ndarray, k: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, its node's nearest centroid: argmin over c[node, :k[node]] of ||c||² − 2·x·c,
    and that minimum (float32: the row's squared distance to it, less ||x||²).

    xs[j] holds node j's rows (views into one array are fine); one GEMM per
    node, shaped by that node alone, then a single argmin over all rows. Rows
    whose best two float32 scores lie within TIE_GAP are scored again in
    float64, as `route_step` does: the choice is then the exact argmin, not an
    artefact of one BLAS kernel's rounding (a flipped tie sends a node's EM down
    another path).
    """
    kmax = c.shape[1]
    dots = np.zeros((int(seg.off[-1]), kmax), dtype=np.float32)  # unused columns: 0, scored inf
    for j, (s, e) in enumerate(seg.bounds):
        gemm.matmul(xs[j], c[j, : k[j]].T, dots[s:e, : k[j]])
    cn = (c * c).sum(-1)
    cn[np.arange(kmax)[None, :] >= k[:, None]] = np.inf  # a node's unused columns never win
    dots *= -2.0
    dots += cn[seg.node_of_row]
    best = np.argmin(dots, axis=1)
    two = np.partition(dots, 1, axis=1)
    close = np.flatnonzero(two[:, 1] - two[:, 0] < TIE_GAP)  # measured: ~0.3% of rows
    node = seg.node_of_row[close]
    for j in np.unique(node).tolist():
        r = close[node == j]
        cc = c[j, : k[j]].astype(np.float64)
        x = xs[j][r - seg.off[j]].astype(np.float64)
        best[r] = np.argmin((cc * cc).sum(1)[None, :] - 2.0 * (x @ cc.T), axis=1)
    return best, two[:, 0]


class _BatchedFit:
    """The EM of `fit_nodes_batched` for nodes that all have k ≥ 2."""

    stop_converged = True  # False runs every step of converged nodes too: same result (tests check)

    def __init__(self, x, members: list[np.ndarray], k: np.ndarray, rngs, batch_size: int):
        self.x, self.members, self.k, self.rngs = x, members, k, rngs
        self.kmax = int(k.max())
        self.n = np.array([len(m) for m in members])
        self.seg = _Segments(np.minimum(self.n, batch_size))
        self.xb = np.empty((int(self.seg.off[-1]), x.shape[1]), dtype=np.float32)
        self.views = [self.xb[s:e] for s, e in self.seg.bounds]
        self.batch_size = batch_size
        # Drawn for every node, used only by those larger than a batch: each node's RNG
        # stream is the one the per-node code consumed.
        self.perm = [rng.permutation(n) for rng, n in zip(rngs, self.n.tolist())]
        self.pos = [0] * len(members)
        self.big = [j for j, n in enumerate(self.n.tolist()) if n > batch_size]
        for j in np.flatnonzero(self.n <= batch_size).tolist():
            self.views[j][:] = x[members[j]]  # the whole node, every step

    def next_batch(self) -> None:
        bs = self.batch_size
        for j in self.big:
            if self.pos[j] + bs > self.n[j]:
                self.perm[j], self.pos[j] = self.rngs[j].permutation(self.n[j]), 0
            idx = np.sort(self.perm[j][self.pos[j] : self.pos[j] + bs])  # sorted: sequential reads
            self.pos[j] += bs
            self.views[j][:] = self.x[self.members[j][idx]]

    def seed(self) -> np.ndarray:
        """k-means++ on each node's current batch → (nodes, kmax, d); unused rows zero.

        Squared distances as ||x||² + ||c||² − 2·x·c (one GEMV per node and
        seed instead of a pass over (b, d) differences), clipped at 0, updated
        for all nodes' rows at once. A seed is drawn as `Generator.choice(b,
        p=d2 / Σd2)` draws it: one `random()` u, the first row whose running sum
        of d2 exceeds u·Σd2.
        """
        seg, xb, k = self.seg, self.xb, self.k
        c = np.zeros((len(k), self.kmax, xb.shape[1]), dtype=np.float32)
        xn = np.einsum("nd,nd->n", xb, xb).astype(np.float64)
        d2 = np.zeros(len(xb))
        dots = np.zeros(len(xb), dtype=np.float32)
        for i in range(self.kmax):
            for j, (s, e) in enumerate(seg.bounds):
                if k[j] <= i:
                    continue
                rng = self.rngs[j]
                cdf = np.cumsum(d2[s:e]) if i else None
                if cdf is not None and cdf[-1] > 0:
                    u = rng.random() * cdf[-1]
                    pick = min(int(np.searchsorted(cdf, u, side="right")), e - s - 1)
                else:
                    # the first seed; or fewer distinct points than k: duplicate seeds are harmless
                    pick = int(rng.integers(e - s))
                c[j, i] = xb[s + pick]
                np.matmul(self.views[j], c[j, i], out=dots[s:e])
            if i + 1 < self.kmax:
                cn = (c[:, i] * c[:, i]).sum(1).astype(np.float64)
                new = np.maximum(xn + cn[seg.node_of_row] - 2.0 * dots, 0.0)
                d2 = new if i == 0 else np.minimum(d2, new)  # rows of finished nodes: unused
        return c

    def fit(
        self, steps: int, balance_factor: float, tol: float = 0.0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The EM steps → (centroids (nodes, kmax, d), balance splits per node, steps run per node).

        A node whose batch is the whole node stops once a step reassigned no
        point and split nothing: its means are then those of the step before,
        so every later step would repeat this one exactly (no split, no RNG
        draw) and the result is the one all `steps` give. Measured on the 100k
        benchmark: level-3 nodes (~390 points) stop after 3–9 of 20 steps;
        level-2 nodes (~6,250 points) keep splitting and run (nearly) all 20.

        The App. C split rule can keep a whole-node node from ever settling exactly: on the 100k
        benchmark mixture, where natural clusters straddle the split limit, nearly every level-3
        node split at every step and ran all 20. With tol > 0 such a node also stops once
        SETTLE_STEPS steps in a row lowered its squared distances (before the splits) by less
        than tol of their best: later steps only move points back and forth across the limit.
        """
        k, kmax = self.k, self.kmax
        self.next_batch()
        c = self.seed()
        splits = np.zeros(len(k), dtype=np.int64)
        ran = np.zeros(len(k), dtype=np.int64)
        b = self.seg.sizes.tolist()
        limit = np.array(
            [max(1, math.ceil(balance_factor * bj / kj)) for bj, kj in zip(b, k.tolist())]
        )
        static = self.n <= self.batch_size
        live, seg, prev = (
            np.arange(len(k)),
            self.seg,
            None,
        )  # prev: last step's assignment of live rows
        rows = np.arange(int(seg.off[-1]))  # row of self.xb of each live row
        # Settling (tol > 0): a whole-node node's squared distances before balancing, and the
        # steps since they last fell by more than tol of their best.
        xsq = (
            np.bincount(
                seg.node_of_row, weights=np.einsum("nd,nd->n", self.xb, self.xb), minlength=len(k)
            )
            if tol > 0
            else None
        )
        best_d, stall = np.full(len(k), np.inf), np.zeros(len(k), dtype=np.int64)
        for _ in range(steps):
            if not len(live):
                break
            self.next_batch()
            views = [self.views[j] for j in live.tolist()]
            cl, kl = c[live], k[live]
            ran[live] += 1
            assign, low = _nearest(seg, views, cl, kl)
            if tol > 0:
                d = np.bincount(seg.node_of_row, weights=low, minlength=len(live)) + xsq[live]
                fell = d < best_d[live] * (1.0 - tol)
                best_d[live] = np.minimum(best_d[live], d)
                stall[live] = np.where(fell, 0, stall[live] + 1)
            counts = seg.counts(assign, kmax)
            hi = counts.max(1)
            lo = np.where(
                np.arange(kmax)[None, :] < kl[:, None], counts, np.iinfo(np.int64).max
            ).min(1)
            over = np.flatnonzero((hi > limit[live]) & (hi - lo > 1))
            split = np.zeros(len(live), dtype=bool)
            for i in over.tolist():  # only nodes with work to do: `balance` draws no RNG otherwise
                s, e, j = *seg.bounds[i], int(live[i])
                n_split = balance(views[i], assign[s:e], int(k[j]), int(limit[j]), self.rngs[j])
                splits[j] += n_split
                split[i] = n_split > 0
            if len(over):
                counts = seg.counts(assign, kmax)
            sums = _cluster_sums(self.xb, rows, seg, assign, counts)
            nz = counts > 0
            cl[nz] = (sums[nz] / counts[nz][:, None]).astype(np.float32)
            c[live] = cl
            if prev is not None and self.stop_converged:
                moved = np.bincount(seg.node_of_row[assign != prev], minlength=len(live))
                done = ((moved == 0) & ~split | (stall[live] >= SETTLE_STEPS)) & static[live]
                if done.any():
                    keep = ~done[seg.node_of_row]
                    assign, rows = assign[keep], rows[keep]
                    live, seg = live[~done], _Segments(seg.sizes[~done])
            prev = assign
        return c, splits, ran

    def equalize(
        self, c: np.ndarray, steps: int, slack: float, cell_size: float | None, strict: bool = False
    ) -> np.ndarray:
        """`equalize_cells` for every node, on its whole node or an EQUALIZE_SAMPLE-row sample
        (cell_size, in points of x, scaled to the rows used)."""
        rows: list[np.ndarray | None] = []
        for j, (n, mb) in enumerate(zip(self.n.tolist(), self.members)):
            if n <= self.batch_size:
                rows.append(None)  # the batch is the whole node, in node order
            elif n > EQUALIZE_SAMPLE:
                # Measured on the 4×16 synthetic benchmark: a 6,400-point sample left level 2 at
                # max/mean 3.5, a 65,536-point one at 2.0, for ~20% more build time.
                rows.append(mb[np.sort(self.rngs[j].choice(n, EQUALIZE_SAMPLE, replace=False))])
            else:
                rows.append(mb)

        def rows_of(j: int, a: int, b: int) -> np.ndarray:
            r = rows[j]
            return self.views[j][a:b] if r is None else np.asarray(self.x[r[a:b]], dtype=np.float32)

        sizes = np.array([len(self.views[j]) if r is None else len(r) for j, r in enumerate(rows)])
        scaled = [
            None if cell_size is None else cell_size * m / n
            for m, n in zip(sizes.tolist(), self.n.tolist())
        ]
        cap = np.array(
            [
                cell_cap(m, int(k), slack, cs, strict=strict)
                for m, k, cs in zip(sizes.tolist(), self.k.tolist(), scaled)
            ]
        )
        eq, empty, largest = _equalize(
            _Segments(sizes), rows_of, c, self.k, steps=steps, cap=cap, strict=strict
        )
        stuck = (empty > 0) | (largest > cap)
        for j in np.flatnonzero(stuck).tolist():
            k = int(self.k[j])
            eq[j, :k] = relocate_cells(
                rows_of(j, 0, int(sizes[j])),
                c[j, :k],
                self.rngs[j],
                steps=steps,
                slack=slack,
                cell_size=scaled[j],
                equalized=eq[j, :k],
                strict=strict,
            )
        return eq


def _equalize(
    seg: _Segments,
    rows_of,
    c: np.ndarray,
    k: np.ndarray,
    *,
    steps: int,
    cap: np.ndarray,
    strict: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`equalize_cells` for many nodes: node j's cells over its rows (rows_of(j, a, b): rows
    a..b of segment j of seg), its centroids c[j, :k[j]] (every k ≥ 2), its largest allowed
    cell cap[j] (rows). Returns the rescaled centroids, (nodes, kmax, d) float32, and each
    node's number of empty cells and largest cell under them.

    Only norms change, so the score of row x for centroid j is s_j² − 2·s_j·a_j with
    a_j = x·ĉ_j: the dot products with the directions ĉ are one GEMM per node, computed once.
    A member of cell j leaves it once s_j exceeds its critical norm a_j + √(a_j² + b), where b
    is its best score elsewhere. So each round, every cell over its cap takes the norm halfway
    between the critical norms of its `excess`-th and next member (an auction: norms only
    grow, and the cell gives up exactly its excess, the members least aligned with it); the
    points it gives up go to their next-best cells (strict: their best cells with room), which
    the next round trims in turn. It
    stops when no cell is over its cap (measured: 3–12 rounds on the 100k mixture), after
    `steps` rounds, or for a cell whose norm would pass MAX_NORM_SCALE × its k-means norm
    (strict: STRICT_MAX_NORM_SCALE)
    (a centroid that would have to serve a far region: `relocate_cells` moves one instead).
    The best configuration seen (fewest empty cells, then smallest maximum) is returned, so
    the result is never worse on the rows than the k-means centroids. Routing stays plain L2.
    """
    nodes, kmax = c.shape[:2]
    used = np.arange(kmax)[None, :] < k[:, None]
    norms = np.sqrt((c.astype(np.float64) ** 2).sum(-1))
    norms[norms == 0] = 1e-6
    norms[~used] = 1.0
    dirs = c / norms[:, :, None]  # float64: the result is best norms × these directions
    dots = np.zeros((int(seg.off[-1]), kmax), dtype=np.float32)  # unused columns: 0, scored inf
    for j, (s, e) in enumerate(seg.bounds):
        d = dirs[j, : k[j]].T.astype(np.float32)
        for a in range(0, e - s, GATHER_ROWS):  # a gathered node's rows pass in slices
            b = min(a + GATHER_ROWS, e - s)
            gemm.matmul(rows_of(j, a, b), d, dots[s + a : s + b, : k[j]])
    row = seg.node_of_row
    n_rows = int(seg.off[-1])
    limit = norms * (STRICT_MAX_NORM_SCALE if strict else MAX_NORM_SCALE)
    big = np.iinfo(np.int64).max
    best_key = np.full(nodes, big, dtype=np.int64)
    best = norms.copy()
    cap_g = np.repeat(np.asarray(cap, dtype=np.int64), kmax)  # per (node, cell)
    for _ in range(steps + 1):
        sn = np.where(used, norms, np.inf)
        score = (sn * sn)[row] - 2.0 * norms[row] * dots  # (rows, kmax) float64; unused: inf
        assign = np.argmin(score, axis=1)
        sizes = seg.counts(assign, kmax)
        mx = np.where(used, sizes, -1).max(1)
        key = ((sizes == 0) & used).sum(1) * (n_rows + 1) + mx  # (empty cells, max)
        better = key < best_key
        best_key[better] = key[better]
        best[better] = norms[better]
        over = (sizes.ravel() > cap_g) & used.ravel()
        if not over.any():
            break
        gid = row * kmax + assign
        m = np.flatnonzero(over[gid])  # rows in over-full cells
        sm = score[m]
        if strict:
            # A row leaves for its best cell with room, not merely its second best: two over-full
            # cells sharing a dense region otherwise pass the same points back and forth while
            # both norms creep up (measured: a level-3 node of a skewed 60k mixture took 210
            # rounds, against the 40 allowed; 7 rounds this way). Skipping cells with less room
            # than the excess as well was tried and lost (leaves 1.16–1.23 instead of 1.13–1.16).
            full = ((sizes >= cap_g.reshape(nodes, kmax)) | ~used)[row[m]]  # (len(m), kmax)
            second = np.where(full, np.inf, sm).min(1)
            nowhere = ~np.isfinite(second)  # every other cell full too: its plain second best
            if nowhere.any():
                second[nowhere] = np.partition(sm[nowhere], 1, axis=1)[:, 1]
        else:
            second = np.partition(sm, 1, axis=1)[:, 1]
        a = dots[m, assign[m]].astype(np.float64)
        crit = a + np.sqrt(np.maximum(a * a + second, 0.0))  # norm at which the row leaves
        order = np.lexsort((crit, gid[m]))
        g, cr = gid[m][order], crit[order]
        first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        cells = g[first]
        # One point beyond the excess: a cell trimmed exactly to its cap has no room for the
        # points its neighbours give up, and full neighbours then trade single points for
        # hundreds of rounds (measured: 7 of 80 level-3 nodes still over after 40 rounds,
        # none with the margin).
        excess = np.minimum(sizes.ravel()[cells] - cap_g[cells] + 1, sizes.ravel()[cells] - 1)
        new = 0.5 * (cr[first + excess - 1] + cr[first + excess])
        flat_norms, flat_limit = norms.reshape(-1), limit.reshape(-1)
        ok = new <= flat_limit[cells]
        if not ok.any():
            break
        flat_norms[cells[ok]] = np.maximum(flat_norms[cells[ok]], new[ok])
    out = (best[:, :, None] * dirs).astype(np.float32)
    out[~used] = 0.0
    return out, best_key // (n_rows + 1), best_key % (n_rows + 1)
