"""The tree built from its leaves up (`tree.method: bottomup`, clustering/bottomup.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from memtree.clustering.bottomup import MAX_LEAVES, build_tree_bottomup, group_balanced
from memtree.clustering.route import route
from memtree.clustering.tree import load_tree, save_tree


def _cost(c, w, lab):
    """The grouping objective, written out: Σ_i w_i |c_i − weighted mean of i's group|²."""
    total = 0.0
    for g in np.unique(lab):
        m = lab == g
        mu = (c[m] * w[m, None]).sum(0) / w[m].sum()
        total += float((((c[m] - mu) ** 2).sum(1) * w[m]).sum())
    return total


def _partitions(items, size):
    """Every partition of items into unordered groups of `size`."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        left = [i for i in rest if i not in others]
        for tail in _partitions(left, size):
            yield [(first, *others), *tail]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_balanced_finds_the_best_grouping_of_exactly_b(seed):
    rng = np.random.default_rng(seed)
    c, w = rng.normal(size=(12, 5)), rng.uniform(0.5, 3.0, 12)
    lab, cost = group_balanced(c, w, 3, rng=np.random.default_rng(seed))
    assert sorted(np.bincount(lab).tolist()) == [3, 3, 3, 3]
    best = min(
        _cost(c, w, np.array([g for i in range(12) for g, grp in enumerate(p) if i in grp]))
        for p in _partitions(list(range(12)), 3)
    )  # 15,400 partitions
    assert cost == pytest.approx(_cost(c, w, lab)) and cost == pytest.approx(best, rel=1e-9)


def test_group_balanced_leaves_no_improving_exchange():
    rng = np.random.default_rng(5)
    c, w = rng.normal(size=(48, 8)), rng.uniform(1.0, 2.0, 48)
    lab, cost = group_balanced(c, w, 4, restarts=2, rng=rng)
    assert np.bincount(lab).tolist() == [4] * 12
    # numbered by first member
    assert lab[0] == 0 and all(lab[:i].max() + 1 >= lab[i] for i in range(1, 48))
    for i, j in itertools.combinations(range(48), 2):
        if lab[i] != lab[j]:
            swapped = lab.copy()
            swapped[i], swapped[j] = lab[j], lab[i]
            assert _cost(c, w, swapped) >= cost - 1e-9 * cost
    with pytest.raises(ValueError, match="do not make groups of 5"):
        group_balanced(c, w, 5, rng=rng)


def _domains(seed: int = 0, n_per_leaf: int = 24, dim: int = 32):
    """16 'domains' placed at random on the sphere (no structure above them), 4 'subtopics' each,
    unit-normalised points: a 3-level × 4 tree whose level 2 should be the domains."""
    rng = np.random.default_rng(seed)
    dom = rng.normal(size=(16, dim))
    sub = dom[:, None, :] + 0.35 * rng.normal(size=(16, 4, dim))  # (16, 4, dim)
    centres = sub.reshape(64, dim)
    x = centres.repeat(n_per_leaf, 0) + 0.12 * rng.normal(size=(64 * n_per_leaf, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    labels = np.arange(64).repeat(n_per_leaf)
    return x.astype(np.float32), labels // 4, labels


def _purity(labels, clusters):
    return sum(np.bincount(labels[clusters == c]).max() for c in np.unique(clusters)) / len(labels)


def test_bottomup_keeps_every_domain_whole_and_its_tree_routes_like_any_tree(tmp_path):
    x, domain, subtopic = _domains()
    tree, paths = build_tree_bottomup(x, levels=3, branching=4, restarts=5, seed=0)
    assert _purity(domain, paths[:, 1]) >= 0.99 and _purity(subtopic, paths[:, 2]) >= 0.99
    assert tree.meta["method"] == "bottomup" and tree.meta["n_points"] == len(x)
    assert [c.shape for c in tree.centroids] == [(4, 32), (16, 32), (64, 32)]
    assert all(v.all() for v in tree.valid)
    # nested ids: a level-l cluster's parent is its id // B, as the format requires
    assert (paths[:, 1] // 4 == paths[:, 0]).all() and (paths[:, 2] // 4 == paths[:, 1]).all()
    assert [int(s.sum()) for s in tree.sizes] == [len(x)] * 3
    assert (tree.sizes[2] == np.bincount(paths[:, 2], minlength=64)).all()
    # a parent's centroid is the size-weighted mean of its children's
    for lv in (0, 1):
        child, below = tree.centroids[lv + 1].reshape(-1, 4, 32), tree.centroids[lv]
        cos = (
            (below * child.mean(1)).sum(1)
            / np.linalg.norm(below, axis=1)
            / np.linalg.norm(child.mean(1), axis=1)
        )
        assert cos.min() > 0.99
    save_tree(tree, tmp_path / "t", config={"method": "bottomup"}, embedder={"model": None})
    back = load_tree(tmp_path / "t")
    assert back.tree_id == tree.tree_id and (route(back, x) == paths).all()
    again, _ = build_tree_bottomup(x, levels=3, branching=4, restarts=5, seed=0)
    assert again.tree_id == tree.tree_id  # deterministic for a seed
    # a corpus with 1 % of its points dropped draws the same domains
    keep = np.sort(np.random.default_rng(1).permutation(len(x))[: len(x) - len(x) // 100])
    _, fewer = build_tree_bottomup(x[keep], levels=3, branching=4, restarts=5, seed=0)
    same = {(a, b) for a, b in zip(paths[keep, 1].tolist(), fewer[:, 1].tolist())}
    assert len(same) == 16  # one-to-one between the two trees' level-2 clusters


def test_bottomup_refuses_what_it_is_not_for():
    x, _, _ = _domains(n_per_leaf=1)
    with pytest.raises(ValueError, match="64 points for 64 leaves; it needs at least 128"):
        build_tree_bottomup(x, levels=3, branching=4)
    with pytest.raises(ValueError, match=f"more than the {MAX_LEAVES}"):
        build_tree_bottomup(x, levels=3, branching=16)


def test_the_pipeline_config_takes_the_method():
    import json

    from memtree.config import ConfigError, load_config, to_dict
    from memtree.pipeline.config import PipelineConfig
    from memtree.pipeline.run import STAGES

    tree = next(s for s in STAGES if s.name == "tree")
    default = load_config(PipelineConfig, {"out": "x"})
    # old trees kept
    assert default.tree.method == "topdown" and "method" not in tree.config(default)
    up = load_config(PipelineConfig, {"out": "x", "tree": {"method": "bottomup"}})
    assert tree.config(up)["method"] == "bottomup"
    assert json.dumps(tree.config(up)) != json.dumps(tree.config(default))
    with pytest.raises(ConfigError, match="method"):
        load_config(PipelineConfig, {"out": "x", "tree": {"method": "agglomerative"}})
    with pytest.raises(ConfigError, match="strict_balance: topdown's"):
        load_config(
            PipelineConfig, {"out": "x", "tree": {"method": "bottomup", "strict_balance": True}}
        )
    assert to_dict(up)["tree"]["method"] == "bottomup"
