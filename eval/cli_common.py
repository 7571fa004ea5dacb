"""What the eval commands share: a named file's check, a note on stderr, `--out` as the
config's `out=` override, a bios demo run's ROOT checked before anything slow runs. Used by
eval/cli.py and by the eval commands of each system folder (`camelot/`, `context/`, `finetune/`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def need_file(path: str | Path, what: str) -> Path:
    """`path` when it exists, else an error naming the flag or key (`what`) that gave it."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{what} {path}: no such file or directory")
    return Path(path)


def note(cmd: str, msg: str) -> None:
    print(f"memtree {cmd}: {msg}", file=sys.stderr, flush=True)


def out_override(args: argparse.Namespace) -> list[str]:
    """`--out PATH` as the config's `out=` override (applied last); an `out=` among the overrides
    that says otherwise is an error, not a silent choice."""
    given = [o.split("=", 1)[1] for o in args.overrides if o.split("=", 1)[0] == "out"]
    if given and args.out is not None and given[-1] != args.out:
        raise ValueError(f"--out {args.out} and out={given[-1]} disagree; give one")
    return [f"out={args.out}"] if args.out is not None else []


def config_file(path: str | None, what: str) -> str | None:
    return str(need_file(path, what)) if path else None


def check_demo_root(root: str, cmd: str, files: tuple[str, ...]) -> None:
    """A bios demo run's ROOT: each file the command reads, named when missing."""
    missing = [f for f in files if not (Path(root) / f).exists()]
    if missing:
        raise FileNotFoundError(
            f"{cmd} ROOT {root}: no {', '.join(missing)} there (ROOT is a bios demo run: "
            "memtree demo's --root)"
        )
