"""Int8 OpenVINO embedding backend against raw torch `SentenceTransformer.encode` (issue #16).

    # 1,000 docs, 256 timed, one setting
    .venv/bin/python -m bench.clustering.embed_backends --quick
    # 3,000 docs, 512 timed, msl 128/256 x 1/2 threads
    .venv/bin/python -m bench.clustering.embed_backends

The issue's bar for making `embed.backend: openvino-int8` the default: >= 2x raw torch encode on
the same texts and threads, embeddings at cosine >= 0.99 to the torch ones, and leaf NMI on a
labelled corpus within 1 %. Data: the synthetic corpus (`pipeline.corpus.topical`, seed 0), labels
domain x topic (64 classes). The int8 export is calibrated on 300 documents that are not in the
measured set (the pipeline calibrates on the corpus's own first windows). Speed: interleaved
rounds (A B, B A) of encode on the first `timed` documents per (max_seq_length, threads) setting,
batch 64. Accuracy: every document embedded by both at the pipeline's default max_seq_length
(256), then `build_tree` 2 x 8 and 2 x 16 on each, leaf NMI against the labels. JSON: --out,
default bench/clustering/results/embed-backends-<date>[-quick].json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import finish, log, results_dir, results_path, run_meta
from memtree.clustering.embed import default_model_path, embed_texts, load_embedder
from memtree.clustering.embed_export import export_openvino_int8
from memtree.clustering.tree import build_tree
from memtree.pipeline.corpus.topical import CorpusSpec, generate_corpus

COLUMNS = ["setting", "torch_docs_per_s", "int8_docs_per_s", "speedup"]
CALIBRATION = 300


def measure(
    *, n_docs: int, timed: int, settings: list[tuple[int, int]], rounds: int, quality: bool = True
) -> dict:
    """Int8 OpenVINO against torch encode on the synthetic corpus: speed per (max_seq_length,
    threads) setting on the first `timed` docs (interleaved rounds, batch 64), cosine over all
    `n_docs` at max_seq_length 256 (or the largest measured), and with `quality` the leaf NMI of
    trees built on each. Returns {rows, runs_seconds, export_seconds, cosine, leaf_nmi}."""
    import torch
    from sklearn.metrics import normalized_mutual_info_score

    docs = list(generate_corpus(CorpusSpec(n_docs=n_docs + CALIBRATION, seed=0)))
    calib = [d["text"] for d in docs[n_docs:]]
    docs = docs[:n_docs]
    texts = [d["text"] for d in docs]
    pairs = sorted({(d["domain"], d["topic"]) for d in docs})
    labels = np.array([pairs.index((d["domain"], d["topic"])) for d in docs])

    tmp = Path(tempfile.mkdtemp(prefix="memtree-bench-ov-"))
    exports, export_s = {}, {}
    for msl in sorted({m for m, _ in settings}):
        t = time.perf_counter()
        exports[msl] = str(tmp / f"msl{msl}")
        export_openvino_int8(default_model_path(), exports[msl], calib, max_seq_length=msl)
        export_s[msl] = time.perf_counter() - t
        log(
            f"int8 export (max_seq_length {msl}, {CALIBRATION} calibration docs): "
            f"{export_s[msl]:.1f} s"
        )

    def models(msl: int, threads: int):
        torch.set_num_threads(threads)
        return {
            "torch": load_embedder(None, device="cpu", max_seq_length=msl),
            "int8": load_embedder(
                exports[msl], max_seq_length=msl, backend="openvino-int8", threads=threads
            ),
        }

    rows, runs = [], {}
    for msl, threads in settings:
        ms = models(msl, threads)
        for m in ms.values():
            embed_texts(m, texts[:64])  # warm-up
        secs: dict[str, list[float]] = {k: [] for k in ms}
        for r in range(rounds):
            for k in list(ms) if r % 2 == 0 else list(ms)[::-1]:
                t = time.perf_counter()
                embed_texts(ms[k], texts[:timed])
                secs[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in secs.items()}
        name = f"msl {msl}, {threads} thread{'s' if threads > 1 else ''}"
        runs[name] = secs
        rows.append(
            {
                "setting": name,
                "torch_docs_per_s": timed / med["torch"],
                "int8_docs_per_s": timed / med["int8"],
                "speedup": med["torch"] / med["int8"],
            }
        )
        log(
            f"{name}: torch {timed / med['torch']:.1f} docs/s, int8 {timed / med['int8']:.1f} "
            "docs/s, "
            f"{med['torch'] / med['int8']:.2f}x"
        )

    msl = 256 if 256 in exports else max(exports)
    ms = models(msl, max(t for _, t in settings))
    emb = {}
    for k, m in ms.items():
        t = time.perf_counter()
        emb[k] = embed_texts(m, texts)
        log(f"all {n_docs} docs, {k}: {time.perf_counter() - t:.1f} s")
    cos = (emb["torch"] * emb["int8"]).sum(1)
    nmis = {}
    for levels, branching in ((2, 8), (2, 16)) if quality else ():
        nmi = {}
        for k, x in emb.items():
            _, paths = build_tree(x, levels=levels, branching=branching, seed=0)
            nmi[k] = float(normalized_mutual_info_score(labels, paths[:, -1]))
        nmis[f"{levels}x{branching}"] = {**nmi, "ratio": nmi["int8"] / nmi["torch"]}
        log(
            f"leaf NMI {levels} x {branching}: torch {nmi['torch']:.4f}, int8 {nmi['int8']:.4f} "
            f"({nmi['int8'] / nmi['torch']:.4f}x)"
        )
    cosine = {
        "min": float(cos.min()),
        "p01": float(np.quantile(cos, 0.01)),
        "mean": float(cos.mean()),
        "frac_below_0.99": float((cos < 0.99).mean()),
        "max_seq_length": msl,
    }
    log(
        f"cosine int8 vs torch over {n_docs} docs: min {cosine['min']:.4f}, 1st percentile "
        f"{cosine['p01']:.4f}, mean {cosine['mean']:.4f}, below 0.99: "
        f"{100 * cosine['frac_below_0.99']:.1f} %"
    )
    return {
        "rows": rows,
        "runs_seconds": runs,
        "export_seconds": export_s,
        "cosine": cosine,
        "leaf_nmi": nmis,
    }


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    meta = run_meta(args)  # at the start: when the run began, and the load then
    n_docs, timed = (1000, 256) if args.quick else (3000, 512)
    settings = [(256, 1)] if args.quick else [(256, 1), (256, 2), (128, 1), (128, 2)]
    res = measure(n_docs=n_docs, timed=timed, settings=settings, rounds=args.rounds)
    msl = res["cosine"]["max_seq_length"]
    at_default = next(r for r in res["rows"] if r["setting"].startswith(f"msl {msl}, 1 thread"))
    verdict = {
        "speed_2x": at_default["speedup"] >= 2.0,
        "cosine_0.99_min": res["cosine"]["min"] >= 0.99,
        "nmi_within_1pct": all(q["ratio"] >= 0.99 for q in res["leaf_nmi"].values()),
    }
    log(f"default criteria (pipeline settings: msl {msl}, one thread per worker): {verdict}")
    results = {
        "meta": {**meta, "docs": n_docs, "timed_docs": timed, "calibration_docs": CALIBRATION},
        **res,
        "default_criteria": verdict,
    }
    day = _dt.date.today().isoformat()
    out = results_path(
        args.out,
        f"embed-backends-{day}{'-quick' if args.quick else ''}.json",
        results_dir(__file__),
    )
    return finish(results, out, COLUMNS)


if __name__ == "__main__":
    raise SystemExit(main())
