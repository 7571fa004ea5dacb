"""Per-subtree banks: split a bank by level-1 subtree, merge the pieces back, move level files.

The paper trains memories with one job per level-1 subtree and merges the
checkpoints afterwards (seed 002 App. A.2). Cluster ids are nested (children of
p are p·B … p·B+B−1), so subtree s owns the contiguous id range
[s·B^(l−1), (s+1)·B^(l−1)) at every level l: a per-subtree bank is the same
format with `subtree: s` and only those slots, and merging is a concatenation
of slot ranges in subtree order, plus the generic memory's slot.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import fsspec
import torch

from memtree.config import from_dict
from memtree.geometry import AnchorShape, MemoryConfig
from memtree.io import atomic_dir, atomic_write_json, read_json
from memtree.memstore.format import (
    DIGEST_BYTES,
    GENERIC,
    BankError,
    BankInfo,
    LevelInfo,
    build_manifest,
    check_files,
    digest,
    is_url,
    level_path,
    read_manifest,
    sums_name,
)
from memtree.memstore.journal import recover
from memtree.memstore.locking import bank_writer, exclusive_change
from memtree.memstore.policy import id_runs

GenericMerge = Literal["mean", "first"]


def _copy_slots(
    src: BankInfo, level: int, first_slot: int, n: int, out, sums_out: bytearray, out_slot: int
) -> None:
    lv = src.level(level)
    with fsspec.open(level_path(src.root, lv), "rb") as f:
        f.seek(first_slot * lv.stride)
        out.seek(out_slot * lv.stride)
        remaining = n * lv.stride
        while remaining:
            chunk = f.read(min(remaining, 64 << 20))
            out.write(chunk)
            remaining -= len(chunk)
    sums = (src.root / sums_name(lv)).read_bytes()
    sums_out[out_slot * DIGEST_BYTES : (out_slot + n) * DIGEST_BYTES] = sums[
        first_slot * DIGEST_BYTES : (first_slot + n) * DIGEST_BYTES
    ]


def _same_bank_shape(a: BankInfo, b: BankInfo) -> None:
    for key in ("anchor", "memory", "dtype", "rank", "tree_id"):
        if a.manifest[key] != b.manifest[key]:
            raise BankError(
                f"{b.root}: {key} differs from {a.root} "
                f"({b.manifest[key]!r} vs {a.manifest[key]!r})"
            )


def _deleted_only_in(info: BankInfo) -> dict[str, list[list[int]]]:
    return info.manifest.get("deleted", {})


def split_bank(root: str | os.PathLike, subtree: int, out: str | os.PathLike) -> BankInfo:
    """Write the per-subtree bank of level-1 cluster `subtree` (with the generic memory)."""
    with _locked([root], out, "split"):
        recover(root)
        src = read_manifest(root)
        check_files(src)
        if src.subtree is not None:
            raise BankError(f"{src.root}: already a per-subtree bank (subtree {src.subtree})")
        generic = any(lv.has_generic for lv in src.levels.values())
        manifest = build_manifest(
            anchor=src.anchor,
            memory=src.memory,
            dtype=src.dtype,
            rank=src.rank,
            tree_id=src.tree_id,
            subtree=subtree,
            generic=generic,
            extra={**src.manifest.get("extra", {}), "split_from_generation": src.generation},
        )
        part = _info(out, manifest)
        deleted = {}
        with atomic_dir(out, publish_guard=lambda: exclusive_change(out)) as tmp:
            for level, lv in part.levels.items():
                sums = bytearray(lv.n_slots * DIGEST_BYTES)
                with open(tmp / lv.file, "wb") as f:
                    f.truncate(lv.file_bytes)
                    _copy_slots(src, level, lv.first_cluster, lv.n_blocks, f, sums, 0)
                    if generic:
                        _copy_slots(src, level, src.level(level).n_blocks, 1, f, sums, lv.n_blocks)
                (tmp / sums_name(lv)).write_bytes(bytes(sums))
                hi = lv.first_cluster + lv.n_blocks
                ids = [
                    i
                    for a, b in _deleted_only_in(src).get(str(level), [])
                    for i in range(a, b)
                    if lv.first_cluster <= i < hi
                ]
                if ids:
                    deleted[str(level)] = id_runs(ids)
            if deleted:
                manifest["deleted"] = deleted
            atomic_write_json(tmp / "manifest.json", manifest)
            _copy_policy(src.root, tmp)
        return read_manifest(out)


def merge_banks(
    parts: Sequence[str | os.PathLike], out: str | os.PathLike, *, generic: GenericMerge = "mean"
) -> BankInfo:
    """Merge per-subtree banks (one per level-1 subtree, any order) into one bank.

    Blocks are copied byte for byte. The generic memory, trained by every job,
    is their element-wise mean (`generic="mean"`) or subtree 0's (`"first"`).
    Deleted lists and blocked sets are united; audit logs are concatenated. The parts' and the
    output's writer locks are held throughout, so no part changes while it is copied.
    """
    with _locked(parts, out, "merge"):
        infos = []
        for p in parts:
            recover(p)
            info = read_manifest(p)
            check_files(info)
            infos.append(info)
        if not infos:
            raise BankError("merge: no banks given")
        B = infos[0].memory.branching
        by_subtree: dict[int, BankInfo] = {}
        for info in infos:
            if info.subtree is None:
                raise BankError(f"{info.root}: not a per-subtree bank (manifest subtree is null)")
            if info.subtree in by_subtree:
                raise BankError(
                    f"merge: subtree {info.subtree} given twice "
                    f"({by_subtree[info.subtree].root}, {info.root})"
                )
            _same_bank_shape(infos[0], info)
            by_subtree[info.subtree] = info
        missing = sorted(set(range(B)) - set(by_subtree))
        if missing:
            raise BankError(f"merge: subtrees {missing} are missing; a merged bank needs all {B}")
        if generic not in ("mean", "first"):
            raise ValueError(f"merge: generic={generic!r} is not 'mean' or 'first'")
        first = by_subtree[0]
        has_generic = any(lv.has_generic for lv in first.levels.values())
        manifest = build_manifest(
            anchor=first.anchor,
            memory=first.memory,
            dtype=first.dtype,
            rank=first.rank,
            tree_id=first.tree_id,
            subtree=None,
            generic=has_generic,
            extra={
                "merged_from": [str(by_subtree[s].root) for s in range(B)],
                "generic_merge": generic,
            },
        )
        merged = _info(out, manifest)
        deleted: dict[str, list[int]] = {}
        with atomic_dir(out, publish_guard=lambda: exclusive_change(out)) as tmp:
            for level, lv in merged.levels.items():
                sums = bytearray(lv.n_slots * DIGEST_BYTES)
                with open(tmp / lv.file, "wb") as f:
                    f.truncate(lv.file_bytes)
                    for s in range(B):
                        part = by_subtree[s]
                        plv = part.level(level)
                        _copy_slots(part, level, 0, plv.n_blocks, f, sums, plv.first_cluster)
                        for a, b in _deleted_only_in(part).get(str(level), []):
                            deleted.setdefault(str(level), []).extend(range(a, b))
                    if has_generic:
                        rec = _merged_generic(
                            merged, level, [by_subtree[s] for s in range(B)], generic
                        )
                        f.seek(lv.n_blocks * lv.stride)
                        f.write(rec)
                        sums[lv.n_blocks * DIGEST_BYTES : (lv.n_blocks + 1) * DIGEST_BYTES] = (
                            digest(rec)
                        )
                (tmp / sums_name(lv)).write_bytes(bytes(sums))
            if deleted:
                manifest["deleted"] = {k: id_runs(v) for k, v in deleted.items()}
            atomic_write_json(tmp / "manifest.json", manifest)
            _merge_policies([by_subtree[s].root for s in range(B)], tmp)
        return read_manifest(out)


def _merged_generic(
    merged: BankInfo, level: int, parts: list[BankInfo], how: GenericMerge
) -> bytes:
    codec = merged.codec(level)
    vals = []
    for part in parts[: 1 if how == "first" else None]:
        lv = part.level(level)
        with fsspec.open(level_path(part.root, lv), "rb") as f:
            f.seek(lv.n_blocks * lv.stride)
            rec = f.read(lv.record_bytes)
        if (
            digest(rec)
            != (part.root / sums_name(lv)).read_bytes()[lv.n_blocks * DIGEST_BYTES :][:DIGEST_BYTES]
        ):
            raise BankError(
                f"checksum mismatch: level {level}, generic memory in {level_path(part.root, lv)}"
            )
        if how == "first":
            return rec  # byte-identical: re-encoding would quantise again
        vals.append(codec.decode(rec, torch.float32))
    return codec.encode(torch.stack(vals).mean(0))


def _info(root: str | os.PathLike, manifest: dict) -> BankInfo:
    return BankInfo(
        root=Path(root),
        manifest=manifest,
        anchor=from_dict(AnchorShape, manifest["anchor"]),
        memory=from_dict(MemoryConfig, manifest["memory"]),
        dtype=manifest["dtype"],
        rank=manifest["rank"],
        tree_id=manifest["tree_id"],
        subtree=manifest["subtree"],
        levels={int(k): LevelInfo(**v) for k, v in manifest["levels"].items()},
    )


def _copy_policy(src: Path, dst: Path) -> None:
    for name in ("policy.json", "audit.jsonl"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def _merge_policies(parts: list[Path], dst: Path) -> None:
    blocked: dict[str, list[int]] = {}
    fallback = None
    audit = b""
    for p in parts:
        if (p / "policy.json").exists():
            pol = read_json(p / "policy.json")
            fallback = fallback or pol["fallback"]
            for lv, runs in pol["blocked"].items():
                blocked.setdefault(lv, []).extend(i for a, b in runs for i in range(a, b))
        if (p / "audit.jsonl").exists():
            audit += (p / "audit.jsonl").read_bytes()
    if blocked or fallback:
        atomic_write_json(
            dst / "policy.json",
            {
                "format": "memtree-bank-policy",
                "version": 1,
                "fallback": fallback or "zeros",
                "blocked": {k: id_runs(v) for k, v in blocked.items()},
            },
        )
    if audit:
        (dst / "audit.jsonl").write_bytes(audit)


def relocate_level(root: str | os.PathLike, level: int, dest: str) -> str:
    """Move one level's file to another directory or fsspec URL (e.g. a slower disk).

    Copy, verify every record against its digest at the destination, switch the
    manifest atomically, then remove the old copy. Returns the new location.
    """
    with bank_writer(root, operation="relocate"):
        return _relocate_level(Path(root), level, dest)


def _relocate_level(root: Path, level: int, dest: str) -> str:
    recover(root)
    info = read_manifest(root)
    check_files(info)
    lv = info.level(level)
    old = level_path(root, lv)
    name = Path(lv.file.split("://")[-1]).name
    if is_url(dest):
        new = dest.rstrip("/") + "/" + name
    else:
        Path(dest).mkdir(parents=True, exist_ok=True)
        new = str(Path(dest).resolve() / name)
    if new == old:
        return new
    with fsspec.open(old, "rb") as src, fsspec.open(new + ".tmp", "wb") as out:
        shutil.copyfileobj(src, out, 64 << 20)
    fs, p = fsspec.core.url_to_fs(new + ".tmp")
    sums = (root / sums_name(lv)).read_bytes()
    with fs.open(p, "rb") as f:
        for s in range(lv.n_slots):
            f.seek(s * lv.stride)
            if digest(f.read(lv.record_bytes)) != sums[s * DIGEST_BYTES : (s + 1) * DIGEST_BYTES]:
                fs.rm(p)
                raise BankError(
                    f"relocate: copy of level {level} to {new} "
                    f"does not verify (slot {s}); nothing moved"
                )
    fs.mv(p, fsspec.core.url_to_fs(new)[1])
    manifest = dict(info.manifest)
    manifest["levels"] = {
        **manifest["levels"],
        str(level): {
            **manifest["levels"][str(level)],
            "file": new if new != str(root / name) else name,
        },
    }
    with exclusive_change(root):  # readers reopen the level where it now lives
        atomic_write_json(root / "manifest.json", manifest)
        ofs, op = fsspec.core.url_to_fs(old)
        ofs.rm(op)
    return new


@contextlib.contextmanager
def _locked(sources: Sequence[str | os.PathLike], out: str | os.PathLike, operation: str):
    """Writer locks of the source banks (nobody edits them while they are copied) and of `out`."""
    with contextlib.ExitStack() as stack:
        for src in sources:
            stack.enter_context(bank_writer(src, operation=f"{operation} (source)"))
        stack.enter_context(bank_writer(out, operation=operation))
        yield


__all__ = ["GENERIC", "merge_banks", "relocate_level", "split_bank"]
