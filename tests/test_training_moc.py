"""Mixture-of-Chapters layers: routing and router losses by hand, Algorithm 1, sparse bank
gradients, block variations, the paper configuration's parameter counts, config errors, and Composer
training."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from composer.core import Callback

from memtree.config import ConfigError
from memtree.geometry import AnchorShape, MemoryConfig
from memtree.training.composer_model import MemtreeLM
from memtree.training.config import load_train_config
from memtree.training.layers.moc import (
    LatentBank,
    MoCConfig,
    MoCLayer,
    load_balance_loss,
    route,
    z_loss,
)
from memtree.training.model import AnchorLM, ModelConfig
from memtree.training.optim import MemoryAdamW

YAMLS = Path(__file__).resolve().parents[1] / "training" / "yamls"
TINY = AnchorShape(
    name="tiny-gqa",
    n_layers=4,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=48,
    vocab_size=61,
)
MOC = MoCConfig(
    n_chapters=9, tokens_per_chapter=5, top_k=3, layers=(1, 3), n_kv_heads=2, zero_init_out=False
)
LN = math.log


def _ids(batch: int = 3, seq: int = 11, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (batch, seq), generator=g)


def _model(moc: MoCConfig = MOC, anchor: AnchorShape = TINY) -> AnchorLM:
    torch.manual_seed(0)
    return AnchorLM(ModelConfig(anchor=anchor, moc=moc, max_seq_len=64))


# -- routing and router losses, by hand ------------------------------------------------------------


def test_route_top_k_renormalised_with_shared_chapter_always_on():
    # chapter 0 is shared; its logit is the largest but it is never routed, and always read
    logits = torch.tensor(
        [
            [10.0, LN(1), LN(2), LN(3), LN(4)],  # routed p = .1 .2 .3 .4
            [-10.0, LN(5), LN(1), LN(3), LN(1)],
        ]
    )  # routed p = .5 .1 .3 .1
    r = route(logits, n_shared=1, top_k=2, routed_scaling=2.5)
    torch.testing.assert_close(r.probs, torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.3, 0.1]]))
    assert r.routed.tolist() == [[3, 2], [0, 2]]
    assert r.chapters.tolist() == [[0, 4, 3], [0, 1, 3]]
    # shared weighs 1, routed 2.5 · p / Σ_top-k p, then all divided by 1 + 2.5
    want = torch.tensor([[2 / 7, 20 / 49, 15 / 49], [2 / 7, 25 / 56, 15 / 56]])
    torch.testing.assert_close(r.weights, want)
    no_shared = route(logits[:, 1:], n_shared=0, top_k=2, routed_scaling=2.5)
    assert no_shared.chapters.tolist() == [[3, 2], [0, 2]]
    torch.testing.assert_close(no_shared.weights, torch.tensor([[4 / 7, 3 / 7], [5 / 8, 3 / 8]]))
    two_shared = route(logits, n_shared=2, top_k=1, routed_scaling=2.5)  # routed p ∝ 2 3 4 / 1 3 1
    assert two_shared.chapters.tolist() == [[0, 1, 4], [0, 1, 3]]
    torch.testing.assert_close(
        two_shared.weights, torch.tensor([[1 / 4.5, 1 / 4.5, 2.5 / 4.5]] * 2)
    )


def test_load_balance_loss_by_hand():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.3, 0.1]], requires_grad=True)
    routed = torch.tensor([[3, 2], [0, 2]])
    # f = C_r / (k·B) · counts = 4 / 4 · [1, 0, 2, 1];  P = [.3, .15, .3, .25]
    loss = load_balance_loss(probs, routed)
    torch.testing.assert_close(loss, torch.tensor(0.3 + 0 + 0.6 + 0.25))
    loss.backward()  # dL/dp_{b,i} = f_i / B: f carries no gradient
    torch.testing.assert_close(probs.grad, torch.tensor([[0.5, 0, 1, 0.5]] * 2))
    uniform = torch.full((2, 4), 0.25)
    torch.testing.assert_close(
        load_balance_loss(uniform, torch.tensor([[0, 1], [2, 3]])), torch.tensor(1.0)
    )
    collapsed = torch.tensor([[0.5, 0.5, 0, 0]] * 2)  # every sequence on the same 2 of 4: C_r / k
    torch.testing.assert_close(
        load_balance_loss(collapsed, torch.tensor([[0, 1], [1, 0]])), torch.tensor(2.0)
    )


def test_z_loss_by_hand():
    logits = torch.tensor([[LN(4), 0.0, LN(2), 0.0], [0.0, 0.0, 0.0, 0.0]])  # Σ exp = 8 and 4
    torch.testing.assert_close(z_loss(logits), torch.tensor((LN(8) ** 2 + LN(4) ** 2) / 2))


def test_layer_records_router_losses_and_weights_them():
    moc = MoCConfig(
        n_chapters=5, tokens_per_chapter=3, top_k=2, layers=(0,), lb_coef=0.01, z_coef=0.001
    )
    layer = MoCLayer(moc, d_model=16, n_layers=1, anchor_heads=2)
    bank = LatentBank(moc, 16)
    with torch.no_grad():  # logits = bias for every sequence: routed p = .1 .2 .3 .4
        layer.router.weight.zero_()
        layer.router.bias.copy_(torch.tensor([LN(4), LN(1), LN(2), LN(3), LN(4)]))
    layer(torch.randn(2, 7, 16), bank)
    # both sequences pick routed {3, 2}: f = 4 / (2·2) · [0, 0, 2, 2];  Σ exp(logits) = 14
    torch.testing.assert_close(
        layer.last_aux["load_balance"], torch.tensor(0.2 * 0 + 0.3 * 2 + 0.4 * 2)
    )
    torch.testing.assert_close(layer.last_aux["z"], torch.tensor(LN(14) ** 2))
    torch.testing.assert_close(layer.aux_loss(), torch.tensor(0.01 * 1.4 + 0.001 * LN(14) ** 2))
    assert layer.last_routing.chapters.tolist() == [[0, 4, 3]] * 2


def test_blocked_chapters_are_never_routed_and_are_refused_in_training():
    """Blocking (eval.chapter_blocking's experiment) takes the router's best chapters away: the
    next best are picked instead, the shared chapter stays; shared or too many blocked chapters,
    or blocking while training, are errors."""
    moc = MoCConfig(n_chapters=5, tokens_per_chapter=3, top_k=2, layers=(0,))
    layer = MoCLayer(moc, d_model=16, n_layers=1, anchor_heads=2).eval()
    bank = LatentBank(moc, 16)
    with torch.no_grad():  # routed p ∝ 1 2 3 4 for every sequence: top-2 = {4, 3}
        layer.router.weight.zero_()
        layer.router.bias.copy_(torch.tensor([LN(4), LN(1), LN(2), LN(3), LN(4)]))
    x = torch.randn(2, 7, 16)
    layer(x, bank)
    assert layer.last_routing.chapters.tolist() == [[0, 4, 3]] * 2
    layer.blocked = torch.tensor([4])
    layer(x, bank)
    assert layer.last_routing.chapters.tolist() == [[0, 3, 2]] * 2
    assert layer.last_routing.probs[:, 3].eq(0).all()  # no weight left on the blocked chapter
    for bad in ([0], [2, 3, 4]):  # the shared chapter; more than n_routed - top_k
        layer.blocked = torch.tensor(bad)
        with pytest.raises(ValueError, match="can be blocked"):
            layer(x, bank)
    layer.blocked = torch.tensor([4])
    with pytest.raises(RuntimeError, match="inference-time"):
        layer.train()(x, bank)


def test_model_aux_loss_is_the_mean_over_memory_layers():
    model = _model()
    model(_ids())
    layers = model.moc_layers()
    assert len(layers) == 2
    torch.testing.assert_close(
        model.moc_aux_loss(), (layers[0].aux_loss() + layers[1].aux_loss()) / 2
    )
    assert _model(None).moc_aux_loss() is None


# -- the layer equals Algorithm 1, sequence by sequence ------------------------------------------


def _algorithm_1(layer: MoCLayer, bank: LatentBank, x: torch.Tensor) -> torch.Tensor:
    """Seed 000 Alg. 1 per sequence, written out: pool → router → top-k ∪ shared → concatenate the
    chapters → RMSNorm → K, V → (weighted) softmax attention per head → W_O."""
    c, g = layer.cfg, layer.geo
    table = bank.weight.view(c.n_chapters, c.tokens_per_chapter, -1)
    out = []
    for b in range(x.shape[0]):
        h = x[b]  # (S, d)
        logits = layer.router.weight @ h.mean(0) + layer.router.bias
        p = torch.softmax(logits[c.n_shared :], 0)
        top = sorted(range(len(p)), key=lambda i: -float(p[i]))[: c.top_k]
        chosen = list(range(c.n_shared)) + [c.n_shared + i for i in top]
        w = torch.cat([torch.ones(c.n_shared), c.routed_scaling * p[top] / p[top].sum()])
        w = w / w.sum()
        mem = torch.cat([table[ch] for ch in chosen])  # (n·T, m): M_S = Concat(M_c)
        if bank.up is not None:
            mem = mem @ bank.up
        mem = mem / (mem.pow(2).mean(-1, keepdim=True) + c.norm_eps).sqrt()
        k, v = mem @ layer.k.weight.T, mem @ layer.v.weight.T
        hn = h / (h.pow(2).mean(-1, keepdim=True) + layer.norm.eps).sqrt() * layer.norm.weight
        q = hn @ layer.q.weight.T
        heads = []
        for i in range(g.n_heads):
            j = i // (g.n_heads // g.n_kv_heads)
            qi = q[:, i * g.head_dim : (i + 1) * g.head_dim]
            ki, vi = (t[:, j * g.head_dim : (j + 1) * g.head_dim] for t in (k, v))
            s = qi @ ki.T / math.sqrt(g.head_dim)  # (S, n·T)
            if c.weight_mode == "bias":
                heads.append(
                    torch.softmax(s + w.log().repeat_interleave(c.tokens_per_chapter), -1) @ vi
                )
            else:
                parts = [
                    (s[:, sl], vi[sl])
                    for sl in (
                        slice(n * c.tokens_per_chapter, (n + 1) * c.tokens_per_chapter)
                        for n in range(len(chosen))
                    )
                ]
                heads.append(
                    sum(
                        wn * torch.softmax(sn, -1) @ vn
                        for wn, (sn, vn) in zip(w, parts, strict=True)
                    )
                )
        out.append(torch.cat(heads, -1) @ layer.o.weight.T)
    return torch.stack(out)


@pytest.mark.parametrize("low_rank", ["none", "factorized", "reduced"])
@pytest.mark.parametrize("weight_mode", ["bias", "mix"])
@pytest.mark.parametrize("n_shared", [0, 2])
def test_layer_equals_algorithm_1(low_rank, weight_mode, n_shared):
    moc = MoCConfig(
        n_chapters=11,
        tokens_per_chapter=5,
        top_k=3,
        n_shared=n_shared,
        layers=(0,),
        n_heads=4,
        n_kv_heads=2,
        weight_mode=weight_mode,
        low_rank=low_rank,
        rank=None if low_rank == "none" else 16,
        zero_init_out=False,
    )
    torch.manual_seed(0)
    layer, bank = MoCLayer(moc, d_model=24, n_layers=1, anchor_heads=3), LatentBank(moc, 24)
    with torch.no_grad():
        layer.router.weight.normal_(std=1.0)  # well-separated router scores: no near-ties in top-k
        layer.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, 24)
    with torch.no_grad():
        torch.testing.assert_close(
            layer(x, bank), _algorithm_1(layer, bank, x), rtol=1e-5, atol=1e-6
        )


def test_zero_init_output_makes_the_layer_a_no_op():
    moc = replace(MOC, zero_init_out=True)
    model = _model(moc)
    deltas = []
    for b in model.blocks:
        if b.moc is not None:
            b.moc.register_forward_hook(lambda _m, _i, out: deltas.append(out))
    model(_ids())
    assert len(deltas) == 2 and all(torch.count_nonzero(d) == 0 for d in deltas)


# -- gradients and the optimizer -----------------------------------------------------------------


@pytest.mark.parametrize("shared_bank", [True, False])
def test_bank_gradient_reaches_only_selected_chapters(shared_bank):
    model = _model(replace(MOC, n_chapters=21, shared_bank=shared_bank))
    logits = model(_ids())
    (logits * torch.randn_like(logits)).sum().backward()
    read = {
        i: set(b.moc.last_routing.chapters.flatten().tolist())
        for i, b in enumerate(model.blocks)
        if b.moc is not None
    }
    expect = {"shared": read[1] | read[3]} if shared_bank else {str(i): s for i, s in read.items()}
    assert set(model.moc_banks) == set(expect)
    for key, chapters in expect.items():
        g = model.moc_banks[key].weight.grad
        assert g.is_sparse
        g = g.coalesce()
        assert set(g.indices()[0].tolist()) == chapters and len(chapters) < 21
        assert (g.values().abs().sum(1) > 0).all()


def test_memory_adamw_updates_only_the_chapters_read():
    model = _model(replace(MOC, n_chapters=21))
    bank = model.moc_banks["shared"].weight
    before = bank.detach().clone()
    banks, _ = model.moc_parameters()
    rest = [p for p in model.parameters() if all(p is not q for q in banks)]
    opt = MemoryAdamW([{"params": rest}, {"params": banks, "weight_decay": 0.1}], lr=1e-2)
    logits = model(_ids())
    (
        F.cross_entropy(logits.flatten(0, 1), _ids(seed=2).flatten()) + model.moc_aux_loss()
    ).backward()
    opt.step()
    read = torch.zeros(21, dtype=torch.bool)
    for m in model.moc_layers():
        read[m.last_routing.chapters.flatten()] = True
    changed = (bank.detach() != before).any(dim=1)
    assert torch.equal(changed, read) and opt.last_rows[id(bank)] == int(read.sum())


def test_router_learns_from_the_lm_loss_and_from_the_aux_losses():
    model = _model()
    logits = model(_ids())
    (logits * torch.randn_like(logits)).sum().backward()  # LM-side loss only
    routers = [m.router.weight for m in model.moc_layers()]
    assert all(r.grad is not None and r.grad.abs().sum() > 0 for r in routers)
    one = _model(replace(MOC, layers=(1,)))
    one(_ids())
    one.moc_aux_loss().backward()  # aux losses only: the router, and nothing downstream of it
    layer = one.moc_layers()[0]
    assert layer.router.weight.grad.abs().sum() > 0
    assert layer.q.weight.grad is None and one.moc_banks["shared"].weight.grad is None


# -- block structure -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variation", "order"), [(1, ["attn", "moc", "ffn"]), (2, ["attn", "ffn", "moc", "moc_ffn"])]
)
def test_block_variations(variation, order):
    model = _model(replace(MOC, variation=variation))
    calls: dict[int, list[str]] = {}
    for i, b in enumerate(model.blocks):
        for name in ("attn", "moc", "ffn", "moc_ffn"):
            mod = getattr(b, name, None)
            if mod is not None:
                mod.register_forward_hook(
                    lambda *_, i=i, name=name: calls.setdefault(i, []).append(name)
                )
    model(_ids())
    assert calls == {0: ["attn", "ffn"], 1: order, 2: ["attn", "ffn"], 3: order}
    if variation == 2:  # a second FFN and its norm per memory block
        extra = sum(p.numel() for p in model.parameters()) - sum(
            p.numel() for p in _model().parameters()
        )
        assert extra == 2 * (3 * TINY.d_model * TINY.ffn_dim + TINY.d_model)


def test_paper_yaml_builds_the_seeds_model():
    """App. A.4.1: 371.29M = 147.87M backbone + 201.38M bank + 22.04M memory layers; dense
    202.94M."""
    cfg = load_train_config(YAMLS / "paper-moc.yaml")
    anchor = cfg.anchor_shape(cfg.model.vocab_size)
    with torch.device("meta"):
        model = AnchorLM(ModelConfig(anchor=anchor, moc=cfg.model.moc, max_seq_len=1024))
        dense = AnchorLM(ModelConfig(anchor=replace(anchor, n_layers=24), max_seq_len=1024))
    bank, layers = model.moc_parameters()
    total, n_bank, n_layers = (
        sum(p.numel() for p in ps) for ps in (model.parameters(), bank, layers)
    )
    millions = [round(n / 1e6, 2) for n in (total, total - n_bank - n_layers, n_bank, n_layers)]
    assert millions == [371.29, 147.87, 201.38, 22.04]
    assert round(sum(p.numel() for p in dense.parameters()) / 1e6, 2) == 202.94


# -- configuration ------------------------------------------------------------------------------

MOC_YAML = "model.moc={n_chapters: 9, tokens_per_chapter: 4, top_k: 2, layers: [1]"


def test_config_errors_name_the_key():
    base = ["data.shards=unused"]
    cfg = load_train_config(None, base + [MOC_YAML + "}"])
    assert cfg.model.moc == MoCConfig(n_chapters=9, tokens_per_chapter=4, top_k=2, layers=(1,))
    with pytest.raises(ConfigError, match=r"unknown config key model\.moc\.bogus"):
        load_train_config(None, base + [MOC_YAML + ", bogus: 1}"])
    with pytest.raises(ConfigError, match=r"model\.moc: top_k 9 exceeds the 8 routable chapters"):
        load_train_config(None, base + [MOC_YAML.replace("top_k: 2", "top_k: 9") + "}"])
    with pytest.raises(ConfigError, match=r"model\.moc\.variation: 3 is not one of \[1, 2\]"):
        load_train_config(None, base + [MOC_YAML + ", variation: 3}"])
    with pytest.raises(ConfigError, match=r"model\.moc: .*use mode 'baseline'"):
        load_train_config(None, base + [MOC_YAML + "}", "mode=scratch", "memory.multipliers=[4]"])
    with pytest.raises(ConfigError, match="fsdp: the MoC latent bank"):
        load_train_config(None, base + [MOC_YAML + "}", "fsdp=true"])
    with pytest.raises(ValueError, match=r"moc\.layers \[7\] are outside the anchor's 4 blocks"):
        ModelConfig(anchor=TINY, moc=replace(MOC, layers=(1, 7)))
    with pytest.raises(ValueError, match="mutually exclusive"):
        ModelConfig(anchor=TINY, moc=MOC, memory=MemoryConfig(multipliers=(2,), branching=2))
    with pytest.raises(ValueError, match="rank is required"):
        replace(MOC, low_rank="reduced")


def test_composer_model_adds_the_aux_loss_when_training():
    model = MemtreeLM(ModelConfig(anchor=TINY, max_seq_len=64, moc=MOC))
    ids, labels = _ids(), _ids(seed=2)
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    model.train()
    out = model(batch)
    ce = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=-100)
    aux = model.model.moc_aux_loss()
    assert aux > 0
    torch.testing.assert_close(model.loss(out, batch), ce + aux)
    model.eval()
    torch.testing.assert_close(model.loss(out, batch), ce)
    names = dict(model.named_parameters())
    assert model._ddp_params_and_buffers_to_ignore == ["model.moc_banks.shared.weight"]
    assert names["model.moc_banks.shared.weight"] is model.model.moc_banks["shared"].weight
    bank, layers = model.moc_parameters()
    groups = [{id(p) for p in g} for g in (model.anchor_parameters(), bank, layers)]
    assert (
        sum(map(len, groups)) == len({id(p) for p in model.parameters()}) == len(set.union(*groups))
    )


# -- Composer end to end ------------------------------------------------------------------------


class MoCLog(Callback):
    """Loss per batch, which chapters were read, and the bank before and after training."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.read: list[set[int]] = []  # chapters read, per batch
        self.bank: list[torch.Tensor] = []
        self.groups = 0

    def _bank(self, state) -> torch.Tensor:
        return state.model.model.moc_banks["shared"].weight.detach().clone()

    def fit_start(self, state, logger) -> None:
        self.bank.append(self._bank(state))
        self.groups = len(state.optimizers[0].param_groups)

    def batch_end(self, state, logger) -> None:
        self.losses.append(float(state.loss))
        layers = state.model.model.moc_layers()
        self.read.append({c for m in layers for c in m.last_routing.chapters.flatten().tolist()})

    def fit_end(self, state, logger) -> None:
        self.bank.append(self._bank(state))


def test_trainer_fit_tiny_moc(pipeline_run, tmp_path):
    from safetensors.torch import load_file
    from streaming.base.util import clean_stale_shared_memory

    from memtree.training.train import build_model, train

    clean_stale_shared_memory()  # left by an earlier streaming loader in this session
    shards = pipeline_run[0] / "shards"
    args = [
        f"data.shards={shards}",
        f"save_folder={tmp_path / 'moc'}",
        "max_duration=12ba",
        "data.batch_size=4",
        "optim.warmup=2ba",
        "optim.lr=1e-2",
        "optim.moc_bank_lr=1e-2",
        "optim.moc_layer_lr=1e-2",
        "model.moc.n_chapters=1025",
    ]  # more chapters than 12 steps can read
    with pytest.raises(ConfigError, match=r"model\.moc\.layers \[9\] are outside"):
        build_model(load_train_config(YAMLS / "tiny-moc.yaml", args + ["model.moc.layers=[1,9]"]))
    log = MoCLog()
    out = train(load_train_config(YAMLS / "tiny-moc.yaml", args), callbacks=[log])
    assert len(log.losses) == 12 and log.groups == 3  # anchor, bank, memory layers
    assert sum(log.losses[-3:]) / 3 < sum(log.losses[:3]) / 3 - 0.5, log.losses  # it learns
    changed = (log.bank[1] != log.bank[0]).any(dim=1)
    read_ever, read_late = torch.zeros_like(changed), torch.zeros_like(changed)
    read_ever[sorted(set.union(*log.read))] = True
    read_late[sorted(set.union(*log.read[6:]))] = True  # past the warmup's zero-LR start
    assert not (changed & ~read_ever).any()  # chapters no sequence read stay exactly as initialised
    assert (changed | ~read_late).all() and int(read_ever.sum()) < len(read_ever)
    assert "moc_banks.shared.weight" in load_file(out["anchor"])
    # eval loads the run with its chapters inside the model (there is no memstore bank)
    from memtree.eval.model import RunModel

    run = RunModel.load(tmp_path / "moc")
    assert run.model.moc_layers() and not run.has_memory
    lp = run.logprobs([run.encode("the cluster of a rare fact")], mode="none")[0]
    assert lp.numel() > 1 and torch.isfinite(lp).all()
