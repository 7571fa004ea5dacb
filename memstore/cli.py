"""`memtree memstore …`: plan, build and inspect hierarchical memory banks.

Thin wrappers over the memstore library. Each subcommand is one
`_add_<name>(subparsers)` that declares its flags and one `_<name>(args)`
handler that calls the library and prints; the library does the work. This
module also owns the flags of the fetch-latency simulator (`memstore.sim`):
`memtree simulate-fetch` and `memtree memstore calibrate`.

Handlers import the memstore library (and clustering) when they run, not at
module top: `memtree` builds every stage's parser on each call, and the library
pulls in torch.

    memtree memstore plan --anchor openlm-160m --memory 256,64,16,0 --type ffn
    memtree memstore plan --anchor n_layers=35,d_model=512,n_heads=12,head_dim=32,ffn_dim=2048 \\
        --memory 0,64,0,0 --placement late --json
    memtree memstore plan --anchor openlm-1.4b --memory 768,256,16,0 --ranks 8 --device-memory 80GiB
    memtree simulate-fetch --profile phone --anchor openlm-160m --memory 256,64,16,0
    memtree memstore calibrate --validate
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memtree.budget import (
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_HEADROOM,
    DEFAULT_SEQ_LEN,
    format_training_report,
    parse_bytes,
    training_report,
)
from memtree.geometry import (
    DTYPES,
    MEMORY_TYPES,
    AnchorShape,
    MemoryConfig,
    format_plan,
    get_anchor,
    human,
    human_bytes,
    parse_multipliers,
    plan,
)

if TYPE_CHECKING:
    import numpy as np


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "memstore",
        help="hierarchical memory banks: plan sizes, build and inspect the on-disk store",
        description="Plan, build and inspect hierarchical memory banks (seed 002 §2, App. A, App. I).",
    )
    subparsers = p.add_subparsers(dest="memstore_command", metavar="SUBCOMMAND")
    for add in (_add_plan, _add_init, _add_info, _add_verify, _add_fetch, _add_block, _add_split, _add_merge,
                _add_relocate, _add_calibrate):
        add(subparsers)
    p.set_defaults(func=lambda args: _help(p))
    _add_simulate(sub)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


# --- anchor parsing -----------------------------------------------------------------------------

def parse_anchor(text: str):
    """A preset name ('openlm-160m') or an explicit shape
    'n_layers=35,d_model=512,n_heads=12,head_dim=32,ffn_dim=2048[,vocab_size=…,n_kv_heads=…,
    tied_embeddings=false,…]' → AnchorShape."""
    text = text.strip()
    if "=" not in text:
        return get_anchor(text)
    fields = {f.name: f for f in dataclasses.fields(AnchorShape)}
    allowed = ", ".join(fields)
    kw: dict[str, object] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep:
            raise ValueError(f"anchor shape: {item!r} is not key=value; allowed keys: {allowed}")
        if key not in fields:
            raise ValueError(f"anchor shape: unknown key {key!r}; allowed keys: {allowed}")
        if key in kw:
            raise ValueError(f"anchor shape: key {key!r} given twice")
        kw[key] = _convert(key, str(fields[key].type), value)
    kw.setdefault("name", "custom")
    required = [f.name for f in fields.values()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in kw]
    if missing:
        raise ValueError(f"anchor shape: missing {', '.join(missing)}; allowed keys: {allowed}")
    return AnchorShape(**kw)


def _convert(key: str, annotation: str, value: str) -> object:
    if annotation == "bool":
        low = value.lower()
        if low in ("true", "1", "yes", "tied"):
            return True
        if low in ("false", "0", "no", "separate"):
            return False
        raise ValueError(f"anchor shape: {key}={value!r} is not a boolean (true/false)")
    if annotation.startswith("int"):
        if "None" in annotation and value.lower() in ("none", "null", ""):
            return None
        try:
            return int(value.replace("_", ""))
        except ValueError:
            raise ValueError(f"anchor shape: {key}={value!r} is not an integer") from None
    choices = re.findall(r"[\"']([^\"']+)[\"']", annotation) if annotation.startswith("Literal") else []
    if choices and value not in choices:
        raise ValueError(f"anchor shape: {key}={value!r} is not one of {choices}")
    return value


# --- plan ---------------------------------------------------------------------------------------

def _add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--anchor", required=True,
                   help="preset name (e.g. openlm-160m) or shape "
                        "n_layers=35,d_model=512,n_heads=12,head_dim=32,ffn_dim=2048[,…]")
    p.add_argument("--memory", required=True, help="multipliers per level, e.g. 256,64,16,0")
    p.add_argument("--type", default="ffn", choices=MEMORY_TYPES, help="memory type (default ffn)")
    p.add_argument("--placement", choices=("uniform", "early", "middle", "late", "explicit"),
                   help="which layers carry memory (default uniform; explicit with --layers)")
    p.add_argument("--placement-layers", type=int, default=10,
                   help="layers used by early/middle/late (default 10, as App. F)")
    p.add_argument("--layers", help="explicit memory layers, e.g. 0,5,9 (implies --placement explicit)")
    p.add_argument("--branching", type=int, default=16, help="tree branching factor (default 16)")
    p.add_argument("--no-preserve-total", dest="preserve_total", action="store_false",
                   help="give every chosen layer the full multiplier instead of keeping the uniform "
                        "parameter budget")


def _memory_config(args: argparse.Namespace, branching: int | None = None):
    layers = _parse_layers(args.layers) if args.layers else ()
    placement = args.placement or ("explicit" if layers else "uniform")
    return MemoryConfig(multipliers=parse_multipliers(args.memory), type=args.type, placement=placement,
                        placement_layers=args.placement_layers, layers=layers,
                        preserve_total=args.preserve_total, branching=branching or args.branching)


# --- plan ---------------------------------------------------------------------------------------

def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="parameter and byte accounting for an anchor + memory configuration",
        description="Print anchor, per-level block, fetched, bank and runtime parameters, and the "
                    "bytes of each in every storage dtype. Nothing is written.",
    )
    _add_memory_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    t = p.add_argument_group(
        "training memory per rank (memtree/budget.py)",
        "With --ranks, also print the bytes one training rank holds for each layout (replicated or "
        "sharded bank × DDP or FSDP anchor), whether it fits the device and from how many ranks it "
        "would. Activations and workspace are not modelled; --headroom is kept free for them.")
    t.add_argument("--ranks", type=int, metavar="N", help="data-parallel ranks (GPUs) to plan for")
    t.add_argument("--device-memory", metavar="SIZE",
                   help="memory of one device, e.g. 80GiB (GiB/Gi = 2^30 bytes, GB/G = 10^9); "
                        "required with --ranks")
    t.add_argument("--global-batch", type=int, default=DEFAULT_GLOBAL_BATCH, metavar="SEQS",
                   help=f"sequences per optimizer step over all ranks (default {DEFAULT_GLOBAL_BATCH}: "
                        "the paper's 2M tokens at 2048 per sequence)")
    t.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, metavar="TOKENS",
                   help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}); reported only, as the "
                        "activations it sizes are not modelled")
    t.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, metavar="FRACTION",
                   help=f"fraction of device memory kept for activations and workspace "
                        f"(default {DEFAULT_HEADROOM})")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    p = plan(parse_anchor(args.anchor), _memory_config(args))
    report = None
    if args.ranks is not None:
        if args.device_memory is None:
            raise ValueError("--ranks needs --device-memory SIZE (e.g. --device-memory 80GiB)")
        report = training_report(p, ranks=args.ranks, device_bytes=parse_bytes(args.device_memory),
                                 headroom=args.headroom, global_batch=args.global_batch,
                                 seq_len=args.seq_len)
    elif args.device_memory is not None:
        raise ValueError("--device-memory is used with --ranks N; give the number of ranks")
    if args.json:
        out = p.to_dict()
        if report is not None:
            out["training_memory"] = report.to_dict()
        print(json.dumps(out, indent=2))
        return 0
    print(format_plan(p))
    if report is not None:
        print()
        print(format_training_report(report, args.device_memory))
    return 0


# --- init ---------------------------------------------------------------------------------------

def _add_init(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "init", help="create a bank on disk, initialised as App. I (memories have no effect at step 0)",
        description="Write a new memory bank (atomically). With --tree the bank is bound to that "
                    "clustering tree and refuses any other.",
    )
    p.add_argument("out", help="bank directory to create (replaced if it exists)")
    _add_memory_args(p)
    p.add_argument("--tree", help="clustering tree directory (e.g. RUN/tree); sets branching and binds the bank")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16", "int8", "int4"))
    p.add_argument("--rank", type=int, help="store every block tensor factorised to this rank")
    p.add_argument("--subtree", type=int, help="write only this level-1 subtree (a per-subtree bank)")
    p.add_argument("--no-generic", dest="generic", action="store_false", help="no generic-memory slot")
    p.add_argument("--init", choices=("paper", "zeros"), default="paper")
    p.add_argument("--std", type=float, default=0.02, help="truncated-normal std for W1/W2 and keys")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_init)


def _init(args: argparse.Namespace) -> int:
    from memstore.format import paper_init, write_bank, zeros_init

    tree_id, branching = None, None
    if args.tree:
        from clustering.tree import compute_tree_id, load_tree

        tree = load_tree(args.tree)
        tree_id, branching = compute_tree_id(tree), tree.branching
        if len(args.memory.split(",")) > tree.levels:
            raise ValueError(f"--memory {args.memory}: the tree has only {tree.levels} levels")
    info = write_bank(args.out, anchor=parse_anchor(args.anchor), memory=_memory_config(args, branching),
                      dtype=args.dtype, rank=args.rank, tree_id=tree_id, subtree=args.subtree,
                      generic=args.generic,
                      init=paper_init(args.seed, args.std) if args.init == "paper" else zeros_init,
                      progress=True)
    print(_describe(info))
    return 0


def _describe(info) -> str:
    lines = [f"bank {info.root}  (memtree-bank v{info.manifest['version']}, generation {info.generation})",
             (f"  tree {info.tree_id or '(unbound)'}  subtree {info.subtree if info.subtree is not None else 'all'}"
             f"  dtype {info.dtype}{f' rank {info.rank}' if info.rank else ''}  type {info.memory.type}")]
    total = 0
    for lv in info.levels.values():
        total += lv.file_bytes
        lines.append(f"  level {lv.level}: m={lv.multiplier} {lv.n_blocks:,} blocks × {human(lv.params)} params, "
                     f"record {lv.record_bytes:,} B, stride {lv.stride:,} B, file {lv.file} "
                     f"({human_bytes(lv.file_bytes)})")
    lines.append(f"  total {human_bytes(total)}")
    return "\n".join(lines)


# --- info / verify ------------------------------------------------------------------------------

def _add_info(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("info", help="describe a bank: levels, sizes, blocked and deleted blocks")
    p.add_argument("bank")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_info)


def _info(args: argparse.Namespace) -> int:
    from memstore.format import read_manifest
    from memstore.journal import recover
    from memstore.store import read_policy

    recover(args.bank)
    info = read_manifest(args.bank)
    policy = read_policy(info.root)
    if args.json:
        print(json.dumps({"manifest": info.manifest, "policy": policy}, indent=2))
        return 0
    print(_describe(info))
    print(f"  fallback {policy['fallback']}; blocked {_count(policy['blocked'])}; "
          f"deleted {_count(info.manifest.get('deleted', {}))}")
    return 0


def _count(runs: dict) -> str:
    per = {lv: sum(b - a for a, b in r) for lv, r in runs.items() if r}
    return ", ".join(f"L{lv}: {n:,}" for lv, n in sorted(per.items())) or "none"


def _add_verify(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("verify", help="check every block against its checksum")
    p.add_argument("bank")
    p.add_argument("--tree", help="also check the bank belongs to this tree")
    p.set_defaults(func=_verify)


def _verify(args: argparse.Namespace) -> int:
    from memstore.format import check_tree, read_manifest, verify_bank
    from memstore.journal import recover

    recover(args.bank)
    if args.tree:
        from clustering.tree import load_tree

        check_tree(read_manifest(args.bank), load_tree(args.tree))
    r = verify_bank(args.bank)
    print(f"ok: {r['blocks_checked']:,} blocks verified in levels {r['levels']} (generation {r['generation']})")
    return 0


# --- fetch --------------------------------------------------------------------------------------

def _add_fetch(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("fetch", help="fetch the blocks of a cluster path (or a query text) and show counters")
    p.add_argument("bank")
    p.add_argument("--path", help="global cluster ids per level, e.g. 3,52,843")
    p.add_argument("--text", help="route this query text through --tree to get the path")
    p.add_argument("--tree", help="clustering tree directory (binds and routes)")
    p.set_defaults(func=_fetch)


def _fetch(args: argparse.Namespace) -> int:
    from memstore.store import MemoryStore

    tree = None
    if args.tree:
        from clustering.tree import load_tree

        tree = load_tree(args.tree)
    if args.text:
        if tree is None:
            raise ValueError("--text needs --tree to route the query")
        from clustering.route import route_texts

        path = [int(c) for c in route_texts(tree, [args.text])[0]]
    elif args.path:
        path = [int(c) for c in args.path.split(",")]
    else:
        raise ValueError("give --path or --text")
    with MemoryStore(args.bank, tree=tree) as store:
        blocks = store.fetch(path, flat=True)
        print(f"path {path}")
        for lv, t in blocks.items():
            state = " (refused: fallback " + store.fallback + ")" if store.is_refused(lv, path[lv - 1]) else ""
            print(f"  level {lv}: cluster {path[lv - 1]} → {t.numel():,} params {t.dtype}, "
                  f"|x|₁={float(t.float().abs().sum()):.4g}{state}")
        print(json.dumps(store.stats()["tiers"], indent=2))
    return 0


# --- block / unblock / delete -------------------------------------------------------------------

def _add_block(subparsers: argparse._SubParsersAction) -> None:
    for name, helptext in (("block", "refuse blocks (never read; fetch serves the fallback)"),
                           ("unblock", "lift a block"), ("delete", "erase blocks' bytes on disk (irreversible)")):
        p = subparsers.add_parser(name, help=helptext)
        p.add_argument("bank")
        p.add_argument("--level", type=int, default=1)
        p.add_argument("--clusters", help="global cluster ids at --level, e.g. 3,7")
        p.add_argument("--subtree", action="store_true", help="include every descendant at deeper levels")
        p.add_argument("--reason", default="", help="recorded in the audit log")
        p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                       help="if another process is writing the bank, wait this long for it (default: fail at "
                            "once, naming it)")
        if name == "block":
            p.add_argument("--queries", help="adversarial: a text file, one query per line; block the subtrees "
                                             "they route to (needs --tree)")
            p.add_argument("--tree", help="clustering tree directory")
            p.add_argument("--fraction", type=float, default=1 / 16,
                           help="share of the bank to block with --queries or --random (default 1/16)")
            p.add_argument("--random", action="store_true", help="control: block random subtrees")
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--fallback", choices=("zeros", "generic"), help="what fetch serves instead")
        p.set_defaults(func=_block, action=name)


def _block(args: argparse.Namespace) -> int:
    from memstore.store import MemoryStore

    clusters = [int(c) for c in args.clusters.split(",")] if args.clusters else []
    with MemoryStore(args.bank, lock_wait=args.wait) as store:
        if args.action == "block" and args.fallback:
            store.set_fallback(args.fallback)
        if args.action == "block" and (args.queries or args.random):
            from memstore.blocking import adversarial_block, random_block

            if args.random:
                report = random_block(store, fraction=args.fraction, level=args.level, seed=args.seed,
                                      reason=args.reason or "random blocking (control)")
            else:
                if not args.tree:
                    raise ValueError("--queries needs --tree to route the queries")
                from clustering.tree import load_tree

                with open(args.queries, encoding="utf-8") as f:
                    texts = [line.strip() for line in f if line.strip()]
                tree = load_tree(args.tree)
                from memstore.format import check_tree

                check_tree(store.info, tree)
                report = adversarial_block(store, texts=texts, tree=tree, fraction=args.fraction,
                                           level=args.level, reason=args.reason or "adversarial blocking")
            print(json.dumps(report, indent=2))
            return 0
        if not clusters:
            raise ValueError(f"{args.action}: give --clusters (or --queries/--random for block)")
        fn = {"block": store.block, "unblock": store.unblock, "delete": store.delete}[args.action]
        counts = fn(args.level, clusters, subtree=args.subtree, reason=args.reason)
        print(f"{args.action}: " + ", ".join(f"level {lv}: {n:,}" for lv, n in sorted(counts.items()))
              + f"; {store.blocked_fraction():.4%} of the bank refused")
    return 0


# --- split / merge / relocate -------------------------------------------------------------------

def _add_split(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("split", help="write per-level-1-subtree banks (one training job each)")
    p.add_argument("bank")
    p.add_argument("out", help="directory; writes OUT/subtree-SSS")
    p.add_argument("--subtrees", help="which subtrees (default all), e.g. 0,3")
    p.set_defaults(func=_split)


def _split(args: argparse.Namespace) -> int:
    from memstore.format import read_manifest
    from memstore.merge import split_bank

    B = read_manifest(args.bank).memory.branching
    subtrees = [int(s) for s in args.subtrees.split(",")] if args.subtrees else range(B)
    for s in subtrees:
        info = split_bank(args.bank, s, Path(args.out) / f"subtree-{s:03d}")
        print(f"wrote {info.root}")
    return 0


def _add_merge(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("merge", help="merge per-subtree banks into one bank")
    p.add_argument("out")
    p.add_argument("parts", nargs="+", help="per-subtree bank directories (all subtrees, any order)")
    p.add_argument("--generic", choices=("mean", "first"), default="mean",
                   help="how to combine the subtree jobs' generic memories (default mean)")
    p.set_defaults(func=_merge)


def _merge(args: argparse.Namespace) -> int:
    from memstore.merge import merge_banks

    print(_describe(merge_banks(args.parts, args.out, generic=args.generic)))
    return 0


def _add_relocate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("relocate", help="move one level's file to another directory or fsspec URL")
    p.add_argument("bank")
    p.add_argument("--level", type=int, required=True)
    p.add_argument("--to", required=True, help="directory or URL (e.g. /mnt/external/bank or s3://bucket/bank)")
    p.set_defaults(func=_relocate)


def _relocate(args: argparse.Namespace) -> int:
    from memstore.merge import relocate_level

    print(f"level {args.level} now at {relocate_level(args.bank, args.level, args.to)}")
    return 0


def _parse_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.strip("()[] ").split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--layers {text!r}: expected comma-separated layer indices like 0,5,9") from None


# --- simulate-fetch (memstore.sim) --------------------------------------------------------------

def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate-fetch",
        help="simulate on-device memory fetch latency (hierarchical vs flat bank, sessions, sweeps)",
        description="Model fetch latency of a hierarchical bank vs a flat bank of equal fetch size on "
                    "hardware profiles (RAM / flash / disk tiers), over one fetch, a session trace with a "
                    "cache, and sweeps of memory configurations (seed 002 §3, Fig. 5).",
    )
    add_simulate_arguments(p)
    p.set_defaults(func=run_simulate)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", action="append", dest="profiles", metavar="phone|laptop|PATH",
                        help="hardware profile (repeatable; default: phone and laptop)")
    parser.add_argument("--anchor", default="openlm-160m", help="anchor preset (default openlm-160m)")
    parser.add_argument("--memory", default="256,64,16,0", help="multipliers per level (default 256,64,16,0)")
    parser.add_argument("--type", default="ffn", choices=MEMORY_TYPES, help="memory type (default ffn)")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES, help="storage dtype (default bf16)")
    parser.add_argument("--policy", default="hierarchical", choices=("hierarchical", "flat"),
                        help="placement of the hierarchical bank's levels (default hierarchical)")
    parser.add_argument("--pin-tier", metavar="TIER",
                        help="store both banks on this one tier, e.g. disk (Fig. 5 right); overrides --policy")
    parser.add_argument("--branching", type=int, default=16, help="tree branching (default 16)")
    parser.add_argument("--trace", default="zipf", metavar="zipf|PATH.npy|PATH.jsonl",
                        help="query trace: synthetic Zipf sessions (default) or a file of cluster paths")
    parser.add_argument("--queries-file", help="real queries, one per line (needs --tree); overrides --trace")
    parser.add_argument("--tree", help="clustering tree directory to route --queries-file through")
    parser.add_argument("--n-queries", type=int, default=1000, help="queries in a zipf trace (default 1000)")
    parser.add_argument("--cache-gb", type=float, help="session cache budget (default: the profile's cache_gb)")
    parser.add_argument("--count-cache-copy", action="store_true",
                        help="charge cache hits a copy at the fastest tier's bandwidth")
    parser.add_argument("--sweep", help='memory configs to compare, e.g. "256,64,16,0;0,16,4,1;5376,0,0,0"')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/simulate-fetch", help="output directory (default runs/simulate-fetch)")


def _cli_trace(args: argparse.Namespace, levels: int) -> tuple[np.ndarray, str]:
    from memstore.sim.latency import load_trace, trace_from_texts, zipf_trace

    if args.queries_file:
        if not args.tree:
            raise ValueError("--queries-file needs --tree (the clustering tree to route the queries through)")
        qf = Path(args.queries_file)
        if not qf.is_file():
            raise FileNotFoundError(f"queries file not found: {qf}")
        texts = [line.strip() for line in qf.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not texts:
            raise ValueError(f"{qf}: no queries (one per line)")
        return trace_from_texts(args.tree, texts), f"queries:{qf}"
    if args.tree:
        raise ValueError("--tree is only used with --queries-file")
    if args.trace == "zipf":
        return zipf_trace(args.n_queries, args.branching, levels, seed=args.seed), "zipf"
    return load_trace(args.trace), f"file:{args.trace}"


def run_simulate(args: argparse.Namespace) -> int:
    from memstore.sim.latency import Policy, pinned, simulate_fetch, simulate_session, sweep
    from memstore.sim.profiles import load_profile
    from memstore.sim.report import ProfileResults, format_table, write_report

    profiles = [load_profile(name) for name in (args.profiles or ["phone", "laptop"])]
    mult = parse_multipliers(args.memory)
    p = plan(args.anchor, mult, type=args.type, branching=args.branching)
    trace, trace_kind = _cli_trace(args, p.memory.n_levels)
    cache_bytes = None if args.cache_gb is None else round(args.cache_gb * 1e9)
    configs = [parse_multipliers(c) for c in args.sweep.split(";") if c.strip()] if args.sweep else []
    placement: Policy = pinned(p, args.pin_tier) if args.pin_tier else args.policy
    results = []
    for prof in profiles:
        rows: list[dict[str, Any]] = []
        if configs:
            # A zipf trace is redrawn per config so configs of other depths can be swept too.
            rows = sweep(args.anchor, configs, prof, type=args.type, dtype=args.dtype, policy=args.policy,
                         pin_tier=args.pin_tier, branching=args.branching,
                         trace=None if trace_kind == "zipf" else trace, n_queries=args.n_queries, seed=args.seed,
                         cache_bytes=cache_bytes, count_cache_copy=args.count_cache_copy)
        results.append(ProfileResults(
            profile=prof, fetch=simulate_fetch(p, prof, args.dtype, placement, flat_tier=args.pin_tier),
            session=simulate_session(p, prof, trace, args.dtype, cache_bytes, policy=placement,
                                     flat_tier=args.pin_tier, count_cache_copy=args.count_cache_copy),
            sweep=tuple(rows)))
    meta = {"anchor": args.anchor, "memory": list(mult), "type": args.type, "dtype": args.dtype,
            "policy": args.policy, "pin_tier": args.pin_tier, "branching": args.branching, "trace": trace_kind,
            "n_queries": int(trace.shape[0]), "seed": args.seed, "count_cache_copy": args.count_cache_copy,
            "plan": p.to_dict()}
    paths = write_report(results, args.out, meta=meta)
    print(format_table(results))
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


# --- calibrate (memstore.sim.calibrate) ---------------------------------------------------------

CALIBRATE_OUT = "runs/calibrate/this-machine.yaml"
CALIBRATE_WORKDIR = "runs/calibrate/work"
_KiB, _MiB = 1 << 10, 1 << 20


def _add_calibrate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure this machine's RAM / flash (/ disk) tiers through the real store; write a profile",
        description="Time real fetches from file-backed banks (O_DIRECT where possible), fit latency + "
                    "bandwidth per tier and write a memtree-hw-profile YAML for simulate-fetch.",
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
    parser.add_argument("--out", default=CALIBRATE_OUT, metavar="PROFILE.yaml",
                        help=f"where to write the measured profile (default {CALIBRATE_OUT})")
    parser.add_argument("--workdir", default=None,
                        help="scratch directory for the calibration banks, on the flash device to measure "
                             f"(default {CALIBRATE_WORKDIR})")
    parser.add_argument("--tiers", default="ram,flash", help="tiers to measure (default ram,flash)")
    parser.add_argument("--disk-dir", help="also measure a 'disk' tier with level files moved to this directory")
    parser.add_argument("--repeats", type=int, default=30, help="random fetches per tier and size (default 30)")
    parser.add_argument("--sizes", default=None,
                        help="block sizes, multiples of 4096 (default 4K,16K,64K,256K,1M,4M,16M,32M)")
    parser.add_argument("--bank-mb", type=float, default=64,
                        help="bytes per calibration bank (at least 4 blocks; default 64 MiB)")
    parser.add_argument("--no-direct", dest="direct", action="store_false",
                        help="buffered reads with posix_fadvise(DONTNEED) before each, instead of O_DIRECT")
    parser.add_argument("--verify", default="always", choices=("always", "once", "never"),
                        help="store checksum mode while timing (default always, the store's default)")
    parser.add_argument("--name", default="this-machine", help="profile name (default this-machine)")
    parser.add_argument("--validate", action="store_true",
                        help="then fetch random paths of a 3-level openlm-160m bank (FFN 64,16,4, branching 4) "
                             "and compare with simulate_fetch on the new profile")
    parser.add_argument("--n-fetches", type=int, default=40, help="paths fetched by --validate (default 40)")
    parser.add_argument("--keep", action="store_true", help="keep the calibration banks in --workdir")
    parser.add_argument("--seed", type=int, default=0)


def run_calibrate(args: argparse.Namespace) -> int:
    from memstore.sim.calibrate import (
        DEFAULT_SIZES,
        format_calibration,
        format_validation,
        measure,
        validate,
        write_profile,
    )

    out = Path(args.out)
    workdir = Path(args.workdir) if args.workdir else Path(CALIBRATE_WORKDIR)
    sizes = tuple(parse_size(s) for s in args.sizes.split(",") if s.strip()) if args.sizes else DEFAULT_SIZES
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    cal = measure(workdir, tiers=tiers, sizes=sizes, repeats=args.repeats, direct=args.direct,
                  disk_dir=args.disk_dir, bank_bytes=int(args.bank_mb * _MiB), verify=args.verify, seed=args.seed,
                  keep=args.keep, name=args.name, progress=lambda msg: print(msg, flush=True))
    print(format_calibration(cal))
    prof = write_profile(cal, out)
    print(f"profile: {out}")
    if args.validate:
        v = validate(prof, workdir, n_fetches=args.n_fetches, direct=args.direct, verify=args.verify,
                     disk_dir=args.disk_dir, seed=args.seed, keep=args.keep)
        print(format_validation(v))
    return 0
