"""The pipeline's embed stage (`pipeline.run`): every window embedded by a sentence encoder
on the Dask workers, one task per windows partition, the parts joined into one
`embeddings.npy` (float32, (n_windows, dim)) in window order.

With the int8 OpenVINO backend the encoder is exported and calibrated first, into the stage's
directory (`EXPORT_DIR`). The tasks also tune glibc's allocator (`EmbedConfig.mmap_threshold_mib`),
since the encoders' activations otherwise fragment the workers' heap.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from memtree.clustering.embed import (
    SEQ_BUCKET,
    auto_int8_min_windows,
    default_model_path,
    embed_texts,
    load_embedder,
    resolve_backend,
)
from memtree.clustering.embed_export import OPENVINO_INT8, export_openvino_int8
from memtree.config import to_dict
from memtree.io import atomic_path, atomic_save_npy
from memtree.pipeline.dask_utils import map_tasks
from memtree.pipeline.stages import Ctx
from memtree.pretrained import cache_root

EXPORT_DIR = "embedder"  # the int8 export, inside the embed stage's directory


def embed_part(
    windows_path: str,
    out_path: str,
    model: str | None,
    device: str,
    strategy: str,
    max_seq_length: int,
    batch_size: int,
    threads: int,
    backend: str = "torch",
    mmap_threshold_mib: int = 0,
) -> int:
    """Dask task: embed one windows partition (skipped if already written)."""
    out = Path(out_path)
    if out.exists():
        return int(np.load(out, mmap_mode="r").shape[0])
    import torch

    if mmap_threshold_mib:
        _fix_mmap_threshold(mmap_threshold_mib << 20)
    torch.set_num_threads(threads)
    m = load_embedder(
        model, device=device, max_seq_length=max_seq_length, backend=backend, threads=threads
    )
    texts = pq.read_table(windows_path, columns=["text"])["text"].to_pylist()
    emb = embed_texts(m, texts, strategy=strategy, batch_size=batch_size)
    n = int(emb.shape[0])
    atomic_save_npy(out, emb)
    del texts, emb
    _trim_heap()
    return n


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def _glibc(fn: str, *args: int) -> None:
    """Call one of glibc's allocator functions; nothing on another C library."""
    try:
        getattr(ctypes.CDLL("libc.so.6"), fn)(*args)
    except (OSError, AttributeError):  # not glibc
        pass


def _fix_mmap_threshold(nbytes: int) -> None:
    """Serve blocks of nbytes or more by mmap for the rest of this process's life (glibc only).
    Setting the threshold also turns off glibc's dynamic raising of it, which is what let the
    encoders' large activations fragment the heap (EmbedConfig.mmap_threshold_mib)."""
    _glibc("mallopt", M_MMAP_THRESHOLD, nbytes)


def _trim_heap() -> None:
    """Hand the worker's freed heap back to the OS after a part (glibc only). The encoders'
    activations differ in size from batch to batch, and glibc keeps the freed pages: measured in
    one process over 30 parts of 700 windows, RSS grew 0.31 GiB untrimmed and 0.14 GiB trimmed
    (docs/BENCHMARKS.md)."""
    _glibc("malloc_trim", 0)


def embed_fingerprint(e) -> dict:
    """The embed settings that change the vectors: the backend as resolved (`auto` picks by
    device), not the device itself (same network, same math up to float rounding) nor the
    allocator setting. A torch run leaves the backend keys out, so torch runs made before the
    int8 backend existed keep their fingerprint. `auto` on the CPU picks by the corpus's size,
    known only once the windows are cut (the window stage is upstream, so its fingerprint already
    fixes the size): the rule's threshold stands in for the choice."""
    d = {k: v for k, v in to_dict(e).items() if k not in ("device", "mmap_threshold_mib")}
    d["backend"] = resolve_backend(e.backend, e.device)
    if d["backend"] == "torch":
        d.pop("backend"), d.pop("calibration_samples")
        return d
    # the int8 network's padding changes its vectors slightly (cosine >= 0.9997)
    d["seq_bucket"] = SEQ_BUCKET
    if d["backend"] == "auto":
        d["auto_int8_min_windows"] = auto_int8_min_windows(e.max_seq_length)
    return d


def _first_texts(ctx: Ctx, n: int) -> list[str]:
    """The corpus's first n windows, in order: the int8 export's calibration set."""
    out: list[str] = []
    for p in ctx.parts("window"):
        if len(out) >= n:
            break
        col = pq.read_table(ctx.stage_dir("window") / p["file"], columns=["text"])["text"]
        out.extend(col.slice(0, n - len(out)).to_pylist())
    return out


def embed_stage(ctx: Ctx, work: Path) -> dict:
    e = ctx.cfg.embed
    wparts = ctx.parts("window")
    (work / "parts").mkdir(exist_ok=True)
    # absolute: the Dask workers' working directory may not be this process's (--scheduler)
    model, export, export_s, obtained = (
        (os.path.abspath(e.model) if e.model else None),
        None,
        0.0,
        None,
    )
    n_windows = sum(int(p["n"]) for p in wparts)
    backend = resolve_backend(e.backend, e.device, n_windows, e.max_seq_length)
    if resolve_backend(e.backend, e.device) == "auto":  # auto on the CPU: the size decided
        ctx.log(
            f"[embed] backend auto: {backend} for {n_windows:,} windows (int8 from "
            f"{auto_int8_min_windows(e.max_seq_length):,} at max_seq_length "
            f"{e.max_seq_length}: below that its export and calibration cost more than they save)"
        )
    if backend == OPENVINO_INT8:
        model = str(work / EXPORT_DIR)
        t0 = time.time()
        cache = cache_root() / "embedder"
        export = export_openvino_int8(
            e.model or default_model_path(),
            model,
            _first_texts(ctx, e.calibration_samples),
            max_seq_length=e.max_seq_length,
            cache_dir=cache,
            progress=ctx.cfg.progress,
        )
        export_s = time.time() - t0
        obtained = export.pop("obtained")
        how = {
            "reused": "kept from the last attempt",
            "cache": f"copied from {cache}",
            "calibrated": f"calibrated on {e.calibration_samples} windows",
        }[obtained]
        ctx.log(f"[embed] int8 OpenVINO export ready in {export_s:.1f} s ({how})")
    args = [
        (
            str(ctx.stage_dir("window") / p["file"]),
            str(work / "parts" / f"part-{i:05d}.npy"),
            model,
            e.device,
            e.strategy,
            e.max_seq_length,
            e.batch_size,
            ctx.cfg.dask.threads_per_worker,
            backend,
            e.mmap_threshold_mib,
        )
        for i, p in enumerate(wparts)
    ]
    t0 = time.time()
    counts = map_tasks(ctx.client, embed_part, args, desc="embed", progress=ctx.cfg.progress)
    seconds = time.time() - t0
    for p, n in zip(wparts, counts):
        if n != p["n"]:
            raise RuntimeError(f"embed: {p['file']} has {p['n']} windows but {n} embeddings")
    n_total = sum(counts)
    first = np.load(work / "parts" / "part-00000.npy", mmap_mode="r")
    dim = int(first.shape[1])
    with atomic_path(work / "embeddings.npy") as tmp:
        mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n_total, dim))
        for i, p in enumerate(wparts):
            mm[p["offset"] : p["offset"] + p["n"]] = np.load(work / "parts" / f"part-{i:05d}.npy")
        mm.flush()
        del mm
    shutil.rmtree(work / "parts")
    return {
        "n": n_total,
        "dim": dim,
        "model": e.model,
        "model_resolved": e.model or default_model_path(),
        "backend": backend,
        "export": EXPORT_DIR if export else None,
        "calibration": export["calibration"] if export else None,
        "export_seconds": round(export_s, 3),
        "export_obtained": obtained,
        "strategy": e.strategy,
        "max_seq_length": e.max_seq_length,
        "batch_size": e.batch_size,
        "embed_seconds": round(seconds, 3),
        "windows_per_second": round(n_total / max(seconds, 1e-9), 1),
    }
