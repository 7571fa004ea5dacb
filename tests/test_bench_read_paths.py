"""bench/kernels/read_paths.py on the CPU with tiny shapes (as the first part of
bench/device/device_check.py: tests/test_device_check.py): every read path runs at every shape or
says why not, agrees with the fp32 reference, the fair baseline's bank gradient is sparse as in
training, and the results record the machine they were measured on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ATTENTION = {
    "kernel",
    "kernel_shared_table",
    "gather_sdpa",
    "gather_sdpa_dense",
    "sdpa_wide",
    "flex",
}
FFN = {"kernel", "kernel_shared_table", "gather_bmm", "gather_bmm_dense"}
SCENARIOS = {
    "moc": ATTENTION,
    "moc_bias": ATTENTION,
    "moc_mix": ATTENTION,
    "hkv": ATTENTION,
    "ffn": FFN,
}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [sys.executable, *cmd], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_read_paths_quick_runs_every_candidate_and_checks_it(tmp_path):
    out = tmp_path / "read-paths.json"
    p = _run(["-m", "bench.kernels.read_paths", "--device", "cpu", "--quick", "--out", str(out)])
    res = json.loads(out.read_text())
    assert "x dev" in p.stdout  # the aligned table was printed

    host = res["meta"]["host"]
    assert {"cpu", "blas", "env", "blas_env_changes"} <= set(host) and host["cpu"]["cores"] >= 1
    assert res["health"]["gemm"]["gflops"] > 0

    rows = {(r["scenario"], r["variant"], r["pass"]): r for r in res["rows"]}
    for scenario, variants in SCENARIOS.items():
        summary = res["scenarios"][scenario]
        # the fair baseline reads as training does: a sparse COO gradient over the batch's rows
        assert (
            summary["baseline_grad_layout"] == "sparse_coo" and summary["baseline_grad_sparse"]
        ), summary
        assert summary["fair_baseline"] in variants
        for v in variants:
            for pname in ("forward", "forward_backward"):
                r = rows[(scenario, v, pname)]
                timed = r["device_ms"] is not None and r["host_ms"] > 0 and r["wall_ms"] > 0
                assert timed or r["reason"], r
                if timed and pname == "forward_backward":
                    errs = r["errors"]
                    assert "error" not in errs and errs["max"] < summary["tolerance"], (
                        scenario,
                        v,
                        errs,
                    )
                    assert {"out", "dbank_k", "dbank_v"} <= set(errs) or {"out", "dw1"} <= set(
                        errs
                    ), errs
                    if summary["weight_mode"]:
                        assert "dweights" in errs, errs
                if timed:
                    ratio = r["vs_fair_baseline"]
                    assert ratio["device"] > 0 and ratio["wall"] > 0, r

    def reason(scenario, v):
        return rows[(scenario, v, "forward")]["reason"] or ""

    for scenario, variants in SCENARIOS.items():
        for v in variants:
            if (v, scenario) == ("flex", "moc_mix"):
                assert reason(scenario, v).startswith("ValueError"), reason(scenario, v)
            elif (v, scenario) == ("gather_sdpa_dense", "moc_mix"):
                assert reason(scenario, v).startswith("n/a"), reason(scenario, v)
            else:  # everything else must run here
                assert not reason(scenario, v), (scenario, v, reason(scenario, v))
