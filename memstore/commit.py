"""Journaled edits of an open bank: scatter, edit and delete all land through `commit_writes`.

The new records are written to `journal/` atomically (one file, `memstore.journal`'s format),
then applied in place under the exclusive reader/writer lock, then the manifest generation is
bumped and the journal removed. A crash before the journal lands leaves the previous version;
after it, opening the bank replays it. Either way every block is whole. A deletion
(`erase_writes`) is such an edit: zeroed records plus the manifest's `deleted` runs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

from memtree.io import atomic_write_bytes
from memtree.memstore.format import BankError, BankInfo, LevelInfo, is_url, read_manifest
from memtree.memstore.journal import apply_journals, journal_bytes
from memtree.memstore.policy import id_runs
from memtree.memstore.sync import BankSync

Write = tuple[int, int, bytes]  # (level, slot, record)


def commit_writes(
    sync: BankSync,
    info: BankInfo,
    files: Mapping[int, str],
    writes: list[Write],
    manifest: dict | None = None,
) -> BankInfo:
    """Journal `writes` with `manifest` (default the bank's; its generation bumped), apply them and
    publish; returns the bank as published. `files` {level: path}: a level living at a URL is
    read-only here and refused before anything is written."""
    manifest = dict(manifest or info.manifest)
    manifest["generation"] = info.generation + 1
    for lv, _, _ in writes:
        if is_url(files[lv]):
            raise BankError(
                f"level {lv} lives at {files[lv]}, which is read-only "
                "here; relocate it to a local path to edit it"
            )
    journal = journal_bytes(manifest, writes)
    jdir = sync.root / "journal"
    jdir.mkdir(exist_ok=True)
    atomic_write_bytes(jdir / f"{manifest['generation']:012d}.jnl", journal)
    with sync.publishing():  # readers wait while bytes change, then reload
        apply_journals(sync.root)
    return read_manifest(sync.root)


def erase_writes(
    info: BankInfo, levels: Mapping[int, LevelInfo], targets: Mapping[int, Sequence[int]]
) -> tuple[list[Write], dict]:
    """The zeroed records and the manifest (its `deleted` runs grown) that delete `targets`
    {level: global ids} of the open `levels`; `info.manifest` itself is left untouched."""
    manifest = copy.deepcopy(info.manifest)  # untouched if the commit fails
    deleted = manifest.setdefault("deleted", {})
    writes: list[Write] = []
    for lv, ids in targets.items():
        li = levels[lv]
        zero = bytes(li.record_bytes)
        writes += [(lv, li.slot(c), zero) for c in ids]
        merged = [i for a, b in deleted.get(str(lv), []) for i in range(a, b)]
        deleted[str(lv)] = id_runs(merged + list(ids))
    return writes, manifest
