"""Balanced hierarchical k-means and greedy routing (real FAISS)."""

import numpy as np
import pytest

from clustering.kmeans import balance, balanced_kmeans
from clustering.route import route
from clustering.tree import build_tree, level_stats, load_tree, save_tree


def _sphere(n, d=32, seed=0, skew=False):
    rng = np.random.default_rng(seed)
    if skew:
        # Heavily skewed mixture: one component holds ~70% of the points.
        k = 12
        w = np.array([0.7] + [0.3 / (k - 1)] * (k - 1))
        centers = rng.normal(size=(k, d))
        x = centers[rng.choice(k, n, p=w)] + 0.6 * rng.normal(size=(n, d))
    else:
        x = rng.normal(size=(n, d))
    x = x.astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _naive_path(tree, v):
    """Level-by-level argmin over the parent's valid children, one point at a time (float64)."""
    parent, out = 0, []
    for lvl in range(1, tree.levels + 1):
        ids = tree.children(lvl, parent)
        c = tree.centroids[lvl - 1][ids].astype(np.float64)
        d = ((c - v.astype(np.float64)) ** 2).sum(1)
        parent = int(ids[np.argmin(d)])
        out.append(parent)
    return out, d


def test_greedy_traversal_equals_level_by_level_argmin():
    x = _sphere(3000, seed=1)
    tree, build_paths = build_tree(x, levels=3, branching=4, batch_size=512, steps=8, seed=0)
    paths = route(tree, x)
    np.testing.assert_array_equal(paths, build_paths)  # build-time and query-time routing agree
    q = _sphere(500, seed=2)
    qp = route(tree, q)
    for i in range(len(q)):
        naive, _ = _naive_path(tree, q[i])
        assert list(qp[i]) == naive
    # Routing a point alone gives the same path as routing it within a batch.
    for i in (0, 17, 499):
        assert (route(tree, q[i : i + 1])[0] == qp[i]).all()
    # Paths are nested: the level-l id's parent is the level-(l-1) id.
    assert (paths[:, 1] // 4 == paths[:, 0]).all() and (paths[:, 2] // 4 == paths[:, 1]).all()


def test_balance_rule_enforces_limit_on_skewed_assignments():
    rng = np.random.default_rng(0)
    x = _sphere(6400, seed=3)
    assign = rng.choice(16, 6400, p=np.r_[0.6, np.full(15, 0.4 / 15)])
    assign[assign == 5] = 4  # an empty cluster too
    limit = int(np.ceil(1.1 * 6400 / 16))
    n = balance(x, assign, 16, limit, rng)
    counts = np.bincount(assign, minlength=16)
    assert n > 0 and counts.max() <= limit and counts.min() > 0 and counts.sum() == 6400


def test_balanced_tree_on_skewed_data():
    x = _sphere(20000, seed=4, skew=True)
    tree, _ = build_tree(x, levels=2, branching=8, seed=0)
    unbalanced, _ = build_tree(x, levels=2, branching=8, seed=0, balance_factor=1e9)
    ratio = level_stats(tree)[0]["balance_ratio"]
    ratio_off = level_stats(unbalanced)[0]["balance_ratio"]
    assert ratio < 1.35, level_stats(tree)
    assert ratio < ratio_off  # balancing is what makes the difference


def test_kmeans_is_deterministic_and_uses_fresh_batches():
    x = _sphere(5000, seed=5)
    a = balanced_kmeans(x, 8, batch_size=640, steps=5, rng=np.random.default_rng(7))
    b = balanced_kmeans(x, 8, batch_size=640, steps=5, rng=np.random.default_rng(7))
    np.testing.assert_array_equal(a.centroids, b.centroids)
    c = balanced_kmeans(x, 8, batch_size=640, steps=5, rng=np.random.default_rng(8))
    assert not np.array_equal(a.centroids, c.centroids)


def test_small_nodes_get_fewer_children_and_routing_stays_valid():
    x = _sphere(40, seed=6)
    tree, paths = build_tree(x, levels=3, branching=4, min_points_per_child=3, seed=0)
    stats = level_stats(tree)
    assert stats[2]["parents_with_fewer_children"] > 0
    for lvl in range(1, 4):
        assert tree.valid[lvl - 1][paths[:, lvl - 1]].all()
    q = _sphere(200, seed=7)
    qp = route(tree, q)
    for lvl in range(1, 4):
        assert tree.valid[lvl - 1][qp[:, lvl - 1]].all()


def test_save_load_roundtrip_and_corruption(tmp_path):
    x = _sphere(600, seed=8)
    tree, _ = build_tree(x, levels=2, branching=4, seed=0)
    meta = save_tree(tree, tmp_path, config={"levels": 2}, embedder={"model": None})
    assert meta["version"] == 1 and meta["format"] == "memtree-tree"
    back = load_tree(tmp_path)
    assert back.tree_id == tree.tree_id
    np.testing.assert_array_equal(route(back, x), route(tree, x))
    f = tmp_path / "centroids-l2.npy"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="centroids-l2.npy: checksum mismatch"):
        load_tree(tmp_path)


def test_too_few_windows_error_and_auto_reduce():
    from pipeline.run import effective_levels

    with pytest.raises(ValueError, match="at least 4096 windows"):
        effective_levels(1000, 3, 16, False)
    assert effective_levels(1000, 3, 16, True) == 2


def test_equalize_cells_balances_routing_cells_below_level_1():
    # Anisotropic clusters: k-means cells of such data are far from equal in size.
    rng = np.random.default_rng(11)
    scales = np.geomspace(0.3, 3.0, 24)
    centers = rng.normal(size=(24, 48))
    lab = rng.integers(0, 24, 24000)
    x = (centers[lab] + scales[lab, None] * rng.normal(size=(24000, 48))).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    plain, _ = build_tree(x, levels=2, branching=8, seed=0, equalize_steps=0)
    eq, paths = build_tree(x, levels=2, branching=8, seed=0, equalize_steps=40)
    r_plain = [s["balance_ratio"] for s in level_stats(plain)]
    r_eq = [s["balance_ratio"] for s in level_stats(eq)]
    # Isotropic noise inside a blob is the hard case; real embeddings: test_pipeline_e2e.
    assert r_eq[0] < r_plain[0] and r_eq[1] < r_plain[1], (r_plain, r_eq)
    np.testing.assert_array_equal(route(eq, x), paths)  # still plain nearest-centroid routing


def test_route_step_settles_float32_near_ties_in_float64():
    """Points all but equidistant from two children (gaps far below float32's resolution) get the
    float64 argmin, as does every other point; invalid children are never chosen."""
    from clustering.route_core import route_step

    rng = np.random.default_rng(5)
    B, d, n = 8, 64, 3000
    c = rng.normal(size=(B * B, d))
    c = (c / np.linalg.norm(c, axis=1, keepdims=True)).astype(np.float32)  # equal norms: midpoints tie
    valid = np.ones(B * B, dtype=bool)
    valid[[3, 17, 42]] = False
    parent = rng.integers(0, B, size=n)
    a = parent * B + rng.integers(0, B, size=n)
    b = parent * B + (a - parent * B + 1) % B
    t = rng.uniform(0.5 - 1e-6, 0.5 + 1e-6, size=(n, 1))
    x = (c[a].astype(np.float64) * t + c[b].astype(np.float64) * (1 - t)).astype(np.float32)
    x[: n // 3] = rng.normal(size=(n // 3, d)).astype(np.float32)  # and ordinary points
    got = route_step(c, valid, x, parent, B)
    for i in range(n):
        ids = np.arange(parent[i] * B, parent[i] * B + B)
        cc = c[ids].astype(np.float64)
        s = (cc * cc).sum(1) - 2.0 * cc @ x[i].astype(np.float64)
        s[~valid[ids]] = np.inf
        assert got[i] == ids[np.argmin(s)], i
    # one at a time, the same answers (nothing depends on the rest of the batch)
    for i in (0, 1500, n - 1):
        assert route_step(c, valid, x[i : i + 1], parent[i : i + 1], B)[0] == got[i]
