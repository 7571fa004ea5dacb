"""Issue 70, item 2: the real-text recipe as a user copies it. `training/yamls/realtext*.yaml` are
its stages in the order measured; each loads and trains as shipped with only `data.shards` given
(and two batches instead of an epoch), the second starting from the first's anchor where the first
saved it, through `memtree train run` as a user types it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtree.cli import main

REPO = Path(__file__).resolve().parents[1]
STAGES = ["realtext-anchor.yaml", "realtext.yaml"]  # the order the YAMLs' comments give


@pytest.fixture(scope="module")
def shards(tmp_path_factory, dask_client) -> Path:
    """A real pipeline run with the recipe's tree shape (3 levels × 4, as
    pipeline/yamls/realdocs.yaml)."""
    from memtree.config import load_config
    from memtree.pipeline.config import PipelineConfig
    from memtree.pipeline.corpus.bios import BiosSpec, write_bios
    from memtree.pipeline.demo import DEMO_YAML
    from memtree.pipeline.run import run_pipeline

    root = tmp_path_factory.mktemp("recipe")
    write_bios(root / "corpus", BiosSpec(entities_per_subtopic=2, head_docs=3), heldout_docs=8)
    cfg = load_config(
        PipelineConfig,
        DEMO_YAML,
        [
            f"out={root / 'pipeline'}",
            f'ingest.inputs=["{root / "corpus" / "corpus.jsonl"}"]',
            "tree.levels=3",
            "tree.branching=4",
            "tree.restarts=1",
            "window.vocab_size=1000",
            "window.train_sample_docs=300",
            "progress=false",
        ],
    )
    run_pipeline(cfg, client=dask_client, log=lambda m: None)
    return root / "pipeline" / "shards"


def test_the_recipe_yamls_are_the_stages_in_order():
    shipped = sorted(p.name for p in (REPO / "training" / "yamls").glob("realtext*.yaml"))
    assert sorted(STAGES) == shipped
    text = (REPO / "training" / "yamls" / "realtext.yaml").read_text()
    # each YAML's comments give the commands in order, the anchor stage first
    for name in STAGES:
        body = (REPO / "training" / "yamls" / name).read_text()
        first, second = (body.index(f"memtree train run training/yamls/{s}") for s in STAGES)
        assert first < second, name
    assert (
        "mode: cotrain" in text and "anchor_checkpoint: runs/realdocs/train/realtext-anchor" in text
    )


def test_the_recipe_stages_train_as_shipped(shards, tmp_path, monkeypatch, capsys):
    from streaming.base.util import clean_stale_shared_memory

    from memtree.memstore.format import read_manifest

    monkeypatch.chdir(tmp_path)  # the YAMLs' relative save folders land here
    for name in STAGES:
        clean_stale_shared_memory()
        assert (
            main(
                [
                    "train",
                    "run",
                    str(REPO / "training" / "yamls" / name),
                    f"data.shards={shards}",
                    "max_duration=2ba",
                ]
            )
            == 0
        ), name
    clean_stale_shared_memory()
    anchor = tmp_path / "runs/realdocs/train/realtext-anchor"
    cotrain = tmp_path / "runs/realdocs/train/realtext"
    assert (anchor / "anchor.safetensors").is_file() and not (anchor / "bank").exists()
    cfg = json.loads((cotrain / "memtree_config.json").read_text())["config"]
    assert (cfg["mode"], cfg["anchor_checkpoint"], cfg["memory"]["lr"]) == (
        "cotrain",
        "runs/realdocs/train/realtext-anchor",
        1.0e-3,
    )
    assert tuple(read_manifest(cotrain / "bank").memory.multipliers) == (64, 16, 4)
    # the co-training stage started from the anchor stage's weights (two batches inside the warmup
    # move them by less than 0.05), not from a fresh initialisation (weights of order 0.1–1)
    from safetensors.torch import load_file

    a, c = load_file(anchor / "anchor.safetensors"), load_file(cotrain / "anchor.safetensors")
    assert set(a) == set(c)
    drift = max(float((a[k] - c[k]).abs().max()) for k in a)
    scale = max(float(v.abs().max()) for v in a.values())
    assert drift < 0.05 < scale, (drift, scale)
