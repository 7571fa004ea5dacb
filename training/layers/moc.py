"""Mixture-of-Chapters memory layers (seed 000 §5, App. A.3 Algorithm 1, App. A.4 Table 5;
seed 004).

A latent memory bank of C chapters × T tokens (shared by every memory layer or
one per layer, seed 004 §3.1) is read by cross-attention from chosen blocks of
the anchor. Per memory layer and per sequence:

1. route: r = mean over the sequence of the hidden states H (B, S, d);
   logits z = W_r r + b_r over all C chapters (B, C), computed in fp32.
   Chapters 0..n_shared-1 are always on; the router picks the top-k of the
   other C - n_shared by p = softmax(z[n_shared:]), and their weights are
   renormalised over the k: p̃_i = p_i / Σ_top-k p.
2. mix weights (Table 5 "routed scaling factor 2.5"): shared chapters weigh 1
   and routed chapters routed_scaling · p̃_i, then all n_shared + k weights are
   divided by their sum (n_shared + routed_scaling).
3. read: the batch's unique selected chapters (U of them) are gathered from the
   latent bank with `F.embedding(sparse=True)`, so the bank's gradient is a
   sparse tensor over those U chapters only; they are normalised token by
   token with a gain-free RMSNorm ("shared/routed mixing normalized with
   RMSNorm": shared and routed tokens enter at the same scale, so neither
   dominates by raw magnitude) and projected through W_K, W_V into a
   (U, T, H_kv, D) per-step bank; the per-sequence chapter lists are
   remapped into it and read with q = W_Q RMSNorm(H) by one of three exact paths
   (`MoCLayer.read`, set for the whole model by `memory.read`, whose "auto" is settled by
   the same timed start-up probe as KV / FFN memories, training/read_choice.py): "fused",
   the memory-attention kernel reading the per-step bank by block index; "gather", SDPA on
   each sequence's gathered chapters (the log-weights carried by a widened head, so flash /
   cuDNN kernels apply); "flex", FlexAttention through a block mask made from the block
   table (not "mix"). weight_mode "bias" (default): one softmax over every
   selected token with log(weight) added to its chapter's logits, so with
   equal weights the read is exactly Algorithm 1's softmax over the
   concatenated chapters and a chapter's weight multiplies the attention mass
   its tokens receive; "mix": a softmax per chapter, outputs summed with the
   weights (MoE-style). Either way the router gets gradient from the LM loss
   through the weights (not with top_k = 1, where the renormalised weights are
   constant) and from the auxiliary losses through p and z. The seed's
   reference code instead scales each memory token by its chapter's weight
   before W_K / W_V; that needs a per-sequence copy of every chapter, which
   the per-step bank shared by the batch avoids.
4. out = W_O(read), added to the residual stream by the block. W_O starts at
   zero (`zero_init_out`), so a new memory layer starts as an exact no-op.

Auxiliary losses (per layer, from the last forward; `MoCLayer.aux_loss`):
- load balance, Switch / DeepSeek style with sequences as the routed units:
  L_lb = Σ_i f_i · P_i over the C_r = C - n_shared routed chapters, with
  f_i = C_r / (k·B) · #{b : i ∈ top-k_b} (no gradient) and P_i = mean_b p_{b,i};
  L_lb = 1 when routing is uniform and balanced, larger when it collapses.
- z-loss (ST-MoE): L_z = mean_b (logsumexp_c z_{b,c})², over all C logits.
The model's auxiliary loss is the mean over its memory layers of
lb_coef · L_lb + z_coef · L_z (coefficients 0.01 / 0.001, Table 5).

The router scores all C chapters although the shared ones are never picked:
this keeps the parameter count (App. A.4.1: 22.04M memory-layer parameters)
and the router FLOPs (App. A.2: 2·d·C) exactly the seed's; the shared rows of
W_r only receive the z-loss gradient.

Low-rank memory (`low_rank`): "factorized" stores the bank as A (C·T, r) with
a shared B (r, d) and expands only the selected chapters, M = A·B (seed 004
§5.3, §7.4 option 1); "reduced" stores r-dimensional tokens and runs the whole
cross-attention in r dimensions: W_Q d→r, W_K and W_V r→H_kv·r/H, W_O r→d
(seed 004 §10.3, §7.4 option 2).

Routing is sequence level as in the seed: the pooled mean covers the whole
training row, including later tokens and other packed documents, so a token's
memory read depends on them (the seed trains this way; see training/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memtree.kernels.memory_attention import (
    memory_attention,
    memory_attention_flex,
    memory_attention_sdpa,
)
from memtree.memstore.format import QUANT_GROUP


@dataclass(frozen=True, kw_only=True)
class MoCConfig:
    n_chapters: int  # C, shared chapters included
    tokens_per_chapter: int  # T
    top_k: int  # routed chapters per sequence
    layers: tuple[int, ...]  # 0-based blocks that read the memory
    n_shared: int = 1  # always-on chapters 0..n_shared-1
    shared_bank: bool = True  # one bank for every memory layer (else one bank per layer)
    variation: Literal[1, 2] = (
        1  # 1: Self-Attn → MemXAttn → MLP; 2: Self-Attn → MLP → MemXAttn → MLP
    )
    n_heads: int | None = None  # memory query heads; None: the anchor's
    n_kv_heads: int | None = None  # memory KV heads; None: n_heads
    routed_scaling: float = 2.5
    weight_mode: Literal["bias", "mix"] = "bias"
    memory_norm: bool = True  # gain-free RMSNorm on memory tokens before W_K / W_V
    lb_coef: float = 0.01
    z_coef: float = 0.001
    init_std: float = 0.02
    zero_init_out: bool = True
    low_rank: Literal["none", "factorized", "reduced"] = "none"
    rank: int | None = None  # r for low_rank
    bank_dtype: Literal["fp32", "bf16", "int8", "int4"] = (
        "fp32"  # how the bank is stored (seed 004 §5.2)
    )
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for k in ("n_chapters", "tokens_per_chapter", "top_k"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be positive, got {getattr(self, k)}")
        if not 0 <= self.n_shared < self.n_chapters:
            raise ValueError(
                f"n_shared must be in [0, n_chapters={self.n_chapters}), got {self.n_shared}"
            )
        if self.top_k > self.n_routed:
            raise ValueError(
                f"top_k {self.top_k} exceeds the {self.n_routed} routable chapters "
                f"(n_chapters {self.n_chapters} - n_shared {self.n_shared})"
            )
        if not self.layers or len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise ValueError(
                f"layers must be distinct non-negative block indices, got {list(self.layers)}"
            )
        if self.variation not in (1, 2):
            raise ValueError(f"variation must be 1 or 2, got {self.variation!r}")
        for k in ("n_heads", "n_kv_heads"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise ValueError(f"{k} must be positive, got {v}")
        if self.routed_scaling <= 0:
            raise ValueError(f"routed_scaling must be positive, got {self.routed_scaling}")
        if self.lb_coef < 0 or self.z_coef < 0:
            raise ValueError(f"lb_coef and z_coef must be >= 0, got {self.lb_coef}, {self.z_coef}")
        if self.init_std <= 0 or self.norm_eps <= 0:
            raise ValueError(
                f"init_std and norm_eps must be positive, got {self.init_std}, {self.norm_eps}"
            )
        if self.weight_mode not in ("bias", "mix"):
            raise ValueError(f"weight_mode must be 'bias' or 'mix', got {self.weight_mode!r}")
        if self.low_rank not in ("none", "factorized", "reduced"):
            raise ValueError(
                f"low_rank must be 'none', 'factorized' or 'reduced', got {self.low_rank!r}"
            )
        if (self.low_rank == "none") != (self.rank is None):
            raise ValueError(
                f"rank is required with low_rank 'factorized' / 'reduced' and only then "
                f"(low_rank {self.low_rank!r}, rank {self.rank})"
            )
        if self.rank is not None and self.rank <= 0:
            raise ValueError(f"rank must be positive, got {self.rank}")
        if self.bank_dtype not in BANK_DTYPES:
            raise ValueError(
                f"bank_dtype must be one of {tuple(BANK_DTYPES)}, got {self.bank_dtype!r}"
            )

    @property
    def n_routed(self) -> int:
        return self.n_chapters - self.n_shared

    @property
    def n_selected(self) -> int:
        """Chapters each sequence reads: the shared ones plus its top-k."""
        return self.n_shared + self.top_k

    def geometry(self, *, d_model: int, n_layers: int, anchor_heads: int) -> MoCGeometry:
        """Head layout on a given anchor; raises if the anchor cannot hold this config."""
        bad = [i for i in self.layers if i >= n_layers]
        if bad:
            raise ValueError(f"moc.layers {bad} are outside the anchor's {n_layers} blocks")
        heads = self.n_heads or anchor_heads
        kv_heads = self.n_kv_heads or heads
        if heads % kv_heads:
            raise ValueError(f"moc.n_kv_heads {kv_heads} must divide the memory heads {heads}")
        attn_dim = self.rank if self.low_rank == "reduced" else d_model
        if attn_dim % heads:
            raise ValueError(
                f"moc: the memory attention width {attn_dim} must be a multiple of the "
                f"{heads} memory heads"
            )
        head_dim = attn_dim // heads
        return MoCGeometry(
            n_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=head_dim,
            mem_dim=attn_dim,
            stored_dim=self.rank or d_model,
        )


@dataclass(frozen=True, kw_only=True)
class MoCGeometry:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mem_dim: int  # width of a memory token entering W_K / W_V (d, or r when reduced)
    stored_dim: int  # width of a stored bank token (r when low-rank, else d)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


class Routing(NamedTuple):
    chapters: Tensor  # (B, n_shared + k) global chapter ids, shared first
    weights: Tensor  # (B, n_shared + k) mixing weights, summing to 1
    probs: Tensor  # (B, C_r) softmax over the routed chapters
    routed: Tensor  # (B, k) top-k indices into the routed chapters


def route(logits: Tensor, *, n_shared: int, top_k: int, routed_scaling: float) -> Routing:
    """Sequence-level top-k routing with always-on shared chapters. logits (B, C) over all
    chapters."""
    batch = logits.shape[0]
    probs = logits[:, n_shared:].softmax(dim=-1)  # (B, C_r)
    top_p, routed = probs.topk(top_k, dim=-1)  # (B, k)
    routed_w = routed_scaling * top_p / top_p.sum(dim=-1, keepdim=True)
    shared = torch.arange(n_shared, device=logits.device).expand(batch, n_shared)
    chapters = torch.cat([shared, routed + n_shared], dim=1)
    weights = torch.cat([routed_w.new_ones(batch, n_shared), routed_w], dim=1)
    return Routing(chapters, weights / weights.sum(dim=-1, keepdim=True), probs, routed)


def load_balance_loss(probs: Tensor, routed: Tensor) -> Tensor:
    """Σ_i f_i·P_i; probs (B, C_r), routed (B, k). 1 when balanced; f_i carries no gradient."""
    batch, n = probs.shape
    k = routed.shape[1]
    counts = torch.zeros(n, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(
        0, routed.flatten(), torch.ones(routed.numel(), dtype=probs.dtype, device=probs.device)
    )
    f = counts * (n / (k * batch))  # (C_r,)
    return (f * probs.mean(dim=0)).sum()


def z_loss(logits: Tensor) -> Tensor:
    """mean_b logsumexp(z_b)²; logits (B, C)."""
    return torch.logsumexp(logits, dim=-1).square().mean()


# How a memory layer reads its chapters (`MoCLayer.read`); every path computes the same function.
READS = ("fused", "gather", "flex")


def read_modes(weight_mode: str) -> tuple[str, ...]:
    """The reads that are exact for `weight_mode`: FlexAttention has one joint softmax, so no
    "mix" (a softmax per chapter)."""
    return READS if weight_mode == "bias" else ("fused", "gather")


def _memory_read(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor,
    weight_mode: str,
    read: str,
) -> Tensor:
    """q (B, H, S, D); bank_k/bank_v (U, T, H_kv, D); block_idx, weights (B, n) → (B, H, S, D).

    The one place a memory layer calls a memory-attention path (kernels/memory_attention), chosen
    by `read`, so a run's `memory.read` (and its probe) reaches Mixture-of-Chapters reads as it
    reaches KV / FFN memories. The per-step bank is computed from the latent chapters, so its
    gradient is dense and small; the latent bank's own gradient is sparse through `LatentBank`'s
    gather."""
    if read == "fused":
        return memory_attention(
            q, bank_k, bank_v, block_idx, weights, weight_mode=weight_mode, sparse_grad=False
        )
    if read == "gather":
        return memory_attention_sdpa(q, bank_k, bank_v, block_idx, weights, weight_mode=weight_mode)
    if read == "flex":
        return memory_attention_flex(q, bank_k, bank_v, block_idx, weights, weight_mode=weight_mode)
    raise ValueError(f"MoC read {read!r} is not one of {READS}")


# Bytes per stored bank value; int8 / int4 add one fp32 absmax scale per QUANT_GROUP values, as
# memstore's records do (memstore/format.py), so a bank quantises here as it would on disk.
BANK_DTYPES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}


def quantise(rows: Tensor, dtype: str) -> Tensor:
    """rows (..., n) → the values a `dtype` store returns for them, with a straight-through
    gradient (quantisation-aware training: the forward reads what is stored, the fp32 master
    copy gets the unquantised gradient). int8/int4: symmetric absmax per group of QUANT_GROUP
    consecutive values of a row."""
    if dtype == "fp32":
        return rows
    if dtype == "bf16":
        q = rows.to(torch.bfloat16).to(rows.dtype)
    else:
        n = rows.shape[-1]
        pad = -n % QUANT_GROUP
        g = F.pad(rows.detach(), (0, pad)).unflatten(-1, (-1, QUANT_GROUP))  # (..., n_groups, G)
        qmax = 127 if dtype == "int8" else 7
        scale = g.abs().amax(dim=-1, keepdim=True) / qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = ((g / scale).round().clamp(-qmax, qmax) * scale).flatten(-2)[..., :n]
    return rows + (q - rows).detach()


def bank_bytes(cfg: MoCConfig, d_model: int) -> int:
    """Bytes of the stored bank(s): C·T·m values in `bank_dtype` (+ group scales), and the fp32
    up-projection of a factorised bank."""
    values = cfg.n_chapters * cfg.tokens_per_chapter * (cfg.rank or d_model)
    per = values * BANK_DTYPES[cfg.bank_dtype]
    if cfg.bank_dtype in ("int8", "int4"):
        per += (
            4
            * cfg.n_chapters
            * math.ceil(cfg.tokens_per_chapter * (cfg.rank or d_model) / QUANT_GROUP)
        )
    if cfg.low_rank == "factorized":
        per += 4 * cfg.rank * d_model
    return int(per) * (1 if cfg.shared_bank else len(cfg.layers))


class LatentBank(nn.Module):
    """The latent memory: a (C, T·m) table, one row per chapter, read with sparse gradients.

    m is d, or r when low-rank; "factorized" adds a dense (r, d) up-projection
    applied to the selected chapters only. A quantised `bank_dtype` reads each selected row as
    its stored (quantised) values (`quantise`)."""

    def __init__(self, cfg: MoCConfig, d_model: int) -> None:
        super().__init__()
        self.cfg = cfg
        stored = cfg.rank or d_model
        self.weight = nn.Parameter(torch.empty(cfg.n_chapters, cfg.tokens_per_chapter * stored))
        self.up = (
            nn.Parameter(torch.empty(cfg.rank, d_model)) if cfg.low_rank == "factorized" else None
        )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.cfg.init_std)
        if self.up is not None:
            # entries of A·B then have std init_std, as a full-width bank would
            nn.init.normal_(self.up, std=self.cfg.rank**-0.5)

    def forward(self, chapters: Tensor) -> Tensor:
        """chapters (U,) → their tokens (U, T, m_out); the table's gradient is sparse over
        `chapters`."""
        rows = quantise(
            F.embedding(chapters, self.weight, sparse=True), self.cfg.bank_dtype
        )  # (U, T·m)
        tokens = rows.unflatten(-1, (self.cfg.tokens_per_chapter, -1))  # (U, T, m)
        return tokens if self.up is None else tokens @ self.up.to(tokens.dtype)


def build_banks(cfg: MoCConfig, d_model: int) -> nn.ModuleDict:
    """{"shared": bank} or {"<layer>": bank per memory layer}."""
    keys = ["shared"] if cfg.shared_bank else [str(i) for i in cfg.layers]
    return nn.ModuleDict({k: LatentBank(cfg, d_model) for k in keys})


def bank_for(banks: nn.ModuleDict, layer: int) -> LatentBank:
    return banks["shared"] if "shared" in banks else banks[str(layer)]


class MoCLayer(nn.Module):
    """Router + memory cross-attention for one block; forward returns the residual update."""

    def __init__(
        self,
        cfg: MoCConfig,
        *,
        d_model: int,
        n_layers: int,
        anchor_heads: int,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        g = cfg.geometry(d_model=d_model, n_layers=n_layers, anchor_heads=anchor_heads)
        self.geo = g
        self.norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.router = nn.Linear(d_model, cfg.n_chapters)
        self.q = nn.Linear(d_model, g.q_dim, bias=False)
        self.k = nn.Linear(g.mem_dim, g.kv_dim, bias=False)
        self.v = nn.Linear(g.mem_dim, g.kv_dim, bias=False)
        self.o = nn.Linear(g.q_dim, d_model, bias=False)
        self.last_routing: Routing | None = None
        self.last_aux: dict[str, Tensor] = {}
        # Global ids of routed chapters the router may not pick (inference-time blocking, the
        # chapters' analogue of blocking a subtree); None: all. Not state: not saved.
        self.blocked: Tensor | None = None
        # The read path (`READS`); the model sets it for every layer (`MemtreeLM.read`). Not state.
        self._read = "fused"
        self.reset_parameters()

    @property
    def read(self) -> str:
        return self._read

    @read.setter
    def read(self, mode: str) -> None:
        if mode not in read_modes(self.cfg.weight_mode):
            raise ValueError(
                f"MoC read {mode!r} is not one of {read_modes(self.cfg.weight_mode)} "
                f"(weight_mode {self.cfg.weight_mode!r})"
            )
        self._read = mode

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for lin in (self.router, self.q, self.k, self.v, self.o):
            nn.init.trunc_normal_(lin.weight, std=std, a=-2 * std, b=2 * std)
        nn.init.zeros_(self.router.bias)
        nn.init.ones_(self.norm.weight)
        if self.cfg.zero_init_out:
            nn.init.zeros_(self.o.weight)

    def route(self, x: Tensor) -> Routing:
        """x (B, S, d) → routing from the fp32 mean over the sequence; records the aux losses."""
        c = self.cfg
        with torch.autocast(x.device.type, enabled=False):
            logits = self.router(x.float().mean(dim=1))  # (B, C)
        if self.blocked is not None:
            if self.training:
                raise RuntimeError(
                    "MoCLayer.blocked is an inference-time experiment; unset it to train"
                )
            ids = self.blocked.tolist()
            if (
                any(i < c.n_shared or i >= c.n_chapters for i in ids)
                or len(set(ids)) > c.n_routed - c.top_k
            ):
                raise ValueError(
                    f"blocked chapters {ids}: only routed chapters (ids {c.n_shared}.."
                    f"{c.n_chapters - 1}) can be blocked, and at most n_routed - top_k = "
                    f"{c.n_routed - c.top_k} of them"
                )
            logits = logits.index_fill(1, self.blocked.to(logits.device), float("-inf"))
        r = route(logits, n_shared=c.n_shared, top_k=c.top_k, routed_scaling=c.routed_scaling)
        self.last_aux = {"load_balance": load_balance_loss(r.probs, r.routed), "z": z_loss(logits)}
        self.last_routing = Routing(*(t.detach() for t in r))
        return r

    def forward(self, x: Tensor, bank: LatentBank) -> Tensor:
        """x (B, S, d) → (B, S, d), the memory read to add to x."""
        g = self.geo
        r = self.route(x)
        chapters, local = torch.unique(r.chapters, return_inverse=True)  # (U,), (B, n_shared + k)
        mem = bank(chapters)  # (U, T, mem_dim)
        if self.cfg.memory_norm:
            mem = F.rms_norm(mem, (mem.shape[-1],), eps=self.cfg.norm_eps)
        bank_k = self.k(mem).unflatten(-1, (g.n_kv_heads, g.head_dim))  # (U, T, H_kv, D)
        bank_v = self.v(mem).unflatten(-1, (g.n_kv_heads, g.head_dim))
        q = (
            self.q(self.norm(x)).unflatten(-1, (g.n_heads, g.head_dim)).transpose(1, 2)
        )  # (B, H, S, D)
        out = _memory_read(
            q, bank_k, bank_v, local, r.weights, self.cfg.weight_mode, self.read
        )  # (B, H, S, D)
        return self.o(out.transpose(1, 2).flatten(2))

    def aux_loss(self) -> Tensor:
        """lb_coef·L_lb + z_coef·L_z of the last forward."""
        if not self.last_aux:
            raise RuntimeError("MoCLayer.aux_loss before any forward")
        return (
            self.cfg.lb_coef * self.last_aux["load_balance"] + self.cfg.z_coef * self.last_aux["z"]
        )


def mean_aux_loss(layers: list[MoCLayer]) -> Tensor:
    """The model's auxiliary loss: the mean over memory layers (so the coefficients do not scale
    with the number of memory layers)."""
    return torch.stack([m.aux_loss() for m in layers]).mean()
