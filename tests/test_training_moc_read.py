"""Mixture-of-Chapters reads go through the run's read choice (issue 58): `moc.py` calls a
memory-attention path only from its one dispatch, every read ("fused", "gather", "flex") trains
the same function on a real model, `MemtreeLM.read` switches every layer, the timed probe and
its cache cover MoC models, and `memory.read` is validated against the model."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch

from memtree.config import ConfigError
from memtree.geometry import AnchorShape
from memtree.training.composer_model import MemorySettings, MemtreeLM
from memtree.training.config import load_train_config
from memtree.training.layers.moc import MoCConfig
from memtree.training.model import ModelConfig
from memtree.training.read_choice import choose_read, probe_read, read_modes, resolve_read

ROOT = Path(__file__).resolve().parents[1]
TINY = AnchorShape(
    name="tiny-gqa",
    n_layers=3,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=48,
    vocab_size=61,
)
READ_FUNCS = {"memory_attention", "memory_attention_sdpa", "memory_attention_flex"}


def _moc(weight_mode: str = "bias", **kw) -> MoCConfig:
    return MoCConfig(
        n_chapters=11,
        tokens_per_chapter=5,
        top_k=3,
        layers=(0, 2),
        n_kv_heads=2,
        zero_init_out=False,
        weight_mode=weight_mode,
        **kw,
    )


def _model(read: str = "fused", weight_mode: str = "bias", **kw) -> MemtreeLM:
    torch.manual_seed(0)
    return MemtreeLM(
        ModelConfig(anchor=TINY, max_seq_len=32, moc=_moc(weight_mode, **kw)),
        memory_settings=MemorySettings(read=read),
    )


def _batch(n: int = 3, seq: int = 13) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, TINY.vocab_size, (n, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids, "paths": torch.zeros(n, 2, dtype=torch.long)}


def _step(model: MemtreeLM, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model.loss(model(batch), batch)
    loss.backward()
    grads = {
        n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return loss.detach(), grads


# -------------------------------------------------------------------- the one call site
def test_moc_calls_a_memory_attention_path_only_from_its_read_dispatch():
    """Fails if moc.py reaches a memory-attention path anywhere but `_memory_read`, or if that
    dispatch stops looking at the read it is given (how MoC ran the kernel on every GPU before)."""
    tree = ast.parse((ROOT / "training" / "layers" / "moc.py").read_text())
    calls: dict[str, list[str]] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in READ_FUNCS
                ):
                    calls.setdefault(fn.name, []).append(node.func.id)
    assert set(calls) == {"_memory_read"}, calls
    assert sorted(calls["_memory_read"]) == sorted(READ_FUNCS)
    dispatch = next(
        f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "_memory_read"
    )
    assert "read" in [a.arg for a in dispatch.args.args]
    compared = {
        c.value
        for n in ast.walk(dispatch)
        if isinstance(n, ast.Compare)
        for c in n.comparators
        if isinstance(c, ast.Constant)
    }
    assert {"fused", "gather", "flex"} <= compared
    # and the layer's forward hands it the layer's read
    forward = next(
        f
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        and f.name == "forward"
        and any(
            isinstance(n, ast.Call) and getattr(n.func, "id", "") == "_memory_read"
            for n in ast.walk(f)
        )
    )
    call = next(
        n
        for n in ast.walk(forward)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "_memory_read"
    )
    assert any(isinstance(a, ast.Attribute) and a.attr == "read" for a in call.args)


# ------------------------------------------------------------------ every read, one function
@pytest.mark.parametrize("weight_mode", ["bias", "mix"])
def test_every_read_gives_the_same_loss_and_gradients(weight_mode):
    model = _model("fused", weight_mode)
    batch = _batch()
    modes = model.read_modes()
    assert modes == (("fused", "gather", "flex") if weight_mode == "bias" else ("fused", "gather"))
    model.train()
    results = {}
    for mode in modes:
        model.read = mode
        assert all(layer.read == mode for layer in model.model.moc_layers())
        results[mode] = _step(model, batch)
    loss0, grads0 = results["fused"]
    assert any(n.endswith("router.weight") for n in grads0)  # the weights' gradient path is live
    bank = [n for n in grads0 if "moc_banks" in n]
    assert bank and all(grads0[n].abs().sum() > 0 for n in bank)
    for mode in modes[1:]:
        loss, grads = results[mode]
        torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-6)
        assert grads.keys() == grads0.keys()
        for n in grads0:
            torch.testing.assert_close(
                grads[n], grads0[n], rtol=1e-4, atol=1e-6, msg=f"{mode}: {n}"
            )


def test_read_switch_and_its_refusals():
    model = _model("gather")
    assert model.read == "gather" and not model.read_in_place
    assert all(layer.read == "gather" for layer in model.model.moc_layers())
    model.read_in_place = True
    assert model.read == "fused" and all(
        layer.read == "fused" for layer in model.model.moc_layers()
    )
    with pytest.raises(ValueError, match="'copy'"):
        model.read = "copy"
    mix = _model("gather", "mix")
    with pytest.raises(ValueError, match="flex"):
        mix.read = "flex"
    with pytest.raises(ValueError, match="flex"):
        _model("flex", "mix")
    assert read_modes(mix) == ("fused", "gather")
    # a model without memory has no read to switch
    plain = MemtreeLM(
        ModelConfig(anchor=TINY, max_seq_len=16), memory_settings=MemorySettings(read="fused")
    )
    assert plain.read_modes() == () and plain.read == "gather"


# ---------------------------------------------------------------------------- the probe
def test_choose_read_takes_the_fastest_clear_winner_of_three():
    assert choose_read({"fused": 0.9, "gather": 1.0, "flex": 0.5}) == "flex"
    assert choose_read({"fused": 0.5, "gather": 1.0, "flex": 0.9}) == "fused"
    assert choose_read({"fused": 1.2, "gather": 1.0, "flex": 0.97}) == "gather"  # inside the margin
    assert choose_read({"fused": math.nan, "gather": 1.0, "flex": 0.5}) == "flex"
    assert choose_read({"fused": 0.5, "flex": 0.5}) == "gather"  # no gather time: nothing to beat
    # a cache entry's other fields are not reads
    assert choose_read({"fused": 2.0, "gather": 1.0, "batch": 1, "measured_at": "x"}) == "gather"


def test_probe_times_every_moc_read_and_leaves_the_model_as_found(tmp_path):
    model = _model("gather")
    batch = _batch()
    model.eval()
    model(batch)  # last-forward records to keep
    routing = [layer.last_routing for layer in model.model.moc_layers()]
    times = probe_read(model, batch, steps=2, warmup=1)
    assert set(times) == {"fused", "gather", "flex"} and all(t > 0 for t in times.values())
    assert model.read == "gather" and not model.training
    assert all(layer.read == "gather" for layer in model.model.moc_layers())
    assert all(
        layer.last_routing is r for layer, r in zip(model.model.moc_layers(), routing, strict=True)
    )
    assert all(p.grad is None for p in model.parameters())

    cache = tmp_path / "probe.json"
    choice = resolve_read(
        "auto",
        model,
        batch,
        on_gpu=True,
        device_name="cpu-as-gpu",
        cache=cache,
        probe=lambda m, b: {"fused": 3.0, "gather": 2.0, "flex": 1.0},
    )
    assert choice == "flex"
    (entry,) = json.loads(cache.read_text())["entries"].values()
    assert entry["flex"] == 1.0 and entry["choice"] == "flex"
    assert entry["key"]["moc"]["weight_mode"] == "bias" and entry["key"]["modes"] == [
        "fused",
        "gather",
        "flex",
    ]
    # cached: the same choice without probing again
    assert (
        resolve_read(
            "auto",
            model,
            batch,
            on_gpu=True,
            device_name="cpu-as-gpu",
            cache=cache,
            probe=lambda m, b: pytest.fail("probed again"),
        )
        == "flex"
    )
    # on the CPU "auto" gathers, explicit reads are returned as given
    assert resolve_read("auto", model, batch) == "gather"
    assert resolve_read("flex", model, batch) == "flex"


# ------------------------------------------------------------------------------ the config
def test_memory_read_flex_is_refused_where_it_cannot_read():
    moc = [
        "data.shards=unused",
        "model.moc={n_chapters: 9, tokens_per_chapter: 4, top_k: 2, layers: [1]}",
    ]
    assert load_train_config(None, moc + ["memory.read=flex"]).memory.read == "flex"
    with pytest.raises(ConfigError, match=r"memory\.read: 'flex' has one joint softmax"):
        load_train_config(None, moc[:1] + [moc[1][:-1] + ", weight_mode: mix}", "memory.read=flex"])
    with pytest.raises(
        ConfigError, match=r"memory\.read: 'flex' reads Mixture-of-Chapters layers only"
    ):
        load_train_config(
            None,
            ["data.shards=unused", "mode=scratch", "memory.multipliers=[4]", "memory.read=flex"],
        )
    with pytest.raises(ConfigError, match=r"memory\.read"):
        load_train_config(None, moc + ["memory.read=copy"])


@pytest.mark.gpu
def test_gpu_every_read_trains_the_same_and_auto_probes_them(tmp_path):
    """On CUDA: the kernel, the widened-head SDPA and compiled FlexAttention give one loss and one
    set of gradients on a MoC model (head dim 32, 32-token chapters), and `auto` probes all three
    on the device and takes one of them."""
    anchor = AnchorShape(
        name="gpu-moc",
        n_layers=2,
        d_model=128,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffn_dim=256,
        vocab_size=97,
    )
    torch.manual_seed(0)
    moc = MoCConfig(n_chapters=17, tokens_per_chapter=32, top_k=4, layers=(1,), zero_init_out=False)
    model = MemtreeLM(
        ModelConfig(anchor=anchor, max_seq_len=64, moc=moc),
        memory_settings=MemorySettings(read="fused"),
    ).cuda()
    ids = torch.randint(0, anchor.vocab_size, (4, 64), device="cuda")
    batch = {"input_ids": ids, "labels": ids, "paths": torch.zeros(4, 2, dtype=torch.long)}
    model.train()
    results = {}
    for mode in model.read_modes():
        model.read = mode
        results[mode] = _step(model, batch)
    loss0, grads0 = results["fused"]
    for mode, (loss, grads) in results.items():
        # the Triton kernel may run its fp32 dots in TF32; a wrong read is off by O(1)
        torch.testing.assert_close(loss, loss0, rtol=1e-3, atol=1e-4)
        for n in grads0:
            torch.testing.assert_close(
                grads[n], grads0[n], rtol=1e-2, atol=1e-4, msg=f"{mode}: {n}"
            )
    model.read = "fused"
    choice = resolve_read("auto", model, batch, cache=tmp_path / "probe.json")
    (entry,) = json.loads((tmp_path / "probe.json").read_text())["entries"].values()
    assert choice in ("fused", "gather", "flex") and all(
        entry[m] > 0 for m in ("fused", "gather", "flex")
    )
