"""Anchor transformer and memory layers: parameter counts, no-op init, masking, gradients."""

from __future__ import annotations

import pytest
import torch

from memtree.geometry import ANCHOR_PRESETS, AnchorShape, MemoryConfig, block_layout
from memtree.training.model import AnchorLM, ModelConfig, assemble_memories, segment_ids_from_eot

TINY = AnchorShape(
    name="tiny", n_layers=4, d_model=32, n_heads=4, head_dim=8, ffn_dim=48, vocab_size=61
)
TINY_GQA = AnchorShape(
    name="tiny-gqa",
    n_layers=4,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=48,
    vocab_size=61,
    tied_embeddings=False,
    qk_norm="head",
    norms_per_block=4,
    qkv_bias=True,
)
EOT = 0
MEMORY_TYPES = ("ffn", "lora-qk", "lora-ov", "lora-ffn", "kv")
PLACEMENTS = (
    {"placement": "uniform"},
    {"placement": "late", "placement_layers": 3},  # widths m·4/3, remainder on the first layers
)


def _model(anchor: AnchorShape = TINY, memory: MemoryConfig | None = None) -> AnchorLM:
    torch.manual_seed(0)
    return AnchorLM(ModelConfig(anchor=anchor, memory=memory, max_seq_len=64)).eval()


def _is_zero_at_init(name: str, kind: str) -> bool:
    """App. I: FFN w3, LoRA B and KV values start at zero so memories start as a no-op."""
    tensor = name.rsplit(".", 1)[1]
    return {"ffn": tensor == "w3", "kv": tensor == "v"}.get(kind, tensor.endswith("_b"))


def _init_blocks(
    anchor: AnchorShape, mem: MemoryConfig, batch: int, *, app_i: bool
) -> dict[int, torch.Tensor]:
    """Flat (B, P) blocks per level; app_i=True zeroes the tensors App. I zero-initialises."""
    out = {}
    for level in range(1, mem.n_levels + 1):
        parts = []
        for spec in block_layout(anchor, mem, level):
            t = torch.randn(batch, spec.numel) * 0.1
            zero = app_i and _is_zero_at_init(spec.name, mem.type)
            parts.append(torch.zeros_like(t) if zero else t)
        if parts:
            out[level] = torch.cat(parts, dim=1)
    return out


def _tokens(batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, TINY.vocab_size, (batch, seq), generator=g)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("openlm-160m", 163_510_016), ("openlm-410m", 411_665_408), ("openlm-1.4b", 1_439_893_504)],
)
def test_preset_param_counts_match_paper(name, expected):
    with torch.device("meta"):
        model = AnchorLM(ModelConfig(anchor=ANCHOR_PRESETS[name]))
    assert sum(p.numel() for p in model.parameters()) == expected == ANCHOR_PRESETS[name].params()


@pytest.mark.parametrize("name", sorted(ANCHOR_PRESETS))
def test_every_preset_matches_geometry(name):
    with torch.device("meta"):
        model = AnchorLM(ModelConfig(anchor=ANCHOR_PRESETS[name]))
    assert sum(p.numel() for p in model.parameters()) == ANCHOR_PRESETS[name].params()


@pytest.mark.parametrize("anchor", [TINY, TINY_GQA], ids=["tiny", "tiny-gqa"])
def test_tiny_param_count_and_init(anchor):
    model = _model(anchor)
    assert sum(p.numel() for p in model.parameters()) == anchor.params()
    w = model.blocks[0].attn.q.weight
    assert w.abs().max() <= 2 * 0.02 and w.std() > 0.01
    assert torch.equal(model.blocks[0].attn_norm.weight, torch.ones(anchor.d_model))
    logits = model(_tokens())
    assert logits.shape == (2, 24, anchor.vocab_size) and torch.isfinite(logits).all()


def test_tied_vs_separate_head():
    tied = _model(TINY)
    assert tied.lm_head is None
    sep = _model(AnchorShape(**{**TINY.__dict__, "tied_embeddings": False}))
    assert sep.lm_head is not None and sep.lm_head.weight is not sep.embed.weight
    diff = sum(p.numel() for p in sep.parameters()) - sum(p.numel() for p in tied.parameters())
    assert diff == TINY.vocab_size * TINY.d_model


def test_segment_ids_from_eot():
    ids = torch.tensor([[5, EOT, 3, 4, EOT, 7], [EOT, 2, 2, 2, 2, EOT]])
    assert segment_ids_from_eot(ids, EOT).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]]


def test_document_mask_and_causality():
    model = _model()
    ids = _tokens(batch=1, seq=20)
    ids[0, 7] = EOT  # document 0 = positions 0..7, document 1 = 8..19
    seg = segment_ids_from_eot(ids, EOT)
    changed = ids.clone()
    changed[0, 1:7] = (changed[0, 1:7] % (TINY.vocab_size - 1)) + 1  # other doc-0 tokens, EOT kept
    with torch.no_grad():
        base, other = model(ids, segment_ids=seg), model(changed, segment_ids=seg)
        torch.testing.assert_close(base[:, 8:], other[:, 8:], rtol=0, atol=1e-6)
        assert not torch.allclose(base[:, :7], other[:, :7])
        # without the document mask, document 1 sees document 0
        assert not torch.allclose(model(ids)[:, 8:], model(changed)[:, 8:])
        future = ids.clone()
        future[0, 12:] = (future[0, 12:] % (TINY.vocab_size - 1)) + 1
        torch.testing.assert_close(model(ids)[:, :12], model(future)[:, :12], rtol=0, atol=1e-6)


@pytest.mark.parametrize("anchor", [TINY, TINY_GQA], ids=lambda a: a.name)
def test_flex_attention_matches_the_dense_document_mask(anchor):
    """attn_impl "flex" (block-sparse FlexAttention) computes what the dense SDPA mask does,
    with ragged documents (one ends mid-block, one is a single token) and without segments."""
    torch.manual_seed(0)
    sdpa = AnchorLM(ModelConfig(anchor=anchor, max_seq_len=160))
    flex = AnchorLM(ModelConfig(anchor=anchor, max_seq_len=160, attn_impl="flex"))
    flex.load_state_dict(sdpa.state_dict())
    ids = _tokens(batch=2, seq=150)
    ids[0, [40, 41, 130]] = EOT  # documents 0..40, 41 alone, 42..130, 131..149
    ids[1, 99] = EOT
    seg = segment_ids_from_eot(ids, EOT)
    for segments in (seg, None):
        a, b = sdpa(ids, segment_ids=segments), flex(ids, segment_ids=segments)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        ga = torch.autograd.grad(a.square().mean(), sdpa.blocks[0].attn.q.weight)[0]
        gb = torch.autograd.grad(b.square().mean(), flex.blocks[0].attn.q.weight)[0]
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="attn_impl 'xformers' is not supported"):
        ModelConfig(anchor=anchor, attn_impl="xformers")


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p["placement"])
@pytest.mark.parametrize("kind", MEMORY_TYPES)
@pytest.mark.parametrize("anchor", [TINY, TINY_GQA], ids=["tiny", "tiny-gqa"])
def test_memories_are_a_noop_at_init(anchor, kind, placement):
    mem = MemoryConfig(multipliers=(3, 0, 2), type=kind, branching=2, **placement)
    model = _model(anchor, mem)
    ids = _tokens()
    seg = segment_ids_from_eot(ids, EOT)
    memories = assemble_memories(_init_blocks(anchor, mem, 2, app_i=True), anchor, mem)
    with torch.no_grad():
        with_mem = model(ids, segment_ids=seg, memories=memories)
        assert torch.equal(with_mem, model(ids, segment_ids=seg))
        blocks = _init_blocks(anchor, mem, 2, app_i=False)
        zero = {lv: torch.zeros_like(b) for lv, b in blocks.items()}
        zero_mem = assemble_memories(zero, anchor, mem)  # generic/blocked fallback
        assert torch.equal(model(ids, memories=zero_mem), model(ids))


@pytest.mark.parametrize("kind", MEMORY_TYPES)
def test_nonzero_memory_changes_only_its_sequence(kind):
    mem = MemoryConfig(multipliers=(4,), type=kind, branching=2)
    model = _model(TINY, mem)
    ids = _tokens()
    blocks = _init_blocks(TINY, mem, 2, app_i=False)
    blocks[1][1] = 0  # sequence 1 gets an all-zero memory
    with torch.no_grad():
        base = model(ids)
        out = model(ids, memories=assemble_memories(blocks, TINY, mem))
    assert torch.equal(out[1], base[1])
    assert (out[0] - base[0]).abs().max() > 1e-4


@pytest.mark.parametrize("kind", MEMORY_TYPES)
def test_gradients_reach_blocks_and_zero_init_partners_get_none(kind):
    """At App. I init, d out / d partner passes through the zero tensor: only that one gets grad."""
    mem = MemoryConfig(multipliers=(3, 2), type=kind, branching=2)
    model = _model(TINY, mem)
    blocks = {lv: b.requires_grad_() for lv, b in _init_blocks(TINY, mem, 2, app_i=True).items()}
    logits = model(_tokens(), memories=assemble_memories(blocks, TINY, mem))
    (logits * torch.randn_like(logits)).sum().backward()
    assert model.embed.weight.grad is not None
    for level, b in blocks.items():
        assert b.grad is not None and b.grad.shape == b.shape
        off = 0
        for spec in block_layout(TINY, mem, level):
            g = b.grad[:, off : off + spec.numel]
            off += spec.numel
            partner_is_zero = not _is_zero_at_init(spec.name, kind)
            if partner_is_zero:
                assert torch.count_nonzero(g) == 0, spec.name
            else:
                assert (g.abs().sum(dim=1) > 0).all(), spec.name


def test_assemble_memories_matches_hand_concatenation():
    mem = MemoryConfig(multipliers=(4, 2), type="ffn", branching=2)
    d, n_layers, batch = TINY.d_model, TINY.n_layers, 3
    flat = {lv: torch.randn(batch, n_layers * 3 * w * d) for lv, w in ((1, 4), (2, 2))}
    got = assemble_memories(flat, TINY, mem)
    assert sorted(got) == list(range(n_layers))
    for layer in range(n_layers):
        for j, name in enumerate(("w1", "w2", "w3")):
            parts = []
            for level, w in ((1, 4), (2, 2)):
                start = (layer * 3 + j) * w * d  # level block = layers × (w1, w2, w3) × (w, d)
                parts.append(flat[level][:, start : start + w * d].reshape(batch, w, d))
            assert torch.equal(got[layer][name], torch.cat(parts, dim=1))


def test_assemble_lora_concatenates_rank_and_skips_bare_layers():
    mem = MemoryConfig(
        multipliers=(2, 3),
        type="lora-qk",
        branching=2,
        placement="explicit",
        layers=(1, 3),
        preserve_total=False,
    )
    sizes = {lv: sum(t.numel for t in block_layout(TINY, mem, lv)) for lv in (1, 2)}
    flat = {lv: torch.randn(2, n, requires_grad=True) for lv, n in sizes.items()}
    got = assemble_memories(flat, TINY, mem)
    assert sorted(got) == [1, 3]
    assert got[1]["q_a"].shape == (2, 5, TINY.d_model) and got[1]["q_b"].shape == (2, TINY.q_dim, 5)
    assert torch.equal(
        got[3]["k_b"][:, :, :2], flat[1][:, -TINY.kv_dim * 2 :].reshape(2, TINY.kv_dim, 2)
    )
    sum(t.sum() for t in got[3].values()).backward()
    assert all(f.grad is not None and f.grad.abs().sum() > 0 for f in flat.values())


def test_memory_errors():
    mem = MemoryConfig(multipliers=(2,), type="ffn", branching=2)
    with pytest.raises(ValueError, match="expected shape"):
        assemble_memories({1: torch.zeros(2, 5)}, TINY, mem)
    with pytest.raises(ValueError, match="no blocks"):
        assemble_memories({}, TINY, mem)
    memories = assemble_memories(_init_blocks(TINY, mem, 2, app_i=True), TINY, mem)
    with pytest.raises(ValueError, match="without memory"):
        _model(TINY)(_tokens(), memories=memories)


def test_ffn_memory_equals_widened_swiglu():
    """§2.2: an FFN memory is the anchor FFN with its inner dim widened by concatenation."""
    mem = MemoryConfig(multipliers=(5,), type="ffn", branching=2)
    ffn = _model(TINY, mem).blocks[0].ffn
    layer = assemble_memories(_init_blocks(TINY, mem, 2, app_i=False), TINY, mem)[0]
    x = torch.randn(2, 7, TINY.d_model)
    with torch.no_grad():
        got = ffn(x, layer)
        for b in range(2):
            w1 = torch.cat([ffn.w1.weight, layer["w1"][b]])  # (ffn + W, d)
            w2 = torch.cat([ffn.w2.weight, layer["w2"][b]])
            w3 = torch.cat([ffn.w3.weight.T, layer["w3"][b]])  # (ffn + W, d)
            want = (torch.nn.functional.silu(x[b] @ w1.T) * (x[b] @ w2.T)) @ w3
            torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


def test_lora_ffn_scale_and_level_sum():
    """Two levels' LoRAs = one LoRA of rank r1 + r2 with scale alpha / (r1 + r2)."""
    mem = MemoryConfig(multipliers=(2, 3), type="lora-ffn", branching=2)
    torch.manual_seed(0)
    ffn = AnchorLM(ModelConfig(anchor=TINY, memory=mem, lora_alpha=2.5)).blocks[1].ffn
    layer = assemble_memories(_init_blocks(TINY, mem, 2, app_i=False), TINY, mem)[1]
    x = torch.randn(2, 7, TINY.d_model)
    with torch.no_grad():
        got = ffn(x, layer)
        for b in range(2):
            w = {
                n: getattr(ffn, n).weight + (2.5 / 5) * layer[f"{n}_b"][b] @ layer[f"{n}_a"][b]
                for n in ("w1", "w2", "w3")
            }
            want = (torch.nn.functional.silu(x[b] @ w["w1"].T) * (x[b] @ w["w2"].T)) @ w["w3"].T
            torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


def test_kv_memory_is_a_separate_position_free_softmax_with_gqa():
    mem = MemoryConfig(multipliers=(6,), type="kv", branching=2)
    model = _model(TINY_GQA, mem)
    attn = model.blocks[0].attn
    layer = assemble_memories(_init_blocks(TINY_GQA, mem, 2, app_i=False), TINY_GQA, mem)[0]
    x = torch.randn(2, 9, TINY_GQA.d_model)
    cos, sin = model._rope_tables(9, x.device)
    h, hkv, d = TINY_GQA.n_heads, TINY_GQA.kv_heads, TINY_GQA.head_dim
    with torch.no_grad():
        delta = attn(x, cos, sin, None, layer) - attn(x, cos, sin, None, None)
        q = attn.q_norm(attn.q(x).view(2, 9, h, d))  # per-head q-norm, no RoPE
        kv_head = torch.arange(h) // (h // hkv)  # query head i reads kv head i // groups
        k = layer["k"].view(2, 6, hkv, d)[:, :, kv_head]
        v = layer["v"].view(2, 6, hkv, d)[:, :, kv_head]
        p = torch.softmax(torch.einsum("bshd,bmhd->bhsm", q, k) / d**0.5, dim=-1)
        want = attn.o(torch.einsum("bhsm,bmhd->bshd", p, v).flatten(2))
    torch.testing.assert_close(delta, want, rtol=1e-4, atol=1e-5)


def test_rope_depends_on_relative_position_only():
    from memtree.training.model import _rope

    model = _model()
    cos, sin = model._rope_tables(16, torch.device("cpu"))
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i: int, j: int) -> torch.Tensor:
        qi = _rope(q, cos[i : i + 1], sin[i : i + 1])
        return (qi * _rope(k, cos[j : j + 1], sin[j : j + 1])).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10))
    assert not torch.allclose(score(5, 2), score(5, 4))


@pytest.mark.parametrize("anchor", [TINY, TINY_GQA], ids=["tiny", "gqa"])
@pytest.mark.parametrize("kind", MEMORY_TYPES)
def test_a_shared_prefix_row_scores_each_continuation_as_its_own_sequence(anchor, kind):
    """positions + attn_mask put prefix + c1 + c2 + c3 in one row: each continuation's logits equal
    those of the separate sequence prefix + c, with memories of every type, on ragged lengths."""
    mem = MemoryConfig(multipliers=(4,), type=kind, branching=2)
    model = _model(anchor, mem)
    memories = assemble_memories(_init_blocks(anchor, mem, 1, app_i=False), anchor, mem)
    row = _tokens(1, 63, seed=3)[0]
    prefix, conts = row[:13], [row[13:14], row[14:19], row[19:58]]  # 1, 5 and 39 tokens
    ids = torch.cat([prefix, *conts])[None]  # (1, 58): longer than some separate sequences
    seg = torch.cat([torch.full((len(c),), k) for k, c in enumerate([prefix, *conts])])
    pos = torch.cat([torch.arange(13)] + [torch.arange(13, 13 + len(c)) for c in conts])[None]
    mask = ((seg[None, :] == 0) | (seg[:, None] == seg[None, :])) & torch.ones(
        58, 58, dtype=torch.bool
    ).tril()
    with torch.no_grad():
        packed = model(ids, positions=pos, attn_mask=mask[None], memories=memories)[0]  # (58, V)
        o = 13
        for c in conts:
            apart = model(torch.cat([prefix, c])[None], memories=memories)[0]
            torch.testing.assert_close(packed[:13], apart[:13], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(packed[o : o + len(c)], apart[13:], atol=1e-5, rtol=1e-5)
            o += len(c)


def test_positions_mask_and_hidden_states_are_checked():
    model = _model(TINY)
    ids = _tokens(2, 24)
    pos, causal = torch.arange(24).expand(2, 24), torch.ones(2, 24, 24, dtype=torch.bool).tril()
    with torch.no_grad():
        plain = model(ids)
        torch.testing.assert_close(
            model(ids, positions=pos, attn_mask=causal), plain, atol=1e-6, rtol=1e-6
        )
        torch.testing.assert_close(model.logits(model(ids, hidden=True)), plain)
        # a row longer than max_seq_len (64) is allowed while its positions stay below it
        long_ids = _tokens(1, 80)
        model(
            long_ids,
            positions=torch.arange(80)[None] % 40,
            attn_mask=torch.ones(1, 80, 80, dtype=torch.bool).tril(),
        )
    with pytest.raises(ValueError, match="go together"):
        model(ids, positions=pos)
    with pytest.raises(ValueError, match="do not match"):
        model(ids, positions=pos[:, :5], attn_mask=causal)
    with pytest.raises(ValueError, match="exceeds max_seq_len 64"):
        model(
            _tokens(1, 80),
            positions=torch.arange(80)[None],
            attn_mask=torch.ones(1, 80, 80, dtype=torch.bool),
        )
    from memtree.training.layers.moc import MoCConfig

    moc = AnchorLM(
        ModelConfig(
            anchor=TINY, moc=MoCConfig(n_chapters=4, tokens_per_chapter=2, top_k=1, layers=(1,))
        )
    )
    assert model.packable and not moc.packable  # a MoC layer routes the whole row
    with pytest.raises(ValueError, match="packable"):
        moc(ids, positions=pos, attn_mask=causal)
