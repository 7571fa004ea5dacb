"""The float32 GEMM the tree's node fits run on: numpy's, torch's or FAISS's BLAS, whichever is
fastest on this host.

A Python process here holds up to three BLAS builds: numpy's OpenBLAS, torch's (MKL on x86 wheels)
and the OpenBLAS bundled in the faiss-cpu wheel (0.3.15). Which is fastest depends on the host:
on an Intel Xeon with AVX-512 and AMX, FAISS's OpenBLAS with `OPENBLAS_CORETYPE=SkylakeX` ran a
flat search at 1.24–1.38× numpy's own sgemm, on a Zen 5 host at 0.94×. The node fits'
GEMMs are small and single-threaded (`clustering.kmeans.single_threaded`), so what matters is
each library's one-core kernel on those shapes, and its per-call cost on the small ones:
`measure` times the GEMMs, `clustering.blas.measure_fits` times node fits on each backend (what
the choice rests on), `choose` keeps numpy unless another library is clearly faster, and
`using(name)` makes `matmul` run there.

Every backend computes the same float32 product up to rounding, and the node fits rescore rows
whose best two centroids lie within `TIE_GAP` in float64 (`clustering.kmeans._nearest`), so the
assignments, and with them the tree, do not depend on the choice (tests/test_gemm.py checks it
on a tree). FAISS's OpenBLAS is reached through its `cblas_sgemm` symbol (ctypes), the library
FAISS itself calls; torch's through `torch.mm(out=)` on zero-copy views.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

BACKENDS = ("numpy", "torch", "faiss")
# a backend replaces numpy only when this much faster: timings on a busy host wobble by ~10 %,
# and a choice that flips between runs would make runs differ in speed for no reason
MARGIN = 1.15
# the node fits' GEMM shape (rows of a cache group, dim, k): nearest centroids x·cᵀ and
# equalisation's dot products (`clustering.kmeans._cache_groups`: ≤ 4,096 rows at a time; the
# cluster sums are a sparse product, `kmeans._cluster_sums`)
SHAPES = ((4096, 384, 16),)

_current = "numpy"
_ROW, _NOTRANS, _TRANS = 101, 111, 112  # CBLAS_ORDER / CBLAS_TRANSPOSE


def current() -> str:
    return _current


@contextlib.contextmanager
def using(name: str) -> Iterator[None]:
    """Run `matmul` on backend `name` inside the block (per process: Dask workers set it per
    task)."""
    global _current
    if name not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {name!r}; one of {BACKENDS}")
    if name == "faiss":
        _faiss_sgemm()  # fail here, naming the reason, not mid-fit
    elif name == "torch":
        import torch  # noqa: F401  (loaded before `one_thread` looks for its pool)
    prev, _current = _current, name
    try:
        yield
    finally:
        _current = prev


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[:] = a @ b for float32 a (m, k), b (k, n), out (m, n); any operand may be a strided view
    whose rows or columns are contiguous (out's columns must be)."""
    if _current == "numpy":
        return np.matmul(a, b, out=out)
    if _current == "torch":
        import torch

        torch.mm(torch.from_numpy(a), torch.from_numpy(b), out=torch.from_numpy(out))
        return out
    return _cblas(a, b, out)


def _operand(x: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(array, transpose flag, leading dimension) for CBLAS row-major."""
    item = x.itemsize
    if x.shape[1] == 1 or x.strides[1] == item:
        return x, _NOTRANS, max(x.strides[0] // item, x.shape[1], 1)
    if x.shape[0] == 1 or x.strides[0] == item:
        return x, _TRANS, max(x.strides[1] // item, x.shape[0], 1)
    x = np.ascontiguousarray(x)
    return x, _NOTRANS, max(x.shape[1], 1)


def _cblas(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] != k or out.shape != (m, n):
        raise ValueError(f"matmul: shapes {a.shape} @ {b.shape} -> {out.shape}")
    if min(m, n, k) == 0:
        out[...] = 0.0
        return out
    if (
        out.dtype != np.float32
        or a.dtype != np.float32
        or b.dtype != np.float32
        or out.strides[1] != 4
    ):
        raise ValueError("matmul on faiss: float32 operands and an output with contiguous columns")
    a, ta, lda = _operand(a)
    b, tb, ldb = _operand(b)
    _faiss_sgemm()(
        _ROW,
        ta,
        tb,
        m,
        n,
        k,
        1.0,
        a.ctypes.data,
        lda,
        b.ctypes.data,
        ldb,
        0.0,
        out.ctypes.data,
        max(out.strides[0] // 4, n),
    )
    return out


@functools.cache
def _faiss_sgemm() -> Callable[..., None]:
    """`cblas_sgemm` of the OpenBLAS that the loaded FAISS links (found by threadpoolctl)."""
    try:
        import faiss  # noqa: F401  (loads its bundled OpenBLAS)
    except ImportError as e:
        raise RuntimeError(
            "GEMM backend 'faiss' needs FAISS (the faiss-cpu or faiss-gpu extra)"
        ) from e
    from threadpoolctl import threadpool_info

    paths = [
        i["filepath"]
        for i in threadpool_info()
        if i.get("user_api") == "blas" and "faiss" in (i.get("filepath") or "")
    ]
    if not paths:
        raise RuntimeError(
            "GEMM backend 'faiss': this FAISS build links no BLAS of its own "
            "that threadpoolctl sees"
        )
    fn = ctypes.CDLL(paths[0]).cblas_sgemm
    c_int, c_float, c_void = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    fn.argtypes = [
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        c_float,
        c_void,
        c_int,
        c_void,
        c_int,
        c_float,
        c_void,
        c_int,
    ]
    fn.restype = None
    return fn


def available() -> list[str]:
    """The backends this process can run (numpy always)."""
    out = ["numpy"]
    if "torch" in sys.modules or _importable("torch"):
        out.append("torch")
    try:
        _faiss_sgemm()
        out.append("faiss")
    except RuntimeError:
        pass
    return out


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Every BLAS / OpenMP pool and torch's intra-op pool at one thread, as in the node fits."""
    from threadpoolctl import threadpool_limits

    torch = sys.modules.get("torch")
    prev = torch.get_num_threads() if torch is not None else None
    with threadpool_limits(limits=1):
        if torch is not None:
            torch.set_num_threads(1)
        try:
            yield
        finally:
            if torch is not None:
                torch.set_num_threads(prev)


def measure(
    backends: list[str] | None = None, *, seconds: float = 0.15, threads: int = 1
) -> dict[str, Any]:
    """GFLOP/s of each backend on the node fits' GEMM shapes, each call on one BLAS thread and
    `threads` callers at once (as `build_tree`'s thread pool calls it: an OpenBLAS that serialises
    concurrent callers is slow there however fast one call is), its worst relative error against a
    float64 product, and the choice (`choose`)."""
    from concurrent.futures import ThreadPoolExecutor

    names = backends or available()
    if "torch" in names:
        import torch  # noqa: F401  (so one_thread can limit its pool)
    rng = np.random.default_rng(0)
    cases = []
    for m, k, n in SHAPES:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((n, k), dtype=np.float32).T  # a transposed view, as c[j].T
        cases.append((a, b, a.astype(np.float64) @ b.astype(np.float64)))
    rates: dict[str, float] = {}
    errors: dict[str, float] = {}

    def run(a: np.ndarray, b: np.ndarray, until: float) -> tuple[int, np.ndarray]:
        out = np.empty((a.shape[0], b.shape[1]), dtype=np.float32)
        calls = 0
        while calls == 0 or time.perf_counter() < until:
            matmul(a, b, out)
            calls += 1
        return calls, out

    with one_thread(), ThreadPoolExecutor(max_workers=threads) as pool:
        for name in names:
            flops = secs = worst = 0.0
            with using(name):
                for a, b, ref in cases:
                    run(a, b, 0.0)  # warm-up (first-call costs: thread pools, page faults)
                    t0 = time.perf_counter()
                    done = list(
                        pool.map(run, [a] * threads, [b] * threads, [t0 + seconds] * threads)
                    )
                    secs += time.perf_counter() - t0
                    flops += 2.0 * a.shape[0] * a.shape[1] * b.shape[1] * sum(c for c, _ in done)
                    worst = max(worst, float(np.abs(done[0][1] - ref).max() / np.abs(ref).max()))
            rates[name] = round(flops / secs / 1e9, 2)
            errors[name] = worst
    return {
        "gflops": rates,
        "threads": threads,
        "max_rel_error": errors,
        "choice": choose(rates, errors),
        "margin": MARGIN,
    }


def choose(rates: dict[str, float], errors: dict[str, float] | None = None) -> str:
    """numpy, unless a backend whose products agree (relative error ≤ 1e-5) is MARGIN× faster
    (rates: higher is faster)."""
    ok = {k: v for k, v in rates.items() if errors is None or errors.get(k, 1.0) <= 1e-5}
    base = ok.get("numpy", 0.0)
    best = max(ok, key=ok.get, default="numpy")
    return best if best != "numpy" and ok[best] >= MARGIN * base else "numpy"
