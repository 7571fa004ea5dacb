"""`memtree eval continual`: learning new facts in sequence without forgetting (seed 003 §5.1,
Figs. 3, 5).

The experiment. A model whose middle FFN is a product-key memory layer is pretrained on a bios
demo run's shards (`ROOT/train/pkm`, trained here when missing, like any `memtree train` run) and
its background access counts are collected over its pretraining batches (stored with the
checkpoint). It then meets `n_facts` facts about entities the corpus never mentions (a bios
world drawn with another seed; names that occur in the corpus are skipped), one at a time: each
fact is a batch of `paraphrases` statements of it in different frames, and each batch is one
gradient step (`memtree train finetune`'s stream; the stream is written to OUT/stream.jsonl so the
command can replay it). Every configuration starts from the same pretrained weights.

Measured before and after each stream:
- learning: 4-way accuracy on the new facts, "The {label} of {reference} is" with distractors drawn
  uniformly from the attribute's closed value set (chance 25 % before finetuning, in expectation);
- forgetting: accuracy on probes of old facts the corpus states often (`old_min_mentions`), and
  perplexity on held-out bios documents; forgetting = the old-fact accuracy drop (points) and the
  held-out perplexity increase (%).
Configurations: a grid over each method's learning knobs (learning rates for all, LoRA rank,
top-t and the TF / all-accessed ablations for sparse memory finetuning: eval/yamls/continual.yaml).
The target (003: sparse memory finetuning forgets ≤ 1/3 of full finetuning and ≤ 1/2 of LoRA at
equal learning) is checked at the learning level every method reaches: each method's least
forgetting among its configurations that learn at least that much. JSON + markdown + PNGs.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from memtree.config import ConfigError, from_dict, is_int, load_config, to_dict
from memtree.eval.demo import DEMO_TRAIN_YAML, shards_fingerprint, train_once
from memtree.eval.longtail import build_probes, load_facts, wilson
from memtree.eval.model import RunModel
from memtree.eval.plots import new_figure, save_png
from memtree.eval.tasks import multiple_choice, perplexity
from memtree.io import atomic_write_json, atomic_write_text, iter_jsonl, read_json
from memtree.memstore.store import MemoryStore, TierConfig
from memtree.pipeline.corpus.bios import BiosSpec, bios_facts, fact_statements
from memtree.training.config import load_train_config
from memtree.training.finetune.blocks import (
    BlockFinetuner,
    BlockFinetuneSpec,
    UnitBackground,
    collect_unit_background,
    write_edits,
)
from memtree.training.finetune.continual import (
    FinetuneSpec,
    batch_tensors,
    collect_run_background,
    finetune_stream,
    load_background,
)
from memtree.training.finetune.slots import BACKGROUND_DIR

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "yamls" / "continual.yaml"
CHANCE = 0.25


@dataclass(frozen=True, kw_only=True)
class ContinualConfig:
    """root: a bios demo run; run: the pretrained memory-layer run (default ROOT/train/pkm,
    trained with `pretrain` overrides of the demo's training YAML when missing); background_batches,
    background_batch_size: the pretraining batches (of that many windows) the background counts are
    collected over (again when the stored ones were collected otherwise); n_facts, paraphrases: the
    stream; world_seed: the new facts' bios world (-1: corpus seed + 2000); old_probes,
    old_min_mentions: the old-fact probes (facts stated in at least that many documents);
    held_out_docs; runs: the configurations; blocks_run: a hierarchical-memory run (default
    ROOT/train/cotrain) whose bank blocks `block_runs` update on the same stream (TF-IDF units,
    every fetched block, or the anchor: training/finetune/blocks.py; empty: skipped); out: report
    folder (default ROOT/continual)."""

    root: str = "runs/demo"
    run: str = ""
    pretrain: list[str] = field(default_factory=list)
    background_batches: int = 1000
    background_batch_size: int = 1
    n_facts: int = 256
    paraphrases: int = 8
    world_seed: int = -1
    old_probes: int = 512
    old_min_mentions: int = 4
    held_out_docs: int = 64
    runs: list[FinetuneSpec] = field(default_factory=list)
    blocks_run: str = ""
    block_runs: list[BlockFinetuneSpec] = field(default_factory=list)
    seed: int = 0
    out: str = ""

    def __post_init__(self) -> None:
        for name in (
            "background_batches",
            "background_batch_size",
            "n_facts",
            "paraphrases",
            "old_probes",
            "held_out_docs",
        ):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if not self.runs:
            raise ConfigError(
                "runs: no finetuning configuration to compare (eval/yamls/continual.yaml lists "
                "them)"
            )


def load_continual_config(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> ContinualConfig:
    return load_config(ContinualConfig, str(path or DEFAULT_YAML), list(overrides))


# -- data ------------------------------------------------------------------------------------------


def new_facts(root: Path, cfg: ContinualConfig) -> list[dict[str, Any]]:
    """n_facts facts of entities the run's corpus never mentions, spread over entities (every
    fact of an entity before the next entity's), deterministic for the config."""
    spec_rec = BiosSpec.stored(read_json(root / "corpus.json")["spec"])
    seed = cfg.world_seed if cfg.world_seed >= 0 else int(spec_rec["seed"]) + 2000
    spec = from_dict(BiosSpec, {**spec_rec, "seed": seed}, where="corpus.json spec")
    corpus = [r for _, r in iter_jsonl(root / "facts.jsonl")]
    known_names = {r["entity"] for r in corpus} | {r["reference"].split()[-1] for r in corpus}
    facts = [
        f
        for f in bios_facts(spec)
        if f["entity"] not in known_names
        and not f.get("famous")
        and f["reference"].split()[-1] not in known_names
    ]
    by_entity: dict[str, list[dict[str, Any]]] = {}
    for f in facts:
        by_entity.setdefault(f["entity"], []).append(f)
    names = sorted(by_entity)
    random.Random(cfg.seed).shuffle(names)
    out: list[dict[str, Any]] = []
    for n in names:
        out += by_entity[n]
        if len(out) >= cfg.n_facts:
            return out[: cfg.n_facts]
    raise ValueError(
        f"the bios world of seed {seed} has {len(out)} facts of new entities, fewer than "
        f"n_facts={cfg.n_facts}"
    )


def write_stream(
    facts: Sequence[dict[str, Any]], path: Path, paraphrases: int, seed: int
) -> list[tuple[str, list[str]]]:
    """The finetuning stream, one record per fact ({"id", "texts"}), written as JSONL."""
    records = [
        (f"{f['entity']}/{f['attribute']}", fact_statements(f, paraphrases, seed=seed))
        for f in facts
    ]
    atomic_write_text(
        path,
        "".join(json.dumps({"id": i, "texts": t}, ensure_ascii=False) + "\n" for i, t in records),
    )
    return records


def old_probes(root: Path, cfg: ContinualConfig) -> list[dict[str, Any]]:
    """Probes of corpus facts stated in ≥ old_min_mentions documents, evenly spread, ≤
    old_probes."""
    probes = build_probes(
        load_facts(root / "facts.jsonl"), seed=cfg.seed, min_mentions=cfg.old_min_mentions
    )
    if not probes:
        raise ValueError(
            f"{root}/facts.jsonl: no fact stated in ≥ {cfg.old_min_mentions} documents"
        )
    step = max(1, len(probes) // cfg.old_probes)
    return probes[::step][: cfg.old_probes]


# -- measuring -------------------------------------------------------------------------------------


def measure(
    rm,
    new: Sequence[dict[str, Any]],
    old: Sequence[dict[str, Any]],
    held_out: Sequence[dict[str, Any]],
    *,
    paths: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Learning (new-fact accuracy), old-fact accuracy and held-out perplexity of rm's model; with
    `paths` ({"new", "old", "held"}: each item's route from its own text), fetched memories."""
    mode = "none" if paths is None else "fetched"
    out = {}
    for name, probes in (("new", new), ("old", old)):
        mc = multiple_choice(
            rm, probes, mode=mode, batch_size=32, paths=None if paths is None else paths[name]
        )
        k = sum(int(p == q["gold"]) for p, q in zip(mc["predictions"], probes, strict=True))
        out[f"{name}_accuracy"] = k / len(probes)
        out[f"{name}_ci95"] = list(wilson(k, len(probes)))
    out["perplexity"] = perplexity(
        rm, held_out, mode=mode, batch_size=16, paths=None if paths is None else paths["held"]
    )["perplexity"]
    return out


def forgetting(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Old-fact accuracy drop (points, > 0 = forgot) and held-out perplexity increase (%)."""
    return {
        "old_drop": 100 * (before["old_accuracy"] - after["old_accuracy"]),
        "ppl_increase_pct": 100 * (after["perplexity"] / before["perplexity"] - 1),
        "learned": 100 * (after["new_accuracy"] - before["new_accuracy"]),
    }


def _run_row(spec, before: dict[str, Any], after: dict[str, Any], **rest: Any) -> dict[str, Any]:
    """A finetuning run's row of results.json: label, method, spec, the measures after it and its
    forgetting, then the run kind's own fields (`rest`, in order)."""
    return {
        "label": spec.label,
        "method": spec.method,
        "spec": to_dict(spec),
        "after": after,
        "forgetting": forgetting(before, after),
        **rest,
    }


def _run_line(row: dict[str, Any]) -> str:
    """The progress line a finished run prints: learning, old facts and held-out perplexity."""
    after, f = row["after"], row["forgetting"]
    return (
        f"{row['label']}: learned {after['new_accuracy']:.1%}, old facts "
        f"{after['old_accuracy']:.1%} (−{f['old_drop']:.1f}), held-out ppl "
        f"{after['perplexity']:.3f} (+{f['ppl_increase_pct']:.1f} %)"
    )


def equal_learning(rows: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """The target check: the learning level L every method reaches (the smallest of the methods'
    best new-fact accuracies); per method, its least forgetting (`key`) among configurations
    learning ≥ L; the ratios sparse / full and sparse / LoRA (≤ 1/3 and ≤ 1/2 wanted). Sparse
    memory finetuning counts with its TF-IDF ranking only (the tf / all rows are ablations). A
    baseline that does not forget (≤ 0) leaves its ratio undefined (None), not met."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["method"] == "sparse_memory" and r.get("spec", {}).get("ranking", "tfidf") != "tfidf":
            continue
        by.setdefault(r["method"], []).append(r)
    if not {"sparse_memory", "full", "lora"} <= set(by):
        return {"level": None, "note": "needs sparse_memory (tfidf), full and lora configurations"}
    level = min(max(r["after"]["new_accuracy"] for r in rs) for rs in by.values())
    best = {}
    for m, rs in by.items():
        ok = [r for r in rs if r["after"]["new_accuracy"] >= level - 1e-9]
        pick = min(ok, key=lambda r: r["forgetting"][key])
        best[m] = {
            "label": pick["label"],
            "new_accuracy": pick["after"]["new_accuracy"],
            "forgetting": pick["forgetting"][key],
        }
    out: dict[str, Any] = {"level": level, "key": key, "best": best}
    s = max(best["sparse_memory"]["forgetting"], 0.0)
    for base, want in (("full", 1 / 3), ("lora", 1 / 2)):
        f = best[base]["forgetting"]
        out[f"ratio_vs_{base}"] = s / f if f > 0 else None
        out[f"met_vs_{base}"] = bool(s / f <= want) if f > 0 else None
    return out


def fact_task(root: Path, out: Path, cfg, rm) -> tuple[list, list, list, list, list]:
    """The new-fact task on a demo root, shared with `memtree eval adapters`: the stream's records
    (written to OUT/stream.jsonl), the new-fact probes, the old-fact probes, the held-out documents
    and the stream tokenised for rm's model, one (record id, ids, real) batch per record. cfg: any
    config with n_facts, paraphrases, world_seed, old_probes, old_min_mentions, held_out_docs,
    seed."""
    facts = new_facts(root, cfg)
    records = write_stream(facts, out / "stream.jsonl", cfg.paraphrases, cfg.seed)
    new = build_probes([{**f, "mentions": 0} for f in facts], seed=cfg.seed)
    held = [r for _, r in iter_jsonl(root / "heldout.jsonl")][: cfg.held_out_docs]
    limit = rm.max_seq_len
    batches = [
        (
            rid,
            *batch_tensors(texts, rm.encode, pad_id=rm.eot_id, max_len=limit, where=f"fact {rid}:"),
        )
        for rid, texts in records
    ]
    return records, new, old_probes(root, cfg), held, batches


def ensure_pretrained(root: Path, cfg: ContinualConfig) -> tuple[Path, str]:
    """The memory-layer run with its background counts (collected when missing or collected
    otherwise); returns (run, what was done with it: "reused", "trained", "retrained", "given").

    The default run, ROOT/train/pkm, is reused only when it was trained from the same inputs: the
    training config (the demo YAML + `pretrain`), its duration and the shards' fingerprint
    (`eval.demo.train_once`, the demo's rule); otherwise it is retrained. A run given as `run=` that
    holds a trained model is the user's: used as given, never retrained or removed."""
    run = Path(cfg.run) if cfg.run else root / "train" / "pkm"
    if cfg.run and (run / "anchor.safetensors").exists():
        print(
            f"memory-layer model: {run} as given (run=; pretrain settings not applied)", flush=True
        )
        action = "given"
    else:
        shards = root / "pipeline" / "shards"
        if not (shards / "manifest.json").exists():
            raise FileNotFoundError(
                f"{shards}: no shards (manifest.json) to pretrain the memory-layer model on; "
                "run `memtree demo` for ROOT first, or give run=…"
            )
        overrides = [
            f"data.shards={shards}",
            "mode=baseline",
            "memory.multipliers=[]",
            f"save_folder={run}",
            "run_name=continual-pkm",
            f"seed={cfg.seed}",
            *cfg.pretrain,
        ]
        tcfg = load_train_config(DEMO_TRAIN_YAML, overrides)
        if tcfg.model.pkm is None:
            raise ConfigError(
                "pretrain: the overrides give no model.pkm (e.g. model.pkm.n_keys=128)"
            )
        inputs = {
            "config": tcfg.fingerprint(),
            "duration": tcfg.max_duration,
            "upstream": shards_fingerprint(shards),
        }
        _, action = train_once(
            "memory-layer model", tcfg, inputs, log=lambda m: print(m, flush=True)
        )
    if not _background_matches(run, cfg):
        print(
            f"collecting background counts over {cfg.background_batches} pretraining batches",
            flush=True,
        )
        collect_run_background(
            run, batches=cfg.background_batches, batch_size=cfg.background_batch_size, seed=cfg.seed
        )
    return run, action


def _background_matches(run: Path, cfg: ContinualConfig) -> bool:
    mans = [
        read_json(f) for f in sorted((run / BACKGROUND_DIR).glob("layer_*/background_counts.json"))
    ]
    want = f"{cfg.background_batch_size} sequence(s) per batch"
    return bool(mans) and all(
        m["n_batches"] == cfg.background_batches and want in m.get("source", "") for m in mans
    )


def run_continual(cfg: ContinualConfig, *, progress: bool = True) -> Path:
    """The whole experiment; returns the markdown report's path."""
    import torch

    root = Path(cfg.root)
    out = Path(cfg.out) if cfg.out else root / "continual"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    run, action = ensure_pretrained(root, cfg)
    timings = {"pretrain_s": round(time.time() - t0, 1)}
    rm = RunModel.load(run)
    model = rm.model
    background = load_background(run / BACKGROUND_DIR, model)
    records, new, old, held, batches = fact_task(root, out, cfg, rm)
    pretrained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t = time.time()
    before = measure(rm, new, old, held)
    timings["measure_s"] = round(time.time() - t, 1)
    rows = []
    for spec in cfg.runs:
        model.load_state_dict(pretrained)
        torch.manual_seed(cfg.seed)
        res = finetune_stream(model, batches, spec, background=background, progress=progress)
        after = measure(rm, new, old, held)
        trained = [v["trained"] for r in res["log"] for k, v in r.items() if k.startswith("layer_")]
        rows.append(
            _run_row(
                spec,
                before,
                after,
                seconds=res["seconds"],
                changed={k: res["changed"][k] for k in ("elements", "of_elements", "bytes")},
                trained_rows_per_step=float(np.mean(trained)) if trained else None,
                final_loss=res["log"][-1]["loss"],
            )
        )
        print(_run_line(rows[-1]), flush=True)
    model.load_state_dict(pretrained)
    hierarchical = None
    if cfg.block_runs:
        t = time.time()
        hierarchical = run_blocks(root, out, cfg, records, new, old, held, progress=progress)
        timings["blocks_s"] = round(time.time() - t, 1)
    timings["total_s"] = round(time.time() - t0, 1)
    bg = next(iter(background.values()))  # every layer's counts came from the same batches
    report = {
        "format": "memtree-continual",
        "version": 1,
        "config": to_dict(cfg),
        "run": str(run),
        "run_action": action,
        "pretrained": read_json(run / "memtree_config.json")["config"]["model"],
        "background": {
            "batches": bg.n_batches,
            "tokens_per_batch": bg.tokens / max(1, bg.n_batches),
            "source": bg.source,
        },
        "tokens_per_finetune_batch": float(np.mean([int(b[2].sum()) for b in batches])),
        "n_new_probes": len(new),
        "n_old_probes": len(old),
        "held_out_documents": len(held),
        "chance": CHANCE,
        "before": before,
        "runs": rows,
        "target": {
            "old_drop": equal_learning(rows, "old_drop"),
            "ppl_increase_pct": equal_learning(rows, "ppl_increase_pct"),
        },
        "hierarchical": hierarchical,
        "timings": timings,
    }
    return write_continual_report(out, report)


def run_blocks(
    root: Path,
    out: Path,
    cfg: ContinualConfig,
    records: Sequence[tuple[str, list[str]]],
    new: Sequence[dict[str, Any]],
    old: Sequence[dict[str, Any]],
    held: Sequence[dict[str, Any]],
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """The same stream into a hierarchical-memory run: each configuration of `block_runs` from the
    run's own weights and a fresh copy of its bank; edits written through memstore's edit path."""
    import torch

    run = Path(cfg.blocks_run) if cfg.blocks_run else root / "train" / "cotrain"
    tree = root / "pipeline" / "tree"  # a demo root's tree; else the run's own (next to its shards)
    rm = RunModel.load(run, tree_dir=tree if tree.is_dir() else None)
    if rm.store is None:
        raise ValueError(
            f"{run}: blocks_run has no bank (a co-trained hierarchical-memory run is needed)"
        )
    fracs = {s.unit_frac for s in cfg.block_runs if s.method == "tfidf"}
    if len(fracs) > 1:
        raise ConfigError(
            f"block_runs: tfidf configurations use different unit_frac {sorted(fracs)}; use one"
        )
    bg_dir = run / "block_background"
    background = None
    if fracs:
        frac = fracs.pop()
        try:
            background = UnitBackground.load(bg_dir)
        except FileNotFoundError:
            background = None
        if background is None or abs(background.unit_frac - frac) > 1e-12:
            print(
                f"collecting block background counts over {run}'s pretraining windows", flush=True
            )
            background = collect_unit_background(
                rm.model, rm.store, rm.config.data.shards, unit_frac=frac, progress=progress
            )
            background.save(bg_dir)
    model = rm.model
    pretrained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    texts = [t for _, ts in records for t in ts]
    flat_paths = rm.route(texts)
    batches, k = [], 0
    for rid, ts in records:
        ids, real = batch_tensors(
            ts, rm.encode, pad_id=rm.eot_id, max_len=model.config.max_seq_len, where=f"fact {rid}:"
        )
        batches.append((rid, ids, real, flat_paths[k : k + len(ts)]))
        k += len(ts)
    paths = {
        "new": rm.route([p["context"] for p in new]),
        "old": rm.route([p["context"] for p in old]),
        "held": rm.route([d["text"] for d in held]),
    }
    # how often a new fact's question fetches the leaf its statements were routed to
    leaf = flat_paths[:, -1].reshape(len(records), -1)
    agree = float(
        np.mean([paths["new"][i, -1] in set(leaf[i].tolist()) for i in range(len(records))])
    )
    bank = run / "bank"
    before = measure(rm, new, old, held, paths=paths)
    rows = []
    for spec in cfg.block_runs:
        work = out / "bank-work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(bank, work)
        model.load_state_dict(pretrained)
        rm.store = MemoryStore(
            work, tree=rm.tree, out_dtype=torch.float32, tiers=[TierConfig(name="ram", kind="ram")]
        )
        torch.manual_seed(cfg.seed)
        ft = BlockFinetuner(rm.model, rm.store, spec, background=background)
        t = time.time()
        log = [
            ft.step(ids, real, p, where=f"fact {rid}")
            for rid, ids, real, p in tqdm(
                batches, desc=f"finetune {spec.label}", disable=not progress
            )
        ]
        ft.finish()
        seconds = time.time() - t
        edits = write_edits(rm.store, ft.blocks, ft.touched, reason=f"eval continual {spec.label}")
        anchor_changed = sum(int((v != pretrained[k]).sum()) for k, v in model.state_dict().items())
        after = measure(rm, new, old, held, paths=paths)
        rows.append(
            _run_row(
                spec,
                before,
                after,
                seconds=round(seconds, 1),
                bank=edits,
                anchor_params_changed=anchor_changed,
                units_trained_per_step=float(np.mean([r.get("units_trained", 0) for r in log])),
                final_loss=log[-1]["loss"],
            )
        )
        print(f"{_run_line(rows[-1])}, bank bytes changed {edits['bytes_changed']:,}", flush=True)
        rm.store.close()
        shutil.rmtree(work, ignore_errors=True)
    model.load_state_dict(pretrained)
    return {
        "run": str(run),
        "background": None if background is None else background.source,
        "question_leaf_agreement": agree,
        "before": before,
        "runs": rows,
    }


# -- report ----------------------------------------------------------------------------------------


def _ratio(tgt: dict[str, Any], base: str) -> str:
    r = tgt[f"ratio_vs_{base}"]
    if r is None:
        return f"undefined ({base} does not forget at this level)"
    return f"{r:.2f} ({'met' if tgt[f'met_vs_{base}'] else 'not met'})"


METHOD_STYLE = {
    "sparse_memory": {"c": "tab:green", "marker": "o"},
    "full": {"c": "tab:red", "marker": "s"},
    "lora": {"c": "tab:blue", "marker": "^"},
}


def write_continual_report(out: Path, report: dict[str, Any]) -> Path:
    atomic_write_json(out / "results.json", report)
    b = report["before"]
    lines = [
        "# Continual learning: new facts in sequence (seed 003)",
        "",
        (
            f"{report['n_new_probes']} new facts, one gradient step each on "
            f"{report['config']['paraphrases']} paraphrases; learning = 4-way accuracy on them "
            f"(chance 25 %); forgetting = accuracy drop on {report['n_old_probes']} old-fact "
            f"probes and held-out perplexity increase on {report['held_out_documents']} documents. "
            f"Background counts: {report['background']['batches']} pretraining batches of "
            f"{report['background']['tokens_per_batch']:.0f} tokens (a finetuning batch: "
            f"{report['tokens_per_finetune_batch']:.0f})."
        ),
        "",
        (
            f"Memory-layer model: {report['run']} ({report.get('run_action', 'given')}: reused "
            "only when trained from the same pretrain settings and shards)."
        ),
        "",
        (
            f"Before finetuning: new facts {b['new_accuracy']:.1%}, old facts "
            f"{b['old_accuracy']:.1%}, held-out perplexity {b['perplexity']:.3f}."
        ),
        "",
        (
            "| configuration | new facts | old facts | old drop (pts) | held-out ppl | ppl "
            "increase | params changed | bytes changed | s |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["runs"]:
        a, f, c = r["after"], r["forgetting"], r["changed"]
        lines.append(
            f"| {r['label']} | {a['new_accuracy']:.1%} | {a['old_accuracy']:.1%} | "
            f"{f['old_drop']:+.1f} | {a['perplexity']:.3f} | {f['ppl_increase_pct']:+.1f} % | "
            f"{c['elements']:,} | {c['bytes']:,} | {r['seconds']:.0f} |"
        )
    lines += [
        "",
        "## At equal learning (the target: sparse ≤ 1/3 of full's forgetting, ≤ 1/2 of LoRA's)",
        "",
    ]
    for key, tgt in report["target"].items():
        if tgt.get("level") is None:
            lines.append(f"- {key}: {tgt.get('note')}")
            continue
        best = tgt["best"]
        lines.append(
            f"- {key} at new-fact accuracy ≥ {tgt['level']:.1%}: "
            + "; ".join(f"{m} {v['forgetting']:+.2f} ({v['label']})" for m, v in best.items())
            + f". Sparse / full {_ratio(tgt, 'full')}, sparse / LoRA {_ratio(tgt, 'lora')}."
        )
    hier = report.get("hierarchical")
    if hier:
        hb = hier["before"]
        lines += [
            "",
            "## Beyond the seed: TF-IDF updates of hierarchical memory blocks",
            "",
            (
                f"The same stream into {hier['run']} (anchor + fetched blocks; every text routed "
                "by its own text, probes by the question). A new fact's question fetches a leaf "
                f"one of its statements was routed to for {hier['question_leaf_agreement']:.0%} of "
                f"the facts. Before: new facts {hb['new_accuracy']:.1%}, old facts "
                f"{hb['old_accuracy']:.1%}, held-out perplexity {hb['perplexity']:.3f}. "
                f"Background: {hier['background']}."
            ),
            "",
            (
                "| configuration | new facts | old facts | old drop (pts) | held-out ppl | ppl "
                "increase | bank records rewritten | bank bytes changed | anchor params changed | "
                "s |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in hier["runs"]:
            a, f, bk = r["after"], r["forgetting"], r["bank"]
            lines.append(
                f"| {r['label']} | {a['new_accuracy']:.1%} | {a['old_accuracy']:.1%} | "
                f"{f['old_drop']:+.1f} | {a['perplexity']:.3f} | {f['ppl_increase_pct']:+.1f} % | "
                f"{bk['records']} | {bk['bytes_changed']:,} | {r['anchor_params_changed']:,} | "
                f"{r['seconds']:.0f} |"
            )
    lines += ["", f"Timings: {report['timings']}", ""]
    atomic_write_text(out / "report.md", "\n".join(lines))
    if hier:
        plot_pareto(
            [
                (BLOCK_LABEL[m], [r for r in hier["runs"] if r["method"] == m], style)
                for m, style in BLOCK_STYLE.items()
            ],
            hier["before"],
            report["chance"],
            "Hierarchical memory blocks: learning vs forgetting",
            out / "pareto_blocks.png",
        )
    tfidf = [
        (
            m.replace("_", " "),
            [
                r
                for r in report["runs"]
                if r["method"] == m and r["spec"].get("ranking", "tfidf") == "tfidf"
            ],
            style,
        )
        for m, style in METHOD_STYLE.items()
    ]
    ablations = [
        (
            f"sparse, {rk} ranking",
            [
                r
                for r in report["runs"]
                if r["method"] == "sparse_memory" and r["spec"].get("ranking") == rk
            ],
            {"facecolors": "none", "edgecolors": "tab:green", "marker": mk},
        )  # 003 Fig. 6, hollow
        for rk, mk in (("tf", "v"), ("all", "D"))
    ]
    plot_pareto(
        tfidf + ablations,
        b,
        report["chance"],
        "Learning vs forgetting over learning rates, LoRA ranks and top-t",
        out / "pareto.png",
    )
    return out / "report.md"


BLOCK_STYLE = {
    "tfidf": {"c": "tab:green", "marker": "o"},
    "all_fetched": {"c": "tab:orange", "marker": "D"},
    "anchor": {"c": "tab:red", "marker": "s"},
}
BLOCK_LABEL = {
    "tfidf": "TF-IDF units",
    "all_fetched": "every fetched block",
    "anchor": "anchor finetune",
}


PARETO_PANELS = (
    ("old_accuracy", "old-fact accuracy (forgetting ↓)"),
    ("perplexity", "held-out perplexity (forgetting ↑)"),
)


def plot_pareto(
    series: Sequence[tuple[str, Sequence[dict[str, Any]], dict[str, Any]]],
    before: dict[str, Any],
    chance: float,
    title: str,
    path: Path,
    panels: Sequence[tuple[str, str]] = PARETO_PANELS,
) -> None:
    """Learning (x) against each forgetting measure (`panels`: (key of the measures, axis label);
    default old-fact accuracy and held-out perplexity), one marker per configuration: series of
    (label, rows, scatter style)."""
    fig = new_figure(5.5 * len(panels), 4.2)
    for j, (key, ylabel) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), j + 1)
        for label, rows, style in series:
            if rows:
                ax.scatter(
                    [r["after"]["new_accuracy"] for r in rows],
                    [r["after"][key] for r in rows],
                    label=label,
                    **style,
                )
        ax.scatter(
            [before["new_accuracy"]], [before[key]], c="black", marker="*", s=80, label="before"
        )
        ax.axvline(chance, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("new-fact accuracy (learning)")
        ax.set_ylabel(ylabel)
        if key.endswith("perplexity"):  # a blown-up configuration would flatten the rest
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    save_png(fig, path)
