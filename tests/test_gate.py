"""The domain gate (`memtree.clustering.gate`) and the gated setting of the scorers: calibration on
a real tree's training windows, the gate's decisions, and `memtree eval tasks --gate` on a trained
run, where the gated column must equal the anchor alone item for item when the gate admits
nothing and fetched memory when it admits everything."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memtree.clustering.gate import GateSpec, calibrate, similarities
from memtree.clustering.route import route
from memtree.clustering.tree import build_tree, load_tree, save_tree
from memtree.eval.tasks import gated_result
from tests.conftest import train_tiny_run

REPO = Path(__file__).resolve().parents[1]


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def saved_tree(tmp_path_factory):
    """A 2 × 4 tree built on 4 tight topics in 32 dimensions, saved as a pipeline lays it out
    (tree/ beside embed/embeddings.npy); plus 40 points of a fifth topic it never saw."""
    rng = np.random.default_rng(0)
    centres = _unit(rng.standard_normal((5, 32)))
    x = _unit(np.repeat(centres[:4], 250, axis=0) + 0.15 * rng.standard_normal((1000, 32)))
    outside = _unit(centres[4] + 0.15 * rng.standard_normal((40, 32)))
    tree, _ = build_tree(x, levels=2, branching=4, batch_size=256, steps=8, seed=0)
    root = tmp_path_factory.mktemp("gate") / "pipeline"
    save_tree(tree, root / "tree", config={}, embedder={})
    (root / "embed").mkdir()
    np.save(root / "embed" / "embeddings.npy", x)
    return load_tree(root / "tree"), x, outside


@pytest.mark.parametrize(
    "text, level, quantile, threshold",
    [("3:0.01", 3, 0.01, None), ("leaf:0.05", -1, 0.05, None), ("2:=0.4", 2, None, 0.4)],
)
def test_gate_specs_parse(text, level, quantile, threshold):
    spec = GateSpec.parse(text)
    assert (spec.level, spec.quantile, spec.threshold) == (level, quantile, threshold)


@pytest.mark.parametrize(
    "text, says",
    [
        ("3", "LEVEL:QUANTILE"),
        ("x:0.1", "LEVEL:QUANTILE"),
        ("-2:0.1", "LEVEL:QUANTILE"),
        ("0:0.1", "gate level"),
        ("3:1.5", "gate quantile"),
        ("3:=2", "gate threshold"),
    ],
)
def test_bad_gate_specs_are_refused_with_the_reason(text, says):
    with pytest.raises(ValueError, match=says):
        GateSpec.parse(text)


def test_similarities_are_each_rows_cosine_to_its_routed_centroid(saved_tree):
    tree, x, outside = saved_tree
    q = np.concatenate([x[::50], outside])
    paths, sims = similarities(tree, q)
    assert np.array_equal(paths, route(tree, q))
    for lvl in range(1, tree.levels + 1):
        c = tree.centroids[lvl - 1][paths[:, lvl - 1]].astype(np.float64)
        want = (q.astype(np.float64) * c).sum(1) / np.linalg.norm(c, axis=1)
        assert np.allclose(sims[:, lvl - 1], want, atol=1e-5)


def test_a_calibrated_gate_admits_its_windows_and_refuses_another_topic(saved_tree):
    tree, x, outside = saved_tree
    gate = calibrate(tree, GateSpec.parse("leaf:0.05"))
    assert gate.level == 2 and gate.windows == len(x) and gate.quantile == 0.05
    assert gate.calibration.endswith("embed/embeddings.npy")
    _, sims = similarities(tree, x)
    share = gate.admit(sims).mean()
    assert 0.94 <= share <= 0.96, share  # the quantile's definition, on the windows it read
    _, far = similarities(tree, outside)
    assert not gate.admit(far).any(), far[:, 1].max()
    # an explicit threshold is used as given, with no calibration data read
    given = calibrate(tree, GateSpec.parse("1:=0.25"))
    assert (given.level, given.threshold, given.windows) == (1, 0.25, 0)
    assert np.array_equal(given.admit(sims), sims[:, 0] >= 0.25)


def test_calibration_errors_name_the_file_and_the_level(saved_tree, tmp_path):
    tree, *_ = saved_tree
    with pytest.raises(ValueError, match="the tree has 2 levels"):
        calibrate(tree, GateSpec.parse("3:0.01"))
    with pytest.raises(FileNotFoundError, match="nowhere.npy"):
        calibrate(tree, GateSpec.parse("2:0.01"), embeddings=tmp_path / "nowhere.npy")
    np.save(tmp_path / "wrong.npy", np.zeros((5, 7), dtype=np.float32))
    with pytest.raises(ValueError, match=r"shape \(n, 32\)"):
        calibrate(tree, GateSpec.parse("2:0.01"), embeddings=tmp_path / "wrong.npy")


def test_gated_results_take_each_item_from_its_setting():
    none = {
        "n": 3,
        "accuracy": 1 / 3,
        "accuracy_norm": 0.0,
        "predictions": [0, 1, 2],
        "predictions_norm": [1, 1, 1],
        "correct": [True, False, False],
        "correct_norm": [False, False, False],
    }
    fetched = {
        **none,
        "accuracy": 2 / 3,
        "predictions": [1, 0, 2],
        "correct": [False, True, True],
        "correct_norm": [True, True, True],
    }
    g = gated_result(none, fetched, np.array([False, True, True]))
    assert g["predictions"] == [0, 0, 2] and g["accuracy"] == 1.0 and g["admitted"] == 2
    assert g["accuracy_norm"] == pytest.approx(2 / 3)
    ppl_n = {"seq_nll": [2.0, 6.0], "seq_tokens": [2, 3], "n_docs": 2}
    ppl_f = {"seq_nll": [1.0, 3.0], "seq_tokens": [2, 3], "n_docs": 2}
    g = gated_result(ppl_n, ppl_f, np.array([True, False]))
    assert g["tokens"] == 5 and g["nll"] == pytest.approx((1.0 + 6.0) / 5) and g["n_docs"] == 2
    assert g["perplexity"] == pytest.approx(np.exp(7.0 / 5))
    with pytest.raises(ValueError, match="gate 3"):
        gated_result(ppl_n, ppl_f, np.array([True, False, True]))


@pytest.fixture(scope="module")
def gated_run(pipeline_run, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gaterun") / "run"
    shape = "model.shape={n_layers: 1, d_model: 32, n_heads: 1, head_dim: 32, ffn_dim: 128}"
    return train_tiny_run(
        pipeline_run[0] / "shards",
        folder,
        "data.batch_size=4",
        "max_duration=8ba",
        "optim.warmup=1ba",
        "memory.multipliers=[8,4]",
        "memory.lr=0.1",
        shape,
    )


def _suite(run: Path, out: Path, gate: str) -> dict:
    from memtree.cli import main

    argv = ["eval", "tasks", "eval/yamls/suite-example.yaml", str(run), "--out", str(out)]
    assert main([*argv, "--gate", gate]) == 0
    return json.loads((out / "results.json").read_text())


def test_eval_tasks_gate_none_is_the_anchor_and_all_is_fetched(
    gated_run, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(REPO)  # the example's task paths are relative to the repository root
    nothing = _suite(gated_run, tmp_path / "closed", "leaf:=1.0")
    everything = _suite(gated_run, tmp_path / "open", "1:=-1.0")
    assert nothing["modes"] == ["none", "generic", "fetched", "gated"]
    for name, task in nothing["tasks"].items():
        metric = task["metric"]
        shut, wide = task["modes"]["gated"], everything["tasks"][name]["modes"]["gated"]
        assert shut["admitted"] == 0 and wide["admitted"] == task["n"]
        assert shut[metric] == pytest.approx(task["modes"]["none"][metric], rel=1e-9)
        assert wide[metric] == pytest.approx(task["modes"]["fetched"][metric], rel=1e-9)
        if "predictions" in task["modes"]["none"]:
            assert shut["predictions"] == task["modes"]["none"]["predictions"]
            assert wide["predictions"] == task["modes"]["fetched"]["predictions"]
    # memory changes something on this run, so the two gated columns are not trivially equal
    assert any(
        t["modes"]["none"]["predictions"] != t["modes"]["fetched"]["predictions"]
        or t["modes"]["none"]["accuracy"] != t["modes"]["fetched"]["accuracy"]
        for t in nothing["tasks"].values()
        if "predictions" in t["modes"]["none"]
    ) or any(
        t["modes"]["none"]["perplexity"] != t["modes"]["fetched"]["perplexity"]
        for t in nothing["tasks"].values()
        if t["metric"] == "perplexity"
    )
    md = (tmp_path / "closed" / "report.md").read_text()
    assert "| + fetched, gated |" in md and "at least 1.0000 (given)" in md
    # a quantile calibrates on the pipeline's windows (embed/embeddings.npy beside the tree)
    q = _suite(gated_run, tmp_path / "q", "leaf:0.01")
    assert q["gate"]["quantile"] == 0.01 and q["gate"]["windows"] > 0
    assert "[gate] level 2" in capsys.readouterr().err


def test_eval_tasks_gate_windows_needs_gate(gated_run, tmp_path, monkeypatch, capsys):
    from memtree.cli import main

    monkeypatch.chdir(REPO)
    argv = ["eval", "tasks", "eval/yamls/suite-example.yaml", str(gated_run)]
    assert main([*argv, "--out", str(tmp_path / "x"), "--gate-windows", "e.npy"]) == 1
    assert "--gate-windows: only with --gate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--gate", "3:1.5"])
    assert "gate quantile: in [0, 1)" in capsys.readouterr().err


def test_the_demo_refuses_a_bad_gate_before_any_work(tmp_path, capsys):
    from memtree.cli import main

    with pytest.raises(SystemExit) as e:
        main(["demo", "--root", str(tmp_path / "demo"), "--gate", "leaf:2"])
    assert e.value.code == 2 and "gate quantile: in [0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()
