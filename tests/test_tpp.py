"""Tokens per parameter (memtree/tpp.py): `memtree memstore plan --shards/--tokens` and the table
`memtree train` stores. Per-block counts are checked against the shards' own samples, read back
through Streaming here, not against the manifest the code reads."""

from __future__ import annotations

import json
import math
import shutil
import statistics

import numpy as np
import pytest

from memtree.cli import main
from memtree.eval.runinfo import run_tpp_table
from memtree.geometry import AnchorShape, plan
from memtree.tpp import (
    FETCH_WORSE_AT_TPP,
    GENERALISES_DOWN_TO,
    HARMFUL_LR_RATIO,
    SAFE_LR_RATIO,
    TppError,
    deliberate,
    even_leaf_tokens,
    format_tpp,
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
    out = _plan_json(
        capsys,
        "--memory",
        "8,16",
        "--shards",
        str(run / "shards"),
        "--duration",
        "3ep",
        "--generic-prob",
        "0.125",
    )
    t = out["tokens_per_parameter"]
    assert t["epoch_tokens"] == sum(n for _, n in samples) and t["epochs"] == 3.0
    for lv in t["levels"]:
        per_block: dict[int, int] = {}
        for path, n in samples:
            per_block[path[lv["level"] - 1]] = per_block.get(path[lv["level"] - 1], 0) + n
        counts = sorted(per_block.values())
        assert (lv["tokens_min"], lv["tokens_median"], lv["tokens_max"]) == (
            counts[0],
            statistics.median(counts),
            counts[-1],
        )
        assert lv["trained_blocks"] == len(counts)
        bank = out["levels"][lv["level"] - 1]["bank_params"]
        assert lv["tpp_epoch"] == pytest.approx(sum(counts) * 0.875 / bank)
        assert lv["tpp_run"] == pytest.approx(3 * lv["tpp_epoch"])
        assert lv["tpp_run_max"] == pytest.approx(counts[-1] * 0.875 * 3 / lv["block_params"])
    # the run folder works as well as its shards/ folder, and its tree's branching is taken
    again = _plan_json(
        capsys,
        "--memory",
        "8,16",
        "--shards",
        str(run),
        "--duration",
        "3ep",
        "--generic-prob",
        "0.125",
    )
    assert (
        again["tokens_per_parameter"]["levels"] == t["levels"] and again["memory"]["branching"] == 8
    )


def test_the_warning_fires_on_a_big_bank_and_not_on_a_sized_one(pipeline_run, capsys):
    shards = str(pipeline_run[0] / "shards")
    # one epoch: under the fewest TPP measured, not as low as a run measured to go wrong: a note
    assert (
        main(["memstore", "plan", "--anchor", ANCHOR, "--memory", "0,256", "--shards", shards]) == 0
    )
    text = capsys.readouterr().out
    assert (
        "note: level 2: each block sees" in text and "not known" in text and "warning" not in text
    )
    big = _plan_json(capsys, "--memory", "0,256", "--shards", shards)["tokens_per_parameter"]
    assert FETCH_WORSE_AT_TPP < big["levels"][0]["tpp_run"] < GENERALISES_DOWN_TO
    assert len(big["notes"]) == 1 and not big["warnings"]
    # a twentieth of an epoch: as low as the run whose fetched memory read worse than its generic
    # one
    assert (
        main(
            [
                "memstore",
                "plan",
                "--anchor",
                ANCHOR,
                "--memory",
                "0,256",
                "--shards",
                shards,
                "--duration",
                "0.05ep",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "warning: level 2: each block sees" in text and "worse with its fetched blocks" in text
    assert (
        main(
            [
                "memstore",
                "plan",
                "--anchor",
                ANCHOR,
                "--memory",
                "1,0",
                "--shards",
                shards,
                "--duration",
                "2ep",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "tokens per parameter" in text and "warning" not in text and "note" not in text
    # a bank that learns faster than the anchor: measured harmful from 10/3×, whatever the TPP
    sized = ["memstore", "plan", "--anchor", ANCHOR, "--memory", "1,0", "--shards", shards]
    assert main([*sized, "--bank-lr", "3e-2", "--anchor-lr", "3e-3"]) == 0
    text = capsys.readouterr().out
    assert (
        "warning: the bank learns at 10× the anchor's learning rate" in text
        and "level 1:" not in text
    )
    # 2×: between the measured, a note
    assert main([*sized, "--bank-lr", "6e-3", "--anchor-lr", "3e-3"]) == 0
    text = capsys.readouterr().out
    assert (
        "warning" not in text and "note: the bank learns at 2× the anchor's learning rate" in text
    )
    assert main([*sized, "--bank-lr", "1e-3", "--anchor-lr", "3e-3"]) == 0
    text = capsys.readouterr().out
    assert "warning" not in text and "note" not in text
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
    a = AnchorShape(
        name="t", n_layers=2, d_model=64, n_heads=2, head_dim=32, ffn_dim=128, vocab_size=2000
    )
    p = plan(a, (0, 0, 16), branching=4)
    t = tpp_table(p, even_leaf_tokens(6_400_000, p), epochs=2.0, generic_prob=0.0)
    (lv,) = t.levels
    assert lv.block_params == 3 * 64 * 16 * 2 and lv.tokens_min == lv.tokens_max == 100_000
    assert lv.tpp_run == pytest.approx(2 * 6_400_000 / (64 * lv.block_params))
    # the sizing rule: the largest multiplier per level that keeps its TPP at the threshold
    # blocks × 3·d·L per unit of m
    per_m = {1: 4 * 3 * 64 * 2, 2: 16 * 3 * 64 * 2, 3: 64 * 3 * 64 * 2}
    assert t.threshold == GENERALISES_DOWN_TO
    assert dict(t.max_multipliers) == {
        lv: int(2 * 6_400_000 / (per_m[lv] * t.threshold)) for lv in (1, 2, 3)
    }
    m3 = dict(t.max_multipliers)[3]
    for m, under in (
        (m3, False),
        (m3 + 1, True),
    ):  # under the fewest measured: a note, not a warning
        at = tpp_table(
            plan(a, (0, 0, m), branching=4),
            even_leaf_tokens(6_400_000, p),
            epochs=2.0,
            generic_prob=0.0,
        )
        assert (
            (at.levels[0].tpp_run < t.threshold) == under
            and bool(at.notes()) == under
            and not at.warnings()
        )
    # a stored table reads back as it was, and under another rule notes and warns by that rule
    stored = json.loads(json.dumps(at.to_dict()))
    assert table_from_dict(stored).to_dict() == stored
    strict = table_from_dict(stored, threshold=at.levels[0].tpp_run * 2, lr_ratio=10.0)
    assert strict.max_multipliers == () and len(strict.notes()) == 1 and len(strict.warnings()) == 1
    assert "10× the anchor" in strict.warnings()[0]
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
    folder = train_tiny_run(
        run / "shards",
        tmp_path / "r",
        "model.anchor=custom",
        "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 128}",
        "memory.multipliers=[4,8]",
        "max_duration=6ba",
        "memory.dropout=0.25",
        "data.batch_size=8",
    )  # 6 batches, not epochs: the table is what is tested
    stored = json.loads((folder / "tpp.json").read_text())
    n_samples = len(_samples(run / "shards"))
    assert stored["format"] == "memtree-tpp" and stored["dropout"] == 0.25
    assert stored["epochs"] == pytest.approx(6 * 8 / n_samples)
    cfg = json.loads((folder / "memtree_config.json").read_text())["config"]
    assert stored["lr_ratio"] == pytest.approx(cfg["memory"]["lr"] / cfg["optim"]["lr"])
    assert "tokens per parameter" in capsys.readouterr().out
    want = _plan_json(
        capsys,
        "--memory",
        "4,8",
        "--shards",
        str(run / "shards"),
        "--duration",
        "6ba",
        "--batch-size",
        "8",
        "--dropout",
        "0.25",
    )["tokens_per_parameter"]
    assert stored["levels"] == want["levels"]
    # a table written under an older rule (no LR ratio, another floor) is read under today's
    (folder / "tpp.json").write_text(
        json.dumps(
            {
                **{k: v for k, v in stored.items() if k != "lr_ratio"},
                "threshold": 1e9,
                "warnings": [],
            }
        )
    )
    again = run_tpp_table(folder)
    assert again["threshold"] == GENERALISES_DOWN_TO and again["levels"] == stored["levels"]
    assert (
        again["lr_ratio"] == pytest.approx(stored["lr_ratio"])
        and again["warnings"] == stored["warnings"]
    )
    assert again["notes"] == stored["notes"]


def _yaml_table(name: str, epoch_tokens: int, epochs: float, *overrides: str):
    """The TPP table of a shipped training YAML's memory and learning rates on `epoch_tokens` per
    epoch spread evenly over the 3-level × 4 tree they train on."""
    from pathlib import Path

    from memtree.training.config import load_train_config

    cfg = load_train_config(
        Path(__file__).resolve().parents[1] / "training" / "yamls" / name, list(overrides)
    )
    p = plan(cfg.anchor_shape(8192), tuple(cfg.memory.multipliers), branching=4)
    return tpp_table(
        p,
        even_leaf_tokens(epoch_tokens, p),
        epochs=epochs,
        generic_prob=cfg.memory.generic_prob,
        dropout=cfg.memory.dropout,
        lr_ratio=cfg.memory.lr / cfg.optim.lr,
    )


def _measured(multipliers, tpp_run: float, lr_ratio: float):
    """A one-level table (the realtext anchor's shape) whose level sits at `tpp_run` over the run,
    or just under it (whole tokens)."""
    a = AnchorShape(
        name="t", n_layers=4, d_model=128, n_heads=4, head_dim=32, ffn_dim=512, vocab_size=8192
    )
    p = plan(a, multipliers, branching=4)
    (bank,) = [lv.bank_params for lv in p.levels if lv.multiplier]
    return tpp_table(
        p, even_leaf_tokens(math.floor(tpp_run * bank), p), generic_prob=0.0, lr_ratio=lr_ratio
    )


def test_warnings_fire_where_benchmarks_measured_harm_and_not_on_the_shipped_recipes():
    """docs/BENCHMARKS.md: a bank at 10/3× and 10× the anchor's LR read held-out text worse than
    dense-1x ("Memory rows on real text", `mlr1e-2`, `mlr3e-2`; "Tokens per parameter on real text",
    `l1m16-lr3e-2` at TPP 35.6 and `l3m256-lr3e-2` at 0.139); 1× and 1/3× did not, and 1/3×
    generalised down to 0.139; fetched read worse than generic with levels at 0.0044 and 0.00066
    (SmolLM2, the real-text row). The shipped recipes get no warning."""
    assert HARMFUL_LR_RATIO == pytest.approx(1e-2 / 3e-3) and SAFE_LR_RATIO == 1.0
    for ratio in (1e-2 / 3e-3, 3e-2 / 3e-3):  # measured harmful, at a high and a low TPP
        for m, tpp in (((16, 0, 0), 35.6), ((0, 0, 256), 0.1391)):  # l3m256: 0.1391 unrounded
            (w,) = _measured(m, tpp, ratio).warnings()
            assert f"{ratio:.3g}× the anchor's learning rate" in w
    for ratio in (1e-3 / 3e-3, 3e-3 / 3e-3):  # measured not to harm
        t = _measured((0, 0, 256), 0.1391, ratio)
        assert not t.warnings() and not t.notes()
    assert not _measured((0, 0, 256), 0.1391, 4.0).notes()  # not the note's: a warning
    # TPP: at the smallest measured (where it generalised) nothing; under it a note; at the SmolLM2
    # run's, a warning
    assert GENERALISES_DOWN_TO == 0.139 and FETCH_WORSE_AT_TPP == 0.0044
    t = _measured((0, 0, 256), 0.1391, 1 / 3)
    assert not t.warnings() and not t.notes()
    t = _measured((0, 0, 256), 0.07, 1 / 3)  # l3m512-lr1e-3, not measured
    assert not t.warnings() and len(t.notes()) == 1 and "not known" in t.notes()[0]
    for tpp in (0.0044, 0.00066):  # and just above the measured one, a note
        (w,) = _measured((0, 0, 256), tpp, 1 / 3).warnings()
        assert "worse with its fetched blocks than with the generic memory" in w
    t = _measured((0, 0, 256), 0.0045, 1 / 3)
    assert not t.warnings() and len(t.notes()) == 1
    # the shipped real-text recipe (3.73M tokens, one epoch: 8.9 tokens per parameter at every
    # level, bank LR a third of the anchor's): no warning, no note
    real = _yaml_table("realtext.yaml", 3_734_731, 1.0)
    assert [round(lv.tpp_run, 1) for lv in real.levels] == [8.9, 8.9, 8.9]
    assert real.lr_ratio == pytest.approx(1 / 3) and not real.warnings() and not real.notes()
    assert "warning" not in format_tpp(real) and "note" not in format_tpp(real)


def test_the_demo_console_does_not_warn_on_its_deliberate_settings():
    """The bios demo (training/yamls/demo.yaml: bank LR 5× the anchor's, leaf blocks under the
    fewest TPP measured; 324,806 tokens per epoch in its shards, 5 co-training epochs): its
    training console, inside `deliberate(**eval.demo.DELIBERATE)` as `run_main_job` runs it,
    prints notes only; outside it (a run of the same settings on real text) the measured LR
    warning fires; tpp.json keeps it either way."""
    from memtree.eval.demo import DELIBERATE, TPP_NOTE

    demo = _yaml_table(
        "demo.yaml", 324_806, 5.0, "mode=cotrain", "anchor_checkpoint=runs/demo/train/anchor"
    )
    assert (
        demo.lr_ratio == pytest.approx(5.0)
        and FETCH_WORSE_AT_TPP < demo.levels[-1].tpp_run < GENERALISES_DOWN_TO
    )
    assert (
        len(demo.warnings()) == 1
        and "5× the anchor's" in demo.warnings()[0]
        and len(demo.notes()) == 1
    )
    plain = format_tpp(demo)
    assert "warning: the bank learns at 5×" in plain
    with deliberate(**DELIBERATE):
        text = format_tpp(demo)
        stored = demo.to_dict()
    assert "warning" not in text and text.count("note:") == 2 and "deliberate setting" in text
    assert demo.console_lines(DELIBERATE) == text.splitlines()[-2:]
    assert format_tpp(demo) == plain  # only inside the block
    assert stored["warnings"] == demo.warnings()
    assert "memorising regime" not in TPP_NOTE and "0.139" in TPP_NOTE
    with pytest.raises(ValueError, match="unknown kind"), deliberate(speed="fast"):
        pass
