"""The finetuning systems' eval commands: `memtree eval continual` (learning new facts without
forgetting, seed 003: `continual.py`) and `memtree eval adapters` (memory adapters vs full
fine-tuning vs LoRA, seed 004 §7.3: `adapters.py`)."""

from __future__ import annotations

import argparse

from memtree.cli import Commands, add_overrides
from memtree.eval.cli_common import check_demo_root, config_file, out_override

# Each command imports its library modules inside its handler, as eval/cli.py does.


def register(cli: Commands) -> None:
    """This folder's eval subcommands, in --help order."""
    sub = cli.verb("eval")
    for add in (_add_continual, _add_adapters):
        add(sub)


def _add_continual(sub: argparse._SubParsersAction) -> None:
    ct = sub.add_parser(
        "continual",
        help="learning new facts in sequence without forgetting: sparse memory finetuning vs full "
        "vs LoRA (seed 003)",
        description="Pretrains a memory-layer model on a bios demo run's shards when needed, "
        "collects its background access counts, then streams new facts (one gradient step per "
        "fact's paraphrases) through each configuration of the grid and measures learning "
        "(new-fact accuracy) and forgetting (old-fact accuracy, held-out perplexity). Writes "
        "OUT/results.json, OUT/report.md, OUT/pareto.png (default OUT: ROOT/continual). Grid: "
        "eval/yamls/continual.yaml. The memory-layer run ROOT/train/pkm is reused only when "
        "trained from the same pretrain settings and shards.",
    )
    ct.add_argument(
        "root",
        help="a bios demo run (memtree demo's --root): corpus.json, facts.jsonl, pipeline/shards",
    )
    add_overrides(
        ct,
        "n_facts=… paraphrases=… run=…",
        what="eval.finetune.continual.ContinualConfig key=value overrides",
    )
    ct.add_argument("--config", help="YAML with the grid (default eval/yamls/continual.yaml)")
    ct.add_argument("--out", help="report folder (default ROOT/continual; the same as out=PATH)")
    ct.set_defaults(func=_continual)


def _continual(args: argparse.Namespace) -> int:
    from memtree.eval.finetune.continual import load_continual_config, run_continual

    check_demo_root(args.root, "eval continual", ("corpus.json", "facts.jsonl", "heldout.jsonl"))
    print(
        run_continual(
            load_continual_config(
                config_file(args.config, "--config"),
                [f"root={args.root}", *args.overrides, *out_override(args)],
            )
        )
    )
    return 0


def _add_adapters(sub: argparse._SubParsersAction) -> None:
    ad = sub.add_parser(
        "adapters",
        help="memory adapters vs full fine-tuning vs LoRA on new facts (seed 004 §7.3)",
        description="Fine-tunes a pretrained model on facts about new entities under four "
        "conditions (full, lora, mem_adapter, mem_adapter+lora) from the same weights, and "
        "measures learning (new-fact accuracy), forgetting (old-fact accuracy, held-out "
        "perplexity; with held_out_text=FILE.jsonl the perplexity of real text), trainable "
        "parameters, bank bytes, FLOPs per token and step time. The model: a bios demo run's "
        "anchor (ROOT/train/anchor, or run=FOLDER) or a real pretrained Hugging Face model, "
        "run=smollm2-135m or run=gemma3-270m (`make pretrained`). Writes OUT/results.json, "
        "OUT/report.md, OUT/pareto.png (default OUT: ROOT/adapters). Grid: "
        "eval/yamls/adapters.yaml.",
    )
    ad.add_argument(
        "root",
        help="a bios demo run (memtree demo's --root): corpus.json, facts.jsonl, heldout.jsonl "
        "and, unless run= names a pretrained model, train/anchor",
    )
    add_overrides(
        ad,
        "n_facts=… epochs=… run=smollm2-135m held_out_text=…",
        what="eval.finetune.adapters.AdaptersConfig key=value overrides",
    )
    ad.add_argument("--config", help="YAML with the grid (default eval/yamls/adapters.yaml)")
    ad.add_argument("--out", help="report folder (default ROOT/adapters; the same as out=PATH)")
    ad.set_defaults(func=_adapters)


def _adapters(args: argparse.Namespace) -> int:
    from memtree.eval.finetune.adapters import load_adapters_config, run_adapters

    check_demo_root(args.root, "eval adapters", ("corpus.json", "facts.jsonl", "heldout.jsonl"))
    print(
        run_adapters(
            load_adapters_config(
                config_file(args.config, "--config"),
                [f"root={args.root}", *args.overrides, *out_override(args)],
            )
        )
    )
    return 0
