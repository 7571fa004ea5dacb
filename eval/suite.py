"""A task suite on your own run: LLM-Foundry-style JSONL tasks scored in Table 1's layout.

A suite YAML (`SuiteConfig`; unknown keys are errors naming the key) lists
tasks, each a JSONL file of items in the format of `eval.tasks` (multiple
choice, schema, generation, perplexity), a knowledge group (common /
specific) and few-shot / item-count settings. `run_suite` scores every task
anchor-only and, when the run has a bank, with generic and with fetched
memory; memories are retrieved as App. B says (`eval.tasks.retrieval_query`:
the question, the schema options' common prefix, the whole perplexity
document — never the few-shot examples). `write_suite_report` writes
results.json, report.md (tasks grouped under common / specific knowledge
with each group's average, one column per memory setting) and suite.png.

Group averages are over the group's accuracy tasks (multiple choice, schema,
generation); perplexity rows are reported beside them but not averaged in,
as Table 1 keeps Wiki-En perplexity apart from Avg-CK / Avg-SK. Generation
answers are compared by their first integer (`eval.tasks.extract_integer`,
the atomic-number style of App. B).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from memtree.config import ConfigError, load_config
from memtree.eval.knowledge import MODES, gate_lines
from memtree.eval.model import RunModel
from memtree.eval.plots import new_figure, save_png
from memtree.eval.tasks import (
    PER_ITEM,
    few_shot,
    gated_result,
    generation,
    multiple_choice,
    perplexity,
    retrieval_query,
    schema,
)
from memtree.io import atomic_write_json, atomic_write_text, iter_jsonl

TaskType = Literal["multiple_choice", "schema", "generation", "perplexity"]
GROUPS = {"common": "Common knowledge", "specific": "Specific knowledge"}
COLUMN = {
    "none": "anchor only",
    "generic": "+ generic",
    "fetched": "+ fetched",
    "gated": "+ fetched, gated",
}
TYPE_LABEL = {
    "multiple_choice": "multiple choice",
    "schema": "schema",
    "generation": "generation",
    "perplexity": "perplexity",
}
# Per type: the fields an item needs and their JSON types.
REQUIRED: dict[str, dict[str, type]] = {
    "multiple_choice": {"context": str, "choices": list, "gold": int},
    "schema": {"context_options": list, "continuation": str, "gold": int},
    "generation": {"context": str, "answer": str},
    "perplexity": {"text": str},
}
OPTIONS = {"multiple_choice": "choices", "schema": "context_options"}


class TaskDataError(ValueError):
    """A task file's line is not a valid item; the message names file:line and the reason."""


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    name: str
    type: TaskType
    path: str  # JSONL of items (relative paths: from the suite YAML's folder)
    group: Literal["common", "specific"]
    num_fewshot: int = 0  # solved examples drawn from the same file, never the item itself
    max_items: int = 0  # score the first max_items items (0 = all)
    max_new_tokens: int = 8  # generation only

    def __post_init__(self) -> None:
        for key in ("num_fewshot", "max_items"):
            if getattr(self, key) < 0:
                raise ConfigError(f"tasks.{self.name}.{key}: must be ≥ 0, got {getattr(self, key)}")
        if self.max_new_tokens < 1:
            raise ConfigError(
                f"tasks.{self.name}.max_new_tokens: must be ≥ 1, got {self.max_new_tokens}"
            )
        if self.num_fewshot and self.type == "perplexity":
            raise ConfigError(
                f"tasks.{self.name}.num_fewshot: perplexity tasks take no few-shot examples"
            )


@dataclass(frozen=True, kw_only=True)
class SuiteConfig:
    tasks: list[TaskSpec]
    seed: int = 0  # few-shot example draw
    batch_size: int = 16  # sequences per forward pass

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ConfigError("tasks: the suite needs at least one task")
        names = [t.name for t in self.tasks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"tasks: task names must be unique, {dup[0]!r} repeats")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be ≥ 1, got {self.batch_size}")


def load_suite_config(path: str | Path | None, overrides: Sequence[str] = ()) -> SuiteConfig:
    """The suite; a task's relative `path` is relative to the suite YAML (else, as before, to the
    working directory); a path found in neither is an error naming the task's key and the YAML."""
    cfg = load_config(SuiteConfig, str(path) if path else None, list(overrides))
    if not path:
        return cfg
    base = Path(path).parent
    tasks = []
    for i, t in enumerate(cfg.tasks):
        p = Path(t.path)
        found = next((c for c in ((p,) if p.is_absolute() else (base / p, p)) if c.is_file()), None)
        if found is None:
            raise ConfigError(
                f"tasks[{i}].path ({t.name}) in {path}: {t.path} is not a file "
                f"(relative paths are relative to the suite YAML, {base})"
            )
        tasks.append(dataclasses.replace(t, path=str(found)))
    return dataclasses.replace(cfg, tasks=tasks)


def _check_item(item: Any, kind: str) -> str | None:
    """Why `item` is not a valid `kind` item, or None."""
    if not isinstance(item, dict):
        return f"expected a JSON object, got {type(item).__name__}"
    for key, tp in REQUIRED[kind].items():
        if key not in item:
            return f"missing key {key!r} (a {kind} item needs {sorted(REQUIRED[kind])})"
        if not isinstance(item[key], tp) or (tp is int and isinstance(item[key], bool)):
            return f"{key!r} must be a {tp.__name__}, got {item[key]!r}"
    if kind in OPTIONS:
        opts = item[OPTIONS[kind]]
        if not opts or not all(isinstance(o, str) for o in opts):
            return f"{OPTIONS[kind]!r} must be a non-empty list of strings"
        if not 0 <= item["gold"] < len(opts):
            return f"gold {item['gold']} is outside the {len(opts)} {OPTIONS[kind]}"
    return None


def load_task_items(path: str | Path, kind: TaskType) -> list[dict[str, Any]]:
    """Every item of a JSONL task file, validated; a bad line raises `TaskDataError` naming
    file:line."""
    items = []
    for lineno, item in iter_jsonl(path, TaskDataError):
        why = _check_item(item, kind)
        if why:
            raise TaskDataError(f"{path}:{lineno}: {why}")
        items.append(item)
    if not items:
        raise TaskDataError(f"{path}: no items")
    return items


def task_items(spec: TaskSpec, seed: int) -> list[dict[str, Any]]:
    """The items to score, each behind `num_fewshot` solved examples drawn (seeded) from the rest of
    the file."""
    pool = load_task_items(spec.path, spec.type)
    n = min(spec.max_items or len(pool), len(pool))
    if not spec.num_fewshot:
        return pool[:n]
    if spec.num_fewshot >= len(pool):
        raise ConfigError(
            f"tasks.{spec.name}.num_fewshot: {spec.num_fewshot} examples need more than the "
            f"{len(pool)} items of {spec.path}"
        )
    rng = random.Random(seed)
    out = []
    for i in range(n):
        shots = rng.sample([j for j in range(len(pool)) if j != i], spec.num_fewshot)
        out += few_shot([pool[i]], [pool[j] for j in shots])
    return out


def _score(
    rm: RunModel,
    spec: TaskSpec,
    items: list[dict[str, Any]],
    mode: str,
    paths: np.ndarray | None,
    batch_size: int,
) -> dict[str, Any]:
    if spec.type == "perplexity":
        return perplexity(rm, items, mode=mode, paths=paths, batch_size=batch_size)
    if spec.type == "generation":
        return generation(rm, items, mode=mode, paths=paths, max_new_tokens=spec.max_new_tokens)
    scorer = multiple_choice if spec.type == "multiple_choice" else schema
    return scorer(rm, items, mode=mode, paths=paths, batch_size=batch_size)


def metric_of(task_type: str) -> str:
    return "perplexity" if task_type == "perplexity" else "accuracy"


def run_suite(rm: RunModel, cfg: SuiteConfig) -> dict[str, Any]:
    """Every task in every memory setting the run supports, and each group's average accuracy per
    setting.

    With a domain gate on `rm` (`RunModel.gate`), also "gated": each item as fetched memory
    scored it where the gate admits its query, as the anchor alone did elsewhere; its metrics
    carry "admitted", the number of items that read memory.

    Returns {"modes", "tasks": {name: {type, group, path, num_fewshot, n, metric, modes: {mode:
    metrics}}}, "groups": {group: {"tasks": [names], "average": {mode: mean accuracy}}}}."""
    modes = [m for m in MODES if m == "none" or rm.has_memory]
    gated = rm.has_memory and rm.gate is not None
    tasks: dict[str, Any] = {}
    for spec in cfg.tasks:
        items = task_items(spec, cfg.seed)
        queries = [d["text"] if spec.type == "perplexity" else retrieval_query(d) for d in items]
        paths, admitted = rm.route_admitted(queries) if rm.has_memory else (None, None)
        scored = {m: _score(rm, spec, items, m, paths, cfg.batch_size) for m in modes}
        if gated:
            scored["gated"] = gated_result(scored["none"], scored["fetched"], admitted)
        tasks[spec.name] = {
            "type": spec.type,
            "group": spec.group,
            "path": spec.path,
            "num_fewshot": spec.num_fewshot,
            "n": len(items),
            "metric": metric_of(spec.type),
            "modes": {
                m: {k: v for k, v in r.items() if k not in PER_ITEM} for m, r in scored.items()
            },
        }
    modes = modes + ["gated"] if gated else modes
    groups: dict[str, Any] = {}
    for g in GROUPS:
        names = [n for n, t in tasks.items() if t["group"] == g and t["metric"] == "accuracy"]
        if any(t["group"] == g for t in tasks.values()):
            groups[g] = {
                "tasks": names,
                "average": {
                    m: float(np.mean([tasks[n]["modes"][m]["accuracy"] for n in names]))
                    if names
                    else None
                    for m in modes
                },
            }
    out = {"modes": modes, "tasks": tasks, "groups": groups}
    if gated:
        out["gate"] = rm.gate.describe()
    return out


def _cell(task: dict[str, Any], mode: str) -> str:
    value = task["modes"][mode][task["metric"]]
    return f"{value:.2f}" if task["metric"] == "perplexity" else f"{100 * value:.1f}"


def write_suite_report(
    out_dir: str | Path, result: dict[str, Any], *, meta: dict[str, Any] | None = None
) -> dict[str, str]:
    """results.json, report.md (Table 1's layout) and suite.png (accuracy per task and group
    average)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modes, tasks = result["modes"], result["tasks"]
    lines = ["# memtree task suite", ""]
    if meta:
        lines += [f"- {k}: {v}" for k, v in meta.items()] + [""]
    lines += [
        (
            "Accuracy in % (perplexity tasks: perplexity, not part of the group average). Memories "
            "are retrieved with the question, the schema options' common prefix, or the whole "
            "document (App. B)."
        ),
        "",
    ]
    if "gate" in result:
        lines += gate_lines(
            result["gate"],
            {n: (t["modes"]["gated"]["admitted"], t["n"]) for n, t in tasks.items()},
        )
    lines += [
        "| task | type | n | " + " | ".join(COLUMN[m] for m in modes) + " |",
        "|---|---|---:|" + "---:|" * len(modes),
    ]
    for g, label in GROUPS.items():
        if g not in result["groups"]:
            continue
        lines.append(f"| **{label}** | | |" + " |" * len(modes))
        for name, t in tasks.items():
            if t["group"] == g:
                kind = f"{TYPE_LABEL[t['type']]}, {t['num_fewshot']}-shot"
                lines.append(
                    f"| {name} | {kind} | {t['n']} | "
                    + " | ".join(_cell(t, m) for m in modes)
                    + " |"
                )
        avg = result["groups"][g]["average"]
        cells = ["—" if avg[m] is None else f"**{100 * avg[m]:.1f}**" for m in modes]
        lines.append(f"| **Avg {label.lower()}** | | | " + " | ".join(cells) + " |")
    fig = new_figure(max(6.0, 0.9 * len(tasks) + 2), 4.0)
    ax = fig.add_subplot()
    labels = [n for n, t in tasks.items() if t["metric"] == "accuracy"]
    values = {m: [tasks[n]["modes"][m]["accuracy"] for n in labels] for m in modes}
    for g, info in result["groups"].items():
        if info["tasks"]:
            labels.append(f"Avg {g}")
            for m in modes:
                values[m].append(info["average"][m])
    x = np.arange(len(labels))
    width = 0.8 / len(modes)
    for k, m in enumerate(modes):
        ax.bar(x + (k - (len(modes) - 1) / 2) * width, values[m], width, label=COLUMN[m])
    ax.set_xticks(x, labels, rotation=30, ha="right")
    ax.set_ylabel("accuracy")
    ax.set_title("Task suite: anchor only vs generic vs fetched memory")
    ax.legend(fontsize=8)
    files = {
        "png": str(out / "suite.png"),
        "json": str(out / "results.json"),
        "markdown": str(out / "report.md"),
    }
    save_png(fig, out / "suite.png")
    atomic_write_json(out / "results.json", {"meta": meta or {}, **result})
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    return files
