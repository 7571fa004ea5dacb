"""Tests for the embedded synthetic corpus (pipeline/corpus/topical.py).

They pin the properties the rest of memtree relies on: byte-for-byte determinism, balanced
topics that are separable from the words alone, facts that never contradict themselves,
Zipf-distributed entity mentions, long documents, and an atomic JSONL writer.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import Counter, defaultdict

import pytest

from memtree.pipeline.corpus import topical as corpus
from memtree.pipeline.corpus.topical import (
    DOMAINS,
    TOPICS,
    CorpusSpec,
    entity_facts,
    generate_corpus,
    write_corpus_jsonl,
)

DEFAULT = CorpusSpec()
_CAPWORD = re.compile(r"\b[A-Z][a-z]+\b")
_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+")


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return list(generate_corpus(DEFAULT))


@pytest.fixture(scope="module")
def facts() -> list[dict]:
    return entity_facts(DEFAULT)


def _dump(recs) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode("utf-8")


def _docs_per_entity(recs: list[dict], names: set[str]) -> Counter:
    """How many documents mention each entity name (names only occur in fact sentences)."""
    c: Counter = Counter()
    for r in recs:
        c.update(set(_CAPWORD.findall(r["text"])) & names)
    return c


def _has(value: str, sentence: str) -> bool:
    """`value` occurs as a whole token sequence: "521" is not found inside "1,521"."""
    return re.search(rf"(?<![\w,.]){re.escape(value)}(?![\w]|[,.]\d)", sentence) is not None


def _loglog_slope(xs: list[float], ys: list[float]) -> float:
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def _mean_mentions_by_rank(recs: list[dict], fcts: list[dict]) -> list[float]:
    rank_of = {f["entity"]: f["rank"] for f in fcts}
    per_doc = _docs_per_entity(recs, set(rank_of))
    by_rank: dict[int, list[int]] = defaultdict(list)
    for name, rank in rank_of.items():
        by_rank[rank].append(per_doc[name])
    return [sum(by_rank[r]) / len(by_rank[r]) for r in sorted(by_rank)]


# ---------------------------------------------------------------------------------- structure


def test_domains_structure():
    assert len(DOMAINS) == 16
    assert all(len(ts) == 4 for ts in DOMAINS.values())
    keys = [t for ts in DOMAINS.values() for t in ts]
    assert len(set(keys)) == 64, "topic keys must be unique corpus-wide"
    assert TOPICS == tuple((d, t) for d, ts in DOMAINS.items() for t in ts)


def test_determinism_and_seed():
    small = CorpusSpec(n_docs=250, seed=7)
    a = _dump(generate_corpus(small))
    b = _dump(generate_corpus(CorpusSpec(n_docs=250, seed=7)))
    assert a == b
    assert entity_facts(small) == entity_facts(small)
    c = _dump(generate_corpus(CorpusSpec(n_docs=250, seed=8)))
    assert a != c


def test_default_spec_is_default(records):
    first = list(itertools.islice(generate_corpus(), 50))
    assert first == records[:50]


def test_n_docs_and_ids(records):
    assert len(records) == DEFAULT.n_docs
    ids = [r["id"] for r in records]
    assert len(set(ids)) == len(ids)
    assert ids == [f"syn-{i:06d}" for i in range(len(ids))]
    assert all(set(r) == {"id", "text", "domain", "topic"} for r in records)
    for n in (1, 63, 130):
        assert sum(1 for _ in generate_corpus(CorpusSpec(n_docs=n))) == n


def test_texts_unique_and_clean(records):
    texts = [r["text"] for r in records]
    assert len(set(texts)) == len(texts), "ingest drops exact duplicates"
    for t in texts[:500]:
        assert t == t.strip() and "  " not in t and "{" not in t and "}" not in t
        assert t[0].isupper() and t[-1] in ".?"


def test_topics_balanced(records):
    counts = Counter((r["domain"], r["topic"]) for r in records)
    assert set(counts) == set(TOPICS)
    assert max(counts.values()) - min(counts.values()) <= 1
    dom = Counter(r["domain"] for r in records)
    assert max(dom.values()) - min(dom.values()) <= 4


def test_topics_separable_by_vocabulary(records):
    # A cheap proxy for "an embedder will cluster this": words unique to one subtopic's
    # vocabulary identify a document's subtopic (and hence its domain) almost always.
    owners: dict[str, set[int]] = defaultdict(set)
    for t in corpus._TOPIC_TABLE:
        for phrase in t.sub.nouns + t.sub.adjs + t.sub.verbs:
            for w in re.findall(r"[a-z]+", phrase.lower()):
                owners[w].add(t.index)
    sig: dict[int, set[str]] = defaultdict(set)
    for w, ts in owners.items():
        if len(ts) == 1:
            sig[next(iter(ts))].add(w)
    hits = 0
    for r in records:
        words = set(re.findall(r"[a-z]+", r["text"].lower()))
        best = max(range(64), key=lambda i: len(words & sig[i]))
        hits += TOPICS[best] == (r["domain"], r["topic"])
    assert hits / len(records) > 0.97


# -------------------------------------------------------------------------------------- facts


def test_entity_facts_schema(facts):
    required = {"entity", "domain", "topic", "attribute", "value", "mentions"}
    assert all(required <= set(f) for f in facts)
    per_entity: dict[str, list[dict]] = defaultdict(list)
    for f in facts:
        per_entity[f["entity"]].append(f)
    assert len(per_entity) == 64 * DEFAULT.entities_per_subtopic
    for name, fs in per_entity.items():
        assert re.fullmatch(r"[A-Z][a-z]+", name)
        assert 2 <= len(fs) <= 3
        assert len({f["attribute"] for f in fs}) == len(fs)
        assert len({(f["domain"], f["topic"], f["rank"]) for f in fs}) == 1
    assert all(f["mentions"] >= 0 for f in facts)
    assert sum(f["mentions"] > 0 for f in facts) > 0.8 * len(facts)


def test_entities_do_not_depend_on_n_docs(facts):
    # A benchmark built from one corpus size stays valid for another: only mentions change.
    def strip(fs):
        return [{k: v for k, v in f.items() if k != "mentions"} for f in fs]

    assert strip(entity_facts(CorpusSpec(n_docs=10))) == strip(facts)


def test_facts_consistent_with_text(records, facts):
    by_entity: dict[str, list[dict]] = defaultdict(list)
    pools: dict[tuple[str, str], set[str]] = defaultdict(set)
    for f in facts:
        by_entity[f["entity"]].append(f)
        pools[(f["domain"], f["attribute"])].add(f["value"])
    names = set(by_entity)
    categorical = {  # numeric pools are covered by the digit check below
        key: re.compile(
            r"(?<![\w,.])("
            + "|".join(re.escape(v) for v in sorted(vals, key=len, reverse=True))
            + r")(?![\w]|[,.]\d)"
        )
        for key, vals in pools.items()
        if not any(ch.isdigit() for v in vals for ch in v)
    }
    stated: Counter = Counter()
    n_sentences = 0
    for r in records:
        seen_in_doc: set[tuple[str, str]] = set()
        for sent in _SENT_SPLIT.split(r["text"]):
            present = set(_CAPWORD.findall(sent)) & names
            if not present:
                continue
            assert len(present) == 1, sent
            name = present.pop()
            fs = by_entity[name]
            assert fs[0]["domain"] == r["domain"] and fs[0]["topic"] == r["topic"]
            n_sentences += 1
            found = [f for f in fs if _has(f["value"], sent)]
            assert found, f"no fact value of {name} in: {sent}"
            # Every number in the sentence belongs to one of this entity's own values ...
            rest = sent
            for f in sorted(fs, key=lambda f: -len(f["value"])):
                rest = rest.replace(f["value"], "")
            assert not re.search(r"\d", rest), f"foreign number in: {sent}"
            # ... and no other entity's value of the same categorical attribute appears with it.
            for f in fs:
                pattern = categorical.get((f["domain"], f["attribute"]))
                if pattern is not None:
                    assert set(pattern.findall(sent)) <= {f["value"]}, sent
            for f in found:
                seen_in_doc.add((name, f["attribute"]))
        stated.update(seen_in_doc)
    assert n_sentences > 1000
    for f in facts:
        assert stated[(f["entity"], f["attribute"])] == f["mentions"], f


def test_zipf_mentions(records, facts):
    means = _mean_mentions_by_rank(records, facts)
    slope = _loglog_slope(list(range(1, len(means) + 1)), means)
    assert abs(slope + DEFAULT.zipf_exponent) < 0.35, slope
    assert means[0] > 5 * means[-1]


def test_zipf_exponent_configurable():
    spec = CorpusSpec(n_docs=2000, seed=3, zipf_exponent=1.6, long_doc_fraction=0.0)
    means = _mean_mentions_by_rank(list(generate_corpus(spec)), entity_facts(spec))
    slope = _loglog_slope(list(range(1, len(means) + 1)), means)
    assert abs(slope + 1.6) < 0.35, slope


# ------------------------------------------------------------------------------------ lengths


def test_document_lengths(records):
    words = [len(r["text"].split()) for r in records]
    long_docs = [w for w in words if w > 2500]
    assert len(long_docs) == round(DEFAULT.long_doc_fraction * DEFAULT.n_docs)
    assert max(words) < 6500
    short = [w for w in words if w <= 2500]
    assert min(short) >= 80
    assert sum(80 <= w <= 650 for w in short) / len(short) > 0.99
    none = CorpusSpec(n_docs=300, long_doc_fraction=0.0)
    assert all(len(r["text"].split()) <= 2500 for r in generate_corpus(none))


# ------------------------------------------------------------------------------------- writer


def test_write_corpus_jsonl_roundtrip(tmp_path):
    spec = CorpusSpec(n_docs=150, seed=2)
    path = tmp_path / "sub" / "corpus.jsonl"
    assert write_corpus_jsonl(path, spec) == 150
    raw = path.read_bytes()
    assert raw.endswith(b"\n") and raw.count(b"\n") == 150
    back = [json.loads(line) for line in raw.decode("utf-8").splitlines()]
    assert back == list(generate_corpus(spec))
    assert sorted(p.name for p in path.parent.iterdir()) == ["corpus.jsonl"], "temp file left"
    assert write_corpus_jsonl(str(path), spec) == 150  # overwrite in place
    assert path.read_bytes() == raw


# --------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_docs", 0),
        ("n_docs", -5),
        ("n_docs", 2.5),
        ("n_docs", True),
        ("seed", -1),
        ("seed", "0"),
        ("zipf_exponent", -0.1),
        ("zipf_exponent", float("nan")),
        ("zipf_exponent", "1"),
        ("entities_per_subtopic", 0),
        ("entities_per_subtopic", 10_000),
        ("long_doc_fraction", 1.5),
        ("long_doc_fraction", -0.01),
    ],
)
def test_spec_validation(field, value):
    with pytest.raises(ValueError, match=field):
        CorpusSpec(**{field: value})


def test_spec_is_frozen_and_keyword_only():
    spec = CorpusSpec()
    with pytest.raises(AttributeError):
        spec.n_docs = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        CorpusSpec(10)  # type: ignore[misc]
