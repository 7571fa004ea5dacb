"""Product-key memory layers and sparse memory finetuning (seed 003 §3–§4; Lample et al. 2019).

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

Sparse memory finetuning (003 §4). `access_counts` counts, per slot, how many times a batch read
it (padding positions masked out). Background document frequencies (`BackgroundCounts`: in how
many of |B| background batches each slot was read at least once) are collected once over
pretraining data and stored with the checkpoint. Per finetuning batch, slot i scores

    tfidf(i) = c(i) / Σ_j c(j) · log((|B| + 1) / (df(i) + 1))

and only the top-t accessed slots by that score receive gradient (`trainable_rows`): the forward
still reads every accessed slot (`ProductKeyMemory.forward(..., trainable=mask)` passes the
others' values with their gradient stopped: the seed's `mem·m + mem.detach() − (mem·m).detach()`,
applied to the rows read so the gradient stays sparse).

The model option is `ModelConfig.pkm` (training/model.py: the layer replaces the FFN of the
chosen blocks) and `model.pkm` in the trainer's YAML (training/yamls/tiny-pkm.yaml); the values'
sparse gradients go through MemoryAdamW's lazy rows like the bank's. `memtree finetune`
(training/finetune.py) streams new data through it; `memtree eval-continual` (eval/continual.py)
measures learning and forgetting.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from memtree.config import is_int
from memtree.io import read_checked_tensors, write_checked_tensors
from training.data import real_positions

BACKGROUND_FORMAT = "memtree-pkm-background"
BACKGROUND_VERSION = 1


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
            raise ValueError(f"value_dim must be an integer >= 0 (0: d_model), got {self.value_dim!r}")

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
        return (d_model * self.heads * self.key_dim + self.heads * self.n_keys * self.key_dim
                + self.n_slots * vd + 2 * d_model * vd)

    def flops(self, d_model: int, tokens: int) -> int:
        """Forward FLOPs of one memory layer over `tokens` tokens (2 per multiply-add): query
        projection, 2·n_keys sub-key scores per head, k² candidate sums, the k-value weighted sum
        per head, gate and output projections. Top-k selections and the softmax are not counted."""
        vd = self.value_dim or d_model
        h, kd, k = self.heads, self.key_dim, self.k
        per_token = (2 * d_model * h * kd + 2 * h * self.n_keys * kd + h * k * k + 2 * h * k * vd
                     + 2 * 2 * d_model * vd + vd)
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
        nn.init.normal_(self.values.weight, std=self.value_dim ** -0.5)

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
        return Lookup(indices=slots, weights=torch.softmax(best.float(), -1).to(best.dtype), scores=best)

    def exhaustive_lookup(self, x: Tensor) -> Lookup:
        """The same top-k over all N slots' full keys [C¹_i; C²_j] (a test reference: O(N))."""
        c, kd = self.cfg, self.cfg.key_dim
        q = self._queries(x)
        n = c.n_keys
        full = torch.cat([self.sub_keys[:, 0][:, :, None, :].expand(-1, n, n, -1),
                          self.sub_keys[:, 1][:, None, :, :].expand(-1, n, n, -1)], -1)  # (H, n, n, kd)
        scores = torch.einsum("...hd,hsd->...hs", q, full.reshape(c.heads, n * n, kd))  # (…, H, N)
        best, slots = scores.topk(c.k, dim=-1)
        return Lookup(indices=slots, weights=torch.softmax(best.float(), -1).to(best.dtype), scores=best)

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


# -- sparse memory finetuning ----------------------------------------------------------------------

def access_counts(indices: Tensor, n_slots: int, mask: Tensor | None = None) -> Tensor:
    """How many times each slot was read: indices (B, S, H, k) from `lookup`, mask (B, S) True for
    real tokens (padding is not counted) → (n_slots,) int64."""
    idx = indices if mask is None else indices[mask.bool()]
    return torch.bincount(idx.flatten(), minlength=n_slots)


def tfidf(counts: Tensor, doc_freq: Tensor, n_batches: int) -> Tensor:
    """003 §4: c(i) / Σ_j c(j) · log((|B| + 1) / (df(i) + 1)) per slot, (N,) float64."""
    if counts.shape != doc_freq.shape:
        raise ValueError(f"counts {tuple(counts.shape)} and background doc_freq {tuple(doc_freq.shape)} "
                         "differ: the background was collected on another memory size")
    c = counts.double()
    tf = c / c.sum().clamp(min=1)
    return tf * torch.log((n_batches + 1) / (doc_freq.double() + 1))


def trainable_rows(counts: Tensor, doc_freq: Tensor, n_batches: int, top_t: int) -> Tensor:
    """(N,) bool: the top_t accessed slots by TF-IDF (ties: the lower slot). A top_t above the
    number of slots this batch accessed is an error naming both."""
    accessed = int((counts > 0).sum())
    if not is_int(top_t) or top_t <= 0:
        raise ValueError(f"top_t must be a positive integer, got {top_t!r}")
    if top_t > accessed:
        raise ValueError(f"top_t={top_t} exceeds the {accessed} slots this batch accessed")
    score = tfidf(counts, doc_freq, n_batches).masked_fill(counts == 0, float("-inf"))
    order = torch.sort(-score, stable=True).indices[:top_t]
    keep = torch.zeros_like(counts, dtype=torch.bool)
    keep[order] = True
    return keep


def keep_rows(grad: Tensor, keep: Tensor) -> Tensor:
    """A values table's sparse gradient (N, vd) restricted to the rows where keep (N,) is True:
    the same update as reading the other rows as constants (`forward(trainable=keep)`), from one
    forward, after the batch's accesses are known."""
    g = grad.coalesce()
    sel = keep[g.indices()[0]]
    return torch.sparse_coo_tensor(g.indices()[:, sel], g.values()[sel], g.shape).coalesce()


@contextmanager
def recording(model: nn.Module) -> Iterator[dict[int, list[Tensor]]]:
    """While open, every forward of the model's memory layers records its slots: yields
    {block index: [indices (…, H, k) per forward]}."""
    layers = {i: b.pkm for i, b in enumerate(model.blocks) if getattr(b, "pkm", None) is not None}
    if not layers:
        raise ValueError("the model has no product-key memory layer (model.pkm)")
    logs: dict[int, list[Tensor]] = {i: [] for i in layers}
    for i, m in layers.items():
        m.recorder = logs[i]
    try:
        yield logs
    finally:
        for m in layers.values():
            m.recorder = None


@torch.no_grad()
def collect_background(model: nn.Module, batches: Iterable[dict[str, Tensor]], n_batches: int,
                       *, progress: bool = True) -> dict[int, BackgroundCounts]:
    """Document frequencies of every memory layer's slots over n_batches pretraining batches
    (dicts with `input_ids` (B, S) and `labels` (B, S), -100 on padding: padded positions are
    not counted). Fewer batches than asked: an error naming both."""
    if not is_int(n_batches) or n_batches <= 0:
        raise ValueError(f"background batches must be a positive integer, got {n_batches!r}")
    model.eval()
    out: dict[int, BackgroundCounts] = {}
    done = 0
    with recording(model) as logs, tqdm(total=n_batches, desc="background counts", disable=not progress) as bar:
        for batch in batches:
            ids = batch["input_ids"]
            real = real_positions(batch["labels"]) if "labels" in batch else torch.ones_like(ids, dtype=torch.bool)
            model(ids, segment_ids=batch.get("segment_ids"))
            for i, log in logs.items():
                n_slots = model.blocks[i].pkm.cfg.n_slots
                out.setdefault(i, BackgroundCounts.empty(n_slots)).add_batch(access_counts(log[-1], n_slots, real),
                                                                              tokens=int(real.sum()))
                log.clear()
            done += 1
            bar.update()
            if done == n_batches:
                break
    if done < n_batches:
        raise ValueError(f"background counts asked for {n_batches} batches, the data gave {done}")
    return out


BACKGROUND_DIR = "pkm_background"  # in a run folder: one layer_{i}/ per memory layer


def background_dir(run: str | Path, layer: int) -> Path:
    """Where a run folder keeps the background counts of its memory layer `layer`."""
    return Path(run) / BACKGROUND_DIR / f"layer_{layer}"


@dataclass
class BackgroundCounts:
    """In how many background batches each slot was read at least once (df, (N,) int64), out of
    n_batches: the IDF side of the TF-IDF, collected once over pretraining data. tokens: the real
    tokens those batches held (IDF separates slots only when a background batch is about as large
    as a finetuning batch: with far larger ones every common slot is in every batch); source: what
    they were collected over."""

    doc_freq: Tensor
    n_batches: int = 0
    tokens: int = 0
    source: str = ""

    @classmethod
    def empty(cls, n_slots: int) -> BackgroundCounts:
        return cls(doc_freq=torch.zeros(n_slots, dtype=torch.int64))

    def add_batch(self, counts: Tensor, tokens: int = 0) -> None:
        if counts.shape != self.doc_freq.shape:
            raise ValueError(f"batch counts have {counts.numel()} slots, the background {self.doc_freq.numel()}")
        self.doc_freq += (counts > 0).to(torch.int64)
        self.n_batches += 1
        self.tokens += int(tokens)

    def save(self, folder: str | Path) -> Path:
        """background_counts.safetensors + background_counts.json (format memtree-pkm-background v1)."""
        return write_checked_tensors(folder, "background_counts", {"doc_freq": self.doc_freq}, {
            "format": BACKGROUND_FORMAT, "version": BACKGROUND_VERSION, "n_batches": self.n_batches,
            "tokens": self.tokens, "source": self.source, "n_slots": int(self.doc_freq.numel())})

    @classmethod
    def load(cls, folder: str | Path, *, n_slots: int | None = None) -> BackgroundCounts:
        """Read them back; a missing file, another format / version, a checksum mismatch or (with
        n_slots) another memory size: an error naming the value."""
        t, man = read_checked_tensors(folder, "background_counts", fmt=BACKGROUND_FORMAT, version=BACKGROUND_VERSION,
                                      missing="no background counts (background_counts.json); collect them over "
                                              "pretraining batches before sparse memory finetuning")
        if n_slots is not None and man["n_slots"] != n_slots:
            raise ValueError(f"{folder}: background counts cover n_slots={man['n_slots']}, the memory has "
                             f"n_slots={n_slots}")
        return cls(doc_freq=t["doc_freq"], n_batches=int(man["n_batches"]), tokens=int(man.get("tokens", 0)),
                   source=man.get("source", ""))
