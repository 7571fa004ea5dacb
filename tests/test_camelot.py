"""CAMELoT (seed 001): the associative memory's write rules against hand-worked examples, the
baselines' caches, FAISS vs exact search, save / load, and the frozen-model hookup (augment =
attention over the explicit prefix, frozen weights, causality, bad input) on memtree's anchor and
tiny random HF Llama / Qwen2 / Gemma 3 models."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from memtree.memstore.camelot.memory import (
    AssociativeMemory,
    CamelotConfig,
    CamelotMemory,
    FifoKNNCache,
    PrevWindowCache,
)
from memtree.training.camelot.longdoc import (
    corpus_nll,
    longdoc_nll,
    longdoc_token_nll,
    new_memory,
    prefix_attention,
)
from memtree.training.model import AnchorLM, ModelConfig
from tests.conftest import TINY_GQA_ANCHOR

ANCHOR = TINY_GQA_ANCHOR
VOCAB = 128


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _anchor(max_seq_len: int = 32) -> AnchorLM:
    torch.manual_seed(0)
    model = AnchorLM(ModelConfig(anchor=ANCHOR, max_seq_len=max_seq_len))
    with torch.no_grad():  # non-trivial norm gains and biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _hf(kind: str):
    transformers = pytest.importorskip("transformers")
    common = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
    }
    if kind == "llama":
        cfg, cls = (
            transformers.LlamaConfig(**common, tie_word_embeddings=False),
            transformers.LlamaForCausalLM,
        )
    elif kind == "qwen":
        cfg, cls = (
            transformers.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False),
            transformers.Qwen2ForCausalLM,
        )
    else:  # per-head q/k norms, query_pre_attn_scalar, both layers sliding (window 4)
        cfg, cls = (
            transformers.Gemma3TextConfig(
                **common, head_dim=8, sliding_window=4, tie_word_embeddings=True
            ),
            transformers.Gemma3ForCausalLM,
        )
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _am(slots: int = 4, threshold: float = 0.9, dim: int = 2, **kw) -> AssociativeMemory:
    return AssociativeMemory(
        CamelotConfig(slots=slots, threshold=threshold, search="exact", **kw),
        kv_heads=1,
        head_dim=dim,
    )


def _set(am: AssociativeMemory, keys, values, counts, ages) -> None:
    """Put a hand-made state in head 0: keys/values lists (None = empty slot)."""
    for i, (k, v, c, a) in enumerate(zip(keys, values, counts, ages)):
        if k is None:
            continue
        am.keys[0, i], am.values[0, i] = torch.tensor(k), torch.tensor(v)
        am.counts[0, i], am.ages[0, i], am.filled[0, i] = c, a, True
    am._search.changed()


def _window(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)[None]  # (1, L, D)


# -- write rules: hand-worked examples -------------------------------------------------------------
def test_consolidation_and_novelty_hand_worked():
    am = _am(slots=4, threshold=0.9)
    _set(
        am,
        keys=[[1, 0], [0, 1], [-1, 0], None],
        values=[[10, 0], [0, 10], [-10, 0], None],
        counts=[2, 1, 1, 0],
        ages=[0, 3, 1, 0],
    )
    k = _window([2, 0.1], [0.9, -0.05], [0, -1], [1, 1.2])
    v = _window([1, 1], [4, 4], [5, 5], [7, 7])
    prefix, match = am.read(k)
    assert match.slot[0, :2].tolist() == [0, 0]  # both close to slot 0 (cos > 0.99)
    assert torch.equal(prefix.keys[0, 0], torch.tensor([1.0, 0.0]))
    assert match.sim[0, 2] < 0.9 and match.sim[0, 3] < 0.9  # the last two are novel
    am.write(k, v, match)
    # slot 0: tokens 0 and 1 consolidated, eq. 6–8: (c·K + ΣK_i) / (c + n)
    assert torch.allclose(am.keys[0, 0], torch.tensor([(2 + 2 + 0.9) / 4, (0.1 - 0.05) / 4]))
    assert torch.allclose(am.values[0, 0], torch.tensor([(20 + 1 + 4) / 4, (1 + 4) / 4]))
    # ... which is eq. 6 applied token by token
    seq = (2 * torch.tensor([1.0, 0]) + torch.tensor([2, 0.1])) / 3
    seq = (3 * seq + torch.tensor([0.9, -0.05])) / 4
    assert torch.allclose(am.keys[0, 0], seq)
    # token 2 takes the empty slot 3 first; token 3 the oldest filled slot not updated: slot 1
    assert am.keys[0, 3].tolist() == [0, -1] and am.values[0, 3].tolist() == [5, 5]
    assert torch.allclose(am.keys[0, 1], torch.tensor([1, 1.2]))
    assert am.values[0, 1].tolist() == [7, 7]
    assert am.keys[0, 2].tolist() == [-1, 0]  # untouched
    assert am.counts[0].tolist() == [4, 1, 1, 1]
    assert am.ages[0].tolist() == [0, 0, 2, 0]  # updated → 0; slot 2 aged 1 → 2
    assert am.stats == {"consolidated": 2, "novel": 2, "dropped": 0}


def _compass(am: AssociativeMemory, ages) -> None:
    """Full memory of 4 slots at 0°, 90°, 180°, 270°."""
    _set(
        am,
        keys=[[1, 0], [0, 1], [-1, 0], [0, -1]],
        values=[[1, 1], [2, 2], [3, 3], [4, 4]],
        counts=[3, 3, 3, 3],
        ages=ages,
    )


def test_recency_replaces_oldest_slots_in_order():
    am = _am(slots=4, threshold=0.99)
    _compass(am, ages=[5, 2, 7, 7])
    k = _window([1, 1], [-1, 1], [-1, -1])  # 45°, 135°, 225°: cos 0.71 < R, all novel
    am.write(k, k)
    # oldest first, ties by lowest index: slot 2 (7), slot 3 (7), slot 0 (5)
    assert am.keys[0, 2].tolist() == [1, 1]
    assert am.keys[0, 3].tolist() == [-1, 1]
    assert am.keys[0, 0].tolist() == [-1, -1]
    assert am.keys[0, 1].tolist() == [0, 1]
    assert am.counts[0].tolist() == [1, 3, 1, 1]
    assert am.ages[0].tolist() == [0, 3, 0, 0]
    am.write(_window([1, -1]), _window([9, 9]))  # 315°: novel again → slot 1, now the oldest
    assert am.keys[0, 1].tolist() == [1, -1]
    assert am.ages[0].tolist() == [1, 0, 1, 1]


def test_more_novel_tokens_than_slots_keeps_the_latest():
    am = _am(slots=2, threshold=0.9)
    k = _window([1, 0], [0, 1], [-1, 0])  # empty memory: every token novel
    am.write(k, k)
    assert am.keys[0].tolist() == [[0, 1], [-1, 0]]  # token 0 dropped
    assert am.stats["dropped"] == 1 and am.stats["novel"] == 2
    assert am.filled[0].all() and am.counts[0].tolist() == [1, 1]


def test_without_consolidation_every_token_is_novel():
    am = _am(slots=4, threshold=0.9, consolidation=False)
    _compass(am, ages=[0, 0, 4, 0])
    am.write(_window([1, 0]), _window([8, 8]))  # identical to slot 0, still novel
    assert am.keys[0, 2].tolist() == [1, 0] and am.values[0, 2].tolist() == [8, 8]
    assert am.keys[0, 0].tolist() == [1, 0] and am.counts[0, 0] == 3  # slot 0 untouched
    assert am.stats["consolidated"] == 0


def test_without_novelty_tokens_fill_empty_slots_then_consolidate():
    am = _am(slots=3, threshold=0.9, novelty=False)
    _set(
        am, keys=[[1, 0], None, None], values=[[1, 0], None, None], counts=[1, 0, 0], ages=[0, 0, 0]
    )
    k = _window([0, 1], [-1, 0], [0.5, 0.5])
    am.write(k, k)
    assert am.keys[0, 1].tolist() == [0, 1] and am.keys[0, 2].tolist() == [-1, 0]
    assert torch.allclose(am.keys[0, 0], torch.tensor([0.75, 0.25]))  # (1·[1,0] + [.5,.5]) / 2
    assert am.counts[0].tolist() == [2, 1, 1]
    am.write(_window([-1, -0.1]), _window([0, 0]))  # full now: even a dissimilar token merges
    assert am.counts[0].tolist() == [2, 1, 2]  # into its nearest, slot 2 ([-1, 0])


def test_without_recency_a_random_slot_is_replaced_deterministically():
    chosen = []
    for seed in range(12):
        am = _am(slots=4, threshold=0.99, recency=False, seed=seed)
        _compass(am, ages=[9, 0, 0, 0])
        am.write(_window([1, 1]), _window([0, 0]))
        chosen.append(int((am.keys[0] == torch.tensor([1.0, 1.0])).all(-1).nonzero()))
        twin = _am(slots=4, threshold=0.99, recency=False, seed=seed)
        _compass(twin, ages=[9, 0, 0, 0])
        twin.write(_window([1, 1]), _window([0, 0]))
        assert torch.equal(twin.keys, am.keys)  # same seed, same choice
    assert len(set(chosen)) > 1  # not always the oldest (slot 0)


def test_without_retrieval_read_is_random_but_write_uses_nearest():
    am = _am(slots=4, threshold=0.9, retrieval=False)
    _compass(am, ages=[0, 0, 0, 0])
    k = _window(*([[1, 0.01]] * 32))
    prefix, match = am.read(k)
    assert (match.slot == 0).all()
    got = {tuple(r) for r in prefix.keys[0].tolist()}
    assert len(got) > 1 and prefix.valid.all()
    am.write(k, k, match)
    assert am.counts[0].tolist() == [35, 3, 3, 3]


def test_empty_memory_reads_nothing():
    am = _am()
    prefix, match = am.read(_window([1, 0], [0, 1]))
    assert prefix is None and (match.slot == -1).all() and torch.isinf(match.sim).all()


def test_mismatched_keys_name_the_field():
    am = AssociativeMemory(CamelotConfig(slots=4, search="exact"), kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="kv_heads=2"):
        am.read(torch.zeros(3, 5, 8))
    with pytest.raises(ValueError, match="head_dim=8"):
        am.read(torch.zeros(2, 5, 4))


# -- search: FAISS against exact ---------------------------------------------------------------
def _random_run(search: str, index: str = "flat", seed: int = 0) -> tuple[AssociativeMemory, list]:
    cfg = CamelotConfig(
        slots=64, threshold=0.6, search=search, faiss_index=index, ivf_lists=4, ivf_probe=4
    )
    am = AssociativeMemory(cfg, kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(2, 100, 16, generator=g)  # more concepts than slots
    slots = []
    for _ in range(8):  # clustered keys: both consolidation and novelty happen
        pick = torch.randint(100, (2, 24), generator=g)
        k = torch.gather(centers, 1, pick[..., None].expand(-1, -1, 16))
        k = k + 0.3 * torch.randn(2, 24, 16, generator=g)
        match = am.search(k)
        slots.append(match.slot)
        am.write(k, torch.randn(2, 24, 16, generator=g), match)
    return am, slots


@pytest.mark.parametrize("index", ["flat", "ivf"])
def test_faiss_and_exact_search_choose_the_same_slots(index):
    exact, s_exact = _random_run("exact")
    fa, s_faiss = _random_run("faiss", index)  # IVF probes all 4 lists: exact too
    for a, b in zip(s_exact, s_faiss):
        assert torch.equal(a, b)
    assert torch.equal(exact.counts, fa.counts) and torch.equal(exact.ages, fa.ages)
    assert torch.allclose(exact.keys, fa.keys)
    assert exact.stats["consolidated"] > 0 and exact.stats["novel"] > 64
    q = torch.randn(2, 50, 16)
    assert torch.equal(exact.search(q).slot, fa.search(q).slot)
    if index == "ivf":  # trained once full, then updated in place by the later writes
        assert all(fa._search._trained)


# -- baselines' caches -----------------------------------------------------------------------------
def _eye(*idx) -> torch.Tensor:
    return torch.eye(8)[list(idx)][None]  # (1, L, 8) one-hot keys


def test_fifo_cache_overwrites_the_oldest_entries():
    cache = FifoKNNCache(CamelotConfig(slots=5, search="exact"), kv_heads=1, head_dim=8)
    assert cache.read(_eye(0)) == (None, None)
    cache.write(_eye(0, 1, 2), 10 * _eye(0, 1, 2))
    cache.write(_eye(3, 4, 5), 10 * _eye(3, 4, 5))
    assert (cache.cursor, cache.size) == (1, 5)
    # ring: slot 0 now holds token 5; token 0 is gone, 1..4 stay where they were written
    assert cache.keys[0].argmax(-1).tolist() == [5, 1, 2, 3, 4]
    assert cache.stats == {"written": 6, "overwritten": 1}
    prefix, match = cache.read(_eye(1, 5, 0))
    assert match.slot[0].tolist()[:2] == [1, 0]
    assert match.sim[0, 2] == 0  # token 0 is no longer retrievable
    assert torch.equal(prefix.values[0, 0], 10 * torch.eye(8)[1]) and prefix.aligned
    cache.write(_eye(0, 1, 2, 3, 4, 5, 6), _eye(0, 1, 2, 3, 4, 5, 6))  # longer than the cache
    assert sorted(cache.keys[0].argmax(-1).tolist()) == [2, 3, 4, 5, 6]


def test_xl_cache_holds_the_previous_window():
    cache = PrevWindowCache(CamelotConfig(slots=1), kv_heads=1, head_dim=8)
    assert cache.read(_eye(0))[0] is None
    cache.write(_eye(0, 1), 2 * _eye(0, 1))
    prefix, _ = cache.read(_eye(7))
    assert torch.equal(prefix.keys, _eye(0, 1)) and not prefix.aligned and prefix.valid.all()
    cache.write(_eye(2, 3, 4), _eye(2, 3, 4))
    assert torch.equal(cache.read(_eye(7))[0].keys, _eye(2, 3, 4))


# -- augment ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sliding", [None, 3])
def test_prefix_attention_equals_explicit_attention(sliding):
    g = torch.Generator().manual_seed(0)
    h, h_kv, s, p, d = 4, 2, 5, 5, 8
    q, k, v = (torch.randn(1, n, s, d, generator=g) for n in (h, h_kv, h_kv))
    pk, pv = torch.randn(1, h_kv, p, d, generator=g), torch.randn(1, h_kv, p, d, generator=g)
    first = torch.tensor([[[0, 1, 2, 5, 4], [0, 0, 0, 0, 0]]])  # entry 3 of head 0 invalid
    out = prefix_attention(q, k, v, pk, pv, first, sliding_window=sliding)
    ref = torch.empty_like(out)
    for hq in range(h):
        kv = hq // (h // h_kv)
        keys, vals = torch.cat([pk[0, kv], k[0, kv]]), torch.cat([pv[0, kv], v[0, kv]])
        for i in range(s):
            pos_q = p + i
            ok = torch.tensor(
                [
                    bool(i >= first[0, kv, j] if j < p else j - p <= i)
                    and (sliding is None or pos_q - j < sliding)
                    for j in range(p + s)
                ]
            )
            sc = (keys[ok] @ q[0, hq, i]) / d**0.5
            ref[0, hq, i] = torch.softmax(sc, 0) @ vals[ok]
    assert torch.allclose(out, ref, atol=1e-6)


def test_xl_on_anchor_equals_the_model_on_both_windows():
    model, ids = _anchor(), torch.randint(0, ANCHOR.vocab_size, (16,))
    with torch.no_grad():
        full = F.cross_entropy(model(ids[None])[0, :-1], ids[1:], reduction="none")
    xl = longdoc_token_nll(model, ids, method="xl", window=8)
    base = longdoc_token_nll(model, ids, method="base", window=8)
    assert torch.allclose(xl, full, atol=1e-5)  # prefix = the previous window's exact K/V
    assert torch.allclose(base[:7], full[:7], atol=1e-5)
    assert not torch.allclose(base[8:], full[8:], atol=1e-3)  # base forgets window 1


@pytest.mark.parametrize("kind", ["llama", "qwen", "gemma"])
def test_xl_on_hf_equals_the_model_on_both_windows(kind):
    model, ids = _hf(kind), torch.randint(0, VOCAB, (16,))
    with torch.no_grad():
        full = F.cross_entropy(model(input_ids=ids[None]).logits[0, :-1], ids[1:], reduction="none")
    xl = longdoc_token_nll(model, ids, method="xl", window=8)
    assert torch.allclose(xl, full, atol=1e-5)


# -- the hookup on frozen models -------------------------------------------------------------------
def _sink_plus_window(logits_of, ids: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """Per-token NLL of each window read after the document's first `sink` tokens, by a plain
    forward over [sink tokens, window] (the first window alone)."""
    out = []
    for start in range(0, ids.numel() - 1, window):
        x, y = ids[start : start + window], ids[start + 1 : start + window + 1]
        pre = ids[:sink] if start else ids[:0]
        with torch.no_grad():
            logits = logits_of(torch.cat([pre, x])[None])[0, pre.numel() :]
        out.append(F.cross_entropy(logits[: len(y)], y, reduction="none"))
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["anchor", "llama", "gemma"])
def test_sink_on_base_equals_the_model_on_sink_plus_window(kind):
    if kind == "anchor":
        model, vocab = _anchor(), ANCHOR.vocab_size
        logits_of = model
    else:
        model, vocab = _hf(kind), VOCAB  # gemma: sliding window 4 covers the sink positions too
        logits_of = lambda x: model(input_ids=x).logits
    ids = torch.randint(0, vocab, (27,), generator=torch.Generator().manual_seed(1))
    sunk = longdoc_token_nll(model, ids, method="base", window=8, sink=3)
    assert torch.allclose(sunk, _sink_plus_window(logits_of, ids, 3, 8), atol=1e-5)
    plain = longdoc_token_nll(model, ids, method="base", window=8)
    assert torch.equal(sunk[:8], plain[:8])  # the first window is the document's start either way
    assert not torch.allclose(sunk[8:], plain[8:], atol=1e-3)


@pytest.mark.parametrize("kind", ["anchor", "llama"])
def test_sink_joins_xl_from_the_third_window_and_memories_from_the_second(kind):
    model = _anchor() if kind == "anchor" else _hf(kind)
    ids = torch.randint(
        0, min(VOCAB, ANCHOR.vocab_size), (30,), generator=torch.Generator().manual_seed(2)
    )
    cfg = CamelotConfig(slots=16, threshold=0.5, search="exact")
    xl, xl_sunk = (longdoc_token_nll(model, ids, method="xl", window=8, sink=s) for s in (0, 2))
    assert torch.allclose(xl[:16], xl_sunk[:16], atol=1e-6) and not torch.allclose(
        xl[16:], xl_sunk[16:], atol=1e-4
    )
    for method in ("memorizing", "camelot"):
        a, b = (
            longdoc_token_nll(model, ids, method=method, window=8, cfg=cfg, sink=s) for s in (0, 2)
        )
        assert torch.equal(a[:8], b[:8]) and not torch.allclose(a[8:16], b[8:16], atol=1e-4)


@pytest.mark.parametrize("method", ["base", "camelot", "memorizing"])
def test_sink_does_not_leak_later_tokens(method):
    model = _anchor()
    ids = torch.randint(0, ANCHOR.vocab_size, (32,), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[20] = (ids[20] + 7) % ANCHOR.vocab_size
    cfg = CamelotConfig(slots=16, threshold=0.5, search="exact")
    a = longdoc_token_nll(model, ids, method=method, window=8, cfg=cfg, sink=4)
    b = longdoc_token_nll(model, changed, method=method, window=8, cfg=cfg, sink=4)
    assert torch.allclose(a[:19], b[:19], atol=1e-6, rtol=0)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_frozen_anchor_is_bit_identical_after_runs():
    model, ids = _anchor(), torch.randint(0, ANCHOR.vocab_size, (40,))
    model.train()
    before, grads = _snapshot(model), {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = model.eval()(ids[None, :16])
    model.train()
    cfg = CamelotConfig(slots=8, threshold=0.5, search="exact", layers=(1,))
    for method in ("base", "xl", "memorizing", "camelot"):
        s, n = longdoc_nll(model, ids, method=method, window=8, cfg=cfg)
        assert n == 39 and s > 0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    assert model.training  # mode restored
    assert all(b.attn.attn_core is None for b in model.blocks)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids[None, :16]), logits)


def test_hf_model_loaded_by_memtree_is_untouched(tmp_path):
    from memtree.training.hf import load_hf_causal_lm

    _hf("llama").save_pretrained(tmp_path)
    model = load_hf_causal_lm(tmp_path)
    ids = torch.randint(0, VOCAB, (30,))
    before = _snapshot(model)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits
    impl = model.config._attn_implementation
    for method in ("xl", "memorizing", "camelot"):
        longdoc_nll(model, ids, method=method, window=8, cfg=CamelotConfig(slots=8, threshold=0.5))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.config._attn_implementation == impl
    for layer in model.model.layers:
        assert not layer.self_attn._forward_pre_hooks
        assert not hasattr(layer.self_attn, "_memtree_camelot_core")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids[None]).logits, logits)


def test_wrapped_models_are_unwrapped():
    from memtree.geometry import MemoryConfig
    from memtree.training.hf import HFMemoryModel

    model, ids = _hf("qwen"), torch.randint(0, VOCAB, (20,))
    wrapped = HFMemoryModel(model, MemoryConfig(multipliers=(4,), type="ffn", branching=2))
    cfg = CamelotConfig(slots=8, threshold=0.5)
    assert longdoc_nll(wrapped, ids, method="camelot", window=8, cfg=cfg) == longdoc_nll(
        model, ids, method="camelot", window=8, cfg=cfg
    )


def test_cleanup_after_an_error_mid_run():
    model = _hf("gemma")
    bad = torch.tensor([1, 2, 3, VOCAB + 5, 4, 5])  # out-of-vocabulary id fails inside forward
    with pytest.raises(IndexError):
        longdoc_nll(model, bad, method="camelot", window=2, cfg=CamelotConfig(slots=4))
    assert model.config._attn_implementation == "sdpa"
    assert not any(layer.self_attn._forward_pre_hooks for layer in model.model.layers)
    anchor = _anchor()
    with pytest.raises(IndexError):
        longdoc_nll(anchor, torch.tensor([1, 2, 99, 3]), method="camelot", window=2)
    assert all(b.attn.attn_core is None for b in anchor.blocks)


@pytest.mark.parametrize("method", ["camelot", "memorizing"])
def test_causal_visibility_does_not_leak_the_next_token(method):
    model = _anchor()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, ANCHOR.vocab_size, (32,), generator=g)
    cfg = CamelotConfig(slots=16, threshold=0.5, search="exact")
    changed = ids.clone()
    changed[30] = (ids[30] + 7) % ANCHOR.vocab_size  # window 4 is tokens 24..31
    leaks = 0
    for vis in ("causal", "full"):
        a = longdoc_token_nll(model, ids, method=method, window=8, cfg=cfg, visibility=vis)
        b = longdoc_token_nll(model, changed, method=method, window=8, cfg=cfg, visibility=vis)
        same = torch.allclose(a[:29], b[:29], atol=1e-6, rtol=0)  # losses before token 30
        if vis == "causal":
            assert same
        else:
            leaks += not same
    assert leaks == 1  # full visibility lets earlier queries see what token 30 retrieved


def test_camelot_memory_state_after_a_run():
    model = _anchor(max_seq_len=64)
    ids = torch.randint(0, ANCHOR.vocab_size, (100,))
    mem = new_memory(model, "camelot", CamelotConfig(slots=16, threshold=0.8, search="exact"))
    longdoc_token_nll(model, ids, method="camelot", window=10, memory=mem)
    st = mem.stats()
    assert st["windows"] == 10
    assert st["consolidated"] + st["novel"] + st["dropped"] == 100 * 2 * ANCHOR.kv_heads
    for layer in mem.layers.values():
        assert layer.filled.any()
        assert (layer.counts[layer.filled] >= 1).all() and (layer.counts[~layer.filled] == 0).all()
        assert (layer.ages[~layer.filled] == 0).all()
        # counts only grow, except that a replaced slot restarts at 1
        total = int(layer.counts.sum())
        assert int(layer.filled.sum()) <= total
        assert total <= layer.stats["novel"] + layer.stats["consolidated"]


# -- bad input ---------------------------------------------------------------------------------
def test_window_longer_than_the_context_is_an_error():
    model = _anchor(max_seq_len=32)
    ids = torch.randint(0, ANCHOR.vocab_size, (40,))
    with pytest.raises(ValueError, match="window=17"):
        longdoc_nll(model, ids, method="camelot", window=17)
    with pytest.raises(ValueError, match="window=33"):
        longdoc_nll(model, ids, method="base", window=33)
    assert longdoc_nll(model, ids, method="base", window=32)[1] == 39
    with pytest.raises(ValueError, match="window=40"):
        longdoc_nll(_hf("qwen"), ids, method="xl", window=40)
    with pytest.raises(
        ValueError, match=r"window=16: 2·window \(memory prefix \+ window\) \+ sink = 33"
    ):
        longdoc_nll(model, ids, method="camelot", window=16, sink=1)
    with pytest.raises(ValueError, match="sink must be a non-negative integer, got -1"):
        longdoc_nll(model, ids, method="base", window=8, sink=-1)


def test_mismatched_memory_names_the_field():
    model = _anchor()
    for field, kw in (
        ("kv_heads", {"kv_heads": 4, "head_dim": 8, "n_layers": 2}),
        ("head_dim", {"kv_heads": 2, "head_dim": 16, "n_layers": 2}),
        ("n_layers", {"kv_heads": 2, "head_dim": 8, "n_layers": 3}),
    ):
        mem = CamelotMemory(CamelotConfig(slots=4), kind="camelot", **kw)
        with pytest.raises(ValueError, match=field):
            longdoc_nll(model, torch.arange(10), method="camelot", window=4, memory=mem)
    mem = new_memory(model, "memorizing", CamelotConfig(slots=4))
    with pytest.raises(ValueError, match="kind='memorizing'"):
        longdoc_nll(model, torch.arange(10), method="camelot", window=4, memory=mem)
    with pytest.raises(ValueError, match="layers"):
        new_memory(model, "camelot", CamelotConfig(slots=4, layers=(0, 2)))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"slots": 0}, "slots"),
        ({"threshold": 1.5}, "threshold"),
        ({"layers": (1, 1)}, "layers"),
        ({"search": "gpu"}, "search"),
        ({"faiss_index": "hnsw"}, "faiss_index"),
        ({"slots": 4, "ivf_lists": 8}, "ivf_lists"),
        ({"ivf_probe": 0}, "ivf_probe"),
    ],
)
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        CamelotConfig(**kw)


def test_empty_documents_are_skipped_and_counted():
    model = _anchor()
    docs = [[], torch.randint(0, ANCHOR.vocab_size, (20,)), [5], torch.tensor([], dtype=torch.long)]
    res = corpus_nll(
        model, docs, method="camelot", window=8, cfg=CamelotConfig(slots=8, search="exact")
    )
    assert (res.n_docs, res.skipped_empty, res.n_tokens) == (1, 3, 19)
    assert res.ppl > 1


# -- on disk ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["camelot", "memorizing", "xl"])
def test_save_load_resumes_identically(tmp_path, method):
    model = _anchor()
    ids = torch.randint(0, ANCHOR.vocab_size, (48,))
    cfg = CamelotConfig(slots=8, threshold=0.6, recency=False, retrieval=False, search="exact")
    mem = new_memory(model, method, cfg)
    longdoc_token_nll(model, ids[:24], method=method, window=8, memory=mem)
    mem.save(tmp_path / "am")
    loaded = CamelotMemory.load(tmp_path / "am")
    assert loaded.stats() == mem.stats() and loaded.kind == mem.kind
    a = longdoc_token_nll(model, ids[24:], method=method, window=8, memory=mem)
    b = longdoc_token_nll(model, ids[24:], method=method, window=8, memory=loaded)
    assert torch.equal(a, b)


def test_load_refuses_other_versions_and_edited_state(tmp_path):
    mem = CamelotMemory(CamelotConfig(slots=4), kind="camelot", n_layers=1, kv_heads=1, head_dim=2)
    path = mem.save(tmp_path / "am")
    man = json.loads((path / "manifest.json").read_text())
    assert (man["format"], man["version"]) == ("memtree-camelot", 1)
    (path / "manifest.json").write_text(json.dumps({**man, "version": 2}))
    with pytest.raises(ValueError, match="version 2"):
        CamelotMemory.load(path)
    mem.save(path)
    with open(path / "state.safetensors", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    with pytest.raises(ValueError, match="sha256"):
        CamelotMemory.load(path)
