"""`memtree train run CONFIG.yaml [key=value …]`: one-process training (thin wrapper over
training.train).

The training systems register their own commands (training/finetune/cli.py, training/context/cli.py,
listed under pyproject.toml's `memtree.commands`), so the core names none of them."""

from __future__ import annotations

import argparse

from memtree.cli import Commands, add_config, add_overrides, config_and_overrides


def register(cli: Commands) -> None:
    p = cli.verb("train").add_parser(
        "run",
        help="train an anchor with hierarchical memories on pipeline shards (Composer)",
        description="Train with Composer on one process. For several GPUs: "
        "composer -n N -m memtree.training.train CONFIG.yaml [key=value …]. "
        "Examples: training/yamls/*.yaml.",
    )
    add_config(p, "training/yamls/*.yaml")
    add_overrides(p, "memory.multipliers=[4,2]")
    p.add_argument(
        "--force",
        action="store_true",
        help="train again from batch 1 even when SAVE_FOLDER holds a finished run of this config "
        "(a rerun otherwise resumes an unfinished run and skips a finished one)",
    )
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    if (
        not args.config and not args.overrides
    ):  # training.train.main would print the launcher's usage
        raise ValueError(
            "no config: memtree train run CONFIG.yaml [key=value …] (examples: "
            "training/yamls/*.yaml)"
        )
    from memtree.training.config import load_train_config
    from memtree.training.train import run_once

    config, overrides = config_and_overrides(args)
    run_once(load_train_config(config, overrides), force=args.force)
    return 0
