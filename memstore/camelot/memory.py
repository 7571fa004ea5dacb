"""CAMELoT's associative memory (seed 001 §2.1, §2.3, App. A.2) and the caches of its baselines.

A training-free memory for a frozen LM, one per memory-augmented layer.
`training/camelot/longdoc.py` runs the model window by window and hands each layer's keys and values
of the window to that layer's memory; this module owns what the memory holds, how it is searched and
how it changes. It sees keys as given (the hookup passes position-free keys, taken before RoPE) and
knows nothing about models.

`AssociativeMemory` (CAMELoT): per KV head H, M slots, each a key and a value vector (D), a
count c (instances consolidated) and an age τ (windows since the slot was last updated).
- Read (eq. 1): for each token key K_i of the window, the filled slot of highest cosine
  similarity (cosine: App. A.2.2). Its key and value are returned aligned with the token.
- Write (eq. 6–8 and "Novelty and Recency"), applied once per window after the read, with the
  read's μ̂(i) and similarity (the paper's eq. 6–8 reuse eq. 1's μ̂(i)). Per head:
  1. familiar tokens (a filled slot exists and sim > R) are consolidated into μ̂(i):
     K ← (c·K + ΣK_i) / (c + n), same for V, c ← c + n, n the slot's familiar tokens. This is
     eq. 6–8 applied token by token, in any order.
  2. novel tokens, in token order, replace the slots not consolidated into in this window:
     empty slots first (lowest index first), then filled slots by age, oldest first (ties:
     lowest index). The slot becomes (K_i, V_i), c = 1, τ = 0. With more novel tokens than
     such slots the last ones win (recency) and the earlier ones are dropped (counted).
  3. ages: every slot updated in this window → 0; every other filled slot → τ + 1.
  Tokens of one window never consolidate into each other (they are all matched against the
  memory as it was before the window); the paper processes a window at once and is silent here.
- Ablations (App. A.2.1): `consolidation=False` (R = +1: every token is novel);
  `novelty=False` (R = −1: every token is consolidated into its nearest slot; empty slots are
  still filled first, in token order, or the memory would stay at the size of its first window);
  `recency=False` (a novel token replaces a random slot among those step 2 may take, empty ones
  still first); `retrieval=False` (the read returns a random filled slot; the write still uses
  the nearest one). Randomness comes from a CPU generator seeded by (seed, layer) and saved.

Search: `search="exact"` computes all similarities in torch (one (H, L, M) matmul);
`"faiss"` uses one FAISS index per head over the unit-normalised keys of the filled slots,
`IndexFlatIP` (exact) or `IndexIVFFlat` (approximate, `ivf_lists` lists, `ivf_probe` probed;
trained once on the slot keys when the memory is first full, exact flat search until then,
and afterwards updated incrementally for the slots each write changes). A flat index moves to
the GPU when the keys live on CUDA and FAISS was built with GPU support. `"auto"` takes FAISS
from `faiss_min_slots` slots on. Flat FAISS and exact search pick the same slot up to float
rounding ties.

Baselines with the same read/write interface:
- `FifoKNNCache` (Memorizing Transformer, Wu et al. 2022, without its training): the last M
  tokens' keys and values per head in a ring buffer that overwrites the oldest entries; read is
  the same top-1 cosine search; no consolidation. (The original retrieves top-k by query and
  gates the result; top-1 by key keeps the harness identical to CAMELoT's.)
- `PrevWindowCache` (Transformer-XL, Dai et al. 2019, without training): the previous window's
  keys and values, returned whole (no retrieval).

`CamelotMemory` holds one of these per memory-augmented layer and saves / loads them in the
`memtree-camelot` v1 format (memstore/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

from memtree.config import from_dict, is_int, to_dict
from memtree.io import (
    atomic_dir,
    atomic_write_json,
    check_format,
    read_json,
    restore_replaced_dir,
    sha256_file,
)

FORMAT = "memtree-camelot"
VERSION = 1
Kind = Literal["camelot", "memorizing", "xl"]
KINDS: tuple[str, ...] = ("camelot", "memorizing", "xl")
_STATE_FILE = "state.safetensors"


@dataclass(frozen=True, kw_only=True)
class CamelotConfig:
    """One associative memory per layer in `layers` (None: every layer).

    slots: M per layer and KV head (also the Memorizing baseline's capacity, so both hold the
    same number of vectors). threshold: R, the cosine similarity above which a token is
    familiar (App. A.1: 0.93).
    """

    slots: int = 4096
    threshold: float = 0.93
    layers: tuple[int, ...] | None = None
    consolidation: bool = True
    novelty: bool = True
    recency: bool = True
    retrieval: bool = True
    search: Literal["exact", "faiss", "auto"] = "auto"
    faiss_index: Literal["flat", "ivf"] = "flat"
    ivf_lists: int = 0  # 0: round(√slots)
    ivf_probe: int = 8
    faiss_min_slots: int = 16_384
    seed: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.slots) or self.slots <= 0:
            raise ValueError(f"slots must be a positive integer, got {self.slots!r}")
        if (
            isinstance(self.threshold, bool)
            or not isinstance(self.threshold, int | float)
            or not -1.0 <= self.threshold <= 1.0
        ):
            raise ValueError(
                f"threshold (R, a cosine similarity) must lie in [-1, 1], got {self.threshold!r}"
            )
        if self.layers is not None:
            layers = tuple(self.layers)
            if not layers:
                raise ValueError("layers must name at least one layer (None: every layer)")
            bad = [i for i in layers if not is_int(i) or i < 0]
            if bad:
                raise ValueError(f"layers must be non-negative layer indices, got {bad}")
            if len(set(layers)) != len(layers):
                raise ValueError(f"layers has duplicates: {list(layers)}")
            object.__setattr__(self, "layers", tuple(sorted(layers)))
        for name in ("consolidation", "novelty", "recency", "retrieval"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.search not in ("exact", "faiss", "auto"):
            raise ValueError(f"search {self.search!r} is not one of 'exact', 'faiss', 'auto'")
        if self.faiss_index not in ("flat", "ivf"):
            raise ValueError(f"faiss_index {self.faiss_index!r} is not one of 'flat', 'ivf'")
        if not is_int(self.ivf_lists) or self.ivf_lists < 0:
            raise ValueError(f"ivf_lists must be a non-negative integer, got {self.ivf_lists!r}")
        if self.ivf_lists > self.slots:
            raise ValueError(f"ivf_lists={self.ivf_lists} exceeds slots={self.slots}")
        if not is_int(self.ivf_probe) or self.ivf_probe <= 0:
            raise ValueError(f"ivf_probe must be a positive integer, got {self.ivf_probe!r}")
        if not is_int(self.faiss_min_slots) or self.faiss_min_slots <= 0:
            raise ValueError(
                f"faiss_min_slots must be a positive integer, got {self.faiss_min_slots!r}"
            )
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def nlist(self) -> int:
        return self.ivf_lists or max(1, round(math.sqrt(self.slots)))

    @property
    def uses_faiss(self) -> bool:
        return self.search == "faiss" or (
            self.search == "auto" and self.slots >= self.faiss_min_slots
        )


@dataclass(frozen=True)
class Match:
    """The nearest filled slot of each token key: slot (H, L) int64, -1 where the head's memory
    is empty; sim (H, L) float32 cosine similarity, -inf there."""

    slot: Tensor
    sim: Tensor


@dataclass(frozen=True)
class Prefix:
    """Keys / values to prepend to a layer's attention: keys, values (H, P, D); valid (H, P)
    bool (invalid entries must be masked out). aligned: entry p was retrieved for token p of
    the window (P = L), else the entries are past tokens (the XL cache)."""

    keys: Tensor
    values: Tensor
    valid: Tensor
    aligned: bool


def _check_kv(k: Tensor, v: Tensor | None, heads: int, dim: int) -> None:
    if k.ndim != 3:
        raise ValueError(f"keys must be (heads, tokens, head_dim), got shape {tuple(k.shape)}")
    if k.shape[0] != heads:
        raise ValueError(f"keys have {k.shape[0]} heads, the memory has kv_heads={heads}")
    if k.shape[2] != dim:
        raise ValueError(f"keys have dimension {k.shape[2]}, the memory has head_dim={dim}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"values {tuple(v.shape)} and keys {tuple(k.shape)} differ in shape")


def _gather_slots(table: Tensor, slot: Tensor) -> Tensor:
    """table (H, M, D), slot (H, L) with -1 allowed → (H, L, D) (zeros where slot < 0)."""
    idx = slot.clamp(min=0).to(table.device)
    out = torch.gather(table, 1, idx[..., None].expand(-1, -1, table.shape[2]))
    return out.masked_fill((slot < 0).to(table.device)[..., None], 0.0)


def _faiss_gpu_resources():
    import faiss

    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        return None
    global _GPU_RES
    if _GPU_RES is None:
        _GPU_RES = faiss.StandardGpuResources()
    return _GPU_RES


_GPU_RES = None


class _SlotSearch:
    """argmax cosine over a (H, M, D) slot table, exact in torch or through per-head FAISS
    indexes kept in step with the table (`changed` marks slots whose vectors were rewritten)."""

    def __init__(self, cfg: CamelotConfig, heads: int, dim: int) -> None:
        self.cfg, self.heads, self.dim = cfg, heads, dim
        self.faiss = cfg.uses_faiss
        self._stale = torch.ones(heads, cfg.slots, dtype=torch.bool)  # index entries out of date
        self._index: list = [None] * heads
        self._ids: list[np.ndarray | None] = [None] * heads  # flat index position → slot
        self._trained = [False] * heads  # IVF quantizer trained (the index holds ids = slots)
        self._quantizers: list = [None] * heads  # kept alive beside their IVF index

    def changed(self, slots: Tensor | None = None, head: int | None = None) -> None:
        heads = range(self.heads) if head is None else (head,)
        for h in heads:
            if slots is None:
                self._stale[h] = True
            else:
                self._stale[h, slots.cpu()] = True

    def changed_mask(self, mask: Tensor) -> None:
        """mask (H, M) bool: the slots rewritten (all heads at once)."""
        self._stale |= mask.cpu()

    def search(self, keys: Tensor, filled: Tensor, q: Tensor) -> Match:
        """keys (H, M, D), filled (H, M) bool, q (H, L, D) → Match (H, L)."""
        if not self.faiss:
            qn, kn = F.normalize(q.float(), dim=-1), F.normalize(keys.float(), dim=-1)
            sims = qn @ kn.mT  # (H, L, M)
            if not bool(filled.all()):  # a full memory (the usual case) needs no mask pass
                sims.masked_fill_(~filled[:, None, :], float("-inf"))
            sim, slot = sims.max(dim=-1)
            return Match(slot=slot.masked_fill(sim == float("-inf"), -1), sim=sim)
        slots, sims = [], []
        qn = F.normalize(q.float(), dim=-1).cpu().numpy()
        for h in range(self.heads):
            index, ids = self._refresh(h, keys[h], filled[h])
            if index is None:
                sims.append(np.full(q.shape[1], -np.inf, dtype=np.float32))
                slots.append(np.full(q.shape[1], -1, dtype=np.int64))
                continue
            d, i = index.search(np.ascontiguousarray(qn[h]), 1)
            i = i[:, 0]
            if ids is not None:
                i = np.where(i >= 0, ids[np.maximum(i, 0)], -1)
            sims.append(np.where(i >= 0, d[:, 0], -np.inf).astype(np.float32))
            slots.append(i.astype(np.int64))
        return Match(
            slot=torch.from_numpy(np.stack(slots)).to(q.device),
            sim=torch.from_numpy(np.stack(sims)).to(q.device),
        )

    def _refresh(self, h: int, keys: Tensor, filled: Tensor):
        """The head's index, brought up to date; (index or None when empty, flat id map)."""
        import faiss

        stale = self._stale[h]
        if self.cfg.faiss_index == "ivf" and not self._trained[h] and bool(filled.all()):
            x = F.normalize(keys.float(), dim=-1).cpu().numpy()
            quantizer = faiss.IndexFlatIP(self.dim)
            index = faiss.IndexIVFFlat(
                quantizer, self.dim, self.cfg.nlist, faiss.METRIC_INNER_PRODUCT
            )
            index.cp.min_points_per_centroid = 1  # small memories: no under-sampling warning
            index.cp.seed = self.cfg.seed
            index.train(x)
            index.add_with_ids(x, np.arange(self.cfg.slots, dtype=np.int64))
            index.nprobe = min(self.cfg.ivf_probe, self.cfg.nlist)
            self._index[h], self._ids[h], self._trained[h] = index, None, True
            self._quantizers[h] = quantizer
            stale.zero_()
        elif self._trained[h]:
            if bool(stale.any()):
                ids = stale.nonzero().squeeze(1).numpy().astype(np.int64)
                self._index[h].remove_ids(ids)
                keep = ids[filled.cpu().numpy()[ids]]
                x = F.normalize(keys[torch.from_numpy(keep).to(keys.device)].float(), dim=-1)
                self._index[h].add_with_ids(x.cpu().numpy(), keep)
                stale.zero_()
        elif bool(stale.any()) or self._index[h] is None:
            ids = filled.nonzero().squeeze(1)
            if len(ids) == 0:
                self._index[h], self._ids[h] = None, None
            else:
                x = F.normalize(keys[ids].float(), dim=-1).cpu().numpy()
                index = faiss.IndexFlatIP(self.dim)
                res = _faiss_gpu_resources() if keys.is_cuda else None
                if res is not None:
                    index = faiss.index_cpu_to_gpu(res, keys.device.index or 0, index)
                index.add(x)
                self._index[h], self._ids[h] = index, ids.cpu().numpy()
            stale.zero_()
        return self._index[h], self._ids[h]


def _generator(seed: int, layer: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + layer)


class AssociativeMemory:
    """CAMELoT's memory of one layer (module docstring): keys, values (H, M, D) fp32; counts,
    ages (H, M) int64; filled (H, M) bool. Tensors live on `device`."""

    kind = "camelot"

    def __init__(
        self,
        cfg: CamelotConfig,
        *,
        kv_heads: int,
        head_dim: int,
        layer: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        self.cfg, self.heads, self.dim, self.layer = cfg, kv_heads, head_dim, layer
        shape = (kv_heads, cfg.slots)
        self.keys = torch.zeros(*shape, head_dim, device=device)
        self.values = torch.zeros(*shape, head_dim, device=device)
        self.counts = torch.zeros(shape, dtype=torch.int64, device=device)
        self.ages = torch.zeros(shape, dtype=torch.int64, device=device)
        self.filled = torch.zeros(shape, dtype=torch.bool, device=device)
        self.generator = _generator(cfg.seed, layer)
        self.stats = {"consolidated": 0, "novel": 0, "dropped": 0}
        self._search = _SlotSearch(cfg, kv_heads, head_dim)

    def search(self, k: Tensor) -> Match:
        """k (H, L, D) → the nearest filled slot per token and head (eq. 1)."""
        _check_kv(k, None, self.heads, self.dim)
        return self._search.search(self.keys, self.filled, k)

    def read(self, k: Tensor) -> tuple[Prefix | None, Match]:
        """k (H, L, D) → (the slots' keys / values aligned with the tokens, or None while the
        memory is empty; the match `write` needs)."""
        match = self.search(k)
        if not bool(self.filled.any()):
            return None, match
        slot = match.slot if self.cfg.retrieval else self._random_filled(k.shape[1])
        return Prefix(
            keys=_gather_slots(self.keys, slot),
            values=_gather_slots(self.values, slot),
            valid=(slot >= 0).to(self.keys.device),
            aligned=True,
        ), match

    def _random_filled(self, n: int) -> Tensor:
        """(H, n) a uniformly random filled slot per token (-1 for an empty head)."""
        out = torch.full((self.heads, n), -1, dtype=torch.int64)
        for h in range(self.heads):
            ids = self.filled[h].nonzero().squeeze(1).cpu()
            if len(ids):
                out[h] = ids[torch.randint(len(ids), (n,), generator=self.generator)]
        return out.to(self.keys.device)

    @torch.no_grad()
    def write(self, k: Tensor, v: Tensor, match: Match | None = None) -> None:
        """Consolidate / replace with the window's keys and values k, v (H, L, D); `match` is
        the read's (recomputed when None).

        All heads at once: a head's slots are rows h·M … h·M + M − 1 of the flattened (H·M, D)
        tables, so each step below is one tensor op over every head and token instead of a
        Python loop per head. Each slot's arithmetic is the per-head rule's, term for term and
        in the same order (consolidation sums its tokens in token order), so results are
        bit-identical to applying the rules head by head."""
        _check_kv(k, v, self.heads, self.dim)
        if match is None:
            match = self.search(k)
        k, v = k.to(self.keys), v.to(self.values)
        cfg, (n_heads, n_tok), m, dev = self.cfg, k.shape[:2], self.cfg.slots, k.device
        slot, sim = match.slot.to(dev), match.sim.to(dev)
        filled = self.filled.clone()  # as before the window
        has = slot >= 0
        order = torch.arange(n_tok, device=dev)
        if not cfg.consolidation:
            novel = torch.ones(n_heads, n_tok, dtype=torch.bool, device=dev)
        elif cfg.novelty:
            novel = ~(has & (sim > cfg.threshold))
        else:  # empty slots go first, in token order; the rest join their nearest slot
            novel = order[None] < (~filled).sum(1, keepdim=True)
            novel |= ~has
        familiar = ~novel
        base = torch.arange(n_heads, device=dev)[:, None] * m  # head h's first flat slot
        keys, values = self.keys.view(-1, self.dim), self.values.view(-1, self.dim)
        counts, touched = (
            self.counts.view(-1),
            torch.zeros(n_heads * m, dtype=torch.bool, device=dev),
        )
        n_fam = int(familiar.sum())
        if n_fam:  # eq. 6–8 for every familiar token at once, only the slots they reach
            tgt = (slot + base)[familiar]  # head-major, token order within a head
            upd, inv = torch.unique(tgt, return_inverse=True)
            n = torch.bincount(inv, minlength=len(upd))
            c = counts[upd].float()
            denom = (c + n.float()).clamp(min=1)[:, None]
            for table, x in ((keys, k), (values, v)):
                total = table.new_zeros(len(upd), self.dim).index_add_(0, inv, x[familiar])
                table[upd] = (c[:, None] * table[upd] + total) / denom
            counts[upd] += n
            touched[upd] = True
            self.stats["consolidated"] += n_fam
        n_new = novel.sum(1)  # per head
        if bool(n_new.any()):
            cand, n_cand = self._candidates(filled, touched.view(n_heads, m), n_new)
            n_take = torch.minimum(n_new, n_cand)
            self.stats["dropped"] += int((n_new - n_take).sum())
            # the most recent tokens win: a head's r-th novel token (0-based) takes candidate
            # r − (n_new − n_take) when that is ≥ 0, else it is dropped
            pos = novel.cumsum(1) - 1 - (n_new - n_take)[:, None]
            take = novel & (pos >= 0)
            h_idx, t_idx = take.nonzero(as_tuple=True)
            dst = cand[h_idx, pos[h_idx, t_idx]] + h_idx * m
            src = h_idx * n_tok + t_idx
            keys[dst] = k.reshape(-1, self.dim)[src]
            values[dst] = v.reshape(-1, self.dim)[src]
            counts[dst] = 1
            self.filled.view(-1)[dst] = True
            touched[dst] = True
            self.stats["novel"] += len(dst)
        touched = touched.view(n_heads, m)
        self.ages.copy_(torch.where(touched, 0, self.ages + self.filled.long()))
        self._search.changed_mask(touched)

    def _candidates(self, filled: Tensor, touched: Tensor, n_new: Tensor) -> tuple[Tensor, Tensor]:
        """Slots a novel token may replace, per head in the order they are taken: empty first
        (by index), then filled and not updated this window, oldest first (or random). →
        (cand (H, K) slot indices, the first n_cand[h] of row h valid; n_cand (H,)), K enough
        for min(n_new, n_cand) per head."""
        free = ~touched
        n_cand = free.sum(1)
        need = int(torch.minimum(n_new, n_cand).max())
        if self.cfg.recency:
            # one ascending key per slot, unique, that orders a head's candidates as the rule
            # does: empty (by index) < filled by age descending (ties by index) < touched
            m = self.cfg.slots
            idx = torch.arange(m, device=filled.device)
            key = torch.where(filled, -self.ages * m + idx, idx - (1 << 62))
            key = key.masked_fill(touched, 1 << 62)
            cand = torch.topk(key, need, dim=1, largest=False, sorted=True).indices
            return cand, n_cand
        # random replacement: one randperm per head with novel tokens, in head order, so the
        # generator is drawn exactly as the per-head rule draws it
        cand = torch.zeros(self.heads, need, dtype=torch.int64, device=filled.device)
        for h in range(self.heads):
            if int(n_new[h]) == 0:
                continue
            empty = (free[h] & ~filled[h]).nonzero().squeeze(1)
            old = (free[h] & filled[h]).nonzero().squeeze(1)
            old = old[torch.randperm(len(old), generator=self.generator).to(old.device)]
            row = torch.cat([empty, old])[:need]
            cand[h, : len(row)] = row
        return cand, n_cand

    def state(self) -> dict[str, Tensor]:
        return {
            "keys": self.keys,
            "values": self.values,
            "counts": self.counts,
            "ages": self.ages,
            "filled": self.filled,
            "rng": self.generator.get_state(),
        }

    def load_state(self, state: dict[str, Tensor]) -> None:
        for name in ("keys", "values", "counts", "ages", "filled"):
            getattr(self, name).copy_(state[name])
        self.generator.set_state(state["rng"])
        self._search.changed()


class FifoKNNCache:
    """Memorizing-Transformer-style memory of one layer: keys, values (H, M, D) of the last M
    tokens in a ring buffer (slot `cursor` is overwritten next; `size` are filled)."""

    kind = "memorizing"

    def __init__(
        self,
        cfg: CamelotConfig,
        *,
        kv_heads: int,
        head_dim: int,
        layer: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        self.cfg, self.heads, self.dim, self.layer = cfg, kv_heads, head_dim, layer
        self.keys = torch.zeros(kv_heads, cfg.slots, head_dim, device=device)
        self.values = torch.zeros(kv_heads, cfg.slots, head_dim, device=device)
        self.cursor = 0
        self.size = 0
        self.stats = {"written": 0, "overwritten": 0}
        self._search = _SlotSearch(cfg, kv_heads, head_dim)

    @property
    def filled(self) -> Tensor:
        m = torch.arange(self.cfg.slots, device=self.keys.device) < self.size
        return m.expand(self.heads, -1)

    def search(self, k: Tensor) -> Match:
        _check_kv(k, None, self.heads, self.dim)
        return self._search.search(self.keys, self.filled, k)

    def read(self, k: Tensor) -> tuple[Prefix | None, Match | None]:
        if self.size == 0:
            _check_kv(k, None, self.heads, self.dim)
            return None, None
        match = self.search(k)
        return Prefix(
            keys=_gather_slots(self.keys, match.slot),
            values=_gather_slots(self.values, match.slot),
            valid=(match.slot >= 0).to(self.keys.device),
            aligned=True,
        ), match

    @torch.no_grad()
    def write(self, k: Tensor, v: Tensor, match: Match | None = None) -> None:
        """Append the window's k, v (H, L, D), overwriting the oldest entries when full."""
        _check_kv(k, v, self.heads, self.dim)
        m, n = self.cfg.slots, k.shape[1]
        if n > m:  # only the last M tokens survive the window anyway
            k, v, n = k[:, n - m :], v[:, n - m :], m
        pos = (self.cursor + torch.arange(n)) % m
        dev_pos = pos.to(self.keys.device)
        self.keys[:, dev_pos], self.values[:, dev_pos] = k.to(self.keys), v.to(self.values)
        self.stats["overwritten"] += max(0, self.size + n - m)
        self.stats["written"] += n
        self.cursor, self.size = (self.cursor + n) % m, min(m, self.size + n)
        self._search.changed(pos)

    def state(self) -> dict[str, Tensor]:
        return {
            "keys": self.keys,
            "values": self.values,
            "ring": torch.tensor([self.cursor, self.size], dtype=torch.int64),
        }

    def load_state(self, state: dict[str, Tensor]) -> None:
        self.keys.copy_(state["keys"])
        self.values.copy_(state["values"])
        self.cursor, self.size = (int(x) for x in state["ring"])
        if not (0 <= self.cursor < self.cfg.slots and 0 <= self.size <= self.cfg.slots):
            raise ValueError(
                f"layer {self.layer}: ring cursor/size {self.cursor}/{self.size} "
                f"out of range for slots={self.cfg.slots}"
            )
        self._search.changed()


class PrevWindowCache:
    """Transformer-XL-style memory of one layer: the previous window's keys and values
    (H, P, D), kept as given (the model's dtype); None before the first write."""

    kind = "xl"

    def __init__(
        self,
        cfg: CamelotConfig,
        *,
        kv_heads: int,
        head_dim: int,
        layer: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        self.cfg, self.heads, self.dim, self.layer = cfg, kv_heads, head_dim, layer
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.stats = {"written": 0}

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def read(self, k: Tensor) -> tuple[Prefix | None, None]:
        _check_kv(k, None, self.heads, self.dim)
        if self.keys is None:
            return None, None
        valid = torch.ones(self.keys.shape[:2], dtype=torch.bool, device=self.keys.device)
        return Prefix(keys=self.keys, values=self.values, valid=valid, aligned=False), None

    @torch.no_grad()
    def write(self, k: Tensor, v: Tensor, match: Match | None = None) -> None:
        _check_kv(k, v, self.heads, self.dim)
        self.keys, self.values = k.detach().clone(), v.detach().clone()
        self.stats["written"] += k.shape[1]

    def state(self) -> dict[str, Tensor]:
        return {} if self.keys is None else {"keys": self.keys, "values": self.values}

    def load_state(self, state: dict[str, Tensor]) -> None:
        if "keys" in state:
            self.keys, self.values = state["keys"].clone(), state["values"].clone()
            _check_kv(self.keys, self.values, self.heads, self.dim)


_LAYER_CLASSES = {"camelot": AssociativeMemory, "memorizing": FifoKNNCache, "xl": PrevWindowCache}
LayerMemory = AssociativeMemory | FifoKNNCache | PrevWindowCache


class CamelotMemory:
    """The memories of one model: kind ("camelot" | "memorizing" | "xl"), one layer memory per
    index in cfg.layers (None: all n_layers), each with kv_heads heads of head_dim."""

    def __init__(
        self,
        cfg: CamelotConfig,
        *,
        kind: Kind,
        n_layers: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device | str | None = None,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {list(KINDS)}")
        for name, val in (("n_layers", n_layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        layers = cfg.layers if cfg.layers is not None else tuple(range(n_layers))
        bad = [i for i in layers if i >= n_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range: the model has n_layers={n_layers}")
        self.cfg, self.kind = cfg, kind
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.windows = 0  # windows written so far
        cls = _LAYER_CLASSES[kind]
        self.layers: dict[int, LayerMemory] = {
            i: cls(cfg, kv_heads=kv_heads, head_dim=head_dim, layer=i, device=device)
            for i in layers
        }

    def check_model(self, *, n_layers: int, kv_heads: int, head_dim: int) -> None:
        """Raise naming the first field in which the memory and the model disagree."""
        for name, mine, theirs in (
            ("n_layers", self.n_layers, n_layers),
            ("kv_heads", self.kv_heads, kv_heads),
            ("head_dim", self.head_dim, head_dim),
        ):
            if mine != theirs:
                raise ValueError(f"memory {name}={mine} does not match the model's {name}={theirs}")

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {"windows": self.windows}
        for mem in self.layers.values():
            for k, v in mem.stats.items():
                out[k] = out.get(k, 0) + v
        return out

    # -- on disk ----------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the memory as a `memtree-camelot` v1 directory (atomically replaced)."""
        path = Path(path)
        tensors = {
            f"{i}.{name}": t.detach().contiguous().cpu()
            for i, mem in self.layers.items()
            for name, t in mem.state().items()
        }
        with atomic_dir(path) as tmp:
            save_file(tensors, str(tmp / _STATE_FILE))
            atomic_write_json(
                tmp / "manifest.json",
                {
                    "format": FORMAT,
                    "version": VERSION,
                    "kind": self.kind,
                    "config": to_dict(self.cfg),
                    "n_layers": self.n_layers,
                    "kv_heads": self.kv_heads,
                    "head_dim": self.head_dim,
                    "layers": sorted(self.layers),
                    "windows": self.windows,
                    "stats": {str(i): m.stats for i, m in self.layers.items()},
                    "state": {"file": _STATE_FILE, "sha256": sha256_file(tmp / _STATE_FILE)},
                },
            )
        return path

    @classmethod
    def load(cls, path: str | Path, *, device: torch.device | str | None = None) -> CamelotMemory:
        path = Path(path)
        restore_replaced_dir(path)
        if not (path / "manifest.json").is_file():
            raise FileNotFoundError(f"{path}: no manifest.json (not a {FORMAT} directory)")
        man = read_json(path / "manifest.json")
        check_format(man, FORMAT, VERSION, path)
        cfg = from_dict(CamelotConfig, man["config"], where="config")
        mem = cls(
            cfg,
            kind=man["kind"],
            n_layers=man["n_layers"],
            kv_heads=man["kv_heads"],
            head_dim=man["head_dim"],
            device=device,
        )
        if sorted(mem.layers) != man["layers"]:
            raise ValueError(
                f"{path}: layers {man['layers']} disagree with the config's {sorted(mem.layers)}"
            )
        state_path = path / man["state"]["file"]
        if sha256_file(state_path) != man["state"]["sha256"]:
            raise ValueError(
                f"{state_path}: sha256 does not match the manifest (corrupt or edited)"
            )
        tensors = load_file(str(state_path), device=str(device) if device is not None else "cpu")
        for i, layer in mem.layers.items():
            state = {
                k.split(".", 1)[1]: t for k, t in tensors.items() if k.split(".", 1)[0] == str(i)
            }
            for name, t in layer.state().items():
                if name not in state:
                    raise ValueError(f"{state_path}: layer {i} lacks tensor {name!r}")
                if tuple(state[name].shape) != tuple(t.shape) or state[name].dtype != t.dtype:
                    got = f"{tuple(state[name].shape)} {state[name].dtype}"
                    raise ValueError(
                        f"{state_path}: layer {i} {name} is {got}, "
                        f"expected {tuple(t.shape)} {t.dtype}"
                    )
            if "rng" in state:  # torch.Generator states live on the CPU
                state["rng"] = state["rng"].cpu()
            layer.load_state(state)
            layer.stats.update(man["stats"][str(i)])
        mem.windows = int(man["windows"])
        return mem
