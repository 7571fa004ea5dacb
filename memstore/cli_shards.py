"""`memtree memstore info / verify / export` on a sharded training run's bank checkpoint.

A run with `parallel.bank: sharded` saves its bank as `memtree-bank-shards` v1 checkpoints,
`SAVE/checkpoints/bank/ba{N}/` (memstore/bank_shards.py; memstore/README.md). `info` and `verify`
take such a checkpoint where they take a bank (told apart by the manifest's `format`: cli.py
hands a checkpoint to `shards_info` / `shards_verify`); `export CKPT --out BANK` writes the
`memtree-bank` the run itself exports at its end, byte for byte. Handlers import the library
when they run (memstore/cli.py says why).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from memtree.geometry import DTYPES, human, human_bytes
from memtree.io import read_json
from memtree.memstore.cli_common import (
    add_json,
    add_wait,
    check_replace,
    describe_bank,
    emit,
    load_tree_arg,
)

# memstore.bank_shards.FORMAT, without importing torch to build the parser
SHARDS_FORMAT = "memtree-bank-shards"


def is_checkpoint(path: str) -> bool:
    """A bank-shards checkpoint (its manifest's format), or a folder of them
    (`checkpoints/bank`)."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        try:
            return read_json(p / "manifest.json").get("format") == SHARDS_FORMAT
        except (ValueError, OSError, AttributeError):
            return False
    return p.is_dir() and any(
        re.fullmatch(r"ba\d+", q.name) and (q / "manifest.json").is_file() for q in p.iterdir()
    )


def shards_info(args: argparse.Namespace) -> int:
    from memtree.memstore.bank_shards import summary

    s = summary(args.bank)
    a, m, by = s["anchor"], s["memory"], s["saved_by"]
    lines = [
        f"bank-shards checkpoint {args.bank}  ({s['format']} v{s['version']}, batch {s['batch']})",
        (
            f"  anchor: {a['n_layers']} layers, d_model {a['d_model']}, {a['n_heads']} heads × "
            f"head_dim {a['head_dim']}, ffn {a['ffn_dim']}, vocab {a['vocab_size']:,}"
        ),
        (
            f"  memory: {m['type']}, multipliers {m['multipliers']}, "
            f"branching {s['branching']}, placement {m['placement']}"
        ),
    ]
    B = s["branching"]
    for lv, v in sorted(s["levels"].items(), key=lambda kv: int(kv[0])):
        lines.append(
            f"  level {lv}: {v['rows_per_subtree']:,} row{'s' * (v['rows_per_subtree'] > 1)} per "
            f"subtree × {B} subtrees + generic = {v['rows']:,} "
            f"rows × {human(v['params_per_row'])} params"
        )
    lines.append(
        f"  {human(s['params'])} params in {s['n_files']} files ({B} subtrees + generic), "
        f"{human_bytes(s['bytes'])} (weights and their AdamW state)"
    )
    lines.append(
        f"  saved by {by['world']} rank{'s' * (by['world'] > 1)}: {by['groups']} memory-parallel "
        f"group{'s' * (by['groups'] > 1)} × {by['replicas']} replica{'s' * (by['replicas'] > 1)}"
    )
    ex = s["export"]
    lines.append(
        f"  export: dtype {ex['dtype']}, tree {ex['tree_id']}, anchor {ex['anchor_name']} "
        f"(`memtree memstore export {args.bank} --out BANK`)"
        if ex
        else "  export: not recorded (a checkpoint from an older memtree): `memtree memstore "
        "export` needs --dtype and --tree-id"
    )
    emit(args, "\n".join(lines), s)
    return 0


def shards_verify(args: argparse.Namespace) -> int:
    from memtree.memstore.bank_shards import read_manifest, verify_shards

    bound = None
    if args.tree:
        from memtree.clustering.tree import compute_tree_id

        man = read_manifest(args.bank)
        tree = load_tree_arg(args.tree)
        recorded = (man.get("export") or {}).get("tree_id")
        if recorded is None:
            raise ValueError(
                f"{args.bank}: its manifest records no tree id (a checkpoint from an older "
                "memtree), so it cannot be checked against --tree; verify without --tree"
            )
        if recorded != compute_tree_id(tree) or int(man["branching"]) != tree.branching:
            raise ValueError(
                f"{args.bank}: trained on tree {recorded} (branching {man['branching']}), not the "
                f"--tree {args.tree} ({compute_tree_id(tree)}, branching {tree.branching})"
            )
        bound = recorded
    r = verify_shards(args.bank)
    emit(
        args,
        f"ok: {r['files']} files ({human_bytes(r['bytes'])}) of the bank-shards checkpoint at "
        f"batch {r['batch']} match their sha256 and shapes"
        + (f"; trained on the --tree {args.tree}" if bound else ""),
        {**r, "checkpoint": args.bank, "format": SHARDS_FORMAT, "tree": args.tree},
    )
    return 0


def add_export(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write the memory bank of a sharded run's bank checkpoint (checkpoints/bank/ba{N})",
        description="Write the memtree-bank that a `parallel.bank: sharded` run exports at its end "
        "(SAVE/bank), from one of its bank checkpoints, streamed a few rows at a time. The export "
        "dtype, tree id and anchor name come from the checkpoint's manifest; a checkpoint saved "
        "before they were recorded needs --dtype and --tree-id. "
        "Every file is checked against its sha256 first.",
    )
    p.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="a bank checkpoint directory, e.g. SAVE/checkpoints/bank/ba200",
    )
    p.add_argument("--out", required=True, metavar="BANK", help="bank directory to write")
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="storage dtype (default: the run's memory.export_dtype, from the manifest)",
    )
    p.add_argument(
        "--tree-id",
        metavar="ID",
        help="the clustering tree's id the bank is bound "
        "to (default: the manifest's; `none`: unbound)",
    )
    p.add_argument(
        "--anchor-name",
        metavar="NAME",
        help="the anchor's name in the bank's manifest (default: the manifest's, else 'custom')",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a bank at BANK even if it holds trained or edited weights or an audit log",
    )
    add_wait(p)
    add_json(p)
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from memtree.memstore.bank_shards import export_bank, export_settings, read_manifest
    from memtree.memstore.locking import bank_writer

    ckpt, out = Path(args.checkpoint), Path(args.out)
    if (ckpt / "manifest.json").is_file() and not is_checkpoint(args.checkpoint):
        raise ValueError(
            f"{ckpt}: format {read_json(ckpt / 'manifest.json').get('format')!r}, not a bank "
            f"checkpoint ({SHARDS_FORMAT}); export reads "
            "a sharded run's SAVE/checkpoints/bank/ba{N}"
        )
    man = read_manifest(ckpt)
    settings = export_settings(
        man, dtype=args.dtype, tree_id=args.tree_id, anchor_name=args.anchor_name, where=str(ckpt)
    )
    if out.resolve() == ckpt.resolve() or ckpt.resolve() in out.resolve().parents:
        raise ValueError(f"--out {out}: inside the checkpoint {ckpt}; write the bank elsewhere")
    with bank_writer(out, operation="export", wait=args.wait):
        replaced = check_replace(str(out), args.force)
        info = export_bank(ckpt, out, **settings)
    emit(
        args,
        f"exported the bank-shards checkpoint {ckpt} "
        f"(batch {man['batch']}) to\n{describe_bank(info)}"
        + ("\n  (replaced the bank that was there)" if replaced else ""),
        {
            "checkpoint": str(ckpt),
            "batch": man["batch"],
            "manifest": info.manifest,
            "replaced": replaced,
        },
    )
    return 0
