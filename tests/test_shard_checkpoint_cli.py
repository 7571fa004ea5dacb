"""Issue 56, items 1 and 5: a sharded run's bank checkpoints (`memtree-bank-shards`) through the
CLI, and their retention. One real 2-process gloo run (`composer -n 2 tests/train_launcher.py`) with
`parallel.bank: sharded`, saving every 2 batches and keeping 2 Composer checkpoints, is shared by
the module; `memtree memstore info / verify / export` run on its checkpoints as subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from train_launcher import launch

from memtree.geometry import AnchorShape, MemoryConfig
from memtree.memstore.format import read_manifest as read_bank_manifest
from memtree.training.bank import TrainableBank
from memtree.training.bank_shards import (
    BankShardCheckpoints,
    checkpoint_batches,
    composer_checkpoint_batches,
    read_manifest,
    save_shards,
)
from memtree.training.data import read_shards_manifest
from memtree.training.optim import MemoryAdamW

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY, KEEP = 6, 2, 2


def memstore_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memtree", "memstore", *map(str, args)],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        },
    )


def ok(*args: str) -> str:
    r = memstore_cli(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def sharded(pipeline_run, tmp_path_factory):
    """(run folder, pipeline run folder, the final bank checkpoint) of a 2-rank sharded run whose
    bank exports as int8 (not the default dtype, so `export` must take it from the checkpoint)."""
    run, shards = pipeline_run[0], pipeline_run[0] / "shards"
    folder = tmp_path_factory.mktemp("shard-cli") / "run"
    launch(
        2,
        [
            f"data.shards={shards}",
            "data.batch_size=8",
            f"max_duration={STEPS}ba",
            f"save_interval={EVERY}ba",
            f"save_num_checkpoints_to_keep={KEEP}",
            "autoresume=true",
            "run_name=shard-cli",
            "mode=scratch",
            "memory.multipliers=[8,4]",
            "memory.export_dtype=int8",
            "optim.warmup=2ba",
            "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}",
            f"save_folder={folder}",
            "parallel.bank=sharded",
        ],
    )
    return folder, run, folder / "checkpoints" / "bank" / f"ba{STEPS}"


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_info_describes_the_checkpoint(sharded):
    folder, run, ckpt = sharded
    # what the run exported: an independent account of the shapes
    bank = read_bank_manifest(folder / "bank")
    B = int(read_shards_manifest(run / "shards")["branching"])
    info = json.loads(ok("info", ckpt, "--json"))
    assert info["format"] == "memtree-bank-shards" and info["batch"] == STEPS
    assert info["saved_by"] == {"world": 2, "groups": 2, "replicas": 1}
    assert info["branching"] == B == bank.memory.branching
    assert sorted(map(int, info["levels"])) == sorted(bank.levels)
    for lv, v in info["levels"].items():
        assert v["rows_per_subtree"] == B ** (int(lv) - 1)
        assert v["params_per_row"] == bank.levels[int(lv)].params
        assert v["rows"] == bank.levels[int(lv)].n_slots  # every cluster's row and the generic one
    on_disk = {p.name: p.stat().st_size for p in ckpt.iterdir() if p.name != "manifest.json"}
    assert {n: e["bytes"] for n, e in info["files"].items()} == on_disk and info["bytes"] == sum(
        on_disk.values()
    )
    assert info["export"]["dtype"] == "int8" and info["export"]["tree_id"] == bank.tree_id
    assert info["memory"]["multipliers"] == [8, 4] and info["anchor"]["d_model"] == 64
    text = ok("info", ckpt)
    assert (
        f"batch {STEPS}" in text
        and "saved by 2 ranks: 2 memory-parallel groups × 1 replica" in text
    )
    assert f"{B + 1} files ({B} subtrees + generic)" in text and "export: dtype int8" in text


def test_verify_passes_and_checks_the_tree(sharded):
    _, run, ckpt = sharded
    B = int(read_shards_manifest(run / "shards")["branching"])
    r = json.loads(ok("verify", ckpt, "--json"))
    assert r["files"] == B + 1 and r["batch"] == STEPS
    assert r["bytes"] == sum(p.stat().st_size for p in ckpt.iterdir() if p.name != "manifest.json")
    assert "match their sha256" in ok("verify", ckpt, "--tree", run / "tree")
    # the folder of checkpoints is not one: the error names the ones there
    r = memstore_cli("verify", ckpt.parent)
    assert r.returncode == 1 and f"give one, e.g. {ckpt}" in r.stderr


def test_export_writes_the_runs_own_bank_byte_for_byte(sharded, tmp_path):
    folder, _, ckpt = sharded
    out = tmp_path / "bank"
    text = ok("export", ckpt, "--out", out)
    assert f"batch {STEPS}" in text and "dtype int8" in text
    _same_files(folder / "bank", out)
    # an existing bank with trained weights is replaced only with --force, as `init` does
    r = memstore_cli("export", ckpt, "--out", out)
    assert r.returncode == 1 and "add --force" in r.stderr
    assert json.loads(ok("export", ckpt, "--out", out, "--force", "--json"))["replaced"] is True
    _same_files(folder / "bank", out)


def test_an_older_checkpoint_without_its_export_settings_needs_the_flags(sharded, tmp_path):
    folder, _, ckpt = sharded
    old = tmp_path / f"ba{STEPS}"
    shutil.copytree(ckpt, old)
    man = json.loads((old / "manifest.json").read_text())
    export = man.pop("export")
    (old / "manifest.json").write_text(json.dumps(man))
    r = memstore_cli("export", old, "--out", tmp_path / "x")
    assert r.returncode == 1 and "give --dtype" in r.stderr and not (tmp_path / "x").exists()
    r = memstore_cli("export", old, "--out", tmp_path / "x", "--dtype", "int8")
    assert r.returncode == 1 and "give --tree-id" in r.stderr
    ok(
        "export",
        old,
        "--out",
        tmp_path / "x",
        "--dtype",
        "int8",
        "--tree-id",
        export["tree_id"],
        "--anchor-name",
        export["anchor_name"],
    )
    _same_files(folder / "bank", tmp_path / "x")
    # a tree id other than the recorded one is refused
    r = memstore_cli("export", ckpt, "--out", tmp_path / "y", "--tree-id", "another-tree")
    assert r.returncode == 1 and "trained on tree" in r.stderr and not (tmp_path / "y").exists()


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_subtree_file_is_named_and_export_refuses(sharded, tmp_path):
    _, _, ckpt = sharded
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    _flip(bad / "subtree-003.safetensors")
    r = memstore_cli("verify", bad)
    assert r.returncode == 1
    assert f"{bad / 'subtree-003.safetensors'}: sha256" in r.stderr and "corrupt" in r.stderr
    assert "subtree-002" not in r.stderr  # only the bad file is named
    r = memstore_cli("export", bad, "--out", tmp_path / "out")
    assert r.returncode == 1 and str(bad / "subtree-003.safetensors") in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_missing_subtree_file_is_named(sharded, tmp_path):
    _, _, ckpt = sharded
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "subtree-001.safetensors").unlink()
    r = memstore_cli("verify", bad, "--json")
    assert r.returncode == 1 and f"{bad / 'subtree-001.safetensors'}: missing" in r.stderr


def test_bank_checkpoints_follow_composers_retention(sharded):
    folder, _, _ = sharded
    ckpts = folder / "checkpoints"
    composer = composer_checkpoint_batches(ckpts)
    assert len(composer) == KEEP and max(composer) == STEPS  # Composer rotated out the older saves
    assert checkpoint_batches(ckpts / "bank") == sorted(composer)
    # no partial folders
    assert not [p.name for p in (ckpts / "bank").iterdir() if p.name.startswith(".")]


ANCHOR = AnchorShape(
    name="t", n_layers=2, d_model=16, n_heads=2, head_dim=8, ffn_dim=32, vocab_size=50
)
MEM = MemoryConfig(multipliers=(4, 2), branching=4)


def test_prune_keeps_what_composer_keeps_and_the_latest(tmp_path):
    """After a resume (Composer never rotates out the checkpoints of the run it resumed from) or
    with save_num_checkpoints_to_keep: -1 the Composer files stay, and so do their bank checkpoints;
    a bank checkpoint whose Composer checkpoint is gone (rotated, or the run died between the two
    savers) goes, except the latest, which the final export reads."""
    bank = TrainableBank(ANCHOR, MEM, seed=2, shard=(0, 1, 2, 3))
    opt = MemoryAdamW([{"params": list(bank.bank_parameters())}], lr=1e-2)
    ckpts = tmp_path / "checkpoints"
    for b in (2, 4, 6, 8, 10):
        save_shards(
            ckpts / "bank",
            b,
            bank,
            opt,
            replica=0,
            world_meta={"world": 1, "groups": 1, "replicas": 1},
        )
    (ckpts / "bank" / ".ba12.partial").mkdir()  # a save killed midway
    for b in (4, 8):
        (ckpts / f"ep0-ba{b}-rank0.pt").write_bytes(b"")
    (ckpts / "latest-rank0.pt").symlink_to("ep0-ba8-rank0.pt")
    saver = BankShardCheckpoints(ckpts / "bank", "2ba", replica=0, world_meta={})
    saver.last_saved = 10
    assert saver.prune() == [2, 6, 12]
    assert checkpoint_batches(ckpts / "bank") == [4, 8, 10]
    assert read_manifest(ckpts / "bank" / "ba4")["batch"] == 4
