"""Multi-rank usability (issue 56): the per-rank placement line, the CPU thread default, the comm
byte total with the anchor's DDP all-reduce, and a run that loses a rank ending with what is
intact and the command that resumes. Real 2-process gloo runs through `composer -n 2`
(tests/train_launcher.py): one whose rank 1 is SIGKILLed mid-step, then the command it prints."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from train_launcher import REPO, launch

from memtree.config import ConfigError
from memtree.geometry import plan
from memtree.training.bank import TrainableBank
from memtree.training.bank_shards import verify_shards
from memtree.training.config import load_train_config
from memtree.training.data import read_shards_manifest, selected_streams, tokenizer_vocab_size
from memtree.training.lanes import place, plan_lanes
from memtree.training.parallel import ParallelLayout
from memtree.training.ranks import (
    cpu_thread_count,
    lost_rank,
    placement_line,
    rank_placement,
    resume_command,
)

# rank 1 dies in batch 3: the checkpoint of batch 2 is the last complete one
STEPS, SAVE, DIE = 5, 2, 3
BATCH = 8


def _args(shards: Path, folder: Path) -> list[str]:
    return [
        f"data.shards={shards}",
        f"data.batch_size={BATCH}",
        f"max_duration={STEPS}ba",
        f"save_interval={SAVE}ba",
        "run_name=ranks",
        "mode=scratch",
        "memory.multipliers=[8,4]",
        "memory.export_dtype=fp32",
        "optim.warmup=1ba",
        "save_num_checkpoints_to_keep=-1",
        "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}",
        f"save_folder={folder}",
        "parallel.bank=sharded",
    ]


@pytest.fixture(scope="module")
def runs(pipeline_run, tmp_path_factory):
    """(shards, folder, output of the run that lost rank 1, the resume command it printed, output of
    that command). The resume appends overrides outside the fingerprint (threads, the DDP hook),
    which must not stop it resuming."""
    shards = pipeline_run[0] / "shards"
    folder = tmp_path_factory.mktemp("ranks") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OMP_NUM_THREADS", raising=False)  # the default under test: no user choice
        died = launch(2, _args(shards, folder), die=(1, DIE), check=False, timeout=600)
        out = died.stdout + died.stderr
        m = re.search(r"^\[rank 0\] resume with: (.+)$", out, re.MULTILINE)
        assert died.returncode != 0 and m, out[-3000:]
        words = shlex.split(m.group(1))
        at = words.index("--die")  # the test's own kill switch, which would kill the rerun again
        rerun = shlex.join(words[:at] + words[at + 2 :] + ["cpu_threads=2", "comm_ddp_hook=false"])
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        }
        resumed = subprocess.run(
            ["bash", "-c", rerun],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    return shards, folder, died, m.group(1), resumed


def _expected_placement(shards: Path, world: int) -> tuple[dict, list[dict]]:
    """Per rank, what it should hold and read, from `training.lanes.place` and the tree's shape."""
    manifest = read_shards_manifest(shards)
    B = int(manifest["branching"])
    lanes = plan_lanes(selected_streams(manifest), batch_size=BATCH)
    pl = place(lanes, branching=B, world=world)
    cfg = load_train_config(None, _args(shards, Path("unused")))
    geo = plan(cfg.anchor_shape(tokenizer_vocab_size(shards, manifest)), cfg.memory_config(B))
    out = []
    for r in range(world):
        g = pl.group_of(r)
        held = pl.holds[g]
        rows = {lv.level: len(held) * B ** (lv.level - 1) + 1 for lv in geo.levels if lv.multiplier}
        width = {lv.level: lv.block_params for lv in geo.levels if lv.multiplier}
        out.append(
            {
                "group": g,
                "subtrees": list(held),
                "rows": rows,
                "bank_bytes": sum(rows[lv] * width[lv] * 4 for lv in rows),
                "state_bound": sum(rows[lv] * (width[lv] * 8 + 16) for lv in rows),
                "lanes": [
                    (f"subtree-{lanes.subtrees[k]:03d}", lanes.per_step[k]) for k in pl.lanes[g]
                ],
            }
        )
    return {"branching": B, "geometry": geo}, out


def _placements(out: str) -> dict[int, str]:
    return {
        int(m.group(1)): m.group(0)
        for m in re.finditer(r"^placement: rank (\d+) of 2 .*$", out, re.MULTILINE)
    }


def _metrics(out: str) -> list[dict[str, int]]:
    """Rank 0's console metrics per logged batch: {comm/bytes/<kind>: bytes}."""
    blocks = re.split(r"^\[batch=\d+/\d+\]:$", out, flags=re.MULTILINE)[1:]
    return [
        {k: int(v) for k, v in re.findall(r"Train (comm/bytes/\S+): (\d+)$", b, re.MULTILINE)}
        for b in blocks
    ]


def test_each_rank_prints_its_placement_and_its_threads(runs):
    shards, _, died, _, resumed = runs
    _, want = _expected_placement(shards, 2)
    cores = len(os.sched_getaffinity(0))
    for out, threads in (
        (died.stdout, f"{max(1, cores // 2)} (auto: {cores} usable cores / 2 local ranks)"),
        (resumed.stdout, "2 (cpu_threads=2)"),
    ):  # printed to stdout
        lines = _placements(out)
        assert sorted(lines) == [0, 1], out[-3000:]
        for r, w in enumerate(want):
            line = lines[r]
            assert f"(bank shard {w['group']} of 2, replica 0 of 1)" in line
            assert f"holds level-1 subtrees {w['subtrees']}:" in line
            per = ", ".join(f"L{lv} {n}" for lv, n in sorted(w["rows"].items()))
            assert f"bank {sum(w['rows'].values())} rows ({per}), {w['bank_bytes']:,} B" in line
            assert f"AdamW state up to {w['state_bound']:,} B" in line
            lanes = ", ".join(f"{name} ({b}/step)" for name, b in w["lanes"])
            assert (
                f"reads lanes {lanes}: {sum(b for _, b in w['lanes'])} of {BATCH} samples per step"
                in line
            )
            assert line.endswith(f"torch threads {threads}"), line


def test_the_comm_total_holds_the_anchors_ddp_all_reduce_unless_the_hook_is_off(runs):
    shards, _, died, _, resumed = runs
    info, _ = _expected_placement(shards, 2)
    ring = 2 * (2 - 1) / 2
    anchor = info["geometry"].anchor_params * 4  # fp32 gradients, every anchor parameter trains
    steps = [m for m in _metrics(died.stderr) if m]  # Composer's console logger writes to stderr
    assert len(steps) >= DIE - 1, died.stderr[-3000:]
    for m in steps:
        parts = {k: v for k, v in m.items() if k != "comm/bytes/step_total"}
        assert set(parts) == {
            "comm/bytes/anchor_ddp_all_reduce",
            "comm/bytes/bank_generic_all_reduce",
            "comm/bytes/control",
        }
        assert m["comm/bytes/step_total"] == sum(parts.values())
        assert m["comm/bytes/anchor_ddp_all_reduce"] == anchor * ring
    # comm_ddp_hook=false: the anchor is not counted, and the sum does not claim to be the total
    later = [m for m in _metrics(resumed.stderr) if m]
    assert later, resumed.stderr[-3000:]
    for m in later:
        assert "comm/bytes/step_total" not in m and "comm/bytes/anchor_ddp_all_reduce" not in m
        assert (
            m["comm/bytes/step_total_excl_anchor"]
            == m["comm/bytes/bank_generic_all_reduce"] + m["comm/bytes/control"]
        )


def test_a_killed_rank_ends_with_the_intact_checkpoints_and_a_resume_command_that_works(runs):
    shards, folder, died, command, resumed = runs
    out = died.stdout + died.stderr
    assert "Rank 1 crashed with exit code -9" in out
    # the survivor's exit code (EX_TEMPFAIL), not a crash's 1
    assert died.returncode == 75, out[-3000:]
    assert "Traceback" not in out, out[-5000:]
    tail = out[out.index("Rank 1 crashed") :].strip().splitlines()
    assert len(tail) <= 10, "\n".join(tail)  # the launcher's few lines and the survivor's message
    ckpts = folder / "checkpoints"
    B = int(read_shards_manifest(shards)["branching"])
    assert (
        f"[rank 0] intact: Composer checkpoint {ckpts / f'ep0-ba{SAVE}-rank0.pt'} (batch {SAVE})"
        in out
    )
    # what the message claims, checked here
    assert verify_shards(ckpts / "bank" / f"ba{SAVE}")["files"] == B + 1
    assert (
        f"[rank 0] intact: bank shards {ckpts / 'bank' / f'ba{SAVE}'} "
        f"({B + 1} files, sha256 verified)" in out
    )
    assert re.search(
        r"^\[rank 0\] training stopped after \d+ batches: rank 1 is gone", out, re.MULTILINE
    ), out[-3000:]
    assert command.startswith("composer -n 2 ") and command.endswith(" autoresume=true")
    # the printed command (less the test's --die) resumes from batch SAVE and finishes
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    batches = [int(b) for b in re.findall(r"^\[batch=(\d+)/\d+\]:$", resumed.stderr, re.MULTILINE)]
    assert batches == list(range(SAVE + 1, STEPS + 1))
    assert (folder / "bank" / "manifest.json").is_file() and (
        folder / "anchor.safetensors"
    ).is_file()


# --- without a launcher ---------------------------------------------------------------------------


def test_cpu_threads_default_and_overrides():
    assert cpu_thread_count("auto", cores=2, local_ranks=2, env={}) == (
        1,
        "auto: 2 usable cores / 2 local ranks",
    )
    assert cpu_thread_count("auto", cores=16, local_ranks=3, env={})[0] == 5
    assert cpu_thread_count("auto", cores=2, local_ranks=4, env={})[0] == 1  # at least one
    # the user's
    assert cpu_thread_count("auto", cores=8, local_ranks=2, env={"OMP_NUM_THREADS": "3"})[0] is None
    # a lone process: torch's own
    assert cpu_thread_count("auto", cores=8, local_ranks=1, env={})[0] is None
    # the key wins
    assert cpu_thread_count(6, cores=8, local_ranks=2, env={"OMP_NUM_THREADS": "3"})[0] == 6
    assert load_train_config(None, ["data.shards=x", "cpu_threads=3"]).cpu_threads == 3
    base = load_train_config(None, ["data.shards=x"])
    assert base.cpu_threads == "auto" and base.comm_ddp_hook is True
    for bad in ("0", "many", "1.5", "true"):
        with pytest.raises(ConfigError, match="cpu_threads"):
            load_train_config(None, ["data.shards=x", f"cpu_threads={bad}"])
    # how a run is placed and measured, not what it trains: a run resumes with them changed
    other = load_train_config(None, ["data.shards=x", "cpu_threads=1", "comm_ddp_hook=false"])
    assert other.fingerprint() == base.fingerprint()


def test_the_resume_command_is_the_launch_with_autoresume():
    argv = [
        "training/train.py",
        "cfg.yaml",
        "autoresume=false",
        "model.shape={n_layers: 2}",
        "seed=1",
    ]
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    assert resume_command(argv, env) == (
        "composer -n 4 training/train.py cfg.yaml 'model.shape={n_layers: 2}' "
        "seed=1 autoresume=true"
    )
    nodes = resume_command(
        argv, {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "7"}
    )
    assert nodes.startswith(
        "on each of the 2 nodes: composer -n 4 --world_size 8 --node_rank K --master_addr h"
    )
    # ranks started as a module (`composer -m` / `torchrun -m`): argv[0] is the module's file
    argv[0] = "/site-packages/memtree/training/train.py"
    assert resume_command(argv, env, "memtree.training.train") == (
        "composer -n 4 -m memtree.training.train cfg.yaml "
        "'model.shape={n_layers: 2}' seed=1 autoresume=true"
    )
    elastic = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
    assert resume_command(argv, elastic, "memtree.training.train").endswith(
        "--node-rank K --master-addr HEAD --master-port PORT -m memtree.training.train cfg.yaml "
        "'model.shape={n_layers: 2}' seed=1 autoresume=true"
    )


def test_what_counts_as_a_lost_rank():
    gone = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:525] Read error "
        "[127.0.0.1]:34471: Connection reset by peer"
    )
    assert lost_rank(gone, 2) and not lost_rank(gone, 1)
    assert lost_rank(SystemExit(128 + 15), 2) and not lost_rank(SystemExit(1), 2)
    try:
        try:
            raise gone
        except RuntimeError as e:
            raise ValueError("while handling it") from e
    except ValueError as wrapped:
        assert lost_rank(wrapped, 2)
    assert not lost_rank(ValueError("a bug"), 2) and not lost_rank(
        RuntimeError("CUDA out of memory"), 2
    )


def test_a_replicated_bank_with_lanes_is_placed_as_whole_bank_and_its_groups_lanes(pipeline_run):
    shards = pipeline_run[0] / "shards"
    info, want = _expected_placement(shards, 2)
    manifest = read_shards_manifest(shards)
    B = info["branching"]
    streams = selected_streams(manifest)
    lanes = plan_lanes(streams, batch_size=BATCH)
    pl = place(lanes, branching=B, world=2)
    cfg = load_train_config(None, [*_args(shards, Path("unused"))[:-1], "parallel.data=lanes"])
    bank = TrainableBank(info["geometry"].anchor, cfg.memory_config(B), init="empty")
    whole = {lv.level: lv.n_blocks + 1 for lv in info["geometry"].levels if lv.multiplier}
    for r in range(2):
        layout = ParallelLayout(
            plan=lanes, placement=pl, rank=r, manifest=manifest, streams=streams, shard=None
        )
        line = placement_line(
            rank_placement(rank=r, world=2, bank=bank, layout=layout, cfg=cfg, threads="1 (x)")
        )
        assert line.startswith(
            f"placement: rank {r} of 2 (lane group {want[r]['group']} of 2, replica 0 of 1) "
            f"holds all {B} level-1 subtrees: bank {sum(whole.values())} rows"
        )
        assert "reads lanes " + ", ".join(f"{n} ({b}/step)" for n, b in want[r]["lanes"]) in line
    # one process reading the lanes (the sharded runs' reference) says so in its short line
    one = ParallelLayout(
        plan=lanes,
        placement=place(lanes, branching=B, world=1),
        rank=0,
        manifest=manifest,
        streams=streams,
        shard=None,
    )
    line = placement_line(
        rank_placement(rank=0, world=1, bank=bank, layout=one, cfg=cfg, threads="2 (x)")
    )
    assert line.startswith(f"placement: one rank; bank (whole) {sum(whole.values())} rows, ")
    assert line.endswith(f"; reads {len(streams)} lanes; torch threads 2 (x)")


def test_a_single_rank_run_prints_one_short_placement_line(pipeline_run, tmp_path, capfd):
    import torch
    from streaming.base.util import clean_stale_shared_memory

    from memtree.training.train import train

    shards = pipeline_run[0] / "shards"
    before = torch.get_num_threads()
    clean_stale_shared_memory()
    try:
        train(
            load_train_config(
                None, [*_args(shards, tmp_path / "one")[:-1], "max_duration=1ba", "cpu_threads=1"]
            )
        )
    finally:
        torch.set_num_threads(before)
        clean_stale_shared_memory()
    lines = [x for x in capfd.readouterr().out.splitlines() if x.startswith("placement:")]
    B = int(read_shards_manifest(shards)["branching"])
    # memory.multipliers [8, 4]: B and B² blocks, each level with its generic row
    rows = (B + 1) + (B * B + 1)
    streams = len(selected_streams(read_shards_manifest(shards)))
    assert len(lines) == 1 and lines[0].startswith(
        f"placement: one rank; bank (whole) {rows} rows, "
    ), lines
    assert lines[0].endswith(f"; reads all {streams} streams; torch threads 1 (cpu_threads=1)"), (
        lines
    )
