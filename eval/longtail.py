"""The long-tail knowledge benchmark: fact probes bucketed by how often the corpus states them.

The analogue of the paper's atomic-number study (Fig. 1): the default corpus
(`memtree pipeline demo-corpus`) states facts about fictional entities whose mention
counts follow a Zipf law, and writes the facts with their exact counts
(`facts.jsonl`: entity, reference, label, attribute, value, mentions, domain,
topic). Each fact becomes a multiple-choice probe

    context  "the surface temperature of the star Veltharion is"
    choices  the true value and `n_distractors` values of the same attribute held
             by other entities (deterministic for a seed)

and accuracy is reported per mention-frequency bucket, for anchor-only,
generic and fetched memories side by side.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memtree.io import iter_jsonl

# Exposure buckets (inclusive lower bound, exclusive upper bound): how many times training saw a
# statement of the fact. Doubling widths, so the top bucket holds only the most frequent facts.
BUCKETS: tuple[tuple[int, int], ...] = (
    (0, 1),
    (1, 2),
    (2, 4),
    (4, 8),
    (8, 16),
    (16, 32),
    (32, 64),
    (64, 128),
    (128, 10**9),
)


def bucket_label(lo: int, hi: int) -> str:
    if hi - lo == 1:
        return str(lo)
    return f"{lo}+" if hi >= 10**9 else f"{lo}-{hi - 1}"


def load_facts(path: str | Path) -> list[dict[str, Any]]:
    facts = []
    for n, rec in iter_jsonl(path):
        missing = {"reference", "label", "attribute", "value", "mentions"} - set(rec)
        if missing:
            raise ValueError(f"{path}:{n}: fact lacks {sorted(missing)}")
        facts.append(rec)
    return facts


def build_probes(
    facts: Sequence[dict[str, Any]],
    *,
    n_distractors: int = 3,
    seed: int = 0,
    min_mentions: int = 0,
    epochs: float = 1.0,
    balance_unseen: bool = False,
) -> list[dict[str, Any]]:
    """One multiple-choice probe per fact that has enough distinct distractor values.

    Distractors come from the fact's closed value set (`values`, as the bios corpus writes it)
    uniformly at random: the gold value is itself uniform in that set, so a model that never saw
    the fact scores exactly chance in expectation, whatever its preferences among values. Facts
    without `values` (older fact lists) fall back to other entities' values of the attribute,
    which is biased when values are unique per entity (a never-stated gold string is rarer than
    the distractors). `exposures` = `mentions` × `epochs`: how many times training saw a
    statement of the fact; buckets use it.

    `balance_unseen`: redraw the distractors of never-stated facts (mentions 0, with `values`) so
    that, within each attribute, the gold's rank among its choices by how often the corpus states
    each value is spread evenly over the ranks (`balanced_unseen`). Uniform draws are at chance
    only in expectation over corpora: an anchor that prefers often-stated values scores above
    chance on a corpus whose unseen golds happen to be often stated elsewhere. The other probes
    stay exactly as drawn without it."""
    rng = random.Random(seed)
    by_attr: dict[str, list[str]] = {}
    for f in facts:
        by_attr.setdefault(f["attribute"], [])
        if f["value"] not in by_attr[f["attribute"]]:
            by_attr[f["attribute"]].append(f["value"])
    probes, sources = [], []
    for f in facts:
        if f["mentions"] < min_mentions:
            continue
        pool = f["values"] if f.get("values") else by_attr[f["attribute"]]
        others = [v for v in pool if v != f["value"]]
        if len(others) < n_distractors:
            continue
        choices = rng.sample(others, n_distractors) + [f["value"]]
        rng.shuffle(choices)
        sources.append(f)
        probes.append(
            {
                "context": f"The {f['label']} of {f['reference']} is",
                "exposures": round(f["mentions"] * epochs),
                "choices": choices,
                "gold": choices.index(f["value"]),
                "mentions": int(f["mentions"]),
                "domain": f.get("domain"),
                "topic": f.get("topic"),
                "entity": f.get("entity"),
                "attribute": f["attribute"],
            }
        )
    if balance_unseen:
        probes = balanced_unseen(probes, sources, value_counts(facts), seed=seed)
    return probes


def value_counts(facts: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """{attribute: {value: statements of that value in the corpus}}: the facts' mentions summed
    per attribute and value (every value of an attribute's closed set, stated or not)."""
    counts: dict[str, dict[str, int]] = {}
    for f in facts:
        c = counts.setdefault(f["attribute"], {})
        for v in f.get("values") or ():
            c.setdefault(v, 0)
        c[f["value"]] = c.get(f["value"], 0) + int(f["mentions"])
    return counts


def balanced_unseen(
    probes: Sequence[dict[str, Any]],
    sources: Sequence[dict[str, Any]],
    counts: dict[str, dict[str, int]],
    *,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """`probes` (as `build_probes` drew them, `sources[i]` the fact of probe i) with the
    never-stated facts' choices redrawn so that the gold's prior rank is spread evenly within
    each attribute.

    A value's prior rank orders an attribute's values by their corpus statement count
    (`counts`, as `value_counts` gives it). Each unseen probe gets a target rank r (0 = the gold
    is the most-stated of its choices): r distractors stated more often than the gold, the rest
    less often; values stated exactly as often as the gold join (ordered by a fixed random key
    per value) only where the others cannot fill any rank. Probes are assigned in order of how
    few ranks their gold allows (a gold stated most of all can only be rank 0), each to its
    least-used allowed rank in its attribute (ties: the least used overall, then at random). A
    scorer that picks by how often the corpus states a value is then at chance on the bucket;
    such a preference cannot fake knowledge of the fact. Each probe records the rank it got
    (`prior_rank`)."""
    rng = random.Random(f"balanced-unseen:{seed}")
    key = {a: {v: (c, rng.random()) for v, c in sorted(vals.items())} for a, vals in counts.items()}
    todo = []
    for i, f in enumerate(sources):
        if f["mentions"] or not f.get("values"):
            continue
        n = len(probes[i]["choices"]) - 1
        k, g = key[f["attribute"]], key[f["attribute"]][f["value"]]
        # values stated exactly as often as the gold only where the others cannot fill a rank:
        # a tie with the gold leaves a count-led scorer's pick to chance
        above = [v for v in f["values"] if k[v][0] > g[0]]
        below = [v for v in f["values"] if k[v][0] < g[0]]
        ranks = [r for r in range(n + 1) if r <= len(above) and n - r <= len(below)]
        if not ranks:
            above = [v for v in f["values"] if v != f["value"] and k[v] > g]
            below = [v for v in f["values"] if v != f["value"] and k[v] < g]
            ranks = [r for r in range(n + 1) if r <= len(above) and n - r <= len(below)]
        todo.append((len(ranks), rng.random(), i, f, sorted(above), sorted(below), ranks))
    out = list(probes)
    per_attr: dict[tuple[str, int], int] = {}
    overall: dict[int, int] = {}
    for _, _, i, f, above, below, ranks in sorted(todo, key=lambda t: t[:2]):
        a = f["attribute"]
        r = min(
            ranks,
            key=lambda r: (per_attr.get((a, r), 0), overall.get(r, 0), rng.random()),
        )
        per_attr[(a, r)] = per_attr.get((a, r), 0) + 1
        overall[r] = overall.get(r, 0) + 1
        n = len(out[i]["choices"]) - 1
        choices = rng.sample(above, r) + rng.sample(below, n - r) + [f["value"]]
        rng.shuffle(choices)
        out[i] = {**out[i], "choices": choices, "gold": choices.index(f["value"]), "prior_rank": r}
    return out


def exposure(p: dict[str, Any]) -> int:
    return int(p.get("exposures", p["mentions"]))


def accuracy_by_bucket(
    probes: Sequence[dict[str, Any]], predictions: Sequence[int]
) -> list[dict[str, Any]]:
    """Per exposure bucket: n, accuracy and its 95 % Wilson interval."""
    rows = []
    for lo, hi in BUCKETS:
        idx = [i for i, p in enumerate(probes) if lo <= exposure(p) < hi]
        correct = sum(int(predictions[i] == probes[i]["gold"]) for i in idx)
        rows.append(
            {
                "bucket": bucket_label(lo, hi),
                "n": len(idx),
                "accuracy": correct / len(idx) if idx else None,
                "ci95": list(wilson(correct, len(idx))) if idx else None,
            }
        )
    return rows


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a binomial proportion k / n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    # at k = 0 or k = n the exact bound is p itself; rounding can land it a hair inside
    return (0.0 if k == 0 else max(0.0, c - h), 1.0 if k == n else min(1.0, c + h))
