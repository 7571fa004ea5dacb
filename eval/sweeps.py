"""Reusable sweeps (App. F memory location, Fig. 3 memory size): settings → training runs →
knowledge eval → report.

A sweep YAML (see eval/yamls/) names a base training config, overrides shared
by every run, and a list of settings, each a name plus its own `key=value`
training overrides. `expand` turns it into one `TrainConfig` per setting
(saved under OUT/runs/<setting>, run name `<sweep>-<setting>`, the sweep's
seed) with its parameter accounting from `memtree.geometry.plan`; `run_sweep`
trains each with `training.train.train` — the code behind `memtree train` —
scores it with `knowledge_eval` and writes OUT/results.json, OUT/report.md and
OUT/sweep.png (the metric per memory setting vs the setting) beside each
run's own evaluation report (OUT/runs/<setting>/eval/).

Reruns resume: a run whose `metrics.json` exists (the trainer writes it
atomically after the anchor and bank are exported) is not trained again —
unless its recorded config differs, which is an error rather than a silent
reuse — and its evaluation is reused when the probes are the same.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from memtree.config import ConfigError, load_config, to_dict
from memtree.eval.knowledge import MODE_LABEL, knowledge_eval, load_eval_inputs, write_report
from memtree.eval.model import RunModel
from memtree.eval.plots import new_figure, save_png
from memtree.geometry import Plan, human, plan
from memtree.io import atomic_write_json, atomic_write_text, dumps_json, read_json
from memtree.training.config import TrainConfig, load_train_config
from memtree.training.data import read_shards_manifest, tokenizer_vocab_size
from memtree.training.train import train

# Keys the sweep itself sets for every run.
RESERVED = ("save_folder", "run_name", "seed")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def check_overrides(overrides: Sequence[str], where: str, reserved: Sequence[str]) -> None:
    for ov in overrides:
        key = ov.split("=", 1)[0].strip()
        if "=" not in ov:
            raise ConfigError(f"{where}: {ov!r} is not of the form key=value")
        if key in reserved or any(key.startswith(r + ".") for r in reserved):
            raise ConfigError(f"{where}: {key} is set by the experiment, not by an override")


@dataclass(frozen=True, kw_only=True)
class SweepSetting:
    name: str  # also the run's folder name
    train: list[str] = field(default_factory=list)  # key=value training overrides of this setting


@dataclass(frozen=True, kw_only=True)
class EvalInputs:
    facts: str  # facts JSONL (memtree pipeline demo-corpus --facts …)
    held_out: str | None = None  # JSONL of {"text": …} for held-out perplexity
    tree: str | None = None  # clustering tree (default: next to the runs' shards)
    max_probes: int = 0  # 0 = all
    seed: int = 0  # probe construction


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    name: str
    out: str
    settings: list[SweepSetting]
    eval: EvalInputs
    base: str | None = None  # training YAML every run starts from
    train: list[str] = field(default_factory=list)  # key=value overrides for every run
    seed: int = 0  # training seed of every run
    x_axis: Literal["setting", "fetch_params", "bank_params"] = "setting"
    metric: Literal["accuracy", "accuracy_norm", "perplexity"] = "accuracy"

    def __post_init__(self) -> None:
        if not self.settings:
            raise ConfigError("settings: a sweep needs at least one setting")
        names = [s.name for s in self.settings]
        for i, n in enumerate(names):
            if not _NAME.match(n):
                raise ConfigError(
                    f"settings[{i}].name: {n!r} must be a folder name ([A-Za-z0-9_.-])"
                )
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"settings: names must be distinct, {dup} repeat")
        check_overrides(self.train, "train", RESERVED)
        for i, s in enumerate(self.settings):
            check_overrides(s.train, f"settings[{i}].train", RESERVED)
        if self.metric == "perplexity" and not self.eval.held_out:
            raise ConfigError("metric: 'perplexity' needs eval.held_out")


def load_sweep_config(
    path: str | Path | None, overrides: Sequence[str] = (), *, require_paths: bool = False
) -> SweepConfig:
    """The sweep; a relative `eval.facts` / `eval.held_out` / `eval.tree` from the YAML is relative
    to the sweep YAML (else, as before, to the working directory); one given as an override is
    relative to the working directory. With `require_paths` (`memtree eval sweep`), a path found
    nowhere is an error naming the key and where it was given; without, it is kept as given."""
    cfg = load_config(SweepConfig, str(path) if path else None, list(overrides))
    overridden = {o.split("=", 1)[0].strip() for o in overrides}
    resolved = {}
    for key in ("facts", "held_out", "tree"):
        value = getattr(cfg.eval, key)
        if not value:
            continue
        p = Path(value)
        from_yaml = bool(path) and f"eval.{key}" not in overridden and "eval" not in overridden
        where = f"in {path}" if from_yaml else "(override)"
        tries = (p,) if p.is_absolute() else ((Path(path).parent / p, p) if from_yaml else (p,))
        found = next((c for c in tries if c.exists()), None)
        if found is None and not require_paths:
            continue
        if found is None:
            rel = (
                f" (relative paths are relative to the sweep YAML, {Path(path).parent}, or the "
                "current folder)"
                if from_yaml and not p.is_absolute()
                else ""
            )
            raise ConfigError(f"eval.{key} {where}: {value}: no such file or directory{rel}")
        resolved[key] = str(found)
    return (
        dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, **resolved))
        if resolved
        else cfg
    )


@dataclass(frozen=True)
class SweepRun:
    name: str
    overrides: list[str]  # the setting's own
    config: TrainConfig
    plan: Plan


def run_plan(cfg: TrainConfig) -> Plan:
    """The run's parameter accounting (anchor, per-level blocks, fetched, bank) from its shards."""
    manifest = read_shards_manifest(cfg.data.shards)
    memory = cfg.memory_config(int(manifest["branching"]))
    if memory is None:
        raise ConfigError(
            "memory.multipliers: a sweep compares memory settings; every run needs a memory"
        )
    if memory.n_levels > int(manifest["levels"]):
        raise ConfigError(
            f"memory.multipliers: {memory.n_levels} levels, but the shards' tree has "
            f"{manifest['levels']}"
        )
    return plan(cfg.anchor_shape(tokenizer_vocab_size(cfg.data.shards, manifest)), memory)


def expand(cfg: SweepConfig, train_overrides: Sequence[str] = ()) -> list[SweepRun]:
    """One training config per setting: base YAML + sweep overrides + the setting's +
    `train_overrides`."""
    check_overrides(train_overrides, "train overrides", RESERVED)
    runs = []
    for s in cfg.settings:
        try:
            tc = load_train_config(
                cfg.base,
                [
                    *cfg.train,
                    *s.train,
                    *train_overrides,
                    f"save_folder={Path(cfg.out) / 'runs' / s.name}",
                    f"run_name={cfg.name}-{s.name}",
                    f"seed={cfg.seed}",
                ],
            )
            runs.append(
                SweepRun(name=s.name, overrides=list(s.train), config=tc, plan=run_plan(tc))
            )
        except ConfigError as e:
            raise ConfigError(f"setting {s.name!r}: {e}") from None
    return runs


def ensure_trained(cfg: TrainConfig, log: Callable[[str], None] = print) -> str:
    """Train unless the save folder holds a finished run of this exact config: 'trained' or
    'skipped'."""
    folder = Path(cfg.save_folder)
    if (folder / "metrics.json").exists():
        old = read_json(folder / "memtree_config.json")["config"]
        new = json.loads(dumps_json(to_dict(cfg)))
        if old != new:
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise ConfigError(
                f"{folder} holds a finished run of another config (differs at {diff}); "
                "delete it or choose another output folder"
            )
        log(f"{cfg.run_name}: finished earlier ({folder}), skipping")
        return "skipped"
    log(f"{cfg.run_name}: training {cfg.max_duration} → {folder}")
    train(cfg)
    return "trained"


def _evaluate(
    run: SweepRun, status: str, ev: EvalInputs, probes: list[dict], held_out: list[dict]
) -> dict:
    folder = Path(run.config.save_folder)
    key = {
        "fingerprint": run.config.fingerprint(),
        "max_duration": run.config.max_duration,
        "facts": str(Path(ev.facts).resolve()),
        "held_out": ev.held_out and str(Path(ev.held_out).resolve()),
        "max_probes": ev.max_probes,
        "seed": ev.seed,
    }
    cached = folder / "eval" / "results.json"
    if status == "skipped" and cached.exists():
        data = read_json(cached)
        if data["meta"].get("eval_key") == key:
            return data["knowledge"]
    knowledge = knowledge_eval(
        RunModel.load(folder, tree_dir=ev.tree, tree_key="eval.tree="), probes, held_out
    )
    write_report(
        folder / "eval", knowledge=knowledge, meta={"run": str(folder.resolve()), "eval_key": key}
    )
    return knowledge


def run_sweep(
    cfg: SweepConfig, *, train_overrides: Sequence[str] = (), log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train (or resume) and evaluate every setting; returns {"runs": [...], "files": {...}}."""
    runs = expand(cfg, train_overrides)
    ev = cfg.eval
    probes, held_out = load_eval_inputs(
        ev.facts, held_out=ev.held_out, max_probes=ev.max_probes, seed=ev.seed
    )
    rows = []
    for r in runs:
        status = ensure_trained(r.config, log)
        knowledge = _evaluate(r, status, ev, probes, held_out)
        rows.append(
            {
                "name": r.name,
                "overrides": r.overrides,
                "status": status,
                "save_folder": r.config.save_folder,
                "memory": {
                    "multipliers": list(r.plan.memory.multipliers),
                    "type": r.plan.memory.type,
                    "placement": r.plan.memory.placement,
                    "memory_layers": list(r.plan.memory_layers),
                },
                "anchor_params": r.plan.anchor_params,
                "fetch_params": r.plan.fetch_params,
                "bank_params": r.plan.bank_params,
                "modes": {
                    m: {k: v for k, v in row.items() if k != "predictions"}
                    for m, row in knowledge["modes"].items()
                },
            }
        )
    result = {
        "sweep": to_dict(cfg),
        "train_overrides": list(train_overrides),
        "n_probes": len(probes),
        "runs": rows,
    }
    result["files"] = write_sweep_report(
        Path(cfg.out), result, metric=cfg.metric, x_axis=cfg.x_axis
    )
    return result


def _fmt(metric: str, v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.2f}" if metric == "perplexity" else f"{v:.1%}"


def write_sweep_report(
    out: Path, result: dict[str, Any], *, metric: str, x_axis: str
) -> dict[str, str]:
    """OUT/results.json, OUT/report.md and OUT/sweep.png (the metric per memory setting vs the
    setting)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = result["runs"]
    modes = [
        m for m in MODE_LABEL if any(m in r["modes"] for r in rows)
    ]  # cached results come key-sorted
    sweep = result["sweep"]
    lines = [
        f"# memtree sweep `{sweep['name']}`",
        "",
        f"{len(rows)} runs; {result['n_probes']} long-tail probes; metric: {metric}.",
        "",
        f"Every run: base `{sweep['base']}` with "
        + (
            " ".join(f"`{o}`" for o in [*sweep["train"], *result["train_overrides"]])
            or "no overrides"
        )
        + ".",
        "",
        "| setting | overrides | memory layers | fetched params | bank params | "
        + " | ".join(MODE_LABEL[m] for m in modes)
        + " | status |",
        "|---|---|---|---:|---:|" + "---:|" * len(modes) + "---|",
    ]
    for r in rows:
        cells = [_fmt(metric, r["modes"][m].get(metric)) if m in r["modes"] else "—" for m in modes]
        lines.append(
            f"| {r['name']} | {' '.join(f'`{o}`' for o in r['overrides'])} | "
            f"{','.join(map(str, r['memory']['memory_layers']))} | {human(r['fetch_params'])} | "
            f"{human(r['bank_params'])} | " + " | ".join(cells) + f" | {r['status']} |"
        )
    if metric != "perplexity" and "fetched" in modes:
        buckets = [b["bucket"] for b in rows[0]["modes"]["fetched"]["by_bucket"]]
        lines += [
            "",
            "Fetched-memory accuracy by how many documents state the fact:",
            "",
            "| setting | " + " | ".join(buckets) + " |",
            "|---|" + "---:|" * len(buckets),
        ]
        for r in rows:
            cells = [_fmt("accuracy", b["accuracy"]) for b in r["modes"]["fetched"]["by_bucket"]]
            lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")

    fig = new_figure()
    ax = fig.add_subplot()
    xs = list(range(len(rows))) if x_axis == "setting" else [r[x_axis] for r in rows]
    order = sorted(range(len(rows)), key=lambda i: (xs[i], i))
    for m in modes:
        pts = [(xs[i], rows[i]["modes"][m].get(metric)) for i in order if m in rows[i]["modes"]]
        pts = [(x, y) for x, y in pts if y is not None]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=MODE_LABEL[m])
    if x_axis == "setting":
        ax.set_xticks(xs, [r["name"] for r in rows], rotation=30 if len(rows) > 5 else 0)
    else:
        ax.set_xscale("log")
        for i in order:
            ax.annotate(
                rows[i]["name"],
                (xs[i], rows[i]["modes"]["none"].get(metric) or 0),
                fontsize=6,
                rotation=60,
                textcoords="offset points",
                xytext=(0, 4),
            )
    ax.set_xlabel(
        {
            "setting": "setting",
            "fetch_params": "fetched memory parameters",
            "bank_params": "memory bank parameters",
        }[x_axis]
    )
    ax.set_ylabel(f"probe {metric}" if metric != "perplexity" else "held-out perplexity")
    ax.set_title(f"sweep {sweep['name']}")
    ax.legend(fontsize=8)
    save_png(fig, out / "sweep.png")
    atomic_write_json(out / "results.json", result)
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    return {
        "json": str(out / "results.json"),
        "markdown": str(out / "report.md"),
        "png": str(out / "sweep.png"),
    }
