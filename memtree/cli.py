"""The `memtree` command: one entry point, subcommands owned by each stage.

Each stage package exposes `register(subparsers)` in its own `cli.py` and is
listed under the `memtree.commands` entry-point group in pyproject.toml. The
dispatcher only discovers and calls them, so stages stay independent and this
module never imports a stage that is not being run (keeps `--help` fast).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from importlib.metadata import entry_points

from memtree import __version__

# Used when memtree runs from a source tree that was never pip-installed.
_FALLBACK = ("pipeline.cli", "memstore.cli", "training.cli", "eval.cli")


def _registrars():
    eps = entry_points(group="memtree.commands")
    if eps:
        for ep in sorted(eps, key=lambda e: e.name):
            yield ep.load()
        return
    for mod in _FALLBACK:
        yield importlib.import_module(mod).register


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memtree",
        description="Pretraining small language models with hierarchical memories.",
    )
    parser.add_argument("--version", action="version", version=f"memtree {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in _registrars():
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Models load from local files only: no hub access, ever.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("MEMTREE_DEBUG"):
            raise
        print(f"memtree: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
