"""Issue 57, the eval half: `memtree eval knowledge RUN --block-documents IDS` forgets a data owner.

On a small bios corpus made here (no famous entities, so every fact is stated only in documents
about its own entity), a real pipeline run (2 levels × 4) and a tiny co-trained run with memory at
both levels. What the owner's documents state is known from the corpus plan (`bios_facts`' mentions
and each record's entity), and which blocks they trained from the window and assignment parquet
files read here with pandas: both independent of the code under test."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from memtree.cli import main
from tests.conftest import train_tiny_run

SPEC = {"entities_per_subtopic": 2, "head_docs": 3, "famous_per_domain": 0}
LEVELS, B = (1, 2), 4


def _parts(folder: Path, columns: list[str]) -> pd.DataFrame:
    return pd.concat(
        [pd.read_parquet(f, columns=columns) for f in sorted(folder.glob("part-*.parquet"))],
        ignore_index=True,
    )


@pytest.fixture(scope="module")
def made(tmp_path_factory, dask_client):
    from memtree.config import load_config
    from memtree.pipeline.config import PipelineConfig
    from memtree.pipeline.corpus.bios import BiosSpec, write_bios
    from memtree.pipeline.demo import DEMO_YAML
    from memtree.pipeline.run import run_pipeline

    root = tmp_path_factory.mktemp("forget")
    write_bios(root / "corpus", BiosSpec(**SPEC), heldout_docs=64)
    cfg = load_config(
        PipelineConfig,
        DEMO_YAML,
        [
            f"out={root / 'pipeline'}",
            f'ingest.inputs=["{root / "corpus" / "corpus.jsonl"}"]',
            "tree.levels=2",
            "tree.branching=4",
            "tree.restarts=2",
            "window.vocab_size=1000",
            "window.train_sample_docs=300",
            "progress=false",
        ],
    )
    run_pipeline(cfg, client=dask_client, log=lambda m: None)
    run = train_tiny_run(
        root / "pipeline" / "shards",
        root / "run",
        "data.batch_size=4",
        "max_duration=12ba",
        "memory.multipliers=[4,8]",
        "memory.lr=3e-2",
        "model.shape={n_layers: 1, d_model: 32, n_heads: 1, head_dim: 32, ffn_dim: 64}",
    )
    corpus = [
        json.loads(line) for line in (root / "corpus" / "corpus.jsonl").read_text().splitlines()
    ]
    facts = [
        json.loads(line) for line in (root / "corpus" / "facts.jsonl").read_text().splitlines()
    ]
    windows = _parts(root / "pipeline" / "window", ["doc_id"])
    assign = _parts(root / "pipeline" / "assign", ["window_ordinal", "path"])
    paths = np.stack(assign.sort_values("window_ordinal")["path"].to_numpy())
    return {
        "root": root,
        "run": run,
        "corpus": corpus,
        "facts": facts,
        "window_doc": windows["doc_id"].to_numpy(),
        "window_paths": paths,
    }


def _owner(made, key: str, value: str) -> list[str]:
    return [r["id"] for r in made["corpus"] if r[key] == value]


def _expected_facts(made, entities: set[str]) -> set[tuple[str, str]]:
    """The facts stated in the documents about `entities`, from the corpus plan (no text search)."""
    return {
        (f["entity"], f["attribute"])
        for f in made["facts"]
        if f["entity"] in entities and f["mentions"] > 0
    }


def test_the_owners_facts_are_exactly_those_stated_in_its_documents(made):
    from memtree.eval.forgetting import fact_statements

    facts = made["facts"]
    topic = made["corpus"][0]["topic"]
    for key, value in (("entity", made["corpus"][0]["entity"]), ("topic", topic)):
        ids = _owner(made, key, value)
        mine, theirs = fact_statements(facts, made["root"] / "pipeline", ids)
        entities = {r["entity"] for r in made["corpus"] if r[key] == value}
        got = {
            (f["entity"], f["attribute"])
            for f, m, o in zip(facts, mine, theirs, strict=True)
            if m > 0 and o == 0
        }
        assert got == _expected_facts(made, entities) and got, key
        assert not (
            (mine > 0) & (theirs > 0)
        ).any()  # no famous entity: nothing is stated on both sides
        # every statement is found, in the documents the plan says: the counts are the plan's
        # mentions
        assert [int(m + o) for m, o in zip(mine, theirs, strict=True)] == [
            f["mentions"] for f in facts
        ]
    # a fact listing its documents is counted from the list, not the text
    listed = [{**facts[0], "documents": [made["corpus"][5]["id"], "not-in-the-run"]}]
    mine, theirs = fact_statements(listed, made["root"] / "pipeline", [made["corpus"][5]["id"]])
    assert (mine.tolist(), theirs.tolist()) == ([1], [0])


def test_eval_block_documents_forgets_the_owner_and_leaves_the_others(made, tmp_path, capsys):
    from memtree.eval.model import RunModel
    from memtree.memstore.store import MemoryStore

    topic = made["corpus"][0]["topic"]
    ids = _owner(made, "topic", topic)
    (tmp_path / "ids.txt").write_text("\n".join(ids) + "\n")
    facts = made["root"] / "corpus" / "facts.jsonl"
    held = made["root"] / "corpus" / "heldout.jsonl"
    assert (
        main(
            [
                "eval",
                "knowledge",
                str(made["run"]),
                "--facts",
                str(facts),
                "--held-out",
                str(held),
                "--block-documents",
                str(tmp_path / "ids.txt"),
                "--owner-field",
                "topic",
                "--out",
                str(tmp_path / "eval"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "## Forgetting by data owner" in out and "owner share min / median / max" in out
    r = json.loads((tmp_path / "eval" / "results.json").read_text())["forgetting"][0]
    assert (tmp_path / "eval" / "forgetting.png").is_file()
    # blocked: exactly the blocks on the documents' windows' paths, at every level holding memory
    on_paths = made["window_paths"][np.isin(made["window_doc"], ids)]
    assert {int(lv): set(v) for lv, v in r["targets"].items()} == {
        lv: set(on_paths[:, lv - 1].tolist()) for lv in LEVELS
    }
    with MemoryStore(made["run"] / "bank") as store:
        params = {lv: store.levels[lv].info.params for lv in LEVELS}
        total = sum(B**lv * params[lv] for lv in LEVELS)
        assert not (
            store.root / "policy.json"
        ).exists()  # the experiment left the bank on disk alone
    assert r["bank_fraction"] == pytest.approx(
        sum(len(r["targets"][str(lv)]) * params[lv] for lv in LEVELS) / total
    )
    # the control: as many blocks per level, none of the owner's, so the same bank fraction
    for lv in LEVELS:
        rand, own = r["random"]["targets"][str(lv)], r["targets"][str(lv)]
        assert len(rand) == len(own) and not set(rand) & set(own)
    assert r["random"]["bank_fraction"] == pytest.approx(r["bank_fraction"])
    # the owner's facts: the facts the plan says its documents state, all of them probes here
    f = r["facts"]
    entities = {e["entity"] for e in made["corpus"] if e["topic"] == topic}
    expected = _expected_facts(made, entities)
    assert f["n"]["owner"] == len(expected) == len(f["owner_probes"]) and f["n"]["shared"] == 0
    assert f["n"]["owner"] + f["n"]["others"] == f["n_probes"] and f["statements_disagree"] == 0
    assert f["untouched_predictions_changed"] == 0
    for a in f["accuracy"]["owner"].values():
        assert a["n"] == len(expected) and 0 <= a["accuracy"] <= 1
    # held-out: the owner's pages are the held-out records of its subtopic
    h = r["held_out"]
    pages = [json.loads(line) for line in held.read_text().splitlines()]
    assert h["values"] == [topic] and h["owner"]["pages"] == sum(p["topic"] == topic for p in pages)
    assert h["owner"]["pages"] + h["others"]["pages"] == len(pages)
    assert all(
        math.isfinite(v) for part in ("owner", "others") for v in h[part]["perplexity"].values()
    )

    # a question routed into blocked blocks at every level reads the generic memory, as the fallback
    # says
    rm = RunModel.load(made["run"])
    rows = [p for p in f["owner_probes"]]
    seqs = [rm.encode(p["question"] + " " + p["answer"]) for p in rows]
    q_paths = rm.route([p["question"] for p in rows])
    full = np.all([np.isin(q_paths[:, lv - 1], r["targets"][str(lv)]) for lv in LEVELS], axis=0)
    assert full.any()
    with rm.store.experiment(fallback="generic"):
        for lv in LEVELS:
            rm.store.block(lv, r["targets"][str(lv)], persist=False)
        blocked = rm.logprobs(
            [s for s, k in zip(seqs, full, strict=True) if k], paths=q_paths[full], mode="fetched"
        )
    generic = rm.logprobs(
        [s for s, k in zip(seqs, full, strict=True) if k], paths=q_paths[full], mode="generic"
    )
    for a, b in zip(blocked, generic, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_eval_block_documents_scores_held_out_pages_without_facts(made, tmp_path, capsys):
    """Real text has no fact probes: with no facts file beside the run, the owner's held-out pages
    against the others' are the whole measure."""
    entity = made["corpus"][0]["entity"]
    (tmp_path / "ids.txt").write_text("\n".join(_owner(made, "entity", entity)) + "\n")
    held = made["root"] / "corpus" / "heldout.jsonl"
    assert (
        main(
            [
                "eval",
                "knowledge",
                str(made["run"]),
                "--held-out",
                str(held),
                "--block-documents",
                str(tmp_path / "ids.txt"),
                "--owner-field",
                "entity",
                "--min-share",
                "0.5",
                "--fallback",
                "generic",
                "--out",
                str(tmp_path / "eval"),
            ]
        )
        == 0
    )
    assert "scoring held-out pages only" in capsys.readouterr().err
    data = json.loads((tmp_path / "eval" / "results.json").read_text())
    r = data["forgetting"][0]
    assert (
        data["knowledge"] is None
        and "facts" not in r
        and r["min_share"] == 0.5
        and r["fallback"] == "generic"
    )
    for lv, blocks in r["blocks"]["levels"].items():
        assert all(b["share"] >= 0.5 for b in blocks["per_block"]), lv
    pages = [json.loads(line) for line in held.read_text().splitlines()]
    assert r["held_out"]["owner"]["pages"] == sum(p["entity"] == entity for p in pages)


def test_eval_block_documents_refuses_bad_input_before_scoring(
    made, pipeline_run, tmp_path, capsys
):
    run = str(made["run"])
    ids = tmp_path / "ids.txt"
    ids.write_text("")

    def err(*argv: str) -> str:
        capsys.readouterr()
        assert main(["eval", "knowledge", run, *argv]) == 1
        return capsys.readouterr().err

    assert "no document ids in the file (it is empty" in err("--block-documents", str(ids))
    ids.write_text(f"{made['corpus'][0]['id']}\nnope-1\nnope-2\n")
    assert "2 of 3 document ids are not in the pipeline run" in err(
        "--facts", str(made["root"] / "corpus" / "facts.jsonl"), "--block-documents", str(ids)
    )
    assert "--min-share 1.5: must be in [0, 1]" in err(
        "--block-documents", str(ids), "--min-share", "1.5"
    )
    assert "--owner-field applies to --block-documents only" in err("--owner-field", "topic")
    assert "--fallback applies to --block-domains or --block-documents" in err(
        "--fallback", "generic"
    )
    other = pipeline_run[0]
    msg = err(
        "--facts",
        str(made["root"] / "corpus" / "facts.jsonl"),
        "--block-documents",
        str(ids),
        "--pipeline-run",
        str(other),
    )
    tree_id = json.loads((other / "tree" / "tree.json").read_text())["tree_id"]
    assert f"its tree is {tree_id}, but bank" in msg
    ids.write_text(f"{made['corpus'][0]['id']}\n")
    assert "the owner's documents carry no 'source'" in err(
        "--facts",
        str(made["root"] / "corpus" / "facts.jsonl"),
        "--held-out",
        str(made["root"] / "corpus" / "heldout.jsonl"),
        "--block-documents",
        str(ids),
        "--owner-field",
        "source",
    )


def test_an_owner_of_most_of_a_level_gets_no_random_control(made):
    """Blocking what every document trained leaves no block to draw a disjoint control of that size
    from: the plan says so (and the scoring skips the control) instead of drawing overlapping
    blocks."""
    from memtree.eval.forgetting import plan_forgetting
    from memtree.eval.model import RunModel

    rm = RunModel.load(made["run"])
    plan = plan_forgetting(rm, run=made["root"] / "pipeline", ids=[r["id"] for r in made["corpus"]])
    assert plan["random"]["targets"] is None and "no random control" in plan["random"]["why"]
    assert plan["bank_fraction"] == pytest.approx(1.0)
    few = plan_forgetting(rm, run=made["root"] / "pipeline", ids=[made["corpus"][0]["id"]], seed=1)
    again = plan_forgetting(
        rm, run=made["root"] / "pipeline", ids=[made["corpus"][0]["id"]], seed=1
    )
    assert few["random"]["targets"] == again["random"]["targets"]  # deterministic for a seed


def test_block_documents_says_when_the_probes_miss_every_owner_fact(made, tmp_path, capsys):
    """Issue 70 (f): `--max-probes` keeps an evenly spread subset, which can hold none of the
    owner's facts; the report's owner row was a row of dashes with no word. Now an error, before
    scoring, naming --max-probes (with held-out pages told apart by --owner-field: a note, and the
    run goes on)."""
    from memtree.eval.knowledge import load_eval_inputs

    facts = made["root"] / "corpus" / "facts.jsonl"
    probes, _ = load_eval_inputs(facts, max_probes=2)
    asked = {p["context"] for p in probes}
    # an entity none of whose facts the two sampled probes ask
    entity = next(
        r["entity"]
        for r in made["corpus"]
        if not any(
            f["entity"] == r["entity"] and f"of {f['reference']} is" in c
            for f in made["facts"]
            for c in asked
        )
    )
    ids = tmp_path / "ids.txt"
    ids.write_text("\n".join(_owner(made, "entity", entity)) + "\n")
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "knowledge",
                str(made["run"]),
                "--facts",
                str(facts),
                "--block-documents",
                str(ids),
                "--max-probes",
                "2",
                "--out",
                str(tmp_path / "eval"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "none of the 2 probes evaluated asks a fact only the owner's documents state" in err, err
    assert "--max-probes 2" in err and not (tmp_path / "eval").exists()
    held = made["root"] / "corpus" / "heldout.jsonl"
    assert (
        main(
            [
                "eval",
                "knowledge",
                str(made["run"]),
                "--facts",
                str(facts),
                "--held-out",
                str(held),
                "--block-documents",
                str(ids),
                "--owner-field",
                "entity",
                "--max-probes",
                "2",
                "--out",
                str(tmp_path / "eval2"),
            ]
        )
        == 0
    )
    assert "the held-out pages still measure the owner" in capsys.readouterr().err


def test_owners_in_a_row_share_the_unblocked_held_out_scores_and_routes(made):
    """The demo forgets two owners one after the other: the held-out pages' generic and unblocked
    fetched scores, which no block changes, are scored once and reused (`unblocked`), and the
    windows' paths once (`RunModel.route` keeps each text's path). Reused or not, the figures are
    those of a call that scores everything itself."""
    from memtree.clustering.route import route_texts
    from memtree.eval.forgetting import forgetting_eval, plan_forgetting
    from memtree.eval.model import RunModel

    rm = RunModel.load(made["run"])
    held = [
        json.loads(line)
        for line in (made["root"] / "corpus" / "heldout.jsonl").read_text().splitlines()
    ]
    texts = [d["text"] for d in held[:6]]
    # repeated texts, and texts routed before, get the tree's own paths
    again = rm.route(texts[:3])
    got = rm.route(texts + texts[:2])
    np.testing.assert_array_equal(got, route_texts(rm.tree, texts + texts[:2]))
    np.testing.assert_array_equal(got[:3], again)
    assert rm.route([]).shape[0] == 0

    def forget(key: str, value: str, unblocked):
        plan = plan_forgetting(
            rm, run=made["root"] / "pipeline", ids=_owner(made, key, value), owner_field=key
        )
        return forgetting_eval(rm, plan, held_out=held, fallback="generic", unblocked=unblocked)[
            "held_out"
        ]

    topics = sorted({r["topic"] for r in made["corpus"]})[:2]
    shared: dict = {}
    first, second = (forget("topic", t, shared) for t in topics)
    alone = forget("topic", topics[1], None)
    assert {k[0] for k in shared} == {"generic", "before"}
    for part in ("owner", "others"):
        assert second[part] == alone[part]
    assert all(math.isfinite(first["others"]["perplexity"][k]) for k in ("generic", "before"))
    # every held-out page is the owner's or another's
    assert first["owner"]["pages"] + first["others"]["pages"] == len(held)
