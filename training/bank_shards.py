"""A sharded bank's checkpoints: one file per level-1 subtree, so a run resumes on any number of ranks.

With `parallel.bank: sharded` each rank holds some level-1 subtrees' rows of every bank table
(`TrainableBank(shard=…)`) and their lazy AdamW state (`MemoryAdamW.row_state`); a Composer
checkpoint keeps rank 0's state only, so the bank is left out of it and saved here, beside it,
at the same batches (`BankShardCheckpoints`, a callback that runs before Composer's saver).

Format `memtree-bank-shards` v1, `save_folder/checkpoints/bank/ba{N}/` (N = batches done):
  manifest.json                format, version, batch, anchor, memory, branching, levels
                               ({level: {rows_per_subtree, params}}), files ({name: {sha256,
                               bytes}}), saved_by ({world, groups, replicas}); written last, so a
                               folder without it is not a checkpoint
  subtree-{s:03d}.safetensors  for every level l with memory: w.{l} (B^(l-1), P_l) the subtree's
                               rows (the table's dtype), and its rows' AdamW state: rows.{l} (U,)
                               the rows ever updated (within the subtree), exp_avg.{l},
                               exp_avg_sq.{l} (U, P_l) float32, steps.{l} (U,) int64
  generic.safetensors          the same for the generic row (w.{l} (1, P_l))
A rank with replica index 0 writes its group's subtrees, global rank 0 the generic row and the
manifest; the folder is assembled under `.ba{N}.partial` and published by one rename. Every file
a rank reads back is checked against the manifest's sha256 first.

`export_bank` streams the files into the `memtree-bank` format (memstore/README.md) block by
block, in the same order and encoding as `TrainableBank.export`: byte-identical to a replicated
run's export of the same weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger
from safetensors import safe_open
from safetensors.torch import save_file

from memstore.format import GENERIC, BankInfo
from memstore.writer import write_bank
from memtree.geometry import AnchorShape, MemoryConfig
from memtree.io import atomic_path, atomic_write_json, read_json, replace_dir, sha256_file
from training.bank import TrainableBank
from training.composer_model import unwrap
from training.optim import MemoryAdamW

log = logging.getLogger(__name__)

FORMAT = "memtree-bank-shards"
VERSION = 1
_DIR = re.compile(r"^ba(\d+)$")


class BankShardError(ValueError):
    """A bank-shards checkpoint that is missing, of another bank, or whose files fail their sha256."""


def subtree_file(s: int) -> str:
    return f"subtree-{s:03d}.safetensors"


def _memory_dict(memory: MemoryConfig) -> dict[str, Any]:
    d = dataclasses.asdict(memory)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _identity(bank: TrainableBank) -> dict[str, Any]:
    return {"anchor": dataclasses.asdict(bank.anchor) | {"name": None}, "memory": _memory_dict(bank.memory)}


def _rows_of(bank: TrainableBank, level: int, subtree: int) -> slice:
    span = bank.memory.branching ** (level - 1)
    i = bank.held_subtrees.index(subtree)
    return slice(i * span, (i + 1) * span)


def _part(bank: TrainableBank, opt: MemoryAdamW, rows_of: dict[int, slice | list[int]]) -> dict[str, torch.Tensor]:
    """The tensors of one file: per level, the rows `rows_of[level]` of the table and their state."""
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


def save_shards(folder: str | os.PathLike, batch: int, bank: TrainableBank, opt: MemoryAdamW, *,
                replica: int, world_meta: dict[str, int]) -> Path | None:
    """Every rank calls this at the same batch; returns the published folder on global rank 0."""
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
        files["generic.safetensors"] = _write(staging / "generic.safetensors", _part(bank, opt, generic))
    every = dist.all_gather_object(files)
    if rank == 0:
        merged = {k: v for part in every for k, v in part.items()}
        B = bank.memory.branching
        missing = [subtree_file(s) for s in range(B) if subtree_file(s) not in merged]
        if missing:
            raise BankShardError(f"{staging}: no rank wrote {missing[:4]}; the ranks' shards do not cover the tree")
        manifest = {"format": FORMAT, "version": VERSION, "batch": batch, **_identity(bank), "branching": B,
                    "levels": {str(lv): {"rows_per_subtree": B ** (lv - 1), "params": bank.tables[str(lv)].shape[1]}
                               for lv in bank.levels},
                    "files": dict(sorted(merged.items())), "saved_by": world_meta}
        atomic_write_json(staging / "manifest.json", manifest)
        replace_dir(staging, final)
    dist.barrier()
    return final if rank == 0 else None


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / "manifest.json"
    if not path.exists():
        raise BankShardError(f"{folder}: no manifest.json, so not a finished bank-shards checkpoint")
    man = read_json(path)
    if man.get("format") != FORMAT or man.get("version") != VERSION:
        raise BankShardError(f"{path}: format {man.get('format')!r} v{man.get('version')!r} is not {FORMAT} v{VERSION}")
    return man


def _open_checked(folder: Path, man: dict[str, Any], name: str):
    entry = man["files"].get(name)
    if entry is None:
        raise BankShardError(f"{folder}: the manifest lists no {name}")
    path = folder / name
    if not path.is_file():
        raise BankShardError(f"{path}: missing (listed in {folder / 'manifest.json'})")
    got = sha256_file(path)
    if got != entry["sha256"]:
        raise BankShardError(f"{path}: sha256 {got} does not match the manifest's {entry['sha256']}; "
                             "the file is corrupt: resume from an earlier checkpoint")
    return safe_open(str(path), framework="pt")


def verify_shards(folder: str | os.PathLike) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest's sha256 (BankShardError naming the
    first bad one); returns {"batch", "files", "bytes"}."""
    folder = Path(folder)
    man = read_manifest(folder)
    for name in man["files"]:
        with _open_checked(folder, man, name):
            pass
    return {"batch": man["batch"], "files": len(man["files"]),
            "bytes": sum(int(e["bytes"]) for e in man["files"].values())}


def load_shards(folder: str | os.PathLike, bank: TrainableBank, opt: MemoryAdamW) -> dict[str, Any]:
    """Fill this rank's rows and their AdamW state from a checkpoint written at any world size."""
    folder = Path(folder)
    man = read_manifest(folder)
    want = _identity(bank)
    for key in ("anchor", "memory"):
        if man[key] != want[key]:
            raise BankShardError(f"{folder}: a bank of {key} {man[key]}, this run's is {want[key]}")
    with torch.no_grad():
        for name, rows_of in [(subtree_file(s), {lv: _rows_of(bank, lv, s) for lv in bank.levels})
                              for s in bank.shard] + [("generic.safetensors",
                                                       {lv: [bank.generic_slot(lv)] for lv in bank.levels})]:
            with _open_checked(folder, man, name) as f:
                for lv in bank.levels:
                    table = bank.tables[str(lv)]
                    local = torch.arange(table.shape[0])[rows_of[lv]]
                    table[local.to(table.device)] = f.get_tensor(f"w.{lv}").to(table.device, table.dtype)
                    at = f.get_tensor(f"rows.{lv}").long()
                    opt.load_row_state(table, {"rows": local[at], "exp_avg": f.get_tensor(f"exp_avg.{lv}"),
                                               "exp_avg_sq": f.get_tensor(f"exp_avg_sq.{lv}"),
                                               "steps": f.get_tensor(f"steps.{lv}")})
    return man


def checkpoint_batches(folder: str | os.PathLike) -> list[int]:
    """The batches of the finished bank-shards checkpoints under `folder`, ascending."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if (m := _DIR.match(p.name)) and (p / "manifest.json").is_file())


def prune(folder: str | os.PathLike, keep: set[int]) -> list[int]:
    """Remove the checkpoints (and unfinished `.partial` folders) whose batch is not in `keep`."""
    root = Path(folder)
    removed = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        m = _DIR.match(p.name) or re.match(r"^\.ba(\d+)\.partial$", p.name)
        if m and int(m.group(1)) not in keep:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(int(m.group(1)))
    return sorted(removed)


def export_bank(folder: str | os.PathLike, root: str | os.PathLike, *, anchor: AnchorShape, memory: MemoryConfig,
                dtype: str = "bf16", tree_id: str | None = None, chunk_rows: int = 256) -> BankInfo:
    """The whole bank in the memstore format from a bank-shards checkpoint, streamed (at most
    `chunk_rows` rows in memory per file), in `TrainableBank.export`'s order and encoding."""
    folder = Path(folder)
    man = read_manifest(folder)
    B = int(man["branching"])
    with contextlib.ExitStack() as stack:
        handles = {name: stack.enter_context(_open_checked(folder, man, name)) for name in man["files"]}
        return _export(handles, B, root, anchor=anchor, memory=memory, dtype=dtype, tree_id=tree_id,
                       chunk_rows=chunk_rows)


def _export(handles: dict[str, Any], B: int, root: str | os.PathLike, *, anchor: AnchorShape,
            memory: MemoryConfig, dtype: str, tree_id: str | None, chunk_rows: int) -> BankInfo:

    def blocks(level: int) -> Iterator[tuple[int, torch.Tensor]]:
        span = B ** (level - 1)
        for s in range(B):
            rows = handles[subtree_file(s)].get_slice(f"w.{level}")
            for a in range(0, span, chunk_rows):
                part = rows[a : min(a + chunk_rows, span)].float()
                for i in range(part.shape[0]):
                    yield s * span + a + i, part[i]
        yield GENERIC, handles["generic.safetensors"].get_tensor(f"w.{level}")[0].float()

    return write_bank(root, anchor=anchor, memory=memory, dtype=dtype, tree_id=tree_id, generic=True,
                      blocks=blocks)


class BankShardCheckpoints(Callback):
    """Saves the sharded bank at Composer's checkpoint batches (before Composer's own saver, which
    the Trainer appends after the user's callbacks) and loads it back when a run resumes."""

    def __init__(self, folder: str | os.PathLike, save_interval: str, *, replica: int,
                 world_meta: dict[str, int]) -> None:
        from composer.utils.misc import create_interval_scheduler

        self.folder = Path(folder)
        self.due = create_interval_scheduler(save_interval)
        self.replica, self.world_meta = replica, world_meta
        self.last_saved: int | None = None
        self.loaded: dict[str, Any] | None = None

    def _parts(self, state: State) -> tuple[TrainableBank, MemoryAdamW]:
        bank = unwrap(state.model).bank
        opt = state.optimizers[0]
        return bank, opt

    def fit_start(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        if batch == 0:
            return
        path = self.folder / f"ba{batch}"
        if not (path / "manifest.json").is_file():
            raise BankShardError(f"the run resumes at batch {batch}, but {path} holds no finished bank-shards "
                                 f"checkpoint (finished: {checkpoint_batches(self.folder)})")
        bank, opt = self._parts(state)
        self.loaded = load_shards(path, bank, opt)
        self.last_saved = batch
        log.info("bank shards: resumed subtrees %s from %s (saved by %s)", list(bank.shard), path,
                 self.loaded["saved_by"])

    def save(self, state: State) -> Path | None:
        bank, opt = self._parts(state)
        batch = int(state.timestamp.batch)
        out = save_shards(self.folder, batch, bank, opt, replica=self.replica, world_meta=self.world_meta)
        self.last_saved = batch
        if out is not None:
            ckpts = self.folder.parent
            kept = {int(m.group(1)) for p in ckpts.glob("ep*-ba*-rank0.pt")
                    if (m := re.search(r"-ba(\d+)-", p.name))}
            prune(self.folder, kept | {batch})
        return out

    def _maybe_save(self, state: State, event: Event) -> None:
        if self.due(state, event) and self.last_saved != int(state.timestamp.batch):
            self.save(state)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._maybe_save(state, Event.BATCH_CHECKPOINT)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._maybe_save(state, Event.EPOCH_CHECKPOINT)
