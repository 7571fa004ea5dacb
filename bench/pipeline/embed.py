"""The `embed` benchmark of bench/pipeline/pipeline_stages.py: the pipeline's Dask embed stage
against SentenceTransformer.encode called directly on the same window texts (target: warm >=
0.9x)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import loadavg, log, row
from bench.pipeline.common import (
    corpus_docs,
    n_cores,
    pipeline_cfg,
    quiet,
    window_texts,
    write_jsonl,
)
from memtree.clustering.embed import embed_texts, load_embedder
from memtree.config import to_dict
from memtree.pipeline.dask_utils import dask_client
from memtree.pipeline.run import run_pipeline


class _EmbedTimer:
    """Times the pipeline's embed stage and a direct encode of the same window texts; every
    run is recorded with the load average before it."""

    def __init__(self, cfg, work: Path, client, texts: list[str]):
        self.cfg, self.work, self.client, self.texts = cfg, work, client, texts
        self.model = None
        self.pipe_runs: list[dict] = []
        self.direct_runs: list[dict] = []

    def pipeline_once(self, label: str) -> float:
        n = len(self.texts)
        shutil.rmtree(self.work / "run" / "embed", ignore_errors=True)
        la = loadavg()
        st = run_pipeline(self.cfg, until="embed", client=self.client, log=quiet)["embed"]["stats"]
        assert st["n"] == n, (st["n"], n)
        self.pipe_runs.append({"kind": label, "seconds": st["embed_seconds"], "loadavg_before": la})
        secs = st["embed_seconds"]
        log(f"embed:   pipeline ({label}) {secs:.1f}s = {n / secs:.2f} win/s")
        return secs

    def direct_once(self) -> float:
        e = self.cfg.embed
        la = loadavg()
        t0 = time.perf_counter()
        embed_texts(self.model, self.texts, strategy=e.strategy, batch_size=e.batch_size)
        secs = time.perf_counter() - t0
        self.direct_runs.append({"seconds": secs, "loadavg_before": la})
        log(f"embed:   direct encode {secs:.1f}s = {len(self.texts) / secs:.2f} win/s")
        return secs

    def run(self, rounds: int) -> float:
        """A cold pipeline run (worker start and model load included), then `rounds` interleaved
        rounds (A B, B A, ...) of the warm pipeline and the direct encode. Returns the direct
        side's model load seconds."""
        import torch

        e = self.cfg.embed
        log(
            f"embed: {len(self.texts)} windows; pipeline embed stage with cold workers "
            "(model load included)"
        )
        self.pipeline_once("cold")
        t0 = time.perf_counter()
        self.model = load_embedder(e.model, device="cpu", max_seq_length=e.max_seq_length)
        load_s = time.perf_counter() - t0
        # warm-up
        embed_texts(self.model, self.texts[:16], strategy=e.strategy, batch_size=e.batch_size)
        log(
            f"embed: {rounds} interleaved rounds of warm pipeline embed vs direct encode "
            f"({torch.get_num_threads()} torch threads)"
        )
        for r in range(rounds):
            for which in ("direct", "pipe") if r % 2 == 0 else ("pipe", "direct"):
                self.direct_once() if which == "direct" else self.pipeline_once("warm")
        return load_s


def _figures(timer: _EmbedTimer, rounds: int, load_s: float, cos: float, n_parts: int) -> dict:
    """The rates and ratios of the timed runs (the JSON's figures after the setup's)."""
    import torch

    n = len(timer.texts)
    pipe_runs, direct_runs = timer.pipe_runs, timer.direct_runs
    warm_s = sum(r["seconds"] for r in pipe_runs if r["kind"] == "warm")
    direct_s = sum(r["seconds"] for r in direct_runs)
    warm_rate, base_rate = n * rounds / warm_s, n * rounds / direct_s
    cold_rate = n / pipe_runs[0]["seconds"]
    base_cold_rate = n / (direct_runs[0]["seconds"] + load_s)
    return {
        "windows": n,
        "n_partitions": n_parts,
        "pipeline_runs": pipe_runs,
        "direct_runs": direct_runs,
        "direct_model_load_seconds": round(load_s, 3),
        "torch_threads": torch.get_num_threads(),
        "pipeline_warm_windows_per_s": warm_rate,
        "direct_windows_per_s": base_rate,
        "pipeline_cold_windows_per_s": cold_rate,
        "direct_with_load_windows_per_s": base_cold_rate,
        "ratio_warm": warm_rate / base_rate,
        "ratio_cold": cold_rate / base_cold_rate,
        "per_round_ratio_warm": [
            d["seconds"] / p["seconds"]
            for d, p in zip(direct_runs, [r for r in pipe_runs if r["kind"] == "warm"])
        ],
        "min_cosine_pipeline_vs_direct_first256": cos,
        "loadavg_end": loadavg(),
    }


def _rows(res: dict, cfg, n_docs: int, rounds: int) -> list[dict]:
    e = cfg.embed
    warm_rate, base_rate = res["pipeline_warm_windows_per_s"], res["direct_windows_per_s"]
    cold_rate = res["pipeline_cold_windows_per_s"]
    base_cold_rate = res["direct_with_load_windows_per_s"]
    data = (
        f"{res['windows']} windows of {n_docs} corpus docs (window 2048 tok), MiniLM "
        f"max_seq_length="
        f"{e.max_seq_length}, batch {e.batch_size}; {res['n_partitions']} parquet partitions, "
        f"{res['dask']['n_workers']} workers x 1 thread vs encode with {res['torch_threads']} "
        f"threads; {rounds} interleaved rounds"
    )
    return [
        row(
            "embed",
            "pipeline embed throughput (warm workers)",
            warm_rate,
            unit="win/s",
            baseline=round(base_rate, 2),
            ratio=warm_rate / base_rate,
            target=">= 0.9x",
            met=warm_rate / base_rate >= 0.9,
            data=data,
        ),
        row(
            "embed",
            "pipeline embed throughput (cold: worker start + model load incl.)",
            cold_rate,
            unit="win/s",
            baseline=round(base_cold_rate, 2),
            ratio=cold_rate / base_cold_rate,
            target="(info; baseline: 1st direct round + its model load)",
            data=data.replace(f"; {rounds} interleaved rounds", "; one run"),
        ),
        row(
            "embed",
            "min cosine(pipeline emb, direct emb), first 256 windows",
            res["min_cosine_pipeline_vs_direct_first256"],
            data=data,
            target="(info; same vectors expected)",
        ),
    ]


def bench_embed(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    """Pipeline embed stage vs direct encode, interleaved (A B, B A, ...) so that load from other
    processes on the machine hits both sides alike; the ratio is of the summed times."""
    import torch

    n_docs, part, rounds = S["embed_docs"], S["embed_partition_docs"], S["embed_rounds"]
    work = Path(tempfile.mkdtemp(prefix="memtree-bench-embed-", dir=ctx["tmp"]))
    write_jsonl(corpus_docs(n_docs), work / "corpus.jsonl")
    cfg = pipeline_cfg(
        work / "run",
        [str(work / "corpus.jsonl")],
        ingest={"partition_docs": part},
        embed={"device": "cpu"},
    )
    e = cfg.embed
    res: dict[str, Any] = {
        "docs": n_docs,
        "partition_docs": part,
        "embed_config": to_dict(e),
        "window_tokens": cfg.window.window_tokens,
        "rounds": rounds,
        "dask": {
            "n_workers": cfg.dask.n_workers or n_cores(),
            "threads_per_worker": cfg.dask.threads_per_worker,
        },
        "loadavg_start": loadavg(),
    }
    torch.set_num_threads(n_cores())
    with dask_client(cfg.dask) as client:
        log(f"embed: ingest/tokenizer/window for {n_docs} docs")
        markers = run_pipeline(cfg, until="window", client=client, log=quiet)
        wparts = markers["window"]["stats"]["parts"]
        timer = _EmbedTimer(cfg, work, client, window_texts(work / "run", wparts))
        load_s = timer.run(rounds)
    base = embed_texts(timer.model, timer.texts[:256], strategy=e.strategy, batch_size=e.batch_size)
    pipe = np.load(work / "run" / "embed" / "embeddings.npy")[:256]
    cos = float(np.min(np.sum(pipe * base, axis=1)))
    res.update(_figures(timer, rounds, load_s, cos, len(wparts)))
    rows = _rows(res, cfg, n_docs, rounds)
    shutil.rmtree(work, ignore_errors=True)
    return res, rows
