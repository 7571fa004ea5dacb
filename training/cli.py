"""`memtree train CONFIG.yaml [key=value …]`: one-process training (thin wrapper over training.train), and
`memtree train-context-vae CONFIG.yaml [key=value …]`: the context bank's compressor (training.context_train),
`memtree finetune CONFIG.yaml [key=value …]` and `memtree finetune-background RUN`: continual finetuning
(training.finetune)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train an anchor with hierarchical memories on pipeline shards (Composer)",
        description="Train with Composer on one process. For several GPUs: "
                    "composer -n N training/train.py CONFIG.yaml [key=value …]. "
                    "Examples: training/yamls/*.yaml.",
    )
    p.add_argument("config", nargs="?", help="YAML config (key=value overrides follow)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. memory.multipliers=[4,2]")
    p.set_defaults(func=_train)

    c = sub.add_parser(
        "train-context-vae",
        help="train the context bank's compressor (a VAE over first+last hidden states) and reader on a frozen anchor",
        description="Train the seed 004 §9.2 compressor and the reader that lets the frozen anchor attend to "
                    "retrieved latent tokens, on recall pairs (document, question about a fact it states). "
                    "Writes SAVE_FOLDER/context_vae.safetensors + context_vae.json. Example: "
                    "training/yamls/context-vae.yaml.",
    )
    c.add_argument("config", nargs="?", help="YAML config (key=value overrides follow)")
    c.add_argument("overrides", nargs="*", help="key=value overrides, e.g. vae.ratio=16")
    c.set_defaults(func=_train_context)
    register_finetune(sub)


def _train(args: argparse.Namespace) -> int:
    if not args.config and not args.overrides:  # training.train.main would print the launcher's usage
        raise ValueError("no config: memtree train CONFIG.yaml [key=value …] (examples: training/yamls/*.yaml)")
    from training.train import main

    return main(([args.config] if args.config else []) + list(args.overrides))


def _train_context(args: argparse.Namespace) -> int:
    from training.context_train import load_context_config, train_context_vae

    config, overrides = args.config, list(args.overrides)
    if config and "=" in config:  # overrides only
        config, overrides = None, [config, *overrides]
    cfg = load_context_config(config, overrides)
    _check_context_inputs(cfg)
    result = train_context_vae(cfg)
    print(f"done: {result['folder']} ({result['steps']} steps; last losses {result['last_losses']})")
    return 0


def _check_context_inputs(cfg) -> None:
    """The compressor run's inputs, named by key before anything is loaded or written (its time strings
    are checked when the config loads: TimeString fields)."""
    from pathlib import Path

    from memtree.config import ConfigError
    missing = [n for n in ("memtree_config.json", "anchor.safetensors") if not (Path(cfg.anchor) / n).is_file()]
    if missing:
        raise ConfigError(f"anchor={cfg.anchor}: not a finished training run (no {' or '.join(missing)} there); give "
                          "the save_folder of a `memtree train` run (`memtree demo` trains runs/demo/train/anchor)")
    if not Path(cfg.data.pairs).is_file():
        raise ConfigError(f"data.pairs={cfg.data.pairs}: no such file; give a JSONL of recall pairs "
                          "(training/README.md; `memtree eval-context-bank ROOT` writes ROOT/context-bank/pairs.jsonl)")


def register_finetune(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser(
        "finetune",
        help="continual finetuning on a stream of new data: sparse memory finetuning, full or LoRA (seed 003)",
        description="Stream a JSONL of batches ({'id', 'texts': [...]}) through a finished run, one gradient "
                    "step per record, with method sparse_memory | full | lora. Writes SAVE_FOLDER/"
                    "anchor.safetensors + finetune.json. Example: training/yamls/finetune-sparse.yaml.",
    )
    f.add_argument("config", nargs="?", help="YAML config (key=value overrides follow)")
    f.add_argument("overrides", nargs="*", help="key=value overrides, e.g. spec.method=lora spec.lr=1e-3")
    f.set_defaults(func=_finetune)

    b = sub.add_parser(
        "finetune-background",
        help="collect a memory-layer run's background access counts over its pretraining shards",
        description="Count, per memory-layer slot, in how many of BATCHES pretraining batches it was read "
                    "(the IDF of sparse memory finetuning); stored with the checkpoint in RUN/pkm_background.",
    )
    b.add_argument("run", help="a finished run folder whose model has model.pkm")
    b.add_argument("--batches", type=int, default=1000, help="background batches (default 1000, the seed's)")
    b.add_argument("--batch-size", type=int, default=1,
                   help="sequences per batch (default 1: about a finetuning batch's tokens, so IDF separates slots)")
    b.add_argument("--seed", type=int, default=0, help="shuffle seed of the shards (default 0)")
    b.set_defaults(func=_background)


def _finetune(args: argparse.Namespace) -> int:
    from training.finetune import finetune, load_finetune_config

    config, overrides = args.config, list(args.overrides)
    if config and "=" in config:  # overrides only
        config, overrides = None, [config, *overrides]
    rec = finetune(load_finetune_config(config, overrides))
    ch = rec["changed"]
    print(f"done: {rec['config']['save_folder']} ({rec['label']}: {rec['steps']} steps; "
          f"{ch['elements']:,} of {ch['of_elements']:,} parameters changed, {ch['bytes']:,} bytes)")
    return 0


def _background(args: argparse.Namespace) -> int:
    from training.finetune import collect_run_background

    folders = collect_run_background(args.run, batches=args.batches, batch_size=args.batch_size, seed=args.seed)
    if not folders:  # a success that says nothing reads as a no-op (issue 36)
        print(f"{args.run}: no memory layer to collect background counts for", file=sys.stderr)
        return 1
    print(f"background access counts over {args.batches} batches collected for {len(folders)} memory "
          f"layer(s) of {args.run}:")
    for layer, folder in folders.items():
        print(f"  layer {layer}: {folder}")
    return 0
