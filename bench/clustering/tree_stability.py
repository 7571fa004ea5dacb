"""How much a pipeline's tree depends on its draw: the paper's top-down rule against `tree.method:
bottomup`, on finished pipeline runs' window embeddings.

    .venv/bin/python -m bench.clustering.tree_stability --run runs/knowledge-bu/seed-{0,1,2,3,4}
    .venv/bin/python -m bench.clustering.tree_stability --run runs/realdocs --tree-seeds 0 1 2 \
        --drops 2

For every run (a `memtree demo` root or any folder holding `pipeline/`) and each method, the tree
is rebuilt with the run's tree settings (levels, branching, restarts, balance …) from several tree
seeds, and from each seed again on the embeddings with 1 % of the windows dropped (`--drops`
draws; a corpus that differs in 1 % of its documents, every other window embedded identically).
Per level it reports:
- the adjusted Rand index between the tree and its 1 %-dropped rebuild, on the windows both hold
  (the issue's target: ≥ 0.95 at level 2), and between the trees of two tree seeds;
- with a bios corpus (corpus.jsonl with field / domain / topic), purity against the corpus's own
  fields, domains and subtopics at levels 1 / 2 / 3 (target ≥ 0.95 at level 2).
The baseline is the top-down rule, built in the same run from the same embeddings and seeds.
JSON + PNG: --out, default bench/clustering/results/tree-stability-<date>.json (and .png).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sklearn.metrics import adjusted_rand_score

from bench.common import finish, log, results_dir, results_path, run_meta
from bench.pipeline.tree import purity
from memtree.clustering.bottomup import build_tree_bottomup
from memtree.clustering.tree import build_tree
from memtree.eval.plots import new_figure, save_png
from memtree.io import read_json

LABELS = ("field", "domain", "topic")  # a bios corpus's structure, level 1 / 2 / 3


def load_run(root: Path) -> tuple[np.ndarray, dict, dict[str, np.ndarray]]:
    """(window embeddings (n, d) float32, the run's tree config, {label: (n,) per window})."""
    pipe = root / "pipeline" if (root / "pipeline").is_dir() else root
    x = np.asarray(np.load(pipe / "embed" / "embeddings.npy"), dtype=np.float32)
    cfg = read_json(pipe / "tree" / "tree.json")["config"]
    labels: dict[str, np.ndarray] = {}
    if (root / "corpus.jsonl").exists():
        assign = pa.concat_tables(
            [pq.read_table(p) for p in sorted((pipe / "assign").glob("part-*.parquet"))]
        )
        docs = assign["doc_ordinal"].to_numpy()[np.argsort(assign["window_ordinal"].to_numpy())]
        with open(root / "corpus.jsonl") as f:
            records = [json.loads(line) for line in f]
        if all(k in records[0] for k in LABELS):
            labels = {k: np.array([records[d][k] for d in docs]) for k in LABELS}
    return x, cfg, labels


def build(method: str, x: np.ndarray, cfg: dict, seed: int) -> np.ndarray:
    kw = {
        k: cfg[k]
        for k in (
            "levels",
            "branching",
            "batch_size",
            "steps",
            "balance_factor",
            "equalize_steps",
            "min_points_per_child",
            "restarts",
            "converge_tol",
        )
    }
    if method == "bottomup":
        return build_tree_bottomup(x, seed=seed, **kw)[1]
    return build_tree(
        x,
        seed=seed,
        strict_balance=cfg.get("strict_balance", False),
        balance_target=cfg.get("balance_target"),
        **kw,
    )[1]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--run",
        type=Path,
        nargs="+",
        required=True,
        help="pipeline runs (demo roots or run folders)",
    )
    ap.add_argument(
        "--methods", nargs="+", default=["topdown", "bottomup"], choices=["topdown", "bottomup"]
    )
    ap.add_argument("--tree-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--drops", type=int, default=2, help="1 %%-dropped rebuilds per tree seed")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    meta = run_meta(args)
    out = results_path(
        args.out, f"tree-stability-{_dt.date.today().isoformat()}.json", results_dir(__file__)
    )
    trees, rows = [], []
    for root in args.run:
        x, cfg, labels = load_run(root)
        levels = int(cfg["levels"])
        log(
            f"{root}: {len(x)} windows, {cfg['branching']}^{levels} leaves, restarts "
            f"{cfg['restarts']}"
            f"{', labelled' if labels else ''}"
        )
        for method in args.methods:
            paths = {}
            for seed in args.tree_seeds:
                t = time.perf_counter()
                paths[seed] = build(method, x, cfg, seed)
                seconds = time.perf_counter() - t
                row = {
                    "run": str(root),
                    "method": method,
                    "seed": seed,
                    "build_s": round(seconds, 2),
                    "ari_drop": [],
                    "purity": {},
                }
                for d in range(args.drops):
                    keep = np.sort(
                        np.random.default_rng([7, seed, d]).permutation(len(x))[
                            : len(x) - len(x) // 100
                        ]
                    )
                    fewer = build(method, x[keep], cfg, seed)
                    row["ari_drop"].append(
                        [
                            adjusted_rand_score(paths[seed][keep, lv], fewer[:, lv])
                            for lv in range(levels)
                        ]
                    )
                for lv, key in enumerate(LABELS[:levels] if labels else ()):
                    row["purity"][f"l{lv + 1}_{key}"] = purity(labels[key], paths[seed][:, lv])
                trees.append(row)
                worst = (
                    min(a[min(1, levels - 1)] for a in row["ari_drop"]) if row["ari_drop"] else None
                )
                log(
                    f"  {method} seed {seed}: ARI at level 2 under a 1 % drop {worst}, purity "
                    f"{ {k: round(v, 3) for k, v in row['purity'].items()} }, {seconds:.1f} s"
                )
            seeds_ari = [
                [adjusted_rand_score(paths[a][:, lv], paths[b][:, lv]) for lv in range(levels)]
                for a, b in itertools.combinations(args.tree_seeds, 2)
            ]
            mine = [r for r in trees if r["run"] == str(root) and r["method"] == method]
            l2 = min(1, levels - 1)
            rows.append(
                {
                    "run": root.name,
                    "method": method,
                    "ari_drop_l2_min": min(a[l2] for r in mine for a in r["ari_drop"])
                    if args.drops
                    else None,
                    "ari_drop_l2_mean": statistics.mean(a[l2] for r in mine for a in r["ari_drop"])
                    if args.drops
                    else None,
                    "ari_seeds_l2_min": min(a[l2] for a in seeds_ari) if seeds_ari else None,
                    "purity_l2_min": min(r["purity"]["l2_domain"] for r in mine)
                    if labels
                    else None,
                    "purity_l2_mean": statistics.mean(r["purity"]["l2_domain"] for r in mine)
                    if labels
                    else None,
                    "purity_l1_mean": statistics.mean(r["purity"]["l1_field"] for r in mine)
                    if labels
                    else None,
                    "build_s_mean": statistics.mean(r["build_s"] for r in mine),
                }
            )
    plot(rows, out.with_suffix(".png"))
    return finish(
        {"meta": meta, "rows": rows, "trees": trees},
        out,
        [
            "run",
            "method",
            "ari_drop_l2_min",
            "ari_drop_l2_mean",
            "ari_seeds_l2_min",
            "purity_l2_min",
            "purity_l2_mean",
            "purity_l1_mean",
            "build_s_mean",
        ],
    )


def plot(rows: list[dict], path: Path) -> None:
    fig = new_figure()
    ax = fig.add_subplot(1, 1, 1)
    runs = list(dict.fromkeys(r["run"] for r in rows))
    for k, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
        mine = {r["run"]: r for r in rows if r["method"] == method}
        xs = [i + 0.2 * (k - 0.5) for i in range(len(runs))]
        ax.scatter(
            xs,
            [mine[r]["ari_drop_l2_min"] for r in runs],
            marker="o",
            label=f"{method}: ARI, 1 % dropped",
        )
        if any(mine[r]["purity_l2_min"] is not None for r in runs):
            ax.scatter(
                xs,
                [mine[r]["purity_l2_min"] for r in runs],
                marker="^",
                label=f"{method}: domain purity",
            )
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(runs)), runs, rotation=30, fontsize=7)
    ax.set_ylabel("level 2, worst over tree seeds")
    ax.set_title("Tree stability: top-down (paper) vs bottom-up")
    ax.legend(fontsize=7)
    save_png(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
