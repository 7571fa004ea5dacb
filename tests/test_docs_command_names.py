"""The docs, docstrings, messages and log prefixes name only commands the CLI has.

Commands were renamed (`memtree eval-continual` → `memtree eval continual`, `memtree eval
--block-documents` → `memtree eval knowledge --block-documents` …); an old spelling left in a README
or an error message sends a user to a command that does not exist. docs/BENCHMARKS.md and the
dated campaign files keep the commands as they were run, and are not read here.
"""

from __future__ import annotations

import re
from pathlib import Path

from memtree import STAGES
from memtree.cli import ORDER, VERBS, build_parser

REPO = Path(__file__).resolve().parents[1]
SKIP = {REPO / "docs" / "BENCHMARKS.md"}


def _subcommands(parser) -> dict[str, object]:
    import argparse

    for action in parser._actions:  # argparse keeps its subparsers here; no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _files() -> list[Path]:
    roots = [REPO / "memtree", REPO / "docs", REPO / "bench", *(REPO / s for s in STAGES)]
    out = [REPO / "README.md", REPO / "Makefile"]
    for root in roots:
        for p in root.rglob("*"):
            if (
                p.suffix in (".py", ".md", ".yaml")
                and p not in SKIP
                and "results" not in p.parts
                and "benchmarks" not in p.relative_to(REPO).parts[:2]
                and "__pycache__" not in p.parts
            ):
                out.append(p)
    return out


def test_every_memtree_command_named_in_docs_and_messages_exists():
    top = _subcommands(build_parser())
    subs = {verb: set(_subcommands(top[verb])) for verb in VERBS}
    words = re.compile(r"\bmemtree\s+([A-Za-z][\w-]*)(?:\s+([^\s`'\")\]]+))?")
    old = re.compile(
        r"(?<![\w/.\"'-])(eval|train|pipeline|memstore)-("
        + "|".join(sorted({s for v in subs.values() for s in v}, key=len, reverse=True))
        + r")\b"
    )
    bad = []
    for path in _files():
        text = path.read_text(errors="replace")
        for m in words.finditer(text):
            verb, sub = m.group(1), m.group(2)
            line = text.count("\n", 0, m.start()) + 1
            if re.fullmatch(r"(eval|train|pipeline|memstore)-[\w-]+", verb):
                bad.append(f"{path.relative_to(REPO)}:{line}: memtree {verb}")
            elif (
                verb in VERBS
                and sub is not None
                and re.fullmatch(r"[a-z][a-z0-9-]*", sub)
                and sub not in subs[verb]
                and sub != "help"
            ):
                bad.append(f"{path.relative_to(REPO)}:{line}: memtree {verb} {sub}")
            elif verb in VERBS and sub is not None and sub.startswith("--") and sub != "--help":
                bad.append(
                    f"{path.relative_to(REPO)}:{line}: memtree {verb} {sub} "
                    "(the verb takes a subcommand)"
                )
        for m in old.finditer(text):
            bad.append(
                f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
            )
    assert set(ORDER) == set(top)
    assert not bad, "\n".join(bad)
