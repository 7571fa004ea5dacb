"""training/layers/pkm.py: product-key lookup equals the exhaustive top-k, gradients reach exactly
the top-t slots under sparse memory finetuning (nothing else moves), TF-IDF against a hand-worked
example, and background counts round-trip with clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from memtree.training.finetune.slots import BackgroundCounts, access_counts, tfidf, trainable_rows
from memtree.training.layers.pkm import PKMConfig, ProductKeyMemory

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _layer(**kw) -> ProductKeyMemory:
    torch.manual_seed(0)
    return ProductKeyMemory(
        PKMConfig(**{"n_keys": 16, "heads": 2, "k": 5, "key_dim": 8, **kw}), d_model=12
    )


@pytest.mark.parametrize("shape", [(1, 1), (3, 63), (2, 100)])
def test_product_key_top_k_equals_exhaustive_top_k(shape):
    m = _layer()
    x = torch.randn(*shape, 12)
    fast, full = m.lookup(x), m.exhaustive_lookup(x)
    assert fast.indices.shape == (*shape, 2, 5)
    assert torch.equal(fast.indices, full.indices)
    torch.testing.assert_close(fast.scores, full.scores)
    torch.testing.assert_close(fast.weights, full.weights)
    torch.testing.assert_close(fast.weights.sum(-1), torch.ones(*shape, 2))


def test_forward_is_the_gated_weighted_sum_of_values():
    m = _layer()
    x = torch.randn(2, 3, 12)
    look = m.lookup(x)
    v = m.values.weight[look.indices]  # (2, 3, H, k, vd)
    y = (look.weights[..., None] * v).sum((-3, -2))
    want = m.w2(y * torch.nn.functional.silu(m.w1(x)))
    torch.testing.assert_close(m(x), want)
    # all-trainable mask = no mask
    torch.testing.assert_close(m(x, trainable=torch.ones(m.cfg.n_slots, dtype=torch.bool)), m(x))


def test_gradient_reaches_exactly_the_top_t_slots_and_nothing_else_moves():
    m = _layer()
    x = torch.randn(4, 7, 12)
    look = m.lookup(x)
    counts = access_counts(look.indices, m.cfg.n_slots)
    bg = BackgroundCounts.empty(m.cfg.n_slots)
    for _ in range(3):  # background batches read other inputs
        bg.add_batch(access_counts(m.lookup(torch.randn(4, 7, 12)).indices, m.cfg.n_slots))
    keep = trainable_rows(counts, bg.doc_freq, bg.n_batches, top_t=6)
    assert int(keep.sum()) == 6 and bool((counts[keep] > 0).all())
    for p in m.parameters():  # sparse memory finetuning trains the values only
        p.requires_grad_(p is m.values.weight)
    before = m.values.weight.detach().clone()
    out = m(x, trainable=keep)
    torch.testing.assert_close(out, m(x))  # the forward still reads every accessed slot
    out.square().sum().backward()
    g = m.values.weight.grad.coalesce()
    rows = g.indices()[0]
    nonzero = rows[(g.values() != 0).any(1)]
    assert set(nonzero.tolist()) == set(keep.nonzero().flatten().tolist())
    torch.optim.SGD([m.values.weight], lr=0.5).step()  # the seed's optimizer for this method
    moved = (m.values.weight.detach() != before).any(1)
    assert torch.equal(moved, keep)  # bit-identical everywhere else


def test_tfidf_against_a_hand_worked_example():
    counts = torch.tensor([3, 1, 0, 4])
    df = torch.tensor([0, 2, 5, 9])
    got = tfidf(counts, df, n_batches=9)
    # tf = c / 8; idf = log(10 / (df + 1))
    want = torch.tensor(
        [3 / 8 * math.log(10 / 1), 1 / 8 * math.log(10 / 3), 0.0, 4 / 8 * math.log(10 / 10)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got, want)
    # slot 0 (frequent here, never in the background) first, then slot 1; slot 3 is everywhere
    assert trainable_rows(counts, df, 9, top_t=2).tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="top_t=4 exceeds the 3 slots this batch accessed"):
        trainable_rows(counts, df, 9, top_t=4)
    with pytest.raises(ValueError, match="another memory size"):
        tfidf(counts, torch.zeros(5, dtype=torch.int64), 9)


def test_access_counts_skip_padding():
    idx = torch.tensor([[[[0, 1]], [[1, 2]]]])  # (B=1, S=2, H=1, k=2)
    assert access_counts(idx, 4).tolist() == [1, 2, 1, 0]
    assert access_counts(idx, 4, mask=torch.tensor([[True, False]])).tolist() == [1, 1, 0, 0]


def test_background_counts_round_trip_and_errors(tmp_path):
    bg = BackgroundCounts.empty(16)
    bg.add_batch(torch.tensor([0, 2] + [0] * 14))
    bg.add_batch(torch.tensor([1, 1] + [0] * 14))
    bg.save(tmp_path / "ckpt")
    back = BackgroundCounts.load(tmp_path / "ckpt", n_slots=16)
    assert back.n_batches == 2 and back.doc_freq.tolist()[:3] == [1, 2, 0]
    with pytest.raises(ValueError, match="n_slots=16, the memory has n_slots=64"):
        BackgroundCounts.load(tmp_path / "ckpt", n_slots=64)
    with pytest.raises(FileNotFoundError, match="no background counts"):
        BackgroundCounts.load(tmp_path / "elsewhere")
    f = tmp_path / "ckpt" / "background_counts.safetensors"
    f.write_bytes(f.read_bytes()[:-4] + b"\xff" * 4)
    with pytest.raises(ValueError, match="sha256"):
        BackgroundCounts.load(tmp_path / "ckpt")


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="key_dim must be even"):
        PKMConfig(key_dim=7)
    with pytest.raises(ValueError, match="k=40 exceeds n_keys=32"):
        PKMConfig(n_keys=32, k=40)


# -- the model option and the trainer -------------------------------------------------------------


def test_anchor_with_a_memory_layer_counts_and_runs():
    from memtree.geometry import AnchorShape
    from memtree.training.flops import model_flops, pkm_params
    from memtree.training.model import AnchorLM, ModelConfig

    anchor = AnchorShape(
        name="t", n_layers=3, d_model=16, n_heads=2, head_dim=8, ffn_dim=32, vocab_size=50
    )
    pkm = PKMConfig(n_keys=8, heads=2, k=4, key_dim=8)
    torch.manual_seed(0)
    model = AnchorLM(ModelConfig(anchor=anchor, max_seq_len=64, pkm=pkm))
    assert [b.pkm is not None for b in model.blocks] == [False, True, False]  # the middle block
    assert model.blocks[1].ffn is None and len(model.pkm_layers()) == 1
    assert sum(p.numel() for p in model.parameters()) == pkm_params(anchor, pkm)
    for s in (1, 63):
        assert model(torch.randint(0, 50, (2, s))).shape == (2, s, 50)
    dense, mem = model_flops(anchor, seq_len=64), model_flops(anchor, seq_len=64, pkm=pkm)
    assert mem.layers[0] == dense.layers[0] and mem.layers[1] < dense.layers[1]
    with pytest.raises(
        ValueError, match=r"pkm.layers \[3\] out of range: the anchor has n_layers=3"
    ):
        ModelConfig(anchor=anchor, pkm=PKMConfig(n_keys=8, heads=2, k=4, key_dim=8, layers=(3,)))


def test_trainer_config_rejects_pkm_outside_baseline_mode():
    from memtree.config import ConfigError
    from memtree.training.config import load_train_config

    pkm = "model.pkm={n_keys: 8, heads: 2, k: 4, key_dim: 8}"
    with pytest.raises(ConfigError, match="model.pkm: .*mode 'baseline', not 'cotrain'"):
        load_train_config(
            None,
            ["data.shards=x", "mode=cotrain", "anchor_checkpoint=y", "memory.multipliers=[4]", pkm],
        )
    with pytest.raises(ConfigError, match="pkm.bogus"):
        load_train_config(None, ["data.shards=x", "model.pkm={bogus: 1}"])


def test_composer_fit_updates_only_the_value_rows_read(pipeline_run, tmp_path):
    """A real `Trainer.fit` on the pipeline's shards with the middle FFN a memory layer: the values'
    gradients arrive sparse and MemoryAdamW's lazy rows move only the slots that were read."""
    from safetensors.torch import load_file
    from streaming.base.util import clean_stale_shared_memory

    from memtree.training.config import load_train_config
    from memtree.training.train import build_model, train

    shards = pipeline_run[0] / "shards"
    over = [
        f"data.shards={shards}",
        f"save_folder={tmp_path / 'run'}",
        "mode=baseline",
        "data.batch_size=2",
        "max_duration=4ba",
        "optim.warmup=1ba",
        "model.shape={n_layers: 2, d_model: 32, n_heads: 2, head_dim: 16, ffn_dim: 64}",
        "model.pkm={n_keys: 32, heads: 2, k: 4, key_dim: 8, layers: [1]}",
    ]
    cfg = load_train_config(None, over)
    torch.manual_seed(cfg.seed)
    clean_stale_shared_memory()
    init = {k: v.detach().clone() for k, v in build_model(cfg)[0].model.state_dict().items()}
    train(cfg)
    clean_stale_shared_memory()
    state = load_file(str(tmp_path / "run" / "anchor.safetensors"))
    assert bool((state["embed.weight"] != init["embed.weight"]).any())  # dense weights trained too
    after, init = state["blocks.1.pkm.values.weight"], init["blocks.1.pkm.values.weight"]
    moved = int((after != init).any(1).sum())
    # 4 steps × 2 sequences × 2 heads × 4 slots per token reach many rows, never all 1,024: a row
    # no token read keeps its initial value bit for bit
    assert 0 < moved < 32 * 32


def test_value_learning_rate_gets_its_own_group(pipeline_run, tmp_path):
    """`optim.pkm_value_lr`: the memory values in their own optimizer group, without weight decay;
    every other parameter stays in the anchor group."""
    from streaming.base.util import clean_stale_shared_memory

    from memtree.training.composer_model import unwrap
    from memtree.training.config import load_train_config
    from memtree.training.train import build_trainer

    shards = pipeline_run[0] / "shards"
    cfg = load_train_config(
        None,
        [
            f"data.shards={shards}",
            f"save_folder={tmp_path / 'run'}",
            "mode=baseline",
            "data.batch_size=2",
            "optim.pkm_value_lr=0.05",
            "model.shape={n_layers: 2, d_model: 32, n_heads: 2, head_dim: 16, ffn_dim: 64}",
            "model.pkm={n_keys: 8, heads: 2, k: 4, key_dim: 8, layers: [1]}",
        ],
    )
    clean_stale_shared_memory()
    trainer = build_trainer(cfg)
    try:
        groups = trainer.state.optimizers[0].param_groups
        values = unwrap(trainer.state.model).model.blocks[1].pkm.values.weight
        mem = [g for g in groups if any(p is values for p in g["params"])]
        assert len(mem) == 1 and len(mem[0]["params"]) == 1
        assert mem[0]["initial_lr"] == 0.05 and mem[0]["weight_decay"] == 0.0
        n = sum(p.numel() for g in groups for p in g["params"])
        assert n == sum(p.numel() for p in unwrap(trainer.state.model).model.parameters())
    finally:
        trainer.close()
        clean_stale_shared_memory()
