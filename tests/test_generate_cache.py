"""Decoding with a KV cache equals the full forward, for every memory type an anchor takes.

The logits of each step of a cached decode (prefill, then one token at a time, and a chunk of
several tokens after a prefix) are compared with one full forward over the same tokens with the
same memory: fp32, ≤ 1e-5."""

from __future__ import annotations

import pytest
import torch

from memtree.geometry import AnchorShape, MemoryConfig, block_layout
from memtree.training.model import AnchorLM, KVCache, ModelConfig, assemble_memories

TYPES = ("ffn", "kv", "lora-qk", "lora-ov", "lora-ffn")


def _model(
    memory_type: str | None, *, qk_norm: str = "full", kv_heads: int | None = None, norms: int = 2
) -> tuple[AnchorLM, dict | None]:
    torch.manual_seed(0)
    shape = AnchorShape(
        n_layers=3,
        d_model=32,
        n_heads=4,
        head_dim=8,
        ffn_dim=48,
        vocab_size=61,
        qk_norm=qk_norm,
        n_kv_heads=kv_heads,
        norms_per_block=norms,
    )
    memory = (
        None
        if memory_type is None
        else MemoryConfig(multipliers=(0, 4, 8), type=memory_type, branching=2)
    )
    model = AnchorLM(ModelConfig(anchor=shape, max_seq_len=40, memory=memory)).eval()
    if memory is None:
        return model, None
    # random nonzero blocks: App. I's init would make several types an exact no-op
    blocks = {
        lv: torch.randn(1, sum(t.numel for t in block_layout(shape, memory, lv))) * 0.3
        for lv in (2, 3)
    }
    return model, assemble_memories(blocks, shape, memory)


def _cached_logits(model: AnchorLM, ids: torch.Tensor, mems, chunks: list[int]) -> torch.Tensor:
    cache = KVCache.for_model(model, batch=ids.shape[0])
    out, at = [], 0
    for n in chunks:
        out.append(model(ids[:, at : at + n], memories=mems, cache=cache))
        at += n
    assert cache.length == at
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("memory_type", [None, *TYPES])
def test_cached_decoding_equals_the_full_forward(memory_type):
    model, mems = _model(memory_type)
    ids = torch.randint(0, 61, (2, 23))
    if mems is not None:  # a batch of two rows, each with its own memory
        mems = {i: {k: torch.cat([v, 1.5 * v]) for k, v in t.items()} for i, t in mems.items()}
    with torch.no_grad():
        full = model(ids, memories=mems)
        # prefill 9 tokens, then one by one, then a chunk of 5 after a cached prefix
        steps = _cached_logits(model, ids, mems, [9] + [1] * 9 + [5])
    assert (full - steps).abs().max() <= 1e-5
    if mems is not None:  # the memory changes what is decoded, so the comparison sees it
        with torch.no_grad():
            assert (model(ids) - full).abs().max() > 1e-3


@pytest.mark.parametrize("qk_norm,kv_heads,norms", [("head", 2, 4), ("none", 1, 2)])
def test_cached_decoding_equals_the_full_forward_on_other_anchor_shapes(qk_norm, kv_heads, norms):
    model, mems = _model("kv", qk_norm=qk_norm, kv_heads=kv_heads, norms=norms)
    ids = torch.randint(0, 61, (1, 17))
    with torch.no_grad():
        full = model(ids, memories=mems)
        steps = _cached_logits(model, ids, mems, [1] * 17)
    assert (full - steps).abs().max() <= 1e-5


def test_a_cache_refuses_what_it_cannot_hold():
    model, _ = _model(None)
    cache = KVCache.for_model(model, batch=1, max_len=8)
    assert cache.max_len == 8 and cache.nbytes == 2 * 3 * 1 * 4 * 8 * 8 * 4
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="exceeds max_seq_len"):
            model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="holds 1 rows"):
            model(torch.zeros(2, 1, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="one document per row"):
            model(
                torch.zeros(1, 1, dtype=torch.long),
                cache=cache,
                segment_ids=torch.zeros(1, 1, dtype=torch.long),
            )


def test_a_widened_ffn_memory_decodes_as_the_gathered_one():
    """An FFN memory joined onto the FFN's weights (one wider SwiGLU per layer) gives the gathered
    read's logits, cached or not; other memory types and batches of two are refused."""
    from memtree.training.model import WidenedFFN, widen_ffn_memories

    model, mems = _model("ffn")
    ids = torch.randint(0, 61, (1, 19))
    wide = widen_ffn_memories(model, mems)
    a = model.config.anchor
    assert all(
        isinstance(w, WidenedFFN) and w.w1.shape == (a.ffn_dim + 12, a.d_model)
        for w in wide.values()
    )
    with torch.no_grad():
        full = model(ids, memories=mems)
        assert (model(ids, memories=wide) - full).abs().max() <= 1e-5
        assert (_cached_logits(model, ids, wide, [7] + [1] * 12) - full).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="one sequence"):
        widen_ffn_memories(
            model, {i: {k: torch.cat([v, v]) for k, v in t.items()} for i, t in mems.items()}
        )
    kv, kv_mems = _model("kv")
    with pytest.raises(ValueError, match="not an FFN memory"):
        widen_ffn_memories(kv, kv_mems)
