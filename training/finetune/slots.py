"""Sparse memory finetuning's slot selection (seed 003 §4) for product-key memory layers
(training/layers/pkm.py).

`access_counts` counts, per slot, how many times a batch read it (padding positions masked
out). Background document frequencies (`BackgroundCounts`: in how
many of |B| background batches each slot was read at least once) are collected once over
pretraining data and stored with the checkpoint. Per finetuning batch, slot i scores

    tfidf(i) = c(i) / Σ_j c(j) · log((|B| + 1) / (df(i) + 1))

and only the top-t accessed slots by that score receive gradient (`trainable_rows`): the forward
still reads every accessed slot (`ProductKeyMemory.forward(..., trainable=mask)` passes the
others' values with their gradient stopped: the seed's `mem·m + mem.detach() − (mem·m).detach()`,
applied to the rows read so the gradient stays sparse).

`memtree train finetune` (training/finetune/continual.py) streams new data through it; `memtree
eval continual` (eval/finetune/continual.py) measures learning and forgetting.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from memtree.config import is_int
from memtree.io import read_checked_tensors, write_checked_tensors
from memtree.training.data import real_positions

BACKGROUND_FORMAT = "memtree-pkm-background"
BACKGROUND_VERSION = 1


def access_counts(indices: Tensor, n_slots: int, mask: Tensor | None = None) -> Tensor:
    """How many times each slot was read: indices (B, S, H, k) from `lookup`, mask (B, S) True for
    real tokens (padding is not counted) → (n_slots,) int64."""
    idx = indices if mask is None else indices[mask.bool()]
    return torch.bincount(idx.flatten(), minlength=n_slots)


def tfidf(counts: Tensor, doc_freq: Tensor, n_batches: int) -> Tensor:
    """003 §4: c(i) / Σ_j c(j) · log((|B| + 1) / (df(i) + 1)) per slot, (N,) float64."""
    if counts.shape != doc_freq.shape:
        raise ValueError(
            f"counts {tuple(counts.shape)} and background doc_freq {tuple(doc_freq.shape)} "
            "differ: the background was collected on another memory size"
        )
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
def collect_background(
    model: nn.Module, batches: Iterable[dict[str, Tensor]], n_batches: int, *, progress: bool = True
) -> dict[int, BackgroundCounts]:
    """Document frequencies of every memory layer's slots over n_batches pretraining batches
    (dicts with `input_ids` (B, S) and `labels` (B, S), -100 on padding: padded positions are
    not counted). Fewer batches than asked: an error naming both."""
    if not is_int(n_batches) or n_batches <= 0:
        raise ValueError(f"background batches must be a positive integer, got {n_batches!r}")
    model.eval()
    out: dict[int, BackgroundCounts] = {}
    done = 0
    with (
        recording(model) as logs,
        tqdm(total=n_batches, desc="background counts", disable=not progress) as bar,
    ):
        for batch in batches:
            ids = batch["input_ids"]
            real = (
                real_positions(batch["labels"])
                if "labels" in batch
                else torch.ones_like(ids, dtype=torch.bool)
            )
            model(ids, segment_ids=batch.get("segment_ids"))
            for i, log in logs.items():
                n_slots = model.blocks[i].pkm.cfg.n_slots
                out.setdefault(i, BackgroundCounts.empty(n_slots)).add_batch(
                    access_counts(log[-1], n_slots, real), tokens=int(real.sum())
                )
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
            raise ValueError(
                f"batch counts have {counts.numel()} slots, the background {self.doc_freq.numel()}"
            )
        self.doc_freq += (counts > 0).to(torch.int64)
        self.n_batches += 1
        self.tokens += int(tokens)

    def save(self, folder: str | Path) -> Path:
        """background_counts.safetensors + background_counts.json (format memtree-pkm-background
        v1)."""
        return write_checked_tensors(
            folder,
            "background_counts",
            {"doc_freq": self.doc_freq},
            {
                "format": BACKGROUND_FORMAT,
                "version": BACKGROUND_VERSION,
                "n_batches": self.n_batches,
                "tokens": self.tokens,
                "source": self.source,
                "n_slots": int(self.doc_freq.numel()),
            },
        )

    @classmethod
    def load(cls, folder: str | Path, *, n_slots: int | None = None) -> BackgroundCounts:
        """Read them back; a missing file, another format / version, a checksum mismatch or (with
        n_slots) another memory size: an error naming the value."""
        t, man = read_checked_tensors(
            folder,
            "background_counts",
            fmt=BACKGROUND_FORMAT,
            version=BACKGROUND_VERSION,
            missing="no background counts (background_counts.json); collect them over "
            "pretraining batches before sparse memory finetuning",
        )
        if n_slots is not None and man["n_slots"] != n_slots:
            raise ValueError(
                f"{folder}: background counts cover n_slots={man['n_slots']}, the memory has "
                f"n_slots={n_slots}"
            )
        return cls(
            doc_freq=t["doc_freq"],
            n_batches=int(man["n_batches"]),
            tokens=int(man.get("tokens", 0)),
            source=man.get("source", ""),
        )
