"""Memory adapters on tiny random Hugging Face causal LMs (Llama, Qwen3, Gemma 3, OLMo 2): exact
no-op at init, live hooks, a hand-written reference of one adapted layer per family, frozen base,
config errors that name the field, deepcopy."""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")

from memtree.config import ConfigError
from memtree.training.finetune.adapters import AdapterSpec
from memtree.training.finetune.hf_adapters import HFMemAdapter
from memtree.training.layers.moc import bank_for

VOCAB = 100
FAMILIES = ("llama", "qwen3", "gemma3", "olmo2")
BANKS = {
    "shared": {},
    "per_layer": {"shared_bank": False},
    "factorized": {"low_rank": "factorized", "rank": 8},
    "reduced": {"low_rank": "reduced", "rank": 16, "shared_bank": False, "layers": "1"},
    "int8": {"bank_dtype": "int8", "layers": "0"},
}


def _config(family: str):
    common = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
    }
    if family == "llama":
        return transformers.LlamaConfig(
            **common, tie_word_embeddings=False, attn_implementation="eager"
        )
    if family == "qwen3":
        return transformers.Qwen3Config(
            **common, head_dim=16, tie_word_embeddings=True, attn_implementation="sdpa"
        )
    if family == "gemma3":  # 4 norms per block, GELU-tanh MLP, one sliding and one global layer
        return transformers.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            attn_implementation="eager",
        )
    # no input norm, full q/k norms
    return transformers.Olmo2Config(**common, attn_implementation="sdpa")


_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}


def _build(family: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = getattr(transformers, _CLASSES[family])(_config(family)).eval()
    with torch.no_grad():  # non-trivial norm gains so nothing hides behind ones / zeros
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype)


@pytest.fixture(scope="module")
def bases():
    return {f: _build(f) for f in FAMILIES}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))


def _spec(variation: int = 1, **kw) -> AdapterSpec:
    return AdapterSpec(
        **{"n_chapters": 8, "tokens_per_chapter": 4, "top_k": 2, "variation": variation, **kw}
    )


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _perturb(adapter: HFMemAdapter, seed: int = 0) -> None:
    """Non-zero W_O (and variation 2's down projection): the adapters now add something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in adapter.mem_layers.values():
            m.o.weight.copy_(0.2 * torch.randn(m.o.weight.shape, generator=g))
        for ffn in adapter.ffns.values() if adapter.moc.variation == 2 else ():
            ffn.down_proj.weight.copy_(0.2 * torch.randn(ffn.down_proj.weight.shape, generator=g))


def _n_hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("bank", list(BANKS))
@pytest.mark.parametrize("variation", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_base_at_init(bases, ids, family, variation, bank):
    model = copy.deepcopy(bases[family])
    before = _logits(model, ids)
    adapter = HFMemAdapter(model, _spec(variation, **BANKS[bank]), seed=3)
    assert _n_hooks(model) == len(adapter.moc.layers) * (2 if variation == 1 else 1)
    got = _logits(adapter, ids)
    assert torch.equal(got, before)
    for m in adapter.mem_layers.values():  # the hooks did run the memory layers
        assert m.last_routing is not None
    assert torch.isfinite(adapter.aux_loss())
    adapter.remove_hooks()
    assert _n_hooks(model) == 0
    assert torch.equal(_logits(model, ids), before)


@pytest.mark.parametrize("variation", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_perturbed_adapters_change_logits(bases, ids, family, variation):
    model = copy.deepcopy(bases[family])
    before = _logits(model, ids)
    adapter = HFMemAdapter(model, _spec(variation))
    _perturb(adapter)
    got = _logits(adapter, ids)
    assert (got - before).abs().max() > 1e-3
    adapter.remove_hooks()
    assert torch.equal(_logits(model, ids), before)


def _reference_layer(layer, x, kw, adapter: HFMemAdapter, i: int, family: str):
    """One decoder layer with its adapter, written out from the HF submodules (hooks removed)."""
    attn_kw = {
        k: v
        for k, v in kw.items()
        if k not in ("position_embeddings_global", "position_embeddings_local")
    }
    if family == "gemma3":
        attn_kw["position_embeddings"] = kw[
            "position_embeddings_local"
            if layer.self_attn.is_sliding
            else "position_embeddings_global"
        ]
    mem, bank = adapter.mem_layers[str(i)], bank_for(adapter.banks, i)
    variation = adapter.moc.variation
    h = x if family == "olmo2" else layer.input_layernorm(x)  # OLMo 2 has no input norm
    a = layer.self_attn(hidden_states=h, **attn_kw)[0]
    if family in ("gemma3", "olmo2"):  # post-norm: the attention output is normalised first
        a = layer.post_attention_layernorm(a)
    x = x + a
    if variation == 1:
        x = x + mem(x, bank)
    if family == "gemma3":
        f = layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
    elif family == "olmo2":
        f = layer.post_feedforward_layernorm(layer.mlp(x))
    else:
        f = layer.mlp(layer.post_attention_layernorm(x))
    x = x + f
    if variation == 2:
        x = x + mem(x, bank)
        ffn = adapter.ffns[str(i)]
        g = adapter.ffn_norms[str(i)](x)
        x = x + ffn.down_proj(layer.mlp.act_fn(ffn.gate_proj(g)) * ffn.up_proj(g))
    return x


@pytest.mark.parametrize("variation", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_hooked_layer_matches_hand_written_reference(bases, ids, family, variation):
    model = copy.deepcopy(bases[family])
    adapter = HFMemAdapter(model, _spec(variation))
    _perturb(adapter)
    i = 1  # its input already carries layer 0's adapter
    layer = model.model.layers[i]
    seen = {}

    def pre(module, args, kwargs):
        seen["x"], seen["kw"] = args[0] if args else kwargs["hidden_states"], dict(kwargs)

    def post(module, args, out):  # registered after the adapter's own: sees the final output
        seen["out"] = out[0] if isinstance(out, tuple) else out

    handles = [
        layer.register_forward_pre_hook(pre, with_kwargs=True),
        layer.register_forward_hook(post),
    ]
    _logits(adapter, ids)
    for h in handles:
        h.remove()
    adapter.remove_hooks()  # the reference calls the HF submodules without the adapter's hooks
    kw = {k: v for k, v in seen["kw"].items() if k != "hidden_states"}
    with torch.no_grad():
        ref = _reference_layer(layer, seen["x"], kw, adapter, i, family)
    torch.testing.assert_close(seen["out"], ref, atol=1e-5, rtol=0)
    with torch.no_grad():  # and the adapter's contribution is not negligible at that tolerance
        base_out = layer(seen["x"], **kw)
    base_out = base_out[0] if isinstance(base_out, tuple) else base_out
    assert (base_out - ref).abs().max() > 1e-3


@pytest.mark.parametrize("variation", [1, 2])
def test_only_adapter_parameters_get_gradients(bases, ids, variation):
    model = copy.deepcopy(bases["llama"])
    adapter = HFMemAdapter(model, _spec(variation, shared_bank=False)).train()
    _perturb(adapter)
    loss = adapter(input_ids=ids, labels=ids, use_cache=False).loss + adapter.aux_loss()
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    for m in adapter.mem_layers.values():
        for lin in (m.router, m.q, m.k, m.v, m.o):
            assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    for bank in adapter.banks.values():
        g = bank.weight.grad
        assert g is not None
        g = g.to_dense() if g.is_sparse else g
        assert g.abs().sum() > 0
    if variation == 2:
        for ffn in adapter.ffns.values():
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ffn.parameters())
    groups = adapter.adapter_parameters()
    ids_ = [id(p) for g in groups.values() for p in g]
    hf_ids = {id(p) for p in model.parameters()}
    assert len(ids_) == len(set(ids_))  # each parameter in one group
    assert set(ids_) == {id(p) for p in adapter.parameters()} - hf_ids
    kv = {id(p) for m in adapter.mem_layers.values() for p in (m.k.weight, m.v.weight)}
    assert {id(p) for p in groups["kv"]} == kv
    assert groups["bank"] == adapter.bank_parameters() == [b.weight for b in adapter.banks.values()]


def test_freezes_follow_the_flags(bases):
    model = copy.deepcopy(bases["llama"])
    adapter = HFMemAdapter(
        model,
        _spec(1, low_rank="factorized", rank=8, freeze_kv=True, bank_lr_factor=0.0),
        freeze_base=False,
    )
    assert all(p.requires_grad for p in model.parameters())
    groups = adapter.adapter_parameters()
    assert len(groups["bank"]) == 2  # the table and the factorised bank's up-projection
    assert not any(p.requires_grad for p in groups["bank"] + groups["kv"])
    assert all(p.requires_grad for p in groups["layers"])


@pytest.mark.parametrize(
    "kw, names",
    [
        ({"layers": "5"}, ("adapter.layers", "2 layers")),
        ({"layers": "last:3"}, ("adapter.layers", "2 layers")),
        ({"low_rank": "factorized", "rank": 128}, ("adapter.rank=128", "d_model=64")),
        ({"n_heads": 5}, ("adapter.n_heads=5", "d_model=64")),
        ({"low_rank": "reduced", "rank": 10}, ("4 attention heads", "adapter.rank=10")),
    ],
)
def test_bad_spec_is_a_config_error_naming_field_and_value(bases, kw, names):
    model = copy.deepcopy(bases["llama"])
    with pytest.raises(ConfigError) as err:
        HFMemAdapter(model, _spec(1, **kw))
    for name in names:
        assert name in str(err.value)
    assert _n_hooks(model) == 0  # the model is left as it was
    assert all(p.requires_grad for p in model.parameters())


def test_deepcopy_hooks_point_at_the_copy(bases, ids):
    adapter = HFMemAdapter(copy.deepcopy(bases["gemma3"]), _spec(1))
    _perturb(adapter)
    before = _logits(adapter, ids)
    clone = copy.deepcopy(adapter)
    assert torch.equal(_logits(clone, ids), before)
    with torch.no_grad():
        for m in clone.mem_layers.values():
            m.o.weight.mul_(-3.0)
    assert not torch.allclose(_logits(clone, ids), before)
    assert torch.equal(_logits(adapter, ids), before)
    clone.remove_hooks()  # removes the copy's hooks only
    assert torch.equal(_logits(adapter, ids), before)


def test_loads_a_local_directory(tmp_path, bases, ids):
    bases["qwen3"].save_pretrained(tmp_path)
    adapter = HFMemAdapter(tmp_path, _spec(2))
    assert torch.equal(_logits(adapter, ids), _logits(bases["qwen3"], ids))


def test_bf16_model_gets_fp32_adapters(ids):
    model = _build("llama", torch.bfloat16)
    before = _logits(model, ids)
    adapter = HFMemAdapter(model, _spec(2))
    assert all(p.dtype == torch.float32 for g in adapter.adapter_parameters().values() for p in g)
    got = _logits(adapter, ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, before)
    _perturb(adapter)
    assert not torch.equal(_logits(adapter, ids), before)


def test_seed_fixes_the_adapters_and_keeps_the_global_rng(bases):
    state = torch.random.get_rng_state()
    a = HFMemAdapter(copy.deepcopy(bases["olmo2"]), _spec(2), seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = HFMemAdapter(copy.deepcopy(bases["olmo2"]), _spec(2), seed=7)
    c = HFMemAdapter(copy.deepcopy(bases["olmo2"]), _spec(2), seed=8)
    pa, pb, pc = (
        torch.cat([p.flatten() for g in x.adapter_parameters().values() for p in g])
        for x in (a, b, c)
    )
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_generate_with_hooks(bases, ids):
    model = copy.deepcopy(bases["gemma3"])
    base = model.generate(ids, max_new_tokens=4, do_sample=False)
    adapter = HFMemAdapter(model, _spec(1))
    assert torch.equal(adapter.hf.generate(ids, max_new_tokens=4, do_sample=False), base)
    _perturb(adapter)
    assert adapter.hf.generate(ids, max_new_tokens=4, do_sample=False).shape == base.shape
