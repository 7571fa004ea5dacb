"""Issue 70, item 4: the paper cuts a new user met after `make demo`, each run as the user typed it
(through `memtree.cli.main`, on real files). Each test failed before its fix. (a) and (e), README
lines, are held by tests/test_readme_commands.py; (f) by tests/test_forgetting.py; (g) by
tests/test_embed_openvino.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtree.cli import main

REPO = Path(__file__).resolve().parents[1]
BASELINE = str(REPO / "training" / "yamls" / "tiny-baseline.yaml")


def _err(capsys) -> str:
    return capsys.readouterr().err


# (b) a negative count sliced from the end
@pytest.mark.parametrize(
    "argv, flag",
    [
        (["eval", "knowledge", "runs/demo/train/cotrain", "--max-probes", "-5"], "--max-probes"),
        (["eval", "longctx", "runs/x", "--max-docs", "-1"], "--max-docs"),
        (
            ["pipeline", "run", "--input", "c.jsonl", "--out", "o", "--branching", "0"],
            "--branching",
        ),
        (["memstore", "plan", "--anchor", "tiny", "--memory", "4,2", "--ranks", "0"], "--ranks"),
    ],
)
def test_negative_counts_are_refused_by_the_parser(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = _err(capsys)
    assert f"argument {flag}: must be " in err, err


# (c) data.batch_size checked before anything is written
@pytest.mark.parametrize("value", ["0", "-1"])
def test_batch_size_is_checked_before_the_run_folder_is_written(
    value, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert (
        main(["train", "run", BASELINE, f"data.shards={tmp_path}", f"data.batch_size={value}"]) == 1
    )
    err = _err(capsys)
    assert f"data.batch_size: must be an integer >= 1, got {value}" in err, err
    assert "_iterator" not in err and "epochs" not in err and "--batch-size" not in err
    assert not (tmp_path / "runs").exists()


# (d) three messages that named the wrong thing
def test_an_empty_corpus_says_it_holds_no_records(tmp_path, capsys, dask_client):
    (tmp_path / "empty.jsonl").write_text("")
    assert (
        main(
            [
                "pipeline",
                "run",
                "--input",
                str(tmp_path / "empty.jsonl"),
                "--out",
                str(tmp_path / "run"),
                "--until",
                "ingest",
                "--no-progress",
                "--scheduler",
                dask_client.scheduler.address,
            ]
        )
        == 1
    )
    err = _err(capsys)
    assert "ingest: the inputs hold no records (1 file(s) read: " in err and "empty.jsonl" in err, (
        err
    )
    assert "rejected ({})" not in err


def test_a_directory_given_as_the_config_is_named_as_one(capsys):
    assert main(["train", "run", str(REPO / "training" / "yamls")]) == 1
    err = _err(capsys)
    assert (
        "a directory, not a YAML file (it holds " in err
        and "tiny-baseline.yaml" not in err.split("(")[0]
    ), err
    assert "config file not found" not in err


def test_memstore_info_on_the_manifest_file_names_the_bank_directory(tmp_path, capsys):
    bank = tmp_path / "bank"
    assert (
        main(
            [
                "memstore",
                "init",
                str(bank),
                "--anchor",
                "tiny",
                "--memory",
                "4,2",
                "--branching",
                "2",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["memstore", "info", str(bank / "manifest.json")]) == 1
    err = _err(capsys)
    assert f"give the bank's directory ({bank}), not its manifest.json" in err, err
    assert main(["memstore", "info", str(bank)]) == 0


# (h) a rerun resumes an unfinished run and skips a finished one
def test_rerunning_train_resumes_or_skips(pipeline_run, tmp_path, capsys):
    from streaming.base.util import clean_stale_shared_memory

    from memtree.training.train import rerun_plan

    shards = pipeline_run[0] / "shards"
    folder = tmp_path / "run"
    argv = [
        "train",
        "run",
        BASELINE,
        f"data.shards={shards}",
        f"save_folder={folder}",
        "data.batch_size=4",
        "save_interval=1ba",
        "optim.warmup=1ba",
        "progress_bar=false",
    ]

    def run(*extra: str) -> str:
        clean_stale_shared_memory()
        capsys.readouterr()
        assert main([*argv, *extra]) == 0
        return capsys.readouterr().out

    run("max_duration=2ba")
    metrics = folder / "metrics.json"
    stamp = metrics.stat().st_mtime_ns
    out = run("max_duration=2ba")
    assert (
        "already trained with this config for 2ba" in out and metrics.stat().st_mtime_ns == stamp
    ), out
    # a longer duration continues from the checkpoint: the Trainer's clock starts at batch 2
    from memtree.config import load_config
    from memtree.training.config import TrainConfig

    action, cfg = rerun_plan(load_config(TrainConfig, BASELINE, [*argv[3:], "max_duration=3ba"]))
    assert action == "resume" and cfg.autoresume
    ckpts = folder / "checkpoints"
    first = {f.name: f.stat().st_mtime_ns for f in ckpts.glob("*ba*.pt")}
    assert sorted(first) == ["ep0-ba1-rank0.pt", "ep0-ba2-rank0.pt"], sorted(first)
    out = run("max_duration=3ba")
    assert "resuming from its latest checkpoint" in out, out
    after = {f.name: f.stat().st_mtime_ns for f in ckpts.glob("*ba*.pt")}
    # batches 1-2 were not trained again (their checkpoints untouched); batch 3 was
    assert {k: after[k] for k in first} == first and "ep0-ba3-rank0.pt" in after, sorted(after)
    # --force trains from batch 1 again
    assert "already trained" not in run("max_duration=3ba", "--force")
    assert metrics.stat().st_mtime_ns != stamp
    clean_stale_shared_memory()


# (h) the demo's stages too: a half-trained stage continues from its latest checkpoint (it used
# to start again from batch 0 over its own checkpoints, seen on a 45-minute SmolLM2 stage)
def test_demo_stage_resumes_a_half_trained_run(pipeline_run, tmp_path):
    from streaming.base.util import clean_stale_shared_memory

    from memtree.config import load_config
    from memtree.eval.demo import train_once
    from memtree.training.config import TrainConfig

    folder = tmp_path / "stage"
    base = [
        f"data.shards={pipeline_run[0] / 'shards'}",
        f"save_folder={folder}",
        "data.batch_size=4",
        "save_interval=1ba",
        "optim.warmup=1ba",
        "progress_bar=false",
    ]
    inputs = {"shards": "x"}
    said: list[str] = []
    clean_stale_shared_memory()
    cfg = load_config(TrainConfig, BASELINE, [*base, "max_duration=2ba"])
    assert train_once("stage", cfg, inputs, log=said.append)[1] == "trained"
    (folder / "metrics.json").unlink()  # as if stopped after batch 2 of a longer stage
    ckpts = folder / "checkpoints"
    first = {f.name: f.stat().st_mtime_ns for f in ckpts.glob("*ba*.pt")}
    clean_stale_shared_memory()
    cfg = load_config(TrainConfig, BASELINE, [*base, "max_duration=3ba"])
    assert train_once("stage", cfg, inputs, log=said.append)[1] == "resumed"
    assert any("resuming from its latest checkpoint" in m for m in said), said
    after = {f.name: f.stat().st_mtime_ns for f in ckpts.glob("*ba*.pt")}
    assert {k: after[k] for k in first} == first and "ep0-ba3-rank0.pt" in after, sorted(after)
    assert train_once("stage", cfg, inputs, log=said.append)[1] == "reused"
    clean_stale_shared_memory()


# (i) eval memories' header names what the trained rows ran for
def test_memories_header_names_the_trained_rows_duration():
    from memtree.eval.memories_report import trained_durations

    demo = {"duration": "7ep"}
    rows = [
        {"kind": "demo", "train": {"duration": "demo (anchor + co-training)"}},
        {"kind": "dense", "train": {"duration": "2ba"}},
        {"kind": "moc", "train": {"duration": "2ba"}},
    ]
    assert trained_durations({"demo": demo, "rows": rows}) == "2ba (the demo's is 7ep)"
    rows[1]["train"]["duration"] = rows[2]["train"]["duration"] = "7ep"
    assert trained_durations({"demo": demo, "rows": rows}) == "7ep (the demo's)"
    assert trained_durations({"demo": demo, "rows": rows[:1]}) == "7ep (none trained)"
