"""A sharded bank's checkpoints: one file per level-1 subtree, so a run resumes on any number of
ranks.

With `parallel.bank: sharded` each rank holds some level-1 subtrees' rows of every bank table
(`TrainableBank(shard=…)`) and their lazy AdamW state (`MemoryAdamW.row_state`); a Composer
checkpoint keeps rank 0's state only, so the bank is left out of it and saved here, beside it,
at the same batches (`BankShardCheckpoints`, a callback that runs before Composer's saver).

The format, `memtree-bank-shards` v1 in `save_folder/checkpoints/bank/ba{N}/`, is memstore's
(memstore/bank_shards.py, memstore/README.md): reading, verifying, exporting and pruning live
there, so `memtree memstore info / verify / export` read a checkpoint without the trainer; they
are re-exported here. This module writes a checkpoint from the ranks and loads it back into them.
A rank with replica index 0 writes its group's subtrees, global rank 0 the generic row and the
manifest; the folder is assembled under `.ba{N}.partial` and published by one rename. Every file
a rank reads back is checked against the manifest's sha256 first.

Retention: a bank checkpoint lives as long as the Composer checkpoint of its batch. Composer's
saver runs after this callback at the same event and deletes the checkpoints it rotates out
there, so the bank checkpoints are pruned at the next event (`BankShardCheckpoints.run_event`),
keeping those whose `ep*-ba{N}-rank0.pt` is still on disk and the latest (the run's final export
reads it).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger
from safetensors.torch import save_file

from memtree.io import atomic_path, atomic_write_json, replace_dir, sha256_file
from memtree.memstore.bank_shards import (  # noqa: F401  (re-exported: the format's readers live in memstore)
    FORMAT,
    GENERIC_FILE,
    VERSION,
    BankShardError,
    checkpoint_batches,
    export_bank,
    identity,
    open_checked,
    prune,
    read_manifest,
    subtree_file,
    verify_shards,
)
from memtree.training.bank import TrainableBank
from memtree.training.composer_model import unwrap
from memtree.training.optim import MemoryAdamW

log = logging.getLogger(__name__)

# Composer's default checkpoint name, `ep{epoch}-ba{batch}-rank{rank}.pt`; rank 0's file exists
# for every checkpoint Composer keeps
_COMPOSER_CKPT = re.compile(r"^ep\d+-ba(\d+)-rank0\.pt$")
_CHECKPOINT_EVENTS = (Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT, Event.ITERATION_CHECKPOINT)


def _identity(bank: TrainableBank) -> dict[str, Any]:
    return identity(bank.anchor, bank.memory)


def _rows_of(bank: TrainableBank, level: int, subtree: int) -> slice:
    span = bank.memory.branching ** (level - 1)
    i = bank.held_subtrees.index(subtree)
    return slice(i * span, (i + 1) * span)


def _part(
    bank: TrainableBank, opt: MemoryAdamW, rows_of: dict[int, slice | list[int]]
) -> dict[str, torch.Tensor]:
    """The tensors of one file: per level, the rows `rows_of[level]` of the table and their
    state."""
    out: dict[str, torch.Tensor] = {}
    for lv in bank.levels:
        table = bank.tables[str(lv)]
        sel = rows_of[lv]
        local = torch.arange(table.shape[0])[sel]  # (n,) table rows of this file, in file order
        out[f"w.{lv}"] = table.detach()[local].cpu().contiguous()
        st = opt.row_state(table, local)
        where = torch.searchsorted(local.to(st["rows"].device), st["rows"])  # file-local row ids
        out[f"rows.{lv}"] = where.cpu().long()
        for k in ("exp_avg", "exp_avg_sq", "steps"):
            out[f"{k}.{lv}"] = st[k].detach().cpu().contiguous()
    return out


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def save_shards(
    folder: str | os.PathLike,
    batch: int,
    bank: TrainableBank,
    opt: MemoryAdamW,
    *,
    replica: int,
    world_meta: dict[str, int],
    export: dict[str, Any] | None = None,
) -> Path | None:
    """Every rank calls this at the same batch; returns the published folder on global rank 0.
    `export` ({dtype, tree_id}): how the run exports its bank, recorded in the manifest (with the
    anchor's name) so `memtree memstore export` writes the same bank from the checkpoint."""
    from composer.utils import dist

    root = Path(folder)
    final, staging = root / f"ba{batch}", root / f".ba{batch}.partial"
    rank = dist.get_global_rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    files: dict[str, dict[str, Any]] = {}
    if replica == 0:  # one copy of each group's rows
        for s in bank.shard:
            tensors = _part(bank, opt, {lv: _rows_of(bank, lv, s) for lv in bank.levels})
            files[subtree_file(s)] = _write(staging / subtree_file(s), tensors)
    if rank == 0:
        generic = {lv: [bank.generic_slot(lv)] for lv in bank.levels}
        files[GENERIC_FILE] = _write(staging / GENERIC_FILE, _part(bank, opt, generic))
    every = dist.all_gather_object(files)
    if rank == 0:
        merged = {k: v for part in every for k, v in part.items()}
        B = bank.memory.branching
        missing = [subtree_file(s) for s in range(B) if subtree_file(s) not in merged]
        if missing:
            raise BankShardError(
                f"{staging}: no rank wrote {missing[:4]}; the ranks' shards do not cover the tree"
            )
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "batch": batch,
            **_identity(bank),
            "branching": B,
            "levels": {
                str(lv): {
                    "rows_per_subtree": B ** (lv - 1),
                    "params": bank.tables[str(lv)].shape[1],
                }
                for lv in bank.levels
            },
            "files": dict(sorted(merged.items())),
            "saved_by": world_meta,
        }
        if export is not None:
            manifest["export"] = {
                "dtype": export["dtype"],
                "tree_id": export["tree_id"],
                "anchor_name": bank.anchor.name,
            }
        atomic_write_json(staging / "manifest.json", manifest)
        replace_dir(staging, final)
    dist.barrier()
    return final if rank == 0 else None


def load_shards(folder: str | os.PathLike, bank: TrainableBank, opt: MemoryAdamW) -> dict[str, Any]:
    """Fill this rank's rows and their AdamW state from a checkpoint written at any world size."""
    folder = Path(folder)
    man = read_manifest(folder)
    want = _identity(bank)
    for key in ("anchor", "memory"):
        if man[key] != want[key]:
            raise BankShardError(f"{folder}: a bank of {key} {man[key]}, this run's is {want[key]}")
    with torch.no_grad():
        for name, rows_of in [
            (subtree_file(s), {lv: _rows_of(bank, lv, s) for lv in bank.levels}) for s in bank.shard
        ] + [(GENERIC_FILE, {lv: [bank.generic_slot(lv)] for lv in bank.levels})]:
            with open_checked(folder, man, name) as f:
                for lv in bank.levels:
                    table = bank.tables[str(lv)]
                    local = torch.arange(table.shape[0])[rows_of[lv]]
                    table[local.to(table.device)] = f.get_tensor(f"w.{lv}").to(
                        table.device, table.dtype
                    )
                    at = f.get_tensor(f"rows.{lv}").long()
                    opt.load_row_state(
                        table,
                        {
                            "rows": local[at],
                            "exp_avg": f.get_tensor(f"exp_avg.{lv}"),
                            "exp_avg_sq": f.get_tensor(f"exp_avg_sq.{lv}"),
                            "steps": f.get_tensor(f"steps.{lv}"),
                        },
                    )
    return man


def composer_checkpoint_batches(folder: str | os.PathLike) -> set[int]:
    """The batches of the Composer checkpoints (rank 0's files) in `folder`."""
    root = Path(folder)
    if not root.is_dir():
        return set()
    return {int(m.group(1)) for p in root.iterdir() if (m := _COMPOSER_CKPT.match(p.name))}


class BankShardCheckpoints(Callback):
    """Saves the sharded bank at Composer's checkpoint batches (before Composer's own saver, which
    the Trainer appends after the user's callbacks), loads it back when a run resumes, and removes
    the bank checkpoints whose Composer checkpoint Composer removed
    (`save_num_checkpoints_to_keep`).

    `export` ({dtype, tree_id}): recorded in each manifest (`save_shards`)."""

    def __init__(
        self,
        folder: str | os.PathLike,
        save_interval: str,
        *,
        replica: int,
        world_meta: dict[str, int],
        export: dict[str, Any] | None = None,
    ) -> None:
        from composer.utils.misc import create_interval_scheduler

        self.folder = Path(folder)
        self.due = create_interval_scheduler(save_interval)
        self.replica, self.world_meta, self.export = replica, world_meta, export
        self.last_saved: int | None = None
        self.loaded: dict[str, Any] | None = None
        self.prune_due = False

    def _parts(self, state: State) -> tuple[TrainableBank, MemoryAdamW]:
        bank = unwrap(state.model).bank
        opt = state.optimizers[0]
        return bank, opt

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        # Composer rotates its checkpoints inside the same checkpoint event, after this callback:
        # the first other event after a save sees what it kept
        if self.prune_due and event not in _CHECKPOINT_EVENTS:
            self.prune()
        super().run_event(event, state, logger)

    def prune(self) -> list[int]:
        """Remove (on global rank 0) the bank checkpoints whose Composer checkpoint is gone, except
        the latest; returns their batches. Composer keeps all with save_num_checkpoints_to_keep: -1,
        and never rotates out the checkpoints of a run it resumed from (it lists only its own
        saves), so neither does this."""
        from composer.utils import dist

        self.prune_due = False
        if dist.get_global_rank() != 0:
            return []
        keep = composer_checkpoint_batches(self.folder.parent)
        if self.last_saved is not None:
            keep.add(self.last_saved)
        removed = prune(self.folder, keep)
        if removed:
            log.info(
                "bank shards: removed the checkpoints of batches %s (Composer's were rotated out)",
                removed,
            )
        return removed

    def fit_start(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        if batch == 0:
            return
        path = self.folder / f"ba{batch}"
        if not (path / "manifest.json").is_file():
            raise BankShardError(
                f"the run resumes at batch {batch}, but {path} holds no finished bank-shards "
                f"checkpoint (finished: {checkpoint_batches(self.folder)})"
            )
        bank, opt = self._parts(state)
        self.loaded = load_shards(path, bank, opt)
        self.last_saved = batch
        self.prune_due = True  # a run killed between the two savers left a bank checkpoint behind
        log.info(
            "bank shards: resumed subtrees %s from %s (saved by %s)",
            list(bank.shard),
            path,
            self.loaded["saved_by"],
        )

    def save(self, state: State) -> Path | None:
        bank, opt = self._parts(state)
        batch = int(state.timestamp.batch)
        out = save_shards(
            self.folder,
            batch,
            bank,
            opt,
            replica=self.replica,
            world_meta=self.world_meta,
            export=self.export,
        )
        self.last_saved = batch
        self.prune_due = True
        return out

    def _maybe_save(self, state: State, event: Event) -> None:
        if self.due(state, event) and self.last_saved != int(state.timestamp.batch):
            self.save(state)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._maybe_save(state, Event.BATCH_CHECKPOINT)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._maybe_save(state, Event.EPOCH_CHECKPOINT)
