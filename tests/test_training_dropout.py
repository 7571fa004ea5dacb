"""Memory dropout in training (`memory.dropout`): some forwards run the anchor alone.

A dropped forward must be exactly the anchor without memory (same logits as memory_mode "none",
no bank gradient), the draws must follow the configured rate and depend only on (seed, forward
counter), and evaluation never drops.
"""

from __future__ import annotations

import pytest
import torch

from memtree.config import ConfigError
from memtree.geometry import AnchorShape, MemoryConfig
from memtree.training.composer_model import MemorySettings, MemtreeLM
from memtree.training.config import load_train_config
from memtree.training.model import ModelConfig

ANCHOR = AnchorShape(
    name="t", n_layers=2, d_model=32, n_heads=4, n_kv_heads=4, head_dim=8, ffn_dim=48, vocab_size=64
)
MEM = MemoryConfig(
    multipliers=(1, 2), type="ffn", branching=2, placement="uniform", placement_layers=2
)
PATHS = torch.tensor([[0, 1], [1, 2], [1, 3]])


def _model(p: float, seed: int = 0) -> MemtreeLM:
    torch.manual_seed(0)
    model = MemtreeLM(
        ModelConfig(anchor=ANCHOR, memory=MEM, max_seq_len=9),
        memory_settings=MemorySettings(read="gather", generic_prob=0.0, dropout=p),
        seed=seed,
    )
    with torch.no_grad():  # a random bank: memories change the logits
        for table in model.bank.tables.values():
            table.normal_(0.0, 0.3)
    return model


def _batch():
    ids = torch.randint(
        0, ANCHOR.vocab_size, (PATHS.shape[0], 9), generator=torch.Generator().manual_seed(1)
    )
    return {"input_ids": ids, "labels": ids, "paths": PATHS}


def _draws(model: MemtreeLM, n: int) -> list[bool]:
    """The dropout draws of training forwards 0 … n-1 (the counter a forward advances)."""
    out = []
    for i in range(n):
        model.forwards.fill_(i)
        out.append(model._draw_dropout())
    return out


def test_a_dropped_forward_is_the_anchor_alone():
    model, batch = _model(0.5), _batch()
    model.eval()
    model.memory_mode = "none"
    with torch.no_grad():
        anchor_only = model(batch)
        model.memory_mode = "fetched"
        fetched = model(batch)
    assert not torch.allclose(anchor_only, fetched)  # the bank matters for these sequences
    model.train()
    seen = set()
    for _ in range(40):
        model.zero_grad(set_to_none=True)
        drawn = model._draw_dropout()  # this forward's draw, from the counter it is about to use
        logits = model(batch)
        model.loss(logits, batch).backward()
        dropped = not model.last_slots
        assert dropped == drawn
        seen.add(dropped)
        bank_grads = [t.grad for t in model.bank.tables.values() if t.grad is not None]
        if dropped:
            torch.testing.assert_close(logits, anchor_only)
            assert model.last_use_generic is None and not bank_grads
        else:
            torch.testing.assert_close(logits, fetched)
            assert bank_grads
    assert seen == {True, False}


def test_dropout_rate_and_determinism():
    n, p = 20000, 0.25
    a = _draws(_model(p), n)
    sigma = (n * p * (1 - p)) ** 0.5
    assert abs(sum(a) - n * p) < 4 * sigma
    assert _draws(_model(p), n) == a  # keyed on (seed, counter): the same run draws the same
    assert _draws(_model(p, seed=1), n) != a
    assert not any(_draws(_model(0.0), 200))  # 0: every forward reads its blocks


def test_evaluation_never_drops():
    model = _model(0.9)
    model.eval()
    with torch.no_grad():
        for _ in range(20):
            model(_batch())
            assert model.last_slots


def test_config_range():
    assert load_train_config(None, ["data.shards=x", "memory.dropout=0.25"]).memory.dropout == 0.25
    for bad in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match="memory.dropout"):
            load_train_config(None, ["data.shards=x", f"memory.dropout={bad}"])
