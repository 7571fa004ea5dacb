"""`memtree memstore …`: plan, build and inspect hierarchical memory banks.

Thin wrappers over the memstore library. Each subcommand is one
`_add_<name>(subparsers)` that declares its flags and one `_<name>(args)`
handler that calls the library and prints; the library does the work. Helper
modules beside it: `cli_common` (the shared conventions: `--queries FILE`,
`--query TEXT`, `--out PATH`, `--json`, errors that name the
flag; memstore/README.md "Command-line conventions"), `cli_blocking` (block /
unblock / delete), `cli_shards` (`info` / `verify` of a sharded training run's
bank checkpoint, `memtree-bank-shards`, and `export` of it into a bank) and
`cli_sim` (the flags of the fetch-latency simulator, `memstore.sim`:
`memtree memstore simulate-fetch` and `memtree memstore calibrate`, re-exported here).

Handlers import the memstore library (and clustering) when they run, not at
module top: `memtree` builds every stage's parser on each call, and the library
pulls in torch.

    memtree memstore plan --anchor openlm-160m --memory 256,64,16,0 --type ffn
    memtree memstore plan --anchor n_layers=35,d_model=512,n_heads=12,head_dim=32,ffn_dim=2048 \\
        --memory 0,64,0,0 --placement late --json
    memtree memstore plan --anchor openlm-1.4b --memory 768,256,16,0 --ranks 8 --device-memory 80GiB
    memtree memstore simulate-fetch --profile phone --anchor openlm-160m --memory 256,64,16,0
    memtree memstore calibrate --validate
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from memtree.budget import (
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_HEADROOM,
    DEFAULT_SEQ_LEN,
    format_training_report,
    parse_bytes,
    training_report,
)
from memtree.cli import Commands, nonneg, positive
from memtree.geometry import (
    MEMORY_TYPES,
    AnchorShape,
    MemoryConfig,
    format_plan,
    get_anchor,
    human_bytes,
    parse_multipliers,
    plan,
)
from memtree.memstore.cli_blocking import add_block_commands
from memtree.memstore.cli_common import (
    INIT_MARK,
    add_json,
    add_wait,
    check_bank,
    check_level,
    check_replace,
    describe_bank,
    emit,
    load_tree_arg,
    parse_ids,
    read_queries,
)
from memtree.memstore.cli_shards import add_export, is_checkpoint, shards_info, shards_verify
from memtree.memstore.cli_sim import (  # noqa: F401  (re-exported: the simulator's flags and handlers)
    CALIBRATE_OUT,
    CALIBRATE_WORKDIR,
    add_calibrate,
    add_calibrate_arguments,
    add_simulate,
    add_simulate_arguments,
    parse_size,
    run_calibrate,
    run_simulate,
)
from memtree.pretrained import SPECS as PRETRAINED


def register(cli: Commands) -> None:
    """memstore's subcommands (seed 002 §2, App. A, App. I), in --help order."""
    subparsers = cli.verb("memstore")
    for add in (
        _add_plan,
        _add_init,
        _add_info,
        _add_verify,
        add_export,
        _add_fetch,
        add_block_commands,
        _add_split,
        _add_merge,
        _add_relocate,
        add_calibrate,
        add_simulate,
    ):
        add(subparsers)


# --- anchor parsing -----------------------------------------------------------------------------


def parse_anchor(text: str):
    """A preset name ('openlm-160m'), a pretrained model's name ('smollm2-135m') or an explicit
    shape 'n_layers=35,d_model=512,n_heads=12,head_dim=32,ffn_dim=2048[,vocab_size=…,n_kv_heads=…,
    tied_embeddings=false,…]' → AnchorShape."""
    text = text.strip()
    if (
        text in PRETRAINED
    ):  # a pretrained model's own decoder (memtree.pretrained), for post-hoc memories
        return AnchorShape(**PRETRAINED[text].shape)
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
    required = [
        f.name
        for f in fields.values()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
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
    choices = (
        re.findall(r"[\"']([^\"']+)[\"']", annotation) if annotation.startswith("Literal") else []
    )
    if choices and value not in choices:
        raise ValueError(f"anchor shape: {key}={value!r} is not one of {choices}")
    return value


# --- plan ---------------------------------------------------------------------------------------


def _add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--anchor",
        required=True,
        help="preset name (e.g. openlm-160m), pretrained model (smollm2-135m, gemma3-270m) or "
        "shape n_layers=35,d_model=512,n_heads=12,head_dim=32,ffn_dim=2048[,…]",
    )
    p.add_argument("--memory", required=True, help="multipliers per level, e.g. 256,64,16,0")
    p.add_argument("--type", default="ffn", choices=MEMORY_TYPES, help="memory type (default ffn)")
    p.add_argument(
        "--placement",
        choices=("uniform", "early", "middle", "late", "explicit"),
        help="which layers carry memory (default uniform; explicit with --layers)",
    )
    p.add_argument(
        "--placement-layers",
        type=positive,
        default=10,
        help="layers used by early/middle/late (default 10, as App. F)",
    )
    p.add_argument(
        "--layers", help="explicit memory layers, e.g. 0,5,9 (implies --placement explicit)"
    )
    p.add_argument(
        "--branching",
        type=positive,
        help="tree branching factor (default 16; init --tree: the tree's)",
    )
    p.add_argument(
        "--no-preserve-total",
        dest="preserve_total",
        action="store_false",
        help="give every chosen layer the full multiplier "
        "instead of keeping the uniform parameter budget",
    )


def _memory_config(args: argparse.Namespace, branching: int | None = None):
    layers = _parse_layers(args.layers) if args.layers else ()
    placement = args.placement or ("explicit" if layers else "uniform")
    return MemoryConfig(
        multipliers=parse_multipliers(args.memory),
        type=args.type,
        placement=placement,
        placement_layers=args.placement_layers,
        layers=layers,
        preserve_total=args.preserve_total,
        branching=branching or args.branching or 16,
    )


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
        "would. Activations and workspace are not modelled; --headroom is kept free for them.",
    )
    t.add_argument(
        "--ranks", type=positive, metavar="N", help="data-parallel ranks (GPUs) to plan for"
    )
    t.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="memory of one device, e.g. 80GiB (GiB/Gi = "
        "2^30 bytes, GB/G = 10^9); required with --ranks",
    )
    t.add_argument(
        "--global-batch",
        type=positive,
        default=DEFAULT_GLOBAL_BATCH,
        metavar="SEQS",
        help=f"sequences per optimizer step over all ranks (default {DEFAULT_GLOBAL_BATCH}: the "
        "paper's 2M tokens at 2048 per sequence)",
    )
    t.add_argument(
        "--seq-len",
        type=positive,
        default=DEFAULT_SEQ_LEN,
        metavar="TOKENS",
        help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}); reported "
        "only, as the activations it sizes are not modelled",
    )
    t.add_argument(
        "--headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        metavar="FRACTION",
        help="fraction of device memory kept for activations "
        f"and workspace (default {DEFAULT_HEADROOM})",
    )
    d = p.add_argument_group(
        "tokens per parameter (memtree/tpp.py)",
        "With --shards or --tokens, also print per level the training tokens each block sees (min "
        "/ median / max) and the tokens per parameter (TPP) per epoch and over --duration, with a "
        "warning where a level is as low as a run measured to go wrong and a note where it is "
        "under the fewest measured (memtree/tpp.py).",
    )
    src = d.add_mutually_exclusive_group()
    src.add_argument(
        "--shards",
        metavar="DIR",
        help="a pipeline run's shards/ folder (or the run folder): per-block counts from the "
        "shards' own per-leaf token counts",
    )
    src.add_argument(
        "--tokens",
        metavar="N",
        help="training tokens per epoch (e.g. 3.5M), spread evenly over the blocks of each level "
        "(an estimate for a balanced tree)",
    )
    d.add_argument(
        "--duration",
        default="1ep",
        metavar="DUR",
        help="how long the run trains: epochs, tokens, samples or batches ('5ep', '10Mtok', "
        "'1200sp', '400ba'; default 1ep)",
    )
    d.add_argument(
        "--batch-size",
        type=positive,
        metavar="SEQS",
        help="sequences per batch, for a --duration in batches",
    )
    d.add_argument(
        "--generic-prob",
        type=float,
        metavar="P",
        help="share of training forwards that read the generic memory (default 1 / branching)",
    )
    d.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        metavar="P",
        help="share of training forwards that run the anchor alone (memory.dropout; default 0)",
    )
    d.add_argument(
        "--bank-lr",
        type=float,
        metavar="LR",
        help="the bank's learning rate (memory.lr), with --anchor-lr: warns at a bank / anchor "
        "ratio measured to harm held-out text, notes one above the anchor's",
    )
    d.add_argument(
        "--anchor-lr", type=float, metavar="LR", help="the anchor's learning rate (optim.lr)"
    )
    p.set_defaults(func=_plan)


def _tpp(args: argparse.Namespace, p, counts):
    """The TPP table of `plan` for --shards (`counts`, read) / --tokens, or None without either."""
    from memtree.tpp import (
        TppError,
        even_leaf_tokens,
        parse_duration_epochs,
        parse_tokens,
        tpp_table,
    )

    if args.shards is None and args.tokens is None:
        for flag, value, default in (
            ("--duration", args.duration, "1ep"),
            ("--generic-prob", args.generic_prob, None),
            ("--dropout", args.dropout, 0.0),
            ("--batch-size", args.batch_size, None),
            ("--bank-lr", args.bank_lr, None),
            ("--anchor-lr", args.anchor_lr, None),
        ):
            if value != default:
                raise ValueError(
                    f"{flag} sizes the tokens per parameter: "
                    "give --shards DIR or --tokens N with it"
                )
        return None
    if counts is not None:
        if counts.levels < p.memory.n_levels:
            raise TppError(
                f"--memory has {p.memory.n_levels} levels, the "
                f"shards' tree ({counts.manifest}) {counts.levels}"
            )
        leaf, levels, samples, source = (
            counts.leaf_tokens,
            counts.levels,
            counts.n_samples,
            str(counts.manifest),
        )
    else:
        total = parse_tokens(args.tokens, "--tokens")
        leaf, levels, samples, source = (
            even_leaf_tokens(total, p),
            None,
            None,
            "--tokens, spread evenly",
        )
    epochs = parse_duration_epochs(
        args.duration,
        epoch_tokens=sum(leaf.values()),
        epoch_samples=samples,
        batch_size=args.batch_size,
    )
    if (args.bank_lr is None) != (args.anchor_lr is None):
        raise TppError("--bank-lr and --anchor-lr go together (their ratio decides the warning)")
    for flag, lr in (("--bank-lr", args.bank_lr), ("--anchor-lr", args.anchor_lr)):
        if lr is not None and not lr > 0:
            raise TppError(f"{flag} {lr}: must be positive")
    ratio = None if args.bank_lr is None else args.bank_lr / args.anchor_lr
    return tpp_table(
        p,
        leaf,
        epochs=epochs,
        generic_prob=args.generic_prob,
        dropout=args.dropout,
        source=source,
        tree_levels=levels,
        lr_ratio=ratio,
    )


def _plan(args: argparse.Namespace) -> int:
    counts = None
    if args.shards is not None:
        from memtree.tpp import TppError, read_shards_counts

        counts = read_shards_counts(args.shards)
        if args.branching is not None and args.branching != counts.branching:
            raise TppError(
                f"--branching {args.branching}: the shards' tree "
                f"({counts.manifest}) branches {counts.branching}"
            )
        args.branching = counts.branching
    p = plan(parse_anchor(args.anchor), _memory_config(args))
    tpp = _tpp(args, p, counts)
    report = None
    if args.ranks is not None:
        if args.device_memory is None:
            raise ValueError("--ranks needs --device-memory SIZE (e.g. --device-memory 80GiB)")
        report = training_report(
            p,
            ranks=args.ranks,
            device_bytes=parse_bytes(args.device_memory),
            headroom=args.headroom,
            global_batch=args.global_batch,
            seq_len=args.seq_len,
        )
    elif args.device_memory is not None:
        raise ValueError("--device-memory is used with --ranks N; give the number of ranks")
    if args.json:
        out = p.to_dict()
        if report is not None:
            out["training_memory"] = report.to_dict()
        if tpp is not None:
            out["tokens_per_parameter"] = tpp.to_dict()
        print(json.dumps(out, indent=2))
        return 0
    print(format_plan(p))
    if tpp is not None:
        from memtree.tpp import format_tpp

        print()
        print(format_tpp(tpp))
    if report is not None:
        print()
        print(format_training_report(report, args.device_memory))
    return 0


# --- init ---------------------------------------------------------------------------------------


def _add_init(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "init",
        help="create a bank on disk, initialised as App. I (memories have no effect at step 0)",
        description="Write a new memory bank (atomically). With --tree the bank is bound to that "
        "clustering tree and refuses any other. A bank that holds trained or edited weights or an "
        "audit log is replaced only with --force.",
    )
    p.add_argument("bank", help="bank directory to create")
    _add_memory_args(p)
    p.add_argument(
        "--tree",
        help="clustering tree directory (e.g. RUN/tree); sets branching and binds the bank",
    )
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16", "int8", "int4"))
    p.add_argument("--rank", type=positive, help="store every block tensor factorised to this rank")
    p.add_argument(
        "--subtree", type=nonneg, help="write only this level-1 subtree (a per-subtree bank)"
    )
    p.add_argument(
        "--no-generic", dest="generic", action="store_false", help="no generic-memory slot"
    )
    p.add_argument("--init", choices=("paper", "zeros"), default="paper")
    p.add_argument(
        "--std", type=float, default=0.02, help="truncated-normal std for W1/W2 and keys"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a bank at BANK even if it holds trained or edited weights or an audit log",
    )
    add_wait(p)
    add_json(p)
    p.set_defaults(func=_init)


def _init(args: argparse.Namespace) -> int:
    from memtree.memstore.locking import bank_writer
    from memtree.memstore.writer import paper_init, write_bank, zeros_init

    tree_id, branching = None, None
    if args.tree:
        from memtree.clustering.tree import compute_tree_id

        tree = load_tree_arg(args.tree)
        tree_id, branching = compute_tree_id(tree), tree.branching
        if args.branching is not None and args.branching != tree.branching:
            raise ValueError(
                f"--branching {args.branching}: the --tree has branching {tree.branching}; leave "
                "--branching out to take it from the tree"
            )
        if len(args.memory.split(",")) > tree.levels:
            raise ValueError(f"--memory {args.memory}: the tree has only {tree.levels} levels")
    with bank_writer(args.bank, operation="write", wait=args.wait):
        replaced = check_replace(args.bank, args.force)
        info = write_bank(
            args.bank,
            anchor=parse_anchor(args.anchor),
            memory=_memory_config(args, branching),
            dtype=args.dtype,
            rank=args.rank,
            tree_id=tree_id,
            subtree=args.subtree,
            generic=args.generic,
            extra={"written_by": INIT_MARK, "init": args.init, "seed": args.seed},
            init=paper_init(args.seed, args.std) if args.init == "paper" else zeros_init,
            progress=not args.json,
        )
    emit(
        args,
        describe_bank(info) + ("\n  (replaced the bank that was there)" if replaced else ""),
        {"manifest": info.manifest, "replaced": replaced},
    )
    return 0


# --- info / verify ------------------------------------------------------------------------------


def _add_info(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "info",
        help="describe a bank (levels, sizes, blocked and "
        "deleted blocks) or a sharded run's bank checkpoint",
    )
    p.add_argument(
        "bank", help="bank directory, or a bank checkpoint (SAVE/checkpoints/bank/ba{N})"
    )
    add_json(p)
    p.set_defaults(func=_info)


def _info(args: argparse.Namespace) -> int:
    from memtree.memstore.format import read_manifest
    from memtree.memstore.journal import recover
    from memtree.memstore.policy import read_policy

    if is_checkpoint(args.bank):
        return shards_info(args)
    recover(check_bank(args.bank))
    info = read_manifest(args.bank)
    policy = read_policy(info.root)
    emit(
        args,
        describe_bank(info)
        + f"\n  fallback {policy['fallback']}; blocked {_count(policy['blocked'])}; deleted "
        f"{_count(info.manifest.get('deleted', {}))}",
        {"manifest": info.manifest, "policy": policy},
    )
    return 0


def _count(runs: dict) -> str:
    per = {lv: sum(b - a for a, b in r) for lv, r in runs.items() if r}
    return ", ".join(f"L{lv}: {n:,}" for lv, n in sorted(per.items())) or "none"


def _add_verify(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check every block against its checksum (or every "
        "file of a bank checkpoint against its sha256)",
    )
    p.add_argument(
        "bank", help="bank directory, or a bank checkpoint (SAVE/checkpoints/bank/ba{N})"
    )
    p.add_argument("--tree", help="also check the bank (or checkpoint) belongs to this tree")
    add_json(p)
    p.set_defaults(func=_verify)


def _verify(args: argparse.Namespace) -> int:
    from memtree.memstore.format import check_tree, read_manifest, verify_bank
    from memtree.memstore.journal import recover

    if is_checkpoint(args.bank):
        return shards_verify(args)
    recover(check_bank(args.bank))
    if args.tree:
        check_tree(read_manifest(args.bank), load_tree_arg(args.tree))
    r = verify_bank(args.bank)
    emit(
        args,
        f"ok: {r['blocks_checked']:,} blocks verified in levels {r['levels']} (generation "
        f"{r['generation']})" + (f"; bound to the --tree {args.tree}" if args.tree else ""),
        {**r, "tree": args.tree},
    )
    return 0


# --- fetch --------------------------------------------------------------------------------------


def _add_fetch(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fetch", help="fetch the blocks of a cluster path (or of query texts) and show counters"
    )
    p.add_argument("bank", help="bank directory")
    p.add_argument(
        "--path",
        help="global cluster ids per tree level, e.g. 3,52,843 (each a child of the one before)",
    )
    p.add_argument(
        "--query", metavar="TEXT", help="route this query text through --tree to get the path"
    )
    p.add_argument(
        "--queries",
        metavar="FILE",
        help="route every query of this file (one per line) through --tree",
    )
    p.add_argument("--tree", help="clustering tree directory (binds and routes)")
    add_json(p)
    p.set_defaults(func=_fetch)


def _fetch_paths(args: argparse.Namespace, tree, info) -> list[tuple[str | None, list[int]]]:
    from memtree.memstore.store import check_path

    given = [
        f
        for f, v in (("--path", args.path), ("--query", args.query), ("--queries", args.queries))
        if v
    ]
    if len(given) != 1:
        raise ValueError(
            "fetch: give one of --path IDS, --query TEXT and --queries FILE"
            + (f", not {' and '.join(given)}" if given else "")
        )
    if args.path:
        path = parse_ids(args.path, "--path")
        need = max(info.levels)
        if len(path) < need:
            raise ValueError(
                f"--path {args.path}: {len(path)} ids, but this "
                f"bank needs one per tree level down to level {need}"
            )
        try:
            check_path(path, info.memory.branching)
        except ValueError as e:
            raise ValueError(f"--path {args.path}: {str(e).split(': ', 1)[1]}") from None
        return [(None, path)]
    texts = [args.query] if args.query else read_queries(args.queries)
    if tree is None:
        raise ValueError(f"{given[0]} needs --tree to route the quer{'y' if args.query else 'ies'}")
    from memtree.clustering.route import route_texts

    return [
        (t, [int(c) for c in row]) for t, row in zip(texts, route_texts(tree, texts), strict=True)
    ]


def _fetch(args: argparse.Namespace) -> int:
    from memtree.memstore.format import read_manifest
    from memtree.memstore.store import MemoryStore

    check_bank(args.bank)
    tree = load_tree_arg(args.tree) if args.tree else None
    paths = _fetch_paths(args, tree, read_manifest(args.bank))
    lines, fetches = [], []
    with MemoryStore(args.bank, tree=tree) as store:
        for text, path in paths:
            blocks = store.fetch(path, flat=True)
            lines.append(f"path {path}" + (f"  ({text})" if text is not None else ""))
            levels = {}
            for lv, t in blocks.items():
                refused = store.is_refused(lv, path[lv - 1])
                l1 = float(t.float().abs().sum())
                levels[str(lv)] = {
                    "cluster": path[lv - 1],
                    "params": t.numel(),
                    "dtype": str(t.dtype).split(".")[-1],
                    "l1": l1,
                    "refused": refused,
                }
                lines.append(
                    f"  level {lv}: cluster {path[lv - 1]} → {t.numel():,} params "
                    f"{levels[str(lv)]['dtype']}, "
                    f"|x|₁={l1:.4g}" + (f" (refused: fallback {store.fallback})" if refused else "")
                )
            fetches.append({"query": text, "path": path, "levels": levels})
        tiers = store.stats()["tiers"]
    for name, t in tiers.items():
        lines.append(
            f"tier {name}: {t.get('reads', 0):,} reads, {human_bytes(t.get('bytes_read', 0))} "
            f"read, cache {t.get('cache_hits', 0):,} hits / {t.get('cache_misses', 0):,} misses"
        )
    emit(args, "\n".join(lines), {"fetches": fetches, "tiers": tiers})
    return 0


# --- split / merge / relocate -------------------------------------------------------------------


def _add_split(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "split",
        help="write per-level-1-subtree banks (one training job each)",
        description="split BANK --out OUT writes OUT/subtree-SSS per level-1 subtree.",
    )
    p.add_argument("bank", help="bank directory")
    p.add_argument("--out", help="directory; writes OUT/subtree-SSS")
    p.add_argument("--subtrees", help="which subtrees (default all), e.g. 0,3")
    add_json(p)
    p.set_defaults(func=_split)


def _split(args: argparse.Namespace) -> int:
    from memtree.memstore.format import read_manifest
    from memtree.memstore.merge import split_bank

    out = args.out
    if out is None:
        raise ValueError("split: give --out DIR (where to write DIR/subtree-SSS)")
    info = read_manifest(check_bank(args.bank))
    if info.subtree is not None:
        raise ValueError(
            f"{args.bank} is already a per-subtree bank (subtree {info.subtree}); split a full bank"
        )
    B = info.memory.branching
    subtrees = parse_ids(args.subtrees, "--subtrees") if args.subtrees else list(range(B))
    bad = [s for s in subtrees if not 0 <= s < B]
    if bad:
        raise ValueError(
            f"--subtrees {args.subtrees}: {bad} out of range; level-1 subtrees are 0…{B - 1}"
        )
    written = [str(split_bank(args.bank, s, Path(out) / f"subtree-{s:03d}").root) for s in subtrees]
    emit(
        args,
        f"split {args.bank} into {len(written)} per-subtree banks:\n"
        + "\n".join(f"  {w}" for w in written),
        {"bank": args.bank, "out": out, "subtrees": subtrees, "written": written},
    )
    return 0


def _add_merge(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "merge",
        help="merge per-subtree banks into one bank",
        description="merge PART... --out OUT.",
    )
    p.add_argument(
        "parts",
        nargs="+",
        metavar="PART",
        help="per-subtree bank directories (all subtrees, any order)",
    )
    p.add_argument("--out", help="bank directory to write")
    p.add_argument(
        "--generic",
        choices=("mean", "first"),
        default="mean",
        help="how to combine the subtree jobs' generic memories (default mean)",
    )
    add_wait(p)
    add_json(p)
    p.set_defaults(func=_merge)


def _merge(args: argparse.Namespace) -> int:
    from memtree.memstore.locking import bank_writer
    from memtree.memstore.merge import merge_banks

    parts, out = list(args.parts), args.out
    if out is None:
        raise ValueError("merge: give --out OUT (the bank to write; the positionals are the parts)")
    for part in parts:
        check_bank(part)
    with bank_writer(out, operation="merge", wait=args.wait):
        info = merge_banks(parts, out, generic=args.generic)
    emit(
        args,
        f"merged {len(parts)} per-subtree banks into\n{describe_bank(info)}",
        {"manifest": info.manifest},
    )
    return 0


def _add_relocate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "relocate", help="move one level's file to another directory or fsspec URL"
    )
    p.add_argument("bank", help="bank directory")
    p.add_argument(
        "--level",
        type=int,
        required=True,
        help="the level whose file moves (one that holds "
        "memory: `memtree memstore info` lists them)",
    )
    p.add_argument(
        "--to", required=True, help="directory or URL (e.g. /mnt/external/bank or s3://bucket/bank)"
    )
    add_wait(p)
    add_json(p)
    p.set_defaults(func=_relocate)


def _relocate(args: argparse.Namespace) -> int:
    from memtree.memstore.format import level_path, read_manifest
    from memtree.memstore.locking import bank_writer
    from memtree.memstore.merge import relocate_level

    info = read_manifest(check_bank(args.bank))
    check_level(info.levels, args.level)
    with bank_writer(args.bank, operation="relocate", wait=args.wait):
        old = level_path(info.root, read_manifest(args.bank).level(args.level))
        new = relocate_level(args.bank, args.level, args.to)
    moved = new != old
    size = human_bytes(info.level(args.level).file_bytes)
    emit(
        args,
        f"relocated level {args.level} of {args.bank}: {old} → {new} ({size})"
        if moved
        else f"level {args.level} of {args.bank} is already at {new}; nothing moved",
        {"bank": args.bank, "level": args.level, "from": old, "to": new, "moved": moved},
    )
    return 0


def _parse_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.strip("()[] ").split(",") if p.strip())
    except ValueError:
        raise ValueError(
            f"--layers {text!r}: expected comma-separated layer indices like 0,5,9"
        ) from None
