"""The bank's edit journal and crash recovery.

An in-place edit (scatter, edit, delete) first lands as one journal file in `BANK/journal/`
(atomic rename), is then applied with `pwrite` + fsync, then the manifest generation is bumped
and the journal removed. `recover`, called by every open, replays a journal a crash left
behind, so every block is either its old or its new value. `audit_log` and `blocked_as_subtree`
are `memstore.audit`'s, imported here too for the callers that read them from this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from memtree.io import atomic_write_json, dumps_json, restore_replaced_dir
from memtree.memstore.audit import (  # noqa: F401  (re-exported: callers read the audit log from here)
    audit_log,
    blocked_as_subtree,
)
from memtree.memstore.format import (
    DIGEST_BYTES,
    BankError,
    LevelInfo,
    digest,
    level_path,
    sums_name,
)
from memtree.memstore.locking import BankBusy, bank_writer, exclusive_change

JOURNAL_FORMAT = "memtree-bank-journal"


def journal_bytes(manifest: dict, writes: list[tuple[int, int, bytes]]) -> bytes:
    entries, body, off = [], [], 0
    for lv, slot, rec in writes:
        entries.append({"level": lv, "slot": slot, "offset": off, "length": len(rec)})
        body.append(rec)
        off += len(rec)
    header = {
        "format": JOURNAL_FORMAT,
        "version": 1,
        "manifest": manifest,
        "entries": entries,
        "body_bytes": off,
    }
    head = dumps_json(header).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(body)


def apply_journals(root: Path) -> int:
    """Apply every complete journal in order; idempotent, so a crash mid-apply is
    repaired by applying again. Returns how many were applied."""
    jdir = root / "journal"
    if not jdir.is_dir():
        return 0
    done = 0
    for stale in jdir.glob(
        ".*.tmp"
    ):  # a journal whose write never finished: the edit never happened
        stale.unlink()
    for jpath in sorted(jdir.glob("*.jnl")):
        data = jpath.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        if header.get("format") != JOURNAL_FORMAT or len(data) != 8 + n + header["body_bytes"]:
            raise BankError(f"{jpath}: malformed journal; the bank needs manual repair")
        body = memoryview(data)[8 + n :]
        manifest = header["manifest"]
        levels = {int(k): LevelInfo(**v) for k, v in manifest["levels"].items()}
        by_level: dict[int, list[dict]] = {}
        for e in header["entries"]:
            by_level.setdefault(e["level"], []).append(e)
        for lv, entries in by_level.items():
            info = levels[lv]
            fd = os.open(level_path(root, info), os.O_WRONLY)
            sfd = os.open(root / sums_name(info), os.O_WRONLY)
            try:
                for e in entries:
                    rec = body[e["offset"] : e["offset"] + e["length"]]
                    os.pwrite(fd, rec, e["slot"] * info.stride)
                    os.pwrite(sfd, digest(rec), e["slot"] * DIGEST_BYTES)
                os.fsync(fd)
                os.fsync(sfd)
            finally:
                os.close(fd)
                os.close(sfd)
        atomic_write_json(root / "manifest.json", manifest)
        jpath.unlink()
        done += 1
    return done


def recover(root: str | os.PathLike) -> int:
    """Finish any interrupted edit of the bank at root (called by every open): put back
    a bank whose replacement was interrupted, drop temp files of interrupted atomic
    writes, replay complete journals. Done under the writer lock; if a live process holds
    it, that writer is mid-operation (its temp files and journal are its own) and will
    finish them, so nothing is touched."""
    root = Path(root)
    if not _needs_recovery(root):
        return 0
    try:
        with bank_writer(root, operation="recover"), exclusive_change(root):
            restore_replaced_dir(root)
            if root.is_dir():
                for stale in root.glob(".*.tmp"):
                    stale.unlink(missing_ok=True)
            return apply_journals(root)
    except BankBusy:
        return 0


def _needs_recovery(root: Path) -> bool:
    if not root.exists():
        return (root.parent / f".{root.name}.tmp-old").is_dir()
    jdir = root / "journal"
    return any(root.glob(".*.tmp")) or (
        jdir.is_dir() and (any(jdir.glob("*.jnl")) or any(jdir.glob(".*.tmp")))
    )
