"""The context bank's eval command: `memtree eval context-bank`, cross-session recall through
the bank (seed 004 §9; the experiment is `recall.py`)."""

from __future__ import annotations

import argparse

from memtree.cli import Commands, add_overrides
from memtree.eval.cli_common import check_demo_root, out_override

# Each command imports its library modules inside its handler, as eval/cli.py does.


def register(cli: Commands) -> None:
    """This folder's eval subcommands, in --help order."""
    sub = cli.verb("eval")
    for add in (_add_context_bank,):
        add(sub)


def _add_context_bank(sub: argparse._SubParsersAction) -> None:
    cb = sub.add_parser(
        "context-bank",
        help="cross-session recall through the context bank (seed 004 §9) on a bios demo run's "
        "frozen anchor",
        description="New entities' documents are compressed into a context bank over several "
        "sessions (saved and reopened between them); a later session answers probes about them "
        "from the question alone. Compares no bank, a bank that never merges, banks filled past "
        "capacity (merging), the probe's own entry and the document in context. Trains the "
        "compressor first when needed. Writes OUT/results.json, OUT/report.md and OUT/recall.png.",
    )
    cb.add_argument(
        "root",
        help="a bios demo run (memtree demo's --root): corpus.json, facts.jsonl, train/anchor",
    )
    add_overrides(
        cb,
        "n_entities=… sessions=… capacities=[1,0.5] top_k=…",
        what="eval.context.recall.ContextRecallConfig key=value overrides",
    )
    cb.add_argument(
        "--train",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="compressor training override (repeatable), e.g. --train max_duration=1ep",
    )
    cb.add_argument("--out", help="report folder (default ROOT/context-bank; the same as out=PATH)")
    cb.set_defaults(func=_context_bank)


def _context_bank(args: argparse.Namespace) -> int:
    from memtree.eval.context.recall import load_recall_config, run_recall

    check_demo_root(args.root, "eval context-bank", ("corpus.json", "facts.jsonl", "train/anchor"))
    train = ",".join(f'"{t}"' for t in args.train)
    cfg = load_recall_config(
        None,
        [
            f"root={args.root}",
            *args.overrides,
            *([f"train=[{train}]"] if train else []),
            *out_override(args),
        ],
    )
    print(run_recall(cfg))
    return 0
