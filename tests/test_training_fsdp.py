"""FSDP with a memory bank, on the CPU with real torch FSDP over gloo.

Composer's FSDP needs CUDA, so this drives torch FSDP directly the way Composer
does it for `fsdp: true`: each child of the ComposerModel wrapped on its own
with the child's `fsdp_wrap_fn` (one unit per anchor block), children marked
`_fsdp_wrap = False` (the bank) left whole. Two ranks each train on half of
every batch; the result must equal one process training on the whole batches
— anchor weights, bank rows and the clipped gradient norm per step — which
holds only if the sharded dense norm is summed across ranks and the bank's
sparse gradients are averaged.
"""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from memtree.geometry import AnchorShape, MemoryConfig
from memtree.training.bank import TrainableBank
from memtree.training.composer_model import MemorySettings, MemtreeLM
from memtree.training.model import ModelConfig
from memtree.training.optim import MemoryAdamW

ANCHOR = AnchorShape(
    name="tiny", n_layers=2, d_model=32, n_heads=2, head_dim=16, ffn_dim=64, vocab_size=97
)
MEM = MemoryConfig(multipliers=(8, 4), branching=4)
STEPS, BATCH, SEQ = 3, 4, 24
CLIP = 0.5  # below the early gradient norms, so clipping is active and a wrong norm would show


def _model() -> MemtreeLM:
    torch.manual_seed(0)
    return MemtreeLM(
        ModelConfig(anchor=ANCHOR, memory=MEM, max_seq_len=SEQ),
        memory_settings=MemorySettings(generic_prob=0.0),
        seed=0,
    )


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, ANCHOR.vocab_size, (BATCH, SEQ), generator=g)
        leaf = torch.randint(0, MEM.branching**2, (BATCH,), generator=g)
        paths = torch.stack([leaf // MEM.branching, leaf], dim=1)  # (B, 2): level-1 id, level-2 id
        out.append({"input_ids": ids, "labels": ids.roll(-1, 1), "paths": paths})
    return out


def _optimizer(model: MemtreeLM, *, dense_sharded: bool) -> MemoryAdamW:
    groups = [
        {"params": list(model.model.parameters()), "lr": 3e-3, "weight_decay": 0.1},
        {"params": list(model.bank.parameters()), "lr": 1e-2, "weight_decay": 0.0},
    ]
    return MemoryAdamW(groups, max_grad_norm=CLIP, dense_sharded=dense_sharded)


def _wrap_like_composer(model: MemtreeLM) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import CustomPolicy

    for name, child in list(model.named_children()):
        if not getattr(child, "_fsdp_wrap", True) or not any(True for _ in child.parameters()):
            continue
        policy = CustomPolicy(getattr(child, "fsdp_wrap_fn", lambda m: False))
        setattr(
            model,
            name,
            FSDP(
                child,
                sharding_strategy=ShardingStrategy.FULL_SHARD,
                auto_wrap_policy=policy,
                use_orig_params=True,
                device_id=torch.device("cpu"),
            ),
        )


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from memtree.training.train import anchor_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = _model()
    _wrap_like_composer(model)
    assert isinstance(model.bank, TrainableBank)  # left whole, as Composer leaves it
    opt = _optimizer(model, dense_sharded=True)
    norms = []
    half = BATCH // world
    for batch in _batches():
        local = {k: v[rank * half : (rank + 1) * half] for k, v in batch.items()}
        model.loss(model(local), local).backward()
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad(set_to_none=True)
    anchor = anchor_state_dict(model)
    # What Composer saves for `state_dict_type: full`: the bank's lazy state must pass through.
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    bank_state = [v for k, v in osd["state"].items() if k.startswith("bank.")]
    if rank == 0:
        torch.save(
            {
                "anchor": anchor,
                "bank": {k: v.clone() for k, v in model.bank.state_dict().items()},
                "norms": norms,
                "bank_state": bank_state,
            },
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_sharded_anchor_with_replicated_bank_matches_one_process(tmp_path):
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)

    model = _model()
    opt = _optimizer(model, dense_sharded=False)
    norms = []
    for batch in _batches():
        halves = [{k: v[i * 2 : (i + 1) * 2] for k, v in batch.items()} for i in range(2)]
        # what averaging over 2 ranks computes
        loss = sum(model.loss(model(h), h) for h in halves) / 2
        loss.backward()
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad(set_to_none=True)

    assert norms[0] > CLIP  # clipping was active
    assert got["norms"] == pytest.approx(norms, rel=1e-5)
    ref = model.model.state_dict()
    assert set(got["anchor"]) == set(ref)
    for k, v in ref.items():
        torch.testing.assert_close(got["anchor"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    before = _model().bank.state_dict()
    for k, v in model.bank.state_dict().items():
        # Adam normalises each element's update, so round-off in near-zero gradients shows up at
        # ~1e-5 of lr-sized steps; a missing or wrong reduction moves whole rows by ~lr instead.
        torch.testing.assert_close(got["bank"][k], v, rtol=0, atol=1e-4, msg=k)
        moved = (v - before[k]).abs().amax(1) > 0
        assert torch.equal((got["bank"][k] - before[k]).abs().amax(1) > 0, moved), k
    # the bank's optimizer state is the lazy pool of touched rows, not a dense copy of the tables
    assert got["bank_state"] and all("slot" in st for st in got["bank_state"])
    touched = {int(st["used"]) for st in got["bank_state"]}
    assert max(touched) <= STEPS * BATCH + 1


def test_fsdp_config_is_refused_without_a_gpu(pipeline_run, tmp_path):
    from memtree.config import ConfigError
    from memtree.training.config import load_train_config
    from memtree.training.train import build_trainer

    cfg = load_train_config(
        None,
        [
            f"data.shards={pipeline_run[0] / 'shards'}",
            f"save_folder={tmp_path / 'r'}",
            "fsdp=true",
            "device=cpu",
            "mode=scratch",
            "memory.multipliers=[8]",
            "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}",
        ],
    )
    with pytest.raises(ConfigError, match="fsdp: true needs GPUs"):
        build_trainer(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# the pipeline fixture needs Dask and FAISS, which the lent GPU machine's check does not carry
@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("faiss", "distributed")),
    reason="the pipeline fixture needs Dask and FAISS",
)
def test_composer_fsdp_with_a_bank_on_gpu(pipeline_run, tmp_path):
    """A real Composer FSDP run with a memory bank on one GPU: the loss falls and the bank
    exports."""
    from memtree.memstore.format import verify_bank
    from memtree.training.config import load_train_config
    from memtree.training.train import train

    cfg = load_train_config(
        None,
        [
            f"data.shards={pipeline_run[0] / 'shards'}",
            f"save_folder={tmp_path / 'r'}",
            "fsdp=true",
            "device=gpu",
            "mode=scratch",
            "memory.multipliers=[16,8]",
            "max_duration=8ba",
            "optim.lr=1e-2",
            "optim.warmup=2ba",
            "data.batch_size=4",
            "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}",
        ],
    )
    result = train(cfg)
    assert result["metrics"]
    verify_bank(result["bank"])
