"""Product-key memory layers (seed 003 §3; Lample et al. 2019).

Memory layer (003 §3, Berges et al. 2024). Per token x (d) and head h:

    q_h = W_q,h x                            (key_dim), split into halves q¹, q² (key_dim / 2 each)
    s¹ = C¹_h q¹, s² = C²_h q²               (n_keys each): sub-key scores of the two halves
    I  = top-k over (i, j) of s¹_i + s²_j    slot i·n_keys + j, among top-k(s¹) × top-k(s²) only
    w  = softmax over I of those scores
    y  = Σ_h Σ_{i∈I} w_i V_i                 (value_dim); V: N = n_keys² slots shared by the heads
    out = W_2 (y ⊙ silu(W_1 x))              (d)

The full key of slot (i, j) is the concatenation [C¹_i; C²_j], so its score is s¹_i + s²_j and
the top-k of all N = n_keys² scores lies inside top-k(s¹) × top-k(s²) (Lample et al.): the lookup
scores 2·n_keys sub-keys and k² candidates per token and head, O(√N), never all N slots.
`exhaustive_lookup` scores every slot; the tests check both give the same slots and weights.
Values are read with `F.embedding(sparse=True)`: a step's gradient is a sparse tensor over the
rows read. Queries are RMS-normalised per head (a stable scale for the sub-key scores).

Sparse memory finetuning of these layers (which slots a batch may update) is a training system of
its own: training/finetune/slots.py.

The model option is `ModelConfig.pkm` (training/model.py: the layer replaces the FFN of the
chosen blocks) and `model.pkm` in the trainer's YAML (training/yamls/tiny-pkm.yaml); the values'
sparse gradients go through MemoryAdamW's lazy rows like the bank's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memtree.config import is_int


@dataclass(frozen=True, kw_only=True)
class PKMConfig:
    """n_keys: sub-keys per half (N = n_keys² slots); heads: memory heads (own query and sub-keys,
    shared values); k: slots read per token and head; key_dim: query width per head (even);
    value_dim: value width (0: d_model); layers: the blocks whose FFN it replaces (empty: the middle
    block, n_layers // 2, as the seed does)."""

    n_keys: int = 128
    heads: int = 4
    k: int = 32
    key_dim: int = 64
    value_dim: int = 0
    layers: tuple[int, ...] = ()  # blocks whose FFN the memory replaces; empty: the middle block

    def __post_init__(self) -> None:
        for name in ("n_keys", "heads", "k", "key_dim"):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.key_dim % 2:
            raise ValueError(f"key_dim must be even (two product-key halves), got {self.key_dim}")
        if self.k > self.n_keys:
            raise ValueError(f"k={self.k} exceeds n_keys={self.n_keys} (top-k per half)")
        if not is_int(self.value_dim) or self.value_dim < 0:
            raise ValueError(
                f"value_dim must be an integer >= 0 (0: d_model), got {self.value_dim!r}"
            )

    @property
    def n_slots(self) -> int:
        return self.n_keys * self.n_keys

    def resolved_layers(self, n_layers: int) -> tuple[int, ...]:
        """The blocks it replaces the FFN of; an index outside the model: an error naming it."""
        layers = self.layers or (n_layers // 2,)
        bad = [i for i in layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"pkm.layers {bad} out of range: the anchor has n_layers={n_layers}")
        return tuple(sorted(set(layers)))

    def params(self, d_model: int) -> int:
        """Parameters of one memory layer: query, sub-keys, values, gate W_1 and output W_2."""
        vd = self.value_dim or d_model
        return (
            d_model * self.heads * self.key_dim
            + self.heads * self.n_keys * self.key_dim
            + self.n_slots * vd
            + 2 * d_model * vd
        )

    def flops(self, d_model: int, tokens: int) -> int:
        """Forward FLOPs of one memory layer over `tokens` tokens (2 per multiply-add): query
        projection, 2·n_keys sub-key scores per head, k² candidate sums, the k-value weighted sum
        per head, gate and output projections. Top-k selections and the softmax are not counted."""
        vd = self.value_dim or d_model
        h, kd, k = self.heads, self.key_dim, self.k
        per_token = (
            2 * d_model * h * kd
            + 2 * h * self.n_keys * kd
            + h * k * k
            + 2 * h * k * vd
            + 2 * 2 * d_model * vd
            + vd
        )
        return tokens * per_token


class Lookup(NamedTuple):
    """indices (…, H, k) int64 slots read, best first; weights (…, H, k) their softmax weights;
    scores (…, H, k) their raw scores."""

    indices: Tensor
    weights: Tensor
    scores: Tensor


class ProductKeyMemory(nn.Module):
    """The memory layer that replaces an FFN (module docstring): x (…, d) → (…, d)."""

    def __init__(self, cfg: PKMConfig, d_model: int) -> None:
        super().__init__()
        self.cfg = cfg
        h, kd = cfg.heads, cfg.key_dim
        self.value_dim = vd = cfg.value_dim or d_model
        self.query = nn.Linear(d_model, h * kd, bias=False)
        self.sub_keys = nn.Parameter(torch.empty(h, 2, cfg.n_keys, kd // 2))
        self.values = nn.Embedding(cfg.n_slots, vd, sparse=True)
        self.w1 = nn.Linear(d_model, vd, bias=False)
        self.w2 = nn.Linear(vd, d_model, bias=False)
        # When a list, every forward appends its slots (…, H, k): how finetuning counts a batch's
        # accesses from the very forward it trains on (a plain attribute, not state).
        self.recorder: list[Tensor] | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Sub-keys and values at unit-scale scores and outputs (Lample et al.'s init); the
        projections are left to the model's own init."""
        kd = self.cfg.key_dim
        nn.init.normal_(self.sub_keys, std=(kd // 2) ** -0.5)
        nn.init.normal_(self.values.weight, std=self.value_dim**-0.5)

    def _queries(self, x: Tensor) -> Tensor:
        q = self.query(x).unflatten(-1, (self.cfg.heads, self.cfg.key_dim))  # (…, H, kd)
        return F.rms_norm(q, (self.cfg.key_dim,))

    def lookup(self, x: Tensor) -> Lookup:
        """x (…, d) → the top-k slots per head by product keys (…, H, k)."""
        c, kd = self.cfg, self.cfg.key_dim
        q = self._queries(x)
        q1, q2 = q[..., : kd // 2], q[..., kd // 2 :]  # (…, H, kd/2)
        s1 = torch.einsum("...hd,hnd->...hn", q1, self.sub_keys[:, 0])  # (…, H, n_keys)
        s2 = torch.einsum("...hd,hnd->...hn", q2, self.sub_keys[:, 1])
        v1, i1 = s1.topk(c.k, dim=-1)  # (…, H, k)
        v2, i2 = s2.topk(c.k, dim=-1)
        cand = (v1[..., :, None] + v2[..., None, :]).flatten(-2)  # (…, H, k²)
        idx = (i1[..., :, None] * c.n_keys + i2[..., None, :]).flatten(-2)
        best, pos = cand.topk(c.k, dim=-1)  # (…, H, k)
        slots = idx.gather(-1, pos)
        return Lookup(
            indices=slots, weights=torch.softmax(best.float(), -1).to(best.dtype), scores=best
        )

    def exhaustive_lookup(self, x: Tensor) -> Lookup:
        """The same top-k over all N slots' full keys [C¹_i; C²_j] (a test reference: O(N))."""
        c, kd = self.cfg, self.cfg.key_dim
        q = self._queries(x)
        n = c.n_keys
        full = torch.cat(
            [
                self.sub_keys[:, 0][:, :, None, :].expand(-1, n, n, -1),
                self.sub_keys[:, 1][:, None, :, :].expand(-1, n, n, -1),
            ],
            -1,
        )  # (H, n, n, kd)
        scores = torch.einsum("...hd,hsd->...hs", q, full.reshape(c.heads, n * n, kd))  # (…, H, N)
        best, slots = scores.topk(c.k, dim=-1)
        return Lookup(
            indices=slots, weights=torch.softmax(best.float(), -1).to(best.dtype), scores=best
        )

    def forward(self, x: Tensor, *, trainable: Tensor | None = None) -> Tensor:
        """x (…, d) → (…, d). trainable: (N,) bool, the slots whose values may receive gradient
        (sparse memory finetuning); the others are read as constants. None: all of them."""
        look = self.lookup(x)
        if self.recorder is not None:
            self.recorder.append(look.indices.detach())
        rows = F.embedding(look.indices, self.values.weight, sparse=True)  # (…, H, k, vd)
        if trainable is not None:
            m = trainable[look.indices].to(rows.dtype)[..., None]  # (…, H, k, 1)
            rows = rows * m + rows.detach() * (1 - m)  # same values; gradient only through m = 1
        y = (look.weights[..., None] * rows).sum(dim=(-3, -2))  # (…, vd)
        return self.w2(y * F.silu(self.w1(x)))
