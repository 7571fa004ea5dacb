"""`memtree train CONFIG.yaml [key=value …]`: one-process training (thin wrapper over training.train).

The training systems register their own commands (training/finetune/cli.py, training/context/cli.py,
listed under pyproject.toml's `memtree.commands`), so the core names none of them."""

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


def _train(args: argparse.Namespace) -> int:
    if not args.config and not args.overrides:  # training.train.main would print the launcher's usage
        raise ValueError("no config: memtree train CONFIG.yaml [key=value …] (examples: training/yamls/*.yaml)")
    from memtree.training.train import main

    return main(([args.config] if args.config else []) + list(args.overrides))
