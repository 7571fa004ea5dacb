"""The host check the pipeline runs before its tree stage: which kernel each BLAS in the process
runs, how fast against a plain sgemm, and which GEMM the node fits use (`clustering.gemm`).

Why: the OpenBLAS 0.3.15 bundled in the faiss-cpu 1.15.1 wheel predates recent CPUs. On an Intel
Xeon with AVX-512 and AMX it picks its SSE3 `Prescott` kernel (threadpoolctl reports it): a
20,000 × 4,096 × 384 flat search ran at 13 GFLOP/s, and at 57 with `OPENBLAS_CORETYPE=SkylakeX`
set before the process started, while numpy's OpenBLAS 0.3.27 picks SkylakeX by itself
(docs/benchmarks/2026-11-27-clustering-baselines-intel-xeon.md, "Baseline health"). OpenBLAS
reads the variable once, when it loads, so the check runs in a fresh interpreter (`python -m
memtree.clustering.blas` prints its JSON) and a fix can only reach processes started
afterwards: the pipeline's Dask workers, which inherit the environment.

`check_host` probes; where FAISS's kernel is a fallback (not one of FAST_KERNELS on a CPU with
AVX2 or better) and nobody set OPENBLAS_CORETYPE, it probes again with the kernel the CPU's flags
are known to run (`safe_coretype`: SkylakeX needs AVX-512 F/CD/BW/DQ/VL, Haswell AVX2 and FMA),
and keeps it only where FAISS then runs that kernel and runs faster. A variable the user set is
never overridden: it is reported, with the figure.

The GEMM choice is timed once per host and kept (`remember_choice`, a `memtree-gemm-choice` file in
the user's cache directory, keyed by the CPU, the thread count, the BLAS kernels and the library
versions): centroids follow the backend by float32 rounding, so a choice re-timed on every run
could flip on a loaded host and two fresh runs of one config would build different trees.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from memtree.io import atomic_write_json

# OpenBLAS kernels with AVX2 or better: any other kernel on a CPU with AVX2 is a fallback
FAST_KERNELS = frozenset(
    {
        "haswell",
        "zen",
        "skylakex",
        "cooperlake",
        "sapphirerapids",
        "neoversen1",
        "neoversen2",
        "neoversev1",
        "armv8sve",
    }
)
_SKYLAKEX = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
_HASWELL = {"avx2", "fma"}
HEALTHY_FRACTION = 0.5  # FAISS's search below half the plain sgemm: a handicapped BLAS


def cpu_flags() -> tuple[str, set[str]]:
    """The CPU model and its flags (/proc/cpuinfo; empty where there is none)."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def safe_coretype(flags: set[str]) -> str | None:
    """The OpenBLAS kernel a CPU with these flags is known to run, or None (no AVX2)."""
    if _SKYLAKEX <= flags:
        return "SkylakeX"
    if _HASWELL <= flags:
        return "Haswell"
    return None


def _rate(call, flops: float, repeats: int) -> float:
    call()  # warm-up: thread pools, page faults
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return round(flops / best / 1e9, 1)


def probe(*, repeats: int = 3, threads: int = 1) -> dict[str, Any]:
    """This process's BLAS libraries (threadpoolctl), numpy's plain sgemm and FAISS's flat search
    in GFLOP/s on all threads, and `clustering.gemm.measure(threads=threads)` (the node fits' GEMMs,
    one BLAS thread per call, `threads` callers: a Dask worker's threads)."""
    from memtree.clustering import gemm

    try:
        import faiss
    except ImportError:
        faiss = None
    libs = _blas_libs()
    rng = np.random.default_rng(0)
    n = 1024
    a = rng.standard_normal((n, n), dtype=np.float32)
    out: dict[str, Any] = {
        "libraries": libs,
        "sgemm_gflops": _rate(lambda: a @ a, 2.0 * n**3, repeats),
        "env": {
            k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ
        },
    }
    out["faiss_kernel"], out["numpy_kernel"] = _kernels(libs)
    if faiss is not None:
        q, k, d = 4096, 1024, 384
        x, c = (
            rng.standard_normal((q, d), dtype=np.float32),
            rng.standard_normal((k, d), dtype=np.float32),
        )
        index = faiss.IndexFlatL2(d)
        index.add(c)
        out["faiss_search_gflops"] = _rate(lambda: index.search(x, 1), 2.0 * q * k * d, repeats)
    out["gemm"] = gemm.measure(seconds=0.05, threads=threads) | {
        "fits": measure_fits(threads=threads)
    }
    out["gemm"]["choice"] = out["gemm"]["fits"]["choice"]
    return out


def measure_fits(
    backends: list[str] | None = None, *, threads: int = 1, repeats: int = 2
) -> dict[str, Any]:
    """Seconds of the same node fits (`kmeans.fit_nodes_batched`: 24 nodes of 320 rows and 2 of
    2,400, d = 384, k = 16, 4 EM steps and 4 equalisation rounds, the sizes of a tree's lower and
    upper levels) on each GEMM backend, `threads` callers at once, best of `repeats`; and the choice
    (`gemm.choose` on 1 / seconds). Every GEMM a build makes is in it, with its per-call costs,
    and so is the work around them, which the choice does not change."""
    from concurrent.futures import ThreadPoolExecutor

    from memtree.clustering import gemm
    from memtree.clustering.kmeans import fit_nodes_batched, single_threaded

    names = backends or gemm.available()
    rng = np.random.default_rng(0)
    sizes = [320] * 24 + [2400] * 2
    x = rng.standard_normal((sum(sizes), 384), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    bounds = np.cumsum([0, *sizes])
    members = [np.arange(a, b) for a, b in itertools.pairwise(bounds)]

    def fit(_: int) -> None:
        fit_nodes_batched(
            x,
            members,
            [16] * len(members),
            [np.random.default_rng(i) for i in range(len(members))],
            batch_size=6400,
            steps=4,
            equalize_steps=4,
        )

    secs: dict[str, float] = {}
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for name in names:
            with gemm.using(name), single_threaded():
                fit(0)  # warm-up
                best = np.inf
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    list(pool.map(fit, range(threads)))
                    best = min(best, time.perf_counter() - t0)
            secs[name] = round(best, 4)
    return {
        "seconds": secs,
        "threads": threads,
        "choice": gemm.choose({k: 1.0 / v for k, v in secs.items()}),
    }


def best_gemm(threads: int | None = None) -> str:
    """The node fits' GEMM on this host for `threads` callers (default: one per core): the stored
    choice (`remember_choice`), timed here (`measure_fits`) the first time."""
    from memtree.clustering import gemm

    gemm.available()  # loads FAISS's OpenBLAS where there is one, so its kernel is in the key
    faiss_kernel, numpy_kernel = _kernels(_blas_libs())
    n = threads or os.cpu_count() or 1
    key = host_key(n, {"faiss": faiss_kernel, "numpy": numpy_kernel})
    entry = stored_choice(key)  # before timing: measuring is what the kept choice saves
    return (entry or remember_choice(key, measure_fits(threads=n)))["choice"]


def resolve_gemm(backend: str, threads: int | None = None) -> str:
    """The backend a tree build runs its GEMMs on: `backend` itself, or for "auto" `best_gemm`
    (timed once per host and kept). The library's builders and the pipeline (when its host check
    is off) resolve "auto" here, so both choose the same BLAS on the same host."""
    return best_gemm(threads) if backend == "auto" else backend


CHOICE_FORMAT, CHOICE_VERSION = "memtree-gemm-choice", 1


def choice_path() -> Path:
    """Where the timed GEMM choices live: $MEMTREE_CACHE_DIR, else $XDG_CACHE_HOME/memtree, else
    ~/.cache/memtree; the file is gemm-choice.json."""
    d = os.environ.get("MEMTREE_CACHE_DIR")
    base = (
        Path(d)
        if d
        else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memtree"
    )
    return base / "gemm-choice.json"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def host_key(threads: int, kernels: dict[str, str | None] | None = None) -> str:
    """What the GEMM choice depends on, hashed: the CPU (model, flags, cores), the callers, the
    BLAS kernels where known, OPENBLAS_CORETYPE and the numpy / torch / FAISS versions."""
    model, flags = cpu_flags()
    what = {
        "cpu": model,
        "flags": sorted(flags),
        "cores": os.cpu_count(),
        "threads": threads,
        "kernels": kernels or {},
        "coretype": os.environ.get("OPENBLAS_CORETYPE"),
        "versions": {d: _version(d) for d in ("numpy", "torch", "faiss-cpu", "faiss-gpu")},
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _read_choices(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
        ok = doc.get("format") == CHOICE_FORMAT and isinstance(doc.get("entries"), dict)
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(
            f"{path}: not a readable {CHOICE_FORMAT} file ({e}); delete it to time the GEMMs again"
        ) from e
    if not ok:
        raise ValueError(f"{path}: not a {CHOICE_FORMAT} file; delete it to time the GEMMs again")
    if doc.get("version") != CHOICE_VERSION:
        raise ValueError(
            f"{path}: {CHOICE_FORMAT} version {doc.get('version')!r}, this memtree reads "
            f"{CHOICE_VERSION}; delete it to time the GEMMs again"
        )
    return doc["entries"]


def stored_choice(key: str) -> dict[str, Any] | None:
    """The stored entry for `key` ({choice, seconds, threads, measured_at, path}), or None."""
    path = choice_path()
    entry = _read_choices(path).get(key)
    return None if entry is None else entry | {"path": str(path), "stored": True}


def remember_choice(key: str, fits: dict[str, Any]) -> dict[str, Any]:
    """The stored choice for `key`; where there is none, `fits` (a `measure_fits` result) becomes it
    (written atomically). Returns {choice, seconds, threads, measured_at, path, stored}: `stored`
    says the choice was timed by an earlier run."""
    path = choice_path()
    entries = _read_choices(path)
    if key in entries:
        return entries[key] | {"path": str(path), "stored": True}
    entry = {
        "choice": fits["choice"],
        "seconds": fits["seconds"],
        "threads": fits["threads"],
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        path,
        {"format": CHOICE_FORMAT, "version": CHOICE_VERSION, "entries": {**entries, key: entry}},
    )
    return entry | {"path": str(path), "stored": False}


def _blas_libs() -> list[dict[str, Any]]:
    """The BLAS libraries this process has loaded (threadpoolctl), each with the package that
    owns it."""
    from threadpoolctl import threadpool_info

    return [
        {k: i.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
        | {"library": Path(i.get("filepath") or "").name, "owner": _owner(i.get("filepath") or "")}
        for i in threadpool_info()
        if i.get("user_api") == "blas"
    ]


def _kernels(libs: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    """(FAISS's OpenBLAS kernel, numpy's) of `_blas_libs()`."""
    kernel = {
        lib["owner"]: lib["architecture"] for lib in reversed(libs)
    }  # the first one of each owner
    return kernel.get("faiss"), kernel.get("numpy")


def _owner(path: str) -> str:
    for name in ("faiss", "numpy", "scipy", "torch"):
        if f"/{name}" in path:
            return name
    return "other"


def probe_subprocess(
    env: dict[str, str] | None = None, *, threads: int = 1, timeout: float = 120.0
) -> dict[str, Any]:
    """`probe(threads=threads)` in a fresh interpreter with environment `env` (default: this
    one's)."""
    proc = subprocess.run(
        [sys.executable, "-m", "memtree.clustering.blas", str(threads)],
        check=False,
        capture_output=True,
        text=True,
        env=dict(os.environ if env is None else env),
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            "the BLAS probe (python -m memtree.clustering.blas) failed: "
            f"{proc.stderr.strip()[-2000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def is_fallback(kernel: str | None, flags: set[str]) -> bool:
    return bool(kernel) and safe_coretype(flags) is not None and kernel.lower() not in FAST_KERNELS


MODES = ("fix", "force", "warn")


def check_host(*, mode: str = "fix", can_fix: bool = True, threads: int = 1) -> dict[str, Any]:
    """Probe the BLAS the pipeline's workers will load. mode "fix" (and `can_fix`: the workers
    are started after this, with this process's environment): set OPENBLAS_CORETYPE where FAISS's
    kernel is a fallback, nobody set the variable and the CPU is known to run a fast kernel;
    "force": also where the environment's OPENBLAS_CORETYPE itself names a fallback (images that
    pin one); "warn": never set it. Returns {cpu, faiss_kernel, faiss_gflops,
    sgemm_gflops, fraction_of_sgemm, fallback, action, before (a probe of the fallback, when fixed),
    gemm (the node fits' backend and its figures), message}."""
    model, flags = cpu_flags()
    first = probe_subprocess(threads=threads)
    res: dict[str, Any] = {"cpu": model, "before": None, "action": "none"}
    final = first
    want = safe_coretype(flags)
    user_set = "OPENBLAS_CORETYPE" in os.environ
    fallback = is_fallback(first["faiss_kernel"], flags)
    if mode not in MODES:
        raise ValueError(f"BLAS check mode {mode!r}: one of {MODES}")
    fix = mode != "warn"
    if fallback and fix and can_fix and (not user_set or mode == "force"):
        second = probe_subprocess(dict(os.environ, OPENBLAS_CORETYPE=want), threads=threads)
        if not is_fallback(second["faiss_kernel"], flags) and second.get(
            "faiss_search_gflops", 0
        ) > first.get("faiss_search_gflops", 0):
            res |= {
                "before": first,
                "action": f"set OPENBLAS_CORETYPE={want}",
                "replaced": os.environ.get("OPENBLAS_CORETYPE") if user_set else None,
            }
            os.environ["OPENBLAS_CORETYPE"] = want
            final = second
    fs, sg = final.get("faiss_search_gflops"), final["sgemm_gflops"]
    res |= {
        "faiss_kernel": final["faiss_kernel"],
        "numpy_kernel": final["numpy_kernel"],
        "faiss_gflops": fs,
        "sgemm_gflops": sg,
        "fraction_of_sgemm": round(fs / sg, 3) if fs and sg else None,
        "fallback": is_fallback(final["faiss_kernel"], flags),
        "env": final["env"],
        "gemm_gflops": final["gemm"]["gflops"],
        "gemm_fit_seconds": final["gemm"]["fits"]["seconds"],
        "gemm_threads": threads,
    }
    kept = remember_choice(
        host_key(threads, {"faiss": final["faiss_kernel"], "numpy": final["numpy_kernel"]}),
        final["gemm"]["fits"],
    )
    res |= {"gemm": kept["choice"], "gemm_choice": kept}
    res["message"] = _message(res, want, user_set=user_set, can_fix=can_fix, mode=mode)
    return res


def _message(
    res: dict[str, Any], want: str | None, *, user_set: bool, can_fix: bool, mode: str
) -> str:
    fig = (
        f"FAISS's OpenBLAS runs kernel {res['faiss_kernel']}: "
        f"flat search {res['faiss_gflops']} GFLOP/s, "
        f"{res['fraction_of_sgemm']} of numpy's sgemm ({res['sgemm_gflops']} GFLOP/s, kernel "
        f"{res['numpy_kernel']})"
    )
    c = res["gemm_choice"]
    when = (
        f"timed on this host on {c['measured_at']}, kept in {c['path']} (delete it to time again)"
        if c["stored"]
        else f"timed now, kept in {c['path']}"
    )
    gemm = (
        f"node fits' GEMM: {res['gemm']} ({when}; "
        f"a node-fit sample took {res['gemm_fit_seconds']} s; "
        f"GEMMs at {res['gemm_gflops']} GFLOP/s; "
        f"{res['gemm_threads']} caller(s) at one BLAS thread each)"
    )
    if res["action"] != "none":
        b = res["before"]
        was = f", replacing the environment's {res['replaced']}" if res.get("replaced") else ""
        return (
            f"BLAS: FAISS's OpenBLAS picked the fallback kernel {b['faiss_kernel']} "
            f"({b.get('faiss_search_gflops')} GFLOP/s) on a CPU that runs {want}; memtree set "
            f"OPENBLAS_CORETYPE={want} for the pipeline's workers{was} (dask.blas={mode}): "
            f"{fig}; {gemm}"
        )
    if not res["fallback"]:
        return f"BLAS: {fig}; {gemm}"
    why = (
        "dask.blas=warn"
        if mode == "warn"
        else (
            "OPENBLAS_CORETYPE is set in the environment, so memtree leaves it "
            "(dask.blas=force replaces it)"
        )
        if user_set and mode != "force"
        else "the workers of an existing Dask cluster keep their own environment"
        if not can_fix
        else f"OPENBLAS_CORETYPE={want} did not make it faster here"
    )
    return (
        f"WARNING BLAS: {fig}. That is a fallback kernel on a CPU with {want}-class SIMD "
        f"({why}); the tree's routing baselines and FAISS's searches run several times slower. "
        f"Fix: start the command (and any Dask workers) with OPENBLAS_CORETYPE={want} in the "
        f"environment; {gemm}"
    )


def main() -> int:
    print(json.dumps(probe(threads=int(sys.argv[1]) if len(sys.argv) > 1 else 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
