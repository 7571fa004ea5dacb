"""Benchmarks judge their baselines: a baseline far below the machine's sgemm is flagged, and the
BLAS environment a baseline runs in is made healthy and recorded (issue 37)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    yield importlib.import_module("bench.common")
    sys.modules.pop("bench.common", None)


def test_baseline_health_is_judged_against_sgemm(common):
    assert common.baseline_health("b", 180.0, 200.0)["healthy"]
    weak = common.baseline_health("b", 35.0, 220.0)
    assert not weak["healthy"] and weak["fraction_of_sgemm"] == pytest.approx(35 / 220, abs=1e-3)


def test_the_health_check_flags_a_deliberately_slowed_baseline(common):
    """The same product as the sgemm check, once through BLAS and once crippled (one thread,
    float64, one row at a time): the first is healthy, the second is not."""
    n = 768
    sgemm = common.sgemm_gflops(n, repeats=3)
    a = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)

    def rate(fn) -> float:
        best = min(_timed(fn) for _ in range(3))
        return 2 * n**3 / best / 1e9

    def crippled():
        a64 = a.astype(np.float64)
        with threadpool_limits(1):
            return np.stack([row @ a64 for row in a64])

    assert common.baseline_health("blas", rate(lambda: a @ a), sgemm)["healthy"]
    assert not common.baseline_health("crippled", rate(crippled), sgemm)["healthy"]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_forced_openblas_kernels_are_unset_for_the_command_and_recorded(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        f"import json, os, sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from bench.common import FAST_KERNELS, cpu_info, machine_meta, prepare_blas_env\n"
        "prepare_blas_env()\n"
        "meta = machine_meta()\n"
        "faiss_blas = [b['architecture'] for b in meta['blas']\n"
        "              if b['user_api'] == 'blas' and 'faiss' in (b['filepath'] or '')]\n"
        "print(json.dumps({'l2': os.environ.get('OPENBLAS_L2_SIZE'), 'changes': "
        "meta['blas_env_changes'],\n"
        "                  'faiss': faiss_blas, 'simd': cpu_info()['simd'], 'fast': "
        "sorted(FAST_KERNELS)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTREE_BENCH")}
    env |= {"OPENBLAS_CORETYPE": "Prescott", "OPENBLAS_L2_SIZE": "65536"}
    p = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["changes"]["unset"] == {"OPENBLAS_CORETYPE": "Prescott", "OPENBLAS_L2_SIZE": "65536"}
    assert got["changes"]["final"] and got["l2"] is None
    if "avx2" in got["simd"]:  # FAISS's OpenBLAS then runs a kernel that uses the CPU's SIMD
        assert got["faiss"] and got["faiss"][0].lower() in got["fast"], got


def test_the_targets_table_claims_no_speedup_against_a_handicapped_baseline(monkeypatch):
    """bench/pipeline/pipeline_targets.py's table: with healthy baselines each ratio is judged
    against its target; with a handicapped FAISS the tree and routing speed-ups are left empty and
    unjudged, while the quality rows (NMI, balance, agreement) are still judged."""
    monkeypatch.syspath_prepend(str(REPO))
    targets = importlib.import_module("bench.pipeline.pipeline_targets")
    tree = {
        "equalize_share": 0.07,
        "rows": [
            {
                "method": "build_tree (defaults)",
                "seconds": 2.0,
                "nmi": 0.98,
                "balance_l1": 1.02,
                "balance_l2": 1.1,
                "balance_l3": 1.19,
            },
            {"method": "faiss.Kmeans flat", "seconds": 16.0, "nmi": 0.97, "balance_l3": 7.0},
            {"method": "two_level_clustering", "seconds": 1.5, "nmi": 0.97, "balance_l3": 5.9},
        ],
        "skewed": [
            {
                "data": "z",
                "mode": "default",
                "points_per_leaf": 14.6,
                "balance": [1.1, 1.15, 1.2, 1.3],
            },
            {
                "data": "z",
                "mode": "strict_balance",
                "points_per_leaf": 14.6,
                "balance": [1.05, 1.07, 1.1, 1.16],
            },
        ],
    }
    route = {
        "agreement_with_float64_argmin": 1.0,
        "rows": [{"method": "route", "seconds": 0.03}, {"method": "exhaustive", "seconds": 4.5}],
    }
    embed = {
        "cosine": {"min": 0.997},
        "rows": [
            {
                "setting": "msl 256, 1 thread",
                "torch_docs_per_s": 20.0,
                "int8_docs_per_s": 30.0,
                "speedup": 1.5,
            }
        ],
    }
    data = {"tree": "t", "route": "r", "embed": "e"}
    ok = {"healthy": True}
    rows = {
        r["metric"]: r
        for r in targets.target_rows(tree, route, embed, {"faiss": ok, "torch": ok}, data)
    }
    assert rows["build_tree vs flat faiss.Kmeans"]["ratio"] == pytest.approx(8.0)
    assert rows["build_tree vs flat faiss.Kmeans"]["met"] == "yes"
    assert rows["build_tree vs two_level_clustering"]["met"] == "no"  # 0.75x
    assert rows["route vs IndexFlatL2 exhaustive"]["met"] == "yes"  # 150x
    assert rows["int8 vs encode, msl 256, 1 thread"]["met"] == "no"  # 1.5x
    assert rows["leaf NMI vs two-level"]["met"] == "yes"
    assert rows["leaf balance, worst of 3 levels"]["value"] == pytest.approx(1.19)
    skewed = rows["leaf balance, worst level, skewed data (14.6 points per leaf), default"]
    assert skewed["value"] == pytest.approx(1.3) and skewed["met"] == "no"
    assert (
        rows["leaf balance, worst level, skewed data (14.6 points per leaf), strict_balance"]["met"]
        == "yes"
    )
    weak = {"faiss": {"healthy": False}, "torch": ok}
    rows = {r["metric"]: r for r in targets.target_rows(tree, route, embed, weak, data)}
    for m in (
        "build_tree vs flat faiss.Kmeans",
        "build_tree vs two_level_clustering",
        "route vs IndexFlatL2 exhaustive",
    ):
        assert rows[m]["ratio"] is None and rows[m]["met"] == "-"
    assert (
        rows["leaf NMI vs flat"]["met"] == "yes" and rows["paths = float64 argmin"]["met"] == "yes"
    )
    assert rows["int8 vs encode, msl 256, 1 thread"]["ratio"] == pytest.approx(1.5)
    for m in (
        "bench.pipeline.pipeline_targets",
        "bench.clustering.routing",
        "bench.clustering.tree_targets",
        "bench.clustering.embed_backends",
        "bench.common",
    ):
        sys.modules.pop(m, None)
