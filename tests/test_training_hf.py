"""Post-hoc memories on tiny random Hugging Face causal LMs (Llama, Qwen2): no-op init, frozen
anchor, sparse bank updates, co-training, per-path outputs, config → AnchorShape."""

from __future__ import annotations

import copy
import itertools
import os
import threading

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")

from memtree.geometry import ANCHOR_PRESETS, AnchorShape, MemoryConfig
from memtree.training.bank import TrainableBank
from memtree.training.hf import HFMemoryModel, anchor_shape_from_hf, hf_param_count
from memtree.training.model import assemble_memories
from memtree.training.optim import MemoryAdamW

MEMORY_TYPES = ("ffn", "lora-ffn", "lora-qk", "lora-ov", "kv")
VOCAB = 128


def _llama_config():
    return transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _qwen_config():
    return transformers.Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )


def _gemma_config():
    return transformers.Gemma3TextConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        sliding_window=4,
        tie_word_embeddings=True,
    )


def _save(config, cls, path):
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # non-trivial biases / norm gains so nothing hides behind zeros
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _save(_llama_config(), transformers.LlamaForCausalLM, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return _save(_qwen_config(), transformers.Qwen2ForCausalLM, tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    # per-head q/k norms, 4 norms per block, GELU-tanh MLP, sliding-window layers
    return _save(_gemma_config(), transformers.Gemma3ForCausalLM, tmp_path_factory.mktemp("gemma"))


@pytest.fixture(params=["llama", "qwen", "gemma"])
def model_dir(request, llama_dir, qwen_dir, gemma_dir):
    return {"llama": llama_dir, "qwen": qwen_dir, "gemma": gemma_dir}[request.param]


def _memory(kind: str = "ffn") -> MemoryConfig:
    return MemoryConfig(multipliers=(8, 4), type=kind, branching=2)


def _batch(batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


PATHS = torch.tensor([[0, 1], [1, 3]])  # level-2 cluster c sits under level-1 cluster c // 2


_BASE_LOGITS: dict[tuple, torch.Tensor] = {}


def _base_logits(model_dir, ids):
    """Logits of the plain HF checkpoint, loaded on its own (cached per directory and batch)."""
    key = (str(model_dir), tuple(ids.shape), ids.sum().item())
    if key not in _BASE_LOGITS:
        _BASE_LOGITS[key] = _load_base_logits(model_dir, ids)
    return _BASE_LOGITS[key]


def _load_base_logits(model_dir, ids):
    base = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        return base(ids).logits


def _train(
    model: HFMemoryModel, ids: torch.Tensor, steps: int, lr: float = 2e-2, params=None
) -> list[float]:
    opt = MemoryAdamW(params if params is not None else model.memory_parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(ids, paths=PATHS, labels=ids)
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss))
    return losses


# (1) no effect at App. I init -------------------------------------------------------------
@pytest.mark.parametrize("kind", MEMORY_TYPES)
def test_logits_equal_base_model_at_init(model_dir, kind):
    ids = _batch()
    want = _base_logits(model_dir, ids)
    model = HFMemoryModel(model_dir, _memory(kind)).eval()
    with torch.no_grad():
        fetched = model(ids, paths=PATHS).logits
        generic = model(ids).logits
        plain = model.hf(ids).logits
    assert torch.equal(fetched, want)
    assert torch.equal(generic, want)
    assert torch.equal(plain, want)


# the memory math: an FFN memory is a widened MLP, a LoRA memory a merged weight -----------------
_LORA_TARGETS = {
    "lora-ffn": (("mlp.gate_proj", "w1"), ("mlp.up_proj", "w2"), ("mlp.down_proj", "w3")),
    "lora-qk": (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k")),
    "lora-ov": (("self_attn.v_proj", "v"), ("self_attn.o_proj", "o")),
}


@pytest.mark.parametrize("kind", ["ffn", *_LORA_TARGETS])
def test_memories_equal_widened_or_merged_model(model_dir, kind):
    model = HFMemoryModel(model_dir, _memory(kind), lora_alpha=2.0).eval()
    g = torch.Generator().manual_seed(5)
    blocks = {
        lv: 0.2 * torch.randn(1, t.shape[1], generator=g) for lv, t in model.bank.tables.items()
    }
    mems = assemble_memories({int(lv): b for lv, b in blocks.items()}, model.anchor, model.memory)
    ids = _batch(batch=1)
    cfg = model.hf.config
    if kind == "ffn":  # concatenate memory rows onto the SwiGLU inner dim
        width = mems[0]["w1"].shape[1]
        cfg = type(cfg).from_dict(
            {**cfg.to_dict(), "intermediate_size": cfg.intermediate_size + width}
        )
    ref = type(model.hf)(cfg).eval()
    sd = {k: v.clone() for k, v in model.hf.state_dict().items()}
    for i, lm in mems.items():
        pre = f"model.layers.{i}."
        if kind == "ffn":
            w1, w2, w3 = (lm[n][0] for n in ("w1", "w2", "w3"))
            sd[pre + "mlp.gate_proj.weight"] = torch.cat([sd[pre + "mlp.gate_proj.weight"], w1])
            sd[pre + "mlp.up_proj.weight"] = torch.cat([sd[pre + "mlp.up_proj.weight"], w2])
            sd[pre + "mlp.down_proj.weight"] = torch.cat(
                [sd[pre + "mlp.down_proj.weight"], w3.T], 1
            )
            continue
        for module, n in _LORA_TARGETS[kind]:
            a, b = lm[f"{n}_a"][0], lm[f"{n}_b"][0]
            sd[pre + module + ".weight"] = sd[pre + module + ".weight"] + 2.0 / a.shape[0] * b @ a
    ref.load_state_dict(sd)
    with torch.no_grad():
        got = model(ids, memories=mems).logits
        want = ref(ids).logits
        base = model.hf(ids).logits
    assert not torch.allclose(got, base, atol=1e-3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


# (2) frozen anchor: loss falls, HF params bit-identical, only fetched rows change -----------------
@pytest.mark.parametrize("kind", MEMORY_TYPES)
def test_training_bank_only(model_dir, kind):
    ids = _batch()
    model = HFMemoryModel(model_dir, _memory(kind))
    assert all(not p.requires_grad for p in model.hf.parameters())
    assert {id(p) for p in model.memory_parameters()} == {id(p) for p in model.bank.tables.values()}
    assert set(model.state_dict()) == {f"hf.{k}" for k in model.hf.state_dict()} | {
        f"bank.tables.{lv}" for lv in model.bank.tables
    }
    hf_before = {n: p.detach().clone() for n, p in model.hf.named_parameters()}
    bank_before = {lv: t.detach().clone() for lv, t in model.bank.tables.items()}
    losses = _train(model, ids, steps=6)
    # LoRA-QK starts from near-uniform attention in a random model, so it moves slowest
    assert losses[-1] < losses[0] - (0.03 if kind in ("ffn", "lora-ffn") else 1e-3), losses
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    for n, p in model.hf.named_parameters():
        assert torch.equal(p, hf_before[n]), n
        assert p.grad is None, n
    for lv, table in model.bank.tables.items():
        changed = (table != bank_before[lv]).any(dim=1).nonzero().flatten().tolist()
        assert changed == sorted(set(PATHS[:, int(lv) - 1].tolist())), (lv, changed)


# (3) co-training moves the anchor ---------------------------------------------------------------
def test_cotrain_updates_hf_params(qwen_dir):
    """Table 2 / App. A.6 co-train a Qwen anchor with its memories."""
    ids = _batch()
    model = HFMemoryModel(qwen_dir, _memory("ffn"), cotrain=True)
    assert all(p.requires_grad for p in model.hf.parameters())
    before = {n: p.detach().clone() for n, p in model.hf.named_parameters()}
    losses = _train(model, ids, steps=3, lr=1e-3, params=model.parameters())
    assert losses[-1] < losses[0]
    changed = [n for n, p in model.hf.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    with pytest.raises(ValueError, match="contradicts"):
        HFMemoryModel(model.hf, _memory(), cotrain=True, freeze_anchor=True)


# (4) different paths → different outputs; no leak into the plain model ---------------------------
def test_paths_select_memories_after_training(llama_dir):
    ids = _batch()
    want = _base_logits(llama_dir, ids)
    model = HFMemoryModel(llama_dir, _memory("ffn"))
    _train(model, ids, steps=5)
    model.eval()
    same = ids[:1].expand(2, -1)
    with torch.no_grad():
        a, b = model(same, paths=PATHS).logits
        generic = model(same).logits
        again = model(same, paths=PATHS).logits
        plain = model.hf(ids).logits
    assert not torch.allclose(a, b)
    assert not torch.allclose(a, generic[0])  # generic row was never trained
    assert torch.equal(torch.stack([a, b]), again)  # deterministic, nothing carried over
    assert torch.equal(plain, want)  # hooks are no-ops outside a memory forward
    # a failing call still clears its memories
    with pytest.raises(ValueError, match="batch"), torch.no_grad():
        model(ids[:1], paths=PATHS)
    with torch.no_grad():
        assert torch.equal(model.hf(ids).logits, want)


def test_deepcopy_applies_the_copys_memories(llama_dir):
    model = HFMemoryModel(llama_dir, _memory("kv"))
    _train(model, _batch(), steps=3)
    model.eval()
    clone = copy.deepcopy(model)
    ids = _batch()
    with torch.no_grad():
        want = model(ids, paths=PATHS).logits
        assert torch.equal(clone(ids, paths=PATHS).logits, want)
        for t in clone.bank.tables.values():
            t.zero_()  # the copy's memories are now a no-op; the original's are not
        assert torch.equal(clone(ids, paths=PATHS).logits, clone.hf(ids).logits)
        assert torch.equal(model(ids, paths=PATHS).logits, want)
        assert not torch.equal(want, model.hf(ids).logits)


def test_generate_with_memories_matches_full_recompute(llama_dir):
    model = HFMemoryModel(llama_dir, _memory("ffn"))
    ids = _batch(seq=6)
    _train(model, ids, steps=3)
    model.eval()
    with torch.no_grad(), model.use_memories(paths=PATHS):
        gen = model.hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    seq = ids
    with torch.no_grad():
        for _ in range(4):
            nxt = model(seq, paths=PATHS).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(gen, seq)


def test_threads_see_only_their_memories(llama_dir):
    model = HFMemoryModel(llama_dir, _memory("ffn"))
    _train(model, _batch(), steps=3)
    model.eval()
    ids = _batch()
    with torch.no_grad():
        want_mem = model(ids, paths=PATHS).logits
        want_plain = model.hf(ids).logits
    results = {}

    def plain():
        with torch.no_grad():
            results["plain"] = model.hf(ids).logits

    with torch.no_grad(), model.use_memories(paths=PATHS):
        t = threading.Thread(target=plain)
        t.start()
        t.join()
        results["mem"] = model.hf(ids).logits
    assert torch.equal(results["plain"], want_plain)
    assert torch.equal(results["mem"], want_mem)


def test_accepts_existing_bank_and_checks_it(llama_dir):
    model = HFMemoryModel(llama_dir, _memory("ffn"))
    bank = TrainableBank(model.anchor, _memory("ffn"), seed=3)
    other = HFMemoryModel(model.hf, bank=bank)
    assert other.bank is bank and other.memory == bank.memory
    wrong = TrainableBank(
        AnchorShape(n_layers=2, d_model=32, n_heads=4, head_dim=8, ffn_dim=48), _memory("ffn")
    )
    with pytest.raises(ValueError, match="geometry"):
        HFMemoryModel(model.hf, bank=wrong)


# (5) config → AnchorShape ---------------------------------------------------------------------
def test_anchor_shape_from_tiny_configs():
    llama = anchor_shape_from_hf(_llama_config(), name="tiny-llama")
    assert llama == AnchorShape(
        name="tiny-llama",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        ffn_dim=64,
        vocab_size=128,
        tied_embeddings=False,
        qk_norm="none",
        norms_per_block=2,
        qkv_bias=False,
    )
    qwen = anchor_shape_from_hf(_qwen_config(), name="tiny-qwen")
    assert qwen == AnchorShape(
        name="tiny-qwen",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        ffn_dim=64,
        vocab_size=128,
        tied_embeddings=True,
        qk_norm="none",
        norms_per_block=2,
        qkv_bias=True,
    )
    # Llama/Qwen norms are weight-only RMSNorms, so the count is exact for these two
    for cfg, cls, shape in (
        (_llama_config(), transformers.LlamaForCausalLM, llama),
        (_qwen_config(), transformers.Qwen2ForCausalLM, qwen),
    ):
        with torch.device("meta"):
            assert hf_param_count(cls(cfg)) == shape.params()


def test_anchor_shape_matches_table2_presets():
    """The public configs of Table 2's models give the geometry presets."""
    cfgs = {
        "gemma3-270m": transformers.Gemma3TextConfig(
            hidden_size=640,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=2048,
            vocab_size=262_144,
            tie_word_embeddings=True,
        ),
        "qwen2.5-0.5b": transformers.Qwen2Config(
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            vocab_size=151_936,
            tie_word_embeddings=True,
        ),
        "llama3.2-1b": transformers.LlamaConfig(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=8192,
            vocab_size=128_256,
            tie_word_embeddings=True,
        ),
    }
    for name, cfg in cfgs.items():
        assert anchor_shape_from_hf(cfg, name=name) == ANCHOR_PRESETS[name], name


# (6) errors -----------------------------------------------------------------------------------
def test_missing_directory_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model.*does not exist"):
        HFMemoryModel(missing, _memory())
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty.*no config.json"):
        HFMemoryModel(empty, _memory())


def test_gradient_checkpointing_is_refused(llama_dir):
    model = HFMemoryModel(llama_dir, _memory(), cotrain=True)
    model.hf.gradient_checkpointing_enable()
    model.train()
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        model(_batch(), paths=PATHS)
