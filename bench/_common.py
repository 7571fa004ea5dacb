"""Helpers shared by the benchmark scripts.

The scripts run as `python bench/<name>.py`, so bench/ is sys.path[0] and they import this
module (and the `_`-prefixed helper modules) by name; the project's packages come from the
installed (editable) memtree. No script is named like a project package, which it would shadow.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:  # pragma: no cover
        return []


def pressure(resources: tuple[str, ...] = ("cpu",)) -> dict[str, float]:
    """Linux PSI avg10 ("some") per resource, when available: how contended the machine is."""
    out = {}
    for res in resources:
        try:
            line = Path(f"/proc/pressure/{res}").read_text().splitlines()[0]
            out[res] = float(dict(kv.split("=") for kv in line.split()[1:])["avg10"])
        except (OSError, KeyError, ValueError, IndexError):
            pass
    return out


def wait_quiet(limit_s: float, *, per_core: float = 1.0) -> float | None:
    """Wait up to limit_s for the 1-min load average to fall below per_core x the cores."""
    if limit_s <= 0:
        return None
    cores = os.cpu_count() or 1
    t0 = time.perf_counter()
    while os.getloadavg()[0] >= per_core * cores and time.perf_counter() - t0 < limit_s:
        time.sleep(5)
    waited = time.perf_counter() - t0
    if waited > 1:
        log(f"waited {waited:.0f}s for a quieter machine (load average now {loadavg()})")
    return round(waited, 1)


def json_default(o: Any) -> Any:
    """JSON for what benchmark results hold besides plain values: numpy scalars/arrays, paths, tuples."""
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray | tuple):
        return list(o.tolist() if isinstance(o, np.ndarray) else o)
    return str(o)


def run_meta(args: Any, **extra: Any) -> dict:
    """The start of a results JSON's "meta": when, where, library versions, load, the arguments."""
    import torch

    return {"started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": platform.node(),
            "python": platform.python_version(), "torch": torch.__version__, "loadavg_start": loadavg(),
            "args": vars(args), **extra}


RESULTS = REPO / "bench" / "results"


def results_path(out: str | Path | None, default: str) -> Path:
    """Where a run writes its JSON, its folder made: `out` as given, else bench/results/`default`.

    The files under bench/results are the records docs/BENCHMARKS.md cites, and default names
    are per day: a second run on the same day takes `<stem>-2.json` (`-3`, ...) rather than
    overwrite the first."""
    if out:
        path = Path(out)
    else:
        path, n = RESULTS / default, 2
        while path.exists():
            path = RESULTS / f"{Path(default).stem}-{n}{Path(default).suffix}"
            n += 1
        if path.name != default:
            log(f"bench/results/{default} holds an earlier run: writing {path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_results(results: dict, out: Path) -> None:
    out.write_text(json.dumps(results, indent=2, default=json_default))


def finish(results: dict, out: Path, print_table: Callable[[list[dict]], None] | Sequence[str]) -> int:
    """Stamp the end of the run, write the results, print the table and where they went.
    print_table: a printer of the rows, or the row keys to print as plain `a | b | c` columns."""
    results["meta"]["finished"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    results["meta"]["loadavg_end"] = loadavg()
    write_results(results, out)
    print()
    if callable(print_table):
        print_table(results["rows"])
    else:
        print(" | ".join(print_table))
        for r in results["rows"]:
            print(" | ".join(fmt(r.get(c)) for c in print_table))
    print(f"\nresults: {out}")
    return 0


def elapsed_ms(call: Callable[[], Any], device: str) -> float:
    """Wall time of call(): CUDA events on the GPU, perf_counter on the CPU."""
    import torch

    if device == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        events[0].record()
        call()
        events[1].record()
        torch.cuda.synchronize()
        return events[0].elapsed_time(events[1])
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e3


def peak_mib(call: Callable[[], Any], device: str) -> float | None:
    """Allocator peak of call() above what was allocated before it."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        kept = call()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del kept
        return peak / 2**20
    return None
