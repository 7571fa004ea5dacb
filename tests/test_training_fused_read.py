"""Reading KV/FFN memories in place from the trainable bank (no per-sequence copies).

The fused read (`TrainableBank.read` → `BankRead` → kernels) must be the same
function as the gathered read (`F.embedding` → `assemble_memories`): equal
logits, equal gradients for every parameter, and a bank gradient that is sparse
over exactly the rows the batch read. The Triton kernels run under
TRITON_INTERPRET=1 on the CPU (tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from memtree.geometry import AnchorShape, MemoryConfig
from memtree.kernels.ffn_memory import ffn_memory, ffn_memory_naive
from memtree.kernels.memory_attention import memory_attention, memory_attention_naive
from memtree.training.bank import TrainableBank, _RowViews
from memtree.training.composer_model import MemorySettings, MemtreeLM
from memtree.training.model import BankRead, ModelConfig, assemble_memories

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
interp = pytest.mark.skipif(not INTERPRET, reason="CPU Triton tests need TRITON_INTERPRET=1")

# GQA (4 query heads, 2 KV heads); three levels whose blocks differ in width
ANCHOR = AnchorShape(
    name="t", n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, vocab_size=64
)
PATHS = torch.tensor([[0, 1, 3], [1, 2, 5], [0, 1, 2], [1, 3, 7]])


def _memory(kind: str) -> MemoryConfig:
    return MemoryConfig(
        multipliers=(1, 2, 3), type=kind, branching=2, placement="uniform", placement_layers=2
    )


def _step(kind: str, read: str, *, use_generic: bool = False):
    """One training forward/backward; the bank is random so memories change the logits."""
    torch.manual_seed(0)
    model = MemtreeLM(
        ModelConfig(anchor=ANCHOR, memory=_memory(kind), max_seq_len=17),
        memory_settings=MemorySettings(read=read, generic_prob=1.0 if use_generic else 0.0),
    )
    with torch.no_grad():
        for table in model.bank.tables.values():
            table.normal_(0.0, 0.3)
    model.train()
    ids = torch.randint(
        0, ANCHOR.vocab_size, (PATHS.shape[0], 17), generator=torch.Generator().manual_seed(1)
    )
    batch = {"input_ids": ids, "labels": ids, "paths": PATHS}
    logits = model(batch)
    model.loss(logits, batch).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return model, logits.detach(), grads


@pytest.mark.parametrize("kind", ["kv", "ffn"])
def test_fused_read_equals_gathered_read(kind):
    fused_model, fused, g_fused = _step(kind, "fused")
    gather_model, gathered, g_gather = _step(kind, "gather")
    assert fused_model.read_in_place and not gather_model.read_in_place
    torch.testing.assert_close(fused, gathered, rtol=1e-5, atol=1e-5)
    assert g_fused.keys() == g_gather.keys()
    for name in g_fused:
        a, b = g_fused[name], g_gather[name]
        assert a.layout == b.layout, name  # bank tables sparse in both
        torch.testing.assert_close(a.to_dense(), b.to_dense(), rtol=1e-4, atol=1e-6, msg=name)
    for lv, table in fused_model.bank.tables.items():
        got = table.grad.coalesce().indices()[0]
        want = torch.unique(PATHS[:, int(lv) - 1])
        assert torch.equal(got, want), lv
    # the memories are not a no-op here: reading none changes the logits
    fused_model.memory_mode = "none"
    fused_model.eval()
    ids = torch.randint(
        0, ANCHOR.vocab_size, (PATHS.shape[0], 17), generator=torch.Generator().manual_seed(1)
    )
    assert (
        fused_model({"input_ids": ids, "labels": ids, "paths": PATHS}) - fused
    ).abs().max() > 1e-3


def test_generic_rows_are_read_in_place_too():
    model, fused, _ = _step("kv", "fused", use_generic=True)
    _, gathered, _ = _step("kv", "gather", use_generic=True)
    torch.testing.assert_close(fused, gathered, rtol=1e-5, atol=1e-5)
    for lv, table in model.bank.tables.items():
        assert table.grad.coalesce().indices()[0].tolist() == [model.bank.generic_slot(int(lv))]


def test_lora_memories_stay_gathered():
    model = MemtreeLM(ModelConfig(anchor=ANCHOR, memory=_memory("lora-ffn"), max_seq_len=8))
    assert not model.read_in_place
    with pytest.raises(ValueError, match="no in-place read"):
        model.bank.read(model.bank.slots(PATHS))
    with pytest.raises(ValueError, match="memory read 'copy'"):
        MemtreeLM(
            ModelConfig(anchor=ANCHOR, memory=_memory("kv"), max_seq_len=8),
            memory_settings=MemorySettings(read="copy"),
        )


def test_read_views_alias_the_tables():
    bank = TrainableBank(ANCHOR, _memory("kv"))
    slots = bank.slots(PATHS)
    mems = bank.read(slots)
    assert set(mems) == set(assemble_memories(bank(slots), ANCHOR, bank.memory))
    for mem in mems.values():
        assert isinstance(mem, BankRead) and len(mem.levels) == 3
        for (views, rows), lv in zip(mem.levels, bank.levels, strict=True):
            table = bank.tables[str(lv)]
            k = views["k"]
            assert k.shape[0] == table.shape[0] and k.shape[2:] == (
                ANCHOR.kv_heads,
                ANCHOR.head_dim,
            )
            assert k.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
            assert rows.shape == (PATHS.shape[0],)


def test_row_views_merge_sparse_and_dense_gradients():
    """Each view's gradient lands in its own columns; views nobody read add nothing; a
    dense gradient for one view makes the table's gradient dense."""
    table = torch.nn.Parameter(torch.randn(6, 10))
    spans = ((0, (2, 2)), (4, (3, 2)))
    a, b = _RowViews.apply(table, spans)
    ga = torch.sparse_coo_tensor(torch.tensor([[1, 4]]), torch.ones(2, 2, 2), (6, 2, 2))
    gb = torch.sparse_coo_tensor(torch.tensor([[4, 5]]), 2 * torch.ones(2, 3, 2), (6, 3, 2))
    torch.autograd.backward([a, b], [ga, gb])
    assert table.grad.is_sparse and table.grad.coalesce().indices()[0].tolist() == [1, 4, 5]
    want = torch.zeros(6, 10)
    want[[1, 4], 0:4] = 1.0
    want[[4, 5], 4:10] = 2.0
    torch.testing.assert_close(table.grad.to_dense(), want)

    table.grad = None
    a, b = _RowViews.apply(table, spans)
    (a.sum() * 3).backward()  # dense, and only the first view
    want = torch.zeros(6, 10)
    want[:, 0:4] = 3.0
    assert not table.grad.is_sparse
    torch.testing.assert_close(table.grad, want)


@interp
def test_triton_kernels_read_views_with_sparse_table_gradients():
    """The Triton kernels (interpreted on the CPU) on strided row views of one table: the
    table's sparse gradient equals autograd through the gathered references."""
    g = torch.Generator().manual_seed(0)
    n, m, h_kv, d, w, dm = 5, 3, 2, 8, 6, 16
    spans = (
        (0, (m, h_kv, d)),
        (m * h_kv * d, (m, h_kv, d)),
        (2 * m * h_kv * d, (w, dm)),
        (2 * m * h_kv * d + w * dm, (w, dm)),
        (2 * m * h_kv * d + 2 * w * dm, (w, dm)),
    )
    width = 2 * m * h_kv * d + 3 * w * dm
    init = torch.randn(n, width, generator=g) * 0.3
    q = torch.randn(3, 4, 7, d, generator=g)
    x = torch.randn(3, 7, dm, generator=g)
    rows = torch.tensor([[4], [1], [4]])
    grads = []
    for impl in ("triton", "reference"):
        table = torch.nn.Parameter(init.clone())
        k, v, w1, w2, w3 = _RowViews.apply(table, spans)
        if impl == "triton":
            out = memory_attention(q, k, v, rows, impl="triton", sparse_grad=True)
            y = ffn_memory(x, w1, w2, w3, rows, impl="triton", sparse_grad=True)
        else:  # autograd through the gathered references on plain slices
            out = memory_attention_naive(q, k, v, rows)
            y = ffn_memory_naive(x, w1, w2, w3, rows)
        (out.square().sum() + y.square().sum()).backward()
        grads.append(table.grad)
    assert grads[0].is_sparse and grads[0].coalesce().indices()[0].tolist() == [1, 4]
    torch.testing.assert_close(grads[0].to_dense(), grads[1], rtol=1e-4, atol=1e-5)


@interp
@pytest.mark.parametrize("kind", ["kv", "ffn"])
def test_triton_fused_read_shares_one_table_per_level_across_layers(kind):
    """The model's fused read through the Triton kernels (interpreted here): KV builds one
    reference table per level for all layers, FFN one pair sort per level, and the read still
    equals the gathered one, logits and every gradient."""
    import dataclasses

    from memtree.training.model import AnchorLM, ModelConfig

    torch.manual_seed(0)
    mem = _memory(kind)
    model = AnchorLM(ModelConfig(anchor=ANCHOR, max_seq_len=17, memory=mem))
    bank = TrainableBank(ANCHOR, mem)
    with torch.no_grad():
        for table in bank.tables.values():
            table.normal_(0.0, 0.3)
    ids = torch.randint(
        0, ANCHOR.vocab_size, (PATHS.shape[0], 17), generator=torch.Generator().manual_seed(1)
    )
    results = {}
    for read in ("fused", "gather"):
        model.zero_grad(set_to_none=True)
        bank.zero_grad(set_to_none=True)
        slots = bank.slots(PATHS)
        if read == "fused":
            mems = {
                layer: dataclasses.replace(br, impl="triton")
                for layer, br in bank.read(slots).items()
            }
            tables = next(iter(mems.values())).tables
            assert all(br.tables is tables for br in mems.values())  # one cache for the step
        else:
            mems = assemble_memories(bank(slots), ANCHOR, mem)
        logits = model(ids, memories=mems)
        logits.square().mean().backward()
        grads = {
            n: p.grad.to_dense()
            for n, p in [*model.named_parameters(), *bank.named_parameters()]
            if p.grad is not None
        }
        results[read] = (logits.detach(), grads)
    assert len(mems) >= 2  # several memory layers read every level
    assert len(tables) == len(bank.levels)
    (fused, g_fused), (gathered, g_gather) = results["fused"], results["gather"]
    torch.testing.assert_close(fused, gathered, rtol=1e-4, atol=1e-5)
    assert g_fused.keys() == g_gather.keys()
    for name in g_fused:
        torch.testing.assert_close(g_fused[name], g_gather[name], rtol=1e-4, atol=1e-5, msg=name)


def test_memory_read_config_resolves_by_device():
    from memtree.config import ConfigError
    from memtree.training.config import load_train_config
    from memtree.training.train import memory_read

    def cfg(*extra):
        return load_train_config(None, ["data.shards=/nonexistent", *extra])

    assert memory_read(cfg("device=cpu")) == "gather"  # auto: the reference is slower on CPU
    assert memory_read(cfg("device=gpu")) == "fused"
    assert memory_read(cfg("device=cpu", "memory.read=fused")) == "fused"
    with pytest.raises(ConfigError, match="memory.read"):
        cfg("memory.read=copy")
