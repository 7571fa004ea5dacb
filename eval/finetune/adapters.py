"""`memtree eval adapters`: memory adapters vs full fine-tuning vs LoRA on new knowledge
(seed 004 §7.3–7.4, §6.1).

The experiment a user with an existing model runs first. A pretrained model (a bios demo run's
`train/anchor`, no memory; or a real pretrained Hugging Face model named by `run=`, SmolLM2-135M or
Gemma 3 270M from `memtree.pretrained`: eval/finetune/bases.py) is fine-tuned on facts about
entities its corpus never mentions, under
the four conditions of §7.3: full fine-tuning, LoRA, memory cross-attention adapters
(training/finetune/adapters.py: MoC layers added to chosen blocks, base frozen) and adapters + LoRA.
The data and the measures are `memtree eval continual`'s (eval/finetune/continual.py), so the two
experiments read side by side: the same new-fact stream (each fact a batch of `paraphrases`
statements in different frames), here repeated for `epochs` passes in a fresh order each pass;
learning = 4-way accuracy on the new facts' probes ("The {label} of {reference} is", chance 25 %;
the statements embed that clause in other frames, the probe states it bare); forgetting = the
accuracy drop on old corpus facts and the held-out perplexity increase, and with `held_out_text`
the perplexity increase on real text (a pretrained model never read the bios corpus: its old-fact
probes sit at chance, and real text is where its forgetting shows). Every condition starts from
the same pretrained weights and seed.

Reported per configuration, with the accounting of training/flops.py: trainable parameters,
bytes of the memory bank, forward FLOPs per token (training and inference), measured step time.
`match_lora: true` sets each LoRA rank so its trainable parameters come nearest the first
mem_adapter configuration's (the parameter-matched comparison §7.3 asks for where methods allow:
full fine-tuning trains every weight by definition). JSON + markdown + PNG.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memtree.config import ConfigError, is_int, load_config, to_dict
from memtree.eval.finetune.bases import AnchorBase, PretrainedBase, open_base, text_pieces
from memtree.eval.finetune.continual import (
    PARETO_PANELS,
    fact_task,
    forgetting,
    measure,
    plot_pareto,
)
from memtree.eval.tasks import sequence_perplexity
from memtree.io import atomic_write_json, atomic_write_text
from memtree.pretrained import LoadedPretrained
from memtree.training.finetune.adapters import adapter_summary
from memtree.training.finetune.continual import FinetuneSpec, finetune_stream
from memtree.training.flops import finetune_accounting, lora_params

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "yamls" / "adapters.yaml"
CHANCE = 0.25
METHOD_STYLE = {
    "full": {"c": "tab:red", "marker": "s"},
    "lora": {"c": "tab:blue", "marker": "^"},
    "mem_adapter": {"c": "tab:green", "marker": "o"},
    "mem_adapter+lora": {"c": "tab:purple", "marker": "D"},
}


@dataclass(frozen=True, kw_only=True)
class AdaptersConfig:
    """root: a bios demo run; run: the pretrained model: a memtree run folder (default
    ROOT/train/anchor) or a name of `memtree.pretrained` (smollm2-135m, gemma3-270m); n_facts,
    paraphrases, world_seed: the new facts (as `memtree eval continual`); epochs: passes over them;
    old_probes, old_min_mentions, held_out_docs: the forgetting measures on the bios corpus;
    held_out_text: a JSONL of {"text"} records of real text whose perplexity is measured too
    (empty: not measured), its first held_out_tokens tokens in 512-token pieces; runs: the
    configurations (`training.finetune.continual.FinetuneSpec`, methods full | lora | mem_adapter |
    mem_adapter+lora); match_lora: LoRA ranks matched to the first adapter's trainable
    parameters; out: report folder (default ROOT/adapters)."""

    root: str = "runs/demo"
    run: str = ""
    n_facts: int = 256
    paraphrases: int = 8
    world_seed: int = -1
    epochs: int = 2
    old_probes: int = 512
    old_min_mentions: int = 4
    held_out_docs: int = 64
    held_out_text: str = ""
    held_out_tokens: int = 20000
    runs: list[FinetuneSpec] = field(default_factory=list)
    match_lora: bool = True
    seed: int = 0
    out: str = ""

    def __post_init__(self) -> None:
        for name in (
            "n_facts",
            "paraphrases",
            "epochs",
            "old_probes",
            "held_out_docs",
            "held_out_tokens",
        ):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if not self.runs:
            raise ConfigError(
                "runs: no configuration to compare (eval/yamls/adapters.yaml lists them)"
            )
        bad = [r.method for r in self.runs if r.method == "sparse_memory"]
        if bad:
            raise ConfigError(
                "runs: sparse_memory needs a product-key memory model; it is `memtree eval "
                "continual`'s"
            )


def load_adapters_config(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> AdaptersConfig:
    return load_config(AdaptersConfig, str(path or DEFAULT_YAML), list(overrides))


def accounting(
    base: AnchorBase | PretrainedBase, spec: FinetuneSpec, seq_len: int
) -> dict[str, Any]:
    """training/flops.py's accounting of one configuration on the base's shape (an HF model's
    through `training.hf.anchor_shape_from_hf`)."""
    moc = base.moc(spec) if spec.method.startswith("mem_adapter") else None
    return finetune_accounting(
        base.shape,
        spec.method,
        seq_len=seq_len,
        lora_rank=spec.lora_rank,
        lora_targets=spec.lora_targets,
        moc=moc,
        train_bank=spec.adapter.bank_lr_factor > 0,
        train_kv=not spec.adapter.freeze_kv,
    )


def matched_lora(
    runs: Sequence[FinetuneSpec], base: AnchorBase | PretrainedBase, seq_len: int
) -> list[FinetuneSpec]:
    """LoRA ranks chosen so each row's trainable parameters come nearest the first mem_adapter
    configuration's: a lora row's LoRA matches it alone, a mem_adapter+lora row's LoRA fills what
    its own (smaller) adapter leaves. Without a mem_adapter row the ranks stay as given."""
    ref = next((r for r in runs if r.method == "mem_adapter"), None)
    if ref is None:
        return list(runs)
    target = accounting(base, ref, seq_len)["trainable_params"]
    a = base.shape
    out = []
    for r in runs:
        if r.method in ("lora", "mem_adapter+lora"):
            budget = (
                target
                if r.method == "lora"
                else target
                - accounting(base, dataclasses.replace(r, method="mem_adapter"), seq_len)[
                    "trainable_params"
                ]
            )
            per_rank = lora_params(a, 1, r.lora_targets)
            if budget < per_rank:
                raise ConfigError(
                    f"match_lora: {r.label}'s adapter alone trains {target - budget:,} of the "
                    f"{target:,} parameters to match; give it a smaller adapter"
                )
            rank = max(1, min(round(budget / per_rank), a.d_model))
            r = dataclasses.replace(r, lora_rank=rank)
        out.append(r)
    return out


def measure_all(
    rm,
    new: Sequence[dict[str, Any]],
    old: Sequence[dict[str, Any]],
    held: Sequence[dict[str, Any]],
    pieces: Sequence[list[int]],
) -> dict[str, Any]:
    """`memtree eval continual`'s measures, and the held-out real text's perplexity when there is
    some."""
    out = measure(rm, new, old, held)
    if pieces:
        out["text_perplexity"] = sequence_perplexity(rm, pieces, mode="none", batch_size=4)[
            "perplexity"
        ]
    return out


def text_forgetting(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """`memtree eval continual`'s forgetting, and the real text's perplexity increase (%) when
    measured."""
    out = forgetting(before, after)
    if "text_perplexity" in before:
        out["text_ppl_increase_pct"] = 100 * (
            after["text_perplexity"] / before["text_perplexity"] - 1
        )
    return out


def run_adapters(
    cfg: AdaptersConfig, *, progress: bool = True, pretrained: LoadedPretrained | None = None
) -> Path:
    """The whole experiment; returns the markdown report's path. pretrained: an HF model already
    loaded (as `memtree.pretrained.load_pretrained` gives it), used instead of `run`."""
    import torch

    root = Path(cfg.root)
    out = Path(cfg.out) if cfg.out else root / "adapters"
    if cfg.held_out_text and not Path(cfg.held_out_text).is_file():
        raise ConfigError(
            f'held_out_text={cfg.held_out_text}: no such file (a JSONL of {{"text": …}} records)'
        )
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    base = open_base(root, cfg.run, pretrained)
    rm = base.rm
    _, new, old, held, batches = fact_task(root, out, cfg, rm)
    pieces = (
        text_pieces(cfg.held_out_text, rm, tokens=cfg.held_out_tokens) if cfg.held_out_text else []
    )
    seq_len = int(np.mean([int(b[2].sum(1).float().mean()) for b in batches]))
    stream = []
    for e in range(cfg.epochs):  # every pass in its own order, the same for every condition
        order = list(range(len(batches)))
        random.Random(cfg.seed * 1000 + e).shuffle(order)
        stream += [batches[i] for i in order]
    runs = matched_lora(cfg.runs, base, seq_len) if cfg.match_lora else list(cfg.runs)
    before = measure_all(rm, new, old, held, pieces)
    rows = []
    for spec in runs:
        crm = base.condition(spec)  # the pretrained weights again
        torch.manual_seed(cfg.seed)
        res = finetune_stream(crm.model, stream, spec, progress=progress)
        after = measure_all(crm, new, old, held, pieces)
        acct = accounting(base, spec, seq_len)
        moc = base.attached(spec)
        adapter = None
        if moc is not None:
            adapter = {
                **adapter_summary(moc, base.shape.d_model),
                "chapter_overlap": chapter_overlap(crm, batches, new),
            }
        rows.append(
            {
                "label": spec.label,
                "method": spec.method,
                "spec": to_dict(spec),
                "after": after,
                "forgetting": text_forgetting(before, after),
                "seconds": res["seconds"],
                "step_ms": 1000 * res["seconds"] / max(1, res["steps"]),
                "accounting": acct,
                "trainable_counted": res["trainable"],
                "adapter": adapter,
                "changed": {
                    k: res["changed"][k]
                    for k in ("elements", "of_elements", "bytes", "added_elements")
                },
                "final_loss": res["log"][-1]["loss"],
            }
        )
        f = rows[-1]["forgetting"]
        text = (
            f", text ppl {after['text_perplexity']:.3f} ({f['text_ppl_increase_pct']:+.1f} %)"
            if pieces
            else ""
        )
        print(
            f"{spec.label}: learned {after['new_accuracy']:.1%}, old facts "
            f"{after['old_accuracy']:.1%} ({f['old_drop']:+.1f} pts), held-out ppl "
            f"{after['perplexity']:.3f} ({f['ppl_increase_pct']:+.1f} %){text}, "
            f"{res['trainable']:,} trainable, {rows[-1]['step_ms']:.0f} ms/step",
            flush=True,
        )
        del crm, res
    base.restore()
    report = {
        "format": "memtree-adapters",
        "version": 1,
        "config": to_dict(cfg),
        **base.meta,
        "base": base.title,
        "hf": base.hf,
        "anchor": dataclasses.asdict(base.shape),
        "n_new_probes": len(new),
        "n_old_probes": len(old),
        "held_out_documents": len(held),
        "held_out_text": (
            {
                "path": cfg.held_out_text,
                "tokens": sum(map(len, pieces)),
                "pieces": len(pieces),
                "piece_tokens": len(pieces[0]),
            }
            if pieces
            else None
        ),
        "steps_per_run": len(stream),
        "tokens_per_batch": seq_len,
        "chance": CHANCE,
        "before": before,
        "runs": rows,
        "best": best_per_method(rows),
        "seconds": round(time.time() - t0, 1),
    }
    return write_adapters_report(out, report)


def chapter_overlap(
    rm, batches: Sequence[tuple], probes: Sequence[dict[str, Any]]
) -> dict[str, Any] | None:
    """Whether a fact's question reads the chapters its statements were written into: per memory
    layer, the share of (fact, statement) pairs whose routed chapters (top-k, shared ones
    excluded) overlap the question's, against the same share for random top-k draws (1 −
    C(C_r − k, k) / C(C_r, k)). Sequence-level routing pools the whole sequence, so a bare
    question and a statement in another frame need not route alike. None without MoC routing, and
    on an HF model (its adapters' layers are not reachable from it: the finetuner holds them)."""
    import torch

    model = rm.model
    if not hasattr(model, "blocks"):
        return None
    layers = [(i, b.moc) for i, b in enumerate(model.blocks) if b.moc is not None]
    if not layers:
        return None
    moc = model.config.moc
    by_id = {f"{p['entity']}/{p['attribute']}": p for p in probes}
    hits = {i: [] for i, _ in layers}
    with torch.no_grad():
        for rid, ids, _real in batches:
            p = by_id.get(rid)
            if p is None:
                continue
            model(ids)
            stmt = {i: m.last_routing.routed for i, m in layers}  # (B, k) each
            model(torch.tensor([rm.encode(p["context"])]))
            for i, m in layers:
                q = set(m.last_routing.routed[0].tolist())
                hits[i] += [bool(q & set(row.tolist())) for row in stmt[i]]
    n_r, k = moc.n_routed, moc.top_k
    chance = 1 - math.comb(n_r - k, k) / math.comb(n_r, k)
    return {"per_layer": {str(i): float(np.mean(h)) for i, h in hits.items()}, "chance": chance}


def best_per_method(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method, the configuration that learned most, and among those learning at least the
    level every method reaches (the smallest of their bests), the one that forgot least (the
    held-out real text's perplexity increase where it was measured, else the bios documents')."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    if not by:
        return {}
    level = min(max(r["after"]["new_accuracy"] for r in rs) for rs in by.values())
    key = (
        "text_ppl_increase_pct"
        if "text_ppl_increase_pct" in rows[0]["forgetting"]
        else "ppl_increase_pct"
    )
    out = {}
    for m, rs in by.items():
        top = max(rs, key=lambda r: r["after"]["new_accuracy"])
        ok = [r for r in rs if r["after"]["new_accuracy"] >= level - 1e-9]
        least = min(ok, key=lambda r: r["forgetting"][key])
        out[m] = {
            "most_learned": top["label"],
            "new_accuracy": top["after"]["new_accuracy"],
            "at_common_level": least["label"],
            "level": level,
            "forgetting_key": key,
            "ppl_increase_pct": least["forgetting"][key],
            "old_drop": least["forgetting"]["old_drop"],
            "trainable_params": least["trainable_counted"],
        }
    return out


def write_adapters_report(out: Path, report: dict[str, Any]) -> Path:
    atomic_write_json(out / "results.json", report)
    b, c, text = report["before"], report["config"], report.get("held_out_text")
    forgetting_text = (
        f"accuracy drop on {report['n_old_probes']} old-fact probes and held-out perplexity "
        f"increase on {report['held_out_documents']} bios documents"
    )
    if text:
        forgetting_text += (
            f" and on {text['tokens']:,} tokens of real text ({text['path']}, "
            f"{text['pieces']} pieces of ≤ {text['piece_tokens']} tokens)"
        )
    lines = [
        "# Memory adapters vs full fine-tuning vs LoRA (seed 004 §7.3)",
        "",
        (
            f"Base: {report['base']}. {report['n_new_probes']} facts of new entities, "
            f"{c['paraphrases']} paraphrases per batch, {c['epochs']} passes "
            f"({report['steps_per_run']} steps per configuration, {report['tokens_per_batch']:.1f} "
            "tokens per sequence on average). Learning = 4-way accuracy on the new facts (chance "
            f"25 %, n = {report['n_new_probes']}); forgetting = {forgetting_text}."
        ),
        "",
    ]
    if report.get("hf"):
        lines += [
            (
                "The pretrained model never read the bios corpus: its old-fact probes sit near "
                "chance and measure little; "
                + (
                    "the real text is where its forgetting shows."
                    if text
                    else "give held_out_text= to measure forgetting on real text."
                )
            ),
            "",
        ]
    lines += [
        (
            f"Before: new facts {b['new_accuracy']:.1%}, old facts {b['old_accuracy']:.1%}, "
            f"held-out perplexity {b['perplexity']:.3f}"
            + (f", real-text perplexity {b['text_perplexity']:.3f}." if text else ".")
        ),
        "",
        (
            "| configuration | new facts (95 % CI) | old facts | old drop (pts) | ppl increase | "
            + ("text ppl increase | " if text else "")
            + "trainable params | bank bytes | train / inference MFLOPs per token | ms / step |"
        ),
        "|---|---:|---:|---:|---:|" + ("---:|" if text else "") + "---:|---:|---:|---:|",
    ]
    for r in report["runs"]:
        a, f, acc = r["after"], r["forgetting"], r["accounting"]
        lo, hi = a["new_ci95"]
        lines.append(
            f"| {r['label']} | {a['new_accuracy']:.1%} ({lo:.0%}–{hi:.0%}) | "
            f"{a['old_accuracy']:.1%} | {f['old_drop']:+.1f} | {f['ppl_increase_pct']:+.1f} % | "
            + (f"{f['text_ppl_increase_pct']:+.1f} % | " if text else "")
            + f"{r['trainable_counted']:,} | {acc['bank_bytes']:,} | "
            f"{acc['train_flops_per_token'] / 1e6:.2f} / "
            f"{acc['inference_flops_per_token'] / 1e6:.2f} | {r['step_ms']:.0f} |"
        )
    agree = [
        (r["label"], r["adapter"]["chapter_overlap"])
        for r in report["runs"]
        if r.get("adapter") and r["adapter"].get("chapter_overlap")
    ]
    if agree:
        lines += [
            "",
            "## Does a question read the chapters its fact was written into?",
            "",
            (
                "Per adapter layer, the share of (fact, training statement) pairs whose routed "
                "chapters overlap the bare question's (chance: random top-k draws)."
            ),
            "",
        ]
        lines += [
            f"- {label}: "
            + ", ".join(f"layer {i} {v:.0%}" for i, v in a["per_layer"].items())
            + f" (chance {a['chance']:.0%})"
            for label, a in agree
        ]
    lines += ["", "## Per method", ""]
    for m, v in report["best"].items():
        measure_name = "real-text" if v["forgetting_key"].startswith("text") else "held-out"
        lines.append(
            f"- {m}: most learned {v['new_accuracy']:.1%} ({v['most_learned']}); at the level "
            f"every method reaches ({v['level']:.1%}) the least forgetting is "
            f"{v['ppl_increase_pct']:+.1f} % {measure_name} perplexity, {v['old_drop']:+.1f} "
            f"points on old facts ({v['at_common_level']}, {v['trainable_params']:,} trainable)."
        )
    lines += ["", f"Wall time {report['seconds']:.0f} s.", ""]
    atomic_write_text(out / "report.md", "\n".join(lines))
    series = [
        (m.replace("_", " "), [r for r in report["runs"] if r["method"] == m], style)
        for m, style in METHOD_STYLE.items()
    ]
    panels = (
        (*PARETO_PANELS, ("text_perplexity", "real-text perplexity (forgetting ↑)"))
        if text
        else PARETO_PANELS
    )
    plot_pareto(
        series,
        b,
        report["chance"],
        "Fine-tuning on new facts: learning vs forgetting",
        out / "pareto.png",
        panels=panels,
    )
    return out / "report.md"
