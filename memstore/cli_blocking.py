"""`memtree memstore block | unblock | delete`: refuse, lift and erase blocks of a bank.

The level is never assumed: with `--queries` / `--random` it follows from `--fraction` and the
bank (`memstore.blocking.default_level`), with `--clusters` it is the shallowest level that holds
memory, and `--level` names another. Undo mirrors do: `unblock` of a cluster that a block
command blocked with its subtree (`--subtree`, `--queries`, `--random`) lifts that subtree
(the audit log records what each block asked for). `--documents IDS --run RUN` acts instead on the
blocks a data owner's documents trained, at every level holding memory (`memstore.ownership`), and
prints what that cost per level. Every command prints one text summary, or JSON with `--json`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from memtree.memstore.cli_common import (
    add_json,
    add_wait,
    check_bank,
    check_level,
    emit,
    levels_text,
    load_tree_arg,
    note,
    parse_ids,
    read_document_ids,
    read_queries,
)

STATE = {
    "block": "blocked",
    "unblock": "not blocked",
    "delete": "deleted",
}  # what each action leaves
LEVEL_HELP = (
    "tree level of --clusters (1 = the root's children). Default: with --queries / --random, the "
    "shallowest level holding memory whose one subtree is at most --fraction of the bank (else the "
    "deepest); with --clusters, the shallowest level holding "
    "memory (`memtree memstore info` lists the bank's levels)"
)


def add_block_commands(subparsers: argparse._SubParsersAction) -> None:
    for name, helptext in (
        ("block", "refuse blocks (never read; fetch serves the fallback)"),
        ("unblock", "lift blocks (what a block command blocked, its subtree included)"),
        ("delete", "erase blocks' bytes on disk (irreversible)"),
    ):
        p = subparsers.add_parser(
            name, help=helptext, description=__doc__.split("\n\n")[1].replace("\n", " ")
        )
        p.add_argument("bank", help="bank directory")
        p.add_argument("--level", type=int, help=LEVEL_HELP)
        p.add_argument("--clusters", help="global cluster ids at --level, e.g. 3,7")
        if name == "unblock":
            p.add_argument(
                "--subtree",
                action=argparse.BooleanOptionalAction,
                default=None,
                help="also lift every descendant (--no-subtree: only the named blocks). Default: "
                "as they were blocked: a cluster blocked with its subtree is lifted with it",
            )
        else:
            p.add_argument(
                "--subtree", action="store_true", help="include every descendant at deeper levels"
            )
        p.add_argument(
            "--documents",
            metavar="IDS_FILE",
            help="a data owner's documents: a text file, one document id (the ingest's doc_id) per "
            "line; acts on the blocks they trained, at every level holding memory (needs --run)"
            + ("; lifts exactly what their blocks set" if name == "unblock" else ""),
        )
        p.add_argument(
            "--run",
            metavar="PIPELINE_RUN",
            help="with --documents: the pipeline run the bank trains on (its ingest, window and "
            "assign stages say which documents' tokens trained each block)",
        )
        if name != "unblock":
            p.add_argument(
                "--min-share",
                type=float,
                metavar="S",
                help="with --documents: only blocks whose training tokens are at least this share "
                "the owner's, in [0, 1] (default 0: every block the documents trained at all)",
            )
        p.add_argument(
            "--allow-missing",
            action="store_true",
            help="with --documents: go on when some ids are "
            "not in the run (they are named on stderr)",
        )
        p.add_argument("--reason", default="", help="recorded in the audit log")
        add_wait(p)
        add_json(p)
        if name == "block":
            p.add_argument(
                "--queries",
                metavar="FILE",
                help="adversarial: a text file, one query per line; "
                "block the subtrees they route to most (needs --tree)",
            )
            p.add_argument(
                "--tree",
                help="clustering tree directory to route --queries through (e.g. RUN/tree)",
            )
            p.add_argument(
                "--fraction",
                type=float,
                help="share of the bank to block with --queries or --random (default 1/16)",
            )
            p.add_argument("--random", action="store_true", help="control: block random subtrees")
            p.add_argument("--seed", type=int, help="seed of --random (default 0)")
            p.add_argument(
                "--fallback", choices=("zeros", "generic"), help="what fetch serves instead"
            )
        p.set_defaults(func=run_block, action=name)


def _documents_mode(args: argparse.Namespace) -> str:
    if not args.documents:
        flag = next(
            f
            for f, on in (
                ("--run", args.run),
                ("--min-share", getattr(args, "min_share", None) is not None),
                ("--allow-missing", args.allow_missing),
            )
            if on
        )
        raise ValueError(f"{flag} is used with --documents IDS_FILE")
    if not args.run:
        raise ValueError(
            "--documents needs --run PIPELINE_RUN (the pipeline run "
            "whose assignments say which blocks the documents trained)"
        )
    subtree = args.subtree is not None if args.action == "unblock" else args.subtree
    given = [
        f
        for f, on in (
            ("--clusters", args.clusters),
            ("--queries", getattr(args, "queries", None)),
            ("--random", getattr(args, "random", False)),
            ("--level", args.level is not None),
            ("--subtree", subtree),
            ("--tree", getattr(args, "tree", None)),
            ("--fraction", getattr(args, "fraction", None) is not None),
            ("--seed", getattr(args, "seed", None) is not None),
        )
        if on
    ]
    if given:
        raise ValueError(
            "--documents chooses the blocks by the documents' training data at every level "
            f"holding memory; it is not used with {' or '.join(given)}"
        )
    return "documents"


def _mode(args: argparse.Namespace) -> str:
    if (
        args.documents
        or args.run
        or getattr(args, "min_share", None) is not None
        or args.allow_missing
    ):
        return _documents_mode(args)
    if args.action != "block":
        if not args.clusters:
            raise ValueError(
                f"{args.action}: give --clusters IDS (global cluster ids at --level), or "
                "--documents IDS_FILE with --run PIPELINE_RUN"
            )
        return "clusters"
    given = [
        f
        for f, on in (
            ("--queries", args.queries),
            ("--random", args.random),
            ("--clusters", args.clusters),
        )
        if on
    ]
    if len(given) > 1:
        raise ValueError(
            f"block: give one of --queries, --random and --clusters, not {' and '.join(given)}"
        )
    if args.queries and not args.tree:
        raise ValueError(
            "--queries needs --tree (the clustering tree to route the queries through)"
        )
    if args.tree and not args.queries:
        raise ValueError("--tree is only used with --queries")
    if not given:
        if args.fallback:
            return "fallback"
        raise ValueError(
            "block: give --clusters IDS, --queries FILE (with --tree), --random, or --documents "
            "IDS_FILE with --run PIPELINE_RUN"
        )
    if args.clusters:
        for flag, value in (("--fraction", args.fraction), ("--seed", args.seed)):
            if value is not None:
                raise ValueError(f"{flag} is used with --queries or --random, not with --clusters")
        return "clusters"
    if args.seed is not None and args.queries:
        raise ValueError("--seed is used with --random, not with --queries")
    return "queries" if args.queries else "random"


def _state(store) -> dict[str, dict[int, set[int]]]:
    def ids(runs: dict) -> dict[int, set[int]]:
        return {int(lv): {i for a, b in r for i in range(a, b)} for lv, r in runs.items()}

    return {
        "blocked": ids(store.policy["blocked"]),
        "deleted": ids(store.info.manifest.get("deleted", {})),
    }


def _changed(action: str, before: dict, after: dict) -> dict[int, int]:
    key = "deleted" if action == "delete" else "blocked"
    a, b = before[key], after[key]
    lvs = set(a) | set(b)
    if action == "unblock":
        return {lv: len(a.get(lv, set()) - b.get(lv, set())) for lv in lvs}
    return {lv: len(b.get(lv, set()) - a.get(lv, set())) for lv in lvs}


def run_block(args: argparse.Namespace) -> int:
    from memtree.memstore.store import MemoryStore

    check_bank(args.bank)
    mode = _mode(args)
    if mode == "documents":
        return _run_documents(args)
    clusters = parse_ids(args.clusters, "--clusters") if args.clusters else []
    texts, tree = (
        (read_queries(args.queries), load_tree_arg(args.tree))
        if mode == "queries"
        else (None, None)
    )
    state = STATE[args.action]
    with MemoryStore(args.bank, lock_wait=args.wait) as store:
        if mode == "queries":
            from memtree.memstore.format import check_tree

            check_tree(store.info, tree)
        out: dict[str, Any] = {"action": args.action, "bank": str(store.root)}
        if args.action == "block" and args.fallback:
            store.set_fallback(args.fallback)
            out["fallback"] = args.fallback
        before = _state(store)
        if mode in ("queries", "random"):
            out.update(_block_subtrees(store, args, mode, texts, tree))
            counts = {int(lv): n for lv, n in out.pop("blocks").items()}
        elif mode == "clusters":
            level = (
                min(store.levels) if args.level is None else check_level(store.levels, args.level)
            )
            fn = {"block": store.block, "unblock": store.unblock, "delete": store.delete}[
                args.action
            ]
            subtree = args.subtree if args.action == "unblock" else bool(args.subtree)
            counts = fn(level, clusters, subtree=subtree, reason=args.reason)
            out.update(level=level, clusters=sorted(set(clusters)), subtree=subtree)
        else:
            counts = {}
        changed = _changed(args.action, before, _state(store))
        out.update(
            blocks={str(lv): n for lv, n in sorted(counts.items())},
            changed={str(lv): n for lv, n in sorted(changed.items()) if lv in counts},
            bank_fraction_refused=store.blocked_fraction(),
        )
    emit(args, _summary(args.action, mode, out, counts, changed, state), out)
    return 0


def _block_subtrees(store, args, mode: str, texts, tree) -> dict[str, Any]:
    from memtree.memstore.blocking import adversarial_block, random_block

    fraction = 1 / 16 if args.fraction is None else args.fraction
    level = None if args.level is None else check_level(store.levels, args.level)
    if mode == "random":
        report = random_block(
            store,
            fraction=fraction,
            level=level,
            seed=args.seed or 0,
            reason=args.reason or "random blocking (control)",
        )
        report["seed"] = args.seed or 0
    else:
        report = adversarial_block(
            store,
            texts=texts,
            tree=tree,
            fraction=fraction,
            level=level,
            reason=args.reason or f"adversarial blocking ({args.queries})",
        )
        report["queries_file"] = args.queries
    report["fraction"] = fraction
    if report["bank_fraction_blocked"] > 1.5 * fraction:
        note(
            f"one level-{report['level']} subtree is {report['bank_fraction_blocked']:.2%} of the "
            f"bank, more than --fraction {fraction:g}; a deeper --level blocks finer"
        )
    return report


def _summary(
    action: str, mode: str, out: dict, counts: dict[int, int], changed: dict[int, int], state: str
) -> str:
    refused = f"{out['bank_fraction_refused']:.4%} of the bank refused"
    head = f"fallback set to {out['fallback']}; " if "fallback" in out else ""
    if mode == "fallback":
        return f"block: {head}{refused}"
    n_changed, n_total = sum(changed.get(lv, 0) for lv in counts), sum(counts.values())
    if mode in ("queries", "random"):
        how = (
            f"routed {out['queries']} queries from {out['queries_file']}, "
            f"{out['queries_blocked']} now hit a blocked path"
            if mode == "queries"
            else f"drawn at random, seed {out['seed']}"
        )
        ids = ", ".join(map(str, out["clusters"]))
        many = len(out["clusters"]) > 1
        return (
            f"block: {head}level {out['level']} cluster{'s' if many else ''} {ids} with "
            f"{'their subtrees' if many else 'its subtree'} ({levels_text(counts)}; {how}); "
            f"{refused} (asked {out['fraction']:.4%})"
        )
    if n_total and not n_changed:
        ids = ", ".join(map(str, out["clusters"]))
        return (
            f"{action}: nothing changed: level {out['level']} "
            f"cluster(s) {ids} already {state}; {refused}"
        )
    text = f"{action}: {head}{levels_text(counts)}"
    if action == "unblock" and out["subtree"] is None and len(counts) > 1:
        text += " (blocked with their subtree, lifted with it)"
    if n_changed < n_total:
        text += f" ({n_total - n_changed:,} of them already {state})"
    return f"{text}; {refused}"


def _run_documents(args: argparse.Namespace) -> int:
    """block / unblock / delete --documents: the blocks a data owner's documents trained
    (memstore.ownership)."""
    from memtree.memstore.audit import audit_log
    from memtree.memstore.ownership import (
        check_min_share,
        check_run_tree,
        lift_targets,
        owner_hash,
        owner_report,
        owner_shares,
        owner_targets,
        run_tree_id,
    )
    from memtree.memstore.store import MemoryStore, id_runs

    share = None if args.action == "unblock" else check_min_share(args.min_share or 0.0)
    ids = read_document_ids(args.documents)
    run_tree_id(args.run)  # a bad --run is named before the bank is opened and locked
    sha = owner_hash(ids)
    with MemoryStore(args.bank, lock_wait=args.wait) as store:
        tree_id = check_run_tree(args.run, store.info.tree_id, args.bank)
        shares = owner_shares(args.run, ids, sorted(store.levels), store.info.memory.branching)
        _check_missing(args, ids, shares)
        request: dict[str, Any] = {
            "by": "documents",
            "owner_sha256": sha,
            "documents": len(ids),
            "documents_found": len(shares.found),
            "run": str(Path(args.run).resolve()),
            "tree_id": tree_id,
        }
        if args.action == "unblock":
            targets, undone = lift_targets(audit_log(store.root), sha)
            if not undone:
                raise ValueError(
                    f"unblock --documents {args.documents}: the audit log of {args.bank} holds no "
                    f"block by these documents (owner sha256 {sha}) "
                    "since their last unblock; nothing to lift"
                )
            request["undoes"] = [e["time"] for e in undone]
        else:
            held = {lv: (L.info.first_cluster, L.info.n_blocks) for lv, L in store.levels.items()}
            targets = owner_targets(shares, held, share)
            request["min_share"] = share
        out: dict[str, Any] = {"action": args.action, "bank": str(store.root), **request}
        if args.action == "block" and args.fallback:
            store.set_fallback(args.fallback)
            out["fallback"] = args.fallback
        changed = (
            store.apply_targets(args.action, targets, reason=args.reason, **request)
            if any(targets.values())
            else {}
        )
        out.update(
            owner_report(shares, targets, store.info),
            targets={str(lv): id_runs(v) for lv, v in sorted(targets.items())},
            changed={str(lv): len(v) for lv, v in sorted(changed.items())},
            bank_fraction_refused=store.blocked_fraction(),
        )
    emit(args, _documents_summary(out, targets, changed), out)
    return 0


def _check_missing(args: argparse.Namespace, ids: list[str], shares) -> None:
    from memtree.memstore.ownership import check_found

    text = check_found(
        shares, ids, documents=args.documents, run=args.run, allow_missing=args.allow_missing
    )
    if text:
        note(text)


def _documents_summary(
    out: dict[str, Any], targets: dict[int, list[int]], changed: dict[int, list[int]]
) -> str:
    from memtree.memstore.ownership import owner_table

    action = out["action"]
    run_share = out["owner_tokens"] / out["run_tokens"] if out["run_tokens"] else 0.0
    how = (
        "lifting what their blocks set"
        if action == "unblock"
        else (
            "every block they trained"
            if not out["min_share"]
            else f"blocks they trained with a share >= {out['min_share']:g}"
        )
    )
    head = (
        f"{action}: {out['documents_found']:,} documents (owner sha256 "
        f"{out['owner_sha256'][:16]}…), {out['owner_tokens']:,} "
        f"training tokens ({run_share:.2%} of the run's); {how}"
    )
    state = STATE[action]
    n_changed, n_total = sum(map(len, changed.values())), sum(map(len, targets.values()))
    if not n_changed:
        tail = (
            "nothing changed: "
            f"{'no block to act on' if not n_total else f'every block already {state}'}"
        )
    else:
        verb = {"block": "blocked", "unblock": "lifted", "delete": "erased"}[action]
        tail = f"{verb} {levels_text({lv: len(v) for lv, v in changed.items()})}"
        if n_changed < n_total:
            tail += f" ({n_total - n_changed:,} of the {n_total:,} already {state})"
    fallback = f"fallback set to {out['fallback']}; " if "fallback" in out else ""
    return (
        f"{head}\n{owner_table(out)}\n{fallback}{tail}; "
        f"{out['bank_fraction_refused']:.4%} of the bank refused"
    )
