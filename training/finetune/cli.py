"""`memtree train finetune CONFIG.yaml [key=value …]` and `memtree train finetune-background RUN`:
continual finetuning on a stream of new data (training/finetune/continual.py, seed 003 §4–§5)."""

from __future__ import annotations

import argparse
import sys

from memtree.cli import Commands, add_config, add_overrides, config_and_overrides, positive


def register(cli: Commands) -> None:
    sub = cli.verb("train")
    f = sub.add_parser(
        "finetune",
        help="continual finetuning on a stream of new data: sparse memory finetuning, full or LoRA "
        "(seed 003)",
        description="Stream a JSONL of batches ({'id', 'texts': [...]}) through a finished run, "
        "one gradient step per record, with method sparse_memory | full | lora. Writes SAVE_FOLDER/"
        "anchor.safetensors + finetune.json. Example: training/yamls/finetune-sparse.yaml.",
    )
    add_config(f, "training/yamls/finetune-*.yaml")
    add_overrides(f, "spec.method=lora spec.lr=1e-3")
    f.set_defaults(func=_finetune)

    b = sub.add_parser(
        "finetune-background",
        help="collect a memory-layer run's background access counts over its pretraining shards",
        description="Count, per memory-layer slot, in how many of BATCHES pretraining batches it "
        "was read (the IDF of sparse memory finetuning); stored with the checkpoint in "
        "RUN/pkm_background.",
    )
    b.add_argument("run", help="a finished run folder whose model has model.pkm")
    b.add_argument(
        "--batches",
        type=positive,
        default=1000,
        help="background batches (default 1000, the seed's)",
    )
    b.add_argument(
        "--batch-size",
        type=positive,
        default=1,
        help="sequences per batch (default 1: about a finetuning batch's tokens, so IDF separates "
        "slots)",
    )
    b.add_argument("--seed", type=int, default=0, help="shuffle seed of the shards (default 0)")
    b.set_defaults(func=_background)


def _finetune(args: argparse.Namespace) -> int:
    from memtree.training.finetune.continual import finetune, load_finetune_config

    config, overrides = config_and_overrides(args)
    rec = finetune(load_finetune_config(config, overrides))
    ch = rec["changed"]
    print(
        f"done: {rec['config']['save_folder']} ({rec['label']}: {rec['steps']} steps; "
        f"{ch['elements']:,} of {ch['of_elements']:,} parameters changed, {ch['bytes']:,} bytes)"
    )
    return 0


def _background(args: argparse.Namespace) -> int:
    from memtree.training.finetune.continual import collect_run_background

    folders = collect_run_background(
        args.run, batches=args.batches, batch_size=args.batch_size, seed=args.seed
    )
    if not folders:  # a success that says nothing reads as a no-op
        print(f"{args.run}: no memory layer to collect background counts for", file=sys.stderr)
        return 1
    print(
        f"background access counts over {args.batches} batches collected for {len(folders)} memory "
        f"layer(s) of {args.run}:"
    )
    for layer, folder in folders.items():
        print(f"  layer {layer}: {folder}")
    return 0
