"""The vocabulary of the topical-prose corpus, read from `data/topical_vocab.json`.

16 domains × 4 subtopics: per domain its practitioners, places, general nouns and adjectives,
how its entities are referred to, and the attributes their facts use; per subtopic its nouns,
verbs (base form) and adjectives. `topical.py` turns it into documents; the file format
(`memtree-topical-vocab`, version 1) is described in the file's own "about" entry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from memtree.io import read_format_json

__all__ = ["VOCABULARY", "VOCAB_PATH", "Attribute", "Domain", "Subtopic", "load_vocabulary"]

VOCAB_PATH = Path(__file__).with_name("data") / "topical_vocab.json"
VOCAB_FORMAT = "memtree-topical-vocab"


@dataclass(frozen=True)
class Attribute:
    key: str
    label: str
    kind: str  # "int" | "dec" | "year" | "cat"
    phrasings: tuple[str, ...]
    lo: int = 0  # "dec": in tenths, one decimal place is written ("3.7 solar masses")
    hi: int = 0
    unit: str = ""
    choices: tuple[str, ...] = ()
    article: bool = False  # categorical value is a countable noun: say "an iron sword"
    generic: bool = True  # the generic "the {label} of {ref} is {value}" phrasings read well


@dataclass(frozen=True)
class Subtopic:
    key: str
    label: str
    nouns: tuple[str, ...]
    verbs: tuple[str, ...]
    adjs: tuple[str, ...]


@dataclass(frozen=True)
class Domain:
    key: str
    label: str
    agents: str  # plural practitioners
    agent: str  # singular practitioner
    places: tuple[str, ...]
    nouns: tuple[str, ...]
    adjs: tuple[str, ...]
    ref: str  # how an entity is referred to, e.g. "the star {name}"
    attrs: tuple[Attribute, ...]
    subs: tuple[Subtopic, ...]


def _attribute(a: dict) -> Attribute:
    return Attribute(
        a["key"],
        a["label"],
        a["kind"],
        tuple(a["phrasings"]),
        lo=a.get("lo", 0),
        hi=a.get("hi", 0),
        unit=a.get("unit", ""),
        choices=tuple(a.get("values", ())),
        article=a.get("article", False),
        generic=a.get("generic", True),
    )


def load_vocabulary(path: str | os.PathLike[str] = VOCAB_PATH) -> tuple[Domain, ...]:
    """The domains of a vocabulary file (format `memtree-topical-vocab` v1), in file order."""
    data = read_format_json(path, VOCAB_FORMAT, 1, "topical vocabulary")
    return tuple(
        Domain(
            d["key"],
            d["label"],
            d["agents"],
            d["agent"],
            tuple(d["places"]),
            tuple(d["nouns"]),
            tuple(d["adjectives"]),
            d["reference"],
            tuple(_attribute(a) for a in d["attributes"]),
            tuple(
                Subtopic(
                    s["key"],
                    s["label"],
                    tuple(s["nouns"]),
                    tuple(s["verbs"]),
                    tuple(s["adjectives"]),
                )
                for s in d["subtopics"]
            ),
        )
        for d in data["domains"]
    )


VOCABULARY: tuple[Domain, ...] = load_vocabulary()
"""The shipped vocabulary, in canonical order (the order fixes topic indices and hence the
corpus)."""
