"""The anchor transformer and its memory layers (seed 002 §2.2, App. A Fig. 14, App. I).

`AnchorLM` is an OpenLM-style decoder: token embedding; per block a gain-only
LayerNorm → attention (q/k gain-only norms, RoPE, optional GQA) → residual,
gain-only LayerNorm → SwiGLU FFN → residual; a final gain-only norm; an output
head tied to the embedding or separate. Its parameter count equals
`AnchorShape.params()` exactly, so the geometry module's accounting is the
model's. Presets other than OpenLM (Gemma/Qwen/Llama) get the same shapes and
counts (GQA, per-head q/k norms, q/k/v biases, post-sublayer norms when
`norms_per_block == 4`) but not those models' norm/activation variants, so
their released weights do not load as-is.

A layer's memory arrives in one of two forms:
- gathered (`LayerMemories` dict): one flat block per level and sequence,
  (B, P_level), laid out by `memtree.geometry.block_layout`;
  `assemble_memories` splits them (`split_block`) into named per-layer tensors and
  concatenates levels along the memory width, and the blocks apply them with
  batched matmuls. Blocks fetched from a memstore bank (eval, on device) and
  every LoRA memory take this form.
- read in place (`BankRead`): views into the trainable bank's tables plus
  each sequence's row per level (`TrainableBank.read`). KV memories are read
  by `kernels.memory_attention` one level at a time and the levels merged by
  their log-sum-exps into the same single softmax; FFN memories by
  `kernels.ffn_memory`, summed over levels. No (B, …) copy of the blocks is
  made and the bank's gradient stays sparse over the rows read.

Mixture of Chapters (`ModelConfig.moc`, `training/layers/moc.py`, seed 000): a latent
memory bank read by routed cross-attention at chosen blocks, either between
attention and FFN (variation 1) or after the FFN and followed by a second FFN
(variation 2, seed 004 §2.3); the bank(s) live in `AnchorLM.moc_banks` and
`moc_aux_loss()` returns the router losses of the last forward. It excludes
the hierarchical `memory` (one kind of memory per model).

Decisions where the paper is silent or its numbers were lost:
- LoRA scale = `lora_alpha / r` with r the layer's rank after concatenating
  levels (the usual LoRA convention; App. I's value for the factor is lost).
  Concatenating the levels' ranks makes their LoRAs one LoRA of rank Σ r_l.
- KV memories: queries attend to the m learned keys/values in a separate
  softmax (no causal mask, no RoPE on either side: the query is taken after its
  q-norm but before rotation, so the memory read does not depend on position);
  the result is added to the attention output before the output projection.
  A separate softmax keeps zero-initialised values an exact no-op, which a
  softmax shared with the context keys would not be. Learned keys are used as
  stored (no k-norm): they are KV-cache entries, which sit after the norm.
- RoPE positions are absolute within the packed sequence, not restarted per
  document: document masking already stops cross-document attention, and
  RoPE only sees position differences within a document.
- Init: truncated normal (±2σ, σ = `init_std`) for every linear and embedding
  weight, zero biases, norm gains 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memtree.geometry import AnchorShape, MemoryConfig, block_layout, memory_layers, split_block
from memtree.kernels.ffn_memory import FFNTable, ffn_memory, ffn_memory_table
from memtree.kernels.memory_attention import MemoryTable, memory_attention, memory_attention_table
from memtree.training.layers.moc import (
    LatentBank,
    MoCConfig,
    MoCLayer,
    bank_for,
    build_banks,
    mean_aux_loss,
)
from memtree.training.layers.pkm import PKMConfig, ProductKeyMemory


class ReadTables:
    """The kernels' tables for one step, shared by every layer's `BankRead`: KV reference
    tables (`memory_attention_table`) and FFN pair sorts (`ffn_memory_table`).

    Every layer reads a level's rows with the same lists at the same shapes, so one table
    per level (and query shape) serves them all: built by the first layer's read, reused by
    the rest. On a GPU a KV table costs ~170 dispatched ops of host time per build
    (docs/BENCHMARKS.md), more than the kernels' own device time at small shapes; an
    FFN table is sorted twice per call without one, and with sparse gradients counts its
    distinct blocks (a host sync) once instead of once per layer.
    Entries are matched by the rows tensor's identity, which the BankReads hold alive."""

    def __init__(self) -> None:
        self._entries: list[tuple[Tensor, tuple, MemoryTable | FFNTable | None]] = []

    def _cached(self, rows: Tensor, key: tuple, build):
        for r, kk, table in self._entries:
            if r is rows and kk == key:
                return table
        table = build()
        self._entries.append((rows, key, table))
        return table

    def ffn(self, rows: Tensor, block_idx: Tensor, n_blocks: int) -> FFNTable:
        """The FFN table of block_idx (B, k) (built from rows (B,)) for banks of n_blocks."""
        key = ("ffn", tuple(block_idx.shape), n_blocks, block_idx.device)
        return self._cached(rows, key, lambda: ffn_memory_table(block_idx, n_blocks))

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self, rows: Tensor, q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, impl: str
    ) -> MemoryTable | None:
        key = (tuple(q.shape), q.dtype, tuple(k.shape), k.dtype, q.device, impl)
        return self._cached(
            rows, key, lambda: memory_attention_table(q, k, v, block_idx, impl=impl)
        )


@dataclass(frozen=True)
class BankRead:
    """One layer's memory read in place from a bank, without per-sequence copies.

    levels: per memory level, ({name: view}, rows): the layer's tensors for every
    bank row as views into that level's table — KV "k"/"v" (N_l, m_l, H_kv, D),
    FFN "w1"/"w2"/"w3" (N_l, W_l, d) — and rows (B,) int64, each sequence's row.
    tables: the step's shared KV / FFN tables (one `ReadTables` for all layers), or None to
    build one per call. impl: the kernels' dispatch ("auto": Triton on CUDA).
    """

    levels: tuple[tuple[dict[str, Tensor], Tensor], ...]
    tables: ReadTables | None = field(default=None, compare=False, repr=False)
    impl: str = "auto"


@dataclass(frozen=True)
class WidenedFFN:
    """One layer's SwiGLU with one sequence's FFN memory joined onto its inner dim (seed 002 §2.2:
    an FFN memory is a wider SwiGLU), for decoding: one GEMM per projection, as the anchor alone
    runs, instead of the anchor's and the memory's apart. w1, w2 (F + W, d); w3 (d, F + W).
    Built by `widen_ffn_memories`; equal to the gathered read up to summation order."""

    w1: Tensor
    w2: Tensor
    w3: Tensor


# Per layer index: named memory tensors, each with a leading batch dim B, a BankRead, or a
# WidenedFFN.
LayerMemories = dict[str, Tensor] | BankRead | WidenedFFN
Memories = dict[int, LayerMemories]


class KVCache:
    """Every layer's keys and values of the tokens seen so far, so that decoding runs each new
    token through the model once instead of the whole sequence again (`AnchorLM.forward(cache=)`).

    k, v: (n_layers, B, H_kv, max_len, D), keys after their norm and RoPE, as attention reads
    them; `length` tokens are filled. Preallocated to `max_len` so a step appends in place
    instead of growing a tensor per token. Memories need no cache entry: a fetched block is the
    same for every position (KV memories are read by the position-free query)."""

    def __init__(
        self,
        *,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_len <= 0 or batch <= 0:
            raise ValueError(f"KVCache: max_len and batch must be positive, got {max_len}, {batch}")
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.max_len = max_len

    @classmethod
    def for_model(
        cls,
        model: AnchorLM,
        *,
        batch: int = 1,
        max_len: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A cache shaped for `model`: up to its max_seq_len tokens unless `max_len` is smaller."""
        a, p = model.config.anchor, next(model.parameters())
        n = model.config.max_seq_len if max_len is None else min(max_len, model.config.max_seq_len)
        return cls(
            n_layers=a.n_layers,
            batch=batch,
            n_kv_heads=a.kv_heads,
            head_dim=a.head_dim,
            max_len=n,
            dtype=dtype or p.dtype,
            device=p.device,
        )

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds in memory (allocated for max_len tokens, not only `length`)."""
        return self.k.numel() * self.k.element_size() * 2

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, H_kv, S, D) of the new tokens → every token's so far, (B, H_kv, length + S, D).
        `length` moves on once all layers have appended (`advance`)."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KVCache holds {self.max_len} tokens; {self.length} + {k.shape[2]} would overflow "
                "it"
            )
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        self.length += n


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    anchor: AnchorShape
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    memory: MemoryConfig | None = None
    moc: MoCConfig | None = None
    pkm: PKMConfig | None = (
        None  # product-key memory layers replacing FFNs (training/layers/pkm.py, seed 003)
    )
    lora_alpha: float = 1.0
    # "sdpa": a dense (B, 1, S, S) document mask (CPU, short sequences); "flex": FlexAttention
    # with a block-sparse document mask, compiled on CUDA (skips the blocks across documents).
    attn_impl: Literal["sdpa", "flex"] = "sdpa"

    def __post_init__(self) -> None:
        if self.max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {self.max_seq_len}")
        if self.init_std <= 0:
            raise ValueError(f"init_std must be positive, got {self.init_std}")
        if self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be positive, got {self.lora_alpha}")
        if self.attn_impl not in ("sdpa", "flex"):
            raise ValueError(f"attn_impl {self.attn_impl!r} is not supported; use 'sdpa' or 'flex'")
        if self.anchor.norms_per_block not in (2, 4):
            raise ValueError(
                f"anchor {self.anchor.name}: norms_per_block must be 2 (pre-norms) or 4 "
                f"(pre- and post-norms), got {self.anchor.norms_per_block}"
            )
        if self.memory is not None:
            memory_layers(self.anchor, self.memory)  # raises on a placement the anchor cannot hold
        if self.pkm is not None:
            if self.memory is not None or self.moc is not None:
                raise ValueError("pkm excludes memory and moc (one kind of memory per model)")
            self.pkm.resolved_layers(self.anchor.n_layers)  # raises on a block the anchor lacks
        if self.moc is not None:
            if self.memory is not None:
                raise ValueError(
                    "memory and moc are mutually exclusive (one kind of memory per model)"
                )
            self.moc.geometry(
                d_model=self.anchor.d_model,
                n_layers=self.anchor.n_layers,
                anchor_heads=self.anchor.n_heads,
            )  # raises if the anchor cannot hold it


def segment_ids_from_eot(input_ids: Tensor, eot_id: int) -> Tensor:
    """(B, S) token ids → (B, S) document index; an EOT token ends (belongs to) its document."""
    is_eot = (input_ids == eot_id).long()
    return torch.cumsum(is_eot, dim=-1) - is_eot


def assemble_memories(
    blocks: dict[int, Tensor], anchor: AnchorShape, memory_config: MemoryConfig
) -> Memories:
    """Per-level flat blocks {level: (B, P_level)} → {layer: {name: (B, …)}}.

    Levels are concatenated along the memory width: rows for FFN / KV / LoRA A
    tensors, columns for LoRA B tensors (named `*_b`). Layers that carry no
    memory are absent. Slices and concatenations keep gradients flowing back to
    the flat blocks.
    """
    per_layer: dict[int, dict[str, list[Tensor]]] = {}
    for level in range(1, memory_config.n_levels + 1):
        layout = block_layout(anchor, memory_config, level)
        if not layout:
            continue
        if level not in blocks:
            raise ValueError(
                f"memory level {level} has multiplier "
                f"{memory_config.multipliers[level - 1]} but no blocks were given"
            )
        flat = blocks[level]
        want = sum(t.numel for t in layout)
        if flat.ndim != 2 or flat.shape[1] != want:
            raise ValueError(
                f"level {level} blocks: expected shape (B, {want}), got {tuple(flat.shape)}"
            )
        # the split every consumer of a flat block uses (memstore records included)
        for name, t in split_block(layout, flat).items():
            _, layer, tensor = name.split(".")
            per_layer.setdefault(int(layer), {}).setdefault(tensor, []).append(t)
    return {
        layer: {name: _cat_width(name, parts) for name, parts in tensors.items()}
        for layer, tensors in sorted(per_layer.items())
    }


def widen_ffn_memories(model: AnchorLM, memories: Memories) -> Memories:
    """Gathered FFN memories of one sequence ({layer: {"w1", "w2", "w3": (1, W, d)}}) → {layer:
    WidenedFFN}: the layer's FFN weights with the memory's rows (w1, w2) and columns (w3) joined on,
    in the weights' dtype. Made once per prompt; every decode step then runs plain SwiGLUs."""
    if model.config.memory is None or model.config.memory.type != "ffn":
        raise ValueError("widen_ffn_memories: the model's memory is not an FFN memory")
    out: Memories = {}
    for layer, mem in memories.items():
        if not isinstance(mem, dict) or mem["w1"].shape[0] != 1:
            raise ValueError(
                f"widen_ffn_memories: layer {layer} needs gathered memories of one sequence"
            )
        ffn = model.blocks[layer].ffn
        dt = ffn.w1.weight.dtype
        out[layer] = WidenedFFN(
            w1=torch.cat([ffn.w1.weight, mem["w1"][0].to(dt)]),  # (F + W, d)
            w2=torch.cat([ffn.w2.weight, mem["w2"][0].to(dt)]),  # (F + W, d)
            w3=torch.cat([ffn.w3.weight, mem["w3"][0].to(dt).T], dim=1),  # (d, F + W)
        )
    return out


def _cat_width(name: str, parts: list[Tensor]) -> Tensor:
    """Join levels along the memory width: LoRA B (B, out, w) by column, others (B, w, ·) by row."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2 if name.endswith("_b") else 1)


def gain_norm(dim: int, eps: float) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=eps, elementwise_affine=True, bias=False)


def lora_delta(x: Tensor, a: Tensor, b: Tensor, alpha: float) -> Tensor:
    """scale·(x·Aᵀ)·Bᵀ per sequence, scale = alpha / r.

    x (B, S, in), a (B, r, in), b (B, out, r) → (B, S, out).
    """
    a, b = a.to(x.dtype), b.to(x.dtype)
    return (alpha / a.shape[1]) * ((x @ a.mT) @ b.mT)


def rotate_half(x: Tensor) -> Tensor:
    """(…, D) → (−x₂, x₁) of its halves: RoPE's rotation by 90°, shared with `camelot`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, S, H, D); cos/sin (S, D), or (B, S, D) for per-row positions."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)  # (…, S, 1, D)
    return x * cos + rotate_half(x) * sin


_COMPILED_FLEX: dict[str, Any] = {}


def _flex_attention(device: torch.device):
    """flex_attention, compiled once per process on CUDA (eager it runs an unfused reference)."""
    # here, not at the top: it loads torch's compiler stack (seconds), needed only for attn_impl
    # flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED_FLEX:
        _COMPILED_FLEX["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX["cuda"]


def document_block_mask(
    segment_ids: Tensor | None, *, batch: int, seq_len: int, device: torch.device
):
    """FlexAttention BlockMask: causal, and within one document when segment_ids (B, S) is given.

    Built once per forward and shared by every layer; blocks that lie entirely across a
    document boundary are skipped by the kernel rather than masked element by element."""
    from torch.nn.attention.flex_attention import create_block_mask  # heavy: see _flex_attention

    if segment_ids is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        return create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (segment_ids[b, q_idx] == segment_ids[b, kv_idx])

    return create_block_mask(doc_mask_mod, batch, None, seq_len, seq_len, device=device)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        a = cfg.anchor
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.kv_heads, a.head_dim
        self.q = nn.Linear(a.d_model, a.q_dim, bias=a.qkv_bias)
        self.k = nn.Linear(a.d_model, a.kv_dim, bias=a.qkv_bias)
        self.v = nn.Linear(a.d_model, a.kv_dim, bias=a.qkv_bias)
        self.o = nn.Linear(a.q_dim, a.d_model, bias=False)
        self.qk_norm = a.qk_norm
        if a.qk_norm != "none":
            q_norm_dim = a.q_dim if a.qk_norm == "full" else a.head_dim
            k_norm_dim = a.kv_dim if a.qk_norm == "full" else a.head_dim
            self.q_norm = gain_norm(q_norm_dim, cfg.norm_eps)
            self.k_norm = gain_norm(k_norm_dim, cfg.norm_eps)
        self.lora_alpha = cfg.lora_alpha
        self.mem_type = cfg.memory.type if cfg.memory is not None else None
        # External attention core, default off: fn(q, k, v) with q (B, S, H, D) and k, v
        # (B, S, H_kv, D) taken before RoPE → (B, H, S, D). It then owns positions and masking;
        # training/camelot/longdoc.py sets it for a run to attend over extra prefix K/V. A plain
        # attribute, not a submodule: state dicts and parameters are unaffected.
        self.attn_core: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None

    def _heads(self, x: Tensor, n: int) -> Tensor:
        return x.unflatten(-1, (n, self.head_dim))  # (B, S, n, D)

    def _repeat_kv(self, x: Tensor) -> Tensor:
        """(B, H_kv, S, D) → (B, H, S, D); explicit repeat keeps every SDPA backend usable."""
        groups = self.n_heads // self.n_kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        mem: LayerMemories | None,
        cache: tuple[KVCache, int] | None = None,
    ) -> Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, S, q_dim), (B, S, kv_dim) ×2
        if mem is not None and self.mem_type == "lora-qk":
            q = q + lora_delta(x, mem["q_a"], mem["q_b"], self.lora_alpha)
            k = k + lora_delta(x, mem["k_a"], mem["k_b"], self.lora_alpha)
        if mem is not None and self.mem_type == "lora-ov":
            v = v + lora_delta(x, mem["v_a"], mem["v_b"], self.lora_alpha)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = self._heads(q, self.n_heads)  # (B, S, H, D)
        k, v = self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)  # (B, S, H_kv, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q_pos_free = q.transpose(1, 2)  # (B, H, S, D), the query KV memories read with
        if self.attn_core is not None:
            out = self.attn_core(q, k, v)  # (B, H, S, D)
        else:
            out = self._self_attention(q, k, v, cos, sin, mask, cache)
        if mem is not None and self.mem_type == "kv":
            out = out + (
                self._read_kv_bank(q_pos_free, mem)
                if isinstance(mem, BankRead)
                else self._read_kv_memory(q_pos_free, mem["k"], mem["v"])
            )
        out = out.transpose(1, 2).flatten(2)  # (B, S, q_dim)
        y = self.o(out)
        if mem is not None and self.mem_type == "lora-ov":
            y = y + lora_delta(out, mem["o_a"], mem["o_b"], self.lora_alpha)
        return y

    def _self_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: tuple[KVCache, int] | None = None,
    ) -> Tensor:
        """q (B, S, H, D), k/v (B, S, H_kv, D) before RoPE → (B, H, S, D), causal (+ mask).
        cache (KVCache, layer): the S new tokens follow the cache's `length` earlier ones
        (cos / sin are theirs), whose keys and values they also attend to."""
        q = _rope(q, cos, sin).transpose(1, 2)  # (B, H, S, D)
        k = _rope(k, cos, sin).transpose(1, 2)  # (B, H_kv, S, D)
        v = v.transpose(1, 2)  # (B, H_kv, S, D)
        past = 0
        if cache is not None:
            store, layer = cache
            past = store.length
            k, v = store.append(layer, k, v)  # (B, H_kv, past + S, D)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        if past:
            S = q.shape[2]
            if S == 1:  # one new token sees every earlier one: no mask
                return F.scaled_dot_product_attention(q, k, v)
            # query i sits at position past + i and sees keys 0 … past + i
            sees = torch.ones(S, past + S, dtype=torch.bool, device=q.device).tril(diagonal=past)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=sees)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, D)
        if isinstance(mask, Tensor):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return _flex_attention(q.device)(q, k, v, block_mask=mask)  # a FlexAttention BlockMask

    def _read_kv_memory(self, q: Tensor, k_mem: Tensor, v_mem: Tensor) -> Tensor:
        """q (B, H, S, D); k_mem/v_mem (B, m, kv_dim) → (B, H, S, D), softmax over the m slots."""
        k_mem = self._repeat_kv(self._heads(k_mem.to(q.dtype), self.n_kv_heads).transpose(1, 2))
        v_mem = self._repeat_kv(self._heads(v_mem.to(q.dtype), self.n_kv_heads).transpose(1, 2))
        return F.scaled_dot_product_attention(q, k_mem, v_mem)  # every query sees every slot

    @staticmethod
    def _read_kv_bank(q: Tensor, mem: BankRead) -> Tensor:
        """q (B, H, S, D) → (B, H, S, D): the same softmax over every level's slots as
        `_read_kv_memory` on the concatenated levels, read by block index from the bank."""

        def read(views: dict[str, Tensor], rows: Tensor, return_lse: bool):
            idx = rows[:, None]  # (B, 1): one block per sequence and level
            table = (
                None
                if mem.tables is None
                else mem.tables.get(rows, q, views["k"], views["v"], idx, mem.impl)
            )
            return memory_attention(
                q,
                views["k"],
                views["v"],
                idx,
                sparse_grad=True,
                impl=mem.impl,
                return_lse=return_lse,
                table=table,
            )

        if len(mem.levels) == 1:
            ((views, rows),) = mem.levels
            return read(views, rows, False)
        outs, lses = zip(*(read(views, rows, True) for views, rows in mem.levels))
        # levels differ in slot count, so one call per level; their lses weight the
        # partial reads into the joint softmax exactly (every sequence reads every level)
        share = torch.softmax(torch.stack(lses), dim=0)[..., None]  # (L, B, H, S, 1) fp32
        return (share * torch.stack(outs).float()).sum(0).to(q.dtype)


class FeedForward(nn.Module):
    """SwiGLU: w3(silu(w1 x) ⊙ w2 x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.anchor.d_model, cfg.anchor.ffn_dim
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(d, f, bias=False)
        self.w3 = nn.Linear(f, d, bias=False)
        self.lora_alpha = cfg.lora_alpha
        self.mem_type = cfg.memory.type if cfg.memory is not None else None
        # When a list, each forward with gathered FFN memories appends the memory's hidden
        # activations (B, S, W): how block finetuning counts the units a batch uses
        # (training/finetune/blocks.py). A plain attribute, not state.
        self.recorder: list[Tensor] | None = None

    def forward(self, x: Tensor, mem: LayerMemories | None) -> Tensor:
        if mem is None or self.mem_type not in ("ffn", "lora-ffn"):
            return self.w3(F.silu(self.w1(x)) * self.w2(x))
        if isinstance(mem, WidenedFFN):
            return F.linear(F.silu(F.linear(x, mem.w1)) * F.linear(x, mem.w2), mem.w3)
        if self.mem_type == "lora-ffn":
            g = self.w1(x) + lora_delta(x, mem["w1_a"], mem["w1_b"], self.lora_alpha)  # (B, S, ffn)
            u = self.w2(x) + lora_delta(x, mem["w2_a"], mem["w2_b"], self.lora_alpha)
            h = F.silu(g) * u
            return self.w3(h) + lora_delta(h, mem["w3_a"], mem["w3_b"], self.lora_alpha)
        # FFN memory widens the inner dim by W; the widened w3 sums the two halves' outputs.
        y = self.w3(F.silu(self.w1(x)) * self.w2(x))
        if isinstance(mem, BankRead):  # (only KV/FFN memories are read in place)
            for views, rows in mem.levels:  # levels' blocks add up along the widened dim
                idx = rows[:, None]  # (B, 1): one block per sequence and level
                table = (
                    None if mem.tables is None else mem.tables.ffn(rows, idx, views["w1"].shape[0])
                )
                y = y + ffn_memory(
                    x, views["w1"], views["w2"], views["w3"], idx, impl=mem.impl, table=table
                )
            return y
        w1, w2, w3 = (mem[n].to(x.dtype) for n in ("w1", "w2", "w3"))  # (B, W, d) each
        h_mem = F.silu(x @ w1.mT) * (x @ w2.mT)  # (B, S, W)
        if self.recorder is not None:
            self.recorder.append(h_mem.detach())
        return y + h_mem @ w3


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        a, eps = cfg.anchor, cfg.norm_eps
        d = a.d_model
        self.attn_norm = gain_norm(d, eps)
        self.attn = Attention(cfg)
        self.ffn_norm = gain_norm(d, eps)
        # a product-key memory layer takes this block's FFN's place (seed 003 §3)
        pkm = cfg.pkm is not None and layer in cfg.pkm.resolved_layers(a.n_layers)
        self.pkm = ProductKeyMemory(cfg.pkm, d) if pkm else None
        self.ffn = None if pkm else FeedForward(cfg)
        # Gemma-style sandwich norms on the sublayer outputs when the shape has 4 norms.
        self.post_norms = cfg.anchor.norms_per_block == 4
        if self.post_norms:
            self.attn_post_norm = gain_norm(d, eps)
            self.ffn_post_norm = gain_norm(d, eps)
        moc = cfg.moc if cfg.moc is not None and layer in cfg.moc.layers else None
        # the memory sublayer brings its own pre-norm (RMSNorm, seed 000 eq. 1) and no post-norm
        self.moc = (
            MoCLayer(moc, d_model=d, n_layers=a.n_layers, anchor_heads=a.n_heads, norm_eps=eps)
            if moc is not None
            else None
        )
        self.moc_variation = moc.variation if moc is not None else None
        if self.moc_variation == 2:
            self.moc_ffn_norm = gain_norm(d, eps)
            self.moc_ffn = FeedForward(cfg)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        mem: LayerMemories | None,
        bank: LatentBank | None = None,
        cache: tuple[KVCache, int] | None = None,
    ) -> Tensor:
        a = self.attn(self.attn_norm(x), cos, sin, mask, mem, cache)
        x = x + (self.attn_post_norm(a) if self.post_norms else a)
        if self.moc_variation == 1:  # Self-Attn → MemXAttn → MLP
            x = x + self.moc(x, bank)
        f = self.pkm(self.ffn_norm(x)) if self.pkm is not None else self.ffn(self.ffn_norm(x), mem)
        x = x + (self.ffn_post_norm(f) if self.post_norms else f)
        if self.moc_variation == 2:  # Self-Attn → MLP → MemXAttn → MLP
            x = x + self.moc(x, bank)
            x = x + self.moc_ffn(self.moc_ffn_norm(x), None)
        return x


class AnchorLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        a = cfg.anchor
        if a.head_dim % 2:
            raise ValueError(f"anchor {a.name}: RoPE needs an even head_dim, got {a.head_dim}")
        self.config = cfg
        self.embed = nn.Embedding(a.vocab_size, a.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(a.n_layers))
        self.moc_banks = build_banks(cfg.moc, a.d_model) if cfg.moc is not None else None
        self.norm = gain_norm(a.d_model, cfg.norm_eps)
        self.lm_head = None if a.tied_embeddings else nn.Linear(a.d_model, a.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.trunc_normal_(m.weight, std=std, a=-2 * std, b=2 * std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
        for m in self.modules():  # after the generic pass: zero-init W_O, bank std, router bias,
            if isinstance(m, MoCLayer | LatentBank | ProductKeyMemory):  # PKM sub-keys and values
                m.reset_parameters()

    def moc_layers(self) -> list[MoCLayer]:
        return [b.moc for b in self.blocks if b.moc is not None]

    def moc_aux_loss(self) -> Tensor | None:
        """Mean over memory layers of lb_coef·L_lb + z_coef·L_z from the last forward; None without
        MoC."""
        layers = self.moc_layers()
        return mean_aux_loss(layers) if layers else None

    def moc_parameters(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(latent banks, memory layers: routers, memory attention, variation-2 FFNs); empty without
        MoC."""
        if self.moc_banks is None:
            return [], []
        layers = []
        for b in self.blocks:
            if b.moc is not None:
                layers += list(b.moc.parameters())
            if b.moc_variation == 2:
                layers += list(b.moc_ffn_norm.parameters()) + list(b.moc_ffn.parameters())
        return list(self.moc_banks.parameters()), layers

    def pkm_layers(self) -> list[ProductKeyMemory]:
        return [b.pkm for b in self.blocks if b.pkm is not None]

    def fsdp_wrap_fn(self, module: nn.Module) -> bool:
        """Composer's FSDP auto-wrap rule: one shard unit per transformer block."""
        return isinstance(module, Block)

    def _rope_tables(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos, sin (S, D) for absolute positions 0..S-1, in fp32."""
        d = self.config.anchor.head_dim
        f32 = torch.float32
        inv_freq = self.config.rope_theta ** (-torch.arange(0, d, 2, device=device, dtype=f32) / d)
        pos = torch.arange(seq_len, device=device, dtype=f32)
        angles = torch.outer(pos, inv_freq)  # (S, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (S, D)
        return angles.cos(), angles.sin()

    @property
    def packable(self) -> bool:
        """Whether every layer but attention acts on each token alone, so that `positions` and
        `attn_mask` can put several sequences sharing a prefix into one row and score them exactly
        as apart. Mixture-of-Chapters layers route a whole row and a custom attention core ignores
        the mask, so neither allows it."""
        return all(b.moc is None and b.attn.attn_core is None for b in self.blocks)

    def forward(
        self,
        input_ids: Tensor,
        *,
        segment_ids: Tensor | None = None,
        memories: Memories | None = None,
        positions: Tensor | None = None,
        attn_mask: Tensor | None = None,
        hidden: bool = False,
        cache: KVCache | None = None,
    ) -> Tensor:
        """input_ids (B, S) → logits (B, S, V), or with hidden=True the last block's output
        (B, S, d), to take `logits` of only the positions a scorer reads.

        segment_ids (B, S): document index per token (`segment_ids_from_eot`);
        attention is causal and within a document. None: causal only.
        memories: per-layer memories, gathered (`assemble_memories`) or read in place
        from a bank (`BankRead`, `training.bank.TrainableBank.read`).
        positions (B, S) int and attn_mask (B, S, S) bool, given together (and only to a
        `packable` model): each token's RoPE position, and which keys each query sees (True:
        attends), in place of 0..S-1 and the causal mask; a row may then be longer than
        max_seq_len as long as its positions are below it (`eval.model.RunModel.choice_scores`).
        cache: the keys and values of the tokens before input_ids (`KVCache`, `length` of them),
        which input_ids follow at positions length … length + S − 1 and attend to; their own
        are appended and `length` moves on. Equal to a full forward over all the tokens (fp32,
        ~1e-6). Only for a `packable` model, one document per row (no segment_ids / positions).
        """
        _, seq_len = input_ids.shape
        if cache is not None:
            return self._forward_cached(input_ids, cache, memories, hidden, segment_ids, positions)
        if (positions is None) != (attn_mask is None):
            raise ValueError("positions and attn_mask go together")
        if positions is not None:
            if not self.packable:
                raise ValueError(
                    "positions/attn_mask need a packable model (no MoC layer, no custom attention "
                    "core)"
                )
            if positions.shape != input_ids.shape or attn_mask.shape != (*input_ids.shape, seq_len):
                raise ValueError(
                    f"positions {tuple(positions.shape)} and attn_mask {tuple(attn_mask.shape)} "
                    f"do not match input_ids {tuple(input_ids.shape)}"
                )
        span = seq_len if positions is None else int(positions.max()) + 1
        if span > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {span} exceeds max_seq_len {self.config.max_seq_len}"
            )
        if memories:
            if self.config.memory is None:
                raise ValueError("memories were given to a model configured without memory")
            bad = [i for i in memories if not 0 <= i < len(self.blocks)]
            if bad:
                raise ValueError(
                    f"memories for layers {bad}, but the anchor has {len(self.blocks)} layers"
                )
        mask = None
        if attn_mask is not None:
            mask = attn_mask[:, None]  # (B, 1, S, S), dense: SDPA on any device
        elif self.config.attn_impl == "flex":
            mask = document_block_mask(
                segment_ids, batch=input_ids.shape[0], seq_len=seq_len, device=input_ids.device
            )
        elif segment_ids is not None:
            same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, S, S)
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=input_ids.device).tril()
            mask = (same_doc & causal)[:, None]  # (B, 1, S, S), broadcast over heads
        cos, sin = self._rope_tables(span, input_ids.device)  # (span, D)
        if positions is not None:
            cos, sin = cos[positions], sin[positions]  # (B, S, D)
        x = self.embed(input_ids)  # (B, S, d)
        for i, block in enumerate(self.blocks):
            bank = bank_for(self.moc_banks, i) if block.moc is not None else None
            x = block(x, cos, sin, mask, memories.get(i) if memories else None, bank)
        return x if hidden else self.logits(x)

    def _forward_cached(
        self,
        input_ids: Tensor,
        cache: KVCache,
        memories: Memories | None,
        hidden: bool,
        segment_ids: Tensor | None,
        positions: Tensor | None,
    ) -> Tensor:
        """`forward` after the cache's tokens; see `forward`."""
        if not self.packable:
            # a Mixture-of-Chapters router pools the whole row, a custom attention core owns its
            # keys
            raise ValueError(
                "a KV cache needs a packable model (no MoC layer, no custom attention core)"
            )
        if segment_ids is not None or positions is not None:
            raise ValueError("a KV cache decodes one document per row: no segment_ids or positions")
        B, S = input_ids.shape
        if cache.k.shape[1] != B:
            raise ValueError(f"the KV cache holds {cache.k.shape[1]} rows, input_ids {B}")
        span = cache.length + S
        if span > min(self.config.max_seq_len, cache.max_len):
            raise ValueError(
                f"sequence length {span} exceeds max_seq_len {self.config.max_seq_len} "
                f"(or the cache's {cache.max_len})"
            )
        if memories and self.config.memory is None:
            raise ValueError("memories were given to a model configured without memory")
        cos, sin = self._rope_tables(span, input_ids.device)
        cos, sin = cos[cache.length :], sin[cache.length :]  # (S, D): the new tokens' positions
        x = self.embed(input_ids)  # (B, S, d)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None, memories.get(i) if memories else None, None, (cache, i))
        cache.advance(S)
        return x if hidden else self.logits(x)

    def logits(self, x: Tensor) -> Tensor:
        """Final hidden states (..., d) from `forward(..., hidden=True)` → logits (..., V)."""
        x = self.norm(x)
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, self.embed.weight)
