"""Trainable bank tables with sparse gradients, lazy AdamW, and memstore interop."""

from __future__ import annotations

import hashlib

import pytest
import torch

from memtree.geometry import AnchorShape, MemoryConfig, block_layout
from memtree.memstore.format import GENERIC, read_manifest
from memtree.memstore.merge import merge_banks
from memtree.memstore.store import MemoryStore
from memtree.training.bank import TrainableBank
from memtree.training.optim import MemoryAdamW

ANCHOR = AnchorShape(
    name="tiny", n_layers=3, d_model=16, n_heads=2, head_dim=8, ffn_dim=32, vocab_size=100
)
MEM = MemoryConfig(multipliers=(8, 4, 2), branching=4)


def _params(level: int) -> int:
    return sum(t.numel for t in block_layout(ANCHOR, MEM, level))


def test_tables_follow_the_bank_slot_order():
    bank = TrainableBank(ANCHOR, MEM)
    # 4^l clusters + 1 generic row per level; FFN rows 3·d·m·L
    assert {lv: tuple(t.shape) for lv, t in ((int(k), v) for k, v in bank.tables.items())} == {
        1: (5, 3 * 16 * 8 * 3),
        2: (17, 3 * 16 * 4 * 3),
        3: (65, 3 * 16 * 2 * 3),
    }
    part = TrainableBank(ANCHOR, MEM, subtree=2)
    assert {lv: tuple(t.shape) for lv, t in ((int(k), v) for k, v in part.tables.items())} == {
        1: (2, 1152),
        2: (5, 576),
        3: (17, 288),
    }
    sl = part.slots(torch.tensor([[2, 9, 37]]))
    assert {lv: int(r) for lv, r in sl.items()} == {1: 0, 2: 1, 3: 5}
    with pytest.raises(ValueError, match="outside subtree 2"):
        part.slots(torch.tensor([[1, 4, 16]]))


def test_gradients_reach_exactly_the_fetched_rows():
    bank = TrainableBank(ANCHOR, MEM)
    paths = torch.tensor([[0, 1, 5], [0, 1, 6], [3, 13, 55]])
    out = bank(bank.slots(paths, use_generic=torch.tensor([False, False, True])))
    sum(o.square().sum() for o in out.values()).backward()
    rows = {int(k): sorted(v.grad.coalesce().indices()[0].tolist()) for k, v in bank.tables.items()}
    assert rows == {1: [0, 4], 2: [1, 16], 3: [5, 6, 64]}  # row 4/16/64 = generic


def test_generic_probability_is_one_over_branching():
    g = torch.Generator().manual_seed(0)
    n = 64_000
    hits = int(TrainableBank.draw_generic(n, 16, g).sum())
    sigma = (n * (1 / 16) * (15 / 16)) ** 0.5
    assert abs(hits - n / 16) < 4 * sigma


def test_dense_step_matches_torch_adamw():
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(5, 7))
    p2 = torch.nn.Parameter(p1.detach().clone())
    ours = MemoryAdamW([p1], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW([p2], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(3):
        g = torch.randn(5, 7, generator=torch.Generator().manual_seed(step))
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.allclose(p1, p2, atol=1e-6)


def test_sparse_rows_update_like_independent_adamw_with_their_own_steps():
    """A row updated at steps 1 and 3 equals a dense AdamW that saw only those two gradients."""
    table = torch.nn.Parameter(torch.randn(6, 4))
    start = table.detach().clone()
    opt = MemoryAdamW([table], lr=0.05, weight_decay=0.1)
    refs = {r: torch.nn.Parameter(start[r].clone()) for r in (1, 4)}
    ref_opts = {
        r: torch.optim.AdamW([refs[r]], lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        for r in refs
    }
    schedule = [[1], [4], [1, 4]]
    for step, rows in enumerate(schedule):
        grads = torch.randn(len(rows), 4, generator=torch.Generator().manual_seed(step))
        table.grad = torch.sparse_coo_tensor(torch.tensor([rows]), grads, table.shape)
        opt.step()
        for r, g in zip(rows, grads, strict=True):
            refs[r].grad = g.clone()
            ref_opts[r].step()
    for r in (1, 4):
        assert torch.allclose(table[r], refs[r], atol=1e-6)
    for r in (0, 2, 3, 5):  # never fetched: untouched, not even decayed
        assert torch.equal(table[r], start[r])
    # state only for the two rows ever touched (pool grown by doubling, capped at the table)
    assert int(opt.state[table]["used"]) == 2


def test_global_clipping_over_dense_and_sparse():
    dense = torch.nn.Parameter(torch.zeros(3))
    table = torch.nn.Parameter(torch.zeros(4, 2))
    dense.grad = torch.tensor([3.0, 0.0, 0.0])
    table.grad = torch.sparse_coo_tensor(
        torch.tensor([[2]]), torch.tensor([[0.0, 4.0]]), table.shape
    )
    opt = MemoryAdamW([dense, table], lr=0.1, max_grad_norm=1.0)
    opt.step()
    assert opt.last_grad_norm == pytest.approx(5.0)
    table.grad = torch.sparse_coo_tensor(
        torch.tensor([[0]]), torch.tensor([[float("nan"), 0.0]]), table.shape
    )
    dense.grad = None
    with pytest.raises(FloatingPointError):
        opt.step()


def test_export_and_load_round_trip(tmp_path):
    bank = TrainableBank(ANCHOR, MEM, seed=3)
    with torch.no_grad():
        bank.tables["2"][7] = torch.arange(_params(2), dtype=torch.float32)
    info = bank.export(tmp_path / "bank", dtype="fp32", tree_id="t123")
    assert info.tree_id == "t123" and read_manifest(info.root).subtree is None
    with MemoryStore(info.root) as st:
        assert torch.equal(st.fetch_flat(2, 7), torch.arange(_params(2), dtype=torch.float32))
        assert torch.equal(st.fetch_flat(3, GENERIC), bank.tables["3"][-1].detach())
    back = TrainableBank.from_bank(info.root)
    for k, v in bank.tables.items():
        assert torch.equal(back.tables[k], v.detach())


def test_per_subtree_training_then_merge_equals_training_one_bank(tmp_path):
    """App. A.2: one job per level-1 subtree, merged, equals one bank trained on the same batches
    (lazy per-row AdamW: rows of different subtrees never interact without clipping)."""
    torch.manual_seed(0)
    batches = {
        0: torch.tensor([[0, 1, 5], [0, 2, 9]]),
        1: torch.tensor([[1, 4, 17], [1, 7, 30]]),
        2: torch.tensor([[2, 8, 33]]),
        3: torch.tensor([[3, 15, 63]]),
    }
    target = {
        lv: torch.randn(_params(lv), generator=torch.Generator().manual_seed(lv))
        for lv in (1, 2, 3)
    }

    def train(bank: TrainableBank, paths_list: list[torch.Tensor]) -> None:
        opt = MemoryAdamW(bank.parameters(), lr=0.05, weight_decay=0.1)
        for paths in paths_list:
            out = bank(bank.slots(paths))
            loss = sum((o - target[lv]).square().sum() for lv, o in out.items())
            opt.zero_grad()
            loss.backward()
            opt.step()

    full = TrainableBank(ANCHOR, MEM, seed=1)
    train(full, [batches[s] for s in range(4)] * 2)
    parts = []
    for s in range(4):
        part = TrainableBank(ANCHOR, MEM, subtree=s, seed=1)
        train(part, [batches[s], batches[s]])
        parts.append(part.export(tmp_path / f"part{s}", dtype="fp32").root)
    merged = merge_banks(parts, tmp_path / "merged", generic="first")
    ref = full.export(tmp_path / "full", dtype="fp32")
    for lv in (1, 2, 3):
        a = hashlib.sha256((merged.root / f"level-{lv}.bin").read_bytes()).hexdigest()
        b = hashlib.sha256((ref.root / f"level-{lv}.bin").read_bytes()).hexdigest()
        assert a == b, f"level {lv} differs"


def test_sparse_state_survives_a_state_dict_round_trip():
    table = torch.nn.Parameter(torch.randn(6, 4))
    opt = MemoryAdamW([table], lr=0.05)
    table.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, 4), table.shape)
    opt.step()
    clone = torch.nn.Parameter(table.detach().clone())
    opt2 = MemoryAdamW([clone], lr=0.05)
    opt2.load_state_dict(opt.state_dict())
    for p, o in ((table, opt), (clone, opt2)):
        p.grad = torch.sparse_coo_tensor(torch.tensor([[3, 5]]), torch.ones(2, 4), p.shape)
        o.step()
    assert torch.equal(table, clone)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("read", ["fused", "gather"])
def test_bank_on_the_gpu_maps_paths_from_either_device(read):
    """The bank on CUDA: `slots` takes host paths (the model maps paths on the host) and device
    paths (bench/training/training_steps.py), and a MemtreeLM forward + backward reads it either way
    (the first device check found the cluster-to-row table left on the CPU)."""
    from memtree.training.composer_model import MemorySettings, MemtreeLM
    from memtree.training.model import ModelConfig

    shard_bank = TrainableBank(ANCHOR, MEM, shard=(1, 3)).cuda()
    paths = torch.tensor([[1, 4, 16], [3, 13, 55]])
    on_host = shard_bank.slots(paths)
    on_gpu = shard_bank.slots(paths.cuda())
    assert all(torch.equal(on_host[lv], on_gpu[lv].cpu()) for lv in on_host)
    model = MemtreeLM(
        ModelConfig(anchor=ANCHOR, memory=MEM, max_seq_len=16),
        memory_settings=MemorySettings(read=read),
    ).cuda()
    ids = torch.randint(0, ANCHOR.vocab_size, (2, 17), device="cuda")
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "paths": paths.cuda()}
    loss = model.loss(model(batch), batch)
    loss.backward()
    assert torch.isfinite(loss) and model.bank.tables["3"].grad is not None
