"""The long-tail knowledge benchmark: fact probes bucketed by how often the corpus states them.

The analogue of the paper's atomic-number study (Fig. 1): the default corpus
(`memtree demo-corpus`) states facts about fictional entities whose mention
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

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memtree.io import iter_jsonl

# Mention-count buckets (inclusive lower bound, exclusive upper bound).
BUCKETS: tuple[tuple[int, int], ...] = ((0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 10**9))


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


def build_probes(facts: Sequence[dict[str, Any]], *, n_distractors: int = 3, seed: int = 0,
                 min_mentions: int = 0) -> list[dict[str, Any]]:
    """One multiple-choice probe per fact that has enough distinct distractor values."""
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
        others = [v for v in by_attr[f["attribute"]] if v != f["value"]]
        if len(others) < n_distractors:
            continue
        choices = rng.sample(others, n_distractors) + [f["value"]]
        rng.shuffle(choices)
        probes.append({
            "context": f"the {f['label']} of {f['reference']} is",
            "choices": choices,
            "gold": choices.index(f["value"]),
            "mentions": int(f["mentions"]),
            "domain": f.get("domain"),
            "topic": f.get("topic"),
            "entity": f.get("entity"),
            "attribute": f["attribute"],
        })
    return probes


def accuracy_by_bucket(probes: Sequence[dict[str, Any]], predictions: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for lo, hi in BUCKETS:
        idx = [i for i, p in enumerate(probes) if lo <= p["mentions"] < hi]
        correct = sum(int(predictions[i] == probes[i]["gold"]) for i in idx)
        rows.append({"bucket": bucket_label(lo, hi), "n": len(idx),
                     "accuracy": correct / len(idx) if idx else None})
    return rows
