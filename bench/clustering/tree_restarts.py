"""k-means restarts per node (`tree.restarts`) against one fit per node, on a demo run's embeddings.

    # seeds 0-7, restarts 1 5 10 20
    .venv/bin/python -m bench.clustering.tree_restarts --run runs/demo
    .venv/bin/python -m bench.clustering.tree_restarts --run runs/demo --seeds 4 --restarts 1 20

For every tree seed and restart count, the demo's tree (3 levels × 4, the pipeline's other tree
settings) is rebuilt on the run's window embeddings (`pipeline/embed/embeddings.npy`), and the
demo's probes are routed from their question text alone (embedded once, by the run's embedder).
Per tree: the mean cosine of each window to its cluster's centroid per level (the k-means
objective) and the routing agreement per level (`eval.rag.routing_agreement`: the share of
probes routed to a cluster holding a window that states the fact). The baseline is restarts = 1,
the paper's rule, built from the same seeds in the same run; the table prints each count's mean
and worst leaf agreement and its ratio to the baseline. JSON + PNG: --out, default
bench/clustering/results/tree-restarts-<date>.json (and .png).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import time
from pathlib import Path

import numpy as np

from bench.common import REPO, finish, log, results_dir, results_path, run_meta
from memtree.clustering.embed import embed_texts, embedder_from_meta
from memtree.clustering.route import route
from memtree.clustering.tree import build_tree, load_tree
from memtree.eval.longtail import build_probes, load_facts
from memtree.eval.plots import new_figure, save_png
from memtree.eval.rag import RagIndex, routing_agreement
from memtree.io import read_json


def objective(x: np.ndarray, tree, paths: np.ndarray) -> list[float]:
    """Per level, the mean cosine of each row of x to its cluster's (re-normalised) centroid."""
    out = []
    for lv in range(tree.levels):
        c = tree.centroids[lv][paths[:, lv]]
        out.append(float((x * (c / np.linalg.norm(c, axis=1, keepdims=True))).sum(1).mean()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--run", type=Path, default=REPO / "runs" / "demo", help="a finished `memtree demo` root"
    )
    ap.add_argument("--seeds", type=int, default=8, help="tree seeds 0 … N-1")
    ap.add_argument("--restarts", type=int, nargs="+", default=[1, 5, 10, 20])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    meta = run_meta(args)  # at the start: when the run began, and the load then
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if 1 not in args.restarts:
        args.restarts = [1, *args.restarts]  # the baseline
    out = results_path(
        args.out, f"tree-restarts-{_dt.date.today().isoformat()}.json", results_dir(__file__)
    )

    pipe = args.run / "pipeline"
    base = load_tree(pipe / "tree")
    cfg = base.meta["config"]
    x = np.asarray(np.load(pipe / "embed" / "embeddings.npy"), dtype=np.float32)
    index = RagIndex.open(pipe)
    windows = index.texts(range(len(index.paths)))
    probe_seed = read_json(args.run / "corpus.json")["spec"][
        "seed"
    ]  # the demo builds probes with the corpus seed
    probes = build_probes(load_facts(args.run / "facts.jsonl"), seed=probe_seed, epochs=1.0)
    emb = base.meta["embedder"]
    q = embed_texts(
        embedder_from_meta(emb, base.path),
        [p["context"] for p in probes],
        strategy=emb.get("strategy", "truncate"),
        batch_size=int(emb.get("batch_size", 64)),
    )
    log(
        f"{x.shape[0]} windows, {len(probes)} probes, embedder backend "
        f"{emb.get('backend', 'torch')}"
    )

    rows = []
    for r in args.restarts:
        for seed in range(args.seeds):
            t = time.perf_counter()
            tree, paths = build_tree(
                x,
                levels=cfg["levels"],
                branching=cfg["branching"],
                batch_size=cfg["batch_size"],
                steps=cfg["steps"],
                balance_factor=cfg["balance_factor"],
                equalize_steps=cfg["equalize_steps"],
                min_points_per_child=cfg["min_points_per_child"],
                seed=seed,
                restarts=r,
            )
            seconds = time.perf_counter() - t
            agree = routing_agreement(windows, paths, probes, route(tree, q))
            once = next(b for b in agree["by_bucket"] if b["bucket"] == "1")["rates"]
            rows.append(
                {
                    "restarts": r,
                    "seed": seed,
                    "build_s": round(seconds, 2),
                    "objective": [round(v, 4) for v in objective(x, tree, paths)],
                    "agreement": [round(v, 4) for v in agree["all"]],
                    "agreement_stated_once": [round(v, 4) for v in once],
                }
            )
            log(
                f"restarts {r:2d} seed {seed}: leaf agreement {agree['all'][-1]:.3f}, "
                f"objective {rows[-1]['objective']}, {seconds:.1f} s"
            )

    summary = []
    base_mean = statistics.mean(row["agreement"][-1] for row in rows if row["restarts"] == 1)
    for r in args.restarts:
        leaf = [row["agreement"][-1] for row in rows if row["restarts"] == r]
        once = [row["agreement_stated_once"][-1] for row in rows if row["restarts"] == r]
        summary.append(
            {
                "restarts": r,
                "leaf_mean": statistics.mean(leaf),
                "leaf_min": min(leaf),
                "stated_once_mean": statistics.mean(once),
                "stated_once_min": min(once),
                "build_s_mean": statistics.mean(
                    row["build_s"] for row in rows if row["restarts"] == r
                ),
                "ratio_to_1": statistics.mean(leaf) / base_mean,
            }
        )
    plot(rows, args.restarts, out.with_suffix(".png"))
    results = {
        "meta": {
            **meta,
            "windows": int(x.shape[0]),
            "probes": len(probes),
            "backend": emb.get("backend", "torch"),
        },
        "rows": summary,
        "trees": rows,
    }
    return finish(
        results,
        out,
        [
            "restarts",
            "leaf_mean",
            "leaf_min",
            "stated_once_mean",
            "stated_once_min",
            "build_s_mean",
            "ratio_to_1",
        ],
    )


def plot(rows: list[dict], restarts: list[int], path: Path) -> None:
    fig = new_figure()
    ax = fig.add_subplot(1, 1, 1)
    for seed in sorted({row["seed"] for row in rows}):
        pts = [(row["restarts"], row["agreement"][-1]) for row in rows if row["seed"] == seed]
        ax.plot(*zip(*pts), marker="o", alpha=0.6, label=f"tree seed {seed}")
    ax.set_xscale("log")
    ax.set_xticks(restarts, [str(r) for r in restarts])
    ax.set_xlabel("k-means restarts per node")
    ax.set_ylabel("probes routed to a leaf stating the fact")
    ax.set_title("Leaf routing agreement of the demo's probes")
    ax.legend(fontsize=7, ncol=2)
    save_png(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
