"""What the launch-configuration tuners (bench/kernels/tune_ffn.py, bench/kernels/tune_backward.py)
share: each configuration's kernels timed on the device by torch.profiler, its outputs checked
against the first configuration's, and a results file rewritten after every row, so a run cut off by
the lent GPU's time limit still leaves every row it measured."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import log


def setup(device: str, out: str) -> Path:
    """The interpreter on the CPU (set before the first kernel launch), an error without CUDA,
    and the output folder, made."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def kernel_device_us(
    step: Callable[[], Any], n: int, device: str, kernels: Sequence[str]
) -> dict[str, float]:
    """{kernel + "_us": its own device time per call} over n calls of step(), for each named
    Triton kernel the profiler saw (the op's host work is not in these)."""
    if device == "cuda":
        torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else []
    )
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    return {
        e.key + "_us": getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        / n
        for e in prof.key_averages()
        if e.key in kernels
    }


def sweep(
    cases: Iterable[tuple[dict, str, Callable[[], dict]]], path: Path, header: dict
) -> list[dict]:
    """Measure each (label, group, measure) in order. measure() returns a row with "out": the
    tensors to check; each row gets max_rel_err against its group's first row's tensors. A
    configuration that fails (out of shared memory or registers) is recorded as an error row.
    After every row, path is rewritten atomically as {**header, "rows": [...]}."""
    rows: list[dict] = []
    refs: dict[str, list[torch.Tensor]] = {}
    for label, group, measure in cases:
        try:
            r = measure()
            got = r.pop("out")
            ref = refs.setdefault(group, got)
            r["max_rel_err"] = max(
                float((a - b).norm() / b.norm().clamp(min=1e-30))
                for a, b in zip(got, ref, strict=True)
            )
            r = {**label, **r}
        except Exception as e:  # noqa: BLE001 (recorded, and the sweep goes on)
            r = {**label, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows.append(r)
        log({k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in r.items()})
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({**header, "rows": rows}, indent=1, default=str))
        tmp.replace(path)
    return rows
