"""Helpers of the pipeline benchmarks: result rows, synthetic data, corpus files, pipeline
configs and the RSS sampler (bench/pipeline/pipeline_stages.py, its stage modules (`embed.py`,
`tree.py`, `assign.py`, `e2e.py`), bench/pipeline/pipeline_scale.py and bench/clustering/routing.py
import them)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow.parquet as pq

from memtree.pipeline.config import (
    DaskConfig,
    EmbedConfig,
    IngestConfig,
    PackConfig,
    PipelineConfig,
    TreeConfig,
    WindowConfig,
)
from memtree.pipeline.corpus.topical import CorpusSpec, generate_corpus

DIM = 384  # all-MiniLM-L6-v2


def n_cores() -> int:
    return os.cpu_count() or 1


def gmm_sphere(
    n: int,
    seed: int,
    *,
    dim: int = DIM,
    domains: int = 16,
    topics: int = 4,
    topic_spread: float = 0.8,
    point_spread: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """A labelled Gaussian mixture on the unit sphere shaped like the corpus: 16 domains x 4
    topics = 64 components. Domain centres are uniform on the sphere; a topic centre is its
    domain centre plus Gaussian noise of norm ~topic_spread, renormalised; a point is its topic
    centre plus noise of norm ~point_spread, renormalised (within-topic cosine ~0.5, like MiniLM
    embeddings of one subtopic). Returns (x (n, dim) float32, labels (n,) int64 in [0, 64))."""
    rng = np.random.default_rng(seed)
    dom = rng.standard_normal((domains, dim)).astype(np.float32)
    dom /= np.linalg.norm(dom, axis=1, keepdims=True)
    top = np.repeat(dom, topics, axis=0) + topic_spread / math.sqrt(dim) * rng.standard_normal(
        (domains * topics, dim)
    ).astype(np.float32)
    top /= np.linalg.norm(top, axis=1, keepdims=True)
    labels = rng.integers(0, domains * topics, size=n)
    x = np.empty((n, dim), dtype=np.float32)
    step = 65536
    for s in range(0, n, step):
        e = min(n, s + step)
        xb = top[labels[s:e]] + point_spread / math.sqrt(dim) * rng.standard_normal(
            (e - s, dim), dtype=np.float32
        )
        xb /= np.linalg.norm(xb, axis=1, keepdims=True)
        x[s:e] = xb
    return x, labels.astype(np.int64)


def gmm_hierarchy(
    n: int,
    seed: int,
    *,
    dim: int = DIM,
    levels: int = 3,
    branching: int = 16,
    spreads: tuple[float, ...] = (1.0, 0.8, 0.6),
    point_spread: float = 0.6,
) -> tuple[np.ndarray, np.ndarray]:
    """A hierarchical Gaussian mixture on the unit sphere, `levels` × `branching` deep (issue #37's
    3 × 16 = 4,096 leaf components): level-1 centres uniform on the sphere; a child centre is its
    parent plus Gaussian noise of norm ~spreads[l], renormalised; a point is a uniformly drawn
    leaf centre plus noise of norm ~point_spread, renormalised. Returns (x (n, dim) float32,
    leaf labels (n,) int64)."""
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((branching, dim)).astype(np.float32)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    for s in spreads[1:levels]:
        c = np.repeat(c, branching, axis=0) + s / math.sqrt(dim) * rng.standard_normal(
            (len(c) * branching, dim)
        ).astype(np.float32)
        c /= np.linalg.norm(c, axis=1, keepdims=True)
    labels = rng.integers(0, len(c), size=n)
    x = c[labels] + point_spread / math.sqrt(dim) * rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), labels.astype(np.int64)


def zipf_mixture(
    n: int, seed: int, *, dim: int = DIM, points_per_component: int = 27, spread: float = 0.7
) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs whose weights fall as 1 / rank (n // points_per_component of them, centres
    standard normal, each point its centre plus noise of `spread` per coordinate, renormalised):
    a few topics hold most points, as in real corpora, unlike `gmm_hierarchy`'s uniform leaves.
    Returns (x (n, dim) float32 unit rows, component labels (n,) int64)."""
    rng = np.random.default_rng(seed)
    comps = max(1, n // points_per_component)
    w = 1.0 / np.arange(1, comps + 1)
    labels = rng.choice(comps, n, p=w / w.sum())
    x = rng.standard_normal((comps, dim)).astype(np.float32)[labels]
    x += spread * rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, labels.astype(np.int64)


def corpus_docs(n: int, seed: int = 0) -> list[dict]:
    return list(generate_corpus(CorpusSpec(n_docs=n, seed=seed)))


def write_jsonl(docs: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)


def window_texts(run_root: Path, parts: list[dict]) -> list[str]:
    """The texts of a pipeline run's windows, in order, from its window stage's parquet parts."""
    texts: list[str] = []
    for p in parts:
        texts += pq.read_table(run_root / "window" / p["file"], columns=["text"])[
            "text"
        ].to_pylist()
    return texts


def pipeline_cfg(root: Path, inputs: list[str], **sections: Any) -> PipelineConfig:
    kinds = {
        "ingest": IngestConfig,
        "window": WindowConfig,
        "embed": EmbedConfig,
        "tree": TreeConfig,
        "pack": PackConfig,
        "dask": DaskConfig,
    }
    sections = {"ingest": {}, "embed": {"device": "cpu"}, **sections}
    sections["ingest"] = {**sections["ingest"], "inputs": inputs}
    parts = {k: kinds[k](**v) for k, v in sections.items()}
    return PipelineConfig(out=str(root), progress=False, **parts)


def quiet(_msg: str) -> None:
    pass


class RssSampler(threading.Thread):
    """Samples the summed RSS of a process and all its descendants every `interval` s."""

    def __init__(self, pid: int, interval: float = 0.5, pss: bool = False):
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.interval = interval
        # PSS splits shared pages (a memmapped file read by several workers) between the processes
        # that map them, where summed RSS counts them once per process; it reads smaps, so slower.
        self.pss = pss
        self.peak_pss_total = 0
        self.stop_evt = threading.Event()
        self.peak_total = 0
        self.peak_root = 0
        self.peak_children = 0
        self.max_procs = 0
        self.samples = 0
        self.timeline: list[tuple[float, int, int]] = []  # (unix time, root RSS, descendants' RSS)

    def run(self) -> None:
        while not self.stop_evt.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.Error:
                break
            root_rss, child_rss, pss = 0, 0, 0
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    pss += p.memory_full_info().pss if self.pss else 0
                except psutil.Error:
                    continue
                if p.pid == self.root.pid:
                    root_rss = rss
                else:
                    child_rss += rss
            self.peak_total = max(self.peak_total, root_rss + child_rss)
            self.peak_pss_total = max(self.peak_pss_total, pss)
            self.peak_root = max(self.peak_root, root_rss)
            self.peak_children = max(self.peak_children, child_rss)
            self.max_procs = max(self.max_procs, len(procs))
            self.samples += 1
            self.timeline.append((time.time(), root_rss, child_rss))
            self.stop_evt.wait(self.interval)

    def stop(self) -> None:
        self.stop_evt.set()
        self.join()


def run_sampled(
    module: str, args: list[str], cwd: Path, pss: bool = False
) -> tuple[int, float, RssSampler]:
    """Run `python -m module *args` in `cwd` (the repository's root) to its end while sampling its
    RSS (with its Dask workers) every 0.5 s → (exit status, wall seconds, sampler)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=str(cwd))
    sampler = RssSampler(proc.pid, 0.5, pss=pss)
    sampler.start()
    rc = proc.wait()
    wall = time.perf_counter() - t0
    sampler.stop()
    return rc, wall, sampler
