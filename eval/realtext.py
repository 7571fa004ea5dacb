"""`memtree eval realtext ROOT`: held-out perplexity of the memory rows on real text.

The bios demo measures knowledge; a memory that only memorised its documents still wins there. On
real text the question is whether a fetched block carries what its cluster's documents share, so
that a page the model never saw reads better with the block its text routes to. This module runs
two training stages on a real-text pipeline run and scores held-out pages. The default config,
eval/yamls/realtext.yaml, is the real-text recipe in the order measured (pipeline
`pipeline/yamls/realdocs.yaml`, stages from `training/yamls/realtext.yaml`, the stage YAMLs a user
runs alone being training/yamls/realtext-anchor.yaml and realtext.yaml);
eval/yamls/realtext-pydocs.yaml is the bank-LR grid on the openings of the Python documentation's
pages (the demo's YAML):

1. anchor: `train_yaml` (default `training/yamls/demo.yaml`), mode baseline, `anchor_duration`;
2. one co-training run per recipe (`recipes`: training overrides on top of `train_yaml`, none for
   the YAML as it is), from that anchor, for `cotrain_duration`;
3. dense-1x: the anchor's shape trained alone for both stages' duration (the same tokens and steps);
4. held-out: every page of `held_out` (default ROOT/corpus/test.jsonl) cut into windows of
   `window_tokens` tokens; each window is routed by its own text (as the pipeline routed the
   training windows) and scored with no memory, the generic blocks and the fetched blocks.

Rows: the pretrained anchor; dense-1x; per recipe the co-trained anchor alone / + generic / +
fetched. Per row: held-out perplexity (token-weighted), and paired 95 % intervals of the
per-page Δ nll/token against the recipe's own anchor and generic rows (pages are the independent
unit: windows of one page share their topic). Written to OUT (default ROOT/realtext): results.json,
report.md and perplexity.png. Training runs resume like the demo's (`eval.demo.train_once`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memtree.config import ConfigError, check_selection, load_config
from memtree.eval.demo import DEMO_TRAIN_YAML, shards_fingerprint, train_once
from memtree.eval.heldout import heldout_windows, paired_doc_interval, per_doc, window_nll
from memtree.eval.model import RunModel
from memtree.eval.plots import new_figure, save_png
from memtree.eval.runinfo import run_pretrained, run_tpp_table
from memtree.io import atomic_write_json, atomic_write_text, iter_jsonl, read_json, sha256_file
from memtree.tpp import format_tpp_markdown
from memtree.training.config import load_train_config

DEFAULT_YAML = Path(__file__).resolve().parent / "yamls" / "realtext.yaml"  # the real-text recipe
SCORES_FILE = (
    "realtext_scores.json"  # a run's per-document held-out sums, reused while its key holds
)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A memory-training recipe: `train` overrides on top of training/yamls/demo.yaml (none: the
    default); `start`: the run whose weights the memory stage starts from: "anchor" (the demo's
    anchor stage, `anchor_duration`) or "dense-1x" (the anchor's shape trained alone for both
    stages' duration: a converged anchor, as seed 002's rows A2 / A3 start from a pretrained model;
    with `mode=frozen` in `train` the stage trains the bank alone, on top of dense-1x)."""

    name: str
    train: list[str] = field(default_factory=list)
    start: str = "anchor"
    note: str = ""
    group: str = (
        ""  # the line this recipe belongs to in the TPP plot (e.g. "bank LR 1e-3"); "" = no line
    )

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", self.name):
            raise ConfigError(
                f"recipes.{self.name}: name must be letters, digits and _ . + - (it names a folder)"
            )
        if self.start not in ("anchor", "dense-1x"):
            raise ConfigError(
                f"recipes.{self.name}.start: 'anchor' or 'dense-1x', got {self.start!r}"
            )


@dataclass(frozen=True, kw_only=True)
class RealTextConfig:
    """root: holds pipeline/ (shards and tree) and corpus/test.jsonl; held_out: JSONL of held-out
    documents ({"text"}; default ROOT/corpus/test.jsonl); window_tokens: held-out window length;
    train_yaml: the training YAML every stage starts from (default training/yamls/demo.yaml);
    train: overrides for every stage; select: the recipes to run (empty: all); out: report folder
    (default ROOT/realtext). anchor: a named pretrained model (`memtree.pretrained`, e.g.
    smollm2-135m) as the frozen anchor, seed 002 Table 2 on real text: ROOT's pipeline tokenised
    with its tokenizer, no anchor stage and no dense-1x (the pretrained model alone is the control
    row), each recipe trains the bank alone on it (`mode=frozen`) for `cotrain_duration`."""

    root: str = "runs/pydocs-short"
    train_yaml: str = ""
    held_out: str = ""
    window_tokens: int = 240
    anchor_duration: str = "2ep"
    cotrain_duration: str = "5ep"
    seed: int = 0
    train: list[str] = field(default_factory=list)
    recipes: list[Recipe] = field(default_factory=lambda: [Recipe(name="default")])
    select: list[str] = field(default_factory=list)
    dense: bool = True
    anchor: str = ""
    out: str = ""

    def __post_init__(self) -> None:
        if self.anchor:
            from memtree.pretrained import SPECS

            if self.anchor not in SPECS:
                raise ConfigError(
                    f"anchor: {self.anchor!r} is not a pretrained model "
                    f"({', '.join(sorted(SPECS))})"
                )
            if self.dense:
                raise ConfigError(
                    "dense: a pretrained anchor has no dense-1x control (the model alone is the "
                    "control row); set dense: false"
                )
            own = [r.name for r in self.selected() if r.start != "anchor"]
            if own:
                raise ConfigError(
                    f"recipes {own}: with a pretrained anchor every recipe starts from it (start: "
                    "anchor)"
                )
        check_selection(
            [r.name for r in self.recipes],
            self.select,
            key="recipes",
            flag="--recipes",
            noun="recipe",
            empty="none to run",
        )
        if self.window_tokens < 2:
            raise ConfigError(f"window_tokens must be >= 2, got {self.window_tokens}")
        units = {_split(getattr(self, k), k)[1] for k in ("anchor_duration", "cotrain_duration")}
        # only dense-1x adds the two durations; a pretrained anchor has no anchor stage at all
        needs_sum = not self.anchor and (
            self.dense or any(r.start == "dense-1x" for r in self.selected())
        )
        if len(units) > 1 and needs_sum:
            raise ConfigError(
                f"anchor_duration {self.anchor_duration!r} and cotrain_duration "
                f"{self.cotrain_duration!r} must share a unit (dense-1x trains for their sum)"
            )
        late = [r.name for r in self.selected() if r.start == "dense-1x"]
        if late and not self.dense:
            raise ConfigError(
                f"recipes {late} start from dense-1x, which dense=false does not train"
            )

    def selected(self) -> list[Recipe]:
        return [r for r in self.recipes if not self.select or r.name in self.select]


def load_realtext_config(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> RealTextConfig:
    return load_config(RealTextConfig, str(path or DEFAULT_YAML), list(overrides))


def _split(duration: str, key: str) -> tuple[int, str]:
    """A duration of whole epochs or batches: ("2ep") → (2, "ep")."""
    m = re.fullmatch(r"\s*(\d+)(ep|ba)\s*", str(duration))
    if not m or int(m.group(1)) < 1:
        raise ConfigError(f"{key}: give whole epochs or batches ('2ep', '150ba'), got {duration!r}")
    return int(m.group(1)), m.group(2)


def total_duration(cfg: RealTextConfig) -> str:
    """Both stages' duration as one: what dense-1x trains for."""
    (a, unit), (c, _) = (
        _split(cfg.anchor_duration, "anchor_duration"),
        _split(cfg.cotrain_duration, "cotrain_duration"),
    )
    return f"{a + c}{unit}"


# -- training --------------------------------------------------------------------------------------


def train_stages(cfg: RealTextConfig, *, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Train (or reuse) the anchor, one co-training run per selected recipe and dense-1x; returns
    {run name: save folder}: "anchor", "dense-1x", "cotrain/<recipe>"."""
    from streaming.base.util import clean_stale_shared_memory

    root = Path(cfg.root)
    shards = root / "pipeline" / "shards"
    if not (shards / "manifest.json").is_file():
        raise FileNotFoundError(
            f"{shards}: no shards (run `memtree pipeline` for ROOT first, e.g. "
            "pipeline/yamls/pydocs-short.yaml)"
        )
    upstream = shards_fingerprint(shards)
    common = [
        f"data.shards={shards}",
        f"seed={cfg.seed}",
        f"data.shuffle_seed={cfg.seed}",
        *cfg.train,
    ]
    runs: dict[str, Path] = {}

    def stage(name: str, folder: Path, extra: list[str], up: str) -> str:
        tcfg = load_train_config(
            cfg.train_yaml or DEMO_TRAIN_YAML,
            [
                *common,
                f"save_folder={folder}",
                f"run_name=realtext-{name.replace('/', '-')}",
                *extra,
            ],
        )
        key, _ = train_once(
            name,
            tcfg,
            {"config": tcfg.fingerprint(), "duration": tcfg.max_duration, "upstream": up},
            log=log,
        )
        clean_stale_shared_memory()  # the next stage opens the shards again in this process
        runs[name] = folder
        return key

    if (
        cfg.anchor
    ):  # seed 002 Table 2: the bank alone on the frozen pretrained model, no anchor stage
        for r in cfg.selected():
            stage(
                f"cotrain/{r.name}",
                root / "train" / f"{cfg.anchor}-{r.name}",
                [
                    "mode=frozen",
                    f"model.anchor={cfg.anchor}",
                    f"max_duration={cfg.cotrain_duration}",
                    *r.train,
                ],
                upstream,
            )
        return runs
    anchor = root / "train" / "anchor"
    # anchor_checkpoint=null: a stage YAML runnable alone (training/yamls/realtext.yaml) names the
    # anchor its co-training starts from; these two stages start from nothing
    anchor_key = stage(
        "anchor",
        anchor,
        [
            "mode=baseline",
            "memory.multipliers=[]",
            "anchor_checkpoint=null",
            f"max_duration={cfg.anchor_duration}",
        ],
        upstream,
    )
    starts = {"anchor": (anchor, anchor_key)}
    if cfg.dense:
        dense = root / "train" / "dense-1x"
        starts["dense-1x"] = (
            dense,
            stage(
                "dense-1x",
                dense,
                [
                    "mode=baseline",
                    "memory.multipliers=[]",
                    "anchor_checkpoint=null",
                    f"max_duration={total_duration(cfg)}",
                ],
                upstream,
            ),
        )
    for r in cfg.selected():
        folder, key = starts[r.start]
        stage(
            f"cotrain/{r.name}",
            root / "train" / f"cotrain-{r.name}",
            [
                "mode=cotrain",
                f"anchor_checkpoint={folder}",
                f"max_duration={cfg.cotrain_duration}",
                *r.train,
            ],
            key,
        )
    return runs


# -- scoring ---------------------------------------------------------------------------------------


def _cached_scores(folder: Path, key: str) -> dict[str, Any] | None:
    f = folder / SCORES_FILE
    if not key or not f.is_file():
        return None
    got = read_json(f)
    return got if got.get("key") == key else None


def score_runs(
    runs: dict[str, Path],
    docs: Sequence[dict[str, Any]],
    tree_dir: Path,
    window_tokens: int,
    *,
    held_key: str = "",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every run's held-out rows: {"rows": [{name, run, mode, nll, perplexity, tokens}],
    "paired": …}.

    held_key: names the held-out documents (e.g. their file's digest); with it each run's
    per-document sums are kept in its folder (SCORES_FILE) and reused while the run, the documents,
    the window length and the tree stay the same, so a sweep done in pieces scores each run once."""
    rows, per = [], {}
    windows = paths = None
    n_windows = n_tokens = None
    for name, folder in runs.items():
        folder = Path(folder)
        inputs = folder / "demo_inputs.json"
        key = ""
        if held_key and inputs.is_file():
            key = hashlib.sha256(
                json.dumps(
                    [
                        read_json(inputs).get("key"),
                        held_key,
                        window_tokens,
                        str(Path(tree_dir).resolve()),
                    ]
                ).encode()
            ).hexdigest()[:16]
        cached = _cached_scores(folder, key)
        if cached is None:
            rm = RunModel.load(folder, tree_dir=tree_dir)
            if windows is None:  # every run shares the tokenizer (the shards') and the tree
                windows = heldout_windows(rm, docs, window_tokens)
                paths = rm.route([w["text"] for w in windows])
                log(f"[eval realtext] {len(docs)} held-out documents → {len(windows)} windows")
            modes = {}
            for mode in ("none", "generic", "fetched") if rm.has_memory else ("none",):
                t = time.time()
                s, tok = per_doc(
                    windows, window_nll(rm, windows, mode=mode, paths=paths), len(docs)
                )
                modes[mode] = {
                    "nll": s.tolist(),
                    "tokens": tok.tolist(),
                    "score_s": round(time.time() - t, 1),
                }
            cached = {
                "key": key,
                "windows": len(windows),
                "tokens": int(sum(len(w["ids"]) - 1 for w in windows)),
                "modes": modes,
            }
            if key:
                atomic_write_json(folder / SCORES_FILE, cached)
        else:
            log(f"[eval realtext] {name}: scores reused ({folder / SCORES_FILE})")
        n_windows, n_tokens = cached["windows"], cached["tokens"]
        memory = len(cached["modes"]) > 1
        for mode in (
            m for m in ("none", "generic", "fetched") if m in cached["modes"]
        ):  # JSON sorts the keys
            m = cached["modes"][mode]
            s, tok = (
                np.asarray(m["nll"], dtype=np.float64),
                np.asarray(m["tokens"], dtype=np.float64),
            )
            row = "anchor alone" if mode == "none" else f"+ {mode}"
            label = name.split("/", 1)[-1] if not memory else f"{name.split('/', 1)[1]}: {row}"
            per[(name, mode)] = (s, tok)
            mean = float(s.sum() / tok.sum())
            rows.append(
                {
                    "name": label,
                    "run": name,
                    "folder": str(folder),
                    "mode": mode,
                    "nll": mean,
                    "perplexity": math.exp(mean),
                    "tokens": int(tok.sum()),
                    "score_s": m["score_s"],
                }
            )
            log(f"[eval realtext] {label}: perplexity {math.exp(mean):.2f}")
    paired = {}
    for (name, mode), (s, tok) in per.items():
        if mode != "fetched":
            continue
        paired[name] = {
            f"fetched − {other}": paired_doc_interval(s, per[(name, other)][0], tok)
            for other in ("none", "generic")
        }
        # dense controls: the anchor stage, dense-1x, and any recipe without memory (e.g. the anchor
        # stage continued on the co-training schedule: what the restarted LR schedule alone is
        # worth)
        controls = [
            "anchor",
            "dense-1x",
            *(
                r
                for r, m in per
                if m == "none" and r.startswith("cotrain/") and (r, "fetched") not in per
            ),
        ]
        for ref in controls:
            if (ref, "none") in per:
                paired[name][f"fetched − {ref.split('/', 1)[-1]}"] = paired_doc_interval(
                    s, per[(ref, "none")][0], tok
                )
    return {"rows": rows, "paired": paired, "windows": n_windows or 0, "tokens": n_tokens or 0}


def run_tpp(folder: Path) -> dict[str, Any] | None:
    """A co-training run's tokens-per-parameter table (`eval.runinfo.run_tpp_table`), with `x`: its
    smallest level TPP over the run (the x of the TPP plot), or None."""
    table = run_tpp_table(folder)
    if table is None:
        return None
    levels = table["levels"]
    return {**table, "x": min(lv["tpp_run"] for lv in levels) if levels else None}


def run_realtext(cfg: RealTextConfig, *, log: Callable[[str], None] = print) -> Path:
    """Train what is missing, score the held-out pages, write the report; returns report.md's
    path."""
    root = Path(cfg.root)
    held = Path(cfg.held_out) if cfg.held_out else root / "corpus" / "test.jsonl"
    if not held.is_file():
        raise FileNotFoundError(
            f"{held}: no held-out documents (held_out=, default ROOT/corpus/test.jsonl)"
        )
    docs = [rec for _, rec in iter_jsonl(held)]
    t0 = time.time()
    runs = train_stages(cfg, log=log)
    train_s = time.time() - t0
    scored = score_runs(
        runs,
        docs,
        root / "pipeline" / "tree",
        cfg.window_tokens,
        held_key=sha256_file(held),
        log=log,
    )
    out = Path(cfg.out) if cfg.out else root / "realtext"
    recipes = {
        r.name: {
            "train": r.train,
            "start": r.start,
            "note": r.note,
            "group": r.group,
            "tpp": run_tpp(runs[f"cotrain/{r.name}"]),
        }
        for r in cfg.selected()
    }
    report = {
        "format": "memtree-realtext",
        "version": 1,
        "root": str(root),
        "held_out": str(held),
        "held_out_documents": len(docs),
        "window_tokens": cfg.window_tokens,
        "anchor_duration": cfg.anchor_duration,
        "cotrain_duration": cfg.cotrain_duration,
        "seed": cfg.seed,
        "pretrained": _pretrained_record(runs) if cfg.anchor else None,
        "train_yaml": str(cfg.train_yaml or DEMO_TRAIN_YAML),
        "train": cfg.train,
        "recipes": recipes,
        "train_s": round(train_s, 1),
        "score_s": round(time.time() - t0 - train_s, 1),
        **scored,
    }
    return write_realtext_report(out, report)


def _pretrained_record(runs: dict[str, Path]) -> dict[str, Any] | None:
    """What the first memory run recorded of its pretrained anchor (name, quantisation, hash)."""
    return next((rec for f in runs.values() if (rec := run_pretrained(f))), None)


# -- report ----------------------------------------------------------------------------------------


def _ci(p: dict[str, Any]) -> str:
    if p["mean"] is None:
        return "—"
    if p["ci95"] is None:
        return f"{p['mean']:+.4f}"
    return f"{p['mean']:+.4f} [{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}]"


def _stages_line(report: dict[str, Any]) -> str:
    p = report.get("pretrained")
    if not p:
        return (
            f"Anchor {report['anchor_duration']}, co-training {report['cotrain_duration']}, "
            f"seed {report['seed']}."
        )
    return (
        f"Anchor: {p['title']} ({p['name']}), pretrained and frozen ({p['quantisation']} "
        f"dequantised to fp32: pretrained, not the released bits; {p['licence']}); the bank alone "
        f"trained on it for {report['cotrain_duration']} (seed 002 Table 2), seed "
        f'{report["seed"]}; "anchor alone" is the pretrained model as released.'
    )


def write_realtext_report(out: str | Path, report: dict[str, Any]) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", report)
    lines = [
        f"# Held-out perplexity on real text ({report['root']})",
        "",
        (
            f"{report['held_out_documents']} held-out documents ({report['held_out']}) in "
            f"{report['windows']} windows of ≤ {report['window_tokens']} tokens, "
            f"{report['tokens']:,} tokens scored; each window routed by its own text. "
            + _stages_line(report)
        ),
        "",
        "| row | held-out ppl | nll/token |",
        "|---|---:|---:|",
    ]
    lines += [f"| {r['name']} | {r['perplexity']:.2f} | {r['nll']:.4f} |" for r in report["rows"]]
    lines += [
        "",
        (
            "Paired per held-out document: Δ nll/token of the fetched row against each other row "
            "(mean, 95 % interval over documents; negative = fetched memory reads the page better)."
        ),
        "",
        "| recipe | comparison | Δ nll/token [95 % CI] | documents worse |",
        "|---|---|---:|---:|",
    ]
    for run, comps in report["paired"].items():
        for comp, p in comps.items():
            lines.append(
                f"| {run.split('/', 1)[1]} | {comp} | {_ci(p)} | {p.get('worse_docs', '—')} / "
                f"{p['n_docs']} |"
            )
    lines += [
        "",
        "## Recipes",
        "",
        f"Every stage reads {report.get('train_yaml') or 'training/yamls/demo.yaml'}, then "
        + (f"`{' '.join(report['train'])}`" if report["train"] else "no common overrides")
        + ", then its recipe's overrides.",
        "",
    ]
    lines += [
        f"- **{name}**"
        + (" (from dense-1x)" if r.get("start") == "dense-1x" else "")
        + ": "
        + (f"`{' '.join(r['train'])}`" if r["train"] else "no overrides of its own")
        + (f": {r['note']}" if r["note"] else "")
        for name, r in report["recipes"].items()
    ]
    lines += tpp_section(report)
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    if any(r.get("tpp") and r["tpp"].get("x") for r in report["recipes"].values()):
        plot_tpp(report, out / "tpp.png")
    fig = new_figure(7.0, 0.35 * len(report["rows"]) + 1.2)
    ax = fig.add_subplot(1, 1, 1)
    names = [r["name"] for r in report["rows"]][::-1]
    ppl = [r["perplexity"] for r in report["rows"]][::-1]
    colors = [
        "tab:green"
        if r["mode"] == "fetched"
        else "tab:orange"
        if r["mode"] == "generic"
        else "tab:gray"
        for r in report["rows"]
    ][::-1]
    ax.barh(names, ppl, color=colors)
    ax.set_xlim(min(ppl) * 0.95, max(ppl) * 1.02)
    ax.set_xlabel("held-out perplexity (lower is better)")
    ax.set_title("Real text: held-out pages, each window routed by its own text")
    save_png(fig, out / "perplexity.png")
    return out / "report.md"


def _ppl(report: dict[str, Any], run: str, mode: str) -> float | None:
    return next(
        (r["perplexity"] for r in report["rows"] if r["run"] == run and r["mode"] == mode), None
    )


def _levels_tpp(t: dict[str, Any]) -> str:
    return ", ".join(
        f"L{lv['level']} m={lv['multiplier']}: {lv['tpp_run']:.3g}" for lv in t["levels"]
    )


def tpp_section(report: dict[str, Any]) -> list[str]:
    """The report's tokens-per-parameter part: each recipe's bank TPP beside its held-out rows
    (seed 002 Fig. 7 at this scale), then each recipe's full table."""
    have = {n: r for n, r in report["recipes"].items() if r.get("tpp") and r["tpp"].get("levels")}
    if not have:
        return []
    dense = _ppl(report, "dense-1x", "none")
    extra = sorted(
        {c for comps in report["paired"].values() for c in comps}
        - {"fetched − none", "fetched − generic", "fetched − anchor", "fetched − dense-1x"}
    )
    lines = [
        "",
        "## Tokens per parameter",
        "",
        (
            "TPP over the co-training run, per level with memory (memtree/tpp.py: the tokens each "
            "block trains on divided by its parameters; `memtree memstore plan --shards` prints "
            "the same). " + (f"dense-1x reads {dense:.2f}." if dense else "")
        ),
        "",
        (
            "| recipe | group | TPP per level | anchor alone / + generic / + fetched ppl | fetched "
            "− dense-1x [95 % CI] | fetched − generic [95 % CI] | pages worse than dense-1x |"
            + "".join(f" {c} [95 % CI] |" for c in extra)
        ),
        "|---|---|---|---:|---:|---:|---:|" + "---:|" * len(extra),
    ]
    for name, r in have.items():
        run = f"cotrain/{name}"
        ppl = [_ppl(report, run, m) for m in ("none", "generic", "fetched")]
        pr = report["paired"].get(run, {})
        vs_dense, vs_gen = pr.get("fetched − dense-1x"), pr.get("fetched − generic")
        lines.append(
            f"| {name} | {r.get('group', '')} | {_levels_tpp(r['tpp'])} | "
            + " / ".join("—" if v is None else f"{v:.2f}" for v in ppl)
            + " | "
            + (_ci(vs_dense) if vs_dense else "—")
            + " | "
            + (_ci(vs_gen) if vs_gen else "—")
            + " | "
            + (f"{vs_dense.get('worse_docs', '—')} / {vs_dense['n_docs']}" if vs_dense else "—")
            + " |"
            + "".join(f" {_ci(pr[c]) if c in pr else '—'} |" for c in extra)
        )
    for name, r in have.items():
        lines += ["", f"### {name}", "", *format_tpp_markdown(r["tpp"])]
    return lines


def plot_tpp(report: dict[str, Any], path: Path) -> None:
    """Seed 002 Fig. 7 at this scale: held-out perplexity against the bank's TPP over the run, one
    line per row (anchor alone, + generic, + fetched) and recipe group, dense-1x as a level line."""
    groups: dict[str, list[tuple[float, str]]] = {}
    for name, r in report["recipes"].items():
        if r.get("tpp") and r["tpp"].get("x"):
            groups.setdefault(r.get("group") or "recipes", []).append((r["tpp"]["x"], name))
    fig = new_figure(7.5, 4.8)
    ax = fig.add_subplot(1, 1, 1)
    styles = {"fetched": ("-", "o"), "generic": ("--", "s"), "none": (":", "^")}
    label = {"fetched": "+ fetched", "generic": "+ generic", "none": "anchor alone"}
    colors = ["tab:green", "tab:blue", "tab:purple", "tab:red", "tab:brown", "tab:olive"]
    for (group, pts), color in zip(sorted(groups.items()), colors * 4):
        pts.sort()
        for mode, (ls, mk) in styles.items():
            ys = [_ppl(report, f"cotrain/{n}", mode) for _, n in pts]
            ax.plot(
                [x for x, _ in pts],
                ys,
                ls=ls,
                marker=mk,
                color=color,
                label=f"{group}: {label[mode]}",
            )
    dense = _ppl(report, "dense-1x", "none")
    if dense:
        ax.axhline(dense, color="black", lw=1.2, label=f"dense-1x ({dense:.1f})")
    for name, r in report["recipes"].items():  # recipes without memory: dense controls
        ctl = None if r.get("tpp") else _ppl(report, f"cotrain/{name}", "none")
        if ctl and _ppl(report, f"cotrain/{name}", "fetched") is None:
            ax.axhline(ctl, color="grey", lw=1.0, ls="-.", label=f"{name} ({ctl:.1f})")
    ax.set_xscale("log")
    ax.set_xlabel("bank tokens per parameter over the run (the level with the fewest)")
    ax.set_ylabel("held-out perplexity (lower is better)")
    ax.set_title("Held-out real text against the bank's tokens per parameter")
    ax.legend(fontsize=7, ncol=2)
    save_png(fig, path)
