"""Which embedder a small corpus should get on the CPU: the pipeline's embed stage end to end
(the int8 export with its calibration, then the embedding) with each backend, on corpora of
several sizes (issue 70 item 5).

    .venv/bin/python -m bench.pipeline.embed_choice                 # 300 and 3,000 documents
    .venv/bin/python -m bench.pipeline.embed_choice --docs 300 1000 4000 --max-seq-length 128

Every run starts from an empty embedder cache (its own MEMTREE_CACHE_DIR), so the int8 backend
pays its export and calibration as a new corpus does; torch pays its model load. Per backend, a
least-squares line through (windows, seconds) gives a fixed cost and a cost per window, and the
break-even corpus size is where the two lines cross. The baseline (torch) runs in the same
process on the same windows. JSON: --out, default bench/pipeline/results/embed-choice-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

from bench.common import finish, log, results_dir, results_path, run_meta
from bench.pipeline.common import corpus_docs, pipeline_cfg, quiet, write_jsonl
from memtree.pipeline.run import run_pipeline

BACKENDS = ("torch", "openvino-int8")


def embed_once(root: Path, inputs: list[str], backend: str, msl: int) -> dict:
    """One pipeline run up to `embed` in a fresh folder and a fresh embedder cache → the stage's
    figures."""
    cache = Path(tempfile.mkdtemp(dir=root, prefix="cache-"))
    cfg = pipeline_cfg(
        root / f"run-{backend}",
        inputs,
        embed={"device": "cpu", "backend": backend, "max_seq_length": msl},
    )  # the pipeline's default Dask cluster, as a user's run gets it
    with mock.patch.dict(os.environ, {"MEMTREE_CACHE_DIR": str(cache)}):  # restored after
        t0 = time.time()
        st = run_pipeline(cfg, until="embed", log=quiet)["embed"]["stats"]
        wall = time.time() - t0
    return {
        "windows": st["n"],
        "export_seconds": st["export_seconds"],
        "export_obtained": st["export_obtained"],
        "embed_seconds": st["embed_seconds"],
        "stage_seconds": round(st["export_seconds"] + st["embed_seconds"], 3),
        "run_seconds": round(wall, 3),
    }


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed seconds, seconds per window) of the least-squares line through (windows, s)."""
    n, s = np.array(points, dtype=np.float64).T
    slope, fixed = np.polyfit(n, s, 1)
    return float(fixed), float(slope)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[300, 3000])
    ap.add_argument("--max-seq-length", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if len(set(args.docs)) < 2:
        ap.error("--docs: at least two corpus sizes (the lines need two points)")
    out = results_path(
        args.out, f"embed-choice-{time.strftime('%Y-%m-%d')}.json", results_dir(__file__)
    )
    results: dict = {"meta": run_meta(args, argv=sys.argv[1:]), "rows": []}
    with tempfile.TemporaryDirectory(prefix="embed-choice-") as tmp:
        for n_docs in args.docs:
            corpus = Path(tmp) / f"corpus-{n_docs}.jsonl"
            write_jsonl(corpus_docs(n_docs), corpus)
            for backend in BACKENDS:  # the baseline first, then the candidate, same windows
                root = Path(tmp) / f"d{n_docs}"
                root.mkdir(exist_ok=True)
                r = embed_once(root, [str(corpus)], backend, args.max_seq_length)
                r.update(docs=n_docs, backend=backend)
                log(
                    f"{n_docs} docs, {backend}: {r['windows']} windows, export "
                    f"{r['export_seconds']:.1f} s + embed {r['embed_seconds']:.1f} s"
                )
                results["rows"].append(r)
    lines = {
        b: fit([(r["windows"], r["stage_seconds"]) for r in results["rows"] if r["backend"] == b])
        for b in BACKENDS
    }
    (f_t, s_t), (f_i, s_i) = lines["torch"], lines["openvino-int8"]
    results["lines"] = {b: {"fixed_s": f, "per_window_s": s} for b, (f, s) in lines.items()}
    results["speedup_per_window"] = s_t / s_i
    results["break_even_windows"] = (f_i - f_t) / (s_t - s_i) if s_t > s_i else None
    lines_out = [
        f"{r['docs']} docs ({r['windows']} windows), {r['backend']}: stage {r['stage_seconds']:.1f}"
        f" s (export {r['export_seconds']:.1f}, embed {r['embed_seconds']:.1f})"
        for r in results["rows"]
    ]
    be = results["break_even_windows"]
    lines_out.append(
        f"per window: torch {1e3 * s_t:.2f} ms, int8 {1e3 * s_i:.2f} ms ({s_t / s_i:.2f}x); fixed: "
        f"torch {f_t:.1f} s, int8 {f_i:.1f} s; break-even "
        + (f"{be:,.0f} windows" if be is not None else "none (int8 not faster per window)")
    )
    return finish(results, out, lambda _rows: print("\n".join(lines_out)))


if __name__ == "__main__":
    raise SystemExit(main())
