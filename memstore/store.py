"""The memory store: tiers, fetch by cluster path, training gather/scatter, blocking, deletion.

`MemoryStore` opens a bank written by `memstore.format` and serves it:

- Each level is read through one tier backend chosen by the placement policy
  (`memstore.placement`): RAM (the level file loaded into memory), flash (a
  local file read with `pread`, optionally O_DIRECT so the page cache is
  bypassed), or disk (a slower store: any local path or fsspec URL, read
  through fsspec). A level's file stays where the manifest says it is;
  `relocate_level` moves it to another directory or URL.
- Flash and disk tiers keep an LRU cache of decoded blocks, one byte budget per
  tier shared by the levels it holds; consecutive queries share shallow levels,
  which is where the cache pays.
- Every read is checked against the block's digest (a mismatch names the level,
  cluster and file), and counted per tier: reads, bytes read, cache hits/misses.
- Blocked and deleted blocks are refused *before* any tier is touched, so the
  read counters prove they were never read; fetch substitutes the fallback
  (zeros = no memory, or the generic memory).
- Edits (scatter, delete, edit) are journaled: the new records are written to
  `journal/` atomically, then applied in place, then the manifest generation is
  bumped and the journal removed. A crash before the journal lands leaves the
  previous version; after it, opening the bank replays it. Either way every
  block is whole.
- Block / unblock / delete / edit append to `audit.jsonl` (who, when, what, why).
- One writer per bank, across processes (`memstore.locking`): every write takes
  the bank's writer lock (a second writer waits `lock_wait` seconds, then fails
  naming the holder) and first reloads what another process changed, so no
  update is lost. Reads hold the bank's reader lock for one fetch / gather and
  reload when the bank's change counter moved: a fetch sees the old bank or the
  new one, never a mix, and a block is honoured by every open store's next fetch.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

import fsspec
import numpy as np
import torch

from memtree.io import atomic_write_bytes, atomic_write_json, check_format, read_json, utc_timestamp
from memtree.memstore.cache import ByteLRU
from memtree.memstore.format import (
    ALIGN,
    DIGEST_BYTES,
    GENERIC,
    TORCH_DTYPES,
    BankError,
    BankInfo,
    LevelInfo,
    check_files,
    check_tree,
    corrupt_message,
    digest,
    is_url,
    level_path,
    read_manifest,
    sums_name,
)
from memtree.memstore.journal import (
    apply_journals,
    audit_log,
    blocked_as_subtree,
    journal_bytes,
    recover,
)
from memtree.memstore.locking import ReadWriteLock, bank_writer, whoami
from memtree.memstore.placement import TierBudget, place_levels

POLICY_FORMAT = "memtree-bank-policy"
Fallback = Literal["zeros", "generic"]


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """One storage tier. Tiers are listed fastest first."""

    name: str
    kind: Literal["ram", "flash", "disk"]
    capacity_bytes: int | None = None  # placement budget; None = unbounded
    cache_bytes: int = 0  # LRU of decoded blocks (flash/disk); RAM needs none
    direct: bool = False  # flash: O_DIRECT reads, bypassing the page cache


DEFAULT_TIERS: tuple[TierConfig, ...] = (
    TierConfig(name="ram", kind="ram", capacity_bytes=1 << 30),
    TierConfig(name="flash", kind="flash", cache_bytes=256 << 20),
)


@dataclass
class TierStats:
    reads: int = 0
    bytes_read: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    load_bytes: int = 0  # bytes read to fill a RAM tier at open

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


# --------------------------------------------------------------------------- tier backends


class _LevelReader:
    """Reads whole records of one level from where its file lives."""

    def __init__(self, path: str, lv: LevelInfo, stats: TierStats) -> None:
        self.path, self.lv, self.stats = path, lv, stats

    def read(self, slot: int) -> memoryview:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _RamReader(_LevelReader):
    def __init__(self, path: str, lv: LevelInfo, stats: TierStats) -> None:
        super().__init__(path, lv, stats)
        with _open_any(path) as f:
            self.buf = bytearray(f.read())
        stats.load_bytes += len(self.buf)

    def read(self, slot: int) -> memoryview:
        off = slot * self.lv.stride
        self.stats.reads += 1
        self.stats.bytes_read += self.lv.record_bytes
        # a copy: cached tensors must not alias a buffer that edits overwrite
        return memoryview(bytearray(self.buf[off : off + self.lv.record_bytes]))

    def write(self, slot: int, record: bytes) -> None:
        off = slot * self.lv.stride
        self.buf[off : off + len(record)] = record


class _FlashReader(_LevelReader):
    def __init__(self, path: str, lv: LevelInfo, stats: TierStats, direct: bool) -> None:
        super().__init__(path, lv, stats)
        flags = os.O_RDONLY
        self.direct = direct and hasattr(os, "O_DIRECT")
        if self.direct:
            flags |= os.O_DIRECT
        try:
            self.fd = os.open(path, flags)
        except OSError as e:
            if not self.direct:
                raise
            # filesystems such as tmpfs refuse O_DIRECT; fall back to buffered reads
            self.direct = False
            self.fd = os.open(path, os.O_RDONLY)
            del e

    def read(self, slot: int) -> memoryview:
        n = self.lv.stride if self.direct else self.lv.record_bytes
        # O_DIRECT needs an aligned buffer: an aligned window of a heap array (a fresh mmap
        # per read would fault in and zero every page, halving throughput)
        raw = np.empty(n + ALIGN, dtype=np.uint8)
        start = (-raw.ctypes.data) % ALIGN
        buf = memoryview(raw[start : start + n])
        got = os.preadv(self.fd, [buf], slot * self.lv.stride)
        if got < self.lv.record_bytes:
            raise BankError(f"{self.path}: short read at level {self.lv.level} slot {slot} "
                            f"({got} of {self.lv.record_bytes} bytes); file truncated?")
        self.stats.reads += 1
        self.stats.bytes_read += got
        return buf[: self.lv.record_bytes]

    def close(self) -> None:
        os.close(self.fd)


class _DiskReader(_LevelReader):
    def __init__(self, path: str, lv: LevelInfo, stats: TierStats) -> None:
        super().__init__(path, lv, stats)
        self.f = _open_any(path, block_size=0)
        self.lock = threading.Lock()

    def read(self, slot: int) -> memoryview:
        with self.lock:
            self.f.seek(slot * self.lv.stride)
            data = self.f.read(self.lv.record_bytes)
        if len(data) < self.lv.record_bytes:
            raise BankError(f"{self.path}: short read at level {self.lv.level} slot {slot}; file truncated?")
        self.stats.reads += 1
        self.stats.bytes_read += len(data)
        return memoryview(bytearray(data))

    def close(self) -> None:
        self.f.close()


def _open_any(path: str, **kw):
    if is_url(path):
        return fsspec.open(path, "rb", **kw).open()
    return open(path, "rb", buffering=0 if kw.get("block_size") == 0 else -1)


# --------------------------------------------------------------------------- the store


def id_runs(ids: Iterable[int]) -> list[list[int]]:
    """Sorted ids → [[start, stop), …] runs, for compact policy files and audit entries."""
    out: list[list[int]] = []
    for i in sorted({int(x) for x in ids}):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


@dataclass
class _Level:
    info: LevelInfo
    tier: str
    reader: _LevelReader
    sums: bytearray
    mask: np.ndarray  # refused (blocked or deleted) slots
    cache: ByteLRU | None
    verified: set[int] = field(default_factory=set)
    hits: int = 0  # cache hits for this level (the tier's cache is shared by its levels)
    misses: int = 0


class MemoryStore:
    """Serve a memory bank by cluster path. See the module docstring for guarantees.

    `verify`: "always" checks every read against its digest, "once" each block once
    per open store (then trusts the page it read), "never" skips the check.
    `out_dtype`: dtype of returned tensors (default: the storage dtype for fp32/bf16/fp16,
    float32 for quantised or low-rank banks).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        tiers: Sequence[TierConfig] = DEFAULT_TIERS,
        placement: str | Mapping[int, str] = "hierarchical",
        tree: Any | None = None,
        verify: Literal["always", "once", "never"] = "always",
        out_dtype: torch.dtype | None = None,
        user: str | None = None,
        lock_wait: float = 0.0,
    ) -> None:
        self.root = Path(root)
        recover(self.root)
        if verify not in ("always", "once", "never"):
            raise ValueError(f"verify: {verify!r} is not one of 'always', 'once', 'never'")
        self.verify, self.out_dtype = verify, out_dtype
        self.lock_wait = lock_wait  # seconds a write waits for another process's writer lock
        self.user = user or whoami()
        self.tiers = {t.name: t for t in tiers}
        if len(self.tiers) != len(tiers):
            raise ValueError(f"tier names must be unique: {[t.name for t in tiers]}")
        self.tier_stats = {t.name: TierStats() for t in tiers}
        self._placement_rule, self._tree = placement, tree
        self._session: list[tuple[str, Any]] = []  # persist=False (un)blocks, experiment fallbacks: kept over reloads
        self._mutex = threading.RLock()  # one operation at a time per store: the lock fd is shared
        self._depth = 0
        self.levels: dict[int, _Level] = {}
        self.refused_served: dict[int, int] = {}
        self._rw = ReadWriteLock(self.root)
        with self._rw.shared() as seen:
            self._load()
            self._seen = seen

    def _load(self) -> None:
        """(Re)read manifest, digests and policy and (re)open the level files; counters survive."""
        info = read_manifest(self.root)
        check_files(info)
        if self._tree is not None:
            check_tree(info, self._tree)
        self._close_levels()
        self.info = info
        level_bytes = {lv.level: lv.file_bytes for lv in self.info.levels.values()}
        self.placement = place_levels(
            level_bytes, [TierBudget(name=t.name, capacity_bytes=t.capacity_bytes) for t in self.tiers.values()],
            self._placement_rule,
        )
        self._disk_policy = read_policy(self.root)
        self._effective_policy(masks=False)
        self._codecs = {lv: self.info.codec(lv) for lv in self.info.levels}
        self.caches: dict[str, ByteLRU] = {}
        for lv in self.info.levels.values():
            tname = self.placement[lv.level]
            tier = self.tiers[tname]
            path = self._file_path(lv)
            stats = self.tier_stats[tname]
            if tier.kind == "ram":
                reader: _LevelReader = _RamReader(path, lv, stats)
            elif tier.kind == "flash":
                if is_url(path):
                    raise BankError(f"level {lv.level} lives at {path}; a flash tier needs a local file")
                reader = _FlashReader(path, lv, stats, tier.direct)
            else:
                reader = _DiskReader(path, lv, stats)
            if tname not in self.caches and tier.kind != "ram" and tier.cache_bytes > 0:
                self.caches[tname] = ByteLRU(tier.cache_bytes)  # one budget per tier, shared by its levels
            cache = self.caches.get(tname)
            self.levels[lv.level] = _Level(info=lv, tier=tname, reader=reader,
                                           sums=bytearray((self.root / sums_name(lv)).read_bytes()),
                                           mask=self._refused_mask(lv), cache=cache)
            self.refused_served.setdefault(lv.level, 0)
        self._identity = _identity(self.root, self.info)

    def _reload(self) -> None:
        """Another process changed the bank: only the policy (a block), or the blocks themselves."""
        if _identity(self.root, read_manifest(self.root)) == self._identity:
            self._disk_policy = read_policy(self.root)
            self._effective_policy()
        else:
            self._load()

    @contextlib.contextmanager
    def _reading(self):
        """One consistent read: the reader lock held shared, the bank reloaded first if it changed."""
        with self._mutex:
            if self._depth:
                yield
                return
            with self._rw.shared() as counter:
                self._catch_up(counter)
                self._depth = 1
                try:
                    yield
                finally:
                    self._depth = 0

    @contextlib.contextmanager
    def _writing(self, operation: str):
        """The bank's writer lock for one operation, with this store brought up to date first."""
        with bank_writer(self.root, operation=operation, wait=self.lock_wait), self._mutex:
            self.refresh()
            yield

    def refresh(self) -> bool:
        """Reload now if another process changed the bank; True if it had. Every fetch does this
        itself, so a long-running reader needs it only to see changes between fetches."""
        with self._mutex, self._rw.shared() as counter:
            return self._catch_up(counter)

    def _catch_up(self, counter: int) -> bool:
        """Reload if the bank's change counter moved past what this store last saw."""
        if counter == self._seen:
            return False
        self._reload()
        self._seen = counter
        return True

    # -- plumbing ---------------------------------------------------------------
    def _file_path(self, lv: LevelInfo) -> str:
        return level_path(self.root, lv)

    def _refused_mask(self, lv: LevelInfo) -> np.ndarray:
        mask = np.zeros(lv.n_blocks, dtype=bool)
        for source in (self.policy["blocked"], self.info.manifest.get("deleted", {})):
            for start, stop in source.get(str(lv.level), []):
                lo, hi = max(start - lv.first_cluster, 0), min(stop - lv.first_cluster, lv.n_blocks)
                if lo < hi:
                    mask[lo:hi] = True
        return mask

    def _close_levels(self) -> None:
        for lv in self.levels.values():
            lv.reader.close()
        self.levels = {}

    def close(self) -> None:
        self._close_levels()
        self._rw.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def fallback(self) -> Fallback:
        return self.policy["fallback"]

    def codec(self, level: int):
        return self._codecs[level]

    def _level(self, level: int) -> _Level:
        try:
            return self.levels[level]
        except KeyError:
            raise BankError(f"{self.root}: level {level} holds no memory (levels: {sorted(self.levels)})") from None

    # -- reading ------------------------------------------------------------------
    def _read_slot(self, L: _Level, slot: int) -> torch.Tensor:
        key = (L.info.level, slot)
        if L.cache is not None:
            hit = L.cache.get(key)
            stats = self.tier_stats[L.tier]
            if hit is not None:
                stats.cache_hits += 1
                L.hits += 1
                return hit.clone()  # callers may edit what they fetch; the cached block must not change
            stats.cache_misses += 1
            L.misses += 1
        rec = L.reader.read(slot)
        if self.verify == "always" or (self.verify == "once" and slot not in L.verified):
            if digest(rec) != bytes(L.sums[slot * DIGEST_BYTES : (slot + 1) * DIGEST_BYTES]):
                raise BankError(corrupt_message(self.info, L.info, slot))
            L.verified.add(slot)
        t = self._codecs[L.info.level].decode(rec, self.out_dtype)
        if L.cache is not None:
            L.cache.put(key, t, t.numel() * t.element_size())
            return t.clone()
        return t

    def is_refused(self, level: int, cluster: int) -> bool:
        with self._reading():
            L = self._level(level)
            slot = L.info.slot(cluster)
            return cluster != GENERIC and bool(L.mask[slot])

    def fetch_flat(self, level: int, cluster: int) -> torch.Tensor:
        """One block as a flat (params,) tensor; a blocked/deleted block yields the
        fallback without touching any tier. `cluster=GENERIC` reads the generic memory."""
        with self._reading():
            L = self._level(level)
            slot = L.info.slot(cluster)
            if cluster != GENERIC and L.mask[slot]:
                self.refused_served[level] += 1
                if self.fallback == "generic" and L.info.has_generic:
                    return self._read_slot(L, L.info.n_blocks)
                return torch.zeros(L.info.params, dtype=self._zero_dtype())
            return self._read_slot(L, slot)

    def _zero_dtype(self) -> torch.dtype:
        if self.out_dtype is not None:
            return self.out_dtype
        return TORCH_DTYPES.get(self.info.dtype, torch.float32) if not self.info.rank else torch.float32

    def fetch(self, path: Sequence[int], *, flat: bool = False) -> dict[int, Any]:
        """Blocks of every memory level on a path of global cluster ids (one per tree level).

        Returns {level: {tensor name: tensor shaped as geometry.block_layout}} ready to
        attach (or {level: flat tensor} with flat=True). One contiguous read per level
        not in cache.
        """
        path = [int(c) for c in path]
        with self._reading():
            if len(path) < max(self.levels):
                raise ValueError(f"path {path} has {len(path)} levels; this bank needs {max(self.levels)}")
            out = {}
            for level in self.levels:
                t = self.fetch_flat(level, path[level - 1])
                out[level] = t if flat else self._codecs[level].unflatten(t)
            return out

    def fetch_generic(self, *, flat: bool = False) -> dict[int, Any]:
        with self._reading():
            out = {}
            for level in self.levels:
                t = self.fetch_flat(level, GENERIC)
                out[level] = t if flat else self._codecs[level].unflatten(t)
            return out

    def gather(self, paths: np.ndarray | torch.Tensor | Sequence[Sequence[int]]) -> dict[int, torch.Tensor]:
        """Training-time batch fetch: paths (B, L) global ids → {level: (B, params)}.

        Each distinct block is read once however many rows share it; rows whose
        path entry is GENERIC (-1) get the generic memory.
        """
        p = np.asarray(paths.cpu() if isinstance(paths, torch.Tensor) else paths, dtype=np.int64)
        with self._reading():
            if p.ndim != 2 or p.shape[1] < max(self.levels):
                raise ValueError(f"gather: paths must be (B, >= {max(self.levels)}), got {p.shape}")
            out = {}
            for level in self.levels:
                ids, inverse = np.unique(p[:, level - 1], return_inverse=True)
                blocks = torch.stack([self.fetch_flat(level, int(c)) for c in ids])
                out[level] = blocks[torch.from_numpy(inverse.reshape(-1))]
            return out

    # -- writing (journaled) -----------------------------------------------------------
    def scatter(self, level: int, clusters: Sequence[int], values: torch.Tensor) -> None:
        """Write updated blocks back: values (n, params) for global cluster ids (or GENERIC)."""
        values = torch.as_tensor(values)
        if values.ndim != 2 or values.shape[0] != len(clusters):
            raise ValueError(f"scatter: values must be (len(clusters)={len(clusters)}, params), got "
                             f"{tuple(values.shape)}")
        with self._writing("scatter"):
            self._scatter(level, clusters, values)

    def _scatter(self, level: int, clusters: Sequence[int], values: torch.Tensor) -> None:
        L = self._level(level)
        slots = [L.info.slot(int(c)) for c in clusters]
        refused = [int(c) for c, s in zip(clusters, slots, strict=True) if c != GENERIC and L.mask[s]]
        if refused:
            raise BankError(f"scatter: level {level} clusters {refused[:10]} are blocked or deleted; "
                            "unblock them first (deleted blocks stay deleted)")
        codec = self._codecs[level]
        self._commit([(level, s, codec.encode(v)) for s, v in zip(slots, values, strict=True)])

    def edit(self, level: int, cluster: int, values: torch.Tensor | Mapping[str, torch.Tensor], *,
             reason: str = "") -> None:
        """Replace one block (flat tensor, or {tensor name: tensor} covering the layout)."""
        codec = self._codecs[level]
        if isinstance(values, Mapping):
            names = [t.name for t in codec.layout]
            if set(values) != set(names):
                raise ValueError(f"edit: level {level} needs tensors {names}, got {sorted(values)}")
            for t in codec.layout:
                if tuple(torch.as_tensor(values[t.name]).shape) != t.shape:
                    raise ValueError(f"edit: level {level} tensor {t.name} must have shape {t.shape}, "
                                     f"got {tuple(torch.as_tensor(values[t.name]).shape)}")
            values = torch.cat([torch.as_tensor(values[n]).reshape(-1) for n in names])
        with self._writing("edit"):
            self._scatter(level, [cluster], torch.as_tensor(values).reshape(1, -1))
            self._audit("edit", {level: [cluster]}, reason)

    def delete(self, level: int, clusters: Sequence[int] = (), *, subtree: bool = False, reason: str = "") -> dict:
        """Erase blocks: their bytes are overwritten with zeros in place, the digests and
        manifest updated, and they are refused from then on. `subtree=True` deletes the
        given clusters' whole subtrees at this and every deeper level."""
        with self._writing("delete"):
            return self._delete(level, clusters, subtree, reason)

    def _delete(self, level: int, clusters: Sequence[int], subtree: bool, reason: str) -> dict:
        targets = self._expand(level, clusters, subtree)
        self._erase(targets)
        self._audit("delete", targets, reason, level=level, clusters=sorted({int(c) for c in clusters}),
                    subtree=bool(subtree))
        return {lv: len(ids) for lv, ids in targets.items()}

    def _erase(self, targets: Mapping[int, Sequence[int]]) -> None:
        manifest = copy.deepcopy(self.info.manifest)  # untouched if the commit fails
        deleted = manifest.setdefault("deleted", {})
        writes = []
        for lv, ids in targets.items():
            L = self.levels[lv]
            zero = bytes(L.info.record_bytes)
            writes += [(lv, L.info.slot(c), zero) for c in ids]
            merged = [i for a, b in deleted.get(str(lv), []) for i in range(a, b)]
            deleted[str(lv)] = id_runs(merged + list(ids))
        self._commit(writes, manifest=manifest)
        for lv in targets:
            self.levels[lv].mask = self._refused_mask(self.levels[lv].info)

    def _commit(self, writes: list[tuple[int, int, bytes]], manifest: dict | None = None) -> None:
        manifest = dict(manifest or self.info.manifest)
        manifest["generation"] = self.info.generation + 1
        for lv, _, _ in writes:
            if is_url(self._file_path(self.levels[lv].info)):
                raise BankError(f"level {lv} lives at {self._file_path(self.levels[lv].info)}, which is "
                                "read-only here; relocate it to a local path to edit it")
        journal = journal_bytes(manifest, writes)
        jdir = self.root / "journal"
        jdir.mkdir(exist_ok=True)
        atomic_write_bytes(jdir / f"{manifest['generation']:012d}.jnl", journal)
        with self._rw.exclusive() as counter:  # readers wait while bytes change, then reload
            apply_journals(self.root)
            self._seen = counter
        self.info = read_manifest(self.root)
        self._identity = _identity(self.root, self.info)
        for lv, slot, rec in writes:
            L = self.levels[lv]
            L.sums[slot * DIGEST_BYTES : (slot + 1) * DIGEST_BYTES] = digest(rec)
            L.verified.discard(slot)
            if L.cache is not None:
                L.cache.discard((lv, slot))
            if isinstance(L.reader, _RamReader):
                L.reader.write(slot, rec)

    # -- blocking ------------------------------------------------------------------------
    def _expand(self, level: int, clusters: Sequence[int], subtree: bool) -> dict[int, list[int]]:
        L = self._level(level)
        for c in clusters:
            if int(c) == GENERIC:
                raise ValueError(f"level {level}: the generic memory cannot be blocked or deleted")
            L.info.slot(int(c))  # validates the id
        out = {level: sorted({int(c) for c in clusters})}
        if subtree:
            B = self.info.memory.branching
            for deeper in sorted(x for x in self.levels if x > level):
                span = B ** (deeper - level)
                out[deeper] = [c * span + j for c in out[level] for j in range(span)]
        return out

    def block(self, level: int, clusters: Sequence[int], *, subtree: bool = False, reason: str = "",
              persist: bool = True) -> dict:
        """Refuse blocks from now on: in every process, at its next fetch. Returns counts per level.
        `persist=False` blocks for this open store only (an experiment on a shared bank):
        policy.json and the audit log are left alone."""
        return self._set_blocked("block", level, clusters, subtree, reason, persist)

    def unblock(self, level: int, clusters: Sequence[int], *, subtree: bool | None = None, reason: str = "",
                persist: bool = True) -> dict:
        """Lift blocks. `subtree=None` (the default) undoes what blocked them: a cluster whose latest
        block named it with `subtree=True` (`blocking.adversarial_block` / `random_block` block that
        way) is lifted with its whole subtree, any other alone. True / False force either."""
        if subtree is None:
            with self._mutex:
                entries = audit_log(self.root) if persist else [
                    {"action": a, "targets": {str(k): id_runs(v) for k, v in t.items()}}
                    for a, t in self._session if a != "fallback"]
            roots = set(blocked_as_subtree(entries, level))
            targets = self._expand(level, [c for c in clusters if int(c) not in roots], False)
            lifted = [c for c in clusters if int(c) in roots]
            for lv, ids in (self._expand(level, lifted, True) if lifted else {}).items():
                targets[lv] = sorted(set(targets.get(lv, [])) | set(ids))
            return self._set_blocked("unblock", level, clusters, None, reason, persist, targets=targets)
        return self._set_blocked("unblock", level, clusters, subtree, reason, persist)

    def _set_blocked(self, action: str, level: int, clusters: Sequence[int], subtree: bool | None, reason: str,
                     persist: bool, targets: dict[int, list[int]] | None = None) -> dict:
        targets = targets if targets is not None else self._expand(level, clusters, bool(subtree))
        counts = {lv: len(ids) for lv, ids in targets.items()}
        if not persist:
            with self._mutex:
                self._session.append((action, targets))
                self._effective_policy()
            return counts
        with self._writing(action):
            _apply_blocked(self._disk_policy, action, targets)
            self._save_policy()
            self._audit(action, targets, reason, level=level, clusters=sorted({int(c) for c in clusters}),
                        subtree="as blocked" if subtree is None else bool(subtree))
        return counts

    def apply_targets(self, action: Literal["block", "unblock", "delete"], targets: Mapping[int, Sequence[int]], *,
                      reason: str = "", **request: Any) -> dict[int, list[int]]:
        """Block, unblock or delete an explicit {level: [global cluster ids]} map as one operation with ONE
        audit entry: `targets` (all it covered), `changed` (the blocks newly blocked, lifted or erased, so
        an undo can lift exactly what a block set) and `request` (what asked for it, e.g. an owner's hash).
        Returns `changed`."""
        if action not in ("block", "unblock", "delete"):
            raise ValueError(f"apply_targets: action {action!r} is not 'block', 'unblock' or 'delete'")
        with self._writing(action):
            targets = {int(lv): self._expand(int(lv), ids, False)[int(lv)] for lv, ids in targets.items() if ids}
            source = self.info.manifest.get("deleted", {}) if action == "delete" else self._disk_policy["blocked"]
            was = {lv: {i for a, b in source.get(str(lv), []) for i in range(a, b)} for lv in targets}
            changed = {lv: sorted(set(ids) - was[lv] if action != "unblock" else set(ids) & was[lv])
                       for lv, ids in targets.items()}
            if action == "delete":
                self._erase(targets)
            else:
                _apply_blocked(self._disk_policy, action, targets)
                self._save_policy()
            self._audit(action, targets, reason, changed={str(lv): id_runs(v) for lv, v in changed.items()},
                        **request)
        return changed

    @contextlib.contextmanager
    def experiment(self, *, fallback: Fallback | None = None):
        """An experiment on this open store: `persist=False` blocks made inside the `with` (and
        `fallback`, if given) are undone when it exits; the bank on disk is never touched. Nests."""
        if fallback is not None:
            self._check_fallback(fallback)
        with self._mutex:
            mark = len(self._session)
            if fallback is not None:
                self._session.append(("fallback", fallback))
                self._effective_policy()
        try:
            yield self
        finally:
            with self._mutex:
                del self._session[mark:]
                self._effective_policy()

    def _effective_policy(self, masks: bool = True) -> None:
        """self.policy = the bank's policy.json + this store's session-only changes, in order."""
        self.policy = copy.deepcopy(self._disk_policy)
        for action, arg in self._session:
            if action == "fallback":
                self.policy["fallback"] = arg
            else:
                _apply_blocked(self.policy, action, arg)
        if masks:
            for L in self.levels.values():
                L.mask = self._refused_mask(L.info)

    def _check_fallback(self, fallback: str) -> None:
        if fallback not in ("zeros", "generic"):
            raise ValueError(f"fallback: {fallback!r} is not 'zeros' or 'generic'")
        if fallback == "generic" and not any(L.info.has_generic for L in self.levels.values()):
            raise BankError(f"{self.root}: fallback 'generic' needs a bank with a generic memory")

    def set_fallback(self, fallback: Fallback) -> None:
        self._check_fallback(fallback)
        with self._writing("set-fallback"):
            self._disk_policy["fallback"] = fallback
            self._save_policy()
            self._audit("set-fallback", {}, fallback)

    def blocked_fraction(self) -> float:
        """Share of the bank's parameters that is refused (blocked or deleted)."""
        total = sum(L.info.n_blocks * L.info.params for L in self.levels.values())
        refused = sum(int(L.mask.sum()) * L.info.params for L in self.levels.values())
        return refused / total if total else 0.0

    def _save_policy(self) -> None:
        """Publish `_disk_policy` (this store's session-only blocks stay out of the file)."""
        with self._rw.exclusive() as counter:
            atomic_write_json(self.root / "policy.json", self._disk_policy)
            self._seen = counter
        self._effective_policy()

    def _audit(self, action: str, targets: Mapping[int, Sequence[int]], reason: str, **request: Any) -> None:
        """One audit line; `request` records what was asked (level, clusters, subtree) beside `targets`,
        every block it covered, so an unblock can undo exactly what a block did."""
        entry = {
            "time": utc_timestamp(), "user": self.user, "host": socket.gethostname(), "action": action,
            "targets": {str(lv): id_runs(ids) for lv, ids in targets.items()},
            "reason": reason, "generation": self.info.generation, **request,
        }
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        fd = os.open(self.root / "audit.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)  # one write of one line: appends from one writer never interleave
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- counters ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "tiers": {n: s.as_dict() for n, s in self.tier_stats.items()},
            "placement": {str(k): v for k, v in self.placement.items()},
            "refused_served": {str(k): v for k, v in self.refused_served.items()},
            "caches": {name: c.stats() for name, c in self.caches.items()},
            "levels": {str(k): {"tier": L.tier, "cache_hits": L.hits, "cache_misses": L.misses,
                                "hit_rate": L.hits / (L.hits + L.misses) if L.hits + L.misses else 0.0}
                       for k, L in self.levels.items()},
        }

    def reset_stats(self) -> None:
        for s in self.tier_stats.values():
            s.reads = s.bytes_read = s.cache_hits = s.cache_misses = 0
        for c in self.caches.values():
            c.hits = c.misses = c.evictions = 0
        for L in self.levels.values():
            L.hits = L.misses = 0
        self.refused_served = {lv: 0 for lv in self.levels}


def _apply_blocked(policy: dict[str, Any], action: str, targets: Mapping[int, Sequence[int]]) -> None:
    for lv, ids in targets.items():
        cur = {i for a, b in policy["blocked"].get(str(lv), []) for i in range(a, b)}
        cur = cur | set(ids) if action == "block" else cur - set(ids)
        policy["blocked"][str(lv)] = id_runs(cur)


def check_path(path: Sequence[int], branching: int) -> None:
    """Refuse a path that no tree of this branching has: level-l ids lie in [0, B^l) and each is a
    child of the one before (global ids nest: children of p are p·B … p·B+B−1). GENERIC (-1) passes.
    `memtree memstore fetch --path` checks with it; `fetch` itself serves any ids the bank holds."""
    B = branching
    for i, c in enumerate(path):
        level = i + 1
        if c != GENERIC and not 0 <= c < B**level:
            raise ValueError(f"path {list(path)}: level-{level} id {c} is out of range [0, {B**level}) "
                             f"for branching {B}")
        if i and c != GENERIC and path[i - 1] != GENERIC and c // B != path[i - 1]:
            p = path[i - 1]
            raise ValueError(f"path {list(path)}: level-{level} id {c} is not a child of level-{level - 1} id {p} "
                             f"(its children are {p * B}…{p * B + B - 1} with branching {B})")


def _identity(root: Path, info: BankInfo) -> tuple:
    """What a reader's open files and digests depend on: the directory (a rewrite or merge
    replaces it), the generation (in-place edits) and where each level's file lives (relocate)."""
    return (os.stat(root).st_ino, info.generation,
            tuple(sorted((lv.level, lv.file) for lv in info.levels.values())))


def read_policy(root: Path) -> dict[str, Any]:
    path = root / "policy.json"
    if not path.exists():
        return {"format": POLICY_FORMAT, "version": 1, "fallback": "zeros", "blocked": {}}
    p = read_json(path)
    check_format(p, POLICY_FORMAT, 1, path, error=BankError)
    if p.get("fallback") not in ("zeros", "generic"):
        raise BankError(f"{path}: fallback {p.get('fallback')!r} is not 'zeros' or 'generic'")
    return p
