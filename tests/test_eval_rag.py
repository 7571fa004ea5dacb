"""RAG baseline (App. H): nearest training window inside the query's cluster, prepended 0-shot."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from memtree.eval.knowledge import knowledge_eval
from memtree.eval.longtail import build_probes
from memtree.eval.model import RunModel
from memtree.eval.rag import SEPARATOR, RagIndex, nearest_in_cluster, rag_items
from memtree.eval.tasks import multiple_choice
from memtree.pipeline.corpus.topical import CorpusSpec, entity_facts
from tests.conftest import train_tiny_run

SPEC = CorpusSpec(n_docs=1200, seed=3, long_doc_fraction=0.01)  # the corpus of tests/conftest.py


@pytest.fixture(scope="module")
def run(pipeline_run, tmp_path_factory):
    return RunModel.load(
        train_tiny_run(
            pipeline_run[0] / "shards",
            tmp_path_factory.mktemp("ragrun") / "run",
            "data.batch_size=2",
            "max_duration=2ba",
            "memory.multipliers=[8,4]",
            "model.shape={n_layers: 1, d_model: 32, n_heads: 1, head_dim: 32, ffn_dim: 64}",
        )
    )


@pytest.fixture(scope="module")
def index(pipeline_run):
    return RagIndex.open(pipeline_run[0])


@pytest.fixture(scope="module")
def probes():
    return build_probes(entity_facts(SPEC), seed=0)[::97]  # ~20 probes over the domains


def test_nearest_stays_inside_the_query_cluster():
    # 2-level tree, branching 2: leaves 0..3. Rows 0-2 in leaf 1, row 3 in leaf 2, row 4 in leaf 3.
    paths = np.array([[0, 1], [0, 1], [0, 1], [1, 2], [1, 3]])
    emb = np.array(
        [[1, 0, 0], [0.6, 0.8, 0], [0.6, 0.8, 0], [0, 1, 0], [0, 0, 1]], dtype=np.float32
    )
    q = np.array([[0, 1, 0], [0, 1, 0], [0, 0.6, 0.8], [1, 0, 0]], dtype=np.float32)
    q_paths = np.array([[0, 1], [1, 2], [0, 1], [0, 0]])
    rows, sims = nearest_in_cluster(q, q_paths, paths, emb, level=2)
    # query 0: row 3 (cos 1) is closer but in leaf 2; inside leaf 1 rows 1 and 2 tie at 0.8 → the
    # lower ordinal
    assert rows.tolist() == [1, 3, 1, -1]
    np.testing.assert_allclose(sims[:3], [0.8, 1.0, 0.48], rtol=1e-6)
    assert np.isnan(sims[3])  # leaf 0 holds no window
    # at level 1, query 3's cluster 0 holds rows 0-2: row 0 is identical to it
    rows1, _ = nearest_in_cluster(q, q_paths, paths, emb, level=1)
    assert rows1.tolist() == [1, 3, 1, 0]


def test_retrieval_matches_a_brute_force_search_of_the_query_leaf(run, index, pipeline_run, probes):
    from memtree.clustering.embed import embed_texts, embedder_from_meta

    out = pipeline_run[0]
    windows = pq.read_table(out / "window" / "part-00003.parquet", columns=["text"])[
        "text"
    ].to_pylist()[:5]
    queries = windows + [p["context"] for p in probes[:10]]
    hit = index.retrieve(queries)
    # the traversal that fetches memories
    assert hit["paths"].tolist() == run.route(queries).tolist()
    # brute force over the pipeline's own outputs: every window of the query's leaf
    leaves = np.concatenate(
        [
            pq.read_table(f, columns=["leaf"])["leaf"].to_numpy()
            for f in sorted((out / "assign").glob("part-*.parquet"))
        ]
    )
    emb = np.load(out / "embed" / "embeddings.npy")
    e = index.tree.meta["embedder"]
    x = embed_texts(embedder_from_meta(e, index.tree.path), queries, strategy=e["strategy"])
    for i, leaf in enumerate(hit["paths"][:, -1]):
        members = np.flatnonzero(leaves == leaf)
        best = members[np.argmax(emb[members] @ x[i])]
        assert hit["ordinals"][i] == best and leaves[hit["ordinals"][i]] == leaf
    # a training window's own text finds itself
    assert index.texts(hit["ordinals"][:5].tolist()) == windows
    assert np.all(hit["similarity"][:5] > 0.999)


def test_prepended_window_reaches_the_scorer_within_max_seq_len(run, index, probes):
    items, rec = rag_items(run, index, probes)
    docs = index.texts(rec["ordinals"])
    for it, p, doc, k in zip(items, probes, docs, rec["kept_tokens"], strict=True):
        head = it["context"][: -len(SEPARATOR + p["context"])]
        assert it["context"].endswith(SEPARATOR + p["context"]) and it["query"] == p["context"]
        assert doc.startswith(head) and len(run.encode(head)) == k > 0
    # the scorer's choice is the argmax over the sequences with the window in front, which differ
    # from 0-shot
    res = multiple_choice(run, items, mode="none")
    changed = 0
    for it, p, pred in zip(items, probes, res["predictions"], strict=True):
        scores, plain = [], []
        for ch in it["choices"]:
            cont = run.encode(" " + ch)
            for ctx, acc in ((it["context"], scores), (p["context"], plain)):
                lp = run.logprobs([run.encode(ctx) + cont], mode="none")[0]
                acc.append(float(lp[-len(cont) :].sum()))
        assert pred == int(np.argmax(scores))
        changed += not np.allclose(scores, plain)
    assert changed == len(items)

    # a short context: the window's head is cut to fit, and every scored sequence fits
    # the run's context as eval reads it (RunModel.max_seq_len)
    run = dataclasses.replace(run, context=40)
    short, rec2 = rag_items(run, index, probes)
    assert any(0 < k < len(run.encode(d)) for k, d in zip(rec2["kept_tokens"], docs, strict=True))
    for it in short:
        n = len(run.encode(it["context"]))
        assert all(n + len(run.encode(" " + ch)) <= 40 for ch in it["choices"])
    # the scorer accepts them all
    assert multiple_choice(run, short, mode="fetched")["n"] == len(short)


def test_knowledge_eval_and_cli_report_the_rag_columns(run, index, probes, tmp_path):
    from memtree.cli import main
    from memtree.pipeline.corpus.topical import write_facts_jsonl

    k = knowledge_eval(run, probes[:8], rag=index)
    assert list(k["modes"]) == ["none", "generic", "fetched", "rag", "rag+fetched"]
    assert k["rag"]["level"] == index.tree.levels and len(k["rag"]["ordinals"]) == 8
    facts = tmp_path / "facts.jsonl"
    write_facts_jsonl(facts, SPEC)
    out = tmp_path / "report"
    assert (
        main(
            [
                "eval",
                "knowledge",
                str(run.store.root.parent),
                "--facts",
                str(facts),
                "--max-probes",
                "6",
                "--rag",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads((out / "results.json").read_text())
    assert {"rag", "rag+fetched"} <= set(data["knowledge"]["modes"])
    # the run's own pipeline run
    assert data["knowledge"]["rag"]["datastore"] == str(index.root.resolve())
    assert "anchor + RAG (nearest training window)" in (out / "report.md").read_text()


def test_routing_agreement_on_a_hand_made_case():
    from memtree.eval.rag import routing_agreement

    texts = [
        "Pelos wrote 41 symphonies.",
        "Pelos lived in Rome.",
        "Feniror was born in 1683.",
        "nothing",
    ]
    window_paths = np.array([[0, 0], [0, 1], [1, 2], [1, 3]])
    probes = [
        {
            "entity": "Pelos",
            "choices": ["12", "41"],
            "gold": 1,
            "mentions": 1,
        },  # stated in window 0 only
        {"entity": "Feniror", "choices": ["1683", "1700"], "gold": 0, "mentions": 3},  # window 2
        {"entity": "Nobody", "choices": ["1", "2"], "gold": 0, "mentions": 1},  # stated nowhere
    ]
    probe_paths = np.array([[0, 1], [1, 2], [0, 0]])  # Pelos: right level 1, wrong leaf
    r = routing_agreement(texts, window_paths, probes, probe_paths)
    assert r["n_probes"] == 3 and r["n_with_stating_window"] == 2
    assert r["all"] == [1.0, 0.5]
    rows = {b["bucket"]: b for b in r["by_bucket"]}
    assert rows["1"]["n"] == 1 and rows["1"]["rates"] == [1.0, 0.0]
    assert rows["2-3"]["rates"] == [1.0, 1.0]
    assert rows["0"]["rates"] == [None, None]
