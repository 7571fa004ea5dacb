"""`memtree train CONFIG.yaml [key=value …]`: one-process training (thin wrapper over training.train), and
`memtree train-context-vae CONFIG.yaml [key=value …]`: the context bank's compressor (training.context_train)."""

from __future__ import annotations

import argparse


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


def _train(args: argparse.Namespace) -> int:
    from training.train import main

    return main(([args.config] if args.config else []) + list(args.overrides))


def _train_context(args: argparse.Namespace) -> int:
    from training.context_train import load_context_config, train_context_vae

    config, overrides = args.config, list(args.overrides)
    if config and "=" in config:  # overrides only
        config, overrides = None, [config, *overrides]
    result = train_context_vae(load_context_config(config, overrides))
    print(f"done: {result['folder']} ({result['steps']} steps; last losses {result['last_losses']})")
    return 0
