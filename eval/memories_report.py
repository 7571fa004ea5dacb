"""The report of `memtree eval memories` (`eval.memories`): results.json, report.md and
accuracy_vs_exposure.png (accuracy per exposure bucket, one curve per row, chance line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memtree.eval.plots import new_figure, save_png
from memtree.geometry import human, human_bytes
from memtree.io import atomic_write_json, atomic_write_text

NOTES = (
    (
        "Trained rows (dense, moc, pkm) train from scratch on the demo's shards, seed and "
        "optimiser settings for the demo's anchor + co-training duration; the demo rows reuse the "
        "demo's runs (anchor only = the co-trained anchor without its memory)."
    ),
    (
        "Δ vs reference: mean per-probe correctness difference (row − reference) on the same "
        "probes, with a normal-approximation 95 % interval on the paired difference (mean ± "
        "1.96·sd/√n)."
    ),
    (
        "runtime params: what one query runs with (anchor + fetched blocks; MoC / PKM: the memory "
        "parameters a token reads); memory active: that memory part alone. Training FLOPs: forward "
        "× 3 per trained sequence (training/flops.py), every sample once per epoch. A row with "
        "budget `flops` trains as many batches as give the fetched row's training FLOPs; the "
        "others train the demo's steps."
    ),
)


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def _delta(p: dict[str, Any]) -> str:
    if p["diff"] is None:
        return "—"
    if p["ci95"] is None:
        return f"{100 * p['diff']:+.1f}"
    lo, hi = p["ci95"]
    return f"{100 * p['diff']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _fetch(f: dict[str, Any]) -> str:
    return "0" if not f["bytes"] else f"{human_bytes(f['bytes'])} / {f['per']}"


def _seconds(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f}"


def _main_table(report: dict[str, Any]) -> list[str]:
    lines = [
        (
            "| row | kind | accuracy | Δ vs reference, points [95 % CI] | held-out ppl | total "
            "params | runtime params | memory active | train FLOPs | train s | inference "
            "FLOPs/token | fetched | blocking |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        ppl = "—" if r.get("perplexity") is None else f"{r['perplexity']:.2f}"
        block = r["blocking"].split(":")[0]
        lines.append(
            f"| {r['name']} | {r['kind']} | {_pct(r['accuracy'])} | "
            f"{_delta(r['paired']['overall'])} | {ppl} | {r['total_params']:,} | "
            f"{r['runtime_params']:,} | {r['memory_active_params']:,} | {r['train_flops']:.3g} | "
            f"{_seconds(r['train']['train_s'])} | {human(r['inference_flops_per_token'])} | "
            f"{_fetch(r['fetch'])} | {block} |"
        )
    return lines


def _bucket_tables(report: dict[str, Any]) -> list[str]:
    first = report["rows"][0]["by_bucket"]
    keep = [i for i, b in enumerate(first) if b["n"]]
    head = "| row | " + " | ".join(f"{first[i]['bucket']} (n={first[i]['n']})" for i in keep) + " |"
    sep = "|---|" + "---:|" * len(keep)
    acc = ["Accuracy by exposure bucket:", "", head, sep]
    acc += [
        f"| {r['name']} | " + " | ".join(_pct(r["by_bucket"][i]["accuracy"]) for i in keep) + " |"
        for r in report["rows"]
    ]
    paired = ["", f"Paired Δ vs {report['reference']} by bucket (points [95 % CI]):", "", head, sep]
    paired += [
        f"| {r['name']} | " + " | ".join(_delta(r["paired"]["by_bucket"][i]) for i in keep) + " |"
        for r in report["rows"]
    ]
    return acc + paired


def plot_accuracy(report: dict[str, Any], path: Path) -> None:
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot()
    buckets = [b["bucket"] for b in report["rows"][0]["by_bucket"]]
    for r in report["rows"]:
        xs = [i for i, b in enumerate(r["by_bucket"]) if b["accuracy"] is not None]
        style = "-" if r["kind"] == "demo" else "--"
        ax.plot(xs, [r["by_bucket"][i]["accuracy"] for i in xs], style, marker="o", label=r["name"])
    ax.set_xticks(range(len(buckets)), buckets)
    ax.set_xlabel("exposures (times training saw a statement of the fact)")
    ax.set_ylabel("probe accuracy")
    if report.get("chance"):
        ax.axhline(report["chance"], color="grey", lw=0.8, ls=":", label="chance")
    ax.set_title("Memory families on the demo's knowledge probes")
    ax.legend(fontsize=7)
    save_png(fig, path)


def _blocking_lines(report: dict[str, Any]) -> list[str]:
    """Target and other domains' accuracy before → after each blocking experiment, with its random
    control: the demo's subtree blocking (fetched) and the chapters' analogue (MoC)."""
    rows = [r for r in report["rows"] if r.get("blocking_result")]
    if not rows:
        return []
    lines = [
        "",
        "Blocking (the demo's target domain; random: as much of the memory, chosen at random):",
        "",
        "| row | blocked | setting | target before → after | other before → after |",
        "|---|---|---|---:|---:|",
    ]
    for r in rows:
        b = r["blocking_result"]
        what = (
            f"{b['fraction']:.2%} of the bank (level-{b['level']} subtree)"
            if b["kind"] == "subtree"
            else f"{b['chapters_blocked_per_layer']} of {b['n_routed']} routed chapters per layer"
        )
        for name, st in b["settings"].items():
            t, o = st["accuracy_target"], st["accuracy_other"]
            lines.append(
                f"| {r['name']} | {what} | {name} | {_pct(t['before'])} → {_pct(t['after'])} | "
                f"{_pct(o['before'])} → {_pct(o['after'])} |"
            )
    return lines


def trained_durations(report: dict[str, Any]) -> str:
    """What the trained rows ran for, as their runs' durations (a `train=[max_duration=…]` override
    shortens them below the demo's), or the demo's duration when no row was trained."""
    runs = [
        r["train"]["duration"]
        for r in report.get("rows", ())
        if r.get("kind") != "demo" and r.get("train")
    ]
    if not runs:
        return f"{report['demo']['duration']} (none trained)"
    distinct = sorted(set(runs), key=runs.index)
    same = distinct == [report["demo"]["duration"]]
    return " / ".join(distinct) + (
        " (the demo's)" if same else f" (the demo's is {report['demo']['duration']})"
    )


def header_lines(report: dict[str, Any]) -> list[str]:
    """The report's title and what it ran on: the demo root's training, memory and corpus."""
    demo = report["demo"]
    lines = [
        "# Memory families on one knowledge benchmark (memtree eval memories)",
        "",
        (
            f"Demo root {report['root']}: {report['n_probes']} probes (chance "
            f"{_pct(report['chance'])}), {report['held_out_documents']} held-out documents; the "
            f"demo trained {demo['epochs']:g} epochs ({demo['anchor_epochs']:g} anchor + "
            f"{demo['cotrain_epochs']:g} co-training), trained rows {trained_durations(report)}; "
            f"anchor {human(demo['anchor_params'])} parameters, hierarchical memory "
            f"{human(demo['plan']['fetch_params'])} fetched from a "
            f"{human(demo['plan']['bank_params'])} bank; reference row: {report['reference']}."
        ),
        "",
    ]
    corpus = demo.get("corpus")
    if corpus:
        changes = (
            ", ".join(f"{k}={v}" for k, v in corpus["spec_changes"].items())
            or "none: the demo's corpus"
        )
        lines += [
            (
                f"Corpus: {corpus['documents']:,} documents, {corpus['facts']:,} facts; generator "
                f"fields changed from the default: {changes}."
            ),
            "",
        ]
    return lines


def write_memories_report(out: str | Path, report: dict[str, Any]) -> Path:
    """Write results.json, report.md and accuracy_vs_exposure.png under `out`; returns report.md's
    path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = header_lines(report)
    lines += [f"- {n}" for n in NOTES] + [""]
    lines += _main_table(report) + [""] + _bucket_tables(report) + ["", "Row details:", ""]
    for r in report["rows"]:
        m = r["model"]
        what = (
            f"shape n_layers={m['shape']['n_layers']} d_model={m['shape']['d_model']} "
            f"ffn_dim={m['shape']['ffn_dim']}"
        )
        if m.get("moc"):
            mc = m["moc"]
            what += (
                f"; MoC {mc['n_chapters']} chapters × {mc['tokens_per_chapter']} tokens, "
                f"top-{mc['top_k']} + {mc['n_shared']} shared, layers {mc['layers']}"
            )
        if m.get("pkm"):
            pk = m["pkm"]
            what += (
                f"; PKM {pk['n_keys']}² slots, {pk['heads']} heads, k={pk['k']}, key_dim "
                f"{pk['key_dim']}, value_dim {pk['value_dim'] or m['shape']['d_model']}"
            )
        lines.append(
            f"- **{r['name']}** ({r['train']['action']}, {r['train']['duration']}): {what}; "
            f"fetched: {r['fetch']['note']}; blocking: {r['blocking']}"
        )
    lines += _blocking_lines(report)
    lines += ["", f"Wall time of the command: {report['seconds']:.0f} s."]
    plot_accuracy(report, out / "accuracy_vs_exposure.png")
    atomic_write_json(out / "results.json", report)
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    return out / "report.md"
