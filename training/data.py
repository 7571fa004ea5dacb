"""Training data: the pipeline's MDS streams → batches of tokens, document segments and cluster paths.

Reads the shards through their documented format (`shards/manifest.json` +
one MDS stream per level-1 subtree, pipeline/README.md) with MosaicML
Streaming, so the dataloader state goes into Composer checkpoints and a
resumed run continues with the same samples. A per-subtree job (App. A.2)
opens only its subtree's stream.

Batch (B = batch size, S = the shards' seq_len):
  input_ids   (B, S) int64   tokens, padded with EOT
  labels      (B, S) int64   next token, -100 where the next token is padding or
                             starts another document (no cross-document targets)
  segment_ids (B, S) int64   document segment per token (padding gets its own)
  paths       (B, L) int64   global cluster id per tree level
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

SHARDS_FORMAT = "memtree-shards"
SHARDS_VERSION = 1


def read_shards_manifest(shards: str | Path) -> dict[str, Any]:
    path = Path(shards) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{shards}: no manifest.json; expected a pipeline run's shards/ directory")
    m = json.loads(path.read_text())
    if m.get("format") != SHARDS_FORMAT or m.get("version") != SHARDS_VERSION:
        raise ValueError(f"{path}: not a {SHARDS_FORMAT} v{SHARDS_VERSION} manifest "
                         f"(format {m.get('format')!r}, version {m.get('version')!r})")
    return m


def tokenizer_vocab_size(shards: str | Path, manifest: dict[str, Any]) -> int:
    from tokenizers import Tokenizer

    tok = (Path(shards) / manifest["tokenizer"]).resolve()
    path = tok / "tokenizer.json" if tok.is_dir() else tok
    return Tokenizer.from_file(str(path)).get_vocab_size()


class Collate:
    """MDS samples → one padded batch (see the module docstring)."""

    def __init__(self, seq_len: int, eot_id: int) -> None:
        self.seq_len, self.eot_id = seq_len, eot_id

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        B, S = len(samples), self.seq_len
        ids = np.full((B, S), self.eot_id, dtype=np.int64)
        seg = np.zeros((B, S), dtype=np.int64)
        valid = np.zeros((B, S), dtype=bool)
        paths = np.stack([np.asarray(s["path"], dtype=np.int64) for s in samples])
        for i, s in enumerate(samples):
            toks = np.asarray(s["tokens"], dtype=np.int64)
            if len(toks) > S:
                raise ValueError(f"sample of {len(toks)} tokens exceeds seq_len {S}")
            ids[i, : len(toks)] = toks
            valid[i, : len(toks)] = True
            bounds = np.asarray(s["doc_bounds"], dtype=np.int64)
            for k in range(len(bounds) - 1):
                seg[i, bounds[k] : bounds[k + 1]] = k
            seg[i, len(toks) :] = len(bounds)  # padding: a segment of its own
        labels = np.full((B, S), -100, dtype=np.int64)
        same_doc = (seg[:, 1:] == seg[:, :-1]) & valid[:, 1:]
        labels[:, :-1] = np.where(same_doc, ids[:, 1:], -100)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "segment_ids": torch.from_numpy(seg), "paths": torch.from_numpy(paths)}


def real_positions(labels: torch.Tensor) -> torch.Tensor:
    """(B, S) labels from `Collate` → (B, S) bool, True on real tokens: a position is padding
    when neither it nor its predecessor has a target (a document's last token has none itself)."""
    real = labels != -100
    real[:, 1:] |= labels[:, :-1] != -100
    return real


def build_dataloader(shards: str | Path, *, batch_size: int, subtrees: list[int] | None = None,
                     shuffle: bool = True, shuffle_seed: int = 0, num_workers: int = 0,
                     drop_last: bool = True):
    """A `StreamingDataLoader` over the shards (all subtrees, or the given ones)."""
    from streaming import Stream, StreamingDataLoader, StreamingDataset

    manifest = read_shards_manifest(shards)
    want = None if subtrees is None else set(subtrees)
    streams = [Stream(local=str(Path(shards) / s["name"])) for s in manifest["streams"]
               if s["n_samples"] > 0 and (want is None or s["subtree"] in want)]
    if not streams:
        raise ValueError(f"{shards}: no samples for subtrees {sorted(want) if want else 'any'}")
    from composer.utils import dist

    per_rank = batch_size // max(dist.get_world_size(), 1)
    if per_rank * max(dist.get_world_size(), 1) != batch_size:
        raise ValueError(f"data.batch_size {batch_size} must be divisible by the {dist.get_world_size()} ranks")
    dataset = StreamingDataset(streams=streams, shuffle=shuffle, shuffle_seed=shuffle_seed,
                               batch_size=per_rank, replication=None)
    collate = Collate(int(manifest["seq_len"]), int(manifest["eot_id"]))
    return StreamingDataLoader(dataset, batch_size=per_rank, collate_fn=collate, num_workers=num_workers,
                               drop_last=drop_last)
