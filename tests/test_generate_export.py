"""Exporting an anchor (and a post-hoc HF memory) with one path's memory merged, as a Hugging Face
folder: the loaded folder's logits and greedy tokens equal the memtree model's with that memory,
for every memory type, q/k norm, tied and separate heads; tokenizer; refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")

from memtree.geometry import AnchorShape, MemoryConfig, block_layout
from memtree.training.generate.export import export_anchor, export_hf_memory
from memtree.training.hf import HFMemoryModel
from memtree.training.layers.moc import MoCConfig
from memtree.training.layers.pkm import PKMConfig
from memtree.training.model import AnchorLM, BankRead, ModelConfig, assemble_memories

VOCAB = 97
KINDS = ("ffn", "kv", "lora-qk", "lora-ov", "lora-ffn")
TOL = 1e-4


def _anchor(qk_norm: str = "full", tied: bool = True, norms_per_block: int = 2) -> AnchorShape:
    # GQA throughout; q/k/v biases with the separate head, so both variants meet every norm
    return AnchorShape(
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        ffn_dim=64,
        vocab_size=VOCAB,
        qk_norm=qk_norm,
        tied_embeddings=tied,
        norms_per_block=norms_per_block,
        qkv_bias=not tied,
    )


def _model(
    anchor: AnchorShape, memory: MemoryConfig | None = None, seed: int = 0, **kw
) -> AnchorLM:
    torch.manual_seed(seed)
    # a wide init and non-trivial gains and biases, so a dropped term shows in the logits
    model = AnchorLM(
        ModelConfig(
            anchor=anchor, memory=memory, max_seq_len=64, init_std=0.2, lora_alpha=2.0, **kw
        )
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def _memories(anchor: AnchorShape, memory: MemoryConfig, batch: int = 1, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    blocks = {}
    for level in range(1, memory.n_levels + 1):
        n = sum(t.numel for t in block_layout(anchor, memory, level))
        if n:
            blocks[level] = 0.3 * torch.randn(batch, n, generator=g)
    return assemble_memories(blocks, anchor, memory)


def _ids(seq: int = 16, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seed))


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    ).eval()


def _greedy(model: AnchorLM, ids: torch.Tensor, memories, n: int) -> torch.Tensor:
    """n tokens by argmax over the memtree model's full forward, one step at a time."""
    for _ in range(n):
        with torch.no_grad():
            nxt = model(ids, memories=memories)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def _check_logits(model, memories, out):
    ids = _ids()
    with torch.no_grad():
        want = model(ids, memories=memories)
        got = _load(out)(ids).logits
        if memories:  # the memory matters, so an export that dropped it would fail
            assert (want - model(ids)).abs().max() > 0.05
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"max |Δlogit| {diff:.2e}"
    return diff


# (1) logits equal the memtree model's, per memory type / q-k norm / head ----------------------
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("qk_norm", ["full", "head"])
@pytest.mark.parametrize("kind", [None, *KINDS])
def test_export_logits_equal(tmp_path, kind, qk_norm, tied):
    anchor = _anchor(qk_norm, tied)
    memory = MemoryConfig(multipliers=(0, 4, 8), type=kind or "ffn", branching=2)
    model = _model(anchor, memory)
    memories = _memories(anchor, memory) if kind else None
    info = export_anchor(model, tmp_path / "out", memories=memories)
    # StableLM holds per-head norms (or none) exactly; OpenLM's full-width q/k norms and a KV
    # memory need the memtree architecture
    stock = qk_norm == "head" and kind != "kv"
    assert info["architecture"] == ("StableLmForCausalLM" if stock else "MemtreeAnchorForCausalLM")
    assert info["memory_merged"] is bool(kind) and info["memory_type"] == kind
    assert info["intermediate_size"] == 64 + (12 if kind == "ffn" else 0)
    assert info["kv_memory_slots"] == ([12, 12] if kind == "kv" else None)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["model_type"]
        == info["model_type"]
    )
    assert info["bytes"] > 0 and info["params"] > 0
    diff = _check_logits(model, memories, tmp_path / "out")
    print(
        f"{kind} {qk_norm} {'tied' if tied else 'untied'}: "
        f"{info['architecture']} max |Δlogit| {diff:.2e}"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_export_uneven_layers_and_post_norms(tmp_path, kind):
    """Memory on layer 1 only (FFN: layer 0 zero-padded to the common width; KV: no slots there),
    4 norms per block, no q/k norm: the memtree architecture, still exact."""
    anchor = _anchor("none", tied=False, norms_per_block=4)
    memory = MemoryConfig(
        multipliers=(4, 2),
        type=kind,
        branching=2,
        placement="explicit",
        layers=(1,),
        preserve_total=False,
    )
    model = _model(anchor, memory)
    memories = _memories(anchor, memory)
    assert set(memories) == {1}
    info = export_anchor(model, tmp_path / "out", memories=memories)
    assert info["architecture"] == "MemtreeAnchorForCausalLM"
    assert info["intermediate_size"] == 64 + (6 if kind == "ffn" else 0)
    if kind == "kv":
        assert info["kv_memory_slots"] == [0, 6]
    _check_logits(model, memories, tmp_path / "out")


def test_stablelm_needs_full_width_attention(tmp_path):
    """n_heads·head_dim != d_model: StableLM's square o_proj cannot hold it."""
    anchor = AnchorShape(
        n_layers=2, d_model=32, n_heads=2, head_dim=8, ffn_dim=64, vocab_size=VOCAB, qk_norm="head"
    )
    model = _model(anchor)
    info = export_anchor(model, tmp_path / "out")
    assert info["architecture"] == "MemtreeAnchorForCausalLM" and "d_model" in info["why_not_stock"]
    _check_logits(model, None, tmp_path / "out")


def test_export_keeps_bf16(tmp_path):
    """A bf16 model exports bf16 weights (LoRA merged in fp32, rounded once)."""
    anchor = _anchor("full")
    memory = MemoryConfig(multipliers=(4,), type="lora-ffn", branching=2)
    model = _model(anchor, memory).to(torch.bfloat16)
    memories = _memories(anchor, memory)
    info = export_anchor(model, tmp_path / "out", memories=memories)
    assert info["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "out" / "model.safetensors").values()} == {
        torch.bfloat16
    }
    ids = _ids()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(ids, memories=memories).float()
        got = hf(ids).logits.float()
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # bf16 rounding, not a lost term


# (2) greedy generation equals a greedy loop over the memtree model ----------------------------
@pytest.mark.parametrize(
    "qk_norm,kind",
    [("full", "ffn"), ("full", "kv"), ("head", "lora-ffn"), ("head", "ffn"), ("full", "lora-qk")],
)
def test_generate_matches_greedy_loop(tmp_path, qk_norm, kind):
    anchor = _anchor(qk_norm, tied=True)
    memory = MemoryConfig(multipliers=(0, 4, 8), type=kind, branching=2)
    model = _model(anchor, memory)
    memories = _memories(anchor, memory)
    export_anchor(model, tmp_path / "out", memories=memories)
    hf = _load(tmp_path / "out")
    prompt = _ids(seq=7, seed=5)
    want = _greedy(model, prompt, memories, 5)
    for use_cache in (True, False):
        got = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=5,
            use_cache=use_cache,
        )
        assert torch.equal(got, want), (use_cache, got, want)


def test_generate_left_padded_batch(tmp_path):
    """The memtree architecture's padding mask: a left-padded batch generates what each prompt
    generates alone."""
    anchor = _anchor("full", tied=False)
    memory = MemoryConfig(multipliers=(4,), type="kv", branching=2)
    model = _model(anchor, memory)
    memories = _memories(anchor, memory)
    export_anchor(model, tmp_path / "out", memories=memories)
    hf = _load(tmp_path / "out")
    short, long = _ids(seq=4, seed=7), _ids(seq=9, seed=8)
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], dim=1), long])
    mask = torch.cat(
        [torch.cat([torch.zeros(1, 5), torch.ones(1, 4)], dim=1), torch.ones(1, 9)]
    ).long()
    got = hf.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=4, pad_token_id=0)
    for row, prompt in ((0, short), (1, long)):
        assert torch.equal(got[row, 9:], _greedy(model, prompt, memories, 4)[0, -4:])


def test_cache_in_chunks_equals_full_forward(tmp_path):
    """The memtree architecture's DynamicCache: a prompt fed in chunks (the second one several
    tokens after a cached prefix) gives the logits of one full forward."""
    anchor = _anchor("full", tied=False, norms_per_block=4)
    memory = MemoryConfig(multipliers=(4,), type="kv", branching=2)
    model = _model(anchor, memory)
    export_anchor(model, tmp_path / "out", memories=_memories(anchor, memory))
    hf = _load(tmp_path / "out")
    ids = _ids(seq=12)
    with torch.no_grad():
        full = hf(ids, use_cache=False).logits
        first = hf(ids[:, :5], use_cache=True)
        second = hf(ids[:, 5:], past_key_values=first.past_key_values, use_cache=True)
    assert torch.allclose(torch.cat([first.logits, second.logits], dim=1), full, atol=1e-5)


# (3) tokenizer ----------------------------------------------------------------------------------
def _tokenizer_dir(path, hf_files: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|endoftext|>", "the", "cat", "sat", "on", "mat", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    if hf_files:  # a folder saved by transformers, with another eos: the export makes EOT the eos
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="mat").save_pretrained(
            path
        )
    else:  # a bare tokenizers file
        tok.save(str(path / "tokenizer.json"))
    # what a memtree run's tokenizer folder records (pipeline/window.py)
    (path / "memtree_tokenizer.json").write_text(
        json.dumps({"eot_token": "<|endoftext|>", "eot_id": 0})
    )
    return path


@pytest.mark.parametrize("hf_files", [False, True], ids=["tokenizer.json", "hf-folder"])
def test_tokenizer_and_eos(tmp_path, hf_files):
    model = _model(_anchor("head"))
    info = export_anchor(
        model, tmp_path / "out", tokenizer_dir=_tokenizer_dir(tmp_path / "tok", hf_files)
    )
    out = tmp_path / "out"
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0 and tok.pad_token_id == 0
    assert tok("the cat sat")["input_ids"] == [1, 2, 3]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    assert info["architecture"] == "StableLmForCausalLM"


# (4) refusals -----------------------------------------------------------------------------------
def test_refuses_existing_folder_and_accepts_empty_one(tmp_path):
    model = _model(_anchor())
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=str(out)):
        export_anchor(model, out)
    assert (out / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    export_anchor(model, empty)
    assert (empty / "model.safetensors").is_file()


def test_refuses_bad_memories(tmp_path):
    anchor = _anchor()
    memory = MemoryConfig(multipliers=(4,), type="ffn", branching=2)
    model = _model(anchor, memory)
    with pytest.raises(ValueError, match="B = 1"):
        export_anchor(model, tmp_path / "out", memories=_memories(anchor, memory, batch=2))
    wrong = {0: {"k": torch.zeros(1, 4, 16), "v": torch.zeros(1, 4, 16)}}
    with pytest.raises(ValueError, match="'ffn' memory has tensors"):
        export_anchor(model, tmp_path / "out", memories=wrong)
    with pytest.raises(ValueError, match="without memory"):
        export_anchor(_model(anchor), tmp_path / "out", memories=_memories(anchor, memory))
    with pytest.raises(TypeError, match="BankRead"):
        export_anchor(model, tmp_path / "out", memories={0: BankRead(levels=())})
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.iterdir())  # no temp folder left behind either


def test_refuses_moc_and_pkm(tmp_path):
    anchor = _anchor()
    moc = _model(anchor, moc=MoCConfig(n_chapters=3, tokens_per_chapter=2, top_k=1, layers=(1,)))
    with pytest.raises(ValueError, match="Mixture-of-Chapters"):
        export_anchor(moc, tmp_path / "out")
    pkm = _model(anchor, pkm=PKMConfig(n_keys=4, heads=2, k=2, key_dim=8))
    with pytest.raises(ValueError, match="product-key"):
        export_anchor(pkm, tmp_path / "out")


# (5) post-hoc memory on a Hugging Face Llama -----------------------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm gains
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("placement", ["uniform", "layer1"])
@pytest.mark.parametrize("kind", ["ffn", "lora-qk", "lora-ov", "lora-ffn"])
def test_export_hf_memory_logits_equal(tmp_path, llama_dir, kind, placement):
    extra = {"placement": "explicit", "layers": (1,)} if placement == "layer1" else {}
    memory = MemoryConfig(multipliers=(8, 4), type=kind, branching=2, **extra)
    hf = HFMemoryModel(llama_dir, memory, lora_alpha=2.0).eval()
    memories = _memories(hf.anchor, memory)
    info = export_hf_memory(hf, memories, tmp_path / "out")
    assert info["architecture"] == "LlamaForCausalLM" and info["memory_merged"]
    if kind == "ffn":
        assert info["intermediate_size"] == 64 + (12 if placement == "uniform" else 24)
    ids = _ids()
    with torch.no_grad():
        want = hf(ids, memories=memories).logits
        got = _load(tmp_path / "out")(ids).logits
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"max |Δlogit| {diff:.2e}"
    print(f"hf {kind} {placement}: max |Δlogit| {diff:.2e}")


def test_export_hf_memory_refuses_kv(tmp_path, llama_dir):
    memory = MemoryConfig(multipliers=(4,), type="kv", branching=2)
    hf = HFMemoryModel(llama_dir, memory)
    with pytest.raises(ValueError, match="'kv' memory"):
        export_hf_memory(hf, _memories(hf.anchor, memory), tmp_path / "out")
    assert not (tmp_path / "out").exists()
