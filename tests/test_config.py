import pytest

from memtree.config import ConfigError, load_config, to_dict
from memtree.pipeline.config import PipelineConfig


def test_defaults_and_overrides():
    cfg = load_config(
        PipelineConfig, {"out": "x"}, ["tree.levels=3", "ingest.inputs=[a.jsonl,b.parquet]"]
    )
    assert cfg.tree.levels == 3 and cfg.tree.branching == 16
    assert cfg.ingest.inputs == ["a.jsonl", "b.parquet"]
    assert to_dict(cfg)["tree"]["levels"] == 3


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"tree\.levelz"):
        load_config(PipelineConfig, {"out": "x", "tree": {"levelz": 3}})
    with pytest.raises(ConfigError, match=r"unknown config key bogus"):
        load_config(PipelineConfig, {"out": "x"}, ["bogus=1"])


def test_type_and_value_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"tree\.branching: expected an integer"):
        load_config(PipelineConfig, {"out": "x", "tree": {"branching": "many"}})
    with pytest.raises(ConfigError, match=r"embed\.strategy: 'max' is not one of"):
        load_config(PipelineConfig, {"out": "x", "embed": {"strategy": "max"}})
    with pytest.raises(ConfigError, match=r"branching must be >= 2"):
        load_config(PipelineConfig, {"out": "x", "tree": {"branching": 1}})
    with pytest.raises(ConfigError, match="missing required config key out"):
        load_config(PipelineConfig, {})
    with pytest.raises(ConfigError, match="seq_len"):
        load_config(PipelineConfig, {"out": "x", "pack": {"seq_len": 16}})


def test_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("out: r\ntree:\n  levels: 2\n")
    assert load_config(PipelineConfig, p).tree.levels == 2
    with pytest.raises(ConfigError, match="not found"):
        load_config(PipelineConfig, tmp_path / "missing.yaml")


def test_tree_restarts_is_validated_and_only_in_the_fingerprint_when_used():
    """restarts=1 (the default) leaves the tree stage's fingerprint what it was before the field
    existed, so finished runs are not rebuilt; any other value is a different tree."""
    import json

    from memtree.pipeline.run import STAGES

    with pytest.raises(ConfigError, match="restarts"):
        load_config(PipelineConfig, {"out": "x", "tree": {"restarts": 0}})
    tree = next(s for s in STAGES if s.name == "tree")
    default = load_config(PipelineConfig, {"out": "x"})
    before = {**to_dict(default.tree), "seed": default.seed}
    # the defaults left out (restarts 1, method topdown): older trees keep their fingerprint
    del before["restarts"], before["gemm"], before["method"]
    assert json.dumps(tree.config(default), sort_keys=True) == json.dumps(before, sort_keys=True)
    more = load_config(PipelineConfig, {"out": "x", "tree": {"restarts": 4, "gemm": "torch"}})
    # the GEMM backend is a speed setting (the same paths): no backend rebuilds a finished tree
    assert tree.config(more)["restarts"] == 4 and "gemm" not in tree.config(more)
    with pytest.raises(ConfigError, match="gemm"):
        load_config(PipelineConfig, {"out": "x", "tree": {"gemm": "blis"}})


def test_allow_tf32_is_a_typed_key_outside_the_fingerprint():
    from memtree.training.config import load_train_config

    base = ["data.shards=x"]
    on, off = load_train_config(None, base), load_train_config(None, [*base, "allow_tf32=false"])
    assert on.allow_tf32 is True and off.allow_tf32 is False  # Composer's DeviceGPU default is on
    # a numerics setting of the device, like `device`: a run may resume with it changed
    assert on.fingerprint() == off.fingerprint()
    with pytest.raises(ConfigError, match="allow_tf32"):
        load_train_config(None, [*base, "allow_tf32=sometimes"])
