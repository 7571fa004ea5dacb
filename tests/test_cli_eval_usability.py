"""Issue 36, the eval commands as a new user runs them: each test runs the command through
`memtree.cli.main` on real files.

The runs here are laid out as `memtree demo` lays them out, with the paths stored the way the
demo stores them (relative to the directory training ran in): ROOT/pipeline/{shards,tree},
ROOT/facts.jsonl, ROOT/heldout.jsonl, ROOT/train/anchor (baseline) and ROOT/train/cotrain (a bank
at level 2 only, started from the anchor). Tests run from the repository root, so every command
here also evaluates a run whose stored paths do not resolve from the current directory."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from memtree.cli import main
from tests.conftest import train_tiny_run

REPO = Path(__file__).resolve().parents[1]
SHAPE = "model.shape={n_layers: 1, d_model: 32, n_heads: 1, head_dim: 32, ffn_dim: 64}"
ANCHOR_BA, COTRAIN_BA, BATCH = 2, 4, 4


def copy_pipeline(src: Path, dst: Path) -> None:
    """What a run reads of a pipeline run: the shards, their tokenizer (the manifest names
    ../tokenizer), the tree and its query embedder (the tree names ../embed/embedder)."""
    for part in ("shards", "tokenizer", "tree", "embed/embedder"):
        shutil.copytree(src / part, dst / part)


@pytest.fixture(scope="module")
def demo(pipeline_run, tmp_path_factory):
    """(base dir, ROOT): a demo-shaped root whose runs store paths relative to base."""
    from memtree.pipeline.corpus.topical import CorpusSpec, entity_facts

    base = tmp_path_factory.mktemp("usability")
    root = base / "demo"
    copy_pipeline(pipeline_run[0], root / "pipeline")
    # tests/conftest.py's corpus
    facts = entity_facts(CorpusSpec(n_docs=1200, seed=3, long_doc_fraction=0.01))
    (root / "facts.jsonl").write_text("".join(json.dumps(f) + "\n" for f in facts))
    (root / "heldout.jsonl").write_text(
        "".join(
            json.dumps({"text": f"The {f['label']} of {f['reference']} is {f['value']}."}) + "\n"
            for f in facts[:6]
        )
    )
    cwd = os.getcwd()
    os.chdir(base)  # as `memtree demo` stores them: relative to where training ran
    try:
        common = [f"data.batch_size={BATCH}", SHAPE]
        train_tiny_run(
            Path("demo/pipeline/shards"),
            Path("demo/train/anchor"),
            *common,
            "mode=baseline",
            "memory.multipliers=[]",
            f"max_duration={ANCHOR_BA}ba",
        )
        train_tiny_run(
            Path("demo/pipeline/shards"),
            Path("demo/train/cotrain"),
            *common,
            "mode=cotrain",
            "anchor_checkpoint=demo/train/anchor",
            "memory.multipliers=[0,8]",
            "memory.lr=3e-2",
            f"max_duration={COTRAIN_BA}ba",
        )
    finally:
        os.chdir(cwd)
    return base, root


def _samples(root: Path) -> int:
    manifest = json.loads((root / "pipeline" / "shards" / "manifest.json").read_text())
    return sum(s["n_samples"] for s in manifest["streams"])


def test_eval_blocks_the_banks_shallowest_level_and_takes_epochs_and_held_out_from_the_run(
    demo, tmp_path, capsys
):
    """Items 1, 2, 12: --block-domains without --block-level on a bank without level-1 memory; the
    epochs (anchor + co-training) and held-out documents come from the run; the stored paths are
    relative to another directory."""
    _, root = demo
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "knowledge",
                str(root / "train" / "cotrain"),
                "--max-probes",
                "8",
                "--block-domains",
                "astronomy",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert data["blocking"]["level"] == 2 and data["blocking"]["fraction"] == pytest.approx(1 / 64)
    epochs = (ANCHOR_BA + COTRAIN_BA) * BATCH / _samples(root)
    assert (
        data["meta"]["epochs"] == pytest.approx(epochs) and "anchor" in data["meta"]["epochs_from"]
    )
    assert f"facts: {root / 'facts.jsonl'}" in err and "heldout.jsonl" in err
    assert all("perplexity" in row for row in data["knowledge"]["modes"].values())
    assert "bank" not in data  # nothing blocked on disk


def test_eval_refuses_a_block_level_without_memory_before_scoring(demo, capsys):
    _, root = demo
    t0 = time.time()
    assert (
        main(
            [
                "eval",
                "knowledge",
                str(root / "train" / "cotrain"),
                "--block-domains",
                "astronomy",
                "--block-level",
                "1",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "--block-level 1" in err and "[2]" in err and "--block-level 2" in err
    assert "epochs" not in err and time.time() - t0 < 30  # failed before the facts were read
    assert (
        main(
            ["eval", "knowledge", str(root / "train" / "cotrain"), "--block-domains", "astronomyy"]
        )
        == 1
    )
    assert "--block-domains: ['astronomyy'] are not domains of" in capsys.readouterr().err
    assert main(["eval", "knowledge", str(root / "train" / "cotrain"), "--block-level", "2"]) == 1
    assert "--block-domains" in capsys.readouterr().err
    assert (
        main(
            [
                "eval",
                "knowledge",
                str(root / "train" / "cotrain"),
                "--facts",
                str(root / "nope.jsonl"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "--facts" in err and "Errno" not in err


def test_a_copied_run_is_evaluated_with_tree_flag_and_its_blocked_blocks_are_reported(
    demo, tmp_path, capsys
):
    """Items 12 and 2: the whole demo root copied elsewhere, its tree missing (given by --tree), a
    block of its bank blocked on disk (memstore's policy and audit log)."""
    from memtree.memstore.store import MemoryStore

    _, root = demo
    copy = tmp_path / "elsewhere" / "demo"
    shutil.copytree(root, copy)
    shutil.rmtree(copy / "pipeline" / "tree")
    run = copy / "train" / "cotrain"
    with MemoryStore(run / "bank") as store:
        store.block(2, [3], reason="privacy request")
    # the tree is what is missing
    assert main(["eval", "knowledge", str(run), "--max-probes", "4"]) == 1
    err = capsys.readouterr().err
    assert "--tree" in err and "data.shards" in err and str(run / "memtree_config.json") in err
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "knowledge",
                str(run),
                "--tree",
                str(root / "pipeline" / "tree"),
                "--max-probes",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    # the copy's layout, not the original's
    assert f"facts: {copy / 'facts.jsonl'}" in capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert (
        data["bank"]["blocked"] == {"2": [[3, 4]]}
        and data["bank"]["audit"][-1]["reason"] == "privacy request"
    )
    report = (out / "report.md").read_text()
    assert "## Blocked memory in the evaluated bank" in report and "level 2: 3 (1 blocks)" in report
    # the run alone, away from its pipeline run: the error names the stored key and the file
    alone = tmp_path / "alone" / "cotrain"
    shutil.copytree(root / "train" / "cotrain", alone)
    assert main(["eval", "knowledge", str(alone), "--max-probes", "4"]) == 1
    err = capsys.readouterr().err
    assert (
        "data.shards = 'demo/pipeline/shards'" in err and str(alone / "memtree_config.json") in err
    )


def test_eval_tasks_from_another_folder_resolves_task_paths_against_the_yaml(
    demo, tmp_path, monkeypatch, capsys
):
    _, root = demo
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "suite"
    assert (
        main(
            [
                "eval",
                "tasks",
                str(REPO / "eval" / "yamls" / "suite-example.yaml"),
                str(root / "train" / "cotrain"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads((out / "results.json").read_text())["tasks"]["everyday-qa"]["n"] == 5
    bad = tmp_path / "suite.yaml"
    bad.write_text(
        "tasks:\n  - {name: qa, type: multiple_choice, path: missing.jsonl, group: common}\n"
    )
    assert main(["eval", "tasks", str(bad), str(root / "train" / "cotrain")]) == 1
    err = capsys.readouterr().err
    assert "tasks[0].path" in err and str(bad) in err and "Errno" not in err
    assert (
        main(["eval", "tasks", str(tmp_path / "none.yaml"), str(root / "train" / "cotrain")]) == 1
    )
    err = capsys.readouterr().err
    assert "SUITE" in err and "Errno" not in err


def test_eval_longctx_refuses_a_group_by_key_the_records_lack(tmp_path, capsys):
    from tests.test_eval_longctx import _tiny_run

    run = _tiny_run(tmp_path)
    docs = tmp_path / "d.jsonl"
    docs.write_text(
        json.dumps({"id": "a", "text": "the red star"})
        + "\n"
        + json.dumps({"id": "b", "text": "a moon"})
    )
    args = [
        "eval",
        "longctx",
        str(run),
        "--docs",
        str(docs),
        "--method",
        "base",
        "--window",
        "4",
        "--no-ablations",
    ]
    assert main([*args, "--group-by", "domain", "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "--group-by domain" in err and "record 1 (id 'a')" in err and str(docs) in err
    assert not (tmp_path / "x").exists()
    # not given, and no record has a topic: every record alone, and the report says so
    assert main([*args, "--out", str(tmp_path / "y")]) == 0
    data = json.loads((tmp_path / "y" / "results.json").read_text())
    assert data["meta"]["group_by"] is None and data["longctx"]["docs"]["n_docs"] == 2
    assert main([*args, "--docs", str(tmp_path / "none.jsonl")]) == 1
    assert "--docs" in capsys.readouterr().err


CONTINUAL = """root: {root}
pretrain: [data.batch_size=2, max_duration=2ba, "{shape}", model.pkm.n_keys={n_keys},
           model.pkm.heads=1, model.pkm.k=2, model.pkm.key_dim=8, "model.pkm.layers=[0]"]
background_batches: 2
n_facts: {n_facts}
paraphrases: 2
old_probes: 4
held_out_docs: 2
runs: [{{method: full, lr: 1.0e-4}}]
block_runs: []
"""


def test_eval_continual_reuses_the_pretrained_model_only_from_the_same_inputs(
    demo, tmp_path, capsys
):
    """Item 7 and 14: changed `pretrain:` settings retrain ROOT/train/pkm; the same ones reuse it;
    --out is the report folder, and out= (the config's key) the same, without a note."""
    from memtree.pipeline.corpus.bios import BiosSpec, write_bios

    _, demo_root = demo
    root = tmp_path / "bios"
    write_bios(root, BiosSpec(entities_per_subtopic=2), heldout_docs=4)
    copy_pipeline(demo_root / "pipeline", root / "pipeline")

    def config(n_keys: int, n_facts: int) -> str:
        path = tmp_path / f"c{n_keys}-{n_facts}.yaml"
        path.write_text(CONTINUAL.format(root=root, shape=SHAPE, n_keys=n_keys, n_facts=n_facts))
        return str(path)

    pkm = root / "train" / "pkm"
    out = tmp_path / "out"
    assert main(["eval", "continual", str(root), "--config", config(4, 2), "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["run_action"] == "trained" and "trained" in (out / "report.md").read_text()
    assert "training" in capsys.readouterr().out
    # n_keys 4 → 8: retrained (the command then stops at n_facts, after the pretraining step)
    too_many = 10**6
    assert (
        main(["eval", "continual", str(root), "--config", config(8, too_many), "--out", str(out)])
        == 1
    )
    cap = capsys.readouterr()
    assert (
        "was trained from other inputs (config changed), retraining" in cap.out
        and "n_facts" in cap.err
    )
    assert (
        json.loads((pkm / "memtree_config.json").read_text())["config"]["model"]["pkm"]["n_keys"]
        == 8
    )
    mtime = (pkm / "anchor.safetensors").stat().st_mtime_ns
    assert (
        main(["eval", "continual", str(root), "--config", config(8, too_many), f"out={out}"]) == 1
    )
    cap = capsys.readouterr()
    assert (
        "already trained from these inputs" in cap.out
        and (pkm / "anchor.safetensors").stat().st_mtime_ns == mtime
    )
    assert "deprecated" not in cap.err
    assert main(["eval", "continual", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert "corpus.json" in err and "Errno" not in err


def test_eval_context_bank_reuses_the_compressor_only_from_the_same_inputs(tmp_path, capsys):
    """Paper cut: `--train` settings changed, or the anchor retrained, used to reuse OUT/vae
    anyway."""
    from tests.test_context_vae import _tiny_bios_run

    root = _tiny_bios_run(tmp_path / "demo")
    out = tmp_path / "cb"
    small = ["n_entities=4", "sessions=1", "capacities=[1.0]", "n_clusters=2", "train_worlds=1"]
    train = [
        "--train",
        "data.batch_size=4",
        "--train",
        "vae.chunk_tokens=64",
        "--train",
        "vae.hidden=16",
        "--train",
        "vae.reader_heads=2",
    ]

    def run(steps: int) -> tuple[str, dict]:
        assert (
            main(
                [
                    "eval",
                    "context-bank",
                    str(root),
                    *small,
                    "--train",
                    f"max_duration={steps}ba",
                    *train,
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        return capsys.readouterr().out, json.loads((out / "vae" / "context_vae.json").read_text())

    text, vae = run(1)
    assert "compressor: training (1ba)" in text and vae["metrics"]["steps"] == 1
    assert json.loads((out / "results.json").read_text())["compressor_action"] == "trained"
    text, vae = run(2)  # --train changed: retrained
    assert "retraining" in text and "config changed" in text and vae["metrics"]["steps"] == 2
    assert json.loads((out / "results.json").read_text())["compressor_action"] == "retrained"
    weights = (out / "vae" / "context_vae.safetensors").stat().st_mtime_ns
    text, _ = run(2)  # the same inputs: reused
    assert (
        "compressor: reused" in text
        and (out / "vae" / "context_vae.safetensors").stat().st_mtime_ns == weights
    )
    assert "Compressor: reused" in (out / "report.md").read_text()
    # the anchor retrained (other weights): the compressor is retrained for it, not refused or
    # reused
    from safetensors.torch import load_file, save_file

    anchor = root / "train" / "anchor" / "anchor.safetensors"
    save_file(
        {k: v + 0.01 if v.is_floating_point() else v for k, v in load_file(str(anchor)).items()},
        str(anchor),
    )
    text, _ = run(2)
    assert "retraining" in text and "anchor changed" in text
    assert json.loads((out / "results.json").read_text())["compressor_action"] == "retrained"


def test_eval_retention_resolves_a_moved_runs_shards_and_names_the_tree_key(demo, tmp_path, capsys):
    """Paper cut: `eval retention` read `data.shards` as stored (relative to where training ran),
    and its missing-tree error said `--tree` where the command's key is `tree=`."""
    _, root = demo
    copy = tmp_path / "elsewhere" / "demo"
    shutil.copytree(root, copy)
    shutil.rmtree(copy / "pipeline" / "tree")
    run = copy / "train" / "cotrain"
    args = [
        "eval",
        "retention",
        f"run={run}",
        f"facts={copy / 'facts.jsonl'}",
        "steps=1",
        "max_probes=4",
        "--out",
        str(tmp_path / "ret"),
    ]
    assert main(args) == 1  # the shards resolve under the copy; the tree is what is missing
    err = capsys.readouterr().err
    assert "pass tree=DIR" in err and "--tree" not in err and "Errno" not in err
    assert not (tmp_path / "ret" / "continued").exists()  # refused before training
    assert main([*args, f"tree={root / 'pipeline' / 'tree'}"]) == 0
    res = json.loads((tmp_path / "ret" / "results.json").read_text())
    assert res["continued"]["status"] == "trained" and res["n_probes"] == 4
    stored = json.loads((tmp_path / "ret" / "continued" / "memtree_config.json").read_text())[
        "config"
    ]
    assert Path(stored["data"]["shards"]) == copy / "pipeline" / "shards"


def test_eval_sweep_resolves_eval_paths_against_the_yaml(demo, tmp_path, monkeypatch, capsys):
    """Paper cut: a sweep YAML's `eval.facts` / `eval.held_out` / `eval.tree` resolved against the
    current folder only; now against the YAML first, and a missing one is named by key and YAML."""
    _, root = demo
    folder = tmp_path / "sweeps"
    folder.mkdir()
    shutil.copy(root / "facts.jsonl", folder / "facts.jsonl")
    shutil.copytree(root / "pipeline" / "tree", folder / "tree")
    # the tree's embedder
    shutil.copytree(root / "pipeline" / "embed" / "embedder", folder / "embed" / "embedder")
    tiny = [
        "mode=scratch",
        "memory.multipliers=[0,8]",
        f"data.batch_size={BATCH}",
        "max_duration=1ba",
        "optim.warmup=1ba",
        "memory.export_dtype=fp32",
        SHAPE,
        f"data.shards={root / 'pipeline' / 'shards'}",
    ]
    body = (
        "name: t\nsettings: [{name: one}]\ntrain: " + json.dumps(tiny) + "\n"
        "eval: {facts: facts.jsonl, tree: tree, max_probes: 4%s}\n"
    )
    good, bad = folder / "sweep.yaml", folder / "bad.yaml"
    good.write_text(body % "")
    bad.write_text(body % ", held_out: missing.jsonl")
    monkeypatch.chdir(tmp_path)  # not the YAML's folder
    assert main(["eval", "sweep", str(bad), "--out", str(tmp_path / "s")]) == 1
    err = capsys.readouterr().err
    assert f"eval.held_out in {bad}: missing.jsonl" in err and "relative to the sweep YAML" in err
    assert "Errno" not in err and not (tmp_path / "s").exists()
    assert main(["eval", "sweep", "sweeps/sweep.yaml", "--out", str(tmp_path / "s")]) == 0
    data = json.loads((tmp_path / "s" / "results.json").read_text())
    assert [r["status"] for r in data["runs"]] == ["trained"]
    # an override is the user's own path: relative to the current folder, named as an override
    assert (
        main(["eval", "sweep", str(good), "eval.facts=facts.jsonl", "--out", str(tmp_path / "s")])
        == 1
    )
    assert "eval.facts (override): facts.jsonl: no such file" in capsys.readouterr().err


def test_the_readmes_generate_line_runs_on_a_demo_shaped_run(demo, capsys):
    """README: `memtree generate runs/demo/train/cotrain --prompt "…"` after make demo, here on a
    demo-shaped run whose stored paths resolve only relative to the run folder."""
    _, root = demo
    assert (
        main(
            [
                "generate",
                str(root / "train" / "cotrain"),
                "--prompt",
                "The birthplace of Ilsa Varn is",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "answer (fetched memory" in out and "fetch L2" in out and "first token after" in out
