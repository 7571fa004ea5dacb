"""`memtree eval adapters` on a Hugging Face causal LM (eval/finetune/adapters.py, bases.py): the
four conditions on a tiny random Llama saved with `save_pretrained` and handed in as a loaded
pretrained model (the seam `run=NAME` goes through), with a byte-level BPE trained here on the bios
corpus. Exact no-op of zero-initialised adapters, what each condition trains, LoRA rank matching
against the counted parameters, the report with real-text forgetting, learning by full fine-tuning.
The real SmolLM2-135M through the command is in the slow part, where `make pretrained` installed
it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from memtree.eval.finetune.adapters import (
    accounting,
    load_adapters_config,
    matched_lora,
    run_adapters,
)
from memtree.eval.finetune.bases import PretrainedBase, open_base
from memtree.io import iter_jsonl, read_json
from memtree.pretrained import LoadedPretrained, PretrainedError, gguf_path
from memtree.training.finetune.adapters import AdapterSpec
from memtree.training.finetune.continual import Finetuner, FinetuneSpec, batch_tensors, changes
from memtree.training.finetune.lora import LoRALinear
from memtree.training.flops import lora_params

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOT = "<|endoftext|>"
ADAPTER = AdapterSpec(n_chapters=4, tokens_per_chapter=4, top_k=2)
# Real English (no bios names): the held-out text forgetting is read on.
ENGLISH = [
    "The weather was cold, so she put on a warm coat before leaving the house.",
    "On the way to the station she stopped at a small shop to buy a cup of coffee.",
    "The train was late, and many people were waiting on the platform in the rain.",
    "When it finally arrived, she found a seat near the window and began to read.",
]


@pytest.fixture(scope="module")
def bios_root(tmp_path_factory):
    """A bios demo root as `memtree demo` writes it (corpus, facts, held-out documents): no
    training."""
    from memtree.pipeline.corpus.bios import BiosSpec, write_bios

    root = tmp_path_factory.mktemp("bios") / "root"
    write_bios(root, BiosSpec(entities_per_subtopic=2), heldout_docs=4)
    return root


@pytest.fixture(scope="module")
def loaded(bios_root, tmp_path_factory) -> LoadedPretrained:
    """A tiny random Llama written by save_pretrained and read back, with a byte-level BPE trained
    on the bios corpus (new entities' names split into pieces, never unknown)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [r["text"] for _, r in iter_jsonl(bios_root / "corpus.jsonl")][:400]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=tok.get_vocab_size(),
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
    ).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    # a stand-in for `memtree.pretrained.provenance`'s record of a converted GGUF model
    record = {
        "name": "tiny-llama",
        "title": "Tiny random Llama",
        "quantisation": "GGUF Q4_1",
        "licence": "test-only",
        "upstream": "nowhere/tiny-llama",
    }
    return LoadedPretrained(
        name="tiny-llama",
        model=model,
        tokenizer=tok,
        eot_id=tok.token_to_id(EOT),
        folder=folder,
        record=record,
    )


def _batches(loaded, n=3):
    texts = [
        "The birth year of Vesavaresk is 1931.",
        "Vesavaresk was founded in the north.",
        "A short one.",
    ]
    return [
        (f"r{i}", *batch_tensors(texts, loaded.encode, pad_id=loaded.eot_id, max_len=64))
        for i in range(n)
    ]


def test_zero_initialised_adapters_give_the_bare_models_logits(loaded):
    base = PretrainedBase(loaded)
    spec = FinetuneSpec(method="mem_adapter", lr=1e-3, adapter=ADAPTER)
    crm = base.condition(spec)
    assert crm.model is not loaded.model and not crm.packable and base.rm.packable
    ft = Finetuner(crm.model, spec)
    ids, _ = _batches(loaded, 1)[0][1:]
    with torch.no_grad():
        assert torch.equal(crm.model(input_ids=ids).logits, loaded.model(input_ids=ids).logits)
    # the layers did read memory: the zero comes from W_O, not a skipped hook
    assert all(m.last_routing is not None for m in ft.hf_adapter.mem_layers.values())
    seqs = [loaded.encode(t) for t in ("The birth year of Vesavaresk is", "It rained.")]
    for a, b in zip(
        crm.logprobs(seqs, mode="none"), base.rm.logprobs(seqs, mode="none"), strict=True
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["full", "lora", "mem_adapter", "mem_adapter+lora"])
def test_each_condition_trains_only_what_it_should(loaded, method):
    base = PretrainedBase(loaded)
    spec = FinetuneSpec(method=method, lr=1e-2, lora_rank=2, adapter=ADAPTER)
    model = copy.deepcopy(loaded.model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ft = Finetuner(model, spec)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    lora = {n for n in names if ".lora_" in n}
    if method == "full":
        assert names == {n for n, _ in model.named_parameters()}
    elif method.endswith("lora"):
        assert names == lora and len(lora) == 2 * 7 * 2  # A and B on q k v o gate up down, 2 layers
    else:
        assert not names  # the base is frozen; the adapter's modules sit beside it
    # the parameters the optimiser steps, counted on the built modules, are training/flops.py's
    # count
    assert ft.n_trainable == accounting(base, spec, seq_len=10)["trainable_params"]
    for _, ids, real in _batches(loaded):
        ft.step(ids, real)
    ft.finish()
    res = {"trainable": ft.n_trainable, "changed": changes(before, model, added=ft.added_state())}
    after = model.state_dict()
    # merged
    assert set(after) == set(before) and not any(isinstance(m, LoRALinear) for m in model.modules())
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    if method == "mem_adapter":
        assert not changed and res["changed"]["elements"] == 0  # base weights bit for bit
        assert res["changed"]["added_elements"] == res["trainable"] > 0
    else:  # full and LoRA move the projections (merged LoRA: only the seven wrapped matrices)
        assert changed
        if method.endswith("lora"):
            assert all(
                k.split(".")[-2]
                in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                for k in changed
            )
    assert res["changed"]["added_elements"] == (
        0
        if "mem_adapter" not in method
        else sum(
            p.numel()
            for p in ft.hf_adapter.parameters()
            if not any(p is q for q in model.parameters())
        )
    )
    assert all(not p.requires_grad for p in ft.module.parameters())


def test_lora_ranks_match_the_adapters_counted_parameters(loaded):
    base = PretrainedBase(loaded)
    runs = [
        FinetuneSpec(method="mem_adapter", lr=1e-3, adapter=ADAPTER),
        FinetuneSpec(method="lora", lr=1e-3),
        FinetuneSpec(
            method="mem_adapter+lora",
            lr=1e-3,
            adapter=AdapterSpec(layers="last:1", n_chapters=4, tokens_per_chapter=4, top_k=2),
        ),
    ]
    mem, lora, both = matched_lora(runs, base, seq_len=10)
    counted = {}
    for spec in (mem, lora, both):
        counted[spec.method] = Finetuner(copy.deepcopy(loaded.model), spec).n_trainable
    per_rank = lora_params(base.shape, 1)
    assert lora.lora_rank > 1 and both.lora_rank >= 1
    for m in ("lora", "mem_adapter+lora"):
        assert abs(counted[m] - counted["mem_adapter"]) <= per_rank / 2 + 1


def test_a_run_that_is_neither_a_folder_nor_a_name_says_both(bios_root):
    with pytest.raises(FileNotFoundError, match="gemma3-270m or smollm2-135m"):
        open_base(bios_root, str(bios_root / "nowhere"))


RUNS = (
    "runs=[{method: full, lr: 3.0e-3}, {method: lora, lr: 1.0e-2}, "
    "{method: mem_adapter, lr: 1.0e-2, adapter: {n_chapters: 4, tokens_per_chapter: 4}}, "
    "{method: mem_adapter+lora, lr: 1.0e-2, adapter: {layers: 'last:1', n_chapters: 4, "
    "tokens_per_chapter: 4}}]"
)


def test_eval_adapters_on_an_hf_model_writes_its_report_and_full_finetuning_learns(
    bios_root, loaded, tmp_path
):
    text = tmp_path / "english.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in ENGLISH))
    out = tmp_path / "out"
    weights = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    cfg = load_adapters_config(
        None,
        [
            f"root={bios_root}",
            "n_facts=8",
            "paraphrases=4",
            "epochs=8",
            "old_probes=8",
            "held_out_docs=2",
            f"held_out_text={text}",
            "held_out_tokens=60",
            f"out={out}",
            RUNS,
        ],
    )
    report = run_adapters(cfg, progress=False, pretrained=loaded)
    res = read_json(out / "results.json")
    assert report.exists() and (out / "pareto.png").stat().st_size > 0
    assert res["run"] == "tiny-llama" and res["model"] == loaded.record and res["hf"]
    assert [r["method"] for r in res["runs"]] == ["full", "lora", "mem_adapter", "mem_adapter+lora"]
    assert res["steps_per_run"] == 8 * 8 and res["held_out_text"]["tokens"] == 60
    md = report.read_text()
    for words in (
        "Tiny random Llama",
        "GGUF Q4_1 (4-bit), dequantised to fp32",
        "licence test-only",
        "text ppl increase",
        "real-text perplexity",
    ):
        assert words in md
    full, lora, mem, both = res["runs"]
    assert full["trainable_counted"] == sum(p.numel() for p in loaded.model.parameters())
    per_rank = lora_params(PretrainedBase(loaded).shape, 1)
    for r in (lora, both):
        assert abs(r["trainable_counted"] - mem["trainable_counted"]) <= per_rank / 2 + 1
    assert (
        mem["changed"]["elements"] == 0
        and mem["changed"]["added_elements"] == mem["trainable_counted"]
    )
    assert mem["adapter"]["layers"] == [0, 1] and mem["adapter"]["chapter_overlap"] is None
    assert all(r["accounting"]["trainable_params"] == r["trainable_counted"] for r in res["runs"])
    for r in res["runs"]:
        assert r["after"]["text_perplexity"] > 0 and "text_ppl_increase_pct" in r["forgetting"]
    assert res["best"]["full"]["forgetting_key"] == "text_ppl_increase_pct"
    # 8 passes over 8 facts: full fine-tuning learns them (chance 25 %)
    assert full["after"]["new_accuracy"] > res["before"]["new_accuracy"]
    # every condition started from the loaded weights (a copy each), which none touched
    assert all(torch.equal(v, weights[k]) for k, v in loaded.model.state_dict().items())


# ------------------------------------------------------------------------------- the real model
# A real model's learning rates (the tiny random model's above blow a pretrained one up); adapters
# in every 10th layer, so the matched LoRA rank stays small.
SMOL_RUNS = (
    "runs=[{method: full, lr: 1.0e-5}, {method: lora, lr: 1.0e-4}, "
    "{method: mem_adapter, lr: 1.0e-3, adapter: {layers: 'every:10'}}, "
    "{method: mem_adapter+lora, lr: 1.0e-3, adapter: {layers: 'last:1'}}]"
)


@pytest.mark.slow
def test_eval_adapters_on_smollm2_through_the_command(bios_root, tmp_path, capsys):
    try:
        gguf_path("smollm2-135m")
    except PretrainedError as e:
        pytest.skip(str(e))
    from memtree.cli import main

    text = tmp_path / "english.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in ENGLISH))
    out = tmp_path / "out"
    assert (
        main(
            [
                "eval",
                "adapters",
                str(bios_root),
                "run=smollm2-135m",
                "n_facts=4",
                "paraphrases=2",
                "epochs=1",
                "old_probes=8",
                "held_out_docs=4",
                f"held_out_text={text}",
                "held_out_tokens=200",
                SMOL_RUNS,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = read_json(out / "results.json")
    assert res["model"]["name"] == "smollm2-135m" and res["model"]["quantisation"] == "GGUF Q4_1"
    assert res["anchor"]["n_layers"] == 30 and len(res["runs"]) == 4
    assert (
        "SmolLM2-135M-Instruct" in (out / "report.md").read_text()
        and Path(out / "pareto.png").is_file()
    )
    mem = res["runs"][2]
    assert (
        mem["changed"]["elements"] == 0
        and mem["changed"]["added_elements"] == mem["trainable_counted"]
    )
    assert res["before"]["text_perplexity"] < 100  # a pretrained model reads plain English well
