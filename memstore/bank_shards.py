"""The `memtree-bank-shards` checkpoint format: read, verify, describe, export, list and prune.

A sharded training run (`parallel.bank: sharded`, training/bank_shards.py) saves its bank beside
Composer's checkpoints as one file per level-1 subtree, so it resumes on any number of ranks.
The format belongs here, beside `memtree-bank`, so that `memtree memstore info / verify /
export` read it without the trainer; training/bank_shards.py writes it and loads it into ranks.

Format `memtree-bank-shards` v1, `save_folder/checkpoints/bank/ba{N}/` (N = batches done;
memstore/README.md has the full description):
  manifest.json                format, version, batch, anchor, memory, branching, levels
                               ({level: {rows_per_subtree, params}}), files ({name: {sha256,
                               bytes}}), saved_by ({world, groups, replicas}), and, optional
                               (newer checkpoints; a v1 reader ignores it), export
                               ({dtype, tree_id, anchor_name}): how the run exports this bank;
                               written last, so a folder without it is not a checkpoint
  subtree-{s:03d}.safetensors  for every level l with memory: w.{l} (B^(l-1), P_l) the subtree's
                               rows (the table's dtype), and its rows' AdamW state: rows.{l} (U,)
                               the rows ever updated (within the subtree), exp_avg.{l},
                               exp_avg_sq.{l} (U, P_l) float32, steps.{l} (U,) int64
  generic.safetensors          the same for the generic row (w.{l} (1, P_l))

`export_bank` streams the files into the `memtree-bank` format block by block, in the order and
encoding of `training.bank.TrainableBank.export`: byte-identical to a replicated run's export of
the same weights, and to the sharded run's own export when given the manifest's `export` entry.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from memtree.config import from_dict, to_dict
from memtree.geometry import DTYPES, AnchorShape, MemoryConfig
from memtree.io import check_format, read_json, sha256_file
from memtree.memstore.format import GENERIC, BankInfo
from memtree.memstore.writer import write_bank

FORMAT = "memtree-bank-shards"
VERSION = 1
GENERIC_FILE = "generic.safetensors"
_DIR = re.compile(r"^ba(\d+)$")
_PARTIAL = re.compile(r"^\.ba(\d+)\.partial$")


class BankShardError(ValueError):
    """A bank-shards checkpoint that is missing, of another bank, or whose files fail their
    sha256."""


def subtree_file(s: int) -> str:
    return f"subtree-{s:03d}.safetensors"


def identity(anchor: AnchorShape, memory: MemoryConfig) -> dict[str, Any]:
    """The manifest's `anchor` and `memory`: what a resuming run must match. The anchor's name is
    a label, not a shape, so it is left out (a run may rename its preset and still resume)."""
    return {"anchor": to_dict(anchor) | {"name": None}, "memory": to_dict(memory)}


def is_shards_checkpoint(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a manifest.json whose format is `memtree-bank-shards`."""
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        return False
    try:
        return read_json(path).get("format") == FORMAT
    except (ValueError, OSError, AttributeError):
        return False


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / "manifest.json"
    if not path.exists():
        done = checkpoint_batches(folder)
        if done:  # the folder of checkpoints was given, not one of them
            raise BankShardError(
                f"{folder}: a folder of bank-shards checkpoints "
                f"({', '.join(f'ba{b}' for b in done)}), not "
                f"one; give one, e.g. {folder / f'ba{done[-1]}'}"
            )
        raise BankShardError(
            f"{folder}: no manifest.json, so not a finished bank-shards checkpoint"
        )
    man = read_json(path)
    check_format(man, FORMAT, VERSION, path, error=BankShardError)
    return man


def file_problem(folder: Path, man: dict[str, Any], name: str) -> str | None:
    """Why file `name` of the checkpoint cannot be read (its path first), or None when it matches
    its manifest entry."""
    entry = man["files"].get(name)
    path = folder / name
    if entry is None:
        return f"{path}: not listed in {folder / 'manifest.json'}"
    if not path.is_file():
        return f"{path}: missing (listed in {folder / 'manifest.json'})"
    got = sha256_file(path)
    if got != entry["sha256"]:
        return (
            f"{path}: sha256 {got} does not match the manifest's {entry['sha256']}; the file is "
            "corrupt: resume from an earlier checkpoint"
        )
    return None


def open_checked(folder: str | os.PathLike, man: dict[str, Any], name: str):
    """safetensors' `safe_open` of a checkpoint file, once its sha256 matches the manifest's."""
    folder = Path(folder)
    if (problem := file_problem(folder, man, name)) is not None:
        raise BankShardError(problem)
    return safe_open(str(folder / name), framework="pt")


def _layout_problems(folder: Path, man: dict[str, Any], name: str) -> list[str]:
    """A file whose sha256 matches still has to hold each level's rows in the manifest's shape."""
    out = []
    with safe_open(str(folder / name), framework="pt") as f:
        keys = set(f.keys())
        for lv, spec in man["levels"].items():
            want = [
                1 if name == GENERIC_FILE else int(spec["rows_per_subtree"]),
                int(spec["params"]),
            ]
            if f"w.{lv}" not in keys:
                out.append(f"{folder / name}: no tensor w.{lv} (level {lv}'s rows)")
            elif (got := list(f.get_slice(f"w.{lv}").get_shape())) != want:
                out.append(f"{folder / name}: w.{lv} has shape {got}, the manifest says {want}")
    return out


def verify_shards(folder: str | os.PathLike) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest's sha256 and shape; BankShardError
    naming every bad or missing file (path and reason). Returns {"batch", "files", "bytes"}."""
    folder = Path(folder)
    man = read_manifest(folder)
    B = int(man["branching"])
    expected = [subtree_file(s) for s in range(B)] + [GENERIC_FILE]
    problems = [
        f"{folder / n}: the manifest lists no such file (a "
        "checkpoint has one per level-1 subtree and the generic row)"
        for n in expected
        if n not in man["files"]
    ]
    for name in man["files"]:
        problem = file_problem(folder, man, name)
        problems += [problem] if problem is not None else _layout_problems(folder, man, name)
    if problems:
        raise BankShardError(
            f"{folder}: {len(problems)} problem{'s' * (len(problems) > 1)} "
            "in the bank-shards checkpoint:\n  " + "\n  ".join(problems)
        )
    return {
        "batch": man["batch"],
        "files": len(man["files"]),
        "bytes": sum(int(e["bytes"]) for e in man["files"].values()),
    }


def summary(folder: str | os.PathLike) -> dict[str, Any]:
    """What `memtree memstore info` says of a checkpoint (nothing is hashed; `verify_shards`
    does)."""
    man = read_manifest(folder)
    B = int(man["branching"])
    levels = {
        lv: {
            "rows_per_subtree": int(s["rows_per_subtree"]),
            "rows": B * int(s["rows_per_subtree"]) + 1,
            "params_per_row": int(s["params"]),
            "params": (B * int(s["rows_per_subtree"]) + 1) * int(s["params"]),
        }
        for lv, s in man["levels"].items()
    }
    return {
        "checkpoint": str(folder),
        "format": man["format"],
        "version": man["version"],
        "batch": man["batch"],
        "anchor": man["anchor"],
        "memory": man["memory"],
        "branching": B,
        "levels": levels,
        "params": sum(v["params"] for v in levels.values()),
        "files": man["files"],
        "n_files": len(man["files"]),
        "bytes": sum(int(e["bytes"]) for e in man["files"].values()),
        "saved_by": man["saved_by"],
        "export": man.get("export"),
    }


def export_settings(
    man: dict[str, Any],
    *,
    dtype: str | None = None,
    tree_id: str | None = None,
    anchor_name: str | None = None,
    where: str = "",
) -> dict[str, Any]:
    """`export_bank`'s anchor, memory, dtype and tree_id for this checkpoint: the manifest's
    `export` entry, or what is given (required where an older checkpoint lacks it).
    `tree_id` "none" exports a bank bound to no tree; a given one must match a recorded one."""
    rec = man.get("export") or {}
    if dtype is None:
        dtype = rec.get("dtype")
    if dtype is None:
        raise BankShardError(
            f"{where or 'the checkpoint'}: its manifest records no export dtype (a checkpoint from "
            "an older memtree): give --dtype, one of "
            f"{list(DTYPES)} (the run's memory.export_dtype)"
        )
    if dtype not in DTYPES:
        raise BankShardError(f"--dtype {dtype!r} is not one of {list(DTYPES)}")
    if tree_id is None:
        if "tree_id" not in rec:
            raise BankShardError(
                f"{where or 'the checkpoint'}: its manifest records no tree id (a checkpoint from "
                "an older memtree): give --tree-id (the `tree_id` of the run's "
                "shards/manifest.json, or none)"
            )
        tid = rec["tree_id"]
    else:
        tid = None if tree_id.lower() == "none" else tree_id
        if "tree_id" in rec and tid != rec["tree_id"]:
            raise BankShardError(
                f"--tree-id {tree_id}: the checkpoint was trained on tree {rec['tree_id']} (its "
                "manifest's export.tree_id); a bank bound to another tree would be refused by the "
                "right one and accepted by the wrong one"
            )
    name = anchor_name or rec.get("anchor_name") or "custom"
    anchor = from_dict(AnchorShape, {**man["anchor"], "name": name}, where="manifest.anchor")
    memory = from_dict(MemoryConfig, man["memory"], where="manifest.memory")
    return {"anchor": anchor, "memory": memory, "dtype": dtype, "tree_id": tid}


def export_bank(
    folder: str | os.PathLike,
    root: str | os.PathLike,
    *,
    anchor: AnchorShape,
    memory: MemoryConfig,
    dtype: str = "bf16",
    tree_id: str | None = None,
    chunk_rows: int = 256,
) -> BankInfo:
    """The whole bank in the memstore format from a bank-shards checkpoint, streamed (at most
    `chunk_rows` rows in memory per file), in `TrainableBank.export`'s order and encoding. Every
    file is checked against its sha256 before anything is written."""
    folder = Path(folder)
    man = read_manifest(folder)
    want = identity(anchor, memory)
    for key in ("anchor", "memory"):
        if man[key] != want[key]:
            raise BankShardError(
                f"{folder}: a bank of {key} {man[key]}, not the {want[key]} asked for"
            )
    B = int(man["branching"])
    with contextlib.ExitStack() as stack:
        handles = {
            name: stack.enter_context(open_checked(folder, man, name)) for name in man["files"]
        }

        def blocks(level: int) -> Iterator[tuple[int, torch.Tensor]]:
            span = B ** (level - 1)
            for s in range(B):
                rows = handles[subtree_file(s)].get_slice(f"w.{level}")
                for a in range(0, span, chunk_rows):
                    part = rows[a : min(a + chunk_rows, span)].float()  # (≤ chunk_rows, P_l)
                    for i in range(part.shape[0]):
                        yield s * span + a + i, part[i]
            yield GENERIC, handles[GENERIC_FILE].get_tensor(f"w.{level}")[0].float()

        return write_bank(
            root,
            anchor=anchor,
            memory=memory,
            dtype=dtype,
            tree_id=tree_id,
            generic=True,
            blocks=blocks,
        )


def checkpoint_batches(folder: str | os.PathLike) -> list[int]:
    """The batches of the finished bank-shards checkpoints under `folder`, ascending."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted(
        int(m.group(1))
        for p in root.iterdir()
        if (m := _DIR.match(p.name)) and (p / "manifest.json").is_file()
    )


def prune(folder: str | os.PathLike, keep: set[int]) -> list[int]:
    """Remove the checkpoints (and unfinished `.partial` folders) whose batch is not in `keep`."""
    root = Path(folder)
    removed = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        m = _DIR.match(p.name) or _PARTIAL.match(p.name)
        if m and int(m.group(1)) not in keep:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(int(m.group(1)))
    return sorted(removed)
