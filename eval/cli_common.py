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


def gate_spec(text: str):
    """argparse type for `--gate`: LEVEL:QUANTILE or LEVEL:=THRESHOLD (`clustering.gate`)."""
    from memtree.clustering.gate import GateSpec

    try:
        return GateSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_gate(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gate",
        type=gate_spec,
        metavar="LEVEL:QUANTILE",
        help="add a gated setting: fetched memory only for queries whose cosine similarity to "
        "their level-LEVEL cluster (LEVEL: 1, 2, … or leaf) reaches the QUANTILE of the training "
        "windows' own (e.g. leaf:0.01), or a given similarity (leaf:=0.4); the anchor alone "
        "elsewhere (memtree.clustering.gate)",
    )
    p.add_argument(
        "--gate-windows",
        metavar="EMBEDDINGS_NPY",
        help="with --gate: the training windows' embeddings to calibrate on (default: the "
        "pipeline's embed/embeddings.npy beside the tree)",
    )


def apply_gate(rm, args: argparse.Namespace) -> None:
    """Calibrate `--gate` on the run's tree and set it on the RunModel `rm`."""
    if args.gate is None:
        if args.gate_windows:
            raise ValueError("--gate-windows: only with --gate")
        return
    if not rm.has_memory or rm.tree is None:
        raise ValueError("--gate: the run has no bank (and tree) to gate")
    from memtree.clustering.gate import calibrate

    rm.gate = calibrate(rm.tree, args.gate, embeddings=args.gate_windows)
    g = rm.gate
    how = (
        f"the {g.quantile:g} quantile of {g.windows:,} training windows" if g.quantile else "given"
    )
    print(
        f"[gate] level {g.level}, cosine ≥ {g.threshold:.4f} ({how})", file=sys.stderr, flush=True
    )
