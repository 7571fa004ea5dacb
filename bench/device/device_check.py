"""The one prepared GPU check: every GPU figure the project tracks, in one call of under 8 minutes.

    # here: fills .devcheck/ (carried)
    make device-wheels
    # there: one H100/H200, < 8 min
    python -m bench.device.device_check --out $OUT
    # here, in tests/test_device_check.py
    python -m bench.device.device_check --device cpu --quick --out D

A GPU is lent only now and then, for 15 minutes in all, on a newer stack (Python 3.12, torch 2.11,
triton 3.6, no package index). So the whole check is prepared here and runs there as one command;
each part runs in its own process under a share of the time left, so one that breaks or runs long
costs only itself, and every part's figures land in --out as JSON (at most 8 files come back; the
default parts write 8):

  env          device, versions, TF32 defaults, CPU count
  read_paths   bench/kernels/read_paths.py --budget-s 200, first and at most 4 minutes (killed at
               240 s): every memory-read path (fused kernels, SDPA on unique-row sparse gathers, the
               widened-head SDPA, FlexAttention) at the MoC, hierarchical-KV and FFN shapes, host
               and device time apart -> read-paths.json. First, so that one short GPU window
               measures it whatever happens to the parts after it
  gpu_tests    `pytest -m gpu` (on the CPU: collection only) -> gpu-tests.txt
  kernels      bench/kernels/kernel_ops.py: memory attention against SDPA on gathered blocks at the
               MoC, hierarchical-KV and per-token shapes; FFN memory against gather + bmm ->
               kernels.json
  training     bench/training/training_steps.py --only read --only overhead at the small anchor and
               at the 12 x 768 one: fused vs gathered reads (and `memory.read: auto`) per step
               -> training-small.json, training-d768.json
  losses       bench/training/train_losses.py on the carried demo shards: GPU fp32 with TF32 off
               (seeds 0 and 1) and on (seed 0), CPU fp32 (seeds 0 and 1) run beside the GPU loss
               runs on a few cores; windowed means and gaps -> losses.json
  profile      bench/kernels/profile_reads.py: host against device time per call of the fused reads
               and their gathered baselines (enqueue, wall, ops, launches, syncs) -> profile.json
  tune_ffn     bench/kernels/tune_ffn.py: each fused FFN kernel's device time per launch
               configuration, one kernel varied at a time -> tune-ffn.json
  tune         bench/kernels/tune_backward.py: each memory-attention kernel's device time and the
               dK/dV kernel's register spills per launch configuration -> tune-backward.json
  embed        MiniLM (carried in fp16) encoding bios texts on CUDA, fp32 and fp16, texts/s
  device_check.json holds the summary: each part's status, seconds and its headline figures.

By default every part but `losses` and `tune` runs, within --budget (460 s): `read_paths` takes
at most 240 s of it and the parts after it share what it leaves (at least 220 s, where they had
all 460 before it came first; each is cut at its share and keeps what it wrote, so the last ones
may come back partial; `--parts` without `read_paths` gives them all of it). The loss pairs'
question (the CPU/GPU loss gap) was answered on an H100 on 2026-11-27 (TF32; docs/BENCHMARKS.md),
and their five training runs cost ~2 of the 8 minutes; the attention backward's sweep gave the
same figures twice that day and its choice is in `Launch.choose`. `--parts ... losses tune` runs
them again.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, log, machine_meta

PARTS = (
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
)
DEFAULT_PARTS = [p for p in PARTS if p not in ("losses", "tune")]
D768 = {
    "name": "d768-l12",
    "n_layers": 12,
    "d_model": 768,
    "n_heads": 12,
    "head_dim": 64,
    "ffn_dim": 3072,
    "vocab_size": 32768,
}
# read_paths.py's own budget and the wall-clock limit of its process: its Triton and Flex
# compiles on a fresh machine come on top of the measurements
READ_PATHS_BUDGET_S, READ_PATHS_LIMIT_S = 200, 240
# share of the remaining time each part may take at most (the rest stays for those after it)
SHARE = {
    "gpu_tests": 0.25,
    "kernels": 0.4,
    "training": 0.6,
    "profile": 0.35,
    "tune_ffn": 0.7,
    "tune": 0.7,
    "losses": 0.8,
    "embed": 1.0,
}


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget
        self.summary: dict[str, Any] = {
            "format": "memtree-device-check",
            "version": 1,
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "args": vars(args),
            "parts": {},
        }
        self.env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p),
        )
        if args.device == "cpu":
            self.env["TRITON_INTERPRET"] = "1"
        self.background: list[tuple[subprocess.Popen, Path, Any]] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def share(self, part: str) -> float:
        """The share of the time left that `part` may take: all of it for the last part run."""
        later = [p for p in PARTS[PARTS.index(part) + 1 :] if p in self.args.parts]
        return SHARE[part] if later else 1.0

    def save(self) -> None:
        tmp = self.out / "device_check.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=1, default=str))
        tmp.replace(self.out / "device_check.json")

    def run(
        self,
        name: str,
        cmd: list[str],
        *,
        share: float,
        log_to: Path | None = None,
        env: dict | None = None,
        cap: float | None = None,
    ) -> dict:
        """One child process under min(share x time left, time left, cap); its tail is kept."""
        limit = max(10.0, min(self.left() * share, cap if cap is not None else float("inf")))
        t0 = time.monotonic()
        log(f"{name}: {' '.join(cmd)} (limit {limit:.0f} s)")
        try:
            p = subprocess.run(
                cmd,
                cwd=REPO,
                env=env or self.env,
                capture_output=True,
                text=True,
                timeout=limit,
                check=False,
            )
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            text = (
                (e.stdout or b"").decode(errors="replace")
                if isinstance(e.stdout, bytes)
                else e.stdout or ""
            )
            text += (
                (e.stderr or b"").decode(errors="replace")
                if isinstance(e.stderr, bytes)
                else e.stderr or ""
            )
        if log_to:
            log_to.write_text(text)
        res = {
            "cmd": cmd,
            "rc": rc,
            "seconds": round(time.monotonic() - t0, 1),
            "tail": text[-2500:],
        }
        log(f"{name}: rc {rc} in {res['seconds']} s")
        return res

    def part(self, name: str, fn) -> None:
        if name not in self.args.parts:
            return
        t0 = time.monotonic()
        try:
            res = fn()
        # a broken part must not cost the others their minutes
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}"}
        res["part_seconds"] = round(time.monotonic() - t0, 1)
        self.summary["parts"][name] = res
        self.save()


def _py() -> list[str]:
    return [sys.executable]


# ------------------------------------------------------------------------------------- parts
def part_env(c: Check) -> dict:
    import torch

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    cuda = torch.cuda.is_available()
    smi = (
        subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
        if cuda
        else ""
    )
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": tv,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "nvidia_smi": smi.strip(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host": machine_meta(),
        "tf32_defaults": {
            "matmul": torch.backends.cuda.matmul.allow_tf32,
            "cudnn": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        },
    }


def part_read_paths(c: Check) -> dict:
    out = c.out / "read-paths.json"
    cmd = [
        *_py(),
        "-m",
        "bench.kernels.read_paths",
        "--device",
        c.args.device,
        "--budget-s",
        str(READ_PATHS_BUDGET_S),
        "--out",
        str(out),
    ]
    if c.args.quick:
        cmd.append("--quick")
    res = c.run("read_paths", cmd, share=1.0, cap=READ_PATHS_LIMIT_S)
    if out.exists():  # written after every scenario, so a timeout keeps the finished ones
        rows = json.loads(out.read_text()).get("rows", [])
        keys = (
            "scenario",
            "variant",
            "pass",
            "device_ms",
            "host_ms",
            "wall_ms",
            "vs_fair_baseline",
            "reason",
        )
        res["headline"] = [{k: r.get(k) for k in keys} for r in rows]
    return res


def part_gpu_tests(c: Check) -> dict:
    # only the files that hold GPU tests: others import what the device does not carry (Dask,
    # OpenVINO)
    files = sorted(
        str(f.relative_to(REPO))
        for f in (REPO / "tests").glob("test_*.py")
        if "pytest.mark.gpu" in f.read_text()
    )
    cmd = [
        *_py(),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "-o",
        "addopts=-ra",
        *files,
    ]
    if c.args.device == "cpu":
        cmd.append("--collect-only")
    res = c.run("gpu_tests", cmd, share=c.share("gpu_tests"), log_to=c.out / "gpu-tests.txt")
    last = [ln for ln in res["tail"].splitlines() if ln.strip()][-1:] or [""]
    res["summary_line"] = last[0]
    return res


def part_kernels(c: Check) -> dict:
    out = c.out / "kernels.json"
    cmd = [
        *_py(),
        "-m",
        "bench.kernels.kernel_ops",
        "--device",
        c.args.device,
        "--out",
        str(out),
        "--runs",
        "2" if c.args.quick else "10",
    ]
    if c.args.quick:
        cmd += ["--only", "ffn"]
    res = c.run("kernels", cmd, share=c.share("kernels"))
    if out.exists():
        rows = json.loads(out.read_text()).get("rows", [])
        res["headline"] = [
            {
                k: r.get(k)
                for k in (
                    "bench",
                    "scenario",
                    "variant",
                    "pass",
                    "ms",
                    "tflops",
                    "vs_baseline",
                    "met",
                )
            }
            for r in rows
        ]
    return res


def part_training(c: Check) -> dict:
    res: dict[str, Any] = {}
    shapes = (
        [("small", [])]
        if c.args.quick
        else [
            ("small", []),
            (
                "d768",
                [
                    "--set",
                    "anchor=" + json.dumps(D768, separators=(",", ":")),
                    "--set",
                    "batch=16",
                    "--set",
                    "seq_len=1024",
                    # 2 x 3 timed steps per variant, not 4 x 4: the check's 8 minutes
                    "--set",
                    "overhead_rounds=2",
                    "--set",
                    "overhead_steps_per_round=3",
                ],
            ),
        ]
    )
    for i, (name, extra) in enumerate(shapes):
        out = c.out / f"training-{name}.json"
        cmd = [
            *_py(),
            "-m",
            "bench.training.training_steps",
            "--device",
            c.args.device,
            "--only",
            "read",
            "--out",
            str(out),
            *extra,
        ]
        cmd += ["--quick"] if c.args.quick else ["--only", "overhead"]
        # the small shape takes about a third of what the 12 x 768 one does
        r = c.run(
            f"training-{name}",
            cmd,
            share=c.share("training") * (0.4 if i < len(shapes) - 1 else 1.0),
        )
        if out.exists():
            r["rows"] = [
                x for x in json.loads(out.read_text()).get("rows", []) if x.get("bench") == "read"
            ]
        res[name] = r
    return res


def part_profile(c: Check) -> dict:
    cmd = [
        *_py(),
        "-m",
        "bench.kernels.profile_reads",
        "--device",
        c.args.device,
        "--out",
        str(c.out),
        "--n",
        "6",
        "--steps",
        "3",
    ]  # ~60 s on an H100
    if c.args.quick:
        cmd.append("--quick")
    res = c.run("profile", cmd, share=c.share("profile"))
    path = c.out / "profile.json"
    if path.exists():
        cases = json.loads(path.read_text())["cases"]
        res["headline"] = {
            k: {
                m: v.get(m)
                for m in (
                    "enqueue_ms",
                    "wall_ms",
                    "device_ms",
                    "aten_ops",
                    "launches",
                    "host_syncs",
                )
            }
            for k, v in cases.items()
        }
    return res


def _sweep_part(c: Check, part: str, module: str, results: str) -> dict:
    """A launch-configuration sweep (bench/kernels/tune_*.py) and its rows."""
    cmd = [*_py(), "-m", module, "--device", c.args.device, "--out", str(c.out)]
    if c.args.quick:
        cmd += ["--quick", "--n", "1"]
    res = c.run(part, cmd, share=c.share(part))
    path = c.out / results
    if path.exists():
        res["rows"] = json.loads(path.read_text())["rows"]
    return res


def part_tune(c: Check) -> dict:
    return _sweep_part(c, "tune", "bench.kernels.tune_backward", "tune-backward.json")


def part_tune_ffn(c: Check) -> dict:
    return _sweep_part(c, "tune_ffn", "bench.kernels.tune_ffn", "tune-ffn.json")


def _loss_runs(c: Check) -> list[tuple[str, str, int, bool]]:
    """(name, device, seed, tf32) of each loss run."""
    if c.args.quick:
        return [("cpu-fp32-s0", "cpu", 0, False)]
    return [
        ("gpu-fp32-notf32-s0", "gpu", 0, False),
        ("gpu-fp32-notf32-s1", "gpu", 1, False),
        ("gpu-fp32-tf32-s0", "gpu", 0, True),
        ("cpu-fp32-s0", "cpu", 0, False),
        ("cpu-fp32-s1", "cpu", 1, False),
    ]


def _loss_cmd(c: Check, name: str, device: str, seed: int, tf32: bool, folder: Path) -> list[str]:
    return [
        *_py(),
        "-m",
        "bench.training.train_losses",
        "training/yamls/demo.yaml",
        "--out",
        str(folder / f"{name}.json"),
        f"data.shards={c.args.shards}",
        "mode=scratch",
        f"max_duration={c.args.loss_steps}ba",
        f"device={device}",
        "precision=fp32",
        f"seed={seed}",
        f"allow_tf32={str(tf32).lower()}",
        f"save_folder={folder / name}",
        "log_interval=1000ba",
        *c.args.loss_set,
    ]


def start_cpu_losses(c: Check) -> None:
    """The CPU runs train beside the GPU loss runs, on a few cores each (after the timed parts)."""
    if "losses" not in c.args.parts:
        return
    folder = c.out.parent / (c.out.name + "-losses")
    folder.mkdir(parents=True, exist_ok=True)
    threads = str(max(1, min(4, (os.cpu_count() or 2) // 4)))
    for name, device, seed, tf32 in _loss_runs(c):
        if device != "cpu":
            continue
        env = dict(c.env, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, CUDA_VISIBLE_DEVICES="")
        # closed in part_losses once it exits
        log_f = open(folder / f"{name}.log", "w")  # noqa: SIM115
        p = subprocess.Popen(
            _loss_cmd(c, name, device, seed, tf32, folder),
            cwd=REPO,
            env=env,
            stdout=log_f,
            stderr=subprocess.STDOUT,
        )
        c.background.append((p, folder / f"{name}.json", log_f))
    log(
        f"losses: {len(c.background)} CPU runs started beside the GPU parts ({threads} threads "
        "each)"
    )


def _windows(losses: list[float], w: int) -> list[float]:
    return [sum(losses[s : s + w]) / len(losses[s : s + w]) for s in range(0, len(losses), w)]


def part_losses(c: Check) -> dict:
    folder = c.out.parent / (c.out.name + "-losses")
    res: dict[str, Any] = {"runs": {}}
    start_cpu_losses(c)  # only now, so that no timed part above shares the CPU with them
    for name, device, seed, tf32 in _loss_runs(c):
        if device == "gpu":
            r = c.run(f"losses-{name}", _loss_cmd(c, name, device, seed, tf32, folder), share=0.5)
            res["runs"][name] = {"rc": r["rc"], "seconds": r["seconds"], "tail": r["tail"][-800:]}
    for p, _, log_f in c.background:  # the CPU runs get what is left of this part's share
        try:
            p.wait(timeout=max(5.0, c.left() * c.share("losses")))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log_f.close()
    w = c.args.loss_window
    curves = {}
    for name, *_ in _loss_runs(c):
        f = folder / f"{name}.json"
        if f.exists():
            d = json.loads(f.read_text())
            curves[name] = d["losses"]
            res["runs"].setdefault(name, {}).update(
                {k: d[k] for k in ("seconds", "device", "torch", "tf32", "torch_threads")},
                windows=[round(v, 4) for v in _windows(d["losses"], w)],
            )
        else:
            log_path = folder / f"{name}.log"
            res["runs"].setdefault(name, {})["missing"] = (
                log_path.read_text()[-800:] if log_path.exists() else "no output"
            )
    # each pair's largest windowed relative gap, B against A
    pairs = [
        ("gpu-fp32-notf32-s0", "cpu-fp32-s0"),
        ("gpu-fp32-notf32-s1", "cpu-fp32-s1"),
        ("gpu-fp32-notf32-s0", "gpu-fp32-tf32-s0"),
        ("gpu-fp32-notf32-s0", "gpu-fp32-notf32-s1"),
        ("cpu-fp32-s0", "cpu-fp32-s1"),
    ]
    res["gaps"] = {}
    for a, b in pairs:
        if a in curves and b in curves:
            wa, wb = _windows(curves[a], w), _windows(curves[b], w)
            rel = [(y - x) / x for x, y in zip(wa, wb)]
            res["gaps"][f"{b} vs {a}"] = {
                "per_window": [round(v, 4) for v in rel],
                "max_abs": round(max(abs(v) for v in rel), 4),
            }
    (c.out / "losses.json").write_text(json.dumps({"window": w, "curves": curves, **res}, indent=1))
    return res


def part_embed(c: Check) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    model_dir = Path(c.args.minilm)
    if not (model_dir / "model.safetensors").exists():
        return {"skipped": f"no MiniLM at {model_dir} (make device-wheels carries it)"}
    texts = [
        json.loads(line)["text"]
        for line in Path(c.args.corpus).read_text().splitlines()
        if line.strip()
    ]
    n = 64 if c.args.quick else 20000
    texts = (texts * (n // max(1, len(texts)) + 1))[:n]
    device = "cuda" if c.args.device == "cuda" else "cpu"
    res: dict[str, Any] = {
        "texts": n,
        "max_seq_length": 128,
        "batch_size": 256,
        "device": device,
        "weights": "carried in fp16; fp32 row converted back",
    }
    for dtype in ("float32", "float16") if device == "cuda" else ("float32",):
        m = SentenceTransformer(str(model_dir), device=device)
        m.max_seq_length = 128
        m = m.to(getattr(torch, dtype))
        m.encode(texts[:64], batch_size=256)  # warm-up: kernels, allocator
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        emb = m.encode(texts, batch_size=256, convert_to_numpy=True)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        res[dtype] = {
            "seconds": round(dt, 2),
            "texts_per_s": round(n / dt, 1),
            "dim": int(emb.shape[1]),
        }
        log(f"embed {dtype}: {n / dt:,.0f} texts/s")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON files (the device's $OUT)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CPU test)")
    ap.add_argument("--budget", type=float, default=460.0, help="seconds for the whole check")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=DEFAULT_PARTS)
    ap.add_argument("--shards", default=".devcheck/demo/pipeline/shards")
    ap.add_argument("--minilm", default=".devcheck/minilm")
    ap.add_argument(
        "--corpus", default=".devcheck/demo/corpus.jsonl", help="texts for the embed part"
    )
    ap.add_argument("--loss-steps", type=int, default=150)
    ap.add_argument(
        "--loss-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more training overrides for the loss runs (other shards than the demo's)",
    )
    ap.add_argument("--loss-window", type=int, default=30)
    args = ap.parse_args(argv)
    if args.quick:
        args.loss_steps, args.loss_window = min(args.loss_steps, 4), 2
    c = Check(args)
    c.summary["parts"]["env"] = part_env(c)
    c.save()
    for name, fn in (
        ("read_paths", part_read_paths),
        ("gpu_tests", part_gpu_tests),
        ("kernels", part_kernels),
        ("training", part_training),
        ("profile", part_profile),
        ("tune_ffn", part_tune_ffn),
        ("tune", part_tune),
        ("losses", part_losses),
        ("embed", part_embed),
    ):
        c.part(name, lambda fn=fn: fn(c))
    c.summary["finished"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    c.summary["seconds"] = round(args.budget - c.left(), 1)
    c.save()
    log(f"device check done in {c.summary['seconds']} s -> {c.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
