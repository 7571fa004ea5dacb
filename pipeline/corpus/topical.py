"""The topical-prose corpus: synthetic English prose on 64 subtopics with long-tail facts.

Why it exists
-------------
memtree must run end to end (embed → hierarchical k-means → memory blocks → pretraining →
knowledge evaluation) on a machine with no network access, and its tests need a corpus whose
structure is *known*. A random-word corpus would not do: MiniLM embeddings of noise do not
cluster, so the memory tree would be meaningless. This module therefore writes real-looking
English documents with a known two-level topic hierarchy and a known set of facts, using only
the standard library and `random.Random` seeded from the spec, so that the same `CorpusSpec`
gives byte-identical output on any machine and Python build.

How it is structured
--------------------
* **Topics.** 16 clearly distinct domains (astronomy, cooking, …, railways), each with 4
  subtopics (`DOMAINS`). Every subtopic has its own hand-written vocabulary of nouns, verbs and
  adjectives, and every domain a small general vocabulary (practitioners, places, general
  nouns and adjectives), all in `data/topical_vocab.json` (`topical_vocab.py`); verbs are
  conjugated and articles chosen by `grammar.py`. Documents are prose assembled from ~40
  sentence templates of several syntactic forms (statements, questions, conditionals,
  contrasts, gerund and infinitive clauses) filled with the subtopic's words, plus a small
  share (~12%) of the domain's general words. A sentence embedder separates the domains
  sharply and the subtopics clearly, which is exactly the shape the hierarchical k-means tree
  is meant to recover.
* **Balance.** Documents are dealt to the 64 subtopics in shuffled rounds, so every subtopic
  gets `n_docs / 64` documents, ±1.
* **Long-tail knowledge.** Each subtopic has `entities_per_subtopic` fictional entities (names
  built from syllables, unique corpus-wide, never an English word of the vocabulary) with 2–3
  attribute facts each, drawn from per-domain attribute templates ("the star Veltharion has a
  surface temperature of 5,812 kelvin", "Chef Oramund rarely cooks without sumac"). A fact is
  fixed per entity: every statement of it uses the same value, though the phrasing varies.
* **Zipf mentions.** Facts live only in documents of their entity's own subtopic, so that a
  fact lands in one region of the memory tree. Within a subtopic the entities are ranked
  1..k, and each document of the subtopic mentions the entity of rank r independently with
  probability ``0.5 * r ** -zipf_exponent``: the expected number of documents mentioning an
  entity is proportional to ``rank ** -zipf_exponent`` (a Zipf law with the configured
  exponent; head entities appear in about half of their subtopic's documents, tail entities in
  a handful or none). A mention states each of the entity's facts with probability 0.65 (at
  least one). `entity_facts` reports, per fact, exactly how many documents state it, so a
  knowledge benchmark can ask about head and tail facts and know how often each was seen.
  (A single corpus-wide ranking is not used because an entity cannot appear in more documents
  than its subtopic has: with 768 entities such a law would leave almost all of them unseen.)
* **Lengths.** Most documents have 80–600 words (log-uniform); a `long_doc_fraction` share has
  2,600–6,000 words, so one document spans several 2,048-token training windows.

Records are ``{"id": "syn-000000", "text": ..., "domain": ..., "topic": ...}`` where `domain`
and `topic` are the snake_case keys of `DOMAINS`.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import string
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from memtree.config import is_int
from memtree.io import atomic_write_text
from memtree.pipeline.corpus.grammar import VOWELS, cap, gerund, third_person, with_article
from memtree.pipeline.corpus.topical_vocab import VOCABULARY, Attribute, Domain, Subtopic

__all__ = [
    "DOMAINS",
    "TOPICS",
    "CorpusSpec",
    "entity_facts",
    "generate_corpus",
    "write_corpus_jsonl",
]

# Probability that a document mentions the rank-1 entity of its subtopic; rank r gets
# HEAD_MENTION_PROB * r**-s. Kept below 1 so the Zipf law is never clipped.
HEAD_MENTION_PROB = 0.5
# Probability that a mention states a given fact of the entity (at least one is always stated).
FACT_STATE_PROB = 0.65
# Share of noun / adjective slots filled from the domain's general vocabulary.
GENERAL_NOUN_SHARE = 0.12
GENERAL_ADJ_SHARE = 0.15
SHORT_DOC_WORDS = (80, 560)  # log-uniform target; the final sentence may overshoot a little
LONG_DOC_WORDS = (2600, 6000)


# --------------------------------------------------------------------------------------------
# Spec
# --------------------------------------------------------------------------------------------


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, kw_only=True)
class CorpusSpec:
    """Everything that determines the corpus: the same spec always yields the same bytes.

    n_docs: number of documents. seed: non-negative integer; different seeds give different
    entities, facts, topic order and text. zipf_exponent: exponent s of the per-subtopic Zipf
    law of entity mentions (0 = uniform). entities_per_subtopic: fictional entities per
    subtopic (64 subtopics). long_doc_fraction: share of documents with 2,600–6,000 words.
    """

    n_docs: int = 4000
    seed: int = 0
    zipf_exponent: float = 1.0
    entities_per_subtopic: int = 12
    long_doc_fraction: float = 0.03

    def __post_init__(self) -> None:
        # Validate eagerly: a bad spec would otherwise surface as an obscure error deep
        # inside generation, or worse, as a silently odd corpus.
        n, seed, s = self.n_docs, self.seed, self.zipf_exponent
        e, f = self.entities_per_subtopic, self.long_doc_fraction
        if not is_int(n) or not 1 <= n <= 10_000_000:
            raise ValueError(f"CorpusSpec.n_docs must be an int in [1, 10000000], got {n!r}")
        if not is_int(seed) or seed < 0:
            raise ValueError(f"CorpusSpec.seed must be a non-negative int, got {seed!r}")
        if not _is_real(s) or not 0 <= s <= 10:
            raise ValueError(f"CorpusSpec.zipf_exponent must be a number in [0, 10], got {s!r}")
        # 500 per subtopic (32,000 names) keeps syllable names plentiful and unique.
        if not is_int(e) or not 1 <= e <= 500:
            raise ValueError(
                f"CorpusSpec.entities_per_subtopic must be an int in [1, 500], got {e!r}"
            )
        if not _is_real(f) or not 0 <= f <= 1:
            raise ValueError(f"CorpusSpec.long_doc_fraction must be a number in [0, 1], got {f!r}")


# --------------------------------------------------------------------------------------------
# Topics (the vocabulary lives in data/topical_vocab.json, read by topical_vocab.py)
# --------------------------------------------------------------------------------------------


DOMAINS: dict[str, tuple[str, ...]] = {d.key: tuple(s.key for s in d.subs) for d in VOCABULARY}
"""Domain key → its subtopic keys, in canonical order (16 domains × 4 subtopics). Read-only."""

TOPICS: tuple[tuple[str, str], ...] = tuple((d, t) for d, ts in DOMAINS.items() for t in ts)
"""All (domain, topic) pairs in canonical order; a topic's index here is its `topic_index`."""


# --------------------------------------------------------------------------------------------
# Sentence templates
# --------------------------------------------------------------------------------------------
# Fields: N1..N3 subtopic nouns (distinct; a small share from the domain's general nouns),
# V1/V2 base verbs, S1 third-person verb, G1 gerund, A1/A2 adjectives, aA1/aA2 adjective with
# its article, P practitioners, p practitioner, ap "a/an practitioner", L a place, G a general
# noun, D the domain, T the topic.

_FILLER = (
    "The {A1} {N1} is central to the study of {T}.",
    "{P} often {V1} the {N1} before they {V2} the {N2}.",
    "When {P} {V1} the {N1}, the {N2} tends to become more {A1}.",
    "{ap} who wants to {V1} the {N1} should first understand the {N2}.",
    "Why does the {N1} seem so {A1} to most {P}?",
    "Few subjects in {D} are as {A1} as the {N1}.",
    "The {N1} and the {N2} are closely linked, since both depend on the {A1} {N3}.",
    "In {T}, the {N1} usually {S1} the {N2}.",
    "Careful {P} {V1} the {N1} only after checking the {A1} {N2}.",
    "It is the {A1} {N1}, not the {N2}, that {S1} the {N3}.",
    "Without the {N1}, no {p} could {V1} the {N2} properly.",
    "Consider the {N1}: it {S1} the {N2} and shapes the {A1} {N3}.",
    "To {V1} the {N1}, {P} rely on the {N2} and on the {A1} {G}.",
    "Most introductions to {T} begin with the {N1}.",
    "At the {L}, much depends on how well the {N1} {S1} the {N2}.",
    "Although the {N1} is {A1}, experienced {P} still {V1} it regularly.",
    "{G1} the {N1} requires patience and {aA1} {N2}.",
    "By {G1} the {N1}, {ap} can learn a great deal about the {A1} {N2}.",
    "How should {P} {V1} the {N1} when the {N2} is {A1}?",
    "The {N1}, the {N2} and the {N3} together define much of {T}.",
    "If the {N1} {S1} the {N2}, the result is {aA1} {N3}.",
    "Questions about the {A1} {N1} come up in almost every discussion of {D}.",
    "Many {P} at the {L} prefer to {V1} the {N1} rather than the {N2}.",
    "One {A1} detail is often overlooked: the {N1} rarely {S1} the {N2} on its own.",
    "Beginners in {T} should learn to {V1} the {N1} before they try to {V2} the {N2}.",
    "There is a long tradition of {P} who {V1} the {N1} with great care.",
    "The most {A1} part of {T} is arguably the {N1}.",
    "Whether the {N1} turns out {A1} or {A2} depends largely on the {N2}.",
    "Let us look more closely at the {N1} and the way it {S1} the {N2}.",
    "Textbooks on {D} describe the {N1} as {A1} and the {N2} as {A2}.",
    "No serious account of {T} can ignore the {A1} {N1}.",
    "The {p} paused to {V1} the {N1}, then turned to the {N2}.",
    "Every {G} says something {A1} about the {N1}.",
    "{aA1} {N1} is easier to {V1} than {aA2} {N2}.",
    "Ask any {p} about the {N1} and you will hear about the {A1} {N2}.",
    "Over time, the {N1} {S1} the {N2}, and the {N3} grows more {A1}.",
    "Is the {N1} really more {A1} than the {N2}?",
    "Only after the {N1} {S1} the {N2} can {P} {V1} the {N3}.",
    "Notice how the {A1} {N1} and the {A2} {N2} work together.",
    "Experts in {T} still disagree about how the {N1} {S1} the {N2}.",
    "{G1} the {A1} {N1} is a skill that every {p} eventually needs.",
    "In practice, the {N1} matters more than the {A1} {N2} suggests.",
)
_OPENERS = (
    "This article looks at {T}, {aA1} corner of {D}.",
    "The study of {T} is one of the most {A1} subjects in {D}.",
    "Anyone interested in {D} eventually runs into {T}.",
    "The following notes on {T} were written for {P} and curious readers alike.",
    "What follows is a short introduction to {T} and the {A1} {N1}.",
    "Among the branches of {D}, the study of {T} stands out for the {A1} {N1}.",
)
_CLOSERS = (
    "In short, {T} rewards anyone willing to study the {N1} closely.",
    "These ideas about the {N1} and the {N2} remain at the heart of {T}.",
    "There is always more to learn about the {A1} {N1}.",
    "For {P}, the {N1} will remain {aA1} subject for years to come.",
)

# Fact phrasings that work for any attribute ({dv}: the value, with its article if it has one).
_GENERIC_FACT = (
    "The {label} of {ref} is {dv}.",
    "{Ref}'s {label} is {dv}.",
    "According to the records, the {label} of {ref} is {dv}.",
    "For {ref}, the {label} is {dv}.",
    "Any {p} familiar with {ref} knows that the {label} is {dv}.",
    "One detail stands out about {ref}: the {label} is {dv}.",
    "It is well documented that {ref}'s {label} is {dv}.",
    "Records give {dv} as the {label} of {ref}.",
)
# Extra phrasings for measured quantities that carry a unit ("... a mass of 3.2 solar masses").
_MEASURE_FACT = (
    "{Ref} is listed with {a_label} of {dv}.",
    "With {a_label} of {dv}, {ref} stands out in the records.",
)


def _fields(template: str) -> tuple[str, ...]:
    return tuple(f for _, f, _, _ in string.Formatter().parse(template) if f)


_FILLER_F = tuple((t, _fields(t)) for t in _FILLER)
_OPENERS_F = tuple((t, _fields(t)) for t in _OPENERS)
_CLOSERS_F = tuple((t, _fields(t)) for t in _CLOSERS)


# --------------------------------------------------------------------------------------------
# World: topics with conjugated vocabularies, entities and their facts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Topic:
    index: int
    domain: Domain
    sub: Subtopic
    verbs: tuple[tuple[str, str, str], ...]  # (base, third person, gerund)


@dataclass(frozen=True)
class _Fact:
    attr: Attribute
    value: str


@dataclass(frozen=True)
class _Entity:
    name: str
    ref: str
    topic_index: int
    rank: int  # 1-based Zipf rank within its subtopic
    facts: tuple[_Fact, ...]


@dataclass(frozen=True)
class _World:
    topics: tuple[_Topic, ...]
    entities: tuple[tuple[_Entity, ...], ...]  # per topic, ordered by rank
    mention_prob: tuple[float, ...]  # per rank (0-based)


_TOPIC_TABLE: tuple[_Topic, ...] = tuple(
    _Topic(
        i,
        d,
        s,
        tuple((v, third_person(v), gerund(v)) for v in s.verbs),
    )
    for i, (d, s) in enumerate((d, s) for d in VOCABULARY for s in d.subs)
)


def _vocabulary_tokens() -> frozenset[str]:
    """Every lowercase word the generator can emit besides names: names must avoid them."""
    texts: list[str] = list(_FILLER + _OPENERS + _CLOSERS + _GENERIC_FACT + _MEASURE_FACT)
    for d in VOCABULARY:
        texts += [d.label, d.agents, d.agent, d.ref, *d.places, *d.nouns, *d.adjs]
        for a in d.attrs:
            texts += [a.label, a.unit, *a.phrasings, *a.choices]
        for s in d.subs:
            texts += [s.label, *s.nouns, *s.verbs, *s.adjs]
    out: set[str] = set()
    for t in texts:
        word = []
        for c in t.lower() + " ":
            if c.isalpha():
                word.append(c)
            elif word:
                out.add("".join(word))
                word = []
    return frozenset(out)


_VOCAB_TOKENS = _vocabulary_tokens()


def _w(text: str) -> tuple[str, ...]:
    """Split a comma-separated word list (entries may be multi-word phrases)."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


_ONSETS = _w(
    "Vel, Or, Ka, Thal, Mor, Ser, Bri, Quen, Dra, Ly, Ash, Cor, Fen, Gal, Hal, Ist, Jor, Kel, "
    "Lun, Mar, Nim, Os, Pel, Riv, Sol, Tor, Ul, Var, Wen, Yr, Zan, Bel, Cas, Del, El, Fal, Gor, "
    "Hes, Ith, Kor, Nal, Per, Sev, Tam, Ves, Ard"
)
_MIDS = _w("a, e, i, o, u, ar, en, il, or, an, eth, is, um, ad, el, ir, on, av, ith, ul, ev, os")
_ENDS = _w(
    "ion, und, ath, is, or, an, el, ia, on, ar, eth, yn, ius, ara, os, ix, em, orn, ald, ira, "
    "un, as, ek, iel, ost, imar, wen, oth, esk, ande"
)


def _make_name(rng: random.Random) -> str:
    r = rng.random()
    n_mid = 0 if r < 0.2 else (1 if r < 0.8 else 2)
    parts = [rng.choice(_ONSETS)] + [rng.choice(_MIDS) for _ in range(n_mid)] + [rng.choice(_ENDS)]
    return "".join(parts)


_AWKWARD = ("aa", "ee", "ii", "oo", "uu", "yi", "iy")


def _good_name(name: str) -> bool:
    """Pronounceable (no doubled or tripled vowels) and never a word the text uses elsewhere."""
    low = name.lower()
    if any(x in low for x in _AWKWARD):
        return False
    run = 0
    for c in low:
        run = run + 1 if c in VOWELS + "y" else 0
        if run >= 3:
            return False
    return low not in _VOCAB_TOKENS


def _rng(seed: int, stream: int, index: int) -> random.Random:
    """An independent generator per (seed, stream, index): integer seeding is platform-stable."""
    return random.Random(((seed * 16 + stream) << 40) + index)


_S_WORLD, _S_TOPIC_ORDER, _S_PLAN, _S_TEXT, _S_LONG = 1, 2, 3, 4, 5


def _format_value(attr: Attribute, rng: random.Random) -> str:
    if attr.kind == "cat":
        return rng.choice(attr.choices)
    n = rng.randint(attr.lo, attr.hi)
    if attr.kind == "year":
        return str(n)
    text = f"{n / 10:,.1f}" if attr.kind == "dec" else f"{n:,}"
    return f"{text} {attr.unit}" if attr.unit else text


def _build_world(spec: CorpusSpec) -> _World:
    used: set[str] = set()
    per_topic: list[tuple[_Entity, ...]] = []
    for topic in _TOPIC_TABLE:
        rng = _rng(spec.seed, _S_WORLD, topic.index)
        ents = []
        for k in range(spec.entities_per_subtopic):
            while True:
                name = _make_name(rng)
                if name not in used and _good_name(name):
                    break
            used.add(name)
            attrs = topic.domain.attrs
            n_facts = rng.choice((2, 3)) if len(attrs) > 2 else len(attrs)
            chosen = sorted(rng.sample(range(len(attrs)), n_facts))
            facts = tuple(_Fact(attrs[j], _format_value(attrs[j], rng)) for j in chosen)
            ref = topic.domain.ref.format(name=name)
            ents.append(_Entity(name, ref, topic.index, k + 1, facts))
        per_topic.append(tuple(ents))
    s = float(spec.zipf_exponent)
    probs = tuple(HEAD_MENTION_PROB * (r**-s) for r in range(1, spec.entities_per_subtopic + 1))
    return _World(_TOPIC_TABLE, tuple(per_topic), probs)


# --------------------------------------------------------------------------------------------
# Document plans (what a document is about and which facts it states) and rendering
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    index: int
    topic_index: int
    target_words: int
    long: bool
    mentions: tuple[tuple[int, tuple[int, ...]], ...]  # (entity rank-1, indices of facts stated)


def _plans(spec: CorpusSpec, world: _World) -> Iterator[_Plan]:
    """The plan of every document, in order. Cheap: `entity_facts` counts mentions from it."""
    n_topics = len(world.topics)
    n_long = round(spec.long_doc_fraction * spec.n_docs)
    long_ids = set(_rng(spec.seed, _S_LONG, 0).sample(range(spec.n_docs), n_long))
    order_rng = _rng(spec.seed, _S_TOPIC_ORDER, 0)
    order: list[int] = []
    lo, hi = math.log(SHORT_DOC_WORDS[0]), math.log(SHORT_DOC_WORDS[1])
    for i in range(spec.n_docs):
        if i % n_topics == 0:  # deal topics in shuffled rounds: balanced to ±1
            order = list(range(n_topics))
            order_rng.shuffle(order)
        topic_index = order[i % n_topics]
        rng = _rng(spec.seed, _S_PLAN, i)
        is_long = i in long_ids
        if is_long:
            target = rng.randint(*LONG_DOC_WORDS)
        else:
            target = int(math.exp(rng.uniform(lo, hi)))
        mentions = []
        for k, ent in enumerate(world.entities[topic_index]):
            if rng.random() < world.mention_prob[k]:
                stated = [j for j in range(len(ent.facts)) if rng.random() < FACT_STATE_PROB]
                if not stated:
                    stated = [rng.randrange(len(ent.facts))]
                mentions.append((k, tuple(stated)))
        yield _Plan(i, topic_index, target, is_long, tuple(mentions))


def _fill(rng: random.Random, template: str, fields: tuple[str, ...], topic: _Topic) -> str:
    """Fill a template; redraw if an adjective stutters into its noun ("ornamental ornamental")."""
    for _ in range(8):
        s = _fill_once(rng, template, fields, topic)
        if not _STUTTER.search(s):
            return s
    return s


_STUTTER = re.compile(r"\b(\w+) \1\b", re.IGNORECASE)


def _fill_once(rng: random.Random, template: str, fields: tuple[str, ...], topic: _Topic) -> str:
    dom, sub = topic.domain, topic.sub
    vals: dict[str, str] = {}
    nouns: list[str] = []
    adjs: list[str] = []
    for f in fields:
        if f in vals:
            continue
        if f[0] == "N":
            while True:
                pool = dom.nouns if rng.random() < GENERAL_NOUN_SHARE else sub.nouns
                w = rng.choice(pool)
                if w not in nouns:
                    break
            nouns.append(w)
            vals[f] = w
        elif f in ("A1", "A2", "aA1", "aA2"):
            while True:
                pool = dom.adjs if rng.random() < GENERAL_ADJ_SHARE else sub.adjs
                w = rng.choice(pool)
                if w not in adjs:
                    break
            adjs.append(w)
            vals[f] = with_article(w) if f[0] == "a" else w
        elif f in ("V1", "V2"):
            vals[f] = rng.choice(topic.verbs)[0]
        elif f == "S1":
            vals[f] = rng.choice(topic.verbs)[1]
        elif f == "G1":
            vals[f] = rng.choice(topic.verbs)[2]
        elif f == "P":
            vals[f] = dom.agents
        elif f == "p":
            vals[f] = dom.agent
        elif f == "ap":
            vals[f] = with_article(dom.agent)
        elif f == "L":
            vals[f] = rng.choice(dom.places)
        elif f == "G":
            vals[f] = rng.choice(dom.nouns)
        elif f == "D":
            vals[f] = dom.label
        elif f == "T":
            vals[f] = sub.label
        else:  # pragma: no cover - a template typo
            raise KeyError(f"unknown template field {f!r}")
    return cap(template.format(**vals))


def _fact_sentence(rng: random.Random, ent: _Entity, fact: _Fact, topic: _Topic) -> str:
    attr = fact.attr
    shown = with_article(fact.value) if attr.article else fact.value
    options = list(attr.phrasings)
    if attr.generic:
        options += _GENERIC_FACT
        if attr.kind in ("int", "dec") and attr.unit:
            options += _MEASURE_FACT
    # Favour the attribute's own natural phrasings; the generic ones add variety.
    template = rng.choice(attr.phrasings) if rng.random() < 0.45 else rng.choice(options)
    return cap(
        template.format(
            ref=ent.ref,
            Ref=cap(ent.ref),
            v=fact.value,
            a_v=shown,
            dv=shown,
            label=attr.label,
            a_label=with_article(attr.label),
            p=topic.domain.agent,
        )
    )


def _render(plan: _Plan, world: _World, seed: int) -> str:
    rng = _rng(seed, _S_TEXT, plan.index)
    topic = world.topics[plan.topic_index]
    ents = world.entities[plan.topic_index]
    groups = [
        [_fact_sentence(rng, ents[k], ents[k].facts[j], topic) for j in stated]
        for k, stated in plan.mentions
    ]
    words = sum(len(s.split()) for g in groups for s in g)
    t, f = rng.choice(_OPENERS_F)
    sentences = [_fill(rng, t, f, topic)]
    words += len(sentences[0].split())
    while words < plan.target_words:
        t, f = rng.choice(_FILLER_F)
        s = _fill(rng, t, f, topic)
        sentences.append(s)
        words += len(s.split())
    if rng.random() < 0.5:
        t, f = rng.choice(_CLOSERS_F)
        closer: str | None = _fill(rng, t, f, topic)
    else:
        closer = None
    paragraphs: list[list[str]] = []
    lo, hi = (4, 8) if plan.long else (3, 7)
    pos = 0
    while pos < len(sentences):
        size = rng.randint(lo, hi)
        paragraphs.append(sentences[pos : pos + size])
        pos += size
    for g in groups:  # each mention's facts stay together, somewhere after the opener
        p = rng.randrange(len(paragraphs))
        para = paragraphs[p]
        at = rng.randint(1 if p == 0 else 0, len(para))
        para[at:at] = g
    if closer is not None:
        paragraphs[-1].append(closer)
    return "\n\n".join(" ".join(p) for p in paragraphs)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def generate_corpus(spec: CorpusSpec | None = None) -> Iterator[dict]:
    """Yield the corpus records ``{"id", "text", "domain", "topic"}`` in a fixed order.

    Deterministic by construction (integer-seeded `random.Random` streams per document, no
    hashing of strings, no set iteration), so the same spec gives byte-identical records on
    any machine; documents are produced lazily, so memory stays flat for large `n_docs`.
    """
    spec = spec if spec is not None else CorpusSpec()
    world = _build_world(spec)
    for plan in _plans(spec, world):
        topic = world.topics[plan.topic_index]
        yield {
            "id": f"syn-{plan.index:06d}",
            "text": _render(plan, world, spec.seed),
            "domain": topic.domain.key,
            "topic": topic.sub.key,
        }


def entity_facts(spec: CorpusSpec | None = None) -> list[dict]:
    """Every fictional entity's facts, with how many documents of `spec`'s corpus state each.

    One dict per (entity, attribute): ``entity`` (the name), ``domain``, ``topic``,
    ``attribute`` (a key such as ``surface_temperature``), ``value`` (exactly as written in the
    text), ``mentions`` (documents stating that fact), plus ``label`` (the attribute in words),
    ``reference`` (how the text names the entity, e.g. "the star Veltharion") and ``rank`` (its
    Zipf rank within its subtopic). A knowledge benchmark uses it to ask questions whose answers
    the model saw a known number of times; facts with ``mentions == 0`` were never stated.
    Computed from the document plans only, so it costs a fraction of generating the text.
    """
    spec = spec if spec is not None else CorpusSpec()
    world = _build_world(spec)
    counts = [[[0] * len(e.facts) for e in ents] for ents in world.entities]
    for plan in _plans(spec, world):
        tc = counts[plan.topic_index]
        for k, stated in plan.mentions:
            for j in stated:
                tc[k][j] += 1
    out = []
    for topic, ents, tc in zip(world.topics, world.entities, counts):
        for ent, fc in zip(ents, tc):
            for fact, n in zip(ent.facts, fc):
                out.append(
                    {
                        "entity": ent.name,
                        "domain": topic.domain.key,
                        "topic": topic.sub.key,
                        "attribute": fact.attr.key,
                        "value": fact.value,
                        "mentions": n,
                        "label": fact.attr.label,
                        "reference": ent.ref,
                        "rank": ent.rank,
                    }
                )
    return out


def write_facts_jsonl(path: str | os.PathLike[str], spec: CorpusSpec | None = None) -> int:
    """Write `entity_facts(spec)` as JSONL (atomically) and return the fact count."""
    facts = entity_facts(spec)
    atomic_write_text(path, "".join(json.dumps(f, sort_keys=True) + "\n" for f in facts))
    return len(facts)


def write_corpus_jsonl(path: str | os.PathLike[str], spec: CorpusSpec | None = None) -> int:
    """Write the corpus as JSONL (one UTF-8 object per line) and return the record count.

    Atomic: the records go to a temporary file in the target directory, which is fsynced and
    then renamed over `path`, so a reader (or a crash) never sees a half-written corpus.
    """
    spec = spec if spec is not None else CorpusSpec()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            for record in generate_corpus(spec):
                fh.write(json.dumps(record, ensure_ascii=False))
                fh.write("\n")
                n += 1
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable (POSIX); best effort elsewhere
        dfd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return n
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
    return n
