"""Retention (App. D/E spirit): does rare knowledge survive more anchor training when it sits in
memories?

From a run with a memory bank, training continues (`training.train.train`,
mode `cotrain`, the same code as `memtree train`) on *other* data — only some
level-1 subtrees of the same shards, i.e. a disjoint part of the topics — for
`steps` batches, with the bank frozen (`memory.init_bank` = the run's bank,
`memory.lr = memory.weight_decay = 0`: every bank update is exactly zero) so
only the anchor changes. The long-tail probes are then scored before (the
run's anchor) and after (the continued anchor), both with the run's own bank,
anchor-only / generic / fetched, split into probes whose subtree the continued
training revisited and those it did not. Forgetting = accuracy before − after,
overall and per mention-frequency bucket.

Outputs in OUT: `continued/` (the training run), results.json, report.md and
retention.png. Reruns resume: a finished continued run is not trained again.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memtree.config import ConfigError, load_config, to_dict
from memtree.eval.knowledge import MODE_LABEL, knowledge_eval, load_eval_inputs
from memtree.eval.longtail import BUCKETS, bucket_label
from memtree.eval.model import RunModel
from memtree.eval.plots import new_figure, save_png
from memtree.eval.runinfo import run_config
from memtree.eval.sweeps import check_overrides, ensure_trained
from memtree.io import atomic_write_json, atomic_write_text, read_json
from memtree.training.config import TrainConfig
from memtree.training.data import read_shards_manifest

# What makes the experiment what it is; overrides may change anything else (e.g. optim.lr).
RESERVED = (
    "mode",
    "anchor_checkpoint",
    "memory.init_bank",
    "memory.lr",
    "memory.weight_decay",
    "data.subtrees",
    "max_duration",
    "save_folder",
    "run_name",
    "seed",
)
GROUPS = {
    "all": "all probes",
    "revisited": "subtree in the continued data",
    "not_revisited": "subtree not in the continued data",
}


@dataclass(frozen=True, kw_only=True)
class RetentionConfig:
    run: str  # a training run with a bank (anchor.safetensors, bank/, memtree_config.json)
    out: str
    facts: str  # facts JSONL (memtree pipeline demo-corpus --facts …)
    steps: int = 100  # continued-training batches
    subtrees: list[int] | None = None  # level-1 subtrees to continue on (≥ 2); None: a seeded half
    train: list[str] = field(default_factory=list)  # key=value overrides of the continued run
    tree: str | None = None  # clustering tree (default: next to the run's shards)
    held_out: str | None = None  # JSONL of {"text": …} for held-out perplexity
    max_probes: int = 0  # 0 = all
    seed: int = 0  # continued training, the default subtree split and the probes

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise ConfigError(f"steps: {self.steps} must be positive")
        if self.subtrees is not None and len(set(self.subtrees)) < 2:
            raise ConfigError(
                f"subtrees: {self.subtrees} — give at least two distinct subtrees (one subtree "
                "trains a per-subtree bank, which cannot start from the run's whole bank)"
            )
        check_overrides(self.train, "train", RESERVED)


def load_retention_config(
    path: str | Path | None, overrides: Sequence[str] = ()
) -> RetentionConfig:
    return load_config(RetentionConfig, str(path) if path else None, list(overrides))


def default_subtrees(shards: str | Path, seed: int) -> list[int]:
    """A seeded half (at least two) of the level-1 subtrees that hold samples; the rest stay
    unvisited."""
    avail = sorted(
        s["subtree"] for s in read_shards_manifest(shards)["streams"] if s["n_samples"] > 0
    )
    if len(avail) < 3:
        raise ConfigError(
            f"subtrees: the shards hold samples in {len(avail)} subtrees; retention needs at "
            "least 3 (two to continue on, one left unvisited)"
        )
    return sorted(random.Random(seed).sample(avail, max(2, len(avail) // 2)))


def continued_config(cfg: RetentionConfig) -> TrainConfig:
    """The run's own config, continued on `subtrees` for `steps` batches with the bank frozen."""
    run = Path(cfg.run)
    base = run_config(
        run
    )  # data.shards (and model.hf_dir) resolved for a run moved from where it trained
    if not any(base.memory.multipliers) or not (run / "bank").exists():
        raise ConfigError(
            f"run: {run} has no memory bank; retention compares memories with the anchor alone"
        )
    subtrees = (
        sorted(set(cfg.subtrees)) if cfg.subtrees else default_subtrees(base.data.shards, cfg.seed)
    )
    return load_config(
        TrainConfig,
        to_dict(base),
        [
            "mode=cotrain",
            f"anchor_checkpoint={run}",
            f"memory.init_bank={run / 'bank'}",
            "memory.lr=0.0",
            "memory.weight_decay=0.0",
            f"data.subtrees=[{','.join(map(str, subtrees))}]",
            f"max_duration={cfg.steps}ba",
            f"save_folder={Path(cfg.out) / 'continued'}",
            f"run_name={base.run_name}-retention",
            f"seed={cfg.seed}",
            *cfg.train,
        ],
    )


def _compare(
    probes: list[dict], before: list[int], after: list[int], mask: np.ndarray
) -> dict[str, Any]:
    gold = np.asarray([p["gold"] for p in probes])
    ok_b, ok_a = np.asarray(before) == gold, np.asarray(after) == gold
    mentions = np.asarray([p["mentions"] for p in probes])

    def acc(ok: np.ndarray, m: np.ndarray) -> float | None:
        return float(ok[m].mean()) if m.any() else None

    b, a = acc(ok_b, mask), acc(ok_a, mask)
    rows = []
    for lo, hi in BUCKETS:
        m = mask & (mentions >= lo) & (mentions < hi)
        rows.append(
            {
                "bucket": bucket_label(lo, hi),
                "n": int(m.sum()),
                "before": acc(ok_b, m),
                "after": acc(ok_a, m),
            }
        )
    return {
        "n": int(mask.sum()),
        "before": b,
        "after": a,
        "forgetting": None if b is None else b - a,
        "by_bucket": rows,
    }


def run_retention(cfg: RetentionConfig, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Continue training (or resume), score before and after; returns the results with their
    files."""
    from safetensors.torch import load_file

    tc = continued_config(cfg)
    rm = RunModel.load(
        cfg.run, tree_dir=cfg.tree, tree_key="tree="
    )  # before training: a missing tree fails fast
    status = ensure_trained(tc, log)
    probes, held_out = load_eval_inputs(
        cfg.facts, held_out=cfg.held_out, max_probes=cfg.max_probes, seed=cfg.seed
    )
    before = knowledge_eval(rm, probes, held_out)
    rm.model.load_state_dict(
        load_file(str(Path(tc.save_folder) / "anchor.safetensors"))
    )  # same bank, new anchor
    after = knowledge_eval(rm, probes, held_out)

    revisited = np.isin(rm.route([p["context"] for p in probes])[:, 0], tc.data.subtrees)
    masks = {
        "all": np.ones(len(probes), dtype=bool),
        "revisited": revisited,
        "not_revisited": ~revisited,
    }
    modes = {}
    for mode, row in before["modes"].items():
        modes[mode] = {
            g: _compare(probes, row["predictions"], after["modes"][mode]["predictions"], m)
            for g, m in masks.items()
        }
        if held_out:
            modes[mode]["perplexity"] = {
                "before": row["perplexity"],
                "after": after["modes"][mode]["perplexity"],
            }
    result = {
        "config": to_dict(cfg),
        "subtrees": list(tc.data.subtrees),
        "n_probes": len(probes),
        "continued": {
            "save_folder": tc.save_folder,
            "steps": cfg.steps,
            "status": status,
            "train_metrics": read_json(Path(tc.save_folder) / "metrics.json")["train"],
        },
        "modes": modes,
    }
    result["files"] = write_retention_report(Path(cfg.out), result)
    return result


def _pct(v: float | None, signed: bool = False) -> str:
    return "—" if v is None else (f"{v:+.1%}" if signed else f"{v:.1%}")


def write_retention_report(out: Path, result: dict[str, Any]) -> dict[str, str]:
    """OUT/results.json, OUT/report.md, OUT/retention.png."""
    out.mkdir(parents=True, exist_ok=True)
    modes = {
        m: result["modes"][m] for m in MODE_LABEL if m in result["modes"]
    }  # JSON-loaded ones come sorted
    first = next(iter(modes.values()))
    lines = [
        "# memtree retention",
        "",
        (
            f"Continued training of the anchor for {result['continued']['steps']} batches on "
            f"level-1 subtrees {result['subtrees']} with the memory bank frozen; "
            f"{result['n_probes']} long-tail probes ({first['revisited']['n']} in those subtrees, "
            f"{first['not_revisited']['n']} elsewhere). Forgetting = accuracy before − after "
            "(positive: forgotten)."
        ),
        "",
    ]
    for g, label in GROUPS.items():
        lines += [
            f"## Probes: {label} (n={first[g]['n']})",
            "",
            "| setting | before | after | forgetting |",
            "|---|---:|---:|---:|",
        ]
        for mode, r in modes.items():
            lines.append(
                f"| {MODE_LABEL[mode]} | {_pct(r[g]['before'])} | {_pct(r[g]['after'])} | "
                f"{_pct(r[g]['forgetting'], signed=True)} |"
            )
        lines.append("")
    buckets = first["not_revisited"]["by_bucket"]
    lines += [
        "## Not-revisited probes by how many documents state the fact (before → after)",
        "",
        "| setting | " + " | ".join(f"{b['bucket']} (n={b['n']})" for b in buckets) + " |",
        "|---|" + "---:|" * len(buckets),
    ]
    for mode, r in modes.items():
        cells = [
            f"{_pct(b['before'])} → {_pct(b['after'])}" for b in r["not_revisited"]["by_bucket"]
        ]
        lines.append(f"| {MODE_LABEL[mode]} | " + " | ".join(cells) + " |")
    if "perplexity" in first:
        lines += ["", "| setting | held-out perplexity before | after |", "|---|---:|---:|"]
        lines += [
            f"| {MODE_LABEL[m]} | {r['perplexity']['before']:.2f} | {r['perplexity']['after']:.2f} "
            "|"
            for m, r in modes.items()
        ]

    fig = new_figure(10, 4)
    ax = fig.add_subplot(1, 2, 1)
    x = np.arange(len(GROUPS))
    width = 0.8 / (2 * len(modes))
    for k, (mode, r) in enumerate(modes.items()):
        for j, when in enumerate(("before", "after")):
            ax.bar(
                x + (2 * k + j) * width - 0.4 + width / 2,
                [r[g][when] or 0 for g in GROUPS],
                width,
                label=f"{MODE_LABEL[mode]}, {when}",
                alpha=0.45 if when == "before" else 1.0,
                color=f"C{k}",
            )
    ax.set_xticks(x, list(GROUPS))
    ax.set_ylabel("probe accuracy")
    ax.set_title("before vs after continued anchor training")
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    ax = fig.add_subplot(1, 2, 2)
    for k, (mode, r) in enumerate(modes.items()):
        pts = [
            (i, b["before"] - b["after"])
            for i, b in enumerate(r["not_revisited"]["by_bucket"])
            if b["before"] is not None
        ]
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            color=f"C{k}",
            label=MODE_LABEL[mode],
        )
    ax.axhline(0, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(buckets)), [b["bucket"] for b in buckets])
    ax.set_xlabel("documents stating the fact")
    ax.set_ylabel("forgetting (accuracy before − after)")
    ax.set_title("not-revisited probes")
    ax.legend(fontsize=7)
    fig.subplots_adjust(wspace=0.3)
    save_png(fig, out / "retention.png")
    atomic_write_json(out / "results.json", result)
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    return {
        "json": str(out / "results.json"),
        "markdown": str(out / "report.md"),
        "png": str(out / "retention.png"),
    }
