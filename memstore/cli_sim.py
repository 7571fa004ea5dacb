"""`memtree memstore simulate-fetch` and `memtree memstore calibrate`: the flags of the
fetch-latency simulator (`memstore.sim`); `memstore.cli` registers them.

With `--tree`, simulate-fetch takes what the tree implies from it: the branching, and the number
of levels (the default `--memory` is cut to the tree's depth; routed paths are cut to the
memory's depth), so the paths it routes are always valid for the simulated bank.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memtree.cli import positive
from memtree.geometry import DTYPES, MEMORY_TYPES, parse_multipliers, plan
from memtree.memstore.cli_common import add_json, emit, load_tree_arg, read_queries

if TYPE_CHECKING:
    import numpy as np

DEFAULT_MEMORY = "256,64,16,0"
DEFAULT_BRANCHING = 16


def add_simulate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate-fetch",
        help="simulate on-device memory fetch latency (hierarchical vs flat bank, "
        "sessions, sweeps)",
        description="Model fetch latency of a hierarchical bank vs a flat bank of equal fetch size "
        "on hardware profiles (RAM / flash / disk tiers), over one fetch, a session trace with a "
        "cache, and sweeps of memory configurations (seed 002 §3, Fig. 5).",
    )
    add_simulate_arguments(p)
    p.set_defaults(func=run_simulate)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        action="append",
        dest="profiles",
        metavar="phone|laptop|PATH",
        help="hardware profile (repeatable; default: phone and laptop)",
    )
    parser.add_argument(
        "--anchor", default="openlm-160m", help="anchor preset (default openlm-160m)"
    )
    parser.add_argument(
        "--memory",
        help=f"multipliers per level (default {DEFAULT_MEMORY}, cut to the --tree's levels)",
    )
    parser.add_argument(
        "--type", default="ffn", choices=MEMORY_TYPES, help="memory type (default ffn)"
    )
    parser.add_argument(
        "--dtype", default="bf16", choices=DTYPES, help="storage dtype (default bf16)"
    )
    parser.add_argument(
        "--policy",
        default="hierarchical",
        choices=("hierarchical", "flat"),
        help="placement of the hierarchical bank's levels (default hierarchical)",
    )
    parser.add_argument(
        "--pin-tier",
        metavar="TIER",
        help="store both banks on this one tier, e.g. disk (Fig. 5 right); overrides --policy",
    )
    parser.add_argument(
        "--branching",
        type=positive,
        help=f"tree branching (default: the --tree's, else {DEFAULT_BRANCHING})",
    )
    parser.add_argument(
        "--trace",
        default="zipf",
        metavar="zipf|PATH.npy|PATH.jsonl",
        help="query trace: synthetic Zipf sessions (default) or a file of cluster paths",
    )
    parser.add_argument(
        "--queries",
        metavar="FILE",
        help="real queries, one per line, routed through --tree; overrides --trace",
    )
    parser.add_argument(
        "--tree",
        help="clustering tree directory (e.g. RUN/tree): routes "
        "--queries and sets the branching and the number of levels",
    )
    parser.add_argument(
        "--n-queries", type=positive, default=1000, help="queries in a zipf trace (default 1000)"
    )
    parser.add_argument(
        "--cache-gb", type=float, help="session cache budget (default: the profile's cache_gb)"
    )
    parser.add_argument(
        "--count-cache-copy",
        action="store_true",
        help="charge every block the cache hands out (each hit, and each miss it keeps) a copy at "
        "the fastest tier's bandwidth, as the store's cache copies its blocks out",
    )
    parser.add_argument(
        "--sweep", help='memory configs to compare, e.g. "256,64,16,0;0,16,4,1;5376,0,0,0"'
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        default="runs/simulate-fetch",
        help="output directory (default runs/simulate-fetch)",
    )
    add_json(parser)


def _tree_geometry(args: argparse.Namespace) -> tuple[Any, str, int]:
    """(tree or None, --memory, branching) with what --tree implies filled in and checked."""
    if args.queries and not args.tree:
        raise ValueError(
            "--queries needs --tree (the clustering tree to route the queries through)"
        )
    if not args.tree:
        return None, args.memory or DEFAULT_MEMORY, args.branching or DEFAULT_BRANCHING
    tree = load_tree_arg(args.tree)
    if args.branching is not None and args.branching != tree.branching:
        raise ValueError(
            f"--branching {args.branching}: the --tree has branching {tree.branching}; leave "
            "--branching out to take it from the tree"
        )
    memory = args.memory or ",".join(DEFAULT_MEMORY.split(",")[: tree.levels])
    if len(parse_multipliers(memory)) > tree.levels:
        raise ValueError(
            f"--memory {memory}: {len(parse_multipliers(memory))} "
            f"levels, but the --tree has only {tree.levels}"
        )
    return tree, memory, tree.branching


def _cli_trace(
    args: argparse.Namespace, tree: Any, branching: int, levels: int
) -> tuple[np.ndarray, str]:
    from memtree.clustering.route import route_texts
    from memtree.memstore.sim.latency import load_trace, zipf_trace

    if args.queries:
        texts = read_queries(args.queries)
        return route_texts(tree, texts)[:, :levels], f"queries:{args.queries}"
    if args.trace == "zipf":
        return zipf_trace(args.n_queries, branching, levels, seed=args.seed), "zipf"
    return load_trace(args.trace), f"file:{args.trace}"


def run_simulate(args: argparse.Namespace) -> int:
    from memtree.memstore.sim.latency import Policy, pinned, simulate_fetch, simulate_session, sweep
    from memtree.memstore.sim.profiles import load_profile
    from memtree.memstore.sim.report import ProfileResults, format_table, write_report

    tree, memory, branching = _tree_geometry(args)
    profiles = [load_profile(name) for name in (args.profiles or ["phone", "laptop"])]
    mult = parse_multipliers(memory)
    p = plan(args.anchor, mult, type=args.type, branching=branching)
    trace, trace_kind = _cli_trace(args, tree, branching, p.memory.n_levels)
    cache_bytes = None if args.cache_gb is None else round(args.cache_gb * 1e9)
    configs = (
        [parse_multipliers(c) for c in args.sweep.split(";") if c.strip()] if args.sweep else []
    )
    placement: Policy = pinned(p, args.pin_tier) if args.pin_tier else args.policy
    results = []
    for prof in profiles:
        rows: list[dict[str, Any]] = []
        if configs:
            # A zipf trace is redrawn per config so configs of other depths can be swept too.
            rows = sweep(
                args.anchor,
                configs,
                prof,
                type=args.type,
                dtype=args.dtype,
                policy=args.policy,
                pin_tier=args.pin_tier,
                branching=branching,
                trace=None if trace_kind == "zipf" else trace,
                n_queries=args.n_queries,
                seed=args.seed,
                cache_bytes=cache_bytes,
                count_cache_copy=args.count_cache_copy,
            )
        results.append(
            ProfileResults(
                profile=prof,
                fetch=simulate_fetch(p, prof, args.dtype, placement, flat_tier=args.pin_tier),
                session=simulate_session(
                    p,
                    prof,
                    trace,
                    args.dtype,
                    cache_bytes,
                    policy=placement,
                    flat_tier=args.pin_tier,
                    count_cache_copy=args.count_cache_copy,
                ),
                sweep=tuple(rows),
            )
        )
    meta = {
        "anchor": args.anchor,
        "memory": list(mult),
        "type": args.type,
        "dtype": args.dtype,
        "policy": args.policy,
        "pin_tier": args.pin_tier,
        "branching": branching,
        "trace": trace_kind,
        "tree": args.tree,
        "n_queries": int(trace.shape[0]),
        "seed": args.seed,
        "count_cache_copy": args.count_cache_copy,
        "plan": p.to_dict(),
    }
    paths = write_report(results, args.out, meta=meta)
    text = (
        format_table(results) + "\n" + "\n".join(f"{name}: {path}" for name, path in paths.items())
    )
    emit(
        args,
        text,
        {
            "meta": {k: v for k, v in meta.items() if k != "plan"},
            "files": {name: str(path) for name, path in paths.items()},
        },
    )
    return 0


# --- calibrate (memstore.sim.calibrate) ---------------------------------------------------------

CALIBRATE_OUT = "runs/calibrate/this-machine.yaml"
CALIBRATE_WORKDIR = "runs/calibrate/work"
_KiB, _MiB = 1 << 10, 1 << 20


def add_calibrate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure this machine's RAM / flash (/ disk) "
        "tiers through the real store; write a profile",
        description="Time real fetches from file-backed banks (O_DIRECT where possible), fit "
        "latency + bandwidth per tier and write a memtree-hw-profile YAML for simulate-fetch.",
    )
    add_calibrate_arguments(p)
    p.set_defaults(func=run_calibrate)


def parse_size(text: str) -> int:
    """'4K' / '4KiB' / '1M' / '32MiB' / '4096' → bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": _KiB, "M": _MiB, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if mult > 1 else t
    try:
        return int(float(num) * mult)
    except ValueError:
        raise ValueError(f"size {text!r}: expected bytes like 4096, 64K or 32M") from None


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default=CALIBRATE_OUT,
        metavar="PROFILE.yaml",
        help=f"where to write the measured profile (default {CALIBRATE_OUT})",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="scratch directory for the calibration banks, on the "
        f"flash device to measure (default {CALIBRATE_WORKDIR})",
    )
    parser.add_argument("--tiers", default="ram,flash", help="tiers to measure (default ram,flash)")
    parser.add_argument(
        "--disk-dir", help="also measure a 'disk' tier with level files moved to this directory"
    )
    parser.add_argument(
        "--repeats", type=positive, default=30, help="random fetches per tier and size (default 30)"
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help="block sizes, multiples of 4096 (default 4K,16K,64K,256K,1M,4M,16M,32M)",
    )
    parser.add_argument(
        "--bank-mb",
        type=float,
        default=64,
        help="bytes per calibration bank (at least 4 blocks; default 64 MiB)",
    )
    parser.add_argument(
        "--no-direct",
        dest="direct",
        action="store_false",
        help="buffered reads with posix_fadvise(DONTNEED) before each, instead of O_DIRECT",
    )
    parser.add_argument(
        "--verify",
        default="always",
        choices=("always", "once", "never"),
        help="store checksum mode while timing (default always, the store's default)",
    )
    parser.add_argument(
        "--name", default="this-machine", help="profile name (default this-machine)"
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="then fetch random paths of a 3-level openlm-160m bank (FFN 64,16,4, branching 4) and "
        "compare with simulate_fetch on the new profile",
    )
    parser.add_argument(
        "--n-fetches", type=int, default=40, help="paths fetched by --validate (default 40)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the calibration banks in --workdir"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_json(parser)


def run_calibrate(args: argparse.Namespace) -> int:
    from memtree.memstore.sim.calibrate import (
        DEFAULT_SIZES,
        format_calibration,
        format_validation,
        measure,
        validate,
        write_profile,
    )

    out = Path(args.out)
    workdir = Path(args.workdir) if args.workdir else Path(CALIBRATE_WORKDIR)
    sizes = (
        tuple(parse_size(s) for s in args.sizes.split(",") if s.strip())
        if args.sizes
        else DEFAULT_SIZES
    )
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    import sys

    progress = sys.stderr if args.json else sys.stdout  # --json: stdout is the JSON alone
    cal = measure(
        workdir,
        tiers=tiers,
        sizes=sizes,
        repeats=args.repeats,
        direct=args.direct,
        disk_dir=args.disk_dir,
        bank_bytes=int(args.bank_mb * _MiB),
        verify=args.verify,
        seed=args.seed,
        keep=args.keep,
        name=args.name,
        progress=lambda msg: print(msg, file=progress, flush=True),
    )
    prof = write_profile(cal, out)
    text, data = (
        f"{format_calibration(cal)}\nprofile: {out}",
        {"profile": str(out), "calibration": cal.to_dict()},
    )
    if args.validate:
        v = validate(
            prof,
            workdir,
            n_fetches=args.n_fetches,
            direct=args.direct,
            verify=args.verify,
            disk_dir=args.disk_dir,
            seed=args.seed,
            keep=args.keep,
        )
        text, data["validation"] = f"{text}\n{format_validation(v)}", v.to_dict()
    emit(args, text, data)
    return 0
