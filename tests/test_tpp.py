"""Tokens per parameter (memtree/tpp.py): `memtree memstore plan --shards/--tokens` and the table
`memtree train` stores. Per-block counts are checked against the shards' own samples, read back
through Streaming here, not against the manifest the code reads."""

from __future__ import annotations

import json
import shutil
import statistics

import numpy as np
import pytest

from memtree.cli import main
from memtree.eval.runinfo import run_tpp_table
from memtree.geometry import AnchorShape, plan
from memtree.tpp import (
    GENERALISES_DOWN_TO,
    TppError,
    even_leaf_tokens,
    parse_duration_epochs,
    parse_tokens,
    table_from_dict,
    tpp_table,
)
from tests.conftest import train_tiny_run

ANCHOR = "n_layers=2,d_model=64,n_heads=2,head_dim=32,ffn_dim=128,vocab_size=2000"


def _samples(shards):
    """(path, token count) of every sample in the shards, through Streaming."""
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    from memtree.pipeline.shards import open_streams

    clean_stale_shared_memory()
    ds = StreamingDataset(streams=open_streams(shards), shuffle=False, batch_size=1)
    out = [(np.asarray(s["path"]).tolist(), len(s["tokens"])) for s in ds]
    clean_stale_shared_memory()
    return out


def _plan_json(capsys, *args):
    assert main(["memstore", "plan", "--anchor", ANCHOR, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_counts_each_blocks_tokens_as_its_samples_hold(pipeline_run, capsys):
    run = pipeline_run[0]
    samples = _samples(run / "shards")
    out = _plan_json(capsys, "--memory", "8,16", "--shards", str(run / "shards"), "--duration", "3ep",
                     "--generic-prob", "0.125")
    t = out["tokens_per_parameter"]
    assert t["epoch_tokens"] == sum(n for _, n in samples) and t["epochs"] == 3.0
    for lv in t["levels"]:
        per_block: dict[int, int] = {}
        for path, n in samples:
            per_block[path[lv["level"] - 1]] = per_block.get(path[lv["level"] - 1], 0) + n
        counts = sorted(per_block.values())
        assert (lv["tokens_min"], lv["tokens_median"], lv["tokens_max"]) == (
            counts[0], statistics.median(counts), counts[-1])
        assert lv["trained_blocks"] == len(counts)
        bank = out["levels"][lv["level"] - 1]["bank_params"]
        assert lv["tpp_epoch"] == pytest.approx(sum(counts) * 0.875 / bank)
        assert lv["tpp_run"] == pytest.approx(3 * lv["tpp_epoch"])
        assert lv["tpp_run_max"] == pytest.approx(counts[-1] * 0.875 * 3 / lv["block_params"])
    # the run folder works as well as its shards/ folder, and its tree's branching is taken
    again = _plan_json(capsys, "--memory", "8,16", "--shards", str(run), "--duration", "3ep", "--generic-prob", "0.125")
    assert again["tokens_per_parameter"]["levels"] == t["levels"] and again["memory"]["branching"] == 8


def test_the_warning_fires_on_a_big_bank_and_not_on_a_sized_one(pipeline_run, capsys):
    shards = str(pipeline_run[0] / "shards")
    assert main(["memstore", "plan", "--anchor", ANCHOR, "--memory", "0,256", "--shards", shards]) == 0
    text = capsys.readouterr().out
    assert "warning: level 2: each block sees" in text and "verbatim" in text
    big = _plan_json(capsys, "--memory", "0,256", "--shards", shards)["tokens_per_parameter"]
    assert big["levels"][0]["tpp_run"] < GENERALISES_DOWN_TO and len(big["warnings"]) == 1
    assert main(["memstore", "plan", "--anchor", ANCHOR, "--memory", "1,0", "--shards", shards, "--duration", "2ep"]) == 0
    text = capsys.readouterr().out
    assert "tokens per parameter" in text and "warning" not in text
    # a bank that learns faster than the anchor: the second measured regime, whatever the TPP
    sized = ["memstore", "plan", "--anchor", ANCHOR, "--memory", "1,0", "--shards", shards]
    assert main([*sized, "--bank-lr", "3e-2", "--anchor-lr", "3e-3"]) == 0
    text = capsys.readouterr().out
    assert "warning: the bank learns at 10× the anchor's learning rate" in text and "level 1:" not in text
    assert main([*sized, "--bank-lr", "1e-3", "--anchor-lr", "3e-3"]) == 0
    assert "warning" not in capsys.readouterr().out
    assert main([*sized, "--bank-lr", "1e-3"]) == 1
    assert "--bank-lr and --anchor-lr go together" in capsys.readouterr().err


def test_bad_tokens_and_counts_are_named(pipeline_run, tmp_path, capsys):
    base = ["memstore", "plan", "--anchor", ANCHOR, "--memory", "0,16"]
    for bad in ("0", "-5", "abc", "1e400"):
        assert main([*base, f"--tokens={bad}"]) == 1
        assert f"--tokens {bad!r}" in capsys.readouterr().err
    assert main([*base, "--duration", "3ep"]) == 1
    assert "--duration sizes the tokens per parameter" in capsys.readouterr().err
    assert main([*base, "--tokens", "1M", "--duration", "often"]) == 1
    assert "--duration 'often'" in capsys.readouterr().err
    # a shards folder written before the per-leaf counts: the manifest is named, with the fix
    old = tmp_path / "old-shards"
    shutil.copytree(pipeline_run[0] / "shards", old)
    m = json.loads((old / "manifest.json").read_text())
    for s in m["streams"]:
        del s["leaf_tokens"]
    (old / "manifest.json").write_text(json.dumps(m))
    assert main([*base, "--shards", str(old)]) == 1
    err = capsys.readouterr().err
    assert str(old / "manifest.json") in err and "leaf_tokens" in err and "memtree pipeline" in err
    assert main([*base, "--shards", str(tmp_path / "nowhere")]) == 1
    assert "--shards" in capsys.readouterr().err
    assert main([*base, "--shards", str(pipeline_run[0] / "shards"), "--branching", "4"]) == 1
    assert "branches 8" in capsys.readouterr().err


def test_even_split_and_durations():
    a = AnchorShape(name="t", n_layers=2, d_model=64, n_heads=2, head_dim=32, ffn_dim=128, vocab_size=2000)
    p = plan(a, (0, 0, 16), branching=4)
    t = tpp_table(p, even_leaf_tokens(6_400_000, p), epochs=2.0, generic_prob=0.0)
    (lv,) = t.levels
    assert lv.block_params == 3 * 64 * 16 * 2 and lv.tokens_min == lv.tokens_max == 100_000
    assert lv.tpp_run == pytest.approx(2 * 6_400_000 / (64 * lv.block_params))
    # the sizing rule: the largest multiplier per level that keeps its TPP at the threshold
    per_m = {1: 4 * 3 * 64 * 2, 2: 16 * 3 * 64 * 2, 3: 64 * 3 * 64 * 2}  # blocks × 3·d·L per unit of m
    assert t.threshold == GENERALISES_DOWN_TO
    assert dict(t.max_multipliers) == {lv: int(2 * 6_400_000 / (per_m[lv] * t.threshold)) for lv in (1, 2, 3)}
    m3 = dict(t.max_multipliers)[3]
    for m, warns in ((m3, False), (m3 + 1, True)):
        at = tpp_table(plan(a, (0, 0, m), branching=4), even_leaf_tokens(6_400_000, p), epochs=2.0, generic_prob=0.0)
        assert (at.levels[0].tpp_run < t.threshold) == warns and bool(at.warnings()) == warns
    # a stored table reads back as it was, and under another rule warns by that rule
    stored = json.loads(json.dumps(at.to_dict()))
    assert table_from_dict(stored).to_dict() == stored
    strict = table_from_dict(stored, threshold=at.levels[0].tpp_run * 2, lr_ratio=3.0)
    assert strict.max_multipliers == () and len(strict.warnings()) == 2 and "3× the anchor" in strict.warnings()[1]
    with pytest.raises(TppError, match="format"):
        table_from_dict({**stored, "format": "other"})
    assert parse_tokens("3.5M") == 3_500_000 and parse_tokens("2_000") == 2000
    assert parse_duration_epochs("7Mtok", epoch_tokens=3_500_000) == 2.0
    assert parse_duration_epochs("400ba", epoch_tokens=1, epoch_samples=1600, batch_size=8) == 2.0
    with pytest.raises(TppError, match="batch size"):
        parse_duration_epochs("400ba", epoch_tokens=1, epoch_samples=1600)
    with pytest.raises(TppError, match="another tree"):
        tpp_table(p, {10_000: 5})


def test_train_stores_the_table_it_logs(pipeline_run, tmp_path, capsys):
    run = pipeline_run[0]
    folder = train_tiny_run(run / "shards", tmp_path / "r", "model.anchor=custom",
                            "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 128}",
                            "memory.multipliers=[4,8]", "max_duration=6ba", "memory.dropout=0.25",
                            "data.batch_size=8")  # 6 batches, not epochs: the table is what is tested
    stored = json.loads((folder / "tpp.json").read_text())
    n_samples = len(_samples(run / "shards"))
    assert stored["format"] == "memtree-tpp" and stored["dropout"] == 0.25
    assert stored["epochs"] == pytest.approx(6 * 8 / n_samples)
    cfg = json.loads((folder / "memtree_config.json").read_text())["config"]
    assert stored["lr_ratio"] == pytest.approx(cfg["memory"]["lr"] / cfg["optim"]["lr"])
    assert "tokens per parameter" in capsys.readouterr().out
    want = _plan_json(capsys, "--memory", "4,8", "--shards", str(run / "shards"), "--duration", "6ba",
                      "--batch-size", "8", "--dropout", "0.25")["tokens_per_parameter"]
    assert stored["levels"] == want["levels"]
    # a table written under an older rule (no LR ratio, another floor) is read under today's
    (folder / "tpp.json").write_text(json.dumps({**{k: v for k, v in stored.items() if k != "lr_ratio"},
                                                 "threshold": 1e9, "warnings": []}))
    again = run_tpp_table(folder)
    assert again["threshold"] == GENERALISES_DOWN_TO and again["levels"] == stored["levels"]
    assert again["lr_ratio"] == pytest.approx(stored["lr_ratio"]) and again["warnings"] == stored["warnings"]
