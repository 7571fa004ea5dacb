"""A sharded bank on more ranks than level-1 subtrees: replica groups (README "Several nodes":
32 ranks over 16 subtrees put each subtree's rows on two ranks that reduce between themselves).

Here 4 real processes (gloo on the CPU, `composer -n 4 tests/train_launcher.py`) train over a
tree with 2 level-1 subtrees, so the ranks form 2 groups of 2 replicas; the run is checked
against one process reading the same batches, then stopped mid-run and resumed on 2 ranks
(2 groups of 1) and on 3 (1 group of 3 replicas holding every subtree: `place` never splits a
world unevenly, see `test_three_ranks_over_two_subtrees_are_one_group_of_three`)."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest
from train_launcher import lane_run_args, launch, read_log, run_weights, worst_diff

from memtree.memstore.format import read_manifest as read_bank_manifest
from memtree.memstore.format import verify_bank
from memtree.training.bank_shards import read_manifest
from memtree.training.config import load_train_config
from memtree.training.lanes import place, plan_lanes

STEPS, STOP = 8, 4
# tests/test_training_sharded.py's bounds (measured there at 2 / 4 ranks: ≤ 4.1e-7): the gradient
# sums round differently at another world size, nothing more
ANCHOR_ATOL, BANK_ATOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def two_subtrees(pipeline_run, tmp_path_factory, dask_client):
    """`pipeline_run`'s corpus through a 2 × 2 tree: a copy of its run with the tree onward redone
    (ingest … embed keep their fingerprints, so the copy skips them); returns the shards folder."""
    from memtree.config import load_config
    from memtree.pipeline.config import PipelineConfig
    from memtree.pipeline.run import run_pipeline
    from tests.conftest import PIPELINE_OVERRIDES

    src, _, _, corpus = pipeline_run
    out = tmp_path_factory.mktemp("replicas") / "run"
    shutil.copytree(
        src,
        out,
        symlinks=True,
        ignore=shutil.ignore_patterns("tree", "assign", "shards", "report", ".work"),
    )
    cfg = load_config(
        PipelineConfig,
        {"out": str(out), "ingest": {"inputs": [str(corpus)]}},
        [*PIPELINE_OVERRIDES, "tree.branching=2"],
    )
    run_pipeline(cfg, client=dask_client, log=lambda m: None)
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    assert int(manifest["branching"]) == 2
    assert sorted(int(s["subtree"]) for s in manifest["streams"] if int(s["n_samples"]) > 0) == [
        0,
        1,
    ]
    return out / "shards"


def _args(shards: Path, folder: Path, *extra: str) -> list[str]:
    return lane_run_args(shards, folder, *extra, run_name="replicas", steps=STEPS, save_every=STOP)


_weights, _worst = run_weights, worst_diff


def _same_weights(folder: Path, ref: Path) -> None:
    (anchor, bank), (ref_anchor, ref_bank) = _weights(folder), _weights(ref)
    assert _worst(anchor, ref_anchor) <= ANCHOR_ATOL
    assert _worst(bank, ref_bank) <= BANK_ATOL


def _same_export(folder: Path, ref: Path) -> None:
    """The exported bank: a valid memtree-bank of the same layout, tree and slots as `ref`'s
    (its rows' values are `_same_weights`'s business)."""
    assert verify_bank(folder / "bank")["levels"] == [1, 2]
    a, b = read_bank_manifest(folder / "bank"), read_bank_manifest(ref / "bank")
    assert (a.anchor, a.memory, a.dtype, a.tree_id, a.levels) == (
        b.anchor,
        b.memory,
        b.dtype,
        b.tree_id,
        b.levels,
    )
    assert a.manifest["layout_digest"] == b.manifest["layout_digest"]
    assert sorted(p.name for p in (folder / "bank").iterdir()) == sorted(
        p.name for p in (ref / "bank").iterdir()
    )
    for p in (ref / "bank").iterdir():
        assert (folder / "bank" / p.name).stat().st_size == p.stat().st_size, p.name
    assert (folder / "bank" / "manifest.json").read_text() == (
        ref / "bank" / "manifest.json"
    ).read_text()


@pytest.fixture(scope="module")
def one_process(two_subtrees, tmp_path_factory):
    """The reference: one process, whole bank, reading the lanes (the batches every world size
    reads)."""
    from streaming.base.util import clean_stale_shared_memory
    from train_launcher import BatchLog

    from memtree.training.train import train

    folder = tmp_path_factory.mktemp("replicas-one") / "one"
    log = folder.parent / "one.batches.jsonl"
    clean_stale_shared_memory()
    train(load_train_config(None, _args(two_subtrees, folder)), callbacks=[BatchLog(log)])
    clean_stale_shared_memory()
    return folder, read_log(log)


@pytest.fixture(scope="module")
def four_ranks(two_subtrees, one_process, tmp_path_factory):
    """4 ranks, bank sharded, uninterrupted: (save folder, batch log, per-rank reports)."""
    root = tmp_path_factory.mktemp("replicas-four")
    folder, log, rep = root / "four", root / "four.batches.jsonl", root / "report"
    launch(4, _args(two_subtrees, folder, "parallel.bank=sharded"), log=log, report=rep)
    return (
        folder,
        read_log(log),
        [json.loads(p.read_text()) for p in sorted(rep.glob("rank*.json"))],
    )


def _same_batches(batches: list[dict], ref: list[dict]) -> None:
    assert [b["step"] for b in batches] == list(range(1, STEPS + 1))
    assert [b["samples"] for b in batches] == [b["samples"] for b in ref]


def test_three_ranks_over_two_subtrees_are_one_group_of_three():
    """`place` splits a world into equal groups only: 3 ranks over 2 subtrees is one group of 3
    replicas, each holding both subtrees' rows, and asking for 2 shards on 3 ranks is refused."""
    plan = plan_lanes(
        [{"subtree": s, "n_samples": 40, "name": f"subtree-{s:03d}"} for s in (0, 1)], batch_size=8
    )
    pl = place(plan, branching=2, world=3)
    assert (pl.groups, pl.replicas, pl.holds) == (1, 3, ((0, 1),))
    assert [pl.group_of(r) for r in range(3)] == [0, 0, 0] and [
        pl.replica_of(r) for r in range(3)
    ] == [0, 1, 2]
    pl = place(plan, branching=2, world=4)
    assert (pl.groups, pl.replicas, pl.holds) == (2, 2, ((0,), (1,)))
    assert [pl.group_of(r) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="parallel.bank_shards 2 must divide the 3 ranks"):
        place(plan, branching=2, world=3, groups=2)


def test_four_ranks_over_two_subtrees_are_two_replica_groups_and_train_like_one_process(
    one_process, four_ranks
):
    ref, ref_batches = one_process
    folder, batches, reports = four_ranks
    _same_batches(batches, ref_batches)
    assert [b["world"] for b in batches] == [4] * STEPS
    _same_weights(folder, ref)
    _same_export(folder, ref)
    # every subtree's rows on exactly two ranks: groups {0, 1} and {2, 3}
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    held = collections.Counter(s for r in reports for s in r["shard"])
    assert held == {0: 2, 1: 2}
    # ranks 0-1 are group 0 and 2-3 group 1 (`Placement.group_of`), each group one subtree
    assert reports[0]["shard"] == reports[1]["shard"] != reports[2]["shard"] == reports[3]["shard"]
    assert sorted(reports[0]["shard"] + reports[2]["shard"]) == [0, 1]
    for r in reports:
        # its subtree's rows per level, plus the generic row
        assert r["rows"] == {"1": 1 + 1, "2": 2 + 1}
        # the replicas exchanged their rows' gradients within the group; no bank row went world-wide
        assert r["comm_bytes"]["bank_group_all_gather"] > 0
        assert "bank_rows_all_gather" not in r["comm_bytes"]
    # replicas hold the same rows bit for bit (each reduced both replicas' gradients), and the two
    # groups other rows (each only its own subtree's, and only the generic row all-reduced)
    assert reports[0]["table_sha"] == reports[1]["table_sha"]
    assert reports[2]["table_sha"] == reports[3]["table_sha"]
    assert reports[0]["table_sha"] != reports[2]["table_sha"]
    # each subtree's file written once, by its group's first replica
    man = read_manifest(folder / "checkpoints" / "bank" / f"ba{STEPS}")
    assert man["saved_by"] == {"world": 4, "groups": 2, "replicas": 2}
    assert sorted(man["files"]) == [
        "generic.safetensors",
        "subtree-000.safetensors",
        "subtree-001.safetensors",
    ]


@pytest.fixture(scope="module")
def stopped(two_subtrees, tmp_path_factory):
    """The 4-rank run stopped, like a kill, right after its checkpoint at batch STOP."""
    root = tmp_path_factory.mktemp("replicas-stopped")
    folder, log = root / "run", root / "run.batches.jsonl"
    launch(4, _args(two_subtrees, folder, "parallel.bank=sharded"), log=log, stop_at=STOP)
    assert not (folder / "bank").exists()  # it never reached the end
    man = read_manifest(folder / "checkpoints" / "bank" / f"ba{STOP}")
    assert man["saved_by"] == {"world": 4, "groups": 2, "replicas": 2}
    return folder, log


@pytest.mark.parametrize("then", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_replicated_shard_run_stopped_mid_run_resumes_on_fewer_ranks(
    two_subtrees, one_process, four_ranks, stopped, tmp_path, then
):
    """Resumed on 2 ranks (a group per subtree, no replicas) and on 3 (one group of 3 replicas):
    the same batches, and the uninterrupted 4-rank run's weights and exported bank."""
    ref, ref_batches = one_process
    four = four_ranks[0]
    src, src_log = stopped
    folder, log = tmp_path / "run", tmp_path / "run.batches.jsonl"
    shutil.copytree(src, folder, symlinks=True)  # each resume from its own copy of the stopped run
    shutil.copy(src_log, log)
    launch(then, _args(two_subtrees, folder, "parallel.bank=sharded"), log=log)
    batches = read_log(log)
    assert [b["world"] for b in batches] == [4] * STOP + [then] * (STEPS - STOP)
    _same_batches(batches, ref_batches)
    _same_weights(folder, four)
    _same_weights(folder, ref)
    _same_export(folder, four)
    man = read_manifest(folder / "checkpoints" / "bank" / f"ba{STEPS}")
    assert man["saved_by"] == {
        "world": then,
        "groups": {2: 2, 3: 1}[then],
        "replicas": {2: 1, 3: 3}[then],
    }
