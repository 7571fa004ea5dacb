"""The unseen-fact control with the gold's prior rank balanced, on finished demo runs.

    .venv/bin/python -m bench.knowledge.unseen_control --root runs/kn-lr1.5e-2 --seeds 0,1,2,3,4

Each seed's run (`<root>/seed-<s>`, as `bench.knowledge.knowledge` lays them out) is scored on its
never-stated facts twice, with the probes `build_probes` draws for the demo: uniform distractors
(`balance_unseen=False`, the design before 2026-12-07) and the gold's rank among its choices by
corpus statement count spread evenly within each attribute (`balance_unseen=True`). Per design and
memory setting (anchor only, generic, fetched): accuracy, whether it lies in `knowledge_check.py`'s
band (chance ± 1.96 binomial standard errors), and how often the scorer picked the most-stated
choice; per design, how often the gold *was* the most-stated choice. The uniform design's
accuracies must equal the run's own report (checked and printed). JSON and PNG: --out, default
bench/knowledge/results/unseen-control-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
from pathlib import Path

from bench.common import finish, log, results_dir, results_path, run_meta
from memtree.eval.longtail import build_probes, load_facts, value_counts
from memtree.eval.model import RunModel
from memtree.eval.tasks import multiple_choice

MODES = ("none", "generic", "fetched")


def prior_rank(p: dict, counts: dict[str, dict[str, int]], i: int) -> int:
    """How many of probe p's choices the corpus states more often than choice i."""
    c = counts[p["attribute"]]
    return sum(c[v] > c[p["choices"][i]] for v in p["choices"])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--root", type=Path, required=True, help="folder of seed-<s> demo roots")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out = results_path(
        args.out, f"unseen-control-{_dt.date.today().isoformat()}.json", results_dir(__file__)
    )
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        run = args.root / f"seed-{seed}"
        report = json.loads((run / "report" / "results.json").read_text())
        epochs = float(report["meta"]["epochs"])
        facts = load_facts(run / "facts.jsonl")
        counts = value_counts(facts)
        rm = RunModel.load(run / "train" / "cotrain", tree_dir=run / "pipeline" / "tree")
        for balanced in (False, True):
            probes = [
                p
                for p in build_probes(facts, seed=seed, epochs=epochs, balance_unseen=balanced)
                if p["mentions"] == 0
            ]
            n = len(probes)
            band = 1.96 * math.sqrt(0.25 * 0.75 / n)
            gold_top = sum(prior_rank(p, counts, p["gold"]) == 0 for p in probes) / n
            paths = rm.route([p["context"] for p in probes])
            for mode in MODES:
                preds = multiple_choice(rm, probes, mode=mode, paths=paths)["predictions"]
                acc = sum(int(k == p["gold"]) for k, p in zip(preds, probes, strict=True)) / n
                picked_top = (
                    sum(prior_rank(p, counts, k) == 0 for k, p in zip(preds, probes, strict=True))
                    / n
                )
                reported = next(
                    b["accuracy"]
                    for b in report["knowledge"]["modes"][mode]["by_bucket"]
                    if b["bucket"] == "0"
                )
                rows.append(
                    {
                        "seed": seed,
                        "design": "balanced" if balanced else "uniform",
                        "mode": mode,
                        "n": n,
                        "accuracy": round(acc, 4),
                        "in_band": abs(acc - 0.25) <= band,
                        "band": round(band, 4),
                        "gold_most_stated": round(gold_top, 3),
                        "picked_most_stated": round(picked_top, 3),
                        "report_accuracy": round(reported, 4) if not balanced else None,
                    }
                )
                log(
                    f"seed {seed} {rows[-1]['design']:8s} {mode:8s} {100 * acc:5.1f} % "
                    f"(band 25 ± {100 * band:.1f}; gold most-stated {gold_top:.2f}, picked "
                    f"most-stated {picked_top:.2f})"
                    + ("" if balanced else f"; report {100 * reported:.1f} %")
                )
    _plot(rows, out.with_suffix(".png"))
    return finish(
        {"meta": run_meta(args), "rows": rows},
        out,
        [
            "seed",
            "design",
            "mode",
            "n",
            "accuracy",
            "in_band",
            "gold_most_stated",
            "picked_most_stated",
            "report_accuracy",
        ],
    )


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({r["seed"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, design in zip(axes, ("uniform", "balanced"), strict=True):
        for j, mode in enumerate(MODES):
            pts = [r for r in rows if r["design"] == design and r["mode"] == mode]
            ax.plot(
                [r["seed"] + (j - 1) * 0.12 for r in pts],
                [100 * r["accuracy"] for r in pts],
                "o",
                label=mode,
            )
        band = max(r["band"] for r in rows if r["design"] == design)
        ax.axhspan(100 * (0.25 - band), 100 * (0.25 + band), color="0.9", zorder=0)
        ax.axhline(25, color="0.5", lw=0.8)
        ax.set_xticks(seeds)
        ax.set_xlabel("demo seed")
        ax.set_title(f"unseen facts, {design} distractors")
    axes[0].set_ylabel("accuracy, %")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
