"""The `e2e` benchmark of bench/pipeline/pipeline_stages.py: run_pipeline end to end in a child
process (this file, run with a spec path, is that child), documents/s and the peak RSS of the
process tree, against a direct encode of a sample of the run's own windows (the embedding-bound
ceiling)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import REPO, loadavg, log, row
from bench.pipeline.common import (
    RssSampler,
    corpus_docs,
    n_cores,
    pipeline_cfg,
    quiet,
    run_sampled,
    window_texts,
    write_jsonl,
)
from memtree.clustering.embed import embed_texts, load_embedder
from memtree.config import to_dict
from memtree.pipeline.run import run_pipeline


def e2e_child(spec_path: str) -> int:
    """Runs in a fresh interpreter (so its RSS is the pipeline's alone): the whole pipeline."""
    spec = json.loads(Path(spec_path).read_text())
    S = spec["sizes"]
    root = Path(spec["root"])
    cfg = pipeline_cfg(
        root,
        [spec["corpus"]],
        window={"window_tokens": S["e2e_window_tokens"]},
        embed={"device": "cpu", "max_seq_length": S["e2e_max_seq_length"]},
        tree={"levels": S["e2e_levels"], "branching": S["e2e_branching"], "auto_reduce": True},
        pack={"seq_len": S["e2e_seq_len"]},
    )
    t0 = time.perf_counter()
    markers = run_pipeline(cfg, log=quiet)
    secs = time.perf_counter() - t0
    Path(spec["result"]).write_text(
        json.dumps({"seconds": secs, "config": to_dict(cfg), "markers": markers}, default=str)
    )
    return 0


def _run_child(S: dict, work: Path) -> tuple[dict, float, RssSampler]:
    """The pipeline in a child interpreter with its RSS sampled; (its result, wall s, sampler)."""
    spec = {
        "sizes": S,
        "root": str(work / "run"),
        "corpus": str(work / "corpus.jsonl"),
        "result": str(work / "result.json"),
    }
    (work / "spec.json").write_text(json.dumps(spec))
    rc, wall, sampler = run_sampled("bench.pipeline.e2e", [str(work / "spec.json")], REPO)
    if rc != 0:
        raise RuntimeError(f"e2e child failed with exit status {rc}")
    return json.loads((work / "result.json").read_text()), wall, sampler


def _direct_encode(S: dict, texts: list[str]) -> dict:
    """Baseline: the same MiniLM (same max_seq_length) encoding a sample of the run's own windows
    directly, i.e. the rate at which the embedding alone could go on this machine right now."""
    import torch

    k = S["e2e_baseline_windows"]
    sample = [texts[i] for i in np.linspace(0, len(texts) - 1, num=min(k, len(texts))).astype(int)]
    torch.set_num_threads(n_cores())
    m = load_embedder(device="cpu", max_seq_length=S["e2e_max_seq_length"])
    embed_texts(m, sample[:8])  # warm-up
    t0 = time.perf_counter()
    embed_texts(m, sample, strategy="truncate", batch_size=64)
    b_s = time.perf_counter() - t0
    return {"windows": len(sample), "seconds": b_s, "windows_per_s": len(sample) / b_s}


def _rows(S: dict, res: dict, sampler: RssSampler, level_stats: list[dict]) -> list[dict]:
    n_docs, n_win, secs = res["docs"], res["windows"], res["run_pipeline_seconds"]
    stage_s, direct = res["stage_seconds"], res["direct_encode_sample"]
    direct_rate = direct["windows_per_s"]
    gib = 1024**3
    data = (
        f"{n_docs:,} corpus docs -> {n_win:,} windows; levels {S['e2e_levels']} x branching "
        f"{S['e2e_branching']}, window/seq_len {S['e2e_window_tokens']}, embed max_seq_length "
        f"{S['e2e_max_seq_length']}; LocalCluster {n_cores()} workers x 1 thread"
    )
    rows = [
        row(
            "e2e",
            "run_pipeline documents/second (all 8 stages, incl. cluster start)",
            n_docs / secs,
            unit="docs/s",
            data=data,
            target="(issue: 50k docs; not run at that scale)",
        ),
        row(
            "e2e",
            "run_pipeline windows/second vs direct encode of a window sample",
            n_win / secs,
            unit="win/s",
            baseline=round(direct_rate, 2),
            ratio=(n_win / secs) / direct_rate,
            target="(info: embed-bound ceiling)",
            data=data + f"; baseline sample {direct['windows']} windows",
        ),
        row(
            "e2e",
            "run_pipeline wall time",
            secs,
            unit="s",
            data=data,
            target="(info) stages: " + ", ".join(f"{k} {v:.0f}s" for k, v in stage_s.items()),
        ),
        row(
            "e2e",
            "peak RSS, driver + Dask workers (summed, 0.5 s samples)",
            round(sampler.peak_total / gib, 2),
            unit="GiB",
            data=data,
            target=f"(info) driver {sampler.peak_root / gib:.2f} GiB, "
            f"children {sampler.peak_children / gib:.2f} GiB",
        ),
    ]
    for s in level_stats:
        rows.append(
            row(
                "e2e",
                f"tree balance max/mean, level {s['level']} (mean {s['mean_size']:.1f}, "
                f"max {s['max_size']})",
                s["balance_ratio"],
                target="<= 1.2",
                met=s["balance_ratio"] <= 1.2,
                data=f"real: e2e run's tree on {n_win:,} windows",
            )
        )
    return rows


def bench_e2e(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    n_docs = S["e2e_docs"]
    work = Path(tempfile.mkdtemp(prefix="memtree-bench-e2e-", dir=ctx["tmp"]))
    write_jsonl(corpus_docs(n_docs), work / "corpus.jsonl")
    res: dict[str, Any] = {"docs": n_docs, "loadavg_start": loadavg()}
    log(
        f"e2e: run_pipeline on {n_docs} docs in a child process (levels {S['e2e_levels']}, "
        f"branching {S['e2e_branching']}, window {S['e2e_window_tokens']}, seq_len "
        f"{S['e2e_seq_len']}, "
        f"embed max_seq_length {S['e2e_max_seq_length']})"
    )
    out, wall, sampler = _run_child(S, work)
    mk = out["markers"]
    n_win = mk["window"]["stats"]["n_windows"]
    secs = out["seconds"]
    res.update(
        docs_kept=mk["ingest"]["stats"]["kept"],
        windows=n_win,
        tokens=mk["window"]["stats"]["n_tokens"],
        run_pipeline_seconds=secs,
        child_wall_seconds=wall,
        stage_seconds={k: v["seconds"] for k, v in mk.items()},
        docs_per_s=n_docs / secs,
        windows_per_s=n_win / secs,
        embed_stage=mk["embed"]["stats"],
        tree=mk["tree"]["stats"],
        shards={k: v for k, v in mk["shards"]["stats"].items()},
        peak_rss_total_bytes=sampler.peak_total,
        peak_rss_driver_bytes=sampler.peak_root,
        peak_rss_children_bytes=sampler.peak_children,
        rss_samples=sampler.samples,
        max_processes=sampler.max_procs,
        config=out["config"],
    )
    texts = window_texts(work / "run", mk["window"]["stats"]["parts"])
    res["direct_encode_sample"] = _direct_encode(S, texts)
    res["loadavg_end"] = loadavg()
    rows = _rows(S, res, sampler, mk["tree"]["stats"]["level_stats"])
    shutil.rmtree(work, ignore_errors=True)
    return res, rows


if __name__ == "__main__":
    sys.exit(e2e_child(sys.argv[1]))
