"""Blocks by training data: what a set of documents trained in every block of a bank.

Seed 002 links ownership of training tokens to ownership of the memories they trained. A pipeline
run (pipeline/README.md) records it: `ingest/docs` maps a document id to its `doc_ordinal`,
`window/` gives each window's `n_tokens` (window ordinal = the part's offset + row), and
`assign/` each window's document and cluster path. Block (l, c) trains on the windows whose
`path[l-1] == c`, so its owner tokens are the `n_tokens` of those windows from the owner's
documents, and the owner's share is that over all tokens routed to the block. Everything is read
column-wise with pyarrow and summed with `np.bincount`, one part at a time: no per-window Python,
and memory bounded by one part (plus one int64 per window and a flag per document).

The owner list is identified in audit entries by `owner_hash`: the sha256 of its sorted unique
ids, one per line (`LC_ALL=C sort -u IDS | sha256sum` for a file without surrounding blanks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memtree.io import read_json

RUN_FLAG = "--run"


def owner_hash(ids: Sequence[str]) -> str:
    return hashlib.sha256("".join(f"{i}\n" for i in sorted(set(ids))).encode()).hexdigest()


def check_min_share(share: float, flag: str = "--min-share") -> float:
    """[0, 1]: 0 blocks every block the documents trained at all, 1 only blocks they trained
    alone."""
    if not 0 <= share <= 1:  # NaN fails both comparisons
        raise ValueError(
            f"{flag} {share}: must be in [0, 1] (the owner's share of a block's training tokens; 0 "
            "blocks every block the documents trained, 1 only those they trained alone)"
        )
    return float(share)


def stage_stats(run: str | Path, stage: str) -> dict[str, Any]:
    """A pipeline run's `stage`/_stage.json `stats` (its parts and counts), or an error naming
    --run."""
    run = Path(run)
    marker = run / stage / "_stage.json"
    if not marker.is_file():
        raise ValueError(
            f"{RUN_FLAG} {run}: no {stage} stage ({marker} missing); give the directory a `memtree "
            "pipeline` run wrote, with its ingest, window and assign stages"
        )
    return read_json(marker)["stats"]


def ingest_tables(run: str | Path, columns: Sequence[str]) -> Iterator[pa.Table]:
    """The run's ingested documents, one ingest part at a time (`doc_ordinal`, `doc_id`, `text`,
    `source`, `meta`: the columns asked for)."""
    run = Path(run)
    for part in stage_stats(run, "ingest")["parts"]:
        yield pq.read_table(run / "ingest" / part["file"], columns=list(columns))


def run_tree_id(run: str | Path) -> str:
    """The `tree_id` of a pipeline run's tree, or an error naming --run."""
    run = Path(run)
    if not run.is_dir():
        raise ValueError(
            f"{RUN_FLAG} {run}: not found (give a pipeline "
            "run directory, the `--out` of `memtree pipeline`)"
        )
    path = run / "tree" / "tree.json"
    if not path.is_file():
        raise ValueError(f"{RUN_FLAG} {run}: not a pipeline run with a tree ({path} missing)")
    tid = read_json(path).get("tree_id")
    if not tid:
        raise ValueError(f"{RUN_FLAG} {run}: {path} records no tree_id")
    return str(tid)


def check_run_tree(
    run: str | Path, bank_tree_id: str | None, bank: str | Path, flag: str = RUN_FLAG
) -> str:
    """The pipeline run's `tree_id` when it is the bank's, else an error naming both."""
    tid = run_tree_id(run)
    if bank_tree_id != tid:
        raise ValueError(
            f"{flag} {run}: its tree is {tid}, but bank {bank} was built for tree "
            f"{bank_tree_id or '(none: the bank is not bound to a tree)'}; "
            "give the run whose tree the bank was trained on"
        )
    return tid


@dataclass(frozen=True)
class OwnerShares:
    """Training tokens per block of every level asked for, all documents' and the owner's."""

    found: list[str]  # the owner's ids the run holds (file order)
    missing: list[str]  # the owner's ids it does not
    tokens: dict[
        int, np.ndarray
    ]  # level -> (B^level,) int64: tokens of all windows routed to each cluster
    owner: dict[int, np.ndarray]  # level -> (B^level,) int64: the owner's part of them
    owner_tokens: int  # the owner's tokens in the run
    run_tokens: int

    def share(self, level: int) -> np.ndarray:
        t = self.tokens[level]
        return np.divide(self.owner[level], t, out=np.zeros(len(t)), where=t > 0)


def owner_shares(
    run: str | Path, ids: Sequence[str], levels: Sequence[int], branching: int
) -> OwnerShares:
    """Count, for every cluster at each of `levels`, the tokens its windows hold and the part of
    them that comes from the documents `ids` (the ingest's `doc_id`)."""
    run = Path(run)
    ingest, window, assign = (stage_stats(run, s) for s in ("ingest", "window", "assign"))
    wanted = pa.array(list(ids), pa.string())
    owned = np.zeros(int(ingest["kept"]), dtype=bool)
    found: set[str] = set()
    for t in ingest_tables(run, ["doc_ordinal", "doc_id"]):
        hit = pc.is_in(t["doc_id"], value_set=wanted)
        mine = t.filter(hit)
        owned[mine["doc_ordinal"].to_numpy()] = True
        found.update(mine["doc_id"].to_pylist())
    n_tokens = np.zeros(int(window["n_windows"]), dtype=np.int64)
    for part in window["parts"]:
        col = pq.read_table(run / "window" / part["file"], columns=["n_tokens"])[
            "n_tokens"
        ].to_numpy()
        n_tokens[part["offset"] : part["offset"] + len(col)] = col
    tokens = {lv: np.zeros(branching**lv, dtype=np.int64) for lv in levels}
    owner = {lv: np.zeros(branching**lv, dtype=np.int64) for lv in levels}
    owner_total = 0
    for part in assign["parts"]:
        path_file = run / "assign" / part["file"]
        t = pq.read_table(path_file, columns=["window_ordinal", "doc_ordinal", "path"])
        if not t.num_rows:
            continue
        paths = _paths(t["path"], path_file, max(levels))
        w = n_tokens[t["window_ordinal"].to_numpy()]
        mine = owned[t["doc_ordinal"].to_numpy()]
        owner_total += int(w[mine].sum())
        for lv in levels:
            c = paths[:, lv - 1]
            if c.min() < 0 or c.max() >= branching**lv:
                raise ValueError(
                    f"{path_file}: level-{lv} cluster ids outside [0, {branching**lv}); the run's "
                    f"tree does not have branching {branching}"
                )
            # float64 sums of int64 token counts are exact below 2^53 tokens per cluster
            tokens[lv] += np.rint(np.bincount(c, weights=w, minlength=branching**lv)).astype(
                np.int64
            )
            owner[lv] += np.rint(
                np.bincount(c[mine], weights=w[mine], minlength=branching**lv)
            ).astype(np.int64)
    return OwnerShares(
        found=[i for i in ids if i in found],
        missing=[i for i in ids if i not in found],
        tokens=tokens,
        owner=owner,
        owner_tokens=owner_total,
        run_tokens=int(n_tokens.sum()),
    )


def check_found(
    shares: OwnerShares,
    ids: Sequence[str],
    *,
    documents: str | Path,
    run: str | Path,
    allow_missing: bool,
    flag: str = "--documents",
) -> str | None:
    """None when the run holds every id; else the note to print when `allow_missing` (some are
    found), or an error naming how many are missing and the first few."""
    if not shares.missing:
        return None
    named = ", ".join(map(repr, shares.missing[:5])) + (", …" if len(shares.missing) > 5 else "")
    text = (
        f"{flag} {documents}: {len(shares.missing):,} of {len(ids):,} "
        f"document ids are not in the pipeline run {run} ({named})"
    )
    if not shares.found:
        raise ValueError(
            f"{text}; none of them is, so nothing can be chosen (is it "
            "the run the bank trains on? ids are the ingest's doc_id)"
        )
    if not allow_missing:
        raise ValueError(
            f"{text}; check them (ids are the ingest's "
            "doc_id) or add --allow-missing to go on without"
        )
    return f"{text}; going on without them (--allow-missing)"


def _paths(column: pa.ChunkedArray, where: Path, need: int) -> np.ndarray:
    chunks = [
        c.flatten().to_numpy(zero_copy_only=False).reshape(len(c), -1)
        for c in column.chunks
        if len(c)
    ]
    paths = np.concatenate(chunks).astype(np.int64, copy=False)
    if paths.shape[1] < need:
        raise ValueError(
            f"{where}: paths have {paths.shape[1]} levels; "
            f"the bank holds memory down to level {need}"
        )
    return paths


def owner_targets(
    shares: OwnerShares, held: Mapping[int, tuple[int, int]], min_share: float
) -> dict[int, list[int]]:
    """{level: cluster ids} to block: the owner trained the block (tokens > 0) with a share of at
    least `min_share`, among the clusters the bank holds (`held`: level -> (first cluster,
    n_blocks))."""
    out = {}
    for lv, (first, n) in held.items():
        ids = np.arange(first, first + n)
        own, share = shares.owner[lv][ids], shares.share(lv)[ids]
        out[lv] = ids[(own > 0) & (share >= min_share)].tolist()
    return out


def owner_report(shares: OwnerShares, targets: Mapping[int, Sequence[int]], info) -> dict[str, Any]:
    """Per level (`info`: the bank's `BankInfo`): blocks chosen, the bank fraction (parameters) they
    are, the owner's share in them (min / median / max, and per block), the owner's tokens they
    cover, and the collateral: other documents' tokens inside them."""
    total = sum(lv.n_blocks * lv.params for lv in info.levels.values())
    levels = {}
    for lv, ids in sorted(targets.items()):
        L = info.levels[lv]
        ids = np.asarray(ids, dtype=np.int64)
        held = np.arange(L.first_cluster, L.first_cluster + L.n_blocks)
        tok, own = shares.tokens[lv][ids], shares.owner[lv][ids]
        share = shares.share(lv)[ids]
        owner_here = int(shares.owner[lv][held].sum())
        levels[str(lv)] = {
            "blocks": len(ids),
            "blocks_in_level": L.n_blocks,
            "blocks_trained": int((shares.owner[lv][held] > 0).sum()),
            "bank_fraction": len(ids) * L.params / total if total else 0.0,
            "share_min": float(share.min()) if len(ids) else None,
            "share_median": float(np.median(share)) if len(ids) else None,
            "share_max": float(share.max()) if len(ids) else None,
            "owner_tokens": owner_here,
            "owner_tokens_covered": int(own.sum()),
            "covered_fraction": float(own.sum() / owner_here) if owner_here else None,
            "collateral_tokens": int((tok - own).sum()),
            "block_tokens": int(tok.sum()),
            "per_block": [
                {"cluster": int(c), "owner_tokens": int(o), "tokens": int(t), "share": float(s)}
                for c, o, t, s in zip(ids, own, tok, share, strict=True)
            ],
        }
    return {
        "documents": len(shares.found) + len(shares.missing),
        "documents_found": len(shares.found),
        "documents_missing": len(shares.missing),
        "owner_tokens": shares.owner_tokens,
        "run_tokens": shares.run_tokens,
        "levels": levels,
        "bank_fraction": sum(v["bank_fraction"] for v in levels.values()),
    }


def owner_table(report: Mapping[str, Any]) -> str:
    """The per-level table `memtree memstore block --documents` prints."""
    rows = [
        (
            "level",
            "blocks",
            "bank fraction",
            "owner share min / median / max",
            "owner tokens covered",
            "collateral tokens",
        )
    ]
    for lv, r in report["levels"].items():
        shares = (
            "-"
            if r["share_min"] is None
            else f"{r['share_min']:.1%} / {r['share_median']:.1%} / {r['share_max']:.1%}"
        )
        covered = "" if r["covered_fraction"] is None else f" ({r['covered_fraction']:.1%})"
        rows.append(
            (
                lv,
                f"{r['blocks']:,} of {r['blocks_in_level']:,}",
                f"{r['bank_fraction']:.3%}",
                shares,
                f"{r['owner_tokens_covered']:,} of {r['owner_tokens']:,}{covered}",
                f"{r['collateral_tokens']:,}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    )


def lift_targets(
    entries: Sequence[Mapping[str, Any]], sha: str
) -> tuple[dict[int, list[int]], list[dict]]:
    """What `unblock --documents` lifts: the blocks the owner's document blocks since its last
    document
    unblock newly blocked (their `changed`), except those a later block of any other request names
    too
    (lifting this owner's request must not lift another's). Returns (targets, the block entries
    undone)."""

    def mine(e: Mapping[str, Any]) -> bool:
        return e.get("by") == "documents" and e.get("owner_sha256") == sha

    start = (
        max(
            (i for i, e in enumerate(entries) if mine(e) and e.get("action") == "unblock"),
            default=-1,
        )
        + 1
    )
    undone = [
        i
        for i in range(start, len(entries))
        if mine(entries[i]) and entries[i].get("action") == "block"
    ]
    if not undone:
        return {}, []
    lift: dict[int, set[int]] = {}
    for i in undone:
        for lv, runs in (entries[i].get("changed") or {}).items():
            lift.setdefault(int(lv), set()).update(c for a, b in runs for c in range(a, b))
    for e in entries[undone[0] :]:
        if e.get("action") == "block" and not mine(e):
            for lv, runs in (e.get("targets") or {}).items():
                lift.get(int(lv), set()).difference_update(c for a, b in runs for c in range(a, b))
    return {lv: sorted(ids) for lv, ids in sorted(lift.items())}, [dict(entries[i]) for i in undone]
