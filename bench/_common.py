"""Helpers shared by the benchmark scripts (run as `python bench/<name>.py`, so this is on sys.path)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np


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


def json_default(o: Any) -> Any:
    """JSON for what benchmark results hold besides plain values: numpy scalars/arrays, paths, tuples."""
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray | tuple):
        return list(o.tolist() if isinstance(o, np.ndarray) else o)
    return str(o)


def write_results(results: dict, out: Path) -> None:
    out.write_text(json.dumps(results, indent=2, default=json_default))


def finish(results: dict, out: Path, print_table) -> int:
    """Stamp the end of the run, write the results, print the table and where they went."""
    results["meta"]["finished"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    results["meta"]["loadavg_end"] = loadavg()
    write_results(results, out)
    print()
    print_table(results["rows"])
    print(f"\nresults: {out}")
    return 0
