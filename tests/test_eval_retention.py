"""Retention: continue the anchor on other subtrees with the bank frozen; probes before vs after."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from memtree.cli import main
from memtree.config import ConfigError, from_dict, to_dict
from memtree.eval.knowledge import knowledge_eval, load_eval_inputs
from memtree.eval.model import RunModel
from memtree.eval.retention import RetentionConfig, default_subtrees, run_retention
from memtree.memstore.format import GENERIC
from memtree.memstore.store import MemoryStore
from tests.conftest import train_tiny_run


@pytest.fixture(scope="module")
def run(pipeline_run, tmp_path_factory):
    return train_tiny_run(
        pipeline_run[0] / "shards",
        tmp_path_factory.mktemp("retrun") / "run",
        "data.batch_size=2",
        "max_duration=3ba",
        "memory.multipliers=[8,4]",
        "memory.lr=3e-2",
        "model.shape={n_layers: 1, d_model: 32, n_heads: 1, head_dim: 32, ffn_dim: 64}",
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from memtree.pipeline.corpus.topical import CorpusSpec, write_facts_jsonl

    d = tmp_path_factory.mktemp("retinputs")
    write_facts_jsonl(d / "facts.jsonl", CorpusSpec(n_docs=1200, seed=3, long_doc_fraction=0.01))
    docs = [
        "the star is bright and the telescope is old",
        "bake the bread in a hot oven for an hour",
    ]
    (d / "held.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return d / "facts.jsonl", d / "held.jsonl"


def test_config_errors_name_the_key(tmp_path):
    base = {"run": "r", "out": str(tmp_path), "facts": "f"}
    with pytest.raises(ConfigError, match="unknown config key step"):
        from_dict(RetentionConfig, {**base, "step": 3})
    with pytest.raises(ConfigError, match="subtrees"):
        from_dict(RetentionConfig, {**base, "subtrees": [1]})
    with pytest.raises(ConfigError, match="train: memory.lr is set by the experiment"):
        from_dict(RetentionConfig, {**base, "train": ["memory.lr=1e-3"]})
    with pytest.raises(ConfigError, match="steps"):
        from_dict(RetentionConfig, {**base, "steps": 0})


def test_retention_end_to_end(run, inputs, pipeline_run, tmp_path):
    from streaming.base.util import clean_stale_shared_memory

    facts, held = inputs
    given = {
        "run": str(run),
        "out": str(tmp_path / "ret"),
        "facts": str(facts),
        "held_out": str(held),
        "steps": 3,
        "max_probes": 24,
    }
    cfg = from_dict(RetentionConfig, given)
    res = run_retention(cfg, log=lambda m: None)
    clean_stale_shared_memory()
    for key in ("json", "markdown", "png"):
        assert Path(res["files"][key]).stat().st_size > 0
    shards = pipeline_run[0] / "shards"
    # half of 8, seeded
    assert res["subtrees"] == default_subtrees(shards, 0) and len(res["subtrees"]) == 4
    cont = tmp_path / "ret" / "continued"
    assert res["continued"]["status"] == "trained" and (cont / "metrics.json").exists()

    # the bank stayed frozen while the anchor moved
    with MemoryStore(run / "bank") as a, MemoryStore(cont / "bank") as b:
        for lv in (1, 2):
            ids = [GENERIC, *range(8**lv)]
            assert all(torch.equal(a.fetch_flat(lv, c), b.fetch_flat(lv, c)) for c in ids)
    old, new = (
        load_file(str(run / "anchor.safetensors")),
        load_file(str(cont / "anchor.safetensors")),
    )
    assert any(not torch.equal(old[k], new[k]) for k in old)

    # before = the run as it was; after = the continued run folder (its anchor, the same bank)
    probes, docs = load_eval_inputs(facts, held_out=held, max_probes=24)
    before = knowledge_eval(RunModel.load(run), probes, docs)
    after_rm = RunModel.load(cont)
    after = knowledge_eval(after_rm, probes, docs)
    revisited = np.isin(after_rm.route([p["context"] for p in probes])[:, 0], res["subtrees"])
    gold = np.asarray([p["gold"] for p in probes])
    for mode in ("none", "generic", "fetched"):
        r = res["modes"][mode]
        assert r["all"]["n"] == len(probes) == r["revisited"]["n"] + r["not_revisited"]["n"]
        assert r["revisited"]["n"] == int(revisited.sum())
        for group, mask in (("revisited", revisited), ("not_revisited", ~revisited)):
            for when, k in (("before", before), ("after", after)):
                ok = np.asarray(k["modes"][mode]["predictions"]) == gold
                want = float(ok[mask].mean()) if mask.any() else None
                assert r[group][when] == pytest.approx(want)
            assert sum(b["n"] for b in r[group]["by_bucket"]) == r[group]["n"]
        assert r["perplexity"]["before"] == pytest.approx(before["modes"][mode]["perplexity"])
        assert r["perplexity"]["after"] == pytest.approx(after["modes"][mode]["perplexity"])
    assert (
        res["modes"]["none"]["perplexity"]["before"] != res["modes"]["none"]["perplexity"]["after"]
    )
    assert "subtree not in the continued data" in (tmp_path / "ret" / "report.md").read_text()

    # a rerun resumes: nothing is trained again, the numbers are the same
    stamp = (cont / "anchor.safetensors").stat().st_mtime_ns
    assert (
        main(["eval", "retention", *(f"{k}={v}" for k, v in to_dict(cfg).items() if k in given)])
        == 0
    )
    again = json.loads((tmp_path / "ret" / "results.json").read_text())
    assert (
        again["continued"]["status"] == "skipped"
        and (cont / "anchor.safetensors").stat().st_mtime_ns == stamp
    )
    assert again["modes"] == res["modes"]
