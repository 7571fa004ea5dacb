"""Sweep configs (App. F memory location, Fig. 3 memory size): expansion, a tiny end-to-end sweep,
resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memtree.cli import main
from memtree.config import ConfigError, dump_yaml, from_dict
from memtree.eval.sweeps import SweepConfig, expand, load_sweep_config, run_sweep
from memtree.geometry import layer_widths, plan
from memtree.training.data import read_shards_manifest, tokenizer_vocab_size

YAMLS = Path(__file__).resolve().parents[1] / "eval" / "yamls"
TINY = [
    "mode=scratch",
    "memory.multipliers=[8,4]",
    "data.batch_size=2",
    "max_duration=3ba",
    "optim.warmup=1ba",
    "memory.export_dtype=fp32",
    "memory.placement_layers=1",
    "model.shape={n_layers: 2, d_model: 32, n_heads: 1, head_dim: 32, ffn_dim: 64}",
]


def _sweep(tmp: Path, shards: Path, facts: Path, settings: list[dict], **kw) -> SweepConfig:
    return from_dict(
        SweepConfig,
        {
            "name": "t",
            "out": str(tmp),
            "train": [f"data.shards={shards}", *TINY],
            "settings": settings,
            "eval": {"facts": str(facts), "max_probes": 8},
            **kw,
        },
    )


def test_config_errors_name_the_key(tmp_path):
    ok = {
        "name": "s",
        "out": str(tmp_path),
        "settings": [{"name": "a"}],
        "eval": {"facts": "f.jsonl"},
    }
    from_dict(SweepConfig, ok)
    with pytest.raises(ConfigError, match="unknown config key setings"):
        from_dict(SweepConfig, {**ok, "setings": []})
    with pytest.raises(ConfigError, match=r"unknown config key settings\[0\]\.trian"):
        from_dict(SweepConfig, {**ok, "settings": [{"name": "a", "trian": []}]})
    with pytest.raises(ConfigError, match="unknown config key eval.max_probe"):
        from_dict(SweepConfig, {**ok, "eval": {"facts": "f", "max_probe": 3}})
    with pytest.raises(ConfigError, match=r"repeat"):
        from_dict(SweepConfig, {**ok, "settings": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(
        ConfigError, match=r"settings\[0\]\.train: save_folder is set by the experiment"
    ):
        from_dict(SweepConfig, {**ok, "settings": [{"name": "a", "train": ["save_folder=x"]}]})
    with pytest.raises(ConfigError, match="x_axis"):
        from_dict(SweepConfig, {**ok, "x_axis": "layers"})


def test_location_yaml_expands_into_distinct_runs_with_one_parameter_budget(pipeline_run, tmp_path):
    shards = pipeline_run[0] / "shards"
    cfg = load_sweep_config(YAMLS / "sweep-location.yaml", [f"out={tmp_path / 'loc'}"])
    # the fixture's tree has 2 levels
    runs = expand(cfg, [f"data.shards={shards}", "memory.multipliers=[0,16]"])
    assert [r.name for r in runs] == ["uniform", "early", "middle", "late"]
    assert len({r.config.save_folder for r in runs}) == len({r.config.run_name for r in runs}) == 4
    assert len({r.config.fingerprint() for r in runs}) == 4
    manifest = read_shards_manifest(shards)
    vocab, branching = tokenizer_vocab_size(shards, manifest), int(manifest["branching"])
    plans = [plan(r.config.anchor_shape(vocab), r.config.memory_config(branching)) for r in runs]
    # demo.yaml's anchor has 4 layers; App. F widens the chosen layers to keep uniform's budget
    assert [list(p.memory_layers) for p in plans] == [[0, 1, 2, 3], [0, 1], [1, 2], [2, 3]]
    assert [layer_widths(p.anchor, p.memory, 16) for p in plans][1] == {0: 32, 1: 32}
    assert len({p.bank_params for p in plans}) == len({p.fetch_params for p in plans}) == 1
    # W1,W2,W3 (16, d) × 4 layers
    assert plans[0].bank_params == branching**2 * 3 * 16 * 4 * plans[0].anchor.d_model
    assert [r.plan.bank_params for r in runs] == [p.bank_params for p in plans]
    # the size sweep needs the demo's 3-level tree: refused with the setting and key named
    size = load_sweep_config(YAMLS / "sweep-size.yaml")
    assert len(size.settings) == 6 and size.x_axis == "bank_params"
    with pytest.raises(ConfigError, match="setting 'l1-m16': memory.multipliers: 3 levels"):
        expand(size, [f"data.shards={shards}"])


def test_tiny_sweep_end_to_end_resumes_and_is_deterministic(pipeline_run, tmp_path):
    from streaming.base.util import clean_stale_shared_memory

    from memtree.pipeline.corpus.topical import CorpusSpec, write_facts_jsonl

    clean_stale_shared_memory()
    shards = pipeline_run[0] / "shards"
    facts = tmp_path / "facts.jsonl"
    write_facts_jsonl(facts, CorpusSpec(n_docs=1200, seed=3, long_doc_fraction=0.01))
    settings = [
        {"name": "uniform", "train": ["memory.placement=uniform"]},
        {"name": "late", "train": ["memory.placement=late"]},
    ]
    cfg = _sweep(tmp_path / "sweep", shards, facts, settings)
    res = run_sweep(cfg, log=lambda m: None)
    assert [r["status"] for r in res["runs"]] == ["trained", "trained"]
    for key in ("json", "markdown", "png"):
        assert Path(res["files"][key]).stat().st_size > 0
    data = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert [r["memory"]["memory_layers"] for r in data["runs"]] == [[0, 1], [1]]
    assert data["runs"][0]["bank_params"] == data["runs"][1]["bank_params"]
    assert set(data["runs"][0]["modes"]) == {"none", "generic", "fetched"}
    assert (tmp_path / "sweep" / "runs" / "late" / "eval" / "report.md").exists()
    assert (
        "| late | `memory.placement=late` | 1 |" in (tmp_path / "sweep" / "report.md").read_text()
    )

    anchors = [tmp_path / "sweep" / "runs" / n / "anchor.safetensors" for n in ("uniform", "late")]
    stamps = [a.stat().st_mtime_ns for a in anchors]
    (tmp_path / "sweep.yaml").write_text(dump_yaml(cfg))
    assert main(["eval", "sweep", str(tmp_path / "sweep.yaml")]) == 0  # the CLI entry, resuming
    again = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert [r["status"] for r in again["runs"]] == ["skipped", "skipped"]
    assert [a.stat().st_mtime_ns for a in anchors] == stamps
    assert [r["modes"] for r in again["runs"]] == [r["modes"] for r in data["runs"]]
    with pytest.raises(ConfigError, match="holds a finished run of another config"):
        run_sweep(cfg, train_overrides=["optim.lr=1e-3"], log=lambda m: None)

    # same seed, fresh folder: the identical model
    fresh = run_sweep(_sweep(tmp_path / "fresh", shards, facts, settings[1:]), log=lambda m: None)
    a, b = (
        load_file(str(anchors[1])),
        load_file(str(tmp_path / "fresh" / "runs" / "late" / "anchor.safetensors")),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert fresh["runs"][0]["modes"] == data["runs"][1]["modes"]
    clean_stale_shared_memory()
