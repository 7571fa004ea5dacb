"""Composer training end to end on real pipeline shards: falling loss, frozen anchor, resume,
errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from composer.core import Callback

from memtree.config import ConfigError
from memtree.memstore.format import verify_bank
from memtree.training.config import load_train_config
from memtree.training.train import build_model, train
from tests.conftest import kill_when_ready


class LossLog(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first: dict[str, torch.Tensor] | None = None  # the first batch the run trained on

    def after_dataloader(self, state, logger) -> None:
        if self.first is None:
            self.first = {
                k: v.clone() for k, v in state.batch.items() if isinstance(v, torch.Tensor)
            }

    def batch_end(self, state, logger) -> None:
        self.losses.append(float(state.loss))


@pytest.fixture(autouse=True)
def _clean_streaming_shm():
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    yield
    clean_stale_shared_memory()


def _cfg(shards: Path, folder: Path, *extra: str):
    base = [
        f"data.shards={shards}",
        f"save_folder={folder}",
        "data.batch_size=4",
        "optim.warmup=2ba",
        "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}",
    ]
    return load_train_config(None, base + list(extra))


def test_baseline_then_frozen_memories(pipeline_run, tmp_path):
    shards = pipeline_run[0] / "shards"
    log = LossLog()
    base = train(
        _cfg(shards, tmp_path / "base", "max_duration=12ba", "optim.lr=1e-2"), callbacks=[log]
    )
    assert len(log.losses) == 12
    assert sum(log.losses[-3:]) / 3 < sum(log.losses[:3]) / 3 - 0.5, log.losses  # it learns

    from safetensors.torch import load_file

    anchor_before = load_file(base["anchor"])
    log2 = LossLog()
    # memory.dropout is off on a frozen anchor: an anchor-only forward would have no gradient
    # (it used to end the fit: "element 0 of tensors does not require grad")
    frozen = train(
        _cfg(
            shards,
            tmp_path / "frozen",
            "max_duration=6ba",
            "mode=frozen",
            f"anchor_checkpoint={tmp_path / 'base'}",
            "memory.multipliers=[16,8]",
            "memory.lr=1e-2",
            "memory.dropout=0.5",
        ),
        callbacks=[log2],
    )
    anchor_after = load_file(frozen["anchor"])
    # frozen anchor
    assert all(torch.equal(anchor_before[k], anchor_after[k]) for k in anchor_before)
    # the first frozen step starts from the trained anchor: its loss is the trained anchor's own
    # on that batch, whether the step reads memories (they have no effect at init) or memory.dropout
    # drops them (it does at seed 0's first forward). Same weights, same batch, fp32 on the CPU:
    # 1e-5 leaves room for another summation order only. The anchor is loaded here by hand, not
    # through build_model's path under test.
    ref = build_model(_cfg(shards, tmp_path / "ref", "mode=baseline"))[0].eval()
    ref.model.load_state_dict(anchor_before)
    with torch.no_grad():
        trained_loss = float(ref.loss(ref(log2.first), log2.first))
    assert log2.losses[0] == pytest.approx(trained_loss, rel=1e-5, abs=1e-5)
    # both runs start on the same batch, and the trained anchor is well below the initial one on it
    assert torch.equal(log.first["input_ids"], log2.first["input_ids"])
    assert log2.losses[0] < log.losses[0] - 0.5, (log.losses[0], log2.losses[0])
    from memtree.clustering.tree import compute_tree_id, load_tree

    info = verify_bank(frozen["bank"])
    assert info["levels"] == [1, 2]
    from memtree.memstore.format import read_manifest

    assert read_manifest(frozen["bank"]).tree_id == compute_tree_id(
        load_tree(pipeline_run[0] / "tree")
    )


def test_memories_start_with_no_effect_and_generic_rate(pipeline_run, tmp_path):
    shards = pipeline_run[0] / "shards"
    cfg = _cfg(shards, tmp_path / "x", "mode=scratch", "memory.multipliers=[4,2]")
    model, manifest = build_model(cfg)
    from memtree.training.data import build_dataloader

    batch = next(iter(build_dataloader(shards, batch_size=4, shuffle=False)))
    model.eval()
    with torch.no_grad():
        model.memory_mode = "fetched"
        fetched = model(batch)
        model.memory_mode = "none"
        plain = model(batch)
    assert torch.equal(fetched, plain)
    model.train()
    draws = torch.cat(
        [model._draw_generic(64) for _ in range(200) if not model.forwards.add_(1) is None]
    )
    p = 1 / int(manifest["branching"])
    n = len(draws)
    assert abs(float(draws.float().sum()) - n * p) < 4 * (n * p * (1 - p)) ** 0.5


def test_memory_dropout_trains_through_composer(pipeline_run, tmp_path):
    """memory.dropout through a real Trainer.fit: dropped forwards (anchor alone) and fetched ones
    mix in one run with the memory callbacks attached, and the run writes a valid bank."""
    shards = pipeline_run[0] / "shards"
    cfg = _cfg(
        shards,
        tmp_path / "d",
        "max_duration=8ba",
        "mode=scratch",
        "memory.multipliers=[4,2]",
        "memory.dropout=0.5",
    )
    log = LossLog()
    out = train(cfg, callbacks=[log])
    model = out["trainer"].state.model
    assert int(model.forwards) == 8 and len(log.losses) == 8
    drawn = []
    for i in range(8):  # the run's draws, recomputed from (seed, counter)
        model.forwards.fill_(i)
        drawn.append(model._draw_dropout())
    assert 0 < sum(drawn) < 8  # both kinds of forward happened
    verify_bank(out["bank"])


def test_nonfinite_loss_stops_with_the_step(pipeline_run, tmp_path):
    model, _ = build_model(_cfg(pipeline_run[0] / "shards", tmp_path / "n"))
    labels = torch.zeros(2, 5, dtype=torch.long)
    out = torch.full((2, 5, model.anchor_shape.vocab_size), float("nan"))
    with pytest.raises(FloatingPointError, match="training forward 0"):
        model.loss(out, {"labels": labels, "paths": torch.zeros(2, 2, dtype=torch.long)})


def test_config_errors_name_the_key(pipeline_run, tmp_path):
    shards = pipeline_run[0] / "shards"
    with pytest.raises(ConfigError, match="memory.bogus"):
        _cfg(shards, tmp_path / "e", "memory.bogus=1")
    with pytest.raises(ConfigError, match="anchor_checkpoint"):
        _cfg(shards, tmp_path / "e", "mode=frozen", "memory.multipliers=[4,2]")
    with pytest.raises(ConfigError, match="3 levels, but the shards' tree has 2"):
        build_model(_cfg(shards, tmp_path / "e", "mode=scratch", "memory.multipliers=[4,2,1]"))
    with pytest.raises(ConfigError, match="'fetched'|is not one of"):
        _cfg(shards, tmp_path / "e", "mode=sideways")


def test_resume_after_kill_matches_an_uninterrupted_run(pipeline_run, tmp_path):
    shards = pipeline_run[0] / "shards"
    args = [
        f"data.shards={shards}",
        "data.batch_size=4",
        "max_duration=8ba",
        "save_interval=1ba",
        "autoresume=true",
        "run_name=resume-test",
        "mode=scratch",
        "memory.multipliers=[8,4]",
        "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}",
        "save_num_checkpoints_to_keep=-1",
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "memtree.training.train"]
    killed_dir = tmp_path / "killed"
    ckpt = killed_dir / "checkpoints" / "ep0-ba3-rank0.pt"
    why = kill_when_ready(
        [*cmd, *args, f"save_folder={killed_dir}"],
        ckpt.exists,
        env=env,
        log=tmp_path / "killed.log",
        timeout=300,
    )
    assert why is None, f"no kill after the ba3 checkpoint: {why}"
    assert not (killed_dir / "anchor.safetensors").exists()
    r = subprocess.run(
        [*cmd, *args, f"save_folder={killed_dir}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r2 = subprocess.run(
        [*cmd, *args, f"save_folder={tmp_path / 'straight'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r2.returncode == 0, r2.stderr[-3000:]
    from safetensors.torch import load_file

    a, b = (
        load_file(killed_dir / "anchor.safetensors"),
        load_file(tmp_path / "straight" / "anchor.safetensors"),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    from memtree.memstore.store import MemoryStore

    with MemoryStore(killed_dir / "bank") as s1, MemoryStore(tmp_path / "straight" / "bank") as s2:
        for lv in (1, 2):
            for c in range(8**lv):
                assert torch.equal(s1.fetch_flat(lv, c), s2.fetch_flat(lv, c))


def test_save_folder_of_another_config_is_refused(pipeline_run, tmp_path):
    shards = pipeline_run[0] / "shards"
    train(_cfg(shards, tmp_path / "s", "max_duration=1ba"))
    with pytest.raises(ConfigError, match="another config.*optim.lr"):
        from memtree.training.train import check_save_folder

        check_save_folder(_cfg(shards, tmp_path / "s", "max_duration=1ba", "optim.lr=0.5"))


def test_shipped_yamls_validate():
    from memtree.training.context.train import load_context_config
    from memtree.training.finetune.continual import load_finetune_config

    for path in sorted((Path(__file__).resolve().parents[1] / "training" / "yamls").glob("*.yaml")):
        if path.name.startswith(
            "context-"
        ):  # the context bank's compressor (training/context/train.py)
            assert load_context_config(path).vae.ratio > 0, path
            continue
        if path.name.startswith(
            "finetune-"
        ):  # `memtree train finetune` (training/finetune/continual.py)
            want = {
                "finetune-sparse.yaml": "sparse_memory",
                "finetune-adapter.yaml": "mem_adapter",
            }[path.name]
            assert load_finetune_config(path).spec.method == want, path
            continue
        # `memtree demo` and `memtree eval realtext` set the mode per stage (eval/demo.py,
        # eval/realtext.py)
        if path.name == "demo.yaml":
            for stage in (
                ["mode=baseline", "memory.multipliers=[]"],
                ["mode=cotrain", "anchor_checkpoint=a"],
            ):
                assert load_train_config(path, stage).run_name, path
            continue
        cfg = load_train_config(path)
        assert cfg.run_name, path


def test_two_process_ddp_with_the_composer_launcher(pipeline_run, tmp_path):
    """`composer -n 2 training/train.py …` on CPU (gloo): bank gradients are sparse and reduced by
    MemoryAdamW, the anchor's by DDP; the run exports a bank that verifies."""
    shards = pipeline_run[0] / "shards"
    repo = Path(__file__).resolve().parents[1]
    launcher = Path(sys.executable).with_name("composer")
    args = [
        f"data.shards={shards}",
        "data.batch_size=4",
        "max_duration=2ba",
        "mode=scratch",
        "memory.multipliers=[8,4]",
        f"save_folder={tmp_path / 'ddp'}",
        "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}",
    ]
    # c10d's info log names each TCPStore connection rank 0 makes (the launcher shows rank 0's
    # output)
    env = {**os.environ, "PYTHONPATH": str(repo), "TORCH_CPP_LOG_LEVEL": "INFO"}
    r = subprocess.run(
        [str(launcher), "-n", "2", str(repo / "training" / "train.py"), *args],
        env=env,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # one rendezvous: when StreamingDataset opened its own process group first, the Trainer's second
    # one on the same port raced the first's closing store, and a rank could hang there for 300 s
    assert out.count("client socket has connected to") == 1, out[-3000:]
    assert verify_bank(tmp_path / "ddp" / "bank")["levels"] == [1, 2]


def test_init_bank_must_match_model_tree_and_config(pipeline_run, tmp_path):
    shards = pipeline_run[0] / "shards"
    cfg = _cfg(shards, tmp_path / "m", "mode=scratch", "memory.multipliers=[4,2]")
    model, manifest = build_model(cfg)
    with torch.no_grad():
        model.bank.tables["2"][3] = 1.0
    model.bank.export(tmp_path / "good", dtype="fp32", tree_id=manifest["tree_id"])
    model.bank.export(tmp_path / "other-tree", dtype="fp32", tree_id="not-this-tree")
    loaded, _ = build_model(
        _cfg(
            shards,
            tmp_path / "m",
            "mode=scratch",
            "memory.multipliers=[4,2]",
            f"memory.init_bank={tmp_path / 'good'}",
        )
    )
    assert torch.equal(loaded.bank.tables["2"][3], torch.ones_like(loaded.bank.tables["2"][3]))
    with pytest.raises(ConfigError, match="tree not-this-tree"):
        build_model(
            _cfg(
                shards,
                tmp_path / "m",
                "mode=scratch",
                "memory.multipliers=[4,2]",
                f"memory.init_bank={tmp_path / 'other-tree'}",
            )
        )
    with pytest.raises(ConfigError, match="memory config"):
        build_model(
            _cfg(
                shards,
                tmp_path / "m",
                "mode=scratch",
                "memory.multipliers=[8,2]",
                f"memory.init_bank={tmp_path / 'good'}",
            )
        )


def test_post_hoc_memories_on_a_local_hf_model(pipeline_run, tmp_path):
    """Table 2's setup at toy scale: a (tiny, random) HF Llama is the frozen anchor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_dir = tmp_path / "tiny-llama"
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=2048,
        )
    ).save_pretrained(hf_dir)
    shards = pipeline_run[0] / "shards"
    log = LossLog()
    out = train(
        load_train_config(
            None,
            [
                f"data.shards={shards}",
                f"save_folder={tmp_path / 'hf'}",
                "data.batch_size=4",
                "max_duration=4ba",
                "mode=frozen",
                f"model.hf_dir={hf_dir}",
                "memory.multipliers=[8,4]",
                "memory.lr=5e-2",
                "optim.warmup=1ba",
            ],
        ),
        callbacks=[log],
    )
    assert all(torch.isfinite(torch.tensor(log.losses)))
    from safetensors.torch import load_file

    base = LlamaForCausalLM.from_pretrained(hf_dir).state_dict()
    after = load_file(out["anchor"])
    assert all(torch.equal(base[k], after[k]) for k in after)  # the HF anchor stayed frozen
    assert verify_bank(out["bank"])["levels"] == [1, 2]


def test_kv_memories_read_in_place_train_like_gathered_ones(pipeline_run, tmp_path):
    """Trainer.fit with KV memories: the fused in-place read and the gathered read give the
    same losses and the same trained bank (co-training, 4 steps)."""
    shards = pipeline_run[0] / "shards"
    runs = {}
    for read in ("fused", "gather"):
        log = LossLog()
        out = train(
            _cfg(
                shards,
                tmp_path / read,
                "max_duration=4ba",
                "mode=scratch",
                "memory.type=kv",
                "memory.multipliers=[4,2]",
                "memory.lr=1e-2",
                "memory.export_dtype=fp32",
                f"memory.read={read}",
            ),
            callbacks=[log],
        )
        runs[read] = (log.losses, out)
    (fused_losses, fused), (gather_losses, gathered) = runs["fused"], runs["gather"]
    assert fused_losses == pytest.approx(gather_losses, rel=1e-4)
    from memtree.training.bank import TrainableBank

    initial, _ = build_model(
        _cfg(
            shards, tmp_path / "init", "mode=scratch", "memory.type=kv", "memory.multipliers=[4,2]"
        )
    )
    trained = TrainableBank.from_bank(fused["bank"])
    for lv in ("1", "2"):  # training moved the rows it read
        moved = (trained.tables[lv] - initial.bank.tables[lv].detach()).abs().amax(1) > 1e-4
        assert 0 < int(moved.sum()), lv
    from memtree.memstore.store import MemoryStore

    with MemoryStore(fused["bank"]) as a, MemoryStore(gathered["bank"]) as b:
        for level in (1, 2):
            for cluster in range(a.info.level(level).n_blocks):
                # atol 1e-4 = 1 % of one Adam step at memory.lr 1e-2: the two reads sum in different
                # orders, and Adam scales a near-zero gradient's rounding difference up to ~lr
                # (measured: 2.1e-5 on 1 of 1,024 values when the demo data changed, 2026-11-25).
                torch.testing.assert_close(
                    a._read_slot(a.levels[level], a.info.level(level).slot(cluster)),
                    b._read_slot(b.levels[level], b.info.level(level).slot(cluster)),
                    rtol=1e-3,
                    atol=1e-4,
                )


def test_bank_lr_by_level_moves_each_level_at_its_own_rate(pipeline_run, tmp_path):
    """memory.lr_by_level gives each level's table its own learning rate: after one real Adam step
    (whose first update is about lr per touched element) the level-1 rows moved ~100× farther than
    the level-2 rows; a list of the wrong length is an error that names the key."""
    from memtree.training.composer_model import unwrap
    from memtree.training.train import build_trainer

    shards = pipeline_run[0] / "shards"
    with pytest.raises(ConfigError, match="memory.lr_by_level"):
        _cfg(
            shards,
            tmp_path / "bad",
            "mode=scratch",
            "memory.multipliers=[4,2]",
            "memory.lr_by_level=[1e-2]",
        )
    # no bank: nothing to check it against
    _cfg(shards, tmp_path / "anchor", "memory.lr_by_level=[1e-2]")
    cfg = _cfg(
        shards,
        tmp_path / "lv",
        "mode=scratch",
        "memory.multipliers=[4,2]",
        "max_duration=1ba",
        "optim.warmup=0ba",
        "memory.lr_by_level=[1.0e-2,1.0e-4]",
        "memory.generic_prob=0.0",
    )
    trainer = build_trainer(cfg)
    try:
        bank = unwrap(trainer.state.model).bank
        groups = trainer.state.optimizers[0].param_groups
        for lv, lr in (("1", 1e-2), ("2", 1e-4)):
            mine = [g for g in groups if any(p is bank.tables[lv] for p in g["params"])]
            assert len(mine) == 1 and mine[0]["initial_lr"] == lr
        before = {lv: t.detach().clone() for lv, t in bank.tables.items()}
        trainer.fit()
        moved = {lv: (t.detach() - before[lv]).abs().max().item() for lv, t in bank.tables.items()}
    finally:
        trainer.close()
    assert 0.5e-2 < moved["1"] < 1.5e-2, moved
    assert 0 < moved["2"] < 1.5e-4, moved


def test_load_run_draws_no_bank_it_would_discard(pipeline_run, tmp_path):
    """A finished run's model reads its memories from the bank through memstore: load_run builds the
    training bank's tables without drawing their initial rows (zeros), where a fresh build draws
    them (seconds and GBs for a pretrained anchor's 305M-parameter bank)."""
    from memtree.training.train import load_run
    from tests.conftest import train_tiny_run

    run = train_tiny_run(
        pipeline_run[0] / "shards",
        tmp_path / "run",
        "data.batch_size=4",
        "max_duration=1ba",
        "memory.multipliers=[4,2]",
        "model.shape={n_layers: 1, d_model: 32, n_heads: 1, head_dim: 32, ffn_dim: 64}",
    )
    model, cfg, _, _ = load_run(run)
    fresh, _ = build_model(cfg)
    assert set(model.bank.tables) == set(fresh.bank.tables) == {"1", "2"}
    for lv, t in model.bank.tables.items():
        assert t.shape == fresh.bank.tables[lv].shape
        assert not t.any() and fresh.bank.tables[lv].any(), lv
