"""What every `memtree memstore …` subcommand shares: one way to say one thing.

The conventions (memstore/README.md, "Command-line conventions"): the bank a command works on is
its first positional argument; a file of queries, one per line, is `--queries FILE`; one query
text is `--query TEXT`; where a command writes is `--out PATH`; the clustering tree is
`--tree DIR`; a writer waits for another process's lock with `--wait SECONDS`; output is a
human-readable summary on stdout, or JSON with `--json`; notes (warnings) go to
stderr, one line each.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memtree.geometry import human, human_bytes
from memtree.io import read_json

# what `memtree memstore init` records in the banks it writes: such a bank holds no training yet
INIT_MARK = "memtree memstore init"


def note(message: str) -> None:
    """One line to stderr (warnings, progress): stdout stays the command's summary or JSON."""
    print(f"memtree: note: {message}", file=sys.stderr)


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of the text summary")


def add_wait(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="if another process is writing the bank, wait this "
        "long for it (default: fail at once, naming it)",
    )


def emit(args: argparse.Namespace, text: str, data: Any) -> None:
    """The command's result: `text` by default, `data` as JSON with --json."""
    print(json.dumps(data, indent=2, default=str) if getattr(args, "json", False) else text)


def read_lines(path: str, flag: str, what: str, whats: str) -> list[str]:
    """The non-empty lines of a text file holding one `what` per line (surrounding whitespace
    dropped); errors name the flag and the file."""
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"{flag} {path}: file not found (expected a text file, one {what} per line)"
        )
    if p.is_dir():
        raise ValueError(
            f"{flag} {path}: is a directory (expected a text file, one {what} per line)"
        )
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{flag} {path}: cannot read it ({getattr(e, 'strerror', None) or e})"
        ) from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(
            f"{flag} {path}: no {whats} in the file (it is empty; expected one {what} per line)"
        )
    return lines


def read_queries(path: str, flag: str = "--queries") -> list[str]:
    """The non-empty lines of a queries file; errors name the flag and the file."""
    return read_lines(path, flag, "query", "queries")


def read_document_ids(path: str, flag: str = "--documents") -> list[str]:
    """The document ids of a file (the ingest's doc_id, one per line), unique, in file order."""
    return list(dict.fromkeys(read_lines(path, flag, "document id", "document ids")))


def load_tree_arg(path: str, flag: str = "--tree"):
    """`clustering.tree.load_tree` with errors that name the flag."""
    from memtree.clustering.tree import load_tree

    p = Path(path)
    if not (p / "tree.json").is_file() and not (p.name == "tree.json" and p.is_file()):
        what = "not found" if not p.exists() else "not a clustering tree directory (no tree.json)"
        raise ValueError(
            f"{flag} {path}: {what}; give the tree directory a pipeline run wrote, e.g. RUN/tree"
        )
    return load_tree(p)


def check_bank(path: str) -> Path:
    """A bank directory that exists, or an error naming it (before any lock or recovery touches
    it)."""
    p = Path(path)
    if p.name == "manifest.json" and p.is_file():
        raise ValueError(
            f"bank {path}: give the bank's directory ({p.parent}), not its manifest.json"
        )
    if not (p / "manifest.json").is_file():
        what = "not found" if not p.exists() else "not a memory bank (no manifest.json)"
        raise ValueError(f"bank {path}: {what}; create one with `memtree memstore init BANK …`")
    return p


def parse_ids(text: str, flag: str) -> list[int]:
    try:
        ids = [int(c) for c in text.replace(" ", "").split(",") if c]
    except ValueError:
        raise ValueError(
            f"{flag} {text!r}: expected comma-separated integer cluster ids, e.g. 3,7"
        ) from None
    if not ids:
        raise ValueError(f"{flag} {text!r}: no cluster ids given")
    return ids


def check_replace(bank: str, force: bool) -> bool:
    """May `init` (or `export --out`) write BANK? True when it replaces a bank. A fresh, untouched
    `init` bank is replaced freely; trained or edited weights or an audit log need --force; anything
    else that is not an empty directory (a training checkpoint included) is never replaced."""
    p = Path(bank)
    if not p.exists() or (p.is_dir() and not any(p.iterdir())):
        return False
    if not (p / "manifest.json").is_file():
        raise ValueError(
            f"{bank} exists and is not a memory bank; refusing to replace it (choose another BANK)"
        )
    manifest = read_json(p / "manifest.json")
    if manifest.get("format") != "memtree-bank":
        raise ValueError(
            f"{bank} holds a {manifest.get('format')!r}, not a memory "
            "bank; refusing to replace it (choose another BANK)"
        )
    held = []
    if (manifest.get("extra") or {}).get("written_by") != INIT_MARK or int(
        manifest.get("generation", 0)
    ):
        held.append("trained or edited weights")
    if (p / "audit.jsonl").exists():
        held.append("an audit log of blocks / deletions")
    if held and not force:
        raise ValueError(
            f"{bank} already holds a bank with {' and '.join(held)}; add --force to replace it"
        )
    return True


def describe_bank(info) -> str:
    """The summary `init`, `info`, `merge` and `export` print of a bank
    (`memstore.format.BankInfo`)."""
    lines = [
        (
            f"bank {info.root}  (memtree-bank "
            f"v{info.manifest['version']}, generation {info.generation})"
        ),
        (
            f"  tree {info.tree_id or '(unbound)'}  subtree "
            f"{info.subtree if info.subtree is not None else 'all'}  dtype "
            f"{info.dtype}{f' rank {info.rank}' if info.rank else ''}  type {info.memory.type}"
        ),
    ]
    total = 0
    for lv in info.levels.values():
        total += lv.file_bytes
        lines.append(
            f"  level {lv.level}: m={lv.multiplier} {lv.n_blocks:,} blocks × {human(lv.params)} "
            f"params, record {lv.record_bytes:,} B, stride {lv.stride:,} B, file {lv.file} "
            f"({human_bytes(lv.file_bytes)})"
        )
    lines.append(f"  total {human_bytes(total)}")
    return "\n".join(lines)


def check_level(levels: Sequence[int], level: int, flag: str = "--level") -> int:
    """A level that holds memory, or an error that names the flag and the levels that do."""
    if level not in levels:
        have = sorted(levels)
        raise ValueError(
            f"{flag} {level}: level {level} holds no memory in this bank (levels that do: "
            f"{', '.join(map(str, have))}); give {' or '.join(f'{flag} {lv}' for lv in have)}"
        )
    return level


def levels_text(counts: dict[int, int]) -> str:
    return ", ".join(f"level {lv}: {n:,}" for lv, n in sorted(counts.items())) or "nothing"
