"""The default corpus of the knowledge benchmark: entity-centric documents with controlled exposure.

Why this corpus
---------------
memtree's point is one effect (seed 002, Fig. 1): an anchor learns what is common, fetched
memories hold the long tail, and blocking a subtree removes exactly its knowledge. Measuring it
at micro scale needs a corpus whose knowledge is *known*, in the spirit of the synthetic
biographies used to study knowledge storage in small LMs (Allen-Zhu & Li, "Physics of Language
Models, Part 3", bioS):

* **Entity-centric documents.** Each document is about one fictional entity and states some of
  its facts, framed in varied sentences and mixed with prose from the entity's subtopic. A
  document therefore embeds like its entity's subtopic, and a question that names the entity
  with its kind ("the red giant Veltharion") routes where the documents about it went.
* **Topical structure at every level.** 4 fields > 16 domains > 64 subtopics (the vocabulary
  in `pipeline/corpus/data/bios_vocab.json`), so a 3-level tree of branching 4 can recover field,
  domain and subtopic; every subtopic has its own entity kind, nouns, verbs and adjectives.
* **Known exposure per fact.** Within a subtopic, entity ranks follow a Zipf law in how many
  documents are about them (`docs(rank) = max(1, round(head_docs · rank^-s))`); each document
  about an entity states each of its facts with probability `state_prob` (at least one). A
  share `withheld_prob` of entities have one fact that no document ever states: the unseen
  control. `bios_facts` reports, per fact, exactly how many documents state it.
* **Closed value sets.** Every attribute takes one of ~12 values, drawn uniformly and
  independently per entity, so every value is equally familiar and a probe's distractors carry
  no frequency bias (a fact nobody stated is at chance for any scorer).
* **One canonical clause per statement.** Every statement of a fact contains
  "the {label} of the {kind} {name} is {value}", inside varied frames ("Records show that …",
  "As every astronomer knows, …"). The benchmark measures *storage* of a fact, not extraction
  across paraphrases, which a 4-layer model trained for minutes cannot learn (Part 3.1 finds
  extraction needs paraphrase augmentation and far more exposures).

Deterministic: the same `BiosSpec` gives byte-identical records on any machine (integer-seeded
`random.Random` streams per document, no hashing, no set iteration).

Records: ``{"id": "bio-000000", "text", "field", "domain", "topic", "entity"}``.
"""

from __future__ import annotations

import json
import math
import os
import random
import string
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

from memtree.io import atomic_write_json, atomic_write_text, read_format_json
from memtree.pipeline.corpus.bios_text import (
    ABOUT,
    COMMON_FRAMES,
    COMMON_INITIAL,
    ENDS,
    FACT_FRAMES,
    FILLER,
    INTROS,
    MIDS,
    ONSETS,
)

__all__ = [
    "BiosSpec",
    "bios_facts",
    "generate_bios",
    "heldout_bios",
    "load_vocabulary",
    "write_bios",
]

VOCAB_PATH = Path(__file__).with_name("data") / "bios_vocab.json"
VOCAB_FORMAT = "memtree-bios-vocab"


@dataclass(frozen=True, kw_only=True)
class BiosSpec:
    """Everything that determines the corpus: the same spec always yields the same bytes.

    entities_per_subtopic: entities per subtopic (64 subtopics). head_docs: documents about the
    rank-1 entity of a subtopic; rank r gets max(1, round(head_docs · r^-zipf_exponent)).
    state_prob: probability that a document about an entity states each of its (non-withheld)
    facts. withheld_prob: share of entities with one fact never stated (the unseen control).
    famous_per_domain: entities per domain that every document of the domain may mention in
    passing: with probability common_prob a document ends with one fact of a famous entity of its
    domain. Those facts are the domain's common knowledge — the most frequent facts of the corpus,
    stated across all of the domain's subtopics. famous_are_heads: a famous entity is the head
    (rank 1, head_docs documents) of one of its domain's subtopics, as common knowledge is in
    real text (an entity everyone mentions is also the one most written about); False: famous
    entities have no documents of their own (rank 0), only the passing mentions — measured to
    let the leaf memory of the famous entity's subtopic override the anchor on them
    (docs/benchmarks/2026-11-21-demo-amd-epyc.md, "The knowledge demo on the entity-centric
    bios corpus"). common_scope: which documents mention a famous entity in passing — "domain"
    (its own domain's) or "corpus" (every document: knowledge no memory block sees more often
    than the anchor does, the paper's common knowledge). common_initial: share of the passing
    mentions that open with the fact ("The … is …, as everyone knows."), the form a probe asks
    in, instead of a lead-in ("Everyone knows that the … is …"); drawn on its own random
    stream, so every other byte of the corpus is the same at any value. 1.0: with lead-ins only
    (0.0) co-training loosened the anchor's grip on the famous facts in the probe's form, at
    0.5 one seed of three still fell short of 80 %, at 1.0 none
    (docs/benchmarks/2026-12-02-realtext-tpp-amd-epyc.md, "The common-knowledge bucket with
    the closing lines in the probe's form").
    filler: (min, max) prose sentences of the subtopic per document.
    """

    seed: int = 0
    entities_per_subtopic: int = 12
    head_docs: int = 20
    zipf_exponent: float = 1.3
    state_prob: float = 0.8
    withheld_prob: float = 0.3
    famous_per_domain: int = 1
    common_prob: float = 0.6
    famous_are_heads: bool = False
    common_scope: str = "domain"
    common_initial: float = 1.0
    filler: tuple[int, int] = (2, 4)

    def record(self) -> dict:
        """The spec as corpus.json stores it (JSON types), to write and to compare against."""
        return {
            **{k: getattr(self, k) for k in self.__dataclass_fields__},
            "filler": list(self.filler),
        }

    def __post_init__(self) -> None:
        checks = (
            ("seed", isinstance(self.seed, int) and self.seed >= 0, "a non-negative int"),
            (
                "entities_per_subtopic",
                isinstance(self.entities_per_subtopic, int)
                and 1 <= self.entities_per_subtopic <= 500,
                "an int in [1, 500]",
            ),
            (
                "head_docs",
                isinstance(self.head_docs, int) and 1 <= self.head_docs <= 10_000,
                "an int in [1, 10000]",
            ),
            (
                "zipf_exponent",
                isinstance(self.zipf_exponent, (int, float)) and 0 <= self.zipf_exponent <= 10,
                "a number in [0, 10]",
            ),
            (
                "state_prob",
                isinstance(self.state_prob, (int, float)) and 0 < self.state_prob <= 1,
                "in (0, 1]",
            ),
            (
                "withheld_prob",
                isinstance(self.withheld_prob, (int, float)) and 0 <= self.withheld_prob <= 1,
                "in [0, 1]",
            ),
            (
                "famous_per_domain",
                isinstance(self.famous_per_domain, int) and 0 <= self.famous_per_domain <= 100,
                "an int in [0, 100]",
            ),
            (
                "common_prob",
                isinstance(self.common_prob, (int, float)) and 0 <= self.common_prob <= 1,
                "in [0, 1]",
            ),
            ("famous_are_heads", isinstance(self.famous_are_heads, bool), "a bool"),
            ("common_scope", self.common_scope in ("domain", "corpus"), "'domain' or 'corpus'"),
            (
                "common_initial",
                isinstance(self.common_initial, (int, float)) and 0 <= self.common_initial <= 1,
                "in [0, 1]",
            ),
            (
                "filler",
                len(self.filler) == 2 and 0 <= self.filler[0] <= self.filler[1] <= 50,
                "a (min, max) pair with 0 ≤ min ≤ max ≤ 50",
            ),
        )
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"BiosSpec.{name} must be {what}, got {getattr(self, name)!r}")

    @staticmethod
    def stored(rec: dict) -> dict:
        """A corpus.json spec record completed with the value each absent field was written with:
        a field added later is absent from older records, and its old behaviour is not always
        today's default (common_initial: 0.0 before the field, 1.0 since)."""
        return {**BiosSpec().record(), **_ABSENT_MEANS, **rec}

    def docs_for_rank(self, rank: int) -> int:
        return max(1, round(self.head_docs * rank ** -float(self.zipf_exponent)))


# What a corpus.json written before a field existed was generated with, where that differs from
# the field's default (BiosSpec.stored).
_ABSENT_MEANS = {"common_initial": 0.0}


# --------------------------------------------------------------------------------------------
# Vocabulary (data file) → topics
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Attr:
    key: str
    label: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class _Topic:
    index: int
    field: str
    domain: str
    domain_label: str
    agents: str
    agent: str
    places: tuple[str, ...]
    general_nouns: tuple[str, ...]
    key: str
    label: str
    kind: str
    nouns: tuple[str, ...]
    verbs: tuple[tuple[str, str, str], ...]  # (base, third person, gerund)
    adjs: tuple[str, ...]
    attrs: tuple[_Attr, ...]


def load_vocabulary(path: str | os.PathLike[str] = VOCAB_PATH) -> tuple[_Topic, ...]:
    """The topics of a vocabulary file (format `memtree-bios-vocab` v1), with clear errors."""
    data = read_format_json(path, VOCAB_FORMAT, 1, "bios vocabulary")
    topics: list[_Topic] = []
    for f in data["fields"]:
        for d in f["domains"]:
            where = f"{path}: domain {d.get('key')!r}"
            attrs = tuple(_Attr(a["key"], a["label"], tuple(a["values"])) for a in d["attributes"])
            for a in attrs:
                if len(set(a.values)) != len(a.values) or len(a.values) < 4:
                    raise ValueError(f"{where}: attribute {a.key!r} needs ≥ 4 distinct values")
            for s in d["subtopics"]:
                if not s["nouns"] or not s["verbs"] or not s["adjectives"]:
                    raise ValueError(
                        f"{where}: subtopic {s.get('key')!r} lacks nouns, verbs or adjectives"
                    )
                topics.append(
                    _Topic(
                        len(topics),
                        f["key"],
                        d["key"],
                        d["label"],
                        d["agents"],
                        d["agent"],
                        tuple(d["places"]),
                        tuple(d["nouns"]),
                        s["key"],
                        s["label"],
                        s["kind"],
                        tuple(s["nouns"]),
                        tuple((v, _third_person(v), _gerund(v)) for v in s["verbs"]),
                        tuple(s["adjectives"]),
                        attrs,
                    )
                )
    return tuple(topics)


@cache
def _default_topics() -> tuple[_Topic, ...]:
    return load_vocabulary()


# Simpler rules than grammar.py's (the topical corpus): kept apart, since they fix this
# corpus's bytes.
_VOWELS = "aeiou"


def _third_person(v: str) -> str:
    if v.endswith(("s", "sh", "ch", "x", "z", "o")):
        return v + "es"
    if v.endswith("y") and len(v) > 1 and v[-2] not in _VOWELS:
        return v[:-1] + "ies"
    return v + "s"


def _gerund(v: str) -> str:
    if v.endswith("ie"):
        return v[:-2] + "ying"
    if v.endswith("e") and not v.endswith(("ee", "ye", "oe")):
        return v[:-1] + "ing"
    if (
        len(v) >= 3
        and v[-1] not in _VOWELS + "wxy"
        and v[-2] in _VOWELS
        and v[-3] not in _VOWELS
        and len(v) <= 4
    ):
        return v + v[-1] + "ing"
    return v + "ing"


def _a(phrase: str) -> str:
    return ("an " if phrase[0].lower() in _VOWELS else "a ") + phrase


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


# --------------------------------------------------------------------------------------------
# Sentences (their frames: bios_text.py)
# --------------------------------------------------------------------------------------------


def _fields(template: str) -> tuple[str, ...]:
    return tuple(f for _, f, _, _ in string.Formatter().parse(template) if f)


def _fill(rng: random.Random, template: str, topic: _Topic, ent: _Entity | None) -> str:
    nouns = rng.sample(topic.nouns, min(2, len(topic.nouns)))
    verb = rng.choice(topic.verbs)
    vals = {
        "N1": nouns[0],
        "N2": nouns[-1],
        "A1": rng.choice(topic.adjs),
        "V1": verb[0],
        "S1": verb[1],
        "G1": _cap(verb[2]),
        "agents": topic.agents,
        "Agents": _cap(topic.agents),
        "agent": topic.agent,
        "topic": topic.label,
        "domain": topic.domain_label,
        "place": rng.choice(topic.places),
        "kind": topic.kind,
        "a_kind": _a(topic.kind),
    }
    if ent is not None:
        vals |= {"name": ent.name, "Name": ent.name, "ref": ent.ref, "Ref": _cap(ent.ref)}
    return _cap(template.format(**{k: vals[k] for k in _fields(template)}))


def canonical_clause(label: str, reference: str, value: str) -> str:
    """The clause every statement of a fact contains, and that a probe completes."""
    return f"the {label} of {reference} is {value}"


# --------------------------------------------------------------------------------------------
# World: entities, facts, documents
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entity:
    name: str
    ref: str
    topic: int
    rank: int  # 1-based Zipf rank within its subtopic
    values: tuple[int, ...]  # per attribute of the domain: index into its values
    withheld: int  # attribute index never stated, or -1


@dataclass(frozen=True)
class _Doc:
    index: int
    topic: int
    entity: int  # rank - 1 within the topic
    stated: tuple[int, ...]  # attribute indices stated
    heldout: bool = False
    side: tuple[int, int] | None = None  # (famous entity, attribute) stated in passing at the end


_S_WORLD, _S_DOCS, _S_TEXT, _S_HELDOUT, _S_FAMOUS, _S_PARAPHRASE, _S_INITIAL = 1, 2, 3, 4, 5, 6, 7


def _rng(seed: int, stream: int, index: int) -> random.Random:
    """An independent generator per (seed, stream, index): integer seeding is platform-stable."""
    return random.Random(((seed * 16 + stream) << 40) + index)


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        r = rng.random()
        n_mid = 0 if r < 0.2 else (1 if r < 0.8 else 2)
        name = (
            rng.choice(ONSETS) + "".join(rng.choice(MIDS) for _ in range(n_mid)) + rng.choice(ENDS)
        )
        low = name.lower()
        if name not in used and not any(x in low for x in ("aa", "ee", "ii", "oo", "uu")):
            used.add(name)
            return name


@dataclass(frozen=True)
class _World:
    topics: tuple[_Topic, ...]
    entities: tuple[tuple[_Entity, ...], ...]  # per topic, by rank
    famous: tuple[_Entity, ...]  # mentioned in passing across their domain
    # per famous entity, (topic, entity index) of the documented entity it is, or (-1, f) when it
    # has no documents of its own (rank 0): the key its facts are counted under
    famous_keys: tuple[tuple[int, int], ...]
    docs: tuple[_Doc, ...]


def _world(spec: BiosSpec, topics: Sequence[_Topic] | None) -> _World:
    """The corpus plan; built once per (spec, topics), since the corpus, its facts and its
    held-out documents are all read off the same plan (write_bios asks for all three)."""
    return _build(spec, tuple(topics or _default_topics()))


@lru_cache(maxsize=4)
def _build(spec: BiosSpec, topics: tuple[_Topic, ...]) -> _World:
    used: set[str] = set()
    entities = []
    for t in topics:
        rng = _rng(spec.seed, _S_WORLD, t.index)
        ents = []
        for k in range(spec.entities_per_subtopic):
            name = _name(rng, used)
            values = tuple(rng.randrange(len(a.values)) for a in t.attrs)
            withheld = rng.randrange(len(t.attrs)) if rng.random() < spec.withheld_prob else -1
            ents.append(_Entity(name, f"the {t.kind} {name}", t.index, k + 1, values, withheld))
        entities.append(tuple(ents))
    famous: list[_Entity] = []
    famous_keys: list[tuple[int, int]] = []
    domains = sorted({t.domain: t.index for t in topics}.items(), key=lambda kv: kv[1])
    for d, (domain, first) in enumerate(domains):
        rng = _rng(spec.seed, _S_FAMOUS, d)
        subs = [t for t in topics if t.domain == domain]
        for k in range(spec.famous_per_domain):
            t = subs[k % len(subs)]
            if (
                spec.famous_are_heads
            ):  # the k-th famous entity: rank 1 + k // 4 of the (k % 4)-th subtopic
                i = min(k // len(subs), spec.entities_per_subtopic - 1)
                famous.append(entities[t.index][i])
                famous_keys.append((t.index, i))
                continue
            name = _name(rng, used)
            values = tuple(rng.randrange(len(a.values)) for a in t.attrs)
            famous.append(_Entity(name, f"the {t.kind} {name}", t.index, 0, values, -1))
            famous_keys.append((-1, len(famous) - 1))
    # Documents: per topic, docs_for_rank(r) documents about entity r; then one global order,
    # shuffled, so the stream mixes topics (the pipeline does not rely on input order).
    docs: list[tuple[int, int, tuple[int, ...]]] = []
    for t, ents in zip(topics, entities, strict=True):
        for e in ents:
            rng = _rng(spec.seed, _S_DOCS, t.index * 100_000 + e.rank)
            for _ in range(spec.docs_for_rank(e.rank)):
                docs.append((t.index, e.rank - 1, _stated(rng, e, spec.state_prob)))
    _rng(spec.seed, _S_DOCS, 10**9).shuffle(docs)
    by_domain: dict[str, list[int]] = {}
    for f, e in enumerate(famous):
        by_domain.setdefault(topics[e.topic].domain, []).append(f)
    out = []
    for i, d in enumerate(docs):
        side = None
        rng = _rng(spec.seed, _S_FAMOUS, 10**6 + i)
        # other documents mention a famous entity in passing, not its own documents
        pool = (
            range(len(famous))
            if spec.common_scope == "corpus"
            else by_domain.get(topics[d[0]].domain, [])
        )
        own = [f for f in pool if famous_keys[f] != (d[0], d[1])]
        if own and rng.random() < spec.common_prob:
            f = rng.choice(own)
            # never a withheld fact (a head entity may have one): it stays unseen by design
            side = (
                f,
                rng.choice(
                    [
                        j
                        for j in range(len(topics[famous[f].topic].attrs))
                        if j != famous[f].withheld
                    ]
                ),
            )
        out.append(_Doc(i, *d, side=side))
    return _World(tuple(topics), tuple(entities), tuple(famous), tuple(famous_keys), tuple(out))


def _stated(rng: random.Random, e: _Entity, p: float) -> tuple[int, ...]:
    allowed = [j for j in range(len(e.values)) if j != e.withheld]
    stated = [j for j in allowed if rng.random() < p]
    return tuple(stated or [rng.choice(allowed)])


def _render(
    doc: _Doc, world: _World, seed: int, stream: int = _S_TEXT, initial: float = 0.0
) -> str:
    rng = _rng(seed, stream, doc.index)
    t = world.topics[doc.topic]
    e = world.entities[doc.topic][doc.entity]
    facts = []
    for j in doc.stated:
        a = t.attrs[j]
        c = canonical_clause(a.label, e.ref, a.values[e.values[j]])
        frame = rng.choice(FACT_FRAMES)
        facts.append(
            frame.format(c=c, C=_cap(c), agent=t.agent, Agents=_cap(t.agents), topic=t.label)
        )
    lo, hi = (2, 4) if stream != _S_HELDOUT else (1, 2)
    prose = [_fill(rng, rng.choice(ABOUT), t, e) for _ in range(rng.randint(1, 2))]
    prose += [_fill(rng, rng.choice(FILLER), t, None) for _ in range(rng.randint(lo, hi) - 2)]
    rng.shuffle(prose)
    body = prose + facts
    rng.shuffle(body)
    if (
        doc.side is not None
    ):  # last: beyond the embedded head (the demo's 64 word pieces) in 98 % of documents
        f = world.famous[doc.side[0]]
        a = world.topics[f.topic].attrs[doc.side[1]]
        c = canonical_clause(a.label, f.ref, a.values[f.values[doc.side[1]]])
        k = COMMON_FRAMES.index(rng.choice(COMMON_FRAMES))
        # its own stream: the lead-in draw above, and so the rest of the corpus, stays as it was
        first = initial > 0 and _rng(seed, _S_INITIAL, doc.index).random() < initial
        body.append((COMMON_INITIAL if first else COMMON_FRAMES)[k].format(c=c, C=_cap(c)))
    return " ".join([_fill(rng, rng.choice(INTROS), t, e), *body])


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def generate_bios(
    spec: BiosSpec | None = None, *, topics: Sequence[_Topic] | None = None
) -> Iterator[dict]:
    """Yield the corpus records in a fixed order (deterministic for the spec)."""
    spec = spec or BiosSpec()
    world = _world(spec, topics)
    for d in world.docs:
        t = world.topics[d.topic]
        yield {
            "id": f"bio-{d.index:06d}",
            "text": _render(d, world, spec.seed, initial=spec.common_initial),
            "field": t.field,
            "domain": t.domain,
            "topic": t.key,
            "entity": world.entities[d.topic][d.entity].name,
        }


def bios_facts(
    spec: BiosSpec | None = None, *, topics: Sequence[_Topic] | None = None
) -> list[dict]:
    """Every (entity, attribute) fact with `mentions`: how many documents of the corpus state it.

    Also `value` (as written), `values` (the attribute's closed value set, for distractors),
    `label`, `reference` ("the red giant Veltharion"), `kind`, `rank` (0: a famous entity with no
    documents of its own, only mentioned in passing), `field`, `domain`, `topic`, `withheld`
    (never stated by design) and `famous`. Counted from the document plans, which
    `generate_bios` renders one to one.
    """
    spec = spec or BiosSpec()
    world = _world(spec, topics)
    counts: dict[tuple[int, int, int], int] = {}
    for d in world.docs:
        for j in d.stated:
            counts[d.topic, d.entity, j] = counts.get((d.topic, d.entity, j), 0) + 1
        if d.side is not None:
            key = (*world.famous_keys[d.side[0]], d.side[1])
            counts[key] = counts.get(key, 0) + 1
    famous = set(world.famous_keys)
    members = [
        (t.index, k, e)
        for t, ents in zip(world.topics, world.entities, strict=True)
        for k, e in enumerate(ents)
    ] + [(-1, f, e) for f, e in enumerate(world.famous) if world.famous_keys[f][0] == -1]
    out = []
    for key, k, e in members:
        t = world.topics[e.topic]
        for j, a in enumerate(t.attrs):
            out.append(
                {
                    "entity": e.name,
                    "reference": e.ref,
                    "kind": t.kind,
                    "rank": e.rank,
                    "field": t.field,
                    "domain": t.domain,
                    "topic": t.key,
                    "attribute": a.key,
                    "label": a.label,
                    "value": a.values[e.values[j]],
                    "values": list(a.values),
                    "mentions": counts.get((key, k, j), 0),
                    "withheld": j == e.withheld,
                    "famous": (key, k) in famous,
                }
            )
    return out


def heldout_bios(
    spec: BiosSpec | None = None, n_docs: int = 256, *, topics: Sequence[_Topic] | None = None
) -> list[dict]:
    """Fresh documents about entities the corpus is about (never trained on): held-out perplexity.

    Entities are drawn in proportion to their corpus documents, each document states the facts
    the corpus states about that entity at least once, with new frames and prose.
    """
    spec = spec or BiosSpec()
    world = _world(spec, topics)
    seen: dict[tuple[int, int], set[int]] = {}
    for d in world.docs:
        seen.setdefault((d.topic, d.entity), set()).update(d.stated)
    rng = _rng(spec.seed, _S_HELDOUT, 0)
    out = []
    for i in range(n_docs):
        src = world.docs[rng.randrange(len(world.docs))]
        stated = tuple(sorted(seen[src.topic, src.entity]))
        doc = _Doc(i, src.topic, src.entity, stated, heldout=True, side=None)
        t = world.topics[src.topic]
        out.append(
            {
                "id": f"bio-heldout-{i:05d}",
                "text": _render(doc, world, spec.seed, _S_HELDOUT),
                "field": t.field,
                "domain": t.domain,
                "topic": t.key,
                "entity": world.entities[src.topic][src.entity].name,
            }
        )
    return out


def write_bios(
    out_dir: str | os.PathLike[str], spec: BiosSpec | None = None, *, heldout_docs: int = 256
) -> dict[str, str | int]:
    """Write `corpus.jsonl`, `facts.jsonl`, `heldout.jsonl` and `corpus.json` (the spec)
    atomically."""
    spec = spec or BiosSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = list(generate_bios(spec))
    facts = bios_facts(spec)
    held = heldout_bios(spec, heldout_docs)
    for name, rows in (("corpus.jsonl", docs), ("facts.jsonl", facts), ("heldout.jsonl", held)):
        atomic_write_text(
            out / name,
            "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows),
        )
    atomic_write_json(
        out / "corpus.json",
        {
            "format": "memtree-bios",
            "version": 1,
            "spec": spec.record(),
            "documents": len(docs),
            "facts": len(facts),
            "heldout_documents": len(held),
            "vocabulary": VOCAB_PATH.name,
        },
    )
    return {
        "corpus": str(out / "corpus.jsonl"),
        "facts": str(out / "facts.jsonl"),
        "heldout": str(out / "heldout.jsonl"),
        "documents": len(docs),
        "n_facts": len(facts),
    }


def recall_pairs(docs: Iterable[dict], facts: Sequence[dict]) -> list[dict]:
    """(document, question about a fact the document states) pairs: what the context bank's
    compressor is trained and evaluated on (training/context/train.py, eval/context/recall.py).

    A document states a fact when it contains the fact's canonical clause (any case); the
    question is the probe's context, "The {label} of {reference} is", the answer the value. Each
    pair also carries the fact's closed value set (`values`) for unbiased distractors. Only the
    facts of the document's own entity and of famous entities (stated in passing) are looked for."""
    by_entity: dict[str, list[dict]] = {}
    for f in facts:
        by_entity.setdefault(f["entity"], []).append(f)
    famous = [f for f in facts if f.get("famous")]
    out = []
    for d in docs:
        text = d["text"].lower()
        seen = set()
        for f in by_entity.get(d["entity"], []) + famous:
            key = (f["entity"], f["attribute"])
            if (
                key in seen
                or canonical_clause(f["label"], f["reference"], f["value"]).lower() not in text
            ):
                continue
            seen.add(key)
            out.append(
                {
                    "doc": d["id"],
                    "prompt": d["text"],
                    "question": f"The {f['label']} of {f['reference']} is",
                    "answer": f["value"],
                    "values": list(f["values"]),
                    "entity": f["entity"],
                    "label": f["label"],
                    "reference": f["reference"],
                    "attribute": f["attribute"],
                    "domain": f.get("domain"),
                    "topic": f.get("topic"),
                }
            )
    return out


def fact_statements(
    fact: dict, n: int, *, seed: int = 0, topics: Sequence[_Topic] | None = None
) -> list[str]:
    """n statements of one fact, each in a different frame while frames last (the corpus's fact
    frames, then its common-knowledge ones; beyond that they repeat): the paraphrases a model
    learns a new fact from in continual finetuning (seed 003 §5.1). Every statement contains the
    fact's canonical clause, which a probe completes. Deterministic for (fact, n, seed).

    fact: a `bios_facts` record (`label`, `reference`, `value`, `topic`, `entity`, `attribute`)."""
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"statements per fact must be a positive integer, got {n!r}")
    by_key = {t.key: t for t in (topics or _default_topics())}
    t = by_key.get(fact.get("topic"))
    if t is None:
        raise ValueError(
            f"fact {fact.get('entity')!r}/{fact.get('attribute')!r}: "
            f"unknown topic {fact.get('topic')!r}"
        )
    c = canonical_clause(fact["label"], fact["reference"], fact["value"])
    frames = list(FACT_FRAMES + COMMON_FRAMES)
    rng = _rng(seed, _S_PARAPHRASE, zlib.crc32(f"{fact['entity']}|{fact['attribute']}".encode()))
    rng.shuffle(frames)
    return [
        frames[i % len(frames)].format(
            c=c, C=_cap(c), agent=t.agent, Agents=_cap(t.agents), topic=t.label
        )
        for i in range(n)
    ]


def exposure_stats(facts: Sequence[dict]) -> dict[int, int]:
    """How many facts are stated by exactly k documents (k → count)."""
    out: dict[int, int] = {}
    for f in facts:
        out[f["mentions"]] = out.get(f["mentions"], 0) + 1
    return dict(sorted(out.items()))


if __name__ == "__main__":  # pragma: no cover - a quick look at the corpus
    s = BiosSpec()
    docs = list(generate_bios(s))
    print(len(docs), "docs;", sum(len(d["text"].split()) for d in docs) / len(docs), "words/doc")
    print(docs[0]["text"], "\n")
    print(docs[1]["text"])
    fs = bios_facts(s)
    print(len(fs), "facts", exposure_stats(fs))
    print(math.fsum(1 for f in fs if f["withheld"]), "withheld")
