"""The `memtree` command: one entry point, a few verbs, each with the subcommands its stages own.

    memtree demo                          the main job (pipeline → anchor → memories → evaluation)
    memtree generate RUN --prompt TEXT    answer prompts with a run, its memory fetched per prompt
    memtree pipeline run|demo|demo-corpus|docs-corpus
    memtree train run|context-vae|finetune|finetune-background
    memtree eval knowledge|sweep|retention|tasks|memories|realtext|longctx|context-bank|
                 continual|adapters
    memtree memstore plan|init|info|…|calibrate|simulate-fetch

Each stage package (and each system folder with commands) exposes `register(cli)` in its own
`cli.py` and is listed under the `memtree.commands` entry-point group in pyproject.toml; `cli` is a
`Commands`, whose `verb(name)` gives the subcommand table of one of the verbs above. The dispatcher
only discovers and calls them, so stages stay independent and this module never imports a stage
that is not being run (keeps `--help` fast). The arguments several commands share come from the
helpers below (`add_config`, `add_overrides`, `config_and_overrides`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from importlib.metadata import entry_points
from typing import Any

from memtree import __version__

# Used when memtree runs from a source tree that was never pip-installed.
_FALLBACK = (
    "memtree.eval.cli",
    "memtree.eval.camelot.cli",
    "memtree.eval.context.cli",
    "memtree.eval.finetune.cli",
    "memtree.memstore.cli",
    "memtree.pipeline.cli",
    "memtree.training.cli",
    "memtree.training.context.cli",
    "memtree.training.finetune.cli",
    "memtree.training.generate.cli",
)


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
    `key=value` overrides given after an option (`memtree pipeline run cfg.yaml --until embed
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
            self.error(
                f"unrecognized arguments: {' '.join(extras)} (`{self.prog} --help` lists the "
                "options)"
            )
        return ns, extras


# The verbs in --help order, with their one-line help; `demo` is a command of its own.
VERBS = {
    "pipeline": (
        "corpus → embeddings → balanced hierarchical tree → cluster-tagged MDS shards; corpora"
    ),
    "train": "train anchors with hierarchical memories (Composer); the systems' training",
    "eval": (
        "evaluate runs: long-tail knowledge and blocking, sweeps, task suites; each system's "
        "experiment"
    ),
    "memstore": (
        "hierarchical memory banks: plan sizes, build, inspect, fetch, block; simulate "
        "on-device fetch"
    ),
}
# Top-level commands with no subcommands: the main job, and running what a run trained.
COMMANDS = ("demo", "generate")
ORDER = (*COMMANDS, *VERBS)


class Commands:
    """What a stage's `register(cli)` adds its commands to."""

    def __init__(self, sub: argparse._SubParsersAction) -> None:
        self._sub = sub
        self._verbs: dict[str, argparse._SubParsersAction] = {}

    def verb(self, name: str) -> argparse._SubParsersAction:
        """The subcommand table of verb `name` (one of `VERBS`), made on first use."""
        if name not in VERBS:
            raise ValueError(f"memtree has no verb {name!r}; the verbs are {', '.join(VERBS)}")
        if name not in self._verbs:
            p = self._sub.add_parser(name, help=VERBS[name], description=VERBS[name] + ".")
            self._verbs[name] = p.add_subparsers(dest=f"{name}_command", metavar="SUBCOMMAND")
            p.set_defaults(func=lambda args, p=p: _print_help(p))
        return self._verbs[name]

    def command(self, name: str, **kw: Any) -> argparse.ArgumentParser:
        """A top-level command with no subcommands (`COMMANDS`: `demo`, `generate`)."""
        if name not in ORDER or name in VERBS:
            raise ValueError(
                f"{name!r} is no top-level command; add it under one of the verbs "
                f"{', '.join(VERBS)}"
            )
        return self._sub.add_parser(name, **kw)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _count(low: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < low:
            # a negative count used to slice from the end (`--max-probes -5` scored all but five)
            raise argparse.ArgumentTypeError(
                f"must be {'positive' if low else '0 or more'}, got {v}"
            )
        return v

    parse.__name__ = (
        "positive integer" if low else "non-negative integer"
    )  # argparse names the type in errors
    return parse


# argparse `type=` for counts: `nonneg` where 0 means "all" or "none", `positive` elsewhere
nonneg = _count(0)
positive = _count(1)


def add_config(p: argparse.ArgumentParser, examples: str) -> None:
    """The optional YAML config positional; `examples`: where example configs are."""
    p.add_argument(
        "config", nargs="?", help=f"YAML config (key=value overrides follow; examples: {examples})"
    )


def add_overrides(
    p: argparse.ArgumentParser, example: str, *, what: str = "key=value overrides"
) -> None:
    """The trailing `key=value` overrides; `example`: one or two of them."""
    p.add_argument("overrides", nargs="*", help=f"{what}, e.g. {example}")


def config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """(config, overrides) of `add_config` + `add_overrides`: a first word holding `=` is an
    override, not a config (`memtree train run data.shards=… mode=baseline`)."""
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config:
        config, overrides = None, [config, *overrides]
    return config, overrides


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memtree",
        description="Pretraining small language models with hierarchical memories.",
    )
    parser.add_argument("--version", action="version", version=f"memtree {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    cli = Commands(sub)
    for name in VERBS:  # the verbs exist (and list in order) even before a stage adds to them
        cli.verb(name)
    for register in _registrars():
        register(cli)
    # --help lists the commands in ORDER, whatever order the entry points came in
    sub._choices_actions.sort(key=lambda a: ORDER.index(a.dest) if a.dest in ORDER else len(ORDER))
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
