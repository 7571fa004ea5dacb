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
) -> list[dict[str, Any]]:
    """One multiple-choice probe per fact that has enough distinct distractor values.

    Distractors come from the fact's closed value set (`values`, as the bios corpus writes it)
    uniformly at random: the gold value is itself uniform in that set, so a model that never saw
    the fact scores exactly chance in expectation, whatever its preferences among values. Facts
    without `values` (older fact lists) fall back to other entities' values of the attribute,
    which is biased when values are unique per entity (a never-stated gold string is rarer than
    the distractors). `exposures` = `mentions` × `epochs`: how many times training saw a
    statement of the fact; buckets use it."""
    rng = random.Random(seed)
    by_attr: dict[str, list[str]] = {}
    for f in facts:
        by_attr.setdefault(f["attribute"], [])
        if f["value"] not in by_attr[f["attribute"]]:
            by_attr[f["attribute"]].append(f["value"])
    probes = []
    for f in facts:
        if f["mentions"] < min_mentions:
            continue
        pool = f["values"] if f.get("values") else by_attr[f["attribute"]]
        others = [v for v in pool if v != f["value"]]
        if len(others) < n_distractors:
            continue
        choices = rng.sample(others, n_distractors) + [f["value"]]
        rng.shuffle(choices)
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
    return probes


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
