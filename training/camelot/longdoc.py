"""Long documents through a frozen LM, window by window, with CAMELoT or a baseline (seed 001).

`longdoc_nll(model, tokens, method=..., window=L, cfg=CamelotConfig(...))` runs one document
through the model in consecutive windows of L tokens (default 128) and returns the summed
next-token NLL and the number of tokens scored (every token but the first, each exactly once;
`longdoc_token_nll` gives the per-token losses, `corpus_nll` sums over documents and skips and
counts empty ones). Methods:
- "base": each window alone (the base model with context L).
- "xl": each memory layer also attends to its keys / values of the previous window
  (Transformer-XL's cache, no retrieval, no fine-tuning).
- "memorizing": each token's key retrieves its nearest key among the last M tokens' (a FIFO
  kNN cache that overwrites the oldest entries, no consolidation: Memorizing Transformer).
- "camelot": each token's key retrieves its nearest associative-memory slot (eq. 1), and the
  window then consolidates into / replaces slots (eq. 6–8; `memstore.camelot.memory`).
The memory-augmented layers are `cfg.layers` (None: all). The model is never trained or
modified: the run is under no_grad in eval mode, weights stay bit-identical, and everything
installed for the run (attention cores, hooks, the HF attention implementation) is removed on
exit, even on error.

Augment (eq. 2–5). At a memory layer the window's L queries attend, in one softmax, to the
P prefix keys / values (retrieved: P = L, one per token; XL: the P = L previous tokens) followed
by the window's own L keys, causally. The layer's memory is read with the window's keys and
written right after the layer attends, so a window only ever sees what earlier windows wrote.

Which prefix entries a query sees (`visibility`). The entry retrieved for token j was chosen by
K_j, a function of token j itself. "full" shows every prefix entry to every query — what a
causal mask over the concatenated 2L list with the prefix first gives, the most literal reading
of §2.2 — but then the query of token i < j, which predicts token i + 1 ≤ j, sees which slot
token j's key picked, i.e. information about the tokens it is predicting, and perplexity leaks
(a test shows a later token changing earlier losses). The default "causal" lets query i see
the entries retrieved for tokens 0..i only, which is leak-free. XL's cached tokens are all in
the past, so they are visible to every query either way. In the first window of "camelot" /
"memorizing" the memory is empty and nothing is prepended.

Positions (RoPE). The seed does not say how retrieved keys are positioned: its appendix lists
only the HF version, batch size, R and ablations; §2 says the retrieved keys and values are
"passed back to the LLM in the form of the key-value cache" and prepended. Our choice:
- memories hold keys taken *before* RoPE (after the model's k-norm, if any). Cosine search and
  the running means of eq. 6 then act on content alone: keys rotated at different positions
  would not be comparable, and averaging them would partly cancel their rotations.
- At augment time the prefix takes positions 0..P−1 and the window P..P+L−1 — exactly how an
  HF key-value cache of length P positions the window, which is what "passed back … as the
  key-value cache" implies — so the entry retrieved for token j sits at distance L from it,
  the distance the XL baseline's token j of the previous window has. Queries and keys of the
  window are rotated at their shifted positions; RoPE is relative, so this changes nothing for
  the window's own attention, and positions stay below 2L, inside the model's context: a
  window needs 2L ≤ the model's context for the memory methods (L for "base"), else an error.
With this choice "xl" over two windows equals the plain model over both windows at once
(tested), which pins the augment math down.

Attention sink (`sink=S`, off by default: the seed has none). A pretrained LM puts much of its
attention on the sequence's first tokens (StreamingLLM, Xiao et al. 2024); a window read after a
prefix of retrieved or cached tokens has no such token, and on SmolLM2 XL's cache turns 28 %
worse than the window alone from the third window on (docs/BENCHMARKS.md). With S > 0 every
layer keeps the keys (before RoPE) and values of the document's first S tokens, as the first
window computed them, and prepends them to every later window at positions 0..S−1, visible to
every query; the memory's prefix follows at S..S+P−1 and the window at S+P... Every method gets
it, base too (window + sink: StreamingLLM without its cache), so the methods still differ only
by their memory; XL gets it from the third window on (its second window's cache already starts
with those tokens). The sink's tokens are scored once, in the first window, like every token.

Models:
- memtree's `AnchorLM` (training/model.py): each memory layer's (with a sink: every layer's)
  `Attention.attn_core` is set for the run; it receives q, k, v before RoPE, rotates them itself
  and attends over the prefix.
- HF Llama / Qwen2 / Gemma 3 causal LMs (training/hf.py loads them; `HFMemoryModel` and
  `MemtreeLM` are unwrapped): a registered HF attention function ("memtree_camelot") is made the
  model's attention implementation for the run. HF hands it q and k after RoPE; a pre-hook on
  each `self_attn` captures that layer's (cos, sin) — Gemma 3's local or global tables — so the
  keys are un-rotated (rotation by −θ, exact up to rounding) for the memory; the rotary module
  that made those tables (found by forward hooks on the model's rotary modules) gives the
  prefix's tables at positions 0..P−1. Sliding-window layers keep their window over the
  shifted positions; the model's `scaling` (e.g. Gemma's query_pre_attn_scalar) is used; logit
  soft-capping is refused.
One document at a time (batch 1); not reentrant.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memtree.memstore.camelot.memory import CamelotConfig, CamelotMemory, Prefix
from memtree.training.hf import anchor_shape_from_hf, decoder_config, decoder_layers
from memtree.training.model import AnchorLM, rotate_half

Method = Literal["base", "xl", "memorizing", "camelot"]
METHODS: tuple[str, ...] = ("base", "xl", "memorizing", "camelot")
Visibility = Literal["causal", "full"]
_KIND = {"xl": "xl", "memorizing": "memorizing", "camelot": "camelot"}
_HF_ATTN = "memtree_camelot"
_CORE_ATTR = "_memtree_camelot_core"


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (…, S, D) rotated by the tables cos / sin (S, D) (the rotate-half layout of AnchorLM
    and HF Llama / Qwen2 / Gemma)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def unapply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Inverse of `apply_rope` (rotation by −θ), exact also for scaled tables (YaRN-style
    attention scaling multiplies cos and sin by the same factor)."""
    x, cos, sin = x.float(), cos.float(), sin.float()
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


def prefix_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pk: Tensor,
    pv: Tensor,
    first_query: Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> Tensor:
    """Attention of the window over prefix + window (eq. 2–5).

    q (B, H, S, D) and k, v (B, H_kv, S, D): the window at positions P..P+S−1, q and k rotated;
    pk, pv (B, H_kv, P, D): the prefix at positions 0..P−1, pk rotated. first_query (B, H_kv, P)
    int64: query i sees prefix entry p iff i ≥ first_query[…, p] (S: never). The window part is
    causal; a sliding window w keeps keys at distance < w. → (B, H, S, D).
    """
    b, h, s, _ = q.shape
    h_kv, p = k.shape[1], pk.shape[2]
    i = torch.arange(s, device=q.device)
    native = i[:, None] >= i[None, :]  # (S, S)
    pre = i[None, None, :, None] >= first_query[:, :, None, :].to(q.device)  # (B, H_kv, S, P)
    if sliding_window is not None:
        native = native & (i[:, None] - i[None, :] < sliding_window)
        dist = (p + i)[:, None] - torch.arange(p, device=q.device)[None, :]  # (S, P)
        pre = pre & (dist < sliding_window)
    mask = torch.cat([pre, native.expand(b, h_kv, s, s)], dim=-1)  # (B, H_kv, S, P+S)
    keys, values = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
    if h != h_kv:
        g = h // h_kv
        keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
        mask = mask.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


class _Run:
    """One document pass: the method's memory, the attention sink and the window in flight (its
    position `offset` = the length of everything prepended to it: sink S, then prefix P)."""

    def __init__(
        self, method: str, memory: CamelotMemory | None, visibility: str, sink: int = 0
    ) -> None:
        self.method, self.memory, self.visibility, self.sink = method, memory, visibility, sink
        self.offset = 0
        self.index = -1  # the window's number in the document
        self.sink_len = 0  # sink tokens held (the first window may be shorter than `sink`)
        self.sink_on = False  # whether this window is given the sink
        # layer → the first window's first sink_len keys (before RoPE) and values, (H_kv, S, D)
        self.sink_kv: dict[int, tuple[Tensor, Tensor]] = {}

    def start_window(self, length: int) -> None:
        self.index += 1
        if self.index == 0:
            self.sink_len = min(self.sink, length)
        # XL's second window caches the first whole, sink included: the sink joins from the third
        self.sink_on = self.sink_len > 0 and self.index >= (2 if self.method == "xl" else 1)
        s = self.sink_len if self.sink_on else 0
        if self.method == "base":
            self.offset = s
        elif self.method == "xl":  # every XL layer caches the same (previous) window
            self.offset = s + max(m.length for m in self.memory.layers.values())
        else:
            self.offset = s + length

    def end_window(self) -> None:
        if self.memory is not None:
            self.memory.windows += 1

    def attend(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_free: Tensor,
        prefix_rope: Callable[[int], tuple[Tensor, Tensor]],
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> Tensor:
        """q (1, H, S, D), k, v (1, H_kv, S, D) with q, k rotated at offset..offset+S−1; k_free
        (1, H_kv, S, D) the keys before RoPE. Reads this layer's memory, attends, writes.
        prefix_rope(P) → (cos, sin) (P, D) for positions 0..P−1. → (1, H, S, D)."""
        if self.index == 0 and self.sink_len:
            self.sink_kv[layer] = (
                k_free[0, :, : self.sink_len].clone(),
                v[0, :, : self.sink_len].clone(),
            )
        mem = self.memory.layers.get(layer) if self.memory is not None else None
        prefix, match = (None, None) if mem is None else mem.read(k_free[0])
        pks, pvs, firsts = [], [], []
        s = self.sink_len if self.sink_on else 0
        if s:  # positions 0..S−1, seen by every query (they are the document's start)
            sk, sv = self.sink_kv[layer]
            cos, sin = prefix_rope(s)
            pks.append(apply_rope(sk.to(device=q.device, dtype=q.dtype), cos, sin)[None])
            pvs.append(sv.to(device=q.device, dtype=q.dtype)[None])
            firsts.append(torch.zeros(1, k.shape[1], s, dtype=torch.int64, device=q.device))
        if prefix is not None:  # positions S..S+P−1
            pk, pv, first = self._prefix(prefix, q, prefix_rope, s)
            pks.append(pk), pvs.append(pv), firsts.append(first)
        if pks:
            pk, pv, first = torch.cat(pks, 2), torch.cat(pvs, 2), torch.cat(firsts, 2)
        else:
            pk = pv = k.new_zeros(*k.shape[:2], 0, k.shape[3])
            first = torch.zeros(1, k.shape[1], 0, dtype=torch.int64, device=q.device)
        out = prefix_attention(q, k, v, pk, pv, first, scale=scale, sliding_window=sliding_window)
        if mem is not None:
            mem.write(k_free[0], v[0], match)
        return out

    def _prefix(
        self, prefix: Prefix, q: Tensor, prefix_rope, sink: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        p, s = prefix.keys.shape[1], q.shape[2]
        if sink + p != self.offset:  # the window was positioned for another prefix length
            raise RuntimeError(
                f"sink of {sink} and prefix of {p} entries, but the window sits at "
                f"offset {self.offset}"
            )
        cos, sin = prefix_rope(sink + p)
        pk = apply_rope(prefix.keys.to(device=q.device, dtype=q.dtype), cos[sink:], sin[sink:])[
            None
        ]
        pv = prefix.values.to(device=q.device, dtype=q.dtype)[None]
        if prefix.aligned and self.visibility == "causal":
            first = torch.arange(p, device=q.device).expand(prefix.valid.shape)
        else:
            first = torch.zeros(prefix.valid.shape, dtype=torch.int64, device=q.device)
        first = torch.where(prefix.valid.to(q.device), first, s)  # invalid: never visible
        return pk, pv, first[None]


# -- memtree's AnchorLM ------------------------------------------------------------------------
class _AnchorCore:
    """`Attention.attn_core` of one memory layer for the run."""

    def __init__(self, run: _Run, layer: int, backend: _AnchorBackend) -> None:
        self.run, self.layer, self.backend = run, layer, backend

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cos, sin = self.backend.tables  # (offset + S, D) fp32
        o, s = self.run.offset, q.shape[1]
        cw, sw = cos[o : o + s], sin[o : o + s]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, S, D)
        return self.run.attend(
            self.layer,
            apply_rope(q, cw, sw),
            apply_rope(k, cw, sw),
            v,
            k,
            lambda p: (cos[:p], sin[:p]),
        )


class _AnchorBackend:
    def __init__(self, model: nn.Module) -> None:
        a = model.config.anchor
        self.model = model
        self.n_layers, self.kv_heads, self.head_dim = a.n_layers, a.kv_heads, a.head_dim
        self.max_positions = model.config.max_seq_len
        self.tables: tuple[Tensor, Tensor] | None = None

    @contextlib.contextmanager
    def installed(self, run: _Run) -> Iterator[None]:
        # the sink reaches every layer; the memory only its own
        layers = range(self.n_layers) if run.sink or run.memory is None else run.memory.layers
        attns = {i: self.model.blocks[i].attn for i in layers}
        try:
            for i, attn in attns.items():
                attn.attn_core = _AnchorCore(run, i, self)
            yield
        finally:
            for attn in attns.values():
                attn.attn_core = None
            self.tables = None

    def logits(self, ids: Tensor, run: _Run) -> Tensor:
        self.tables = self.model._rope_tables(run.offset + ids.shape[1], ids.device)
        return self.model(ids)


# -- Hugging Face causal LMs --------------------------------------------------------------------
def _hf_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """HF attention-interface function: query (B, H, S, D), key/value (B, H_kv, S, D) after
    RoPE → ((B, S, H, D), None). The model's own mask is not built for this implementation;
    the core builds causal / sliding / prefix masks itself."""
    core = getattr(module, _CORE_ATTR, None)
    if core is None:
        raise RuntimeError(f"attention implementation {_HF_ATTN!r} used outside a CAMELoT run")
    if softcap is not None:
        raise NotImplementedError(
            "attention logit soft-capping is not supported by the CAMELoT hookup"
        )
    return core(query, key, value, scaling=scaling, sliding_window=sliding_window), None


class _HFCore:
    """Attention of one HF layer during the run (every layer: the implementation is global)."""

    def __init__(self, run: _Run, layer: int, backend: _HFBackend) -> None:
        self.run, self.layer, self.backend = run, layer, backend

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, scaling, sliding_window) -> Tensor:
        got = self.backend.rope.pop(self.layer, None)
        if got is None:
            raise RuntimeError(
                f"layer {self.layer}: attention ran without its self_attn pre-hook "
                "(an attention module outside model.layers is not supported)"
            )
        cos, sin, rotary = got  # cos / sin (B, S, D) at the window's positions
        k_free = unapply_rope(k, cos[:, None], sin[:, None])  # (B, H_kv, S, D) fp32
        out = self.run.attend(
            self.layer,
            q,
            k,
            v,
            k_free,
            lambda p: self.backend.prefix_tables(rotary, p, q),
            scale=scaling,
            sliding_window=sliding_window,
        )
        return out.transpose(1, 2)  # (B, S, H, D)


class _RopeTap:
    """Pre-hook on `self_attn`: keep the layer's (cos, sin) and the rotary module behind them."""

    def __init__(self, backend: _HFBackend, layer: int) -> None:
        self.backend, self.layer = backend, layer

    def __call__(self, module, args, kwargs):
        pe = kwargs.get("position_embeddings")
        if pe is None and len(args) > 1:
            pe = args[1]
        if pe is None:
            raise RuntimeError(
                f"layer {self.layer}: self_attn got no position_embeddings "
                "(only RoPE decoders in the Llama / Qwen2 / Gemma style are "
                "supported)"
            )
        cos, sin = pe
        made = self.backend.rotary_of.get(id(cos))
        if made is None or made[0] is not cos:
            raise RuntimeError(
                f"layer {self.layer}: cannot tell which rotary module made its RoPE "
                "tables (expected a *RotaryEmbedding module)"
            )
        self.backend.rope[self.layer] = (cos, sin, made[1])


class _RotaryTap:
    def __init__(self, backend: _HFBackend) -> None:
        self.backend = backend

    def __call__(self, module, args, out):
        self.backend.rotary_of[id(out[0])] = (out[0], module)


class _HFBackend:
    def __init__(self, hf: nn.Module) -> None:
        from transformers import AttentionInterface

        AttentionInterface.register(_HF_ATTN, _hf_attention)
        self.model = hf
        a = anchor_shape_from_hf(hf.config)
        text = decoder_config(hf.config)
        if getattr(text, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError(
                f"{type(hf).__name__}: attention logit soft-capping is not "
                "supported by the CAMELoT hookup"
            )
        self.n_layers, self.kv_heads, self.head_dim = a.n_layers, a.kv_heads, a.head_dim
        self.max_positions = int(text.max_position_embeddings)
        self.layers = decoder_layers(hf)
        if len(self.layers) != self.n_layers:
            raise ValueError(
                f"config says n_layers={self.n_layers}, the model has {len(self.layers)}"
            )
        self.rope: dict[int, tuple[Tensor, Tensor, nn.Module]] = {}
        self.rotary_of: dict[int, tuple[Tensor, nn.Module]] = {}
        self._tables: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def prefix_tables(self, rotary: nn.Module, p: int, like: Tensor) -> tuple[Tensor, Tensor]:
        key = (id(rotary), p)
        if key not in self._tables:
            pos = torch.arange(p, device=like.device)[None]
            cos, sin = rotary(like, pos)  # (1, P, D)
            self._tables[key] = (cos[0], sin[0])
        return self._tables[key]

    @contextlib.contextmanager
    def installed(self, run: _Run) -> Iterator[None]:
        configs = {
            id(m.config): m.config
            for m in self.model.modules()
            if hasattr(getattr(m, "config", None), "_attn_implementation_internal")
        }
        before = {k: c._attn_implementation_internal for k, c in configs.items()}
        handles: list[Any] = []
        attns = [layer.self_attn for layer in self.layers]
        try:
            for m in self.model.modules():
                if type(m).__name__.endswith("RotaryEmbedding"):
                    handles.append(m.register_forward_hook(_RotaryTap(self)))
            for i, attn in enumerate(attns):
                setattr(attn, _CORE_ATTR, _HFCore(run, i, self))
                handles.append(attn.register_forward_pre_hook(_RopeTap(self, i), with_kwargs=True))
            for c in configs.values():  # direct: the setter would recurse into sub-configs
                c._attn_implementation_internal = _HF_ATTN
            yield
        finally:
            for k, c in configs.items():
                c._attn_implementation_internal = before[k]
            for h in handles:
                h.remove()
            for attn in attns:
                if hasattr(attn, _CORE_ATTR):
                    delattr(attn, _CORE_ATTR)
            self.rope.clear()
            self.rotary_of.clear()
            self._tables.clear()

    def logits(self, ids: Tensor, run: _Run) -> Tensor:
        self.rope.clear()
        self.rotary_of.clear()
        self._tables.clear()
        pos = torch.arange(run.offset, run.offset + ids.shape[1], device=ids.device)[None]
        return self.model(input_ids=ids, position_ids=pos, use_cache=False).logits


def _backend(model: nn.Module) -> _AnchorBackend | _HFBackend:
    if isinstance(model, AnchorLM):
        return _AnchorBackend(model)
    inner = getattr(model, "hf", None)  # HFMemoryModel: its hooks are no-ops with no memories
    if isinstance(inner, nn.Module):
        return _backend(inner)
    if hasattr(getattr(model, "config", None), "model_type"):
        return _HFBackend(model)
    inner = getattr(model, "model", None)  # MemtreeLM
    if isinstance(inner, nn.Module):
        return _backend(inner)
    raise TypeError(
        f"{type(model).__name__} is neither memtree's AnchorLM nor a Hugging Face causal LM"
    )


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# -- public API ---------------------------------------------------------------------------------
def new_memory(
    model: nn.Module,
    method: Method,
    cfg: CamelotConfig | None = None,
    *,
    device: torch.device | str | None = None,
) -> CamelotMemory | None:
    """An empty memory of `method`'s kind sized for `model` (None for "base")."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {list(METHODS)}")
    if method == "base":
        return None
    b = _backend(model)
    return CamelotMemory(
        cfg or CamelotConfig(),
        kind=_KIND[method],
        n_layers=b.n_layers,
        kv_heads=b.kv_heads,
        head_dim=b.head_dim,
        device=device if device is not None else _device(b.model),
    )


@contextlib.contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def context_limit(model: nn.Module) -> int:
    """Positions the model supports (AnchorLM's max_seq_len, HF's max_position_embeddings)."""
    return int(_backend(model).max_positions)


def check_window(model: nn.Module, window: int, methods: Sequence[str], sink: int = 0) -> None:
    """Errors naming `window` unless every method fits: a memory method positions the window after
    a prefix of L entries, so it needs 2L positions; base needs L; a sink adds its S to each."""
    _check_window(window, methods, context_limit(model), sink)


def _check_window(window: int, methods: Sequence[str], limit: int, sink: int = 0) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be a positive integer, got {window!r}")
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
        raise ValueError(f"sink must be a non-negative integer, got {sink!r}")
    copies = 1 if list(methods) == ["base"] else 2  # the window, and for a memory its prefix of L
    need = copies * window + sink
    if need > limit:
        what = ("window" if copies == 1 else "2·window (memory prefix + window)") + (
            " + sink" if sink else ""
        )
        raise ValueError(
            f"window={window}: {what} = {need} positions exceeds the model's context of {limit}; "
            f"use window ≤ {(limit - sink) // copies}"
        )


def longdoc_token_nll(
    model: nn.Module,
    tokens: Tensor | Sequence[int],
    *,
    method: Method = "camelot",
    window: int = 128,
    cfg: CamelotConfig | None = None,
    memory: CamelotMemory | None = None,
    visibility: Visibility = "causal",
    sink: int = 0,
) -> Tensor:
    """Per-token NLL (N − 1,) fp32 of a document of N tokens, window by window (module docstring).

    memory: continue from this memory (it is updated in place); None: a fresh one from `cfg`.
    sink: keep the document's first `sink` tokens as an attention sink before every later window
    (module docstring, "Attention sink"); 0: none, the seed's setting.
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {list(METHODS)}")
    if visibility not in ("causal", "full"):
        raise ValueError(f"visibility {visibility!r} is not one of 'causal', 'full'")
    b = _backend(model)
    _check_window(window, [method], b.max_positions, sink)
    if method == "base":
        if memory is not None:
            raise ValueError("method 'base' uses no memory, but one was given")
    elif memory is None:
        memory = new_memory(b.model, method, cfg)
    else:
        if memory.kind != _KIND[method]:
            raise ValueError(f"memory kind={memory.kind!r} cannot serve method {method!r}")
        memory.check_model(n_layers=b.n_layers, kv_heads=b.kv_heads, head_dim=b.head_dim)
    device = _device(b.model)
    ids = torch.as_tensor(tokens, dtype=torch.long).to(device).flatten()
    n = ids.numel()
    if n < 2:
        return torch.zeros(0, device=device)
    run = _Run(method, memory, visibility, sink)
    losses = []
    install = contextlib.nullcontext() if method == "base" and not sink else b.installed(run)
    with _frozen(b.model), install:
        for start in range(0, n - 1, window):
            x, y = ids[start : start + window], ids[start + 1 : start + window + 1]
            run.start_window(len(x))
            logits = b.logits(x[None], run)  # (1, S, V)
            losses.append(F.cross_entropy(logits[0, : len(y)].float(), y, reduction="none"))
            run.end_window()
    return torch.cat(losses)


def longdoc_nll(
    model: nn.Module,
    tokens: Tensor | Sequence[int],
    *,
    method: Method = "camelot",
    window: int = 128,
    cfg: CamelotConfig | None = None,
    memory: CamelotMemory | None = None,
    visibility: Visibility = "causal",
    sink: int = 0,
) -> tuple[float, int]:
    """(summed NLL in nats, tokens scored) of one document; perplexity = exp(sum / n)."""
    nll = longdoc_token_nll(
        model,
        tokens,
        method=method,
        window=window,
        cfg=cfg,
        memory=memory,
        visibility=visibility,
        sink=sink,
    )
    return float(nll.double().sum()), int(nll.numel())


@dataclass(frozen=True)
class CorpusNLL:
    sum_nll: float
    n_tokens: int
    n_docs: int  # documents scored
    skipped_empty: int  # documents with < 2 tokens (nothing to predict), skipped

    @property
    def ppl(self) -> float:
        return math.exp(self.sum_nll / self.n_tokens) if self.n_tokens else float("nan")


def corpus_nll(
    model: nn.Module,
    docs: Iterable[Tensor | Sequence[int]],
    *,
    method: Method = "camelot",
    window: int = 128,
    cfg: CamelotConfig | None = None,
    visibility: Visibility = "causal",
    sink: int = 0,
) -> CorpusNLL:
    """Sum of `longdoc_nll` over documents, each with a fresh memory; empty documents (fewer
    than 2 tokens) are skipped and counted."""
    total, n_tok, n_docs, skipped = 0.0, 0, 0, 0
    for doc in docs:
        if len(doc) < 2:
            skipped += 1
            continue
        s, n = longdoc_nll(
            model, doc, method=method, window=window, cfg=cfg, visibility=visibility, sink=sink
        )
        total, n_tok, n_docs = total + s, n_tok + n, n_docs + 1
    return CorpusNLL(sum_nll=total, n_tokens=n_tok, n_docs=n_docs, skipped_empty=skipped)
