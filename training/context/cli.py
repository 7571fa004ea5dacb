"""`memtree train context-vae CONFIG.yaml [key=value …]`: the context bank's compressor
(training/context/train.py, seed 004 §9)."""

from __future__ import annotations

import argparse

from memtree.cli import Commands, add_config, add_overrides, config_and_overrides


def register(cli: Commands) -> None:
    c = cli.verb("train").add_parser(
        "context-vae",
        help="train the context bank's compressor (a VAE over first+last hidden states) and reader "
        "on a frozen anchor",
        description="Train the seed 004 §9.2 compressor and the reader that lets the frozen anchor "
        "attend to retrieved latent tokens, on recall pairs (document, question about a fact it "
        "states). Writes SAVE_FOLDER/context_vae.safetensors + context_vae.json. Example: "
        "training/yamls/context-vae.yaml.",
    )
    add_config(c, "training/yamls/context-vae.yaml")
    add_overrides(c, "vae.ratio=16")
    c.set_defaults(func=_train_context)


def _train_context(args: argparse.Namespace) -> int:
    from memtree.training.context.train import load_context_config, train_context_vae

    config, overrides = config_and_overrides(args)
    cfg = load_context_config(config, overrides)
    _check_context_inputs(cfg)
    result = train_context_vae(cfg)
    print(
        f"done: {result['folder']} ({result['steps']} steps; last losses {result['last_losses']})"
    )
    return 0


def _check_context_inputs(cfg) -> None:
    """The compressor run's inputs, named by key before anything is loaded or written (its time
    strings are checked when the config loads: TimeString fields)."""
    from pathlib import Path

    from memtree.config import ConfigError

    missing = [
        n
        for n in ("memtree_config.json", "anchor.safetensors")
        if not (Path(cfg.anchor) / n).is_file()
    ]
    if missing:
        raise ConfigError(
            f"anchor={cfg.anchor}: not a finished training run (no {' or '.join(missing)} there); "
            "give the save_folder of a `memtree train run` run (`memtree demo` trains "
            "runs/demo/train/anchor)"
        )
    if not Path(cfg.data.pairs).is_file():
        raise ConfigError(
            f"data.pairs={cfg.data.pairs}: no such file; give a JSONL of recall pairs "
            "(training/README.md; `memtree eval context-bank ROOT` writes "
            "ROOT/context-bank/pairs.jsonl)"
        )
