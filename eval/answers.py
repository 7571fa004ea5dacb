"""The demo in words (seed 002 Fig. 1 as text): long-tail questions answered by generation with the
prompt's fetched memory, with the generic memory, and with the prompt's subtree blocked.

Each question is a probe's context ("The constellation of the red giant Sevath is"), routed from
its own text only, as every fetched memory in the demo is; the answer is `memtree generate`'s
greedy continuation (`training.generate.Generator`: the bank read through memstore, a KV-cache
decode). An answer counts as correct when it starts with the fact's value. Blocking goes through
the store's own policy for this open store only (`persist=False`, inside `experiment`, so the bank
on disk and its audit log are untouched): the prompt's block at the bank's first memory level and
every block below it, served as the generic memory, as the demo's blocking experiment does.

The questions shown and scored are taken at a fixed stride from the long tail (facts seen 1–7
times) in probe order, never by their outcome, beside the same count of unseen facts (0 times),
which no memory should answer better than a guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memtree.eval.longtail import exposure
from memtree.training.generate.generator import Generator

SETTINGS = ("fetched", "generic", "blocked")


def _spread(items: list, n: int) -> list:
    return items[:: max(1, len(items) // n)][:n] if n else []


def _correct(answer: str, value: str) -> bool:
    return answer.strip().startswith(value)


def _answer_all(gen: Generator, probe: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    q = probe["context"]
    fetched = gen.generate(q, memory="fetched", max_new_tokens=max_new_tokens)
    generic = gen.generate(q, memory="generic", max_new_tokens=max_new_tokens)
    level = min(gen.store.levels)
    with gen.store.experiment(fallback="generic"):
        gen.store.block(
            level, [fetched.path[level - 1]], subtree=True, persist=False, reason="answers in words"
        )
        blocked = gen.generate(q, memory="fetched", max_new_tokens=max_new_tokens)
    value = probe["choices"][probe["gold"]]
    row = {
        "question": q,
        "value": value,
        "exposures": exposure(probe),
        "domain": probe.get("domain"),
        "entity": probe.get("entity"),
        "path": fetched.path,
        "blocked_level": level,
    }
    for name, g in zip(SETTINGS, (fetched, generic, blocked), strict=True):
        row[name] = g.text
        row[f"{name}_correct"] = _correct(g.text, value)
    return row


def answers_in_words(
    run: str | Path,
    probes: Sequence[dict[str, Any]],
    *,
    tree_dir: str | Path | None = None,
    n_shown: int = 6,
    n_scored: int = 96,
    max_new_tokens: int = 8,
    tail: tuple[int, int] = (1, 7),
) -> dict[str, Any]:
    """Generated answers to long-tail and unseen questions in the three settings: the first
    `n_shown` long-tail rows in full, and how often each setting's answer starts with the value over
    `n_scored` long-tail and `n_scored` unseen questions (rows with `shown`)."""
    lo, hi = tail
    tail_probes = _spread([p for p in probes if lo <= exposure(p) <= hi], n_scored)
    unseen = _spread([p for p in probes if exposure(p) == 0], n_scored)
    gen = Generator.from_run(run, tree_dir=tree_dir)
    try:
        rows = {
            "tail": [_answer_all(gen, p, max_new_tokens) for p in tail_probes],
            "unseen": [_answer_all(gen, p, max_new_tokens) for p in unseen],
        }
    finally:
        gen.close()
    scored = {
        kind: {
            s: {
                "n": len(rs),
                "correct": sum(r[f"{s}_correct"] for r in rs),
                "rate": sum(r[f"{s}_correct"] for r in rs) / len(rs) if rs else None,
            }
            for s in SETTINGS
        }
        for kind, rs in rows.items()
    }
    return {
        "tail": f"{lo}-{hi}",
        "max_new_tokens": max_new_tokens,
        "scored": scored,
        "shown": _spread(rows["tail"], n_shown),
        "rows": rows,
    }


def answers_markdown(a: dict[str, Any]) -> list[str]:
    """The report's section: the shown questions and each setting's answer, then the rates."""
    level = a["shown"][0]["blocked_level"] if a["shown"] else 2
    lines = [
        "## Answers in words (seed 002 Fig. 1 as text)",
        "",
        (
            f"Long-tail questions (facts seen {a['tail']} times), each routed from its own text, "
            f"answered by `memtree generate` (greedy, {a['max_new_tokens']} tokens) with the "
            f"question's fetched memory, with the generic memory, and with its level-{level} "
            "subtree blocked (served as the generic memory, as the blocking experiment does: every "
            "memory level of the path lies in that subtree, so the blocked answer is the generic "
            "one). Questions taken at a fixed stride, not by outcome."
        ),
        "",
        "| question | value | fetched | generic | subtree blocked |",
        "|---|---|---|---|---|",
    ]
    for r in a["shown"]:
        cells = [
            f"{r[s]!s}{' ✓' if r[f'{s}_correct'] else ''}".replace("|", "/").replace("\n", " ")
            for s in SETTINGS
        ]
        lines.append(f"| {r['question']} | {r['value']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Answers that start with the value:",
        "",
        "| questions | n | fetched | generic | subtree blocked |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind, label in (("tail", f"seen {a['tail']}×"), ("unseen", "unseen (0×)")):
        s = a["scored"][kind]
        n = s["fetched"]["n"]
        rates = " | ".join(
            f"{s[k]['rate']:.1%}" if s[k]["rate"] is not None else "—" for k in SETTINGS
        )
        lines.append(f"| {label} | {n} | {rates} |")
    return lines + [""]


def plot_answers(a: dict[str, Any], path: Path) -> None:
    """Bars: how often each setting's generated answer starts with the value, long tail and
    unseen."""
    import numpy as np

    from memtree.eval.plots import new_figure, save_png

    fig = new_figure()
    ax = fig.add_subplot()
    kinds = (("tail", f"seen {a['tail']}×"), ("unseen", "unseen (0×)"))
    x = np.arange(len(kinds))
    for k, s in enumerate(SETTINGS):
        rates = [a["scored"][kind][s]["rate"] or 0 for kind, _ in kinds]
        ax.bar(
            x + (k - 1) * 0.27,
            rates,
            0.25,
            label={"blocked": "subtree blocked"}.get(s, f"{s} memory"),
        )
    ax.set_xticks(x, [f"{label} (n={a['scored'][kind]['fetched']['n']})" for kind, label in kinds])
    ax.set_ylabel("generated answers that start with the value")
    ax.set_title("Answers in words: fetched vs generic vs blocked")
    ax.legend(fontsize=8)
    save_png(fig, path)
