"""TF-IDF updates of hierarchical memory blocks: seed 003's slot selection applied to memtree's
bank.

When new documents arrive, each is routed by the clustering tree (its own text, as pretraining
routed its windows) and fetches one block per memory level. For FFN memories a block's "slots"
are its hidden units: unit j of layer ℓ is row j of w1 and w2 and column j of w3 (one row of each
stored (W, d) tensor). A unit is *used* at a token when its |activation| is among the top
`unit_frac` of its block's units in that layer (the analogue of a memory layer's top-k read).
Background: in how many pretraining windows routed to that block each of its units was used
(`UnitBackground`, collected once over the run's shards, one window per batch, and stored with
the run: format `memtree-block-background` v1). Per finetuning batch the units used are counted
per (level, cluster, layer, unit), ranked by 003's TF-IDF against the background of their own
block, and only the top_t receive gradient; the forward still reads whole blocks.

Methods (`BlockFinetuneSpec.method`), all in one harness:
  tfidf         the top_t units by TF-IDF across the batch's fetched blocks (SGD);
  all_fetched   every unit of every fetched block (SGD);
  anchor        the anchor's parameters, blocks read as they are (AdamW, weight decay 0.1).
Updated blocks are kept in memory during the stream and written through memstore's edit path at
the end (`write_edits`), which reports the records rewritten and the bytes that changed: the
on-device cost of the update.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from memtree.config import ConfigError, is_int
from memtree.geometry import TensorSpec, block_layout, join_block, layer_widths
from memtree.io import read_checked_tensors, write_checked_tensors
from memtree.memstore.store import MemoryStore
from memtree.training.data import build_dataloader, real_positions
from memtree.training.model import AnchorLM, assemble_memories
from memtree.training.optim import MemoryAdamW

BACKGROUND_FORMAT = "memtree-block-background"
BACKGROUND_VERSION = 1
METHODS = ("tfidf", "all_fetched", "anchor")


@dataclass(frozen=True, kw_only=True)
class BlockFinetuneSpec:
    """method: tfidf | all_fetched | anchor; lr; top_t: units trained per batch (tfidf);
    unit_frac: share of a block's units per layer counted as used at a token; weight_decay
    (anchor's AdamW)."""

    method: str = "tfidf"
    lr: float = 1.0
    top_t: int = 256
    unit_frac: float = 0.125
    weight_decay: float = 0.1

    def __post_init__(self) -> None:
        checks = (
            ("method", self.method in METHODS, f"one of {METHODS}"),
            ("lr", isinstance(self.lr, int | float) and self.lr > 0, "positive"),
            ("top_t", is_int(self.top_t) and self.top_t > 0, "a positive integer"),
            (
                "unit_frac",
                isinstance(self.unit_frac, int | float) and 0 < self.unit_frac <= 1,
                "in (0, 1]",
            ),
            (
                "weight_decay",
                isinstance(self.weight_decay, int | float) and self.weight_decay >= 0,
                ">= 0",
            ),
        )
        for name, ok, want in checks:
            if not ok:
                raise ConfigError(f"block finetune {name}={getattr(self, name)!r}: must be {want}")

    @property
    def label(self) -> str:
        if self.method == "tfidf":
            return f"blocks tfidf t={self.top_t} lr={self.lr:g}"
        return (
            f"blocks all fetched lr={self.lr:g}"
            if self.method == "all_fetched"
            else f"anchor lr={self.lr:g}"
        )


def unit_layout(model: nn.Module, store) -> dict[int, list[tuple[int, int, int]]]:
    """Per anchor layer with FFN memory, its hidden columns by level: [(level, start, width)] in
    the order `assemble_memories` concatenates them."""
    cfg = model.config
    if cfg.memory is None or cfg.memory.type != "ffn":
        raise ValueError("block finetuning needs a run with FFN memories (memory.type: ffn)")
    out: dict[int, list[tuple[int, int, int]]] = {}
    for level in sorted(store.levels):
        m = cfg.memory.multipliers[level - 1]
        for layer, w in layer_widths(cfg.anchor, cfg.memory, m).items():
            if w:
                cols = out.setdefault(layer, [])
                start = cols[-1][1] + cols[-1][2] if cols else 0
                cols.append((level, start, w))
    return out


@contextmanager
def recording_units(model: nn.Module) -> Iterator[dict[int, list[Tensor]]]:
    """While open, every forward with gathered FFN memories records each layer's memory hidden
    activations: yields {layer: [(B, S, W) per forward]}."""
    logs: dict[int, list[Tensor]] = {i: [] for i, b in enumerate(model.blocks) if b.ffn is not None}
    for i, log in logs.items():
        model.blocks[i].ffn.recorder = log
    try:
        yield logs
    finally:
        for i in logs:
            model.blocks[i].ffn.recorder = None


def used_units(h: Tensor, real: Tensor, frac: float) -> Tensor:
    """h (B, S, W) one level's slice of a layer's activations, real (B, S) → per sequence how many
    real tokens used each unit (its |activation| in the top ⌈frac·W⌉ at that token): (B, W)
    int64."""
    k = max(1, int(np.ceil(frac * h.shape[-1])))
    top = h.abs().topk(k, dim=-1).indices  # (B, S, k)
    hit = torch.zeros_like(h, dtype=torch.int64).scatter_(-1, top, 1) * real[..., None].long()
    return hit.sum(1)


@dataclass
class UnitBackground:
    """Per memory level: df (n_blocks, n_layers, W) int64, in how many background windows routed
    to that block each unit was used; windows (n_blocks,) how many windows each block saw."""

    df: dict[int, Tensor]
    windows: dict[int, Tensor]
    unit_frac: float
    source: str = ""

    def save(self, folder: str | Path) -> Path:
        """unit_background.safetensors + unit_background.json (format memtree-block-background
        v1)."""
        tensors = {f"df.{lv}": t for lv, t in self.df.items()} | {
            f"windows.{lv}": t for lv, t in self.windows.items()
        }
        return write_checked_tensors(
            folder,
            "unit_background",
            tensors,
            {
                "format": BACKGROUND_FORMAT,
                "version": BACKGROUND_VERSION,
                "unit_frac": self.unit_frac,
                "source": self.source,
                "levels": {str(lv): list(t.shape) for lv, t in self.df.items()},
            },
        )

    @classmethod
    def load(cls, folder: str | Path) -> UnitBackground:
        t, man = read_checked_tensors(
            folder,
            "unit_background",
            fmt=BACKGROUND_FORMAT,
            version=BACKGROUND_VERSION,
            missing="no block background counts (unit_background.json); collect them "
            "with training.finetune.blocks.collect_unit_background first",
        )
        levels = [int(k) for k in man["levels"]]
        return cls(
            df={lv: t[f"df.{lv}"] for lv in levels},
            windows={lv: t[f"windows.{lv}"] for lv in levels},
            unit_frac=float(man["unit_frac"]),
            source=man.get("source", ""),
        )


def _layer_index(layout: dict[int, list[tuple[int, int, int]]]) -> dict[int, int]:
    return {layer: i for i, layer in enumerate(sorted(layout))}


def _level_widths(layout: dict[int, list[tuple[int, int, int]]]) -> dict[int, int]:
    """{level: W}, a level's hidden units per layer (the same in every layer that has them)."""
    return {lv: w for cols in layout.values() for lv, _, w in cols}


@torch.no_grad()
def collect_unit_background(
    model: AnchorLM,
    store: MemoryStore,
    shards: str | Path,
    *,
    unit_frac: float = 0.125,
    max_windows: int = 0,
    progress: bool = True,
) -> UnitBackground:
    """Count, over the run's pretraining windows (each with the path pretraining fetched its
    blocks by), which units of each fetched block were used. model: the run's anchor with FFN
    memory; store: its bank."""
    layout = unit_layout(model, store)
    lidx = _layer_index(layout)
    width = _level_widths(layout)
    df = {
        lv: torch.zeros(store.levels[lv].info.n_blocks, len(layout), width[lv], dtype=torch.int64)
        for lv in width
    }
    windows = {lv: torch.zeros(store.levels[lv].info.n_blocks, dtype=torch.int64) for lv in width}
    loader = build_dataloader(shards, batch_size=1, shuffle=False, drop_last=False)
    model.eval()
    n = 0
    with recording_units(model) as logs:
        for batch in tqdm(loader, desc="block background", disable=not progress):
            ids, labels, paths = batch["input_ids"], batch["labels"], batch["paths"]
            real = real_positions(labels)
            model(
                ids,
                segment_ids=batch["segment_ids"],
                memories=assemble_memories(
                    store.gather(paths), model.config.anchor, model.config.memory
                ),
            )
            for layer, cols in layout.items():
                h = logs[layer].pop()
                for lv, start, w in cols:
                    slot = store.levels[lv].info.slot(int(paths[0, lv - 1]))
                    df[lv][slot, lidx[layer]] += (
                        used_units(h[..., start : start + w], real, unit_frac)[0] > 0
                    ).long()
            for lv in width:
                windows[lv][store.levels[lv].info.slot(int(paths[0, lv - 1]))] += 1
            n += 1
            if max_windows and n >= max_windows:
                break
    return UnitBackground(
        df=df, windows=windows, unit_frac=unit_frac, source=f"{shards} ({n} windows)"
    )


class BlockFinetuner:
    """One method on a hierarchical-memory run: `step(ids, real, paths)` per batch. Blocks are read
    from `store` the first time a batch fetches them and kept (edited) in `self.blocks` after."""

    def __init__(
        self,
        model: AnchorLM,
        store: MemoryStore,
        spec: BlockFinetuneSpec,
        *,
        background: UnitBackground | None = None,
    ) -> None:
        self.model, self.store, self.spec = model, store, spec
        self.layout = unit_layout(self.model, self.store)
        self.lidx = _layer_index(self.layout)
        self.widths = _level_widths(self.layout)
        self.blocks: dict[tuple[int, int], Tensor] = {}  # (level, global cluster) → flat fp32 block
        self.touched: set[tuple[int, int]] = set()
        self.last_keep: dict[int, Tensor] | None = (
            None  # tfidf: the last step's units, per level (n_uniq, layers, W)
        )
        if spec.method == "tfidf":
            if background is None:
                raise ValueError(
                    "method tfidf needs the run's block background counts (UnitBackground)"
                )
            if abs(background.unit_frac - spec.unit_frac) > 1e-12:
                raise ValueError(
                    f"the block background counts used unit_frac={background.unit_frac}, the spec "
                    f"unit_frac={spec.unit_frac}: collect them again with the spec's"
                )
            for lv, t in background.df.items():
                n_blocks = self.store.levels[lv].info.n_blocks
                if t.shape[0] != n_blocks:
                    raise ValueError(
                        f"level {lv}: background counts cover {t.shape[0]} blocks, the bank has "
                        f"{n_blocks}"
                    )
        self.background = background
        for p in self.model.parameters():
            p.requires_grad_(spec.method == "anchor")
        self.opt = (
            MemoryAdamW(
                list(self.model.parameters()),
                lr=spec.lr,
                betas=(0.9, 0.999),
                weight_decay=spec.weight_decay,
            )
            if spec.method == "anchor"
            else None
        )
        anchor, memory = self.model.config.anchor, self.model.config.memory
        # each level's block tensors in flat order: the row masks are joined by it
        self.layouts: dict[int, tuple[TensorSpec, ...]] = {
            lv: tuple(block_layout(anchor, memory, lv)) for lv in self.store.levels
        }
        self.n_steps = 0

    def _block(self, level: int, cluster: int) -> Tensor:
        key = (level, cluster)
        if key not in self.blocks:
            self.blocks[key] = self.store.fetch_flat(level, cluster).float().clone()
        return self.blocks[key]

    def step(
        self, ids: Tensor, real: Tensor, paths: np.ndarray, *, where: str = ""
    ) -> dict[str, Any]:
        """One step on a batch: ids, real (B, S); paths (B, L) each sequence's route."""
        train_blocks = self.spec.method != "anchor"
        leaves, blocks, uniq = {}, {}, {}
        for lv in sorted(self.store.levels):
            ids_lv, inverse = np.unique(paths[:, lv - 1], return_inverse=True)
            uniq[lv] = [int(c) for c in ids_lv]
            leaves[lv] = torch.stack([self._block(lv, c) for c in uniq[lv]]).requires_grad_(
                train_blocks
            )
            blocks[lv] = leaves[lv][torch.from_numpy(inverse.reshape(-1))]
        self.model.train()
        with recording_units(self.model) as logs:
            logits = self.model(
                ids,
                memories=assemble_memories(
                    blocks, self.model.config.anchor, self.model.config.memory
                ),
            )
        tgt = ids[:, 1:].masked_fill(~real[:, 1:], -100)
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), tgt.flatten(), ignore_index=-100
        )
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.model.eval()
        rec: dict[str, Any] = {"loss": float(loss)}
        if self.spec.method == "anchor":
            self.opt.step()
        else:
            try:
                keep = (
                    self._trainable_units(logs, real, paths, uniq)
                    if self.spec.method == "tfidf"
                    else None
                )
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            self.last_keep = keep
            trained = 0
            with torch.no_grad():
                for lv, leaf in leaves.items():
                    g = leaf.grad
                    if keep is not None:
                        g = g * self._row_mask(lv, keep[lv])  # (n_uniq, params)
                    for j, c in enumerate(uniq[lv]):
                        if keep is None or bool(keep[lv][j].any()):
                            self.blocks[(lv, c)] -= self.spec.lr * g[j]
                            self.touched.add((lv, c))
                    trained += (
                        int(keep[lv].sum())
                        if keep is not None
                        else self.widths[lv] * len(self.layout) * len(uniq[lv])
                    )
            rec["units_trained"] = trained
        self.n_steps += 1
        return rec

    def _trainable_units(self, logs, real, paths, uniq) -> dict[int, Tensor]:
        """{level: (n_uniq, n_layers, W) bool}: the batch's top_t units by TF-IDF against each
        block's own background (003 §4's score with a block's windows as |B|)."""
        counts = {
            lv: torch.zeros(len(uniq[lv]), len(self.layout), w, dtype=torch.int64)
            for lv, w in self.widths.items()
        }
        pos = {lv: {c: j for j, c in enumerate(uniq[lv])} for lv in uniq}
        for layer, cols in self.layout.items():
            h = logs[layer][-1]
            for lv, start, w in cols:
                per_seq = used_units(h[..., start : start + w], real, self.spec.unit_frac)  # (B, W)
                for b in range(per_seq.shape[0]):
                    counts[lv][pos[lv][int(paths[b, lv - 1])], self.lidx[layer]] += per_seq[b]
        total = sum(int(c.sum()) for c in counts.values())
        scores, owners = [], []
        for lv, c in counts.items():
            slots = [self.store.levels[lv].info.slot(u) for u in uniq[lv]]
            df = self.background.df[lv][slots].double()  # (n_uniq, n_layers, W)
            n = self.background.windows[lv][slots].double()[:, None, None]
            s = c.double() / max(total, 1) * torch.log((n + 1) / (df + 1))
            scores.append(s.masked_fill(c == 0, float("-inf")).flatten())
            owners.append((lv, c.shape))
        flat = torch.cat(scores)
        used = int(torch.isfinite(flat).sum())
        if self.spec.top_t > used:
            raise ValueError(f"top_t={self.spec.top_t} exceeds the {used} units this batch used")
        top = torch.sort(-flat, stable=True).indices[: self.spec.top_t]
        mask = torch.zeros_like(flat, dtype=torch.bool)
        mask[top] = True
        out, k = {}, 0
        for lv, shape in owners:
            n = int(np.prod(shape))
            out[lv] = mask[k : k + n].view(shape)
            k += n
        return out

    def _row_mask(self, level: int, keep: Tensor) -> Tensor:
        """(n_uniq, n_layers, W) bool → (n_uniq, params) float: 1 on the rows of w1, w2 and w3 (all
        stored (W, d)) of the kept units."""
        rows_of = {}
        for t in self.layouts[level]:
            _, layer, _name = t.name.split(".")
            rows = keep[:, self.lidx[int(layer)]].float()  # (n_uniq, W)
            rows_of[t.name] = rows[:, :, None].expand(
                -1, -1, int(np.prod(t.shape[1:]))
            )  # (n_uniq, W, d)
        return join_block(self.layouts[level], rows_of)

    def finish(self) -> None:
        for p in self.model.parameters():
            p.requires_grad_(False)
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)


def write_edits(
    store,
    blocks: dict[tuple[int, int], Tensor],
    touched: set[tuple[int, int]],
    *,
    reason: str = "block finetune",
) -> dict[str, int]:
    """Write the touched blocks through the store's edit path (journaled, audited); returns the
    records rewritten, their bytes, and the parameters (and their stored bytes) that changed."""
    records = nbytes = changed = 0
    for lv, c in sorted(touched):
        old = store.fetch_flat(lv, c).float()
        new = blocks[(lv, c)]
        changed += int((old != new).sum())
        store.edit(lv, c, new.to(old.dtype), reason=reason)
        records += 1
        nbytes += store.levels[lv].info.record_bytes
    elem = (
        store.levels[min(store.levels)].info.record_bytes
        // store.levels[min(store.levels)].info.params
    )
    return {
        "records": records,
        "record_bytes": nbytes,
        "params_changed": changed,
        "bytes_changed": changed * elem,
    }
