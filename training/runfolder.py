"""What a training run folder records about itself, read back by whatever uses a run.

- Stored paths (`data.shards`, `model.hf_dir`, `anchor_checkpoint` in `RUN/memtree_config.json`)
  were written as given to `memtree train`, usually relative to the directory it ran in. A run
  copied or moved elsewhere still loads: a stored path is tried as stored, then relative to the
  run folder and each of its parents (its trailing parts, longest first); when none holds what
  the key names, the error names the key, its value and the file that stores it.

Here, beside the trainer that writes the folder, so that generation (`training/generate/`) and
evaluation (`eval/runinfo.py` re-exports these) read a run the same way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from memtree.io import read_json

CONFIG_FILE = "memtree_config.json"


def _holds(path: Path, must: str) -> bool:
    return (path / must).exists() if must else path.exists()


def resolve_stored(run: str | Path, key: str, value: str | Path, *, must: str = "") -> Path:
    """The path stored in RUN/memtree_config.json under `key`: as stored (absolute, or relative to
    the current directory, as training wrote it), else relative to the run folder or one of its
    parents, trying the stored path's trailing parts longest first (runs/demo/pipeline/shards under
    a copied ROOT: ROOT/pipeline/shards). `must`: a file the path must hold (e.g. manifest.json)."""
    run, stored = Path(run), Path(value)
    if _holds(stored, must):
        return stored
    parts = stored.parts[1:] if stored.is_absolute() else stored.parts
    parts = tuple(p for p in parts if p not in (".", ".."))
    for base in [run.resolve(), *run.resolve().parents]:
        for k in range(len(parts)):
            cand = base.joinpath(*parts[k:])
            if _holds(cand, must):
                return cand
    what = f"no {must} there" if must else "it does not exist"
    raise FileNotFoundError(
        f"{key} = {str(value)!r} (stored in {run / CONFIG_FILE}): {what}, neither from the current "
        "directory nor relative to the run folder or its parents (was the run moved without it?); "
        f"fix {key} in {run / CONFIG_FILE}"
    )


def stored_config(run: str | Path) -> dict[str, Any]:
    path = Path(run) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{run}: no {CONFIG_FILE}; not a training run folder (memtree train's save_folder)"
        )
    return read_json(path)["config"]


def finished_run(run: str | Path) -> Path:
    """`run` as a Path once it is a finished training run's folder; else the error names what is
    missing (the folder, its config, its anchor weights)."""
    folder = Path(run)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such run folder (a training run's save_folder)")
    stored_config(folder)  # names a folder that is no run
    if not (folder / "anchor.safetensors").exists():
        raise FileNotFoundError(
            f"{folder}: no anchor.safetensors (not a finished training run: "
            "memtree train run writes it at the end)"
        )
    return folder


def run_config(run: str | Path):
    """The run's TrainConfig with its stored paths resolved (see `resolve_stored`)."""
    # lazy: keeps this module light for eval's readers of stored paths
    from memtree.config import from_dict
    from memtree.training.config import TrainConfig

    cfg = from_dict(TrainConfig, stored_config(run))
    shards = resolve_stored(run, "data.shards", cfg.data.shards, must="manifest.json")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shards=str(shards)))
    if cfg.pretrained:
        # this machine's converted copy; the run records the hash it trained on
        from memtree.pretrained import pretrained_dir, read_manifest

        hf = pretrained_dir(cfg.pretrained)
        trained = read_json(Path(run) / CONFIG_FILE).get("pretrained", {}).get("hash")
        if trained and read_manifest(hf)["hash"] != trained:
            raise ValueError(
                f"{run}: trained on {cfg.pretrained} with folder hash {trained}, but this "
                f"machine's {hf} has {read_manifest(hf)['hash']} (another conversion or package "
                "version)"
            )
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_dir=str(hf)))
    elif cfg.model.hf_dir:
        hf = resolve_stored(run, "model.hf_dir", cfg.model.hf_dir, must="config.json")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_dir=str(hf)))
    return cfg


def open_tree(tree_dir: str | Path | None, cfg, folder: Path, tree_key: str = "--tree"):
    """`--tree` when given, else `tree/` beside the run's shards; a missing one names both.
    `tree_key`: how the caller's user gives the tree (`--tree`, or a config key such as `tree=`)."""
    # lazy, as run_config's imports: readers of stored paths stay light
    from memtree.clustering.tree import load_tree

    given = f"{tree_key}{tree_dir}" if tree_key.endswith("=") else f"{tree_key} {tree_dir}"
    if tree_dir:
        if not (Path(tree_dir) / "tree.json").exists() and Path(tree_dir).name != "tree.json":
            raise FileNotFoundError(f"{given}: no clustering tree there (no tree.json)")
        return load_tree(tree_dir)
    default = Path(cfg.data.shards).parent / "tree"
    if not (default / "tree.json").exists():
        fix = f"{tree_key}DIR" if tree_key.endswith("=") else f"{tree_key} DIR"
        raise FileNotFoundError(
            f"{folder}: no clustering tree at {default} (tree/ beside data.shards "
            f"{cfg.data.shards!r}, stored in {folder / CONFIG_FILE}); pass {fix}"
        )
    return load_tree(default)
