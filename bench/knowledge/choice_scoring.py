"""Multiple-choice scoring: an item's choices in one row behind the shared question, against one
sequence per choice, on a finished demo run.

    # 1,024 probes
    .venv/bin/python -m bench.knowledge.choice_scoring --run runs/demo
    # all of them
    .venv/bin/python -m bench.knowledge.choice_scoring --run runs/demo --probes 0

The demo's probes (4 choices each) are scored by the co-trained run with `RunModel.choice_scores`
twice per setting: pack=False (the baseline: question + choice as four sequences, the head on every
position) and pack=True (question + the four choices in one row, per-choice positions and mask, the
head only where a choice token is predicted). Settings: the 0-shot question and the RAG item (the
nearest training window prepended, as the demo's RAG rows score it), anchor only and fetched
memory. Per setting: seconds of each, their ratio, the largest score difference and whether the
picked choice is the same for every probe. Same process, same batches (16 items), one after the
other; torch threads as set (`--threads`, default all cores). JSON: --out, default
bench/knowledge/results/choice-scoring-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import REPO, finish, log, results_dir, results_path, run_meta
from memtree.eval.longtail import build_probes, load_facts
from memtree.eval.model import RunModel
from memtree.eval.rag import RagIndex, rag_items


def score(
    rm: RunModel, items: list[dict], paths: np.ndarray | None, mode: str, pack: bool, batch: int
) -> tuple[float, list[list[float]], int]:
    """Seconds, scores and tokens run through the model for `items` at `batch` items per forward."""
    encoded = [
        (rm.encode(it["context"]), [rm.encode(" " + c.strip()) for c in it["choices"]])
        for it in items
    ]
    tokens = sum(
        len(q) + sum(map(len, cs)) if pack else sum(len(q) + len(c) for c in cs)
        for q, cs in encoded
    )
    t0 = time.perf_counter()
    out: list[list[float]] = []
    for s in range(0, len(encoded), batch):
        rows = None if mode != "fetched" else paths[s : s + batch]
        out += rm.choice_scores(encoded[s : s + batch], paths=rows, mode=mode, pack=pack)
    return time.perf_counter() - t0, out, tokens


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--run", type=Path, default=REPO / "runs" / "demo", help="a finished `memtree demo` root"
    )
    ap.add_argument("--probes", type=int, default=1024, help="probes, evenly spread (0: all)")
    ap.add_argument("--batch", type=int, default=16, help="items per forward")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = results_path(
        args.out, f"choice-scoring-{_dt.date.today().isoformat()}.json", results_dir(__file__)
    )
    meta = run_meta(args, threads=torch.get_num_threads())
    rm = RunModel.load(args.run / "train" / "cotrain", tree_dir=args.run / "pipeline" / "tree")
    probes = build_probes(load_facts(args.run / "facts.jsonl"), seed=0)
    if args.probes:
        probes = probes[:: max(1, len(probes) // args.probes)][: args.probes]
    paths = rm.route([p["context"] for p in probes])
    rag, _ = rag_items(rm, RagIndex.open(args.run / "pipeline"), probes)
    rows = []
    for setting, items in (("question", probes), ("rag", rag)):
        for mode in ("none", "fetched"):
            log(f"{setting} / {mode}: {len(items)} probes")
            base_s, base, base_tokens = score(rm, items, paths, mode, False, args.batch)
            packed_s, packed, packed_tokens = score(rm, items, paths, mode, True, args.batch)
            b, p = np.asarray(base), np.asarray(packed)
            rows.append(
                {
                    "setting": setting,
                    "mode": mode,
                    "probes": len(items),
                    "separate_s": round(base_s, 2),
                    "one_row_s": round(packed_s, 2),
                    "speedup": round(base_s / packed_s, 2),
                    "tokens_separate": base_tokens,
                    "tokens_one_row": packed_tokens,
                    "max_abs_score_diff": float(np.abs(b - p).max()),
                    "same_choice": bool((b.argmax(1) == p.argmax(1)).all()),
                }
            )
            log(
                f"  separate {base_s:.1f} s, one row {packed_s:.1f} s ({base_s / packed_s:.2f}x), "
                f"max |Δscore| {rows[-1]['max_abs_score_diff']:.2e}"
            )
    results = {"meta": meta, "rows": rows}
    return finish(
        results,
        out,
        [
            "setting",
            "mode",
            "probes",
            "separate_s",
            "one_row_s",
            "speedup",
            "tokens_separate",
            "tokens_one_row",
            "max_abs_score_diff",
            "same_choice",
        ],
    )


if __name__ == "__main__":
    raise SystemExit(main())
