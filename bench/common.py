"""Helpers shared by the benchmark scripts: result files, load, timing, the host's BLAS.

The scripts run from the repository's root as modules, `python -m bench.<topic>.<name>`, so the
root is sys.path[0] and they import this module as `bench.common` (and a topic's helper modules
as `bench.<topic>.<module>`); the project's packages come from the installed (editable) memtree,
all under `memtree.`. Each topic folder keeps its records in its own `results/`.
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

from memtree.clustering import blas as blas_check

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
    """JSON for what benchmark results hold besides plain values: numpy scalars/arrays, paths,
    tuples."""
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

    return {
        "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_start": loadavg(),
        "host": machine_meta(),
        "args": vars(args),
        **extra,
    }


# where a default name goes when the caller names no folder (tests point it at one of theirs);
# None: the results folder of the script that was run
RESULTS: Path | None = None


def results_dir(script: str | Path) -> Path:
    """The records folder of the topic a script lives in: bench/<topic>/results."""
    return Path(script).resolve().parent / "results"


def results_path(out: str | Path | None, default: str, folder: Path | None = None) -> Path:
    """Where a run writes its JSON, its folder made: `out` as given, else `folder`/`default`
    (a script passes `results_dir(__file__)`, its topic's bench/<topic>/results).

    The files under bench/<topic>/results are the records docs/BENCHMARKS.md cites, and default
    names are per day: a second run on the same day takes `<stem>-2.json` (`-3`, ...) rather than
    overwrite the first."""
    if out:
        path = Path(out)
    else:
        import sys

        base = folder or RESULTS or results_dir(sys.argv[0])
        path, n = base / default, 2
        while path.exists():
            path = base / f"{Path(default).stem}-{n}{Path(default).suffix}"
            n += 1
        if path.name != default:
            log(f"{_shown(base / default)} holds an earlier run: writing {path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _shown(path: Path) -> str:
    """A path as the messages name it: relative to the repository when it lies inside."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def command_line() -> str:
    """The command as it was typed, for the records (`python -m bench.<topic>.<name> ARGS`)."""
    import sys

    return " ".join([Path(sys.executable).name, *sys.orig_argv[1:]])


def rerun_argv() -> list[str]:
    """This command's argv for os.execve: the same interpreter options and module or script."""
    import sys

    return [sys.executable, *sys.orig_argv[1:]]


def write_results(results: dict, out: Path) -> None:
    out.write_text(json.dumps(results, indent=2, default=json_default))


def finish(
    results: dict, out: Path, print_table: Callable[[list[dict]], None] | Sequence[str]
) -> int:
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


# ------------------------------------------------------------------- what a benchmark ran on
# OpenBLAS reads these at load time; machines that set them (cloud images do) force slower kernels
BLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
# OpenBLAS kernels with AVX2 or better (the pipeline's check shares the list): any other kernel on
# a CPU with AVX2 is a fallback
FAST_KERNELS = blas_check.FAST_KERNELS
ENV_PREFIXES = ("OPENBLAS_", "OMP_", "MKL_", "GOTO", "KMP_", "OPENMP_")
_REEXEC = "MEMTREE_BENCH_BLAS"


def cpu_info() -> dict[str, Any]:
    """CPU model and the SIMD extensions that decide which BLAS kernels can run."""
    model, flags = blas_check.cpu_flags()
    simd = sorted(
        f for f in flags if f.startswith(("sse4", "avx", "fma", "amx", "f16c", "asimd", "sve"))
    )
    return {"model": model or platform.processor() or "", "cores": os.cpu_count(), "simd": simd}


def blas_libraries() -> list[dict[str, Any]]:
    """Every BLAS / OpenMP runtime loaded in this process (threadpoolctl): library, kernel,
    threads."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:  # the lent GPU machine's image may lack it: say so rather than fail the run
        return [
            {"error": "threadpoolctl is not installed: the BLAS / OpenMP runtimes were not listed"}
        ]

    keep = (
        "user_api",
        "internal_api",
        "prefix",
        "version",
        "num_threads",
        "architecture",
        "threading_layer",
        "filepath",
    )
    return [{k: i.get(k) for k in keep} for i in threadpool_info()]


def blas_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def machine_basics(**extra: Any) -> dict[str, Any]:
    """The versions and size of the machine a results file was measured on (python, torch,
    numpy, FAISS when installed, cores, memory, CPU model, platform), plus `extra`."""
    import numpy as np
    import torch

    try:
        import faiss

        faiss_version = faiss.__version__
    except ImportError:
        faiss_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "faiss": faiss_version,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1),
        "cpu": cpu_info()["model"],
        "cuda_available": bool(torch.cuda.is_available()),
        "platform": platform.platform(),
        **extra,
    }


def print_aligned(
    header: Sequence[str],
    cells: Sequence[Sequence[str]],
    *,
    last_width: int | None = None,
    rule: bool = True,
) -> None:
    """Left-aligned columns under a header (and a rule); the last column at most last_width."""
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)
    ]
    if last_width is not None:
        widths[-1] = min(widths[-1], last_width)
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    print(line)
    if rule:
        print("-" * len(line))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))


TARGET_COLUMNS = [
    ("bench", "bench"),
    ("metric", "metric"),
    ("value", "measured"),
    ("baseline", "baseline"),
    ("ratio", "ratio"),
    ("target", "target"),
    ("met", "met"),
    ("data", "data"),
]


def row(
    bench: str,
    metric: str,
    value: Any,
    *,
    data: str,
    baseline: Any = None,
    ratio: float | None = None,
    target: str = "",
    met: bool | None = None,
    unit: str = "",
) -> dict:
    """One result row of a target table (`print_targets`): a figure, its baseline, the ratio and
    whether the target is met."""
    return {
        "bench": bench,
        "metric": metric,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "ratio": ratio,
        "target": target,
        "met": met,
        "data": data,
    }


def print_targets(
    rows: list[dict], *, data_width: int = 60, unit_on_baseline: bool = False
) -> None:
    """Rows of {bench, metric, value, unit, baseline, ratio[, ratio_range, runs], target, met
    ("yes" / "no" / "-"), data}: the measured value against its baseline and target."""
    cells = []
    for r in rows:
        row = []
        for k, _ in TARGET_COLUMNS:
            cell = fmt(r[k])
            if (
                r["unit"]
                and r[k] is not None
                and (k == "value" or (k == "baseline" and unit_on_baseline))
            ):
                cell += f" {r['unit']}"
            if k == "ratio" and r.get("ratio_range") and r.get("runs", 1) > 1:
                cell += f" ({fmt(r['ratio_range'][0])}-{fmt(r['ratio_range'][1])})"
            if k == "met":
                cell = {"yes": "MET", "no": "NOT MET", "-": "-"}[cell]
            row.append(cell)
        cells.append(row)
    print_aligned([h for _, h in TARGET_COLUMNS], cells, last_width=data_width)


def machine_meta() -> dict[str, Any]:
    """What a results file needs to say about the machine for its ratios to be judged."""
    try:
        import faiss  # noqa: F401  (its bundled OpenBLAS is listed only once loaded)
    except ImportError:
        pass
    return {
        "cpu": cpu_info(),
        "blas": blas_libraries(),
        "env": blas_env(),
        "blas_env_changes": json.loads(os.environ.get(_REEXEC, "{}")),
    }


def _faiss_kernel() -> str | None:
    import faiss  # noqa: F401  (loads FAISS's bundled OpenBLAS, so threadpoolctl can see it)

    for lib in blas_libraries():
        if lib["user_api"] == "blas" and "faiss" in (lib["filepath"] or ""):
            return lib["architecture"]
    return None


def prepare_blas_env(mode: str = "auto") -> dict[str, Any]:
    """Give the FAISS baselines the BLAS kernels the CPU can run; call first thing in main().

    mode "auto": OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are unset for this command (re-executing
    it, as OpenBLAS reads them at load); then if FAISS's OpenBLAS still runs a fallback kernel on a
    CPU with AVX-512 / AVX2, the command is re-executed once more with OPENBLAS_CORETYPE=SkylakeX /
    Haswell. mode "as-is": nothing changes (to reproduce a handicapped run). What was changed and
    why is in the environment of the final process and so in `machine_meta()`."""
    import sys

    done = json.loads(os.environ.get(_REEXEC, "{}"))
    if mode == "as-is" or done.get("final"):
        return done
    if not done and any(k in os.environ for k in BLAS_VARS):
        done = {"unset": {k: os.environ[k] for k in BLAS_VARS if k in os.environ}}
        env = {k: v for k, v in os.environ.items() if k not in BLAS_VARS}
        env[_REEXEC] = json.dumps(done)
        os.execve(sys.executable, rerun_argv(), env)
    kernel = _faiss_kernel()
    flags = blas_check.cpu_flags()[1]
    want = blas_check.safe_coretype(
        flags
    )  # the pipeline's check and the benchmarks agree on the fix
    if blas_check.is_fallback(kernel, flags) and "OPENBLAS_CORETYPE" not in os.environ:
        done |= {
            "set": {"OPENBLAS_CORETYPE": want},
            "why": f"FAISS's OpenBLAS picked the fallback kernel {kernel} on a CPU with "
            f"{want}-class SIMD",
            "final": True,
        }
        env = dict(os.environ, OPENBLAS_CORETYPE=want, **{_REEXEC: json.dumps(done)})
        os.execve(sys.executable, rerun_argv(), env)
    done |= {"final": True, "faiss_kernel": kernel}
    os.environ[_REEXEC] = json.dumps(done)
    return done


_EMULATE = "MEMTREE_BENCH_EMULATE_BLAS"
EMULATIONS = ("faiss-fallback", "slow-numpy-blas")


def emulate_blas(kind: str) -> dict[str, Any]:
    """Another host's BLAS on this one, by changing OPENBLAS_CORETYPE between the two OpenBLAS
    loads (OpenBLAS reads it once, at load; numpy's loads when this module imports numpy, FAISS's
    at `import faiss`). "faiss-fallback": numpy's OpenBLAS picks its own kernel, FAISS's runs
    Prescott (SSE3), as on the Intel Xeon of issue #56; "slow-numpy-blas": numpy's runs Prescott,
    FAISS's the kernel the CPU runs (a host whose numpy BLAS is the slower one). The command is
    re-executed once with the variable numpy's load must see. torch's BLAS (MKL in the x86 wheels)
    reads neither. Call first thing in main(), before anything imports FAISS; returns what was
    done."""
    import sys

    from memtree.clustering.blas import cpu_flags, safe_coretype

    if kind not in EMULATIONS:
        raise ValueError(f"unknown BLAS emulation {kind!r}; one of {EMULATIONS}")
    fast = safe_coretype(cpu_flags()[1])
    if fast is None:
        raise SystemExit("a BLAS emulation needs a CPU with AVX2 (a fast kernel to compare with)")
    numpy_kernel, faiss_kernel = (
        ("Prescott", fast) if kind == "slow-numpy-blas" else (None, "Prescott")
    )
    if os.environ.get(_EMULATE) != kind:
        env = {k: v for k, v in os.environ.items() if k not in BLAS_VARS} | {_EMULATE: kind}
        if numpy_kernel:
            env["OPENBLAS_CORETYPE"] = numpy_kernel
        os.execve(sys.executable, rerun_argv(), env)
    if "faiss" in sys.modules:
        raise RuntimeError("emulate_blas: FAISS was loaded before the variable could change")
    os.environ["OPENBLAS_CORETYPE"] = faiss_kernel
    return {
        "kind": kind,
        "numpy_openblas": numpy_kernel or "its own pick (no OPENBLAS_CORETYPE at its load)",
        "faiss_openblas": faiss_kernel,
    }


def sgemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """The machine's plain float32 matrix product (numpy), GFLOP/s, best of `repeats`."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    best = min(_seconds(lambda: a @ a) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def torch_sgemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """torch's float32 CPU matmul (the GEMMs of a raw `SentenceTransformer.encode`), GFLOP/s, best
    of `repeats`, on torch's current thread count."""
    import torch

    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    best = min(_seconds(lambda: a @ a) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def faiss_l2_gflops(n: int = 20000, k: int = 4096, d: int = 384, repeats: int = 3) -> float:
    """FAISS's exhaustive L2 search (`IndexFlatL2`, the k-means assignment step and the routing
    baseline's kernel), GFLOP/s counting 2·n·k·d per search, best of `repeats`."""
    import faiss

    rng = np.random.default_rng(0)
    x, c = (
        rng.standard_normal((n, d), dtype=np.float32),
        rng.standard_normal((k, d), dtype=np.float32),
    )
    index = faiss.IndexFlatL2(d)
    index.add(c)
    best = min(_seconds(lambda: index.search(x, 1)) for _ in range(repeats))
    return 2 * n * k * d / best / 1e9


def _seconds(call: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


HEALTHY_FRACTION = 0.5  # a baseline below half the machine's sgemm rate is not a fair opponent


def baseline_health(name: str, gflops: float, sgemm: float) -> dict[str, Any]:
    """A baseline's GFLOP/s against the machine's sgemm in the same run; below HEALTHY_FRACTION it
    is reported as handicapped and no speed-up is claimed against it."""
    frac = gflops / sgemm if sgemm > 0 else 0.0
    return {
        "baseline": name,
        "gflops": round(gflops, 1),
        "sgemm_gflops": round(sgemm, 1),
        "fraction_of_sgemm": round(frac, 3),
        "healthy": frac >= HEALTHY_FRACTION,
    }


def host_gemm() -> dict[str, Any]:
    """Each BLAS's float32 GEMM on this host, so a reader sees which host kind a tree figure came
    from (issue 71): GFLOP/s at the node fits' shapes (`clustering.gemm.SHAPES`, one thread, per
    backend: numpy's OpenBLAS, torch's, FAISS's OpenBLAS) and at a 2,048² square on all threads
    (numpy, torch). Logged as one line and returned for the results file."""
    from memtree.clustering import gemm

    node = gemm.measure()
    out = {
        "node_shapes": [list(s) for s in gemm.SHAPES],
        "node_gflops_1_thread": node.get("gflops"),
        "node_choice": node.get("choice"),
        "node_measure": node,  # clustering.gemm.measure's whole result
        "square_2048_gflops_all_threads": {
            "numpy": round(sgemm_gflops(), 1),
            "torch": round(torch_sgemm_gflops(), 1),
        },
    }
    log(
        f"sgemm GFLOP/s at the node shapes {gemm.SHAPES} (one thread): "
        f"{out['node_gflops_1_thread']}; at 2,048² (all threads): "
        f"{out['square_2048_gflops_all_threads']}"
    )
    return out
