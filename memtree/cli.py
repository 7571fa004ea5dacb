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
_FALLBACK = ("memtree.eval.cli", "memtree.eval.camelot.cli", "memtree.eval.context.cli",
             "memtree.eval.finetune.cli", "memtree.memstore.cli", "memtree.pipeline.cli", "memtree.training.cli",
             "memtree.training.context.cli", "memtree.training.finetune.cli")


def _registrars():
    eps = entry_points(group="memtree.commands")
    if eps:
        for ep in sorted(eps, key=lambda e: e.name):
            yield ep.load()
        return
    for mod in _FALLBACK:
        yield importlib.import_module(mod).register


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser (and, through argparse's `parser_class` default, its own
    subcommands'): an unknown option is its error, shown with its usage, not the top level's.

    argparse hands a subcommand's leftovers up to the top-level parser, which would print
    `memtree [-h] [--version] COMMAND ...`. Left-over words without a leading dash are
    `key=value` overrides given after an option (`memtree pipeline cfg.yaml --until embed
    tree.levels=3`), which argparse does not match to a positional once options came between:
    they join the command's `overrides`."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras and isinstance(getattr(ns, "overrides", None), list):
            words = [a for a in extras if not a.startswith("-")]
            if words and all("=" in a for a in words):
                ns.overrides.extend(words)
                extras = [a for a in extras if a.startswith("-")]
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)} (`{self.prog} --help` lists the options)")
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memtree",
        description="Pretraining small language models with hierarchical memories.",
    )
    parser.add_argument("--version", action="version", version=f"memtree {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
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
