"""Issue 36 (pipeline, training and the dispatcher): the README's and `--help`'s commands, run as a
new user runs them, through `memtree.cli.main` on real files. Each test failed before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from memtree.cli import build_parser, main
from tests.conftest import write_jsonl

REPO = Path(__file__).resolve().parents[1]


def _err(capsys) -> str:
    return capsys.readouterr().err


# ------------------------------------------------------------------ item 14: unknown options
@pytest.mark.parametrize(
    "argv, usage",
    [
        (["pipeline", "run", "--input", "c.jsonl", "--bogus"], "usage: memtree pipeline "),
        (["train", "run", "cfg.yaml", "--bogus"], "usage: memtree train "),
        (["memstore", "block", "runs/bank", "--bogus"], "usage: memtree memstore block "),
        (["memstore", "--bogus", "block", "runs/bank"], "usage: memtree memstore "),
    ],
)
def test_unknown_option_shows_the_subcommands_usage(capsys, argv, usage):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = _err(capsys)
    assert usage in err, err
    assert "usage: memtree [-h]" not in err
    assert "unrecognized arguments: --bogus" in err


def test_overrides_after_an_option_are_overrides():
    args = build_parser().parse_args(
        ["pipeline", "run", "cfg.yaml", "--until", "ingest", "tree.levels=3", "seed=1"]
    )
    assert args.config == "cfg.yaml" and args.overrides == ["tree.levels=3", "seed=1"]
    assert args.until == "ingest"


# ------------------------------------------------------------------ item 9: rejects are reported
def _bad_corpus(path: Path) -> Path:
    write_jsonl(
        path,
        [
            {"id": "a", "text": "A good document about rivers."},
            "{not json",
            "[1, 2]",
            {"id": "b"},
            {"id": "c", "text": "Another good document, about mountains."},
        ],
    )
    with open(path, "ab") as f:
        f.write(b"\n" + json.dumps({"id": "d", "text": "A third good one."}).encode() + b"\n")
    return path


def test_pipeline_says_how_many_records_it_rejected_and_where(tmp_path, capsys, dask_client):
    corpus = _bad_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "run"
    argv = [
        "pipeline",
        "run",
        "--input",
        str(corpus),
        "--out",
        str(out),
        "--until",
        "ingest",
        "--no-progress",
        "--scheduler",
        dask_client.scheduler.address,
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "4 of 7 records rejected" in printed, printed
    assert "blank_line 1, malformed_json 1, missing_field 1, not_an_object 1" in printed
    assert f"{out}/ingest/rejects.parquet" in printed
    assert pq.read_table(out / "ingest" / "rejects.parquet").num_rows == 4
    assert main(argv) == 0  # a rerun skips the stage and still says so
    printed = capsys.readouterr().out
    assert "up to date" in printed and "4 of 7 records rejected" in printed


def test_all_rejected_names_a_file_that_exists(tmp_path, capsys, dask_client):
    corpus = write_jsonl(tmp_path / "c.jsonl", ["{bad", "[1]"])
    assert (
        main(
            [
                "pipeline",
                "run",
                "--input",
                str(corpus),
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
    assert "all 2 records were rejected" in err
    named = Path(err.split("see ")[1].split()[0])
    assert named.name == "rejects.parquet" and named.is_file(), err


# ------------------------------------------------------------- item 10: globs, nothing half-written
def test_readme_glob_inputs_are_expanded_in_order(tmp_path, capsys, dask_client, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    write_jsonl(
        tmp_path / "data" / "b.jsonl", [{"id": "b1", "text": "Second file, about bridges."}]
    )
    write_jsonl(tmp_path / "data" / "a.jsonl", [{"id": "a1", "text": "First file, about anchors."}])
    write_jsonl(tmp_path / "data" / "skip.txt.bak", ["not matched"])
    (tmp_path / "empty").mkdir()
    paper = str(REPO / "pipeline" / "yamls" / "paper.yaml")
    sched = ["--scheduler", dask_client.scheduler.address, "--no-progress"]
    assert (
        main(
            [
                "pipeline",
                "run",
                paper,
                "ingest.inputs=[data/*.jsonl]",
                "out=runs/paper",
                "--until",
                "ingest",
                *sched,
            ]
        )
        == 0
    )
    stats = json.loads((tmp_path / "runs/paper/ingest/_stage.json").read_text())["stats"]
    assert stats["units"] == 2 and stats["kept"] == 2
    docs = [
        d
        for part in stats["parts"]
        for d in pq.read_table(tmp_path / "runs/paper/ingest" / part["file"]).to_pylist()
    ]
    assert [d["doc_id"] for d in docs] == ["a1", "b1"]
    assert [Path(d["source"]) for d in docs] == [
        tmp_path / "data/a.jsonl",
        tmp_path / "data/b.jsonl",
    ]
    # a pattern matching nothing, or a missing file: named, and the run folder is not created
    for bad, named in (
        ("ingest.inputs=[nodata/*.jsonl]", "no file matches the pattern nodata/*.jsonl"),
        ("ingest.inputs=[data/missing.jsonl]", "input not found: data/missing.jsonl"),
        ("ingest.inputs=[empty]", "input directory is empty: "),
    ):
        capsys.readouterr()
        assert (
            main(["pipeline", "run", paper, bad, "out=runs/bad", "--until", "ingest", *sched]) == 1
        )
        assert named in _err(capsys)
        assert not (tmp_path / "runs" / "bad").exists()


def test_a_missing_tokenizer_is_named_before_anything_runs(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "one document"}])
    out = tmp_path / "run"
    assert (
        main(
            [
                "pipeline",
                "run",
                "--input",
                str(corpus),
                "--out",
                str(out),
                "--tokenizer",
                str(tmp_path / "nope"),
                "--no-progress",
            ]
        )
        == 1
    )
    err = _err(capsys)
    assert f"window.tokenizer={tmp_path / 'nope'}: no tokenizer.json" in err
    assert not out.exists()  # ingest did not run first, and no config.json was written


def test_docs_corpus_names_its_rejects_file_and_a_missing_deb(tmp_path, capsys):
    from tests.test_debdocs import PREFIX, _page, make_deb

    deb = make_deb(
        tmp_path / "pkg_1.0_all.deb",
        {PREFIX + "a.rst.txt": _page(1), PREFIX + "b.rst.txt": b"short"},
    )
    out = tmp_path / "docs"
    base = [
        "pipeline",
        "docs-corpus",
        str(out),
        "--package",
        "pkg",
        "--prefix",
        PREFIX,
        "--suffix",
        ".rst.txt",
    ]
    assert main([*base, "--deb", str(deb)]) == 0
    assert f"1 rejected (each with its reason in {out / 'rejects.jsonl'})" in _err(capsys)
    assert main([*base, "--deb", str(tmp_path / "nope.deb")]) == 1
    err = _err(capsys)
    assert "--deb" in err and "nope.deb" in err and "Errno" not in err
    empty = make_deb(tmp_path / "other_1.0_all.deb", {"usr/share/doc/other/a.txt": b"x"})
    assert (
        main(
            [
                "pipeline",
                "docs-corpus",
                str(tmp_path / "docs2"),
                "--package",
                "pkg",
                "--prefix",
                PREFIX,
                "--suffix",
                ".rst.txt",
                "--deb",
                str(empty),
            ]
        )
        == 1
    )
    assert not (tmp_path / "docs2").exists()
    # several packages: a .deb no --package names, and --prefix with more than one package, are
    # refused
    assert (
        main(
            [
                "pipeline",
                "docs-corpus",
                str(tmp_path / "docs3"),
                "--package",
                "python3.11-doc",
                "--deb",
                str(deb),
            ]
        )
        == 1
    )
    assert "--deb holds package(s) ['pkg'], which no --package names" in _err(capsys)
    assert (
        main(
            [
                "pipeline",
                "docs-corpus",
                str(tmp_path / "docs3"),
                "--package",
                "python3.11-doc",
                "--package",
                "linux-doc-6.1",
                "--prefix",
                PREFIX,
            ]
        )
        == 1
    )
    assert "--prefix / --suffix apply to one package" in _err(capsys)
    # the README records the command that rebuilds the corpus
    assert (
        f"memtree pipeline docs-corpus {out} --package pkg --prefix {PREFIX} --suffix .rst.txt"
        in (out / "README.md").read_text()
    )


# ---------------------------------------------------------------- item 13: keys named, no raw errno
def test_time_strings_are_checked_with_the_key_named(tmp_path, capsys):
    yaml = str(REPO / "training" / "yamls" / "tiny-baseline.yaml")
    for bad, key in (
        ("max_duration=abc", "max_duration"),
        ("optim.warmup=1.5ba", "optim.warmup"),
        ("save_interval=often", "save_interval"),
        ("log_interval=1x", "log_interval"),
    ):
        assert (
            main(
                [
                    "train",
                    "run",
                    yaml,
                    f"data.shards={tmp_path}",
                    f"save_folder={tmp_path / 's'}",
                    bad,
                ]
            )
            == 1
        )
        err = _err(capsys)
        assert f"{key}: " in err and "100ba" in err and "2ep" in err, err
        assert "Invalid time string" not in err
    from memtree.training.config import load_train_config

    cfg = load_train_config(
        None, ["data.shards=x", "max_duration=2ep", "optim.warmup=0.1dur", "save_interval=1e3ba"]
    )
    assert (cfg.max_duration, cfg.optim.warmup, cfg.save_interval) == ("2ep", "0.1dur", "1e3ba")


def test_train_names_missing_shards_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "run"]) == 1
    err = _err(capsys)
    assert "memtree train run CONFIG.yaml" in err and "composer -n" not in err
    assert main(["train", "run", str(REPO / "training" / "yamls" / "tiny-baseline.yaml")]) == 1
    err = _err(capsys)
    assert (
        "data.shards=runs/demo/pipeline/shards: no manifest.json" in err
        and "memtree pipeline" in err
    )
    assert not (tmp_path / "runs").exists()


def _looks_like_a_run(run: Path) -> None:
    """The two files that make a folder pass for a finished run (so the next check is reached)."""
    run.mkdir(parents=True)
    (run / "memtree_config.json").write_text("{}")
    (run / "anchor.safetensors").write_bytes(b"")


def test_finetune_names_the_key_the_path_and_what_writes_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yaml = str(REPO / "training" / "yamls" / "finetune-sparse.yaml")
    assert main(["train", "finetune", yaml]) == 1
    err = _err(capsys)
    assert "run=runs/demo/train/pkm: not a finished training run" in err and "Errno" not in err
    _looks_like_a_run(tmp_path / "runs/demo/train/pkm")
    assert main(["train", "finetune", yaml]) == 1
    err = _err(capsys)
    assert (
        "data=runs/demo/continual/stream.jsonl: no such file" in err
        and "memtree eval continual" in err
    )
    (tmp_path / "runs/demo/continual").mkdir()
    write_jsonl(tmp_path / "runs/demo/continual/stream.jsonl", [{"id": "1", "texts": ["a fact"]}])
    assert main(["train", "finetune", yaml, "background=runs/demo/bg"]) == 1
    err = _err(capsys)
    assert (
        "background=runs/demo/bg: no such folder" in err
        and "memtree train finetune-background" in err
    )
    assert main(["train", "finetune-background", "nope"]) == 1
    assert "RUN=nope: not a finished training run" in _err(capsys)
    assert not (tmp_path / "runs/demo/finetune").exists()


# ------------------------------------------------ item 11: a failed start does not poison the retry
def test_failed_start_leaves_the_save_folder_usable(pipeline_run, tmp_path, capsys, monkeypatch):
    from safetensors.torch import save_file
    from streaming.base.util import clean_stale_shared_memory

    from memtree.training.config import load_train_config
    from memtree.training.train import build_model

    shards = pipeline_run[0] / "shards"  # a 2-level tree
    # the tiny anchor, untrained
    model, _ = build_model(load_train_config(None, [f"data.shards={shards}"]))
    (tmp_path / "base").mkdir()
    save_file(
        {k: v.clone() for k, v in model.model.state_dict().items()},
        str(tmp_path / "base/anchor.safetensors"),
    )
    yaml = str(REPO / "training" / "yamls" / "tiny-cotrain.yaml")
    folder = tmp_path / "cotrain"
    args = [
        "train",
        "run",
        yaml,
        f"data.shards={shards}",
        f"save_folder={folder}",
        f"anchor_checkpoint={tmp_path / 'base'}",
    ]
    assert main(args) == 1
    assert "memory.multipliers: 3 levels, but the shards' tree has 2" in _err(capsys)
    assert not (folder / "memtree_config.json").exists()
    # the corrected rerun is not refused (a 1-batch run, to keep the test short)
    clean_stale_shared_memory()
    try:
        assert (
            main([*args, "memory.multipliers=[64,32]", "max_duration=1ba", "data.batch_size=2"])
            == 0
        ), _err(capsys)
    finally:
        clean_stale_shared_memory()
    assert (folder / "anchor.safetensors").is_file() and (folder / "bank").is_dir()


def test_config_files_alone_do_not_claim_a_save_folder(tmp_path):
    from memtree.config import ConfigError
    from memtree.training.config import load_train_config
    from memtree.training.train import check_save_folder

    folder = tmp_path / "s"
    a = load_train_config(None, ["data.shards=x", f"save_folder={folder}", "optim.lr=0.1"])
    b = load_train_config(None, ["data.shards=x", f"save_folder={folder}", "optim.lr=0.2"])
    check_save_folder(a)  # what a start that then failed left (before the fix: every failed start)
    check_save_folder(b)  # taken over: nothing was trained there
    assert (
        json.loads((folder / "memtree_config.json").read_text())["fingerprint"] == b.fingerprint()
    )
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "ep0-ba1-rank0.pt").write_bytes(b"x")
    with pytest.raises(
        ConfigError, match=r"save_folder=.*checkpoints of another config \(checkpoints/.*optim.lr"
    ):
        check_save_folder(a)


def test_train_context_vae_names_keys_and_producers(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yaml = str(REPO / "training" / "yamls" / "context-vae.yaml")
    assert main(["train", "context-vae", yaml, "max_duration=abc"]) == 1
    err = _err(capsys)
    assert "max_duration: 'abc' is not a time string" in err and "100ba" in err
    assert main(["train", "context-vae", yaml]) == 1
    err = _err(capsys)
    assert (
        "anchor=runs/demo/train/anchor: not a finished training run" in err and "Errno" not in err
    )
    _looks_like_a_run(tmp_path / "runs/demo/train/anchor")
    assert main(["train", "context-vae", yaml]) == 1
    assert "data.pairs=runs/demo/context-bank/pairs.jsonl: no such file" in _err(capsys)
    assert not (tmp_path / "runs/demo/context-bank").exists()


def test_pipeline_without_a_run_directory_says_which_flag(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "one document"}])
    assert main(["pipeline", "run", "--input", str(corpus)]) == 1
    assert "give --out RUN" in _err(capsys)


def test_context_vae_time_strings_checked_from_python(tmp_path):
    # issue 36: the compressor's duration / interval / warmup keys are TimeStrings, so a config
    # built in Python (not through `memtree train context-vae`) names the key too, before a Trainer
    # is built
    from memtree.config import ConfigError
    from memtree.training.context.train import (
        ContextDataSection,
        ContextTrainConfig,
        load_context_config,
    )

    yaml = str(REPO / "training" / "yamls" / "context-vae.yaml")
    for key in ("max_duration", "warmup", "save_interval", "log_interval"):
        with pytest.raises(ConfigError, match=f"{key}: '3 epochs' is not a time string"):
            load_context_config(yaml, [f"{key}=3 epochs"])
    with pytest.raises(ConfigError, match="warmup: '20' is not a time string"):
        ContextTrainConfig(
            anchor=str(tmp_path),
            data=ContextDataSection(pairs="p.jsonl"),
            save_folder=str(tmp_path / "vae"),
            warmup="20",
        )
    assert load_context_config(yaml, ["max_duration=3ba"]).max_duration == "3ba"


# ------------------------------------------------------------------ one command tree
def _subcommands(parser) -> dict:
    import argparse

    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_one_command_tree_a_few_verbs_one_name_each(capsys):
    """`memtree --help` lists the main job and four verbs and fits a screen; every verb has its
    subcommands, each name once; the source-tree fallback lists the same registrars as pyproject."""
    import tomllib

    from memtree.cli import _FALLBACK, ORDER, VERBS

    parser = build_parser()
    top = _subcommands(parser)
    assert sorted(top) == sorted(ORDER) and ORDER == (
        "demo",
        "generate",
        "pipeline",
        "train",
        "eval",
        "memstore",
    )
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 24 and max(map(len, text.splitlines())) <= 80, text
    listed = [
        line.split()[0]
        for line in text.splitlines()
        if line.startswith("    ") and not line.startswith("     ")
    ]
    assert listed == list(ORDER), text
    names = {verb: sorted(_subcommands(top[verb])) for verb in VERBS}
    assert names["pipeline"] == ["demo", "demo-corpus", "docs-corpus", "run"]
    assert names["train"] == ["context-vae", "finetune", "finetune-background", "run"]
    assert names["eval"] == sorted(
        [
            "knowledge",
            "sweep",
            "retention",
            "tasks",
            "memories",
            "realtext",
            "longctx",
            "context-bank",
            "continual",
            "adapters",
        ]
    )
    assert {
        "plan",
        "init",
        "info",
        "verify",
        "fetch",
        "block",
        "calibrate",
        "simulate-fetch",
    } <= set(names["memstore"])
    # a verb alone prints its subcommands (exit 2: nothing ran)
    assert main(["eval"]) == 2 and "knowledge" in capsys.readouterr().out
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][
        "memtree.commands"
    ]
    assert sorted(f"{v.split(':')[0]}" for v in eps.values()) == sorted(_FALLBACK)


def test_a_stage_cannot_add_a_top_level_command_or_an_unknown_verb():
    import argparse

    from memtree.cli import Commands

    cli = Commands(argparse.ArgumentParser().add_subparsers())
    with pytest.raises(ValueError, match="no verb 'evaluate'"):
        cli.verb("evaluate")
    with pytest.raises(ValueError, match="under one of the verbs"):
        cli.command("eval-memories")
