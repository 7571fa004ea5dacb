"""training/finetune/continual.py, training/finetune/lora.py and eval/finetune/continual.py: each
finetuning method changes what it should and nothing else (sparse memory finetuning: exactly the
top-t value rows, bit for bit; LoRA: only the adapted projections once merged; full: everything),
background counts are collected from real MDS shards and stored with the checkpoint,
`memtree train finetune` runs a JSONL stream end to end on a real Composer-trained memory-layer run,
bad input gets errors naming the value, and the continual-learning report is written."""

from __future__ import annotations

import json

import pytest
import torch

from memtree.geometry import AnchorShape
from memtree.training.finetune.continual import (
    Finetuner,
    FinetuneSpec,
    batch_tensors,
    changes,
    snapshot,
)
from memtree.training.finetune.lora import LoRALinear, add_lora, merge_lora
from memtree.training.finetune.slots import BackgroundCounts, access_counts, recording
from memtree.training.layers.pkm import PKMConfig
from memtree.training.model import AnchorLM, ModelConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ANCHOR = AnchorShape(
    name="t", n_layers=3, d_model=16, n_heads=2, head_dim=8, ffn_dim=32, vocab_size=50
)


def _model(pkm: bool = True) -> AnchorLM:
    torch.manual_seed(0)
    return AnchorLM(
        ModelConfig(
            anchor=ANCHOR,
            max_seq_len=64,
            pkm=PKMConfig(n_keys=16, heads=2, k=4, key_dim=8) if pkm else None,
        )
    )


def _batch(seed: int = 1, lengths=(9, 5, 1 + 1, 7)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    texts = [
        " ".join(str(int(t)) for t in torch.randint(3, 50, (n,), generator=g)) for n in lengths
    ]
    return batch_tensors(texts, lambda t: [int(w) for w in t.split()], pad_id=0, max_len=64)


def _background(model: AnchorLM, n: int = 4) -> dict[int, BackgroundCounts]:
    bg = BackgroundCounts.empty(model.blocks[1].pkm.cfg.n_slots)
    with torch.no_grad(), recording(model) as logs:
        for s in range(n):
            ids, real = _batch(100 + s, lengths=(12, 12))
            model(ids)
            bg.add_batch(access_counts(logs[1][-1], bg.doc_freq.numel(), real))
    return {1: bg}


def test_sparse_memory_step_moves_exactly_the_top_t_rows_and_nothing_else():
    model = _model()
    bg = _background(model)
    before = snapshot(model)
    ids, real = _batch()
    with torch.no_grad(), recording(model) as logs:
        model(ids)
    counts = access_counts(logs[1][-1], 256, real)
    ft = Finetuner(model, FinetuneSpec(method="sparse_memory", top_t=7, lr=5.0), background=bg)
    rec = ft.step(ids, real)
    ft.finish()
    assert rec["layer_1"] == {"accessed": int((counts > 0).sum()), "trained": 7}
    ch = changes(before, model)
    assert set(ch["tensors"]) == {"blocks.1.pkm.values.weight"}  # every other tensor bit-identical
    moved = (model.blocks[1].pkm.values.weight != before["blocks.1.pkm.values.weight"]).any(1)
    assert int(moved.sum()) == 7 and bool((counts[moved] > 0).all())  # accessed rows only
    # the same rows the TF-IDF ranking picks from this batch's counts (padding not counted)
    from memtree.training.finetune.slots import trainable_rows

    assert torch.equal(moved, trainable_rows(counts, bg[1].doc_freq, bg[1].n_batches, 7))


def test_padding_is_not_counted_as_a_memory_access():
    model = _model()
    ids, real = _batch(lengths=(3, 9))
    with torch.no_grad(), recording(model) as logs:
        model(ids)
    masked = access_counts(logs[1][-1], 256, real)
    assert int(masked.sum()) == int(real.sum()) * 2 * 4  # tokens × heads × k
    assert int(access_counts(logs[1][-1], 256).sum()) == ids.numel() * 2 * 4


def test_tf_and_all_rankings():
    model = _model()
    ids, real = _batch()
    before = snapshot(model)
    rec = Finetuner(model, FinetuneSpec(method="sparse_memory", ranking="all", lr=1.0)).step(
        ids, real
    )
    moved = int(
        (model.blocks[1].pkm.values.weight != before["blocks.1.pkm.values.weight"]).any(1).sum()
    )
    assert rec["layer_1"]["accessed"] == rec["layer_1"]["trained"]
    # slots read only at a sequence's last token get no gradient (nothing after it is predicted)
    assert 0.8 * rec["layer_1"]["accessed"] < moved <= rec["layer_1"]["accessed"]
    model.load_state_dict(before)
    rec = Finetuner(
        model, FinetuneSpec(method="sparse_memory", ranking="tf", top_t=3, lr=1.0)
    ).step(ids, real)
    assert rec["layer_1"]["trained"] == 3


def test_lora_changes_only_the_adapted_projections_and_merges_exactly():
    model = _model()
    before = snapshot(model)
    ids, real = _batch()
    x = model(ids).detach()
    ft = Finetuner(model, FinetuneSpec(method="lora", lora_rank=2, lr=1e-2))
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    # attention q/k/v/o in all 3 blocks, FFN w1/w2/w3 in the 2 blocks that keep an FFN
    assert len(wrapped) == 3 * 4 + 2 * 3
    torch.testing.assert_close(model(ids), x)  # B = 0: the adapted model starts as the base
    for _ in range(3):
        ft.step(ids, real)
    adapted = model(ids).detach()
    ft.finish()
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(model(ids), adapted, rtol=1e-5, atol=1e-5)  # merged = adapted
    changed = set(changes(before, model)["tensors"])
    want = {f"blocks.{i}.attn.{p}.weight" for i in range(3) for p in "qkvo"}
    want |= {f"blocks.{i}.ffn.w{j}.weight" for i in (0, 2) for j in (1, 2, 3)}
    assert changed == want  # embeddings, norms and the memory layer untouched
    assert set(model.state_dict()) == set(before)


def test_lora_targets_attention_only_and_errors():
    model = _model(pkm=False)
    names = add_lora(model, rank=2, alpha=4.0, targets="attention")
    assert len(names) == 3 * 4 and all(".attn." in n for n in names)
    with pytest.raises(TypeError, match="LoRA twice"):
        add_lora(model, rank=2, alpha=4.0, targets="attention")
    assert merge_lora(model) == 12
    with pytest.raises(ValueError, match="LoRA rank 99"):
        add_lora(_model(), rank=99, alpha=1.0)


def test_full_finetuning_changes_every_trained_tensor():
    model = _model()
    before = snapshot(model)
    ids, real = _batch()
    ft = Finetuner(model, FinetuneSpec(method="full", lr=1e-3))
    ft.step(ids, real)
    ft.finish()
    ch = changes(before, model)
    # AdamW with decay moves every dense tensor; the memory's values move on the rows read only
    assert set(ch["tensors"]) == set(before)
    v = ch["tensors"]["blocks.1.pkm.values.weight"]
    assert 0 < v["rows"] < v["of_rows"]
    assert ch["bytes"] == ch["elements"] * 4 and ch["rows"] == sum(
        t["rows"] for t in ch["tensors"].values()
    )


def test_bad_input_names_the_value():
    model = _model()
    with pytest.raises(ValueError, match=r"no background counts for memory layer\(s\) \[1\]"):
        Finetuner(model, FinetuneSpec(method="sparse_memory"))
    with pytest.raises(
        ValueError, match="background counts cover 64 slots, the memory has n_slots=256"
    ):
        Finetuner(
            model, FinetuneSpec(method="sparse_memory"), background={1: BackgroundCounts.empty(64)}
        )
    ids, real = _batch()
    ft = Finetuner(
        model, FinetuneSpec(method="sparse_memory", top_t=100_000), background=_background(model)
    )
    with pytest.raises(
        ValueError, match=r"record 7: layer 1: top_t=100000 exceeds the \d+ slots this batch"
    ):
        ft.step(ids, real, where="record 7")
    with pytest.raises(ValueError, match="needs a model with a memory layer"):
        Finetuner(_model(pkm=False), FinetuneSpec(method="sparse_memory", ranking="all"))
    from memtree.config import ConfigError

    with pytest.raises(ConfigError, match="finetune method='adapter'"):
        FinetuneSpec(method="adapter")
    with pytest.raises(ValueError, match="text 1: 1 token"):
        batch_tensors(["1 2 3", "4"], lambda t: [int(w) for w in t.split()], pad_id=0, max_len=8)


def test_fact_statements_are_deterministic_distinct_and_state_the_fact():
    from memtree.pipeline.corpus.bios import BiosSpec, bios_facts, canonical_clause, fact_statements

    f = bios_facts(BiosSpec())[3]
    a, b = fact_statements(f, 8, seed=1), fact_statements(f, 8, seed=1)
    assert a == b and len(set(a)) == 8
    clause = canonical_clause(f["label"], f["reference"], f["value"]).lower()
    assert all(clause in s.lower() for s in a)
    assert fact_statements(f, 20)[:14] != fact_statements(f, 20)[14:]  # 14 frames, then repeats
    assert len(set(fact_statements(f, 20))) == 14


def test_equal_learning_target_check():
    from memtree.eval.finetune.continual import equal_learning

    def row(m, new, drop, ranking="tfidf"):
        return {
            "method": m,
            "label": f"{m}-{new}",
            "after": {"new_accuracy": new},
            "forgetting": {"old_drop": drop},
            "spec": {"ranking": ranking},
        }

    rows = [
        row("full", 0.9, 30.0),
        row("full", 0.5, 12.0),
        row("lora", 0.6, 8.0),
        row("lora", 0.4, 2.0),
        row("sparse_memory", 0.7, 3.0),
        row("sparse_memory", 0.55, 1.0),
        row("sparse_memory", 0.95, 0.0, ranking="all"),
    ]  # an ablation: not the method
    t = equal_learning(rows, "old_drop")
    assert t["level"] == 0.6  # LoRA's best learning is the level every method reaches
    assert t["best"]["full"]["forgetting"] == 30.0  # full's only configuration learning ≥ 0.6
    assert t["best"]["sparse_memory"]["forgetting"] == 3.0  # the 0.55 one learns too little
    assert t["ratio_vs_full"] == pytest.approx(0.1) and t["met_vs_full"]
    assert t["ratio_vs_lora"] == pytest.approx(3.0 / 8.0) and t["met_vs_lora"]
    rows[2]["forgetting"]["old_drop"] = -1.0  # a baseline that does not forget: no ratio, not "met"
    t = equal_learning(rows, "old_drop")
    assert t["ratio_vs_lora"] is None and t["met_vs_lora"] is None


@pytest.fixture(scope="module")
def pkm_run(pipeline_run, tmp_path_factory):
    """A tiny memory-layer model trained by a real Composer `Trainer.fit` on the pipeline's
    shards."""
    from tests.conftest import train_tiny_run

    folder = tmp_path_factory.mktemp("pkm") / "run"
    return train_tiny_run(
        pipeline_run[0] / "shards",
        folder,
        "mode=baseline",
        "memory.multipliers=[]",
        "data.batch_size=2",
        "max_duration=3ba",
        "model.shape={n_layers: 2, d_model: 32, n_heads: 2, head_dim: 16, ffn_dim: 64}",
        "model.pkm={n_keys: 32, heads: 2, k: 4, key_dim: 8, layers: [1]}",
    )


def test_memtree_finetune_end_to_end(pkm_run, pipeline_run, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file
    from streaming.base.util import clean_stale_shared_memory

    from memtree.cli import main
    from memtree.training.finetune.continual import finetune_summary
    from memtree.training.finetune.slots import background_dir
    from memtree.training.train import load_run

    # a run of its own: no background counts yet
    pkm_run = shutil.copytree(pkm_run, tmp_path / "run")
    stream = tmp_path / "stream.jsonl"
    stream.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"f{i}",
                    "texts": [f"the colour of item {i} is blue", f"item {i} has the colour blue"],
                }
            )
            + "\n"
            for i in range(3)
        )
    )
    out = tmp_path / "ft"
    assert (
        main(
            [
                "train",
                "finetune",
                f"run={pkm_run}",
                f"data={stream}",
                f"save_folder={out}",
                "spec.top_t=4",
            ]
        )
        == 1
    )
    assert "pkm_background/layer_1: no background counts" in capsys.readouterr().err
    clean_stale_shared_memory()
    # the user's command, which says what it collected and where (it printed nothing: issue 36)
    assert (
        main(["train", "finetune-background", str(pkm_run), "--batches", "3", "--batch-size", "2"])
        == 0
    )
    said = capsys.readouterr().out
    assert (
        "over 3 batches collected for 1 memory layer(s)" in said
        and str(background_dir(pkm_run, 1)) in said
    )
    clean_stale_shared_memory()
    folders = {1: background_dir(pkm_run, 1)}
    bg = BackgroundCounts.load(folders[1], n_slots=32 * 32)
    assert (
        bg.n_batches == 3
        and 0 < int((bg.doc_freq > 0).sum()) < 32 * 32
        and int(bg.doc_freq.max()) <= 3
    )
    from memtree.training.data import read_shards_manifest

    seq_len = read_shards_manifest(pipeline_run[0] / "shards")["seq_len"]
    assert 0 < bg.tokens <= 3 * 2 * seq_len and "2 sequence(s) per batch" in bg.source

    assert (
        main(
            [
                "train",
                "finetune",
                f"run={pkm_run}",
                f"data={stream}",
                f"save_folder={out}",
                "spec.top_t=4",
                "spec.lr=3.0",
            ]
        )
        == 0
    )
    rec = finetune_summary(out / "finetune.json")
    assert rec["steps"] == 3 and rec["optimizer"] == "sgd"
    assert all(r["layer_1"]["trained"] == 4 for r in rec["log"])
    assert set(rec["changed"]["tensors"]) == {"blocks.1.pkm.values.weight"}
    rows = rec["changed"]["tensors"]["blocks.1.pkm.values.weight"]["rows"]
    assert 4 <= rows <= 12  # 3 steps × top 4 (a row may be picked twice)
    before, after = (
        load_file(str(pkm_run / "anchor.safetensors")),
        load_file(str(out / "anchor.safetensors")),
    )
    assert all(
        torch.equal(before[k], after[k]) for k in before if k != "blocks.1.pkm.values.weight"
    )
    model, *_ = load_run(out)  # the finetuned folder is a run like any other
    assert model.model.blocks[1].pkm is not None
    assert (out / "pkm_background" / "layer_1" / "background_counts.json").exists()
    capsys.readouterr()
    assert (
        main(["train", "finetune", f"run={pkm_run}", f"data={stream}", f"save_folder={out}"]) == 1
    )
    assert "already holds a finished finetune" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "texts": []}\n')
    assert (
        main(
            [
                "train",
                "finetune",
                f"run={pkm_run}",
                f"data={bad}",
                f"save_folder={tmp_path / 'ft2'}",
            ]
        )
        == 1
    )
    assert "bad.jsonl:1: a record needs 'texts'" in capsys.readouterr().err


def _stream_nll(run, texts: list[str]) -> float:
    from memtree.training.finetune.continual import lm_loss
    from memtree.training.train import load_run

    model, _, manifest, tok = load_run(run)
    ids, real = batch_tensors(
        texts, lambda t: tok.encode(t).ids, pad_id=int(manifest["eot_id"]), max_len=64
    )
    with torch.no_grad():
        return float(lm_loss(model.model.eval()(ids), ids, real))


def test_sparse_memory_finetuning_lowers_the_loss_of_the_facts_it_learns(pkm_run, tmp_path, capsys):
    """The direction `memtree train finetune` exists for: after sparse memory finetuning on a stream
    of facts, the finetuned run's loss on those facts is below the run's own, and only memory values
    moved, so it is the finetuned slots that carry them. The SGD rate is the project's (eval
    continual's grid: 300-3,000); on this 3-batch run, 7.621 -> 7.574 (2026-11-29). Slots that
    were not the ones read, or values not written back, would leave the loss where it was."""
    import shutil

    from streaming.base.util import clean_stale_shared_memory

    from memtree.cli import main

    run = shutil.copytree(pkm_run, tmp_path / "run")
    clean_stale_shared_memory()
    assert (
        main(["train", "finetune-background", str(run), "--batches", "3", "--batch-size", "2"]) == 0
    )
    clean_stale_shared_memory()
    records = [
        {
            "id": f"f{i}",
            "texts": [f"the colour of item {i} is blue", f"item {i} has the colour blue"],
        }
        for i in range(3)
    ]
    stream = tmp_path / "stream.jsonl"
    stream.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "ft"
    assert (
        main(
            [
                "train",
                "finetune",
                f"run={run}",
                f"data={stream}",
                f"save_folder={out}",
                "spec.top_t=16",
                "spec.lr=3000.0",
                "spec.steps_per_batch=4",
            ]
        )
        == 0
    )
    capsys.readouterr()
    texts = [t for r in records for t in r["texts"]]
    before, after = _stream_nll(run, texts), _stream_nll(out, texts)
    assert after < before - 0.02, (before, after)
    from memtree.training.finetune.continual import finetune_summary

    assert set(finetune_summary(out / "finetune.json")["changed"]["tensors"]) == {
        "blocks.1.pkm.values.weight"
    }


def test_eval_continual_writes_its_report(pkm_run, pipeline_run, tmp_path):
    """The experiment on a bios world, run against the tiny memory-layer run (its own background
    counts collected first) and, for the hierarchical part, a tiny co-trained bank run:
    results.json, report.md and both Pareto PNGs, each configuration from the same pretrained
    weights and bank."""
    from streaming.base.util import clean_stale_shared_memory

    from memtree.eval.finetune.continual import load_continual_config, run_continual
    from memtree.io import read_json
    from memtree.pipeline.corpus.bios import BiosSpec, write_bios
    from memtree.training.train import load_run
    from tests.conftest import train_tiny_run

    root = tmp_path / "bios"
    write_bios(root, BiosSpec(entities_per_subtopic=2), heldout_docs=8)
    mem_run = train_tiny_run(
        pipeline_run[0] / "shards",
        tmp_path / "memrun",
        "data.batch_size=2",
        "max_duration=2ba",
        "memory.multipliers=[16,8]",
        "model.shape={n_layers: 2, d_model: 32, n_heads: 2, head_dim: 16, ffn_dim: 64}",
    )
    bank_bytes = {f.name: f.read_bytes() for f in (mem_run / "bank").glob("level-*.bin")}
    clean_stale_shared_memory()
    cfg = load_continual_config(
        None,
        [
            f"root={root}",
            f"run={pkm_run}",
            "n_facts=6",
            "paraphrases=3",
            "old_probes=16",
            "held_out_docs=4",
            "background_batches=2",
            f"out={tmp_path / 'out'}",
            (
                "runs=[{method: sparse_memory, top_t: 8, lr: 2.0}, "
                "{method: lora, lora_rank: 2, lr: 1.0e-3}, {method: full, lr: 1.0e-4}]"
            ),
            f"blocks_run={mem_run}",
            (
                "block_runs=[{method: tfidf, top_t: 4, lr: 1.0, unit_frac: 0.25}, "
                "{method: all_fetched, lr: 1.0}, {method: anchor, lr: 1.0e-4}]"
            ),
        ],
    )
    report = run_continual(cfg, progress=False)
    clean_stale_shared_memory()
    res = read_json(tmp_path / "out" / "results.json")
    assert report.exists() and (tmp_path / "out" / "pareto.png").stat().st_size > 0
    assert [r["method"] for r in res["runs"]] == ["sparse_memory", "lora", "full"]
    assert res["n_new_probes"] == 6 and res["n_old_probes"] == 16
    assert res["runs"][0]["changed"]["elements"] > 0
    assert set(res["target"]) == {"old_drop", "ppl_increase_pct"}
    lines = (tmp_path / "out" / "stream.jsonl").read_text().splitlines()
    assert len(lines) == 6 and len(json.loads(lines[0])["texts"]) == 3
    # the run itself was never written: every configuration started from it
    model, *_ = load_run(pkm_run)
    assert res["before"]["perplexity"] > 0 and model is not None
    hier = res["hierarchical"]
    assert [r["method"] for r in hier["runs"]] == ["tfidf", "all_fetched", "anchor"]
    tfidf, every, anchor = hier["runs"]
    assert 0 < tfidf["bank"]["params_changed"] < every["bank"]["params_changed"]
    assert anchor["bank"]["records"] == 0 and anchor["anchor_params_changed"] > 0
    assert tfidf["anchor_params_changed"] == 0 == every["anchor_params_changed"]
    assert (tmp_path / "out" / "pareto_blocks.png").stat().st_size > 0
    # every configuration edited a copy: the run's own bank is byte-identical
    assert {f.name: f.read_bytes() for f in (mem_run / "bank").glob("level-*.bin")} == bank_bytes


def test_shipped_continual_grid_loads():
    from memtree.eval.finetune.continual import load_continual_config

    cfg = load_continual_config()
    assert {s.method for s in cfg.runs} == {"sparse_memory", "full", "lora"}
    assert any(p.startswith("model.pkm.") for p in cfg.pretrain)
