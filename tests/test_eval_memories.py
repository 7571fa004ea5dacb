"""Issue 38: `memtree eval memories`, every memory family beside dense models on one knowledge
benchmark.

The end-to-end test lays out a tiny `memtree demo` root (the shared pipeline run, a fact list, an
anchor run and a co-training run continuing it, trained with Composer) and runs the command's
whole grid through `memtree.cli.main`: each trained row is a real Composer fit, each row is scored
on the same probes, and the matched-budget rows are checked against their trained models' parameter
counts and `training/flops.py`."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from memtree.cli import main
from memtree.config import ConfigError
from memtree.geometry import AnchorShape, MemoryConfig, plan
from tests.conftest import train_tiny_run

SHAPE = "model.shape={n_layers: 1, d_model: 32, n_heads: 1, head_dim: 32, ffn_dim: 64}"
BATCH, ANCHOR_BA, COTRAIN_BA = 4, 2, 4

GRID = """
rows:
  - {name: anchor, kind: demo, setting: none}
  - {name: generic, kind: demo, setting: generic}
  - {name: fetched, kind: demo, setting: fetched}
  - {name: dense-1x, kind: dense, size: 1x}
  - {name: dense-2x, kind: dense, size: 2x}
  - {name: dense-2x-flops, kind: dense, size: 2x, budget: flops}
  - {name: dense-runtime, kind: dense, size: runtime}
  - {name: moc, kind: moc, moc: {n_chapters: 9, n_shared: 1, top_k: 2, layers: [0]}}
  - {name: pkm, kind: pkm, pkm: {n_keys: 32, heads: 4, key_dim: 8, value_dim: 32},
     train: [optim.pkm_value_lr=3.0e-2]}
  - {name: rag, kind: demo, setting: rag}
  - {name: rag+fetched, kind: demo, setting: rag+fetched}
"""


@pytest.fixture(scope="module")
def root(pipeline_run, tmp_path_factory) -> Path:
    """A demo-shaped root: the pipeline run, facts with mention counts, held-out documents, and
    ROOT/train/{anchor, cotrain} (a level-2 FFN memory of width 64, co-trained from the anchor)."""
    from memtree.pipeline.corpus.topical import CorpusSpec, entity_facts

    root = tmp_path_factory.mktemp("memories") / "demo"
    shutil.copytree(pipeline_run[0], root / "pipeline")
    # tests/conftest.py's corpus
    facts = entity_facts(CorpusSpec(n_docs=1200, seed=3, long_doc_fraction=0.01))
    (root / "facts.jsonl").write_text("".join(json.dumps(f) + "\n" for f in facts))
    (root / "heldout.jsonl").write_text(
        "".join(
            json.dumps({"text": f"The {f['label']} of {f['reference']} is {f['value']}."}) + "\n"
            for f in facts[:6]
        )
    )
    common = [f"data.batch_size={BATCH}", SHAPE]
    shards = root / "pipeline" / "shards"
    train_tiny_run(
        shards,
        root / "train" / "anchor",
        *common,
        "mode=baseline",
        "memory.multipliers=[]",
        f"max_duration={ANCHOR_BA}ba",
    )
    train_tiny_run(
        shards,
        root / "train" / "cotrain",
        *common,
        "mode=cotrain",
        f"anchor_checkpoint={root / 'train' / 'anchor'}",
        "memory.multipliers=[0,64]",
        "memory.lr=3e-2",
        f"max_duration={COTRAIN_BA}ba",
    )
    return root


def test_every_row_trains_and_scores_with_the_budgets_it_claims(root, tmp_path, capsys):
    from memtree.eval.memories import moc_active_params, open_demo
    from memtree.training.flops import moc_params, model_flops, pkm_params
    from memtree.training.layers.moc import MoCConfig
    from memtree.training.layers.pkm import PKMConfig

    grid = tmp_path / "grid.yaml"
    grid.write_text(GRID)
    out = tmp_path / "out"
    # the demo's blocking experiment as `memtree demo` reports it: its target domains and share are
    # what the MoC row's chapter-blocking analogue runs on
    targets = ["astronomy", "aviation", "chemistry", "computer_networking", "cooking", "fashion"]
    demo_blocking = {
        "target_domains": targets,
        "fraction": 0.125,
        "level": 1,
        "n_target": 1,
        "n_other": 1,
        "fallback": "generic",
        "settings": {},
    }
    (root / "report").mkdir(exist_ok=True)
    (root / "report" / "results.json").write_text(json.dumps({"blocking": demo_blocking}))
    assert (
        main(
            [
                "eval",
                "memories",
                str(root),
                "max_probes=40",
                "--config",
                str(grid),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "| dense-runtime | dense |" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert res["demo"]["corpus"] is None  # the tests' topical corpus: no bios corpus.json in ROOT
    rows = {r["name"]: r for r in res["rows"]}
    assert list(rows) == [
        "anchor",
        "generic",
        "fetched",
        "dense-1x",
        "dense-2x",
        "dense-2x-flops",
        "dense-runtime",
        "moc",
        "pkm",
        "rag",
        "rag+fetched",
    ]
    assert (out / "accuracy_vs_exposure.png").stat().st_size > 0 and "Paired Δ" in (
        out / "report.md"
    ).read_text()
    demo = open_demo(root)
    anchor, fetch = demo.shape.params(), demo.plan.fetch_params
    assert fetch == 3 * 64 * 32 and demo.duration() == f"{ANCHOR_BA + COTRAIN_BA}ba"
    for r in rows.values():  # every row scored on the same probes, each with its paired interval
        assert len(r["predictions"]) == res["n_probes"] == 40 and r["paired"]["overall"]["n"] == 40
        assert sum(b["n"] for b in r["by_bucket"]) == 40
        if r["kind"] != "demo":  # trained here for the demo's whole duration, through Composer
            budget = "6ba" if r["spec"]["budget"] == "steps" else r["train"]["duration"]
            assert r["train"]["action"] == "trained" and r["train"]["duration"] == budget
            assert r["measured_params"] == r["total_params"]
            assert r["perplexity"] is not None and r["train"]["train_s"] > 0
        else:  # the demo's anchor + co-training wall time, from their Composer checkpoints
            assert r["train"]["train_s"] > 0
    assert rows["fetched"]["paired"]["overall"]["diff"] == 0
    # dense rows: the anchor's shape; ≥ 2× the anchor by depth; exactly anchor + fetched memory at
    # runtime (and its FLOPs)
    assert rows["dense-1x"]["total_params"] == anchor == rows["anchor"]["runtime_params"]
    assert rows["dense-2x"]["total_params"] >= 2 * anchor
    assert rows["dense-2x"]["model"]["shape"]["n_layers"] > 1
    assert (
        rows["dense-runtime"]["total_params"] == anchor + fetch == rows["fetched"]["runtime_params"]
    )
    # budget flops: the deeper model trains fewer batches, to the fetched row's training FLOPs (to a
    # batch)
    eq, steps = rows["dense-2x-flops"], rows["dense-2x"]
    batches = int(eq["train"]["duration"].removesuffix("ba"))
    assert eq["total_params"] == steps["total_params"] and 1 <= batches < 6
    per_batch = steps["train_flops"] / 6  # dense-2x trained 6 batches
    assert abs(eq["train_flops"] - rows["fetched"]["train_flops"]) <= per_batch / 2 + 1
    assert (
        rows["dense-runtime"]["inference_flops_per_token"]
        == rows["fetched"]["inference_flops_per_token"]
    )
    # MoC: its parameters as training/flops.py counts them; tokens_per_chapter solved to the fetched
    # size
    moc = MoCConfig(
        **{**rows["moc"]["model"]["moc"], "layers": tuple(rows["moc"]["model"]["moc"]["layers"])}
    )
    assert rows["moc"]["total_params"] == anchor + sum(moc_params(demo.shape, moc).values())
    step = moc.n_selected * demo.shape.d_model  # active parameters per extra token per chapter
    assert abs(moc_active_params(demo.shape, moc) - fetch) <= step / 2
    assert rows["moc"]["memory_active_params"] == moc_active_params(demo.shape, moc)
    assert (
        rows["moc"]["inference_flops_per_token"]
        == model_flops(demo.shape, moc, seq_len=demo.seq_len).forward / demo.seq_len
    )
    # PKM: k solved so query + sub-keys + k values per head + projections = the fetched blocks
    # exactly
    pk = PKMConfig(**{**rows["pkm"]["model"]["pkm"], "layers": ()})
    assert pk.k == 16 and rows["pkm"]["memory_active_params"] == fetch
    assert rows["pkm"]["total_params"] == pkm_params(demo.shape, pk)
    # demo rows reuse the demo's runs; RAG reads a window, fetched the path's blocks
    assert rows["fetched"]["total_params"] == anchor + demo.plan.bank_params + fetch
    assert rows["fetched"]["fetch"]["bytes"] == 4 * fetch and rows["rag"]["fetch"]["bytes"] > 0
    assert rows["rag"]["perplexity"] is None and rows["fetched"]["blocking"].startswith("yes")
    # blocking: the demo's own figures on the fetched row; the chapters' analogue run on the MoC row
    assert rows["fetched"]["blocking_result"] == {"kind": "subtree", **demo_blocking}
    cb = rows["moc"]["blocking_result"]
    assert cb["kind"] == "chapters" and cb["target_domains"] == targets and cb["n_target"] > 0
    assert cb["n_routed"] == 8 and cb["chapters_blocked_per_layer"] == 1 and cb["fraction"] == 0.125
    adv, rnd = cb["settings"]["adversarial"], cb["settings"]["random"]
    for st in (adv, rnd):  # one layer ([0]), one routed chapter (ids 1..8) blocked in it
        assert (
            len(st["chapters"]) == 1
            and len(st["chapters"][0]) == 1
            and 1 <= st["chapters"][0][0] <= 8
        )
        assert st["accuracy_target"]["before"] == adv["accuracy_target"]["before"]
    assert adv["chapters"] != rnd["chapters"]
    # the adversarial chapter is the one the target's sequences picked most: no random one beats it
    assert (
        adv["target_picks_on_blocked"][0] >= rnd["target_picks_on_blocked"][0]
        and adv["target_picks_on_blocked"][0] > 0
    )
    assert (
        "| moc | 1 of 8 routed chapters per layer | adversarial |"
        in (out / "report.md").read_text()
    )

    # --rows: a subset; the trained row is reused (same inputs) and the reference is still scored
    assert (
        main(
            [
                "eval",
                "memories",
                str(root),
                "max_probes=40",
                "--config",
                str(grid),
                "--rows",
                "dense-runtime",
                "--out",
                str(tmp_path / "subset"),
            ]
        )
        == 0
    )
    sub = json.loads((tmp_path / "subset" / "results.json").read_text())
    assert [r["name"] for r in sub["rows"]] == ["fetched", "dense-runtime"]
    (root / "report" / "results.json").unlink()  # the module's other tests see the root as it was
    again = sub["rows"][1]
    assert (
        again["train"]["action"] == "reused"
        and again["train"]["train_s"] == rows["dense-runtime"]["train"]["train_s"]
    )
    assert again["predictions"] == rows["dense-runtime"]["predictions"]


def test_paired_interval_equals_a_direct_computation():
    from memtree.eval.memories import paired_by_bucket, paired_interval

    a = [True, True, False, True, False, True]
    b = [False, True, False, False, False, True]
    # d = 1, 0, 0, 1, 0, 0: mean 1/3; sample variance (4·(1/3)² + 2·(2/3)²) / 5 = 12/45
    got = paired_interval(a, b)
    half = 1.96 * math.sqrt(12 / 45) / math.sqrt(6)
    assert got["n"] == 6 and got["diff"] == pytest.approx(1 / 3)
    assert got["ci95"] == pytest.approx([1 / 3 - half, 1 / 3 + half])
    assert paired_interval([True], [False]) == {"n": 1, "diff": 1.0, "ci95": None}
    # per bucket: exposures 0 → bucket "0", 5 → "4-7"
    probes = [{"exposures": e, "mentions": 1} for e in (0, 0, 5, 5, 5, 5)]
    by = {r["bucket"]: r for r in paired_by_bucket(probes, a, b)}
    assert (
        by["0"]["diff"] == 1 / 2
        and by["4-7"]["n"] == 4
        and by["4-7"]["diff"] == pytest.approx(1 / 4)
    )
    d = np.array([0, 1, 0, 0], dtype=float)
    assert by["4-7"]["ci95"][1] == pytest.approx(0.25 + 1.96 * d.std(ddof=1) / 2)
    assert by["1"]["n"] == 0 and by["1"]["diff"] is None


def test_the_report_names_the_corpus_a_demo_root_was_generated_from(tmp_path):
    """A grid on `memtree demo --corpus entities_per_subtopic=48` is the headline's benchmark, not
    the demo's: its report must say so, read from the corpus.json the generator wrote."""
    from memtree.eval.memories import corpus_meta
    from memtree.eval.memories_report import header_lines
    from memtree.pipeline.corpus.bios import BiosSpec, write_bios

    assert corpus_meta(tmp_path) is None  # a root without a bios corpus (the tests' topical one)
    wrote = write_bios(tmp_path, BiosSpec(entities_per_subtopic=3, head_docs=4), heldout_docs=2)
    meta = corpus_meta(tmp_path)
    assert meta == {
        "documents": wrote["documents"],
        "facts": wrote["n_facts"],
        "spec_changes": {"entities_per_subtopic": 3, "head_docs": 4},
    }
    demo = {
        "epochs": 7,
        "anchor_epochs": 2,
        "cotrain_epochs": 5,
        "duration": "7ep",
        "anchor_params": 10,
        "plan": {"fetch_params": 2, "bank_params": 20},
        "corpus": meta,
    }
    report = {
        "root": str(tmp_path),
        "n_probes": 0,
        "chance": 0.25,
        "held_out_documents": 0,
        "reference": "fetched",
        "demo": demo,
    }
    text = "\n".join(header_lines(report))
    assert (
        f"Corpus: {wrote['documents']:,} documents, {wrote['n_facts']:,} facts; "
        "generator fields changed from "
        "the default: entities_per_subtopic=3, head_docs=4."
    ) in text


def test_dense_sizes_match_the_fetched_memory_they_claim():
    from dataclasses import replace

    from memtree.eval.memories import dense_shape, fetched_widths
    from memtree.training.flops import ffn_memory, model_flops

    anchor = AnchorShape(
        n_layers=4, d_model=128, n_heads=4, head_dim=32, ffn_dim=512, vocab_size=8192
    )
    p = plan(anchor, MemoryConfig(multipliers=(0, 64, 128), branching=4))
    assert fetched_widths(p) == {0: 192, 1: 192, 2: 192, 3: 192}
    twice = dense_shape(anchor, p, "2x")
    assert (
        twice.params() >= 2 * anchor.params() > replace(twice, n_layers=twice.n_layers - 1).params()
    )
    assert dense_shape(anchor, p, "1x").params() == anchor.params()
    runtime = dense_shape(anchor, p, "runtime")
    assert runtime.ffn_dim == 704 and runtime.params() == p.runtime_params
    assert model_flops(runtime, seq_len=256).forward == model_flops(
        anchor, seq_len=256
    ).forward + ffn_memory(anchor, fetched_widths(p), tokens=256)


def test_total_bank_rows_match_the_fetched_rows_total_parameters():
    """bank: total sizes MoC's chapter count and PKM's key count so the model's total parameters
    come within one step of anchor + the fetched row's whole bank, at the active-matched
    tokens_per_chapter / k; the active parameters then exceed the fetched blocks' only by the router
    / sub-keys grown."""
    from dataclasses import replace

    from memtree.eval.memories import moc_active_params, pkm_active_params, size_moc, size_pkm
    from memtree.training.flops import moc_params, pkm_params

    anchor = AnchorShape(
        n_layers=4, d_model=128, n_heads=4, head_dim=32, ffn_dim=512, vocab_size=8192
    )
    p = plan(anchor, MemoryConfig(multipliers=(0, 64, 128), branching=4))
    fetch, total = p.fetch_params, anchor.params() + p.bank_params + p.fetch_params
    fields = {"n_chapters": 17, "n_shared": 1, "top_k": 4, "layers": [1, 3], "n_kv_heads": 2}
    active_only, m = size_moc(anchor, fields, fetch), size_moc(anchor, fields, fetch, total)
    size = lambda c: anchor.params() + sum(moc_params(anchor, c).values())
    step = size(replace(m, n_chapters=m.n_chapters + 1)) - size(m)  # one more chapter
    assert (
        m.tokens_per_chapter == active_only.tokens_per_chapter
        and m.n_chapters > active_only.n_chapters == 17
    )
    assert abs(size(m) - total) <= step / 2 and size(active_only) < total / 2
    # a router row + bias per chapter, in 2 layers
    router = 2 * (anchor.d_model + 1) * (m.n_chapters - 17)
    assert moc_active_params(anchor, m) - moc_active_params(anchor, active_only) == router
    pk_fields = {"n_keys": 16, "heads": 2, "key_dim": 32}
    small, pk = size_pkm(anchor, pk_fields, fetch), size_pkm(anchor, pk_fields, fetch, total)
    assert pk.k == small.k and pk.n_keys > small.n_keys == 16
    below, above = (
        pkm_params(anchor, replace(pk, n_keys=n)) for n in (pk.n_keys - 1, pk.n_keys + 1)
    )
    assert below < total < above and abs(pkm_params(anchor, pk) - total) <= max(
        above - total, total - below
    )
    sub_keys = pk.heads * (pk.n_keys - 16) * pk.key_dim  # every token scores all 2·n_keys half-keys
    assert pkm_active_params(anchor, pk) - pkm_active_params(anchor, small) == sub_keys


def test_grid_errors_name_the_key(tmp_path):
    from memtree.eval.memories import load_memories_config

    def load(text: str, *overrides: str):
        path = tmp_path / "g.yaml"
        path.write_text(text)
        return load_memories_config(path, overrides)

    ok = "rows: [{name: fetched, kind: demo, setting: fetched}, {name: d, kind: dense, size: 2x}]\n"
    assert [r.name for r in load(ok).selected()] == ["fetched", "d"]
    assert [r.name for r in load(ok, "select=[d]").selected()] == ["fetched", "d"]
    with pytest.raises(ConfigError, match=r"unknown config key rows\[0\]\.bogus"):
        load("rows: [{name: fetched, kind: demo, setting: fetched, bogus: 1}]\n")
    with pytest.raises(ConfigError, match=r"select \(--rows\): unknown row\(s\) \['nope'\]"):
        load(ok, "select=[nope]")
    with pytest.raises(ConfigError, match=r"rows.d.budget: 'time' is not one of"):
        load(
            "rows: [{name: fetched, kind: demo, setting: fetched}, "
            "{name: d, kind: dense, size: 2x, budget: time}]\n"
        )
    with pytest.raises(ConfigError, match=r"rows.d.bank: total is for moc and pkm rows"):
        load(
            "rows: [{name: fetched, kind: demo, setting: fetched}, "
            "{name: d, kind: dense, size: 2x, bank: total}]\n"
        )
    with pytest.raises(ConfigError, match=r"rows.m.bank: 'all' is not one of"):
        load(
            "rows: [{name: fetched, kind: demo, setting: fetched}, "
            "{name: m, kind: moc, bank: all}]\n"
        )
    with pytest.raises(ConfigError, match="budget flops sets max_duration"):
        load(
            "rows: [{name: fetched, kind: demo, setting: fetched}, "
            "{name: d, kind: dense, size: 2x, budget: flops, train: [max_duration=3ep]}]\n"
        )
    with pytest.raises(ConfigError, match="rows.d.size: only for kind dense"):
        load(
            "rows: [{name: fetched, kind: demo, setting: fetched}, "
            "{name: d, kind: moc, size: 2x}]\n"
        )
    with pytest.raises(ConfigError, match="rows.m.moc"):
        load(
            "rows: [{name: fetched, kind: demo, setting: fetched}, "
            "{name: m, kind: moc, moc: {top_kk: 2}}]\n"
        )
    with pytest.raises(ConfigError, match="reference"):
        load("rows: [{name: d, kind: dense, size: 2x}]\n")
