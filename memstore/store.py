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

`MemoryStore` is the facade; each concern is a part of its own: the tier backends
(`memstore.tiers`), the open levels with their block caches and verified reads
(`memstore.levels`), the blocking policy and this store's session-only changes
(`memstore.policy`), consistency with other processes (`memstore.sync`), journaled
edits (`memstore.commit`), the audit log (`memstore.audit`) and the counters
(`memstore.stats`). The names callers import from here (`TierConfig`, `DEFAULT_TIERS`,
`TierStats`, `id_runs`, `read_policy`, `POLICY_FORMAT`, `Fallback`) still resolve here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Self

import numpy as np
import torch

from memtree.memstore.audit import append_audit, audit_log, blocked_as_subtree
from memtree.memstore.commit import Write, commit_writes, erase_writes
from memtree.memstore.format import (
    GENERIC,
    TORCH_DTYPES,
    BankError,
    LevelInfo,
    check_files,
    check_tree,
    level_path,
    read_manifest,
)
from memtree.memstore.journal import recover
from memtree.memstore.levels import Level, OpenLevels
from memtree.memstore.locking import whoami
from memtree.memstore.policy import (  # noqa: F401  (re-exported: callers read the policy file from here)
    POLICY_FORMAT,
    BlockPolicy,
    Fallback,
    apply_blocked,
    expand_targets,
    id_runs,
    read_policy,
    refused_mask,
)
from memtree.memstore.stats import StoreStats, TierStats, blocked_fraction
from memtree.memstore.sync import BankSync
from memtree.memstore.tiers import DEFAULT_TIERS, TierConfig


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
        self._stats = StoreStats(t.name for t in tiers)
        self._placement_rule, self._tree = placement, tree
        self._policy = BlockPolicy(self.root)
        self._levels: OpenLevels | None = None
        self._sync = BankSync(self.root)
        self._sync.open(self._load)

    def _load(self) -> None:
        """(Re)read manifest, digests and policy and (re)open the level files; counters survive."""
        info = read_manifest(self.root)
        check_files(info)
        if self._tree is not None:
            check_tree(info, self._tree)
        if self._levels is not None:
            self._levels.close()
        self.info = info
        self._policy.load()
        self._levels = OpenLevels(
            self.root, info, self.tiers, self._placement_rule, self.tier_stats, self._refused_mask
        )
        for level in self.levels:
            self.refused_served.setdefault(level, 0)
        self._sync.note(info)

    def _reload(self) -> None:
        """Another process changed the bank: only the policy (a block), or the blocks themselves."""
        if self._sync.files_changed():
            self._load()
        else:
            self._policy.load()
            self._levels.remask(self._refused_mask)

    def _reading(self):
        """One consistent read: the reader lock held shared, the bank reloaded first if it
        changed."""
        return self._sync.reading(self._reload)

    def _writing(self, operation: str):
        """The bank's writer lock for one operation, with this store brought up to date first."""
        return self._sync.writing(operation, self.lock_wait, self._reload)

    def refresh(self) -> bool:
        """Reload now if another process changed the bank; True if it had. Every fetch does this
        itself, so a long-running reader needs it only to see changes between fetches."""
        return self._sync.refresh(self._reload)

    # -- the parts' state, under the names callers read ---------------------------------------
    @property
    def levels(self) -> dict[int, Level]:
        return self._levels.levels

    @property
    def placement(self) -> dict[int, str]:
        return self._levels.placement

    @property
    def caches(self) -> dict:
        return self._levels.caches

    @property
    def tier_stats(self) -> dict[str, TierStats]:
        return self._stats.tiers

    @property
    def refused_served(self) -> dict[int, int]:
        return self._stats.refused_served

    @property
    def policy(self) -> dict[str, Any]:
        return self._policy.effective

    @property
    def fallback(self) -> Fallback:
        return self._policy.fallback

    def codec(self, level: int):
        return self._levels.codecs[level]

    def _refused_mask(self, lv: LevelInfo) -> np.ndarray:
        return refused_mask(lv, self.policy, self.info.manifest.get("deleted", {}))

    def _policy_changed(self) -> None:
        """Recombine the policy with this store's session-only changes and remask every level."""
        self._policy.combine()
        self._levels.remask(self._refused_mask)

    def close(self) -> None:
        self._levels.close()
        self._sync.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _level(self, level: int) -> Level:
        try:
            return self.levels[level]
        except KeyError:
            raise BankError(
                f"{self.root}: level {level} holds no memory (levels: {sorted(self.levels)})"
            ) from None

    # -- reading ------------------------------------------------------------------
    def _read_slot(self, L: Level, slot: int) -> torch.Tensor:
        return self._levels.read(L, slot, self.verify, self.out_dtype)

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
        return (
            TORCH_DTYPES.get(self.info.dtype, torch.float32)
            if not self.info.rank
            else torch.float32
        )

    def fetch(self, path: Sequence[int], *, flat: bool = False) -> dict[int, Any]:
        """Blocks of every memory level on a path of global cluster ids (one per tree level).

        Returns {level: {tensor name: tensor shaped as geometry.block_layout}} ready to
        attach (or {level: flat tensor} with flat=True). One contiguous read per level
        not in cache.
        """
        path = [int(c) for c in path]
        with self._reading():
            if len(path) < max(self.levels):
                raise ValueError(
                    f"path {path} has {len(path)} levels; this bank needs {max(self.levels)}"
                )
            out = {}
            for level in self.levels:
                t = self.fetch_flat(level, path[level - 1])
                out[level] = t if flat else self.codec(level).unflatten(t)
            return out

    def fetch_generic(self, *, flat: bool = False) -> dict[int, Any]:
        with self._reading():
            out = {}
            for level in self.levels:
                t = self.fetch_flat(level, GENERIC)
                out[level] = t if flat else self.codec(level).unflatten(t)
            return out

    def gather(
        self, paths: np.ndarray | torch.Tensor | Sequence[Sequence[int]]
    ) -> dict[int, torch.Tensor]:
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
            raise ValueError(
                f"scatter: values must be (len(clusters)={len(clusters)}, "
                f"params), got {tuple(values.shape)}"
            )
        with self._writing("scatter"):
            self._scatter(level, clusters, values)

    def _scatter(self, level: int, clusters: Sequence[int], values: torch.Tensor) -> None:
        L = self._level(level)
        slots = [L.info.slot(int(c)) for c in clusters]
        refused = [
            int(c) for c, s in zip(clusters, slots, strict=True) if c != GENERIC and L.mask[s]
        ]
        if refused:
            raise BankError(
                f"scatter: level {level} clusters {refused[:10]} are blocked or deleted; unblock "
                "them first (deleted blocks stay deleted)"
            )
        codec = self.codec(level)
        self._commit([(level, s, codec.encode(v)) for s, v in zip(slots, values, strict=True)])

    def edit(
        self,
        level: int,
        cluster: int,
        values: torch.Tensor | Mapping[str, torch.Tensor],
        *,
        reason: str = "",
    ) -> None:
        """Replace one block (flat tensor, or {tensor name: tensor} covering the layout)."""
        codec = self.codec(level)
        if isinstance(values, Mapping):
            names = [t.name for t in codec.layout]
            if set(values) != set(names):
                raise ValueError(f"edit: level {level} needs tensors {names}, got {sorted(values)}")
            for t in codec.layout:
                if tuple(torch.as_tensor(values[t.name]).shape) != t.shape:
                    raise ValueError(
                        f"edit: level {level} tensor {t.name} must have shape {t.shape}, got "
                        f"{tuple(torch.as_tensor(values[t.name]).shape)}"
                    )
            values = torch.cat([torch.as_tensor(values[n]).reshape(-1) for n in names])
        with self._writing("edit"):
            self._scatter(level, [cluster], torch.as_tensor(values).reshape(1, -1))
            self._audit("edit", {level: [cluster]}, reason)

    def delete(
        self, level: int, clusters: Sequence[int] = (), *, subtree: bool = False, reason: str = ""
    ) -> dict:
        """Erase blocks: their bytes are overwritten with zeros in place, the digests and
        manifest updated, and they are refused from then on. `subtree=True` deletes the
        given clusters' whole subtrees at this and every deeper level."""
        with self._writing("delete"):
            return self._delete(level, clusters, subtree, reason)

    def _delete(self, level: int, clusters: Sequence[int], subtree: bool, reason: str) -> dict:
        targets = self._expand(level, clusters, subtree)
        self._erase(targets)
        self._audit(
            "delete",
            targets,
            reason,
            level=level,
            clusters=sorted({int(c) for c in clusters}),
            subtree=bool(subtree),
        )
        return {lv: len(ids) for lv, ids in targets.items()}

    def _erase(self, targets: Mapping[int, Sequence[int]]) -> None:
        writes, manifest = erase_writes(
            self.info, {lv: self.levels[lv].info for lv in targets}, targets
        )
        self._commit(writes, manifest=manifest)
        self._levels.remask(self._refused_mask, targets)

    def _commit(self, writes: list[Write], manifest: dict | None = None) -> None:
        files = {lv: level_path(self.root, self.levels[lv].info) for lv, _, _ in writes}
        self.info = commit_writes(self._sync, self.info, files, writes, manifest)
        self._sync.note(self.info)
        self._levels.written(self.info, writes)

    # -- blocking ------------------------------------------------------------------------
    def _expand(self, level: int, clusters: Sequence[int], subtree: bool) -> dict[int, list[int]]:
        self._level(level)  # a level without memory is named before any id is checked
        infos = {lv: L.info for lv, L in self.levels.items()}
        return expand_targets(infos, self.info.memory.branching, level, clusters, subtree)

    def block(
        self,
        level: int,
        clusters: Sequence[int],
        *,
        subtree: bool = False,
        reason: str = "",
        persist: bool = True,
    ) -> dict:
        """Refuse blocks from now on: in every process, at its next fetch. Returns counts per level.
        `persist=False` blocks for this open store only (an experiment on a shared bank):
        policy.json and the audit log are left alone."""
        return self._set_blocked("block", level, clusters, subtree, reason, persist)

    def unblock(
        self,
        level: int,
        clusters: Sequence[int],
        *,
        subtree: bool | None = None,
        reason: str = "",
        persist: bool = True,
    ) -> dict:
        """Lift blocks. `subtree=None` (the default) undoes what blocked them: a cluster whose
        latest block named it with `subtree=True` (`blocking.adversarial_block` / `random_block`
        block that way) is lifted with its whole subtree, any other alone. True / False force
        either."""
        if subtree is None:
            with self._sync.mutex:
                entries = audit_log(self.root) if persist else self._policy.session_entries()
            roots = set(blocked_as_subtree(entries, level))
            targets = self._expand(level, [c for c in clusters if int(c) not in roots], False)
            lifted = [c for c in clusters if int(c) in roots]
            for lv, ids in (self._expand(level, lifted, True) if lifted else {}).items():
                targets[lv] = sorted(set(targets.get(lv, [])) | set(ids))
            return self._set_blocked(
                "unblock", level, clusters, None, reason, persist, targets=targets
            )
        return self._set_blocked("unblock", level, clusters, subtree, reason, persist)

    def _set_blocked(
        self,
        action: str,
        level: int,
        clusters: Sequence[int],
        subtree: bool | None,
        reason: str,
        persist: bool,
        targets: dict[int, list[int]] | None = None,
    ) -> dict:
        targets = targets if targets is not None else self._expand(level, clusters, bool(subtree))
        counts = {lv: len(ids) for lv, ids in targets.items()}
        if not persist:
            with self._sync.mutex:
                self._policy.session.append((action, targets))
                self._policy_changed()
            return counts
        with self._writing(action):
            apply_blocked(self._policy.disk, action, targets)
            self._save_policy()
            self._audit(
                action,
                targets,
                reason,
                level=level,
                clusters=sorted({int(c) for c in clusters}),
                subtree="as blocked" if subtree is None else bool(subtree),
            )
        return counts

    def apply_targets(
        self,
        action: Literal["block", "unblock", "delete"],
        targets: Mapping[int, Sequence[int]],
        *,
        reason: str = "",
        **request: Any,
    ) -> dict[int, list[int]]:
        """Block, unblock or delete an explicit {level: [global cluster ids]} map as one operation
        with ONE
        audit entry: `targets` (all it covered), `changed` (the blocks newly blocked, lifted or
        erased, so
        an undo can lift exactly what a block set) and `request` (what asked for it, e.g. an owner's
        hash). Returns `changed`."""
        if action not in ("block", "unblock", "delete"):
            raise ValueError(
                f"apply_targets: action {action!r} is not 'block', 'unblock' or 'delete'"
            )
        with self._writing(action):
            targets = {
                int(lv): self._expand(int(lv), ids, False)[int(lv)]
                for lv, ids in targets.items()
                if ids
            }
            source = (
                self.info.manifest.get("deleted", {})
                if action == "delete"
                else self._policy.disk["blocked"]
            )
            was = {
                lv: {i for a, b in source.get(str(lv), []) for i in range(a, b)} for lv in targets
            }
            changed = {
                lv: sorted(set(ids) - was[lv] if action != "unblock" else set(ids) & was[lv])
                for lv, ids in targets.items()
            }
            if action == "delete":
                self._erase(targets)
            else:
                apply_blocked(self._policy.disk, action, targets)
                self._save_policy()
            self._audit(
                action,
                targets,
                reason,
                changed={str(lv): id_runs(v) for lv, v in changed.items()},
                **request,
            )
        return changed

    @contextlib.contextmanager
    def experiment(self, *, fallback: Fallback | None = None):
        """An experiment on this open store: `persist=False` blocks made inside the `with` (and
        `fallback`, if given) are undone when it exits; the bank on disk is never touched. Nests."""
        if fallback is not None:
            self._check_fallback(fallback)
        session = self._policy.session
        with self._sync.mutex:
            mark = len(session)
            if fallback is not None:
                session.append(("fallback", fallback))
                self._policy_changed()
        try:
            yield self
        finally:
            with self._sync.mutex:
                del session[mark:]
                self._policy_changed()

    def _check_fallback(self, fallback: str) -> None:
        if fallback not in ("zeros", "generic"):
            raise ValueError(f"fallback: {fallback!r} is not 'zeros' or 'generic'")
        if fallback == "generic" and not any(L.info.has_generic for L in self.levels.values()):
            raise BankError(f"{self.root}: fallback 'generic' needs a bank with a generic memory")

    def set_fallback(self, fallback: Fallback) -> None:
        self._check_fallback(fallback)
        with self._writing("set-fallback"):
            self._policy.disk["fallback"] = fallback
            self._save_policy()
            self._audit("set-fallback", {}, fallback)

    def blocked_fraction(self) -> float:
        """Share of the bank's parameters that is refused (blocked or deleted)."""
        return blocked_fraction(self.levels)

    def _save_policy(self) -> None:
        """Publish the policy file (this store's session-only blocks stay out of it)."""
        with self._sync.publishing():
            self._policy.save()
        self._policy_changed()

    def _audit(
        self, action: str, targets: Mapping[int, Sequence[int]], reason: str, **request: Any
    ) -> None:
        append_audit(
            self.root,
            user=self.user,
            action=action,
            targets=targets,
            reason=reason,
            generation=self.info.generation,
            request=request,
        )

    # -- counters ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self._stats.report(self.placement, self.caches, self.levels)

    def reset_stats(self) -> None:
        self._stats.reset(self.caches, self.levels)


def check_path(path: Sequence[int], branching: int) -> None:
    """Refuse a path that no tree of this branching has: level-l ids lie in [0, B^l) and each is a
    child of the one before (global ids nest: children of p are p·B … p·B+B−1). GENERIC (-1) passes.
    `memtree memstore fetch --path` checks with it; `fetch` itself serves any ids the bank holds."""
    B = branching
    for i, c in enumerate(path):
        level = i + 1
        if c != GENERIC and not 0 <= c < B**level:
            raise ValueError(
                f"path {list(path)}: level-{level} id {c} is "
                f"out of range [0, {B**level}) for branching {B}"
            )
        if i and c != GENERIC and path[i - 1] != GENERIC and c // B != path[i - 1]:
            p = path[i - 1]
            raise ValueError(
                f"path {list(path)}: level-{level} id {c} is not a child of level-{level - 1} id "
                f"{p} (its children are {p * B}…{p * B + B - 1} with branching {B})"
            )
