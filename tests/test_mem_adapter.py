"""Memory adapters on memtree's own anchor (training/finetune/adapters.py, seed 004 §6.1, §7.3–7.4):
exact no-op at attachment, the §7.4 projection options against their formulas, which parameters each
fine-tuning condition trains, the frozen-bank protection, the accounting, the experiment."""

from __future__ import annotations

import json
import math

import pytest
import torch

from memtree.config import ConfigError
from memtree.geometry import AnchorShape
from memtree.training.finetune.adapters import AdapterSpec, attach_to_anchor, detach_from_anchor
from memtree.training.finetune.continual import (
    Finetuner,
    FinetuneSpec,
    batch_tensors,
    changes,
    snapshot,
)
from memtree.training.layers.moc import LatentBank, MoCConfig, MoCLayer, quantise
from memtree.training.model import AnchorLM, ModelConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ANCHOR = AnchorShape(
    name="t", n_layers=3, d_model=16, n_heads=2, head_dim=8, ffn_dim=32, vocab_size=50
)


def _model(moc: MoCConfig | None = None) -> AnchorLM:
    torch.manual_seed(0)
    return AnchorLM(ModelConfig(anchor=ANCHOR, max_seq_len=64, moc=moc)).eval()


def _batch(seed: int = 1, lengths=(9, 5, 2, 7)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    texts = [
        " ".join(str(int(t)) for t in torch.randint(3, 50, (n,), generator=g)) for n in lengths
    ]
    return batch_tensors(texts, lambda t: [int(w) for w in t.split()], pad_id=0, max_len=64)


SPECS = {
    "v1-shared": AdapterSpec(n_chapters=4, tokens_per_chapter=3, top_k=2),
    "v2-per-layer": AdapterSpec(
        layers="every:2",
        variation=2,
        shared_bank=False,
        n_chapters=4,
        tokens_per_chapter=3,
        top_k=1,
    ),
    "factorized-int8": AdapterSpec(
        layers="first:2",
        n_chapters=4,
        tokens_per_chapter=3,
        top_k=2,
        low_rank="factorized",
        rank=4,
        bank_dtype="int8",
    ),
    "reduced-int4": AdapterSpec(
        layers="last:1",
        n_chapters=4,
        tokens_per_chapter=3,
        top_k=2,
        low_rank="reduced",
        rank=8,
        bank_dtype="int4",
    ),
    "one-token": AdapterSpec(layers="0,2", n_chapters=3, tokens_per_chapter=1, top_k=1, n_shared=0),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_attached_adapters_leave_the_logits_bit_identical_and_detach_cleanly(name):
    model = _model()
    ids, _ = _batch()
    with torch.no_grad():
        base = model(ids)
    keys = set(model.state_dict())
    moc = attach_to_anchor(model, SPECS[name], seed=3)
    assert model.config.moc == moc and all(model.blocks[i].moc is not None for i in moc.layers)
    with torch.no_grad():
        assert torch.equal(model(ids), base)
        for i in (
            moc.layers
        ):  # the layers did run and read memory: the zero comes from W_O, not a skipped call
            assert model.blocks[i].moc.last_routing is not None
    assert set(model.state_dict()) > keys
    assert (
        detach_from_anchor(model) and set(model.state_dict()) == keys and model.config.moc is None
    )
    assert not detach_from_anchor(model)


def test_attachment_is_deterministic_for_a_seed_and_leaves_the_global_rng_alone():
    a, b = _model(), _model()
    state = torch.random.get_rng_state()
    attach_to_anchor(a, SPECS["v1-shared"], seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    attach_to_anchor(b, SPECS["v1-shared"], seed=5)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("low_rank", ["factorized", "reduced"])
def test_projection_options_equal_their_explicit_formulas(low_rank):
    """§7.4 option 1: full-d projections over M = A·B; option 2: everything at width r. One
    sequence, 1 shared + top-1 routed chapter, 2 heads, written out with plain matmuls."""
    d, r, T = 16, 4, 3
    cfg = MoCConfig(
        n_chapters=3,
        tokens_per_chapter=T,
        top_k=1,
        layers=(0,),
        n_heads=2,
        low_rank=low_rank,
        rank=r,
        zero_init_out=False,
    )
    torch.manual_seed(1)
    layer, bank = MoCLayer(cfg, d_model=d, n_layers=1, anchor_heads=2), LatentBank(cfg, d)
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 5, d)
    with torch.no_grad():
        got = layer(x, bank)[0]  # (S, d)
        logits = layer.router(x.mean(1))[0]
        routed = 1 + int(logits[1:].argmax())
        w = torch.tensor([1.0, cfg.routed_scaling]) / (1 + cfg.routed_scaling)
        A = bank.weight.view(3, T, r)  # the stored bank: (C, T, r) in both options
        M = torch.cat([A[0], A[routed]])  # (2T, r) selected tokens, shared chapter first
        if low_rank == "factorized":
            assert bank.up.shape == (r, d)
            M = M @ bank.up  # (2T, d): the full-width tokens rebuilt before attention
        else:
            assert (
                bank.up is None
                and layer.q.weight.shape == (r, d)
                and layer.o.weight.shape == (d, r)
            )
        M = _rms(M, cfg.norm_eps)
        q = _rms(x[0], layer.norm.eps) * layer.norm.weight @ layer.q.weight.T  # (S, width)
        k, v = M @ layer.k.weight.T, M @ layer.v.weight.T  # (2T, width)
        hd = q.shape[1] // 2
        heads = []
        for h in range(2):
            sl = slice(h * hd, (h + 1) * hd)
            s = q[:, sl] @ k[:, sl].T / math.sqrt(hd) + torch.log(w).repeat_interleave(T)  # (S, 2T)
            heads.append(s.softmax(-1) @ v[:, sl])
        want = torch.cat(heads, dim=1) @ layer.o.weight.T
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_quantised_bank_reads_stored_values_with_a_straight_through_gradient():
    from memtree.memstore.format import QUANT_GROUP

    rows = torch.randn(3, QUANT_GROUP + 5, requires_grad=True)
    for dtype, levels in (("int8", 255), ("int4", 15)):
        q = quantise(rows, dtype)
        head = q[:, :QUANT_GROUP].detach()
        scale = rows[:, :QUANT_GROUP].detach().abs().amax(1, keepdim=True) / (levels // 2)
        assert torch.allclose(head / scale, (head / scale).round(), atol=1e-4)  # on the grid
        assert float((q - rows).abs().max()) <= float(scale.max()) / 2 + 1e-6
        assert 0 < float((q - rows).abs().max())
        (g,) = torch.autograd.grad(q.sum(), rows)
        assert torch.equal(g, torch.ones_like(rows))
    assert torch.equal(quantise(rows, "bf16"), rows.detach().bfloat16().float())


def _trained(model: AnchorLM, spec: FinetuneSpec, steps: int = 3) -> tuple[Finetuner, dict, dict]:
    before = snapshot(model)
    torch.manual_seed(0)
    ft = Finetuner(model, spec)
    after_attach = snapshot(model)
    for s in range(steps):
        ft.step(*_batch(10 + s))
    return ft, before, after_attach


ADAPTER = AdapterSpec(n_chapters=4, tokens_per_chapter=3, top_k=2)


@pytest.mark.parametrize("method", ["full", "lora", "mem_adapter", "mem_adapter+lora"])
def test_each_condition_trains_exactly_what_it_names(method):
    model = _model()
    ft, before, attached = _trained(model, FinetuneSpec(method=method, lr=1e-2, adapter=ADAPTER))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == trainable
    if method == "full":
        assert trainable == set(before)
    if method == "lora":
        assert trainable and all(".lora_" in n for n in trainable)
    if method.startswith("mem_adapter"):
        mem = {n for n in trainable if ".moc." in n or n.startswith("moc_banks.")}
        assert mem == {
            n
            for n in model.state_dict()
            if n not in before and ".lora_" not in n and ".base." not in n
        }
        assert trainable - mem == (
            {n for n in trainable if ".lora_" in n} if method.endswith("+lora") else set()
        )
    ft.finish()
    ch = changes(before, model)
    base_changed = set(ch["tensors"])
    if method == "mem_adapter":  # the base model's weights are bit-identical
        assert base_changed == set() and ch["added_elements"] > 0
    elif method == "full":
        # (not every tensor need move by a few steps: embedding rows never read)
        assert base_changed
    else:  # LoRA merged into exactly the adapted projections
        assert base_changed and all(
            k.split(".")[-2] in ("q", "k", "v", "o", "w1", "w2", "w3") for k in base_changed
        )
    if method.startswith("mem_adapter"):  # and the adapters did learn
        now = model.state_dict()
        assert any(not torch.equal(now[k], attached[k]) for k in now if ".moc.o." in k)


def test_frozen_bank_keeps_its_bytes_and_freeze_kv_keeps_the_projections():
    model = _model()
    spec = FinetuneSpec(
        method="mem_adapter",
        lr=1e-2,
        adapter=AdapterSpec(
            n_chapters=4,
            tokens_per_chapter=3,
            top_k=2,
            bank_lr_factor=0.0,
            freeze_kv=True,
            bank_dtype="int8",
        ),
    )
    ft, _, attached = _trained(model, spec, steps=4)
    now = model.state_dict()
    bank = [k for k in now if k.startswith("moc_banks.")]
    kv = [k for k in now if ".moc.k." in k or ".moc.v." in k]
    assert bank and kv
    for k in bank + kv:
        assert now[k].numpy().tobytes() == attached[k].numpy().tobytes(), k
    assert any(not torch.equal(now[k], attached[k]) for k in now if ".moc.q." in k)
    assert all(len(g["params"]) for g in ft.opt.param_groups) and len(ft.opt.param_groups) == 1


def test_bank_learns_at_its_factor_of_the_rate():
    model = _model()
    ft, *_ = _trained(
        model,
        FinetuneSpec(
            method="mem_adapter",
            lr=1e-2,
            adapter=AdapterSpec(n_chapters=4, tokens_per_chapter=3, top_k=2, bank_lr_factor=0.1),
        ),
        steps=1,
    )
    lrs = [g["lr"] for g in ft.opt.param_groups]
    assert lrs == pytest.approx([1e-2, 1e-3])
    assert [p for p in ft.opt.param_groups[1]["params"]] == list(model.moc_banks.parameters())


def test_a_pretrained_moc_model_trains_its_own_memory_with_its_bank_frozen():
    """§6.1: a model pretrained with MoC layers keeps its memory; mem_adapter fine-tunes it."""
    moc = MoCConfig(n_chapters=4, tokens_per_chapter=3, top_k=2, layers=(1,))
    model = _model(moc)
    spec = FinetuneSpec(method="mem_adapter", lr=1e-2, adapter=AdapterSpec(bank_lr_factor=0.0))
    ft, before, _ = _trained(model, spec)
    assert ft.adapter is None and model.config.moc == moc  # nothing attached
    now = model.state_dict()
    assert set(now) == set(before)
    changed = {k for k in now if not torch.equal(now[k], before[k])}
    assert changed and all(".moc." in k for k in changed)
    assert torch.equal(now["moc_banks.shared.weight"], before["moc_banks.shared.weight"])


def test_accounting_counts_what_the_finetuner_trains():
    from memtree.training.flops import finetune_accounting, model_flops

    cases = [
        ("full", ADAPTER),
        ("lora", ADAPTER),
        ("mem_adapter", ADAPTER),
        ("mem_adapter+lora", ADAPTER),
        ("mem_adapter", SPECS["v2-per-layer"]),
        ("mem_adapter", SPECS["factorized-int8"]),
        (
            "mem_adapter",
            AdapterSpec(
                layers="last:2",
                low_rank="reduced",
                rank=8,
                bank_lr_factor=0,
                freeze_kv=True,
                n_chapters=4,
                tokens_per_chapter=3,
            ),
        ),
    ]
    for method, ad in cases:
        model = _model()
        ft = Finetuner(model, FinetuneSpec(method=method, lora_rank=3, lr=1e-3, adapter=ad))
        moc = model.config.moc
        acct = finetune_accounting(
            ANCHOR,
            method,
            seq_len=20,
            lora_rank=3,
            moc=moc,
            train_bank=ad.bank_lr_factor > 0,
            train_kv=not ad.freeze_kv,
        )
        assert acct["trainable_params"] == sum(p.numel() for p in ft.params), (method, ad)
        if moc is not None:
            added = sum(
                p.numel()
                for n, p in model.named_parameters()
                if ".moc" in n or n.startswith("moc_banks")
            )
            assert acct["adapter_params"] == added
            assert acct["inference_flops_per_token"] * 20 == pytest.approx(
                model_flops(ANCHOR, moc, seq_len=20).forward, abs=20
            )
        if method == "lora":
            assert (
                acct["train_flops_per_token"]
                > acct["inference_flops_per_token"]
                == acct["base_flops_per_token"]
            )
    # bytes of the stored bank: fp32 4 per value; int8 1 per value + a 4-byte scale per group
    from memtree.memstore.format import QUANT_GROUP
    from memtree.training.layers.moc import bank_bytes

    m32 = ADAPTER.moc_config(n_layers=3, d_model=16, n_heads=2)
    assert bank_bytes(m32, 16) == 4 * 4 * 3 * 16
    m8 = AdapterSpec(n_chapters=4, tokens_per_chapter=3, top_k=2, bank_dtype="int8").moc_config(
        n_layers=3, d_model=16, n_heads=2
    )
    assert bank_bytes(m8, 16) == 4 * 3 * 16 + 4 * 4 * math.ceil(3 * 16 / QUANT_GROUP)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"layers": "3"}, ["adapter.layers", "3 layers"]),
        ({"layers": "last:4"}, ["adapter.layers", "3 layers"]),
        ({"low_rank": "factorized", "rank": 32}, ["adapter.rank=32", "d_model=16"]),
        ({"n_heads": 3}, ["adapter.n_heads=3", "d_model=16"]),
        ({"low_rank": "reduced", "rank": 6, "n_heads": 4}, ["adapter.n_heads=4", "adapter.rank=6"]),
        ({"n_kv_heads": 3}, ["adapter.n_kv_heads=3", "2 memory heads"]),
    ],
)
def test_an_adapter_that_does_not_fit_the_model_names_the_field_and_the_value(spec, words):
    model = _model()
    keys = set(model.state_dict())
    with pytest.raises(ConfigError) as e:
        attach_to_anchor(model, AdapterSpec(**spec))
    assert all(w in str(e.value) for w in words), str(e.value)
    assert set(model.state_dict()) == keys and model.config.moc is None


def test_bad_adapter_fields_are_config_errors():
    for bad, word in (
        ({"variation": 3}, "adapter.variation"),
        ({"low_rank": "factorized"}, "adapter.rank"),
        ({"rank": 4}, "adapter.rank"),
        ({"bank_dtype": "int2"}, "adapter.bank_dtype"),
        ({"bank_lr_factor": -1.0}, "adapter.bank_lr_factor"),
        ({"layers": "every:x"}, None),
        ({"top_k": 16}, "adapter.top_k"),
    ):
        if word is None:
            with pytest.raises(ConfigError, match="every: needs a positive integer"):
                AdapterSpec(**bad).resolve_layers(3)
            continue
        with pytest.raises(ConfigError, match=word):
            AdapterSpec(**bad)
    with pytest.raises(ValueError, match="already has a memory layer"):
        attach_to_anchor(
            _model(MoCConfig(n_chapters=4, tokens_per_chapter=3, top_k=2, layers=(1,))), ADAPTER
        )
    with pytest.raises(ConfigError, match="adamw"):
        Finetuner(_model(), FinetuneSpec(method="mem_adapter", optimizer="sgd", adapter=ADAPTER))


def test_layer_selectors():
    assert AdapterSpec(layers="all").resolve_layers(4) == (0, 1, 2, 3)
    assert AdapterSpec(layers="every:3").resolve_layers(9) == (2, 5, 8)
    assert AdapterSpec(layers="first:2").resolve_layers(5) == (0, 1)
    assert AdapterSpec(layers="last:2").resolve_layers(5) == (3, 4)
    assert AdapterSpec(layers="3, 0").resolve_layers(5) == (0, 3)


@pytest.fixture(scope="module")
def anchor_run(pipeline_run, tmp_path_factory):
    """A tiny anchor without memory, trained by a real Composer `Trainer.fit` on the pipeline's
    shards."""
    from tests.conftest import train_tiny_run

    folder = tmp_path_factory.mktemp("anchor") / "run"
    return train_tiny_run(
        pipeline_run[0] / "shards",
        folder,
        "mode=baseline",
        "memory.multipliers=[]",
        "data.batch_size=2",
        "max_duration=2ba",
        "model.shape={n_layers: 2, d_model: 32, n_heads: 2, head_dim: 16, ffn_dim: 64}",
    )


def test_memtree_finetune_with_adapters_saves_a_run_that_reopens_with_them(anchor_run, tmp_path):
    from safetensors.torch import load_file

    from memtree.cli import main
    from memtree.training.finetune.continual import finetune_summary
    from memtree.training.train import load_run

    stream = tmp_path / "stream.jsonl"
    stream.write_text(
        "".join(
            json.dumps({"id": f"f{i}", "texts": [f"the colour of item {i} is blue"]}) + "\n"
            for i in range(3)
        )
    )
    out = tmp_path / "ft"
    assert (
        main(
            [
                "train",
                "finetune",
                f"run={anchor_run}",
                f"data={stream}",
                f"save_folder={out}",
                "spec.method=mem_adapter",
                "spec.lr=1e-3",
                "spec.adapter={layers: 'last:1', n_chapters: 4, tokens_per_chapter: 2}",
            ]
        )
        == 0
    )
    rec = finetune_summary(out / "finetune.json")
    assert rec["changed"]["elements"] == 0 and rec["changed"]["added_elements"] > 0
    before, after = (
        load_file(str(anchor_run / "anchor.safetensors")),
        load_file(str(out / "anchor.safetensors")),
    )
    assert all(torch.equal(before[k], after[k]) for k in before)
    model, *_ = load_run(out)
    assert model.model.config.moc.layers == (1,) and model.model.blocks[1].moc is not None
    sd = model.model.state_dict()
    assert all(torch.equal(sd[k], after[k]) for k in after)


def test_eval_adapters_writes_its_report(anchor_run, tmp_path):
    from memtree.eval.finetune.adapters import load_adapters_config, run_adapters
    from memtree.io import read_json
    from memtree.pipeline.corpus.bios import BiosSpec, write_bios

    root = tmp_path / "bios"
    write_bios(root, BiosSpec(entities_per_subtopic=2), heldout_docs=4)
    runs = (
        "runs=[{method: full, lr: 1.0e-4}, {method: lora, lr: 1.0e-3}, "
        "{method: mem_adapter, lr: 1.0e-3, adapter: {n_chapters: 4, tokens_per_chapter: 2}}, "
        "{method: mem_adapter+lora, lr: 1.0e-3, adapter: {layers: 'last:1', n_chapters: 4, "
        "tokens_per_chapter: 2}}]"
    )
    cfg = load_adapters_config(
        None,
        [
            f"root={root}",
            f"run={anchor_run}",
            "n_facts=4",
            "paraphrases=2",
            "epochs=2",
            "old_probes=8",
            "held_out_docs=2",
            f"out={tmp_path / 'out'}",
            runs,
        ],
    )
    report = run_adapters(cfg, progress=False)
    res = read_json(tmp_path / "out" / "results.json")
    assert report.exists() and (tmp_path / "out" / "pareto.png").stat().st_size > 0
    assert [r["method"] for r in res["runs"]] == ["full", "lora", "mem_adapter", "mem_adapter+lora"]
    assert res["steps_per_run"] == 8
    full, lora, mem, both = res["runs"]
    # match_lora: LoRA's trainable parameters sized to the adapter's, the combination's total too
    target = mem["accounting"]["trainable_params"]
    per_rank = lora["accounting"]["trainable_params"] / lora["spec"]["lora_rank"]
    for r in (lora, both):
        assert abs(r["accounting"]["trainable_params"] - target) <= per_rank / 2 + 1
    assert full["accounting"]["trainable_params"] > target
    assert mem["changed"]["elements"] == 0 and mem["changed"]["added_elements"] == target
    assert (
        mem["accounting"]["bank_bytes"] == 4 * 4 * 2 * 32 and lora["accounting"]["bank_bytes"] == 0
    )
    agree = mem["adapter"]["chapter_overlap"]
    assert set(agree["per_layer"]) == {"0", "1"} and all(
        0 <= v <= 1 for v in agree["per_layer"].values()
    )
    # 3 routable, top-2
    assert agree["chance"] == pytest.approx(1 - math.comb(1, 2) / math.comb(3, 2))
    assert full["adapter"] is None and both["adapter"]["layers"] == [1]
    assert all(r["step_ms"] > 0 for r in res["runs"]) and set(res["best"]) == {
        r["method"] for r in res["runs"]
    }
    # every condition started from the same weights: the run's file is untouched and the model was
    # reset
    assert res["before"]["perplexity"] > 0


def test_shipped_adapter_yamls_load():
    from memtree.eval.finetune.adapters import load_adapters_config

    cfg = load_adapters_config()
    assert {s.method for s in cfg.runs} == {"full", "lora", "mem_adapter", "mem_adapter+lora"}
    from pathlib import Path

    from memtree.training.finetune.continual import load_finetune_config

    ft = load_finetune_config(
        Path(__file__).parents[1] / "training" / "yamls" / "finetune-adapter.yaml"
    )
    assert ft.spec.method == "mem_adapter" and ft.spec.adapter.n_chapters == 16
