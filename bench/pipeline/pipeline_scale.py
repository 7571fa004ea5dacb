"""The whole pipeline at scale: documents/s, peak memory, and 1 vs 2 Dask workers (issue #16).

    # 50,000 docs, 1 and 2 workers
    .venv/bin/python -m bench.pipeline.pipeline_scale
    # memory vs corpus size
    .venv/bin/python -m bench.pipeline.pipeline_scale --docs 10000 50000 --workers 2

Each run is `run_pipeline` (all 8 stages, LocalCluster start included) on the synthetic corpus
(`pipeline.corpus.topical`, seed 0) in a fresh child interpreter, with the e2e settings of
bench/pipeline/pipeline_stages.py (3 x 8 tree, 512-token windows and samples, embed max_seq_length
128) and `--backend` for the embedder and `--mmap-threshold-mib` for its workers' allocator (0:
glibc's dynamic threshold; several values are run one after another for each size); the peak RSS of
the child and its Dask workers is sampled every
0.5 s (bench/pipeline/common.py's RssSampler). The issue's memory criterion: peak memory must not
grow with the corpus beyond the embeddings themselves, so each row also gives peak RSS minus the
embedding matrix (windows x 384 x 4 bytes), and the peak of the summed PSS: the tree stage's
workers memmap embeddings.npy, and summed RSS counts those shared pages once per process. Scaling:
docs/s with 2 workers over 1 worker. JSON: --out, default
bench/pipeline/results/pipeline-scale-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import REPO, finish, log, results_dir, results_path, run_meta, write_results
from bench.pipeline.common import corpus_docs, pipeline_cfg, run_sampled, write_jsonl
from memtree.config import to_dict
from memtree.pipeline.run import run_pipeline

COLUMNS = [
    "docs",
    "workers",
    "backend",
    "mmap_threshold_mib",
    "windows",
    "seconds",
    "docs_per_s",
    "embed_s",
    "peak_rss_gib",
    "peak_pss_gib",
    "peak_minus_embeddings_gib",
    "speedup_vs_1_worker",
]


def child(spec_path: str) -> int:
    """Runs in a fresh interpreter, so the sampled RSS is the pipeline's alone."""
    spec = json.loads(Path(spec_path).read_text())
    cfg = pipeline_cfg(
        Path(spec["root"]),
        [spec["corpus"]],
        window={"window_tokens": 512},
        embed={
            "device": "cpu",
            "max_seq_length": 128,
            "backend": spec["backend"],
            "mmap_threshold_mib": spec["mmap_threshold_mib"],
        },
        tree={"levels": 3, "branching": 8, "auto_reduce": True},
        pack={"seq_len": 512},
        dask={"n_workers": spec["workers"], "threads_per_worker": 1},
    )
    events: list[
        tuple[float, str]
    ] = []  # (unix time, log line): stage boundaries for the RSS timeline
    t0 = time.perf_counter()
    markers = run_pipeline(cfg, log=lambda m: events.append((time.time(), m)))
    Path(spec["result"]).write_text(
        json.dumps(
            {
                "seconds": time.perf_counter() - t0,
                "config": to_dict(cfg),
                "markers": markers,
                "events": events,
            },
            default=str,
        )
    )
    return 0


def stage_peaks(timeline: list[tuple[float, int, int]], events: list[tuple[float, str]]) -> dict:
    """Peak driver / worker / total RSS (GiB) per stage, from the "[stage] running" ... "done" log
    lines.

    The baseline (start of the stage) is kept too, so a stage's own growth is peak - start."""
    gib = 1024**3
    spans, start = {}, {}
    for t, line in events:
        if not line.startswith("["):
            continue
        name, rest = line[1:].split("]", 1)
        if rest.startswith(" running"):
            start[name] = t
        elif rest.startswith(" done") and name in start:
            spans[name] = (start.pop(name), t)
    out = {}
    for name, (a, b) in spans.items():
        rows = [r for r in timeline if a <= r[0] <= b] or [
            min(timeline, key=lambda r: abs(r[0] - a))
        ]
        out[name] = {
            "driver_gib": max(r[1] for r in rows) / gib,
            "workers_gib": max(r[2] for r in rows) / gib,
            "total_gib": max(r[1] + r[2] for r in rows) / gib,
            "workers_start_gib": rows[0][2] / gib,
            "driver_start_gib": rows[0][1] / gib,
        }
    return out


def one_run(corpus: Path, docs: int, workers: int, backend: str, mmap_mib: int, tmp: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"scale-{docs}-{workers}w-", dir=tmp))
    spec = {
        "root": str(work / "run"),
        "corpus": str(corpus),
        "result": str(work / "result.json"),
        "workers": workers,
        "backend": backend,
        "mmap_threshold_mib": mmap_mib,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    log(
        f"run_pipeline: {docs:,} docs, {workers} worker(s), backend {backend}, mmap threshold "
        f"{mmap_mib} MiB"
    )
    rc, wall, sampler = run_sampled(
        "bench.pipeline.pipeline_scale", ["--_child", str(work / "spec.json")], REPO, pss=True
    )
    if rc != 0:
        raise RuntimeError(f"pipeline child failed with exit status {rc} ({work})")
    out = json.loads((work / "result.json").read_text())
    mk = out["markers"]
    n_win = mk["window"]["stats"]["n_windows"]
    gib = 1024**3
    emb_bytes = n_win * mk["embed"]["stats"]["dim"] * 4
    r = {
        "docs": docs,
        "workers": workers,
        "backend": backend,
        "mmap_threshold_mib": mmap_mib,
        "windows": n_win,
        "tokens": mk["window"]["stats"]["n_tokens"],
        "seconds": out["seconds"],
        "child_wall_seconds": wall,
        "docs_per_s": docs / out["seconds"],
        "embed_s": mk["embed"]["seconds"],
        "stage_seconds": {k: v["seconds"] for k, v in mk.items()},
        "peak_rss_gib": sampler.peak_total / gib,
        "peak_driver_gib": sampler.peak_root / gib,
        "peak_workers_gib": sampler.peak_children / gib,
        "embeddings_gib": emb_bytes / gib,
        "peak_minus_embeddings_gib": (sampler.peak_total - emb_bytes) / gib,
        "peak_pss_gib": sampler.peak_pss_total / gib,
        "rss_samples": sampler.samples,
        "stage_rss": stage_peaks(sampler.timeline, out["events"]),
        "tree_level_stats": mk["tree"]["stats"]["level_stats"],
    }
    log(
        f"  {out['seconds']:.0f} s, {r['docs_per_s']:.1f} docs/s, embed {r['embed_s']:.0f} s, "
        f"peak RSS {r['peak_rss_gib']:.2f} GiB, PSS {r['peak_pss_gib']:.2f} GiB (driver "
        f"{r['peak_driver_gib']:.2f}, workers "
        f"{r['peak_workers_gib']:.2f}); stages "
        + ", ".join(f"{k} {v:.0f}s" for k, v in r["stage_seconds"].items())
    )
    for name, m in r["stage_rss"].items():
        log(
            f"    {name:9s} driver {m['driver_start_gib']:.2f} -> {m['driver_gib']:.2f} GiB, "
            f"workers {m['workers_start_gib']:.2f} -> {m['workers_gib']:.2f} GiB"
        )
    shutil.rmtree(work, ignore_errors=True)
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, nargs="+", default=[50_000])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--backend", default="openvino-int8", choices=["torch", "openvino-int8"])
    p.add_argument(
        "--mmap-threshold-mib",
        type=int,
        nargs="+",
        default=[4],
        help="EmbedConfig.mmap_threshold_mib values to compare (0: glibc's dynamic threshold)",
    )
    p.add_argument("--tmp", default=None, help="scratch directory (default: the system temp dir)")
    p.add_argument("--out", default=None)
    p.add_argument("--_child", dest="child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child)
    tmp = Path(tempfile.mkdtemp(prefix="memtree-bench-scale-", dir=args.tmp))
    day = _dt.date.today().isoformat()
    out = results_path(args.out, f"pipeline-scale-{day}.json", results_dir(__file__))
    meta = run_meta(args)  # at the start: when the run began, and the load then
    rows: list[dict] = []
    for docs in args.docs:
        corpus = tmp / f"corpus-{docs}.jsonl"
        write_jsonl(corpus_docs(docs), corpus)
        for workers in args.workers:
            for mib in args.mmap_threshold_mib:
                rows.append(one_run(corpus, docs, workers, args.backend, mib, tmp))
            for r in rows:
                one = next(
                    (
                        o
                        for o in rows
                        if o["docs"] == r["docs"]
                        and o["workers"] == 1
                        and o["mmap_threshold_mib"] == r["mmap_threshold_mib"]
                    ),
                    None,
                )
                r["speedup_vs_1_worker"] = r["docs_per_s"] / one["docs_per_s"] if one else None
            write_results({"meta": meta, "rows": rows}, out)  # partial results survive
    return finish({"meta": meta, "rows": rows}, out, COLUMNS)


if __name__ == "__main__":
    raise SystemExit(main())
