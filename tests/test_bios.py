"""The entity-centric default corpus (pipeline/corpus/bios.py): determinism, exposure counts,
vocabulary checks."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter

import pytest

from memtree.pipeline.corpus.bios import (
    VOCAB_PATH,
    BiosSpec,
    bios_facts,
    canonical_clause,
    generate_bios,
    heldout_bios,
    load_vocabulary,
    write_bios,
)

SMALL = BiosSpec(seed=5, entities_per_subtopic=4, head_docs=6, zipf_exponent=1.0)


def test_same_spec_same_bytes_and_seeds_differ():
    a = list(generate_bios(SMALL))
    assert a == list(generate_bios(SMALL))
    b = list(
        generate_bios(BiosSpec(seed=6, entities_per_subtopic=4, head_docs=6, zipf_exponent=1.0))
    )
    assert [r["text"] for r in a] != [r["text"] for r in b]
    assert len({r["id"] for r in a}) == len(a)


def test_documents_per_entity_follow_the_zipf_plan():
    docs = list(generate_bios(SMALL))
    per_entity = Counter((r["topic"], r["entity"]) for r in docs)
    facts = bios_facts(SMALL)
    # rank 0: undocumented
    rank = {(f["topic"], f["entity"]): f["rank"] for f in facts if f["rank"] >= 1}
    assert len(rank) == 64 * SMALL.entities_per_subtopic  # 4 fields × 4 domains × 4 subtopics
    for key, r in rank.items():
        assert per_entity[key] == SMALL.docs_for_rank(r) == max(1, round(6 * r**-1.0))


@pytest.mark.parametrize("heads", [True, False], ids=["famous-heads", "famous-undocumented"])
def test_exposure_counts_equal_a_count_over_the_generated_text(heads):
    """`mentions` is counted from the plan; here it is recounted from the rendered documents."""
    spec = dataclasses.replace(SMALL, famous_are_heads=heads)
    docs = list(generate_bios(spec))
    facts = bios_facts(spec)
    by_name: dict[str, list[dict]] = {}
    for f in facts:
        by_name.setdefault(f["entity"], []).append(f)
    counted: Counter = Counter()
    for d in docs:
        for name in set(re.findall(r"[A-Z][a-z]+", d["text"])) & set(by_name):
            for f in by_name[name]:
                clause = canonical_clause(f["label"], f["reference"], f["value"])
                counted[name, f["attribute"]] += bool(
                    re.search(re.escape(clause) + r"[.,]", d["text"], re.IGNORECASE)
                )
    assert all(counted[f["entity"], f["attribute"]] == f["mentions"] for f in facts)
    # withheld facts are never stated, and the buckets the benchmark needs are all populated
    assert all(f["mentions"] == 0 for f in facts if f["withheld"])
    assert {0, 1, 2} <= {f["mentions"] for f in facts}
    famous = [f for f in facts if f["famous"]]
    passing = sum(
        bool(
            re.search(
                r"([Ee]veryone knows|common knowledge|readers will remember|widely known)",
                d["text"],
            )
        )
        for d in docs
    )
    per_entity = Counter(d["entity"] for d in docs)
    assert passing > len(docs) / 3  # common_prob 0.6 of the documents mention a famous fact
    if (
        heads
    ):  # famous entities are their subtopic's head: documented and mentioned across the domain
        assert len(famous) == 16 * 4  # one famous entity per domain, its 4 attributes
        assert all(f["rank"] == 1 and per_entity[f["entity"]] == spec.head_docs for f in famous)
        assert sum(f["mentions"] for f in famous) > passing
        top = sorted(facts, key=lambda f: -f["mentions"])[: len(famous) // 2]
        assert all(f["famous"] for f in top)  # the most stated facts of the corpus
    else:  # no document of their own, stated only in passing across many topics
        assert len(famous) == 16 * 4 and not {f["entity"] for f in famous} & set(per_entity)
        assert sum(f["mentions"] for f in famous) == passing


def test_values_are_closed_sets_and_uniform():
    facts = bios_facts(BiosSpec(seed=1))
    position: Counter = Counter()  # index of the value in its set, for the 12-value attributes
    for f in facts:
        assert f["value"] in f["values"]
        if len(f["values"]) == 12:
            position[f["values"].index(f["value"])] += 1
    n = sum(position.values())
    assert n > 2000 and len(position) == 12
    # uniform draws: every position within ±30 % of n / 12 (~4.5 standard deviations)
    assert all(abs(c - n / 12) < 0.3 * n / 12 for c in position.values()), position


def test_heldout_documents_are_new_text_about_seen_entities():
    docs = list(generate_bios(SMALL))
    held = heldout_bios(SMALL, 40)
    assert held == heldout_bios(SMALL, 40)
    texts = {d["text"] for d in docs}
    seen = {(d["topic"], d["entity"]) for d in docs}
    assert all(h["text"] not in texts and (h["topic"], h["entity"]) in seen for h in held)


def test_write_bios_writes_all_files(tmp_path):
    info = write_bios(tmp_path, SMALL, heldout_docs=8)
    lines = (tmp_path / "corpus.jsonl").read_text().splitlines()
    assert len(lines) == info["documents"] and json.loads(lines[0])["id"] == "bio-000000"
    meta = json.loads((tmp_path / "corpus.json").read_text())
    assert meta["format"] == "memtree-bios" and meta["version"] == 1 and meta["spec"]["seed"] == 5
    assert len((tmp_path / "facts.jsonl").read_text().splitlines()) == info["n_facts"]
    assert len((tmp_path / "heldout.jsonl").read_text().splitlines()) == 8


def test_bad_spec_and_bad_vocabulary_are_named(tmp_path):
    with pytest.raises(ValueError, match="state_prob"):
        BiosSpec(state_prob=0)
    with pytest.raises(ValueError, match="entities_per_subtopic"):
        BiosSpec(entities_per_subtopic=0)
    bad = tmp_path / "v.json"
    bad.write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(
        ValueError,
        match=(
            r"v\.json: not a bios vocabulary file "
            r"\(format 'other', expected 'memtree-bios-vocab'\)"
        ),
    ):
        load_vocabulary(bad)
    data = json.loads(VOCAB_PATH.read_text())
    data["fields"][0]["domains"][0]["attributes"][0]["values"] = ["a", "a", "b", "c"]
    bad.write_text(json.dumps(data))
    with pytest.raises(
        ValueError, match="attribute 'surface_temperature' needs ≥ 4 distinct values"
    ):
        load_vocabulary(bad)
    topics = load_vocabulary()
    assert len(topics) == 64 and len({t.kind for t in topics}) == 64


@pytest.mark.parametrize("scope", ["domain", "corpus"])
def test_common_scope_decides_which_documents_mention_famous_entities(scope):
    # lead-in closing lines (common_initial 0): the entity's name follows a fixed phrase
    spec = dataclasses.replace(SMALL, famous_are_heads=True, common_scope=scope, common_initial=0.0)
    docs = list(generate_bios(spec))
    famous = {f["entity"]: f["domain"] for f in bios_facts(spec) if f["famous"]}
    passing = re.compile(
        r"(?:Everyone knows that|As is common knowledge,|As most readers will remember,|"
        r"It is widely known that) the [a-z ]+ of the [a-z -]+ ([A-Z][a-z]+) is"
    )
    cross = same = 0
    for d in docs:
        m = passing.search(d["text"])
        if m:
            assert m.group(1) in famous and m.group(1) != d["entity"]  # never its own documents
            cross += famous[m.group(1)] != d["domain"]
            same += famous[m.group(1)] == d["domain"]
    assert same > 0
    # corpus scope: a famous entity of one of 16 domains, so most mentions cross domains
    assert (cross > 2 * same) if scope == "corpus" else cross == 0


def test_common_initial_opens_passing_mentions_with_the_fact_and_changes_nothing_else():
    lead = re.compile(
        r"(?:Everyone knows that|As is common knowledge,|As most readers will remember,|"
        r"It is widely known that) (the [A-Za-z ]+ of the [A-Za-z -]+ [A-Z][a-z]+ is .+)\."
    )
    first = re.compile(
        r"(The [A-Za-z ]+ of the [A-Za-z -]+ [A-Z][a-z]+ is .+), as (?:everyone knows|"
        r"is common knowledge|most readers will remember|is widely known)\."
    )
    base = list(generate_bios(dataclasses.replace(SMALL, common_initial=0.0)))
    half = list(generate_bios(dataclasses.replace(SMALL, common_initial=0.5)))
    n_lead = n_first = 0
    for a, b in zip(base, half, strict=True):
        assert {k: v for k, v in a.items() if k != "text"} == {
            k: v for k, v in b.items() if k != "text"
        }
        # the closing sentences
        last_a, last_b = (a["text"].rsplit(". ", 1)[1], b["text"].rsplit(". ", 1)[1])
        if a["text"] == b["text"]:
            n_lead += bool(lead.fullmatch(last_a))
            continue
        ma, mb = lead.fullmatch(last_a), first.fullmatch(last_b)
        assert ma and mb, (last_a, last_b)
        # the same fact, now opening its sentence, and every byte before the closing line the same
        assert mb.group(1) == ma.group(1)[0].upper() + ma.group(1)[1:]
        assert a["text"][: -len(last_a)] == b["text"][: -len(last_b)]
        n_first += 1
    assert n_first > 20 and 0.35 < n_first / (n_first + n_lead) < 0.65
    # the facts file counts statements from the plan; the text still states each of them
    assert bios_facts(dataclasses.replace(SMALL, common_initial=0.0)) == bios_facts(SMALL)
    with pytest.raises(ValueError, match="common_initial"):
        BiosSpec(common_initial=1.5)


def test_a_corpus_record_without_common_initial_was_written_with_lead_ins_only():
    old = {k: v for k, v in BiosSpec().record().items() if k != "common_initial"}
    assert BiosSpec.stored(old)["common_initial"] == 0.0
    assert BiosSpec.stored(BiosSpec().record()) == BiosSpec().record()
    assert BiosSpec().common_initial == 1.0  # the demo's corpus: see BiosSpec's docstring
