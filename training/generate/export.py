"""Export an anchor with one path's fetched memory merged, as a Hugging Face model folder.

`export_anchor(model, out_dir, memories=...)` writes config.json, model.safetensors,
generation_config.json (and the run's tokenizer), loadable with
`AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)`.
The memory of one tree path (gathered form, batch 1: `assemble_memories` on each level's block
of that path) becomes ordinary weights, so the folder answers exactly as `model(ids,
memories=memories)` does, with no memtree code at inference when the architecture is stock:
- "ffn": a wider SwiGLU. The memory's rows join the FFN's inner dim (w1 / w2 rows, w3 columns);
  layers with no or a narrower memory are padded with zero rows and columns, which add exactly 0
  (silu(0)·0 = 0), so every layer has one `intermediate_size`.
- "lora-*": merged, W += (alpha / r)·B·A. For "lora-ffn" w3's LoRA input already includes the
  w1 / w2 deltas, which merging w1 / w2 first reproduces exactly.
- "kv": learned keys / values read by the position-free query in a separate softmax
  (`training.model.Attention`); no stock architecture has that, so they stay extra parameters.

Architecture. The anchor's norms are gain-only LayerNorms (mean-subtracting, not RMSNorm), so
Llama / Qwen / Gemma do not match. StableLM does, exactly: LayerNorm (a zero bias is exact),
pre-norm sequential residual, optional per-head q/k LayerNorms (one per head; the anchor's
shared gain is copied to each), q/k/v biases, SwiGLU, full rotate-half RoPE (partial_rotary_factor
1.0), 1/√head_dim attention, tied or separate head. It is used when the anchor allows it:
qk_norm "head" or "none", 2 norms per block, n_heads·head_dim == d_model (StableLM's o_proj is
hidden × hidden) and no KV memory. Otherwise — OpenLM's q/k norms over all heads ("full", the
default), Gemma-style post-norms, a narrower attention, KV memories — the folder uses the
`memtree_anchor` architecture defined here: `MemtreeAnchorForCausalLM`, the anchor's forward with
an HF `DynamicCache`, registered with `AutoConfig` / `AutoModelForCausalLM` when this module is
imported. Loading such a folder therefore needs `import memtree.training.generate.export` first
(no `auto_map` / remote code is written).

`export_hf_memory` does the same for a post-hoc memory on a Hugging Face model
(`training.hf.HFMemoryModel`): the same architecture with a larger `intermediate_size`, or LoRA
merged; a KV memory is refused (a stock model cannot hold it).

Not exportable: Mixture-of-Chapters and product-key memory layers (routed reads over a bank,
which no HF architecture has), a custom attention core (runtime state, not weights), memories of
more than one sequence (one folder is one path) and memories read in place (`BankRead`).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
    StableLmConfig,
    StableLmForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import no_init_weights

from memtree.geometry import AnchorShape
from memtree.io import atomic_dir, read_json
from memtree.training.model import AnchorLM, BankRead, Memories, rotate_half

MODEL_TYPE = "memtree_anchor"
LOAD_NOTE = "import memtree.training.generate.export"

# LoRA pairs → the weight they adapt: (tensor prefix, AnchorLM module, HF decoder-layer module).
_LORA_TARGETS = {
    "lora-qk": (("q", "attn.q", "self_attn.q_proj"), ("k", "attn.k", "self_attn.k_proj")),
    "lora-ov": (("v", "attn.v", "self_attn.v_proj"), ("o", "attn.o", "self_attn.o_proj")),
    # each weight merges on its own: w3's LoRA read h built from the adapted w1 / w2, which the
    # merged w1 / w2 rebuild exactly
    "lora-ffn": (
        ("w1", "ffn.w1", "mlp.gate_proj"),
        ("w2", "ffn.w2", "mlp.up_proj"),
        ("w3", "ffn.w3", "mlp.down_proj"),
    ),
}
_FFN_MODULES = {
    "w1": ("ffn.w1", "mlp.gate_proj"),
    "w2": ("ffn.w2", "mlp.up_proj"),
    "w3": ("ffn.w3", "mlp.down_proj"),
}


# -- the memtree_anchor architecture ------------------------------------------------------------
class MemtreeAnchorConfig(PretrainedConfig):
    """`AnchorLM`'s shape for transformers. qk_norm "full" | "head" | "none"; norms_per_block 2
    (pre-norms) or 4 (+ post-sublayer norms); kv_memory_slots: learned key/value slots per layer
    (0: none) of a merged KV memory; intermediate_size includes a merged FFN memory."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 50_432,
        hidden_size: int = 512,
        intermediate_size: int = 2048,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 8,
        num_key_value_heads: int | None = None,
        head_dim: int = 64,
        qk_norm: str = "full",
        norms_per_block: int = 2,
        qkv_bias: bool = False,
        rope_theta: float = 10_000.0,
        norm_eps: float = 1e-5,
        max_position_embeddings: int = 2048,
        kv_memory_slots: list[int] | None = None,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        **kwargs: Any,
    ) -> None:
        if qk_norm not in ("full", "head", "none"):
            raise ValueError(f"qk_norm {qk_norm!r} is not one of 'full', 'head', 'none'")
        if norms_per_block not in (2, 4):
            raise ValueError(f"norms_per_block must be 2 or 4, got {norms_per_block}")
        slots = list(kv_memory_slots) if kv_memory_slots else [0] * num_hidden_layers
        if len(slots) != num_hidden_layers:
            raise ValueError(
                f"kv_memory_slots has {len(slots)} entries for {num_hidden_layers} layers"
            )
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.intermediate_size, self.num_hidden_layers = intermediate_size, num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim, self.qk_norm, self.norms_per_block = head_dim, qk_norm, norms_per_block
        self.qkv_bias, self.rope_theta, self.norm_eps = qkv_bias, rope_theta, norm_eps
        self.max_position_embeddings, self.kv_memory_slots = max_position_embeddings, slots
        self.initializer_range, self.use_cache = initializer_range, use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def _norm(dim: int, eps: float) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=eps, bias=False)  # gain-only, as `training.model.gain_norm`


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, S, D); cos / sin (B, S, D) → x rotated (rotate-half convention, as AnchorLM)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotate_half(x) * sin


class _Attention(nn.Module):
    def __init__(self, c: MemtreeAnchorConfig, layer: int) -> None:
        super().__init__()
        d, self.h, self.h_kv, self.d_head = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q = nn.Linear(d, self.h * self.d_head, bias=c.qkv_bias)
        self.k = nn.Linear(d, self.h_kv * self.d_head, bias=c.qkv_bias)
        self.v = nn.Linear(d, self.h_kv * self.d_head, bias=c.qkv_bias)
        self.o = nn.Linear(self.h * self.d_head, d, bias=False)
        self.qk_norm = c.qk_norm
        if c.qk_norm != "none":
            full = c.qk_norm == "full"
            self.q_norm = _norm(self.h * self.d_head if full else self.d_head, c.norm_eps)
            self.k_norm = _norm(self.h_kv * self.d_head if full else self.d_head, c.norm_eps)
        m = c.kv_memory_slots[layer]
        self.mem_k = (
            nn.Parameter(torch.zeros(m, self.h_kv * self.d_head)) if m else None
        )  # (m, kv_dim)
        self.mem_v = nn.Parameter(torch.zeros(m, self.h_kv * self.d_head)) if m else None

    def _repeat_kv(self, x: Tensor) -> Tensor:
        """(B, H_kv, T, D) → (B, H, T, D), the explicit repeat AnchorLM uses."""
        groups = self.h // self.h_kv
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: DynamicCache | None,
        layer: int,
    ) -> Tensor:
        """x (B, S, d) → (B, S, d). mask (B, 1, S, T) bool or None (plain causal from
        position 0)."""
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.unflatten(-1, (self.h, self.d_head))  # (B, S, H, D)
        k, v = k.unflatten(-1, (self.h_kv, self.d_head)), v.unflatten(-1, (self.h_kv, self.d_head))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|H_kv, S, D)
        k = _rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, layer)  # (B, H_kv, T, D), every token so far
        causal = mask is None and q.shape[2] > 1
        out = F.scaled_dot_product_attention(
            _rope(q, cos, sin),
            self._repeat_kv(k),
            self._repeat_kv(v),
            attn_mask=mask,
            is_causal=causal,
        )  # (B, H, S, D)
        if self.mem_k is not None:
            # KV memory: the un-rotated query reads every slot in its own softmax, so the read
            # is the same at every position and needs no cache entry
            b = q.shape[0]
            km, vm = (
                self._repeat_kv(
                    t.to(q.dtype)
                    .unflatten(-1, (self.h_kv, self.d_head))
                    .transpose(0, 1)[None]
                    .expand(b, -1, -1, -1)
                )
                for t in (self.mem_k, self.mem_v)
            )  # (B, H, m, D)
            out = out + F.scaled_dot_product_attention(q, km, vm)
        return self.o(out.transpose(1, 2).flatten(2))


class _SwiGLU(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (
            nn.Linear(d, f, bias=False),
            nn.Linear(d, f, bias=False),
            nn.Linear(f, d, bias=False),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class _Block(nn.Module):
    def __init__(self, c: MemtreeAnchorConfig, layer: int) -> None:
        super().__init__()
        d, eps = c.hidden_size, c.norm_eps
        self.attn_norm, self.attn = _norm(d, eps), _Attention(c, layer)
        self.ffn_norm, self.ffn = _norm(d, eps), _SwiGLU(d, c.intermediate_size)
        self.post_norms = c.norms_per_block == 4
        if self.post_norms:
            self.attn_post_norm, self.ffn_post_norm = _norm(d, eps), _norm(d, eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: DynamicCache | None,
        layer: int,
    ) -> Tensor:
        a = self.attn(self.attn_norm(x), cos, sin, mask, cache, layer)
        x = x + (self.attn_post_norm(a) if self.post_norms else a)
        f = self.ffn(self.ffn_norm(x))
        return x + (self.ffn_post_norm(f) if self.post_norms else f)


class _Body(nn.Module):
    def __init__(self, c: MemtreeAnchorConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.blocks = nn.ModuleList(_Block(c, i) for i in range(c.num_hidden_layers))
        self.norm = _norm(c.hidden_size, c.norm_eps)


class MemtreeAnchorForCausalLM(PreTrainedModel, GenerationMixin):
    """`AnchorLM` (memory merged) as a transformers causal LM. Parameter names are AnchorLM's under
    `model.` (plus `model.blocks.{i}.attn.mem_k` / `mem_v` (m, kv_dim) for a KV memory), so the
    weights read like the training checkpoint's. Attention is always torch SDPA; a 2-D
    `attention_mask` (left padding) and `past_key_values` (`DynamicCache`) are honoured."""

    config_class = MemtreeAnchorConfig
    base_model_prefix = "model"
    _tied_weights_keys: ClassVar[list[str]] = ["lm_head.weight"]
    _no_split_modules: ClassVar[list[str]] = ["_Block"]
    _supports_sdpa = True  # what it runs anyway; lets from_pretrained's default choice through

    def __init__(self, config: MemtreeAnchorConfig) -> None:
        super().__init__(config)
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, _Attention) and module.mem_k is not None:
            nn.init.normal_(module.mem_k, std=std)
            nn.init.zeros_(module.mem_v)  # as App. I: a fresh KV memory adds nothing

    def _rope_tables(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """position_ids (B, S) → cos, sin (B, S, D) in fp32, computed as AnchorLM does."""
        d = self.config.head_dim
        f32 = torch.float32
        inv_freq = self.config.rope_theta ** (
            -torch.arange(0, d, 2, device=position_ids.device, dtype=f32) / d
        )
        angles = position_ids.to(f32)[..., None] * inv_freq  # (B, S, D/2)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: DynamicCache | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        cache_position: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        """input_ids (B, S) → logits (B, S, V) (the last `logits_to_keep` positions if nonzero).
        attention_mask (B, T) over the cached and new tokens, 1 = real, 0 = padding."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        x = self.model.embed(input_ids) if inputs_embeds is None else inputs_embeds  # (B, S, d)
        b, s = x.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if cache_position is None:
            cache_position = torch.arange(past, past + s, device=x.device)
        if position_ids is None:
            position_ids = cache_position[None].expand(b, s)
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError(
                f"attention_mask must be (B, T) 0/1, got shape {tuple(attention_mask.shape)}"
            )
        padded = attention_mask is not None and not bool(attention_mask.all())
        mask = None  # plain causal from position 0: SDPA's is_causal, as AnchorLM
        if padded or (past and s > 1):
            keys = torch.arange(past + s, device=x.device)
            mask = (keys[None, :] <= cache_position[:, None])[None, None].expand(b, 1, s, past + s)
            if padded:
                mask = mask & attention_mask[:, None, None, : past + s].bool()
                # a padding query keeps its own key, so no softmax row is empty (NaN)
                mask = mask | (keys[None, :] == cache_position[:, None])
        cos, sin = self._rope_tables(position_ids)
        cache = past_key_values if use_cache else None
        for i, block in enumerate(self.model.blocks):
            x = block(x, cos, sin, mask, cache, i)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(self.model.norm(x[:, keep]))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device)
            )
        out = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
        return out.to_tuple() if return_dict is False else out


AutoConfig.register(MODEL_TYPE, MemtreeAnchorConfig, exist_ok=True)
AutoModelForCausalLM.register(MemtreeAnchorConfig, MemtreeAnchorForCausalLM, exist_ok=True)


# -- memories ---------------------------------------------------------------------------------
def _tensor_shapes(a: AnchorShape, kind: str) -> dict[str, tuple[int | None, int | None]]:
    """Per memory type, each tensor's shape without the batch; None marks the memory width."""
    d, f, q, kv = a.d_model, a.ffn_dim, a.q_dim, a.kv_dim
    return {
        "ffn": {"w1": (None, d), "w2": (None, d), "w3": (None, d)},
        "kv": {"k": (None, kv), "v": (None, kv)},
        "lora-qk": {"q_a": (None, d), "q_b": (q, None), "k_a": (None, d), "k_b": (kv, None)},
        "lora-ov": {"v_a": (None, d), "v_b": (kv, None), "o_a": (None, q), "o_b": (d, None)},
        "lora-ffn": {
            "w1_a": (None, d),
            "w1_b": (f, None),
            "w2_a": (None, d),
            "w2_b": (f, None),
            "w3_a": (None, f),
            "w3_b": (d, None),
        },
    }[kind]


def _one_path(
    memories: Memories | None, a: AnchorShape, kind: str | None
) -> dict[int, dict[str, Tensor]]:
    """Gathered memories of one sequence {layer: {name: (1, …)}} → {layer: {name: (…)}}, checked."""
    if not memories:
        return {}
    if kind is None:
        raise ValueError("memories were given, but the model is configured without memory")
    want = _tensor_shapes(a, kind)
    out: dict[int, dict[str, Tensor]] = {}
    for layer, lm in sorted(memories.items()):
        if isinstance(lm, BankRead):
            raise TypeError(
                f"layer {layer}: memories read in place from a bank (BankRead) cannot be "
                "exported; pass gathered ones (assemble_memories on the path's blocks)"
            )
        if not 0 <= layer < a.n_layers:
            raise ValueError(f"memories for layer {layer}, but the anchor has {a.n_layers} layers")
        if set(lm) != set(want):
            raise ValueError(
                f"layer {layer}: a {kind!r} memory has tensors {sorted(want)}, got {sorted(lm)}"
            )
        widths = set()
        for name, t in lm.items():
            if t.ndim != 3 or t.shape[0] != 1:
                raise ValueError(
                    f"layer {layer} {name}: shape {tuple(t.shape)}; an export merges one path's "
                    "memory, so it needs batch B = 1 (e.g. assemble_memories({level: "
                    "blocks[level][i:i + 1]}, …))"
                )
            for got, exp in zip(t.shape[1:], want[name], strict=True):
                if exp is None:
                    widths.add(got)
                elif got != exp:
                    raise ValueError(
                        f"layer {layer} {name}: shape {tuple(t.shape[1:])} does not fit the "
                        f"anchor (expected {tuple('W' if e is None else e for e in want[name])})"
                    )
        if len(widths) != 1:
            raise ValueError(
                f"layer {layer}: the {kind!r} tensors disagree on the memory width {sorted(widths)}"
            )
        out[layer] = {name: t[0].detach() for name, t in lm.items()}
    return out


def _merge_memory(
    sd: dict[str, Tensor],
    mem: dict[int, dict[str, Tensor]],
    kind: str,
    alpha: float,
    n_layers: int,
    key: Callable[[int, str], str],
    hf_names: bool,
) -> int:
    """Fold one path's memory into the state dict sd (replacing tensors, not writing into the
    model's). key(layer, module) → that module's state-dict stem; hf_names picks the HF module
    names over AnchorLM's. Returns the FFN width every layer then has (0 when unchanged)."""
    pick = 2 if hf_names else 1
    if kind.startswith("lora"):
        for layer, lm in mem.items():
            for t in _LORA_TARGETS[kind]:
                w_key = key(layer, t[pick]) + ".weight"
                a, b = lm[f"{t[0]}_a"], lm[f"{t[0]}_b"]  # (r, in), (out, r)
                w = sd[w_key]
                # merged in fp32 at least: a bf16 sum would round the delta twice
                acc = torch.promote_types(w.dtype, torch.float32)
                delta = (alpha / a.shape[0]) * (
                    b.to(w.device, acc) @ a.to(w.device, acc)
                )  # (out, in)
                sd[w_key] = (w.to(acc) + delta).to(w.dtype)
        return 0
    if kind != "ffn":
        return 0
    extra = max(lm["w1"].shape[0] for lm in mem.values())
    width = 0
    for layer in range(n_layers):
        lm = mem.get(layer)
        keys = {n: key(layer, mods[pick - 1]) for n, mods in _FFN_MODULES.items()}
        gate = sd[keys["w1"] + ".weight"]  # (f, d)
        rows = {n: gate.new_zeros(extra, gate.shape[1]) for n in ("w1", "w2", "w3")}  # (extra, d)
        for n, t in (lm or {}).items():  # the memory's (W, d), zero-padded to extra
            rows[n][: t.shape[0]] = t.to(gate)
        sd[keys["w1"] + ".weight"] = torch.cat([gate, rows["w1"]])  # (f + extra, d)
        sd[keys["w2"] + ".weight"] = torch.cat([sd[keys["w2"] + ".weight"], rows["w2"]])
        sd[keys["w3"] + ".weight"] = torch.cat(
            [sd[keys["w3"] + ".weight"], rows["w3"].T], dim=1
        )  # (d, f + extra)
        for n in (
            "w1",
            "w2",
        ):  # an MLP bias (Llama mlp_bias): zero on the new units, like their rows
            if (bk := keys[n] + ".bias") in sd:
                sd[bk] = torch.cat([sd[bk], sd[bk].new_zeros(extra)])
        width = gate.shape[0] + extra
    return width


# -- export ---------------------------------------------------------------------------------------
def _stablelm_misfit(a: AnchorShape, kind: str | None) -> str | None:
    """Why the anchor (with this merged memory) is not exactly a StableLM, or None if it is."""
    if kind == "kv":
        return "a KV memory (learned keys/values in a separate softmax) has no stock equivalent"
    if a.qk_norm == "full":
        return "q/k norms over all heads (qk_norm 'full') are not per-head LayerNorms"
    if a.norms_per_block == 4:
        return "post-sublayer norms (norms_per_block 4) have no StableLM equivalent"
    if a.q_dim != a.d_model:
        return (
            f"StableLM needs n_heads·head_dim == d_model, the anchor has {a.q_dim} != {a.d_model}"
        )
    return None


def _to_stablelm(sd: dict[str, Tensor], a: AnchorShape) -> dict[str, Tensor]:
    """AnchorLM state dict (merged) → StableLmForCausalLM's, with zero LayerNorm biases."""

    def ln(dst: str, src: str) -> None:
        out[dst + ".weight"] = sd[src + ".weight"]
        out[dst + ".bias"] = torch.zeros_like(sd[src + ".weight"])

    out: dict[str, Tensor] = {
        "model.embed_tokens.weight": sd["embed.weight"],
        "lm_head.weight": sd.get("lm_head.weight", sd["embed.weight"]),
    }
    ln("model.norm", "norm")
    for i in range(a.n_layers):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        ln(dst + "input_layernorm", src + "attn_norm")
        ln(dst + "post_attention_layernorm", src + "ffn_norm")
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            for p in ("weight", "bias"):
                if (k := f"{src}attn.{ours}.{p}") in sd:
                    out[f"{dst}self_attn.{theirs}.{p}"] = sd[k]
        if a.qk_norm == "head":  # one shared gain → StableLM's one LayerNorm per head
            for h in range(a.n_heads):
                out[f"{dst}self_attn.q_layernorm.norms.{h}.weight"] = sd[src + "attn.q_norm.weight"]
            for h in range(a.kv_heads):
                out[f"{dst}self_attn.k_layernorm.norms.{h}.weight"] = sd[src + "attn.k_norm.weight"]
        for ours, theirs in (("w1", "gate_proj"), ("w2", "up_proj"), ("w3", "down_proj")):
            out[f"{dst}mlp.{theirs}.weight"] = sd[f"{src}ffn.{ours}.weight"]
    return out


def _check_target(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(
            f"export folder {out_dir} already exists and is not empty; "
            "give a new path (an export never overwrites one)"
        )


@contextlib.contextmanager
def _still_free(out_dir: Path) -> Iterator[None]:
    """Around the publishing rename: a folder filled meanwhile is refused, not replaced."""
    _check_target(out_dir)
    yield


def _save_tokenizer(src: Path, dst: Path, eot_id: int | None, max_len: int) -> None:
    """The run's tokenizer (a `tokenizers` tokenizer.json, with or without HF config files) saved
    as a PreTrainedTokenizerFast-compatible folder whose eos (and pad, if it has none) is EOT."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"tokenizer folder {src} has no tokenizer.json (a memtree run's "
            "tokenizer folder, or any fast Hugging Face tokenizer folder, has one)"
        )
    if (src / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    else:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"))
    if eot_id is not None:
        eot = tok.convert_ids_to_tokens(eot_id)
        if eot is None:
            raise ValueError(f"tokenizer {src} has no token with id {eot_id} (the EOT id)")
        tok.eos_token = eot
        if tok.pad_token is None:  # memtree pads with EOT; HF batching wants some pad token
            tok.pad_token = eot
    tok.model_max_length = max_len
    tok.save_pretrained(str(dst))


def _write(
    out_dir: Path,
    cls: type[PreTrainedModel],
    config: PretrainedConfig,
    state: dict[str, Tensor],
    dtype: torch.dtype,
    generation: GenerationConfig | None,
    tokenizer: Callable[[Path], None] | None,
) -> tuple[int, int]:
    """Build cls(config) from state (strict: every tensor named and shaped as the class expects),
    save it into a temp folder beside out_dir, rename it into place. → (params, bytes)."""
    with no_init_weights():  # every tensor comes from state; random init would be wasted time
        hf = cls(config)
    hf.to(dtype).load_state_dict(state, strict=True)
    hf.tie_weights()
    if generation is not None:
        hf.generation_config = generation
    params = sum(p.numel() for p in hf.parameters())  # tied weights counted once
    with atomic_dir(out_dir, publish_guard=lambda: _still_free(out_dir)) as tmp:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
        hf.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer(tmp)
    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    return params, size


def _eot(eot_id: int | None, tokenizer_dir: Path | None, vocab_size: int) -> int | None:
    """The EOT id: given, else the run tokenizer's (memtree_tokenizer.json), else None."""
    if (
        eot_id is None
        and tokenizer_dir is not None
        and (tokenizer_dir / "memtree_tokenizer.json").is_file()
    ):
        eot_id = int(read_json(tokenizer_dir / "memtree_tokenizer.json")["eot_id"])
    if eot_id is not None and not 0 <= eot_id < vocab_size:
        raise ValueError(f"eot_id {eot_id} is outside the vocabulary (size {vocab_size})")
    return eot_id


def export_anchor(
    model: AnchorLM,
    out_dir: str | os.PathLike,
    *,
    memories: Memories | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    eot_id: int | None = None,
) -> dict:
    """Write `model` with one path's memory merged as an HF model folder at out_dir.

    memories: gathered, batch 1 — {layer: {name: (1, …)}} from `assemble_memories` on the
    path's blocks {level: (1, P_level)}; None exports the anchor alone. tokenizer_dir: the run's
    tokenizer folder (tokenizer.json), saved alongside with eos = EOT. eot_id: the EOT token
    (default: tokenizer_dir's memtree_tokenizer.json), the folder's eos / pad id.
    out_dir must not exist or be empty; the folder appears complete or not at all.

    Returns {path, architecture, model_type, intermediate_size, params, bytes, dtype,
    memory_type, memory_merged, kv_memory_slots, why_not_stock, load_requires}.
    """
    cfg, a = model.config, model.config.anchor
    out_dir = Path(out_dir)
    _check_target(out_dir)
    if cfg.moc is not None or cfg.pkm is not None:
        which = "Mixture-of-Chapters" if cfg.moc is not None else "product-key memory"
        raise ValueError(
            f"cannot export a model with {which} layers: their routed reads over a "
            "memory bank have no Hugging Face architecture to go into"
        )
    if any(b.attn.attn_core is not None for b in model.blocks):
        raise ValueError(
            "cannot export a model with a custom attention core (attn_core): it is "
            "runtime state of a run, not weights; clear it first"
        )
    kind = cfg.memory.type if cfg.memory is not None else None
    mem = _one_path(memories, a, kind)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    eot_id = _eot(eot_id, tok_dir, a.vocab_size)
    dtype = next(model.parameters()).dtype
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    width = (
        _merge_memory(
            sd, mem, kind, cfg.lora_alpha, a.n_layers, lambda i, m: f"blocks.{i}.{m}", False
        )
        if mem
        else 0
    ) or a.ffn_dim
    slots = (
        [mem[i]["k"].shape[0] if i in mem else 0 for i in range(a.n_layers)]
        if mem and kind == "kv"
        else None
    )
    merged_kind = kind if mem else None
    why = _stablelm_misfit(a, merged_kind)
    common: dict[str, Any] = {
        "vocab_size": a.vocab_size,
        "hidden_size": a.d_model,
        "intermediate_size": width,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.kv_heads,
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": a.tied_embeddings,
        "use_cache": True,
        # memtree prompts start with no BOS; EOT ends a document
        "bos_token_id": None,
        "eos_token_id": eot_id,
        "pad_token_id": None,
    }
    if why is None:
        config: PretrainedConfig = StableLmConfig(
            hidden_act="silu",
            layer_norm_eps=cfg.norm_eps,
            use_qkv_bias=a.qkv_bias,
            qk_layernorm=a.qk_norm == "head",
            use_parallel_residual=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            partial_rotary_factor=1.0,
            **common,
        )
        cls: type[PreTrainedModel] = StableLmForCausalLM
        state = _to_stablelm(sd, a)
    else:
        config = MemtreeAnchorConfig(
            head_dim=a.head_dim,
            qk_norm=a.qk_norm,
            norms_per_block=a.norms_per_block,
            qkv_bias=a.qkv_bias,
            norm_eps=cfg.norm_eps,
            kv_memory_slots=slots,
            **common,
        )
        cls = MemtreeAnchorForCausalLM
        state = {f"model.{k}": v for k, v in sd.items() if not k.startswith("lm_head.")}
        state["lm_head.weight"] = sd.get("lm_head.weight", sd["embed.weight"])
        for i, lm in mem.items() if slots else ():
            state[f"model.blocks.{i}.attn.mem_k"], state[f"model.blocks.{i}.attn.mem_v"] = (
                lm["k"],
                lm["v"],
            )
    generation = (
        GenerationConfig(eos_token_id=eot_id, pad_token_id=eot_id) if eot_id is not None else None
    )
    tokenizer = (
        (lambda d: _save_tokenizer(tok_dir, d, eot_id, cfg.max_seq_len))
        if tok_dir is not None
        else None
    )
    params, size = _write(out_dir, cls, config, state, dtype, generation, tokenizer)
    return {
        "path": str(out_dir),
        "architecture": cls.__name__,
        "model_type": config.model_type,
        "intermediate_size": width,
        "params": params,
        "bytes": size,
        "dtype": str(dtype).removeprefix("torch."),
        "memory_type": merged_kind,
        "memory_merged": bool(mem),
        "kv_memory_slots": slots,
        "why_not_stock": why,
        "load_requires": LOAD_NOTE if why is not None else None,
    }


def export_hf_memory(
    hf_model: Any,
    memories: Memories,
    out_dir: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
) -> dict:
    """Write a post-hoc memory's HF model (`training.hf.HFMemoryModel`) with one path's memory
    merged, as a folder of the same architecture: "ffn" → a larger intermediate_size (layers
    without memory zero-padded; the MLP's own activation is applied to the new units, as the
    hooks do), "lora-*" → merged weights. "kv" is refused. memories: gathered, batch 1
    ({layer: {name: (1, …)}}, e.g. `hf_model.gather(1, paths=path[None])`). tokenizer_dir: an HF
    tokenizer folder saved alongside as it is. Returns the same description as `export_anchor`.
    """
    from memtree.training.hf import HFMemoryModel, decoder_config, decoder_layers

    if not isinstance(hf_model, HFMemoryModel):
        raise TypeError(f"export_hf_memory takes an HFMemoryModel, got {type(hf_model).__name__}")
    kind, a = hf_model.memory.type, hf_model.anchor
    if kind == "kv":
        raise ValueError(
            "cannot export a 'kv' memory into a stock Hugging Face model: its learned "
            "keys/values, read in a separate softmax, have no place in that architecture"
        )
    out_dir = Path(out_dir)
    _check_target(out_dir)
    mem = _one_path(memories, a, kind)
    base = hf_model.hf
    names = {id(m): n for n, m in base.named_modules()}
    prefixes = [names[id(layer)] for layer in decoder_layers(base)]
    sd = {k: v.detach() for k, v in base.state_dict().items()}
    width = (
        _merge_memory(
            sd, mem, kind, hf_model.lora_alpha, a.n_layers, lambda i, m: f"{prefixes[i]}.{m}", True
        )
        if mem
        else 0
    )
    config = copy.deepcopy(base.config)
    if width:
        decoder_config(config).intermediate_size = width
    dtype = next(base.parameters()).dtype
    generation = (
        copy.deepcopy(base.generation_config) if getattr(base, "generation_config", None) else None
    )
    tokenizer = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        tokenizer = lambda d: tok.save_pretrained(str(d))
    params, size = _write(out_dir, type(base), config, sd, dtype, generation, tokenizer)
    return {
        "path": str(out_dir),
        "architecture": type(base).__name__,
        "model_type": config.model_type,
        "intermediate_size": width or a.ffn_dim,
        "params": params,
        "bytes": size,
        "dtype": str(dtype).removeprefix("torch."),
        "memory_type": kind if mem else None,
        "memory_merged": bool(mem),
        "kv_memory_slots": None,
        "why_not_stock": None,
        "load_requires": None,
    }
