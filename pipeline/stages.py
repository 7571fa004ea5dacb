"""Run directory, stage fingerprints and atomic stage publication.

A run directory holds one sub-directory per finished stage, each with a
`_stage.json` marker (stage name, format version, fingerprint, stats,
timing). The fingerprint hashes the config sections the stage reads plus the
fingerprints of the stages it reads from, so a rerun:

- skips a stage whose marker matches (finished work is never redone),
- redoes a stage whose inputs or config changed (and, transitively, its dependents).

While a stage runs it writes into `<run>/.work/<stage>-<fingerprint>/`; every
file there is written atomically and tasks skip files that already exist, so
a killed run resumes mid-stage. When the stage finishes, the work directory is
renamed onto `<run>/<stage>/` in one step.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memtree.io import atomic_write_json, naming_path, read_json, replace_dir
from memtree.pipeline.config import PipelineConfig

MARKER = "_stage.json"


@dataclass
class Ctx:
    """What a stage function (`StageDef.fn`) is given: the run's config, run directory, Dask
    client and log, and the markers of the stages finished so far."""

    cfg: PipelineConfig
    root: Path
    client: Any
    log: Callable[[str], None]
    markers: dict[str, dict] = field(default_factory=dict)
    host: dict | None = None  # `clustering.blas.check_host`'s result, when the tree stage runs

    def stage_dir(self, name: str) -> Path:
        return self.root / name

    def parts(self, stage: str) -> list[dict]:
        return self.markers[stage]["stats"]["parts"]


@dataclass(frozen=True)
class StageDef:
    name: str
    version: int
    deps: tuple[str, ...]
    config: Callable[[Any], Any]  # selects the config the stage depends on
    fn: Callable[..., dict]  # fn(ctx, work_dir) -> stats


def fingerprint(stage: StageDef, cfg_part: Any, dep_fps: list[str]) -> str:
    payload = json.dumps(
        {"stage": stage.name, "version": stage.version, "config": cfg_part, "deps": dep_fps},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def read_marker(stage_dir: Path) -> dict | None:
    m = stage_dir / MARKER
    return read_json(m) if m.is_file() else None


def run_stage(
    root: Path, stage: StageDef, fp: str, ctx: Any, *, log: Callable[[str], None]
) -> dict:
    """Run one stage unless its marker already matches `fp`; returns the marker."""
    out = root / stage.name
    marker = read_marker(out)
    if marker and marker.get("fingerprint") == fp:
        log(f"[{stage.name}] up to date, skipped")
        return marker
    work = root / ".work" / f"{stage.name}-{fp}"
    work.mkdir(parents=True, exist_ok=True)
    # Work dirs of this stage under another fingerprint are stale attempts.
    for stale in (root / ".work").glob(f"{stage.name}-*"):
        if stale != work:
            shutil.rmtree(stale, ignore_errors=True)
    log(f"[{stage.name}] running" + (" (resuming)" if any(work.iterdir()) else ""))
    t0 = time.time()
    with naming_path(
        work, kept=f"finished stages, and the parts of stage {stage.name} already written, are kept"
    ):
        stats = stage.fn(ctx, work)
    seconds = time.time() - t0
    marker = {
        "stage": stage.name,
        "version": stage.version,
        "fingerprint": fp,
        "stats": stats,
        "seconds": round(seconds, 3),
    }
    atomic_write_json(work / MARKER, marker)
    replace_dir(work, out)
    log(f"[{stage.name}] done in {seconds:.1f}s")
    return marker
