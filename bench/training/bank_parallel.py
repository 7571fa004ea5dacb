"""Memory-parallel co-training: a sharded bank against the replicated one, in real multi-process
runs.

    # both parts (about 25 min on 2 CPU cores)
    python -m bench.training.bank_parallel
    # bytes per step at 2 and 4 ranks (demo shards)
    python -m bench.training.bank_parallel --parts comm
    # step time and peak RSS per rank, bank 1× → 70×
    python -m bench.training.bank_parallel --parts scale
    python -m bench.training.bank_parallel --parts scale --branchings 4 17 --scale-banks sharded \
        --repeats 3
    # only the bank grows: the flatness target
    python -m bench.training.bank_parallel --parts scale --branchings 4 17 --scale-banks sharded \
        --repeats 3 --allocators retain --fixed-rows
    # cpu_threads auto vs torch's default
    python -m bench.training.bank_parallel --parts threads --steps 8 --warmup 2

Each configuration is a `composer -n W` launch of this file in worker mode (`--worker SPEC`): it
builds the run with `training.train.build_trainer` (gloo on the CPU), attaches `CommBytes`
(the anchor's DDP all-reduce counted by a comm hook, the optimizer's collectives by the optimizer)
and a per-rank reporter (step times, peak RSS, resident bank tables and their optimizer state),
trains `--steps` steps without saving, and writes one JSON per rank.

- comm: the demo's shards and training shapes (`training/yamls/demo.yaml`: anchor 4 × 128, FFN
  memories (0, 64, 128)), replicated vs sharded bank over the same lanes, at 2 and 4 ranks: bytes
  a rank sends per step, by collective (ring estimate). Target: sharded sends at most the anchor's
  gradient all-reduce plus the replicated (generic) rows, nothing that grows with the bank.
- scale: synthetic MDS shards (random tokens, uniform leaves) of trees with branching 4, 8, 12, 17
  (3 levels), so the bank is 1×, 7.6×, 25× and 70× the demo's with the same fetched blocks and
  the same steps; 4 ranks, replicated vs sharded: median step time and peak RSS per rank, page
  faults, kernel seconds and distinct bank rows updated per step. `--allocators system retain`
  runs the sharded bank under both `host_allocator` settings (the replicated baseline under the
  last); `--repeats R` interleaves R rounds. Target: sharded step time flat (≤ 1.1× from 1× to
  70×), RSS per rank growing as bank / 4.
- threads: 2 ranks, sharded bank, the demo's shapes (`--threads-batch` sequences per step): the
  new default (`cpu_threads: auto`, OMP_NUM_THREADS unset: usable cores / local ranks threads per
  rank) against the old one (torch's default, every core in every rank: `cpu_threads` set to the
  count torch picks here without OMP_NUM_THREADS), `--repeats` interleaved rounds: tokens per
  second of the whole run (every rank's input tokens / the slowest rank's median step) and the
  ratio. The comm and scale parts run their ranks with OMP_NUM_THREADS=1, as they always have.

Baselines run in the same invocation, interleaved by size. Results:
bench/training/results/bank-parallel-<date>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import REPO, finish, fmt, log, results_dir, results_path, run_meta

DEMO_TRAIN = [
    "model.anchor=custom",
    "model.shape={n_layers: 4, d_model: 128, n_heads: 4, head_dim: 32, ffn_dim: 512}",
    "memory.multipliers=[0,64,128]",
    "memory.type=ffn",
    "memory.lr=3.0e-2",
    "memory.generic_prob=0.0625",
    "mode=scratch",
    "optim.warmup=2ba",
    "save_interval=0ba",
    "progress_bar=false",
    "log_interval=1000ba",
]


# --- worker ---------------------------------------------------------------------------------------


def _worker(spec_path: str) -> int:
    """One rank of one configuration: train, then write rank{r}.json into spec["out"]."""
    import torch
    from composer.core import Callback
    from composer.utils import dist

    from memtree.training.callbacks import CommBytes
    from memtree.training.composer_model import unwrap
    from memtree.training.config import load_train_config
    from memtree.training.train import build_trainer

    spec = json.loads(Path(spec_path).read_text())

    class Report(Callback):
        def __init__(self) -> None:
            self.t0, self.steps, self.bytes, self.faults, self.sys, self.rows = (
                0.0,
                [],
                [],
                [],
                [],
                [],
            )
            self.tokens = []

        def batch_start(self, state, logger) -> None:
            self.t0, self.ru = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)

        def batch_end(self, state, logger) -> None:
            self.steps.append(time.perf_counter() - self.t0)
            ru = resource.getrusage(resource.RUSAGE_SELF)
            # first-touch page faults and kernel time: what a step spends re-mapping freed memory
            self.faults.append(ru.ru_minflt - self.ru.ru_minflt)
            self.sys.append(ru.ru_stime - self.ru.ru_stime)
            self.bytes.append(dict(comm.last))
            # distinct bank rows this rank's optimizer updated: the sparse step's work, which
            # grows with how many rows a batch spreads over, not with the table
            self.rows.append(sum(state.optimizers[0].last_rows.values()))
            self.tokens.append(int(state.batch["input_ids"].numel()))

        def fit_end(self, state, logger) -> None:
            bank, opt = unwrap(state.model).bank, state.optimizers[0]
            tables = list(bank.tables.values())
            st = [opt.state.get(t, {}) for t in tables]
            skip = spec["warmup"]
            kinds = sorted({k for b in self.bytes for k in b})
            rep = {
                "rank": dist.get_global_rank(),
                "world": dist.get_world_size(),
                "step_s": self.steps,
                "median_step_s": statistics.median(self.steps[skip:]),
                "minor_faults_per_step": statistics.median(self.faults[skip:]),
                "sys_s_per_step": statistics.median(self.sys[skip:]),
                "rows_updated_per_step": statistics.mean(self.rows[skip:]),
                "bytes_per_step": {
                    k: statistics.mean(b.get(k, 0) for b in self.bytes[skip:]) for k in kinds
                },
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "bank_rows": sum(int(t.shape[0]) for t in tables),
                "table_bytes": sum(t.numel() * t.element_size() for t in tables),
                "bank_state_bytes": sum(
                    v.numel() * v.element_size()
                    for s in st
                    for v in s.values()
                    if hasattr(v, "numel")
                ),
                "anchor_grad_bytes": sum(
                    p.numel() * p.element_size()
                    for p in unwrap(state.model).model.parameters()
                    if p.requires_grad
                ),
                # the generic rows' all-reduce: each table's row plus one "was read" flag
                "generic_row_bytes": sum((t.shape[1] + 1) * t.element_size() for t in tables),
                "shard": list(bank.shard) if bank.shard is not None else None,
                "threads": torch.get_num_threads(),
                "tokens_per_step": statistics.mean(self.tokens[skip:]),
            }
            Path(spec["out"], f"rank{rep['rank']}.json").write_text(json.dumps(rep))

    comm = CommBytes(hook_ddp=True)
    trainer = build_trainer(load_train_config(None, spec["overrides"]), callbacks=[comm, Report()])
    try:
        trainer.fit()
    finally:
        trainer.close()
    return 0


def _launch(
    world: int,
    overrides: list[str],
    *,
    steps: int,
    warmup: int,
    tmp: Path,
    name: str,
    omp_threads: str | None = "1",
) -> list[dict]:
    """`omp_threads`: the ranks' OMP_NUM_THREADS (None: unset, so `cpu_threads` decides)."""
    from streaming.base.util import clean_stale_shared_memory

    out = tmp / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = out / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "out": str(out),
                "warmup": warmup,
                "overrides": [*overrides, f"max_duration={steps}ba", f"save_folder={out / 'run'}"],
            }
        )
    )
    clean_stale_shared_memory()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {
        "PYTHONPATH": str(REPO)
    }
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = omp_threads
    t0 = time.time()
    r = subprocess.run(
        [
            str(Path(sys.executable).with_name("composer")),
            "-n",
            str(world),
            "-m",
            "bench.training.bank_parallel",
            "--worker",
            str(spec),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    clean_stale_shared_memory()
    if r.returncode != 0:
        # a configuration that does not fit the machine is a result, not a crash of the benchmark
        text = r.stdout + r.stderr
        tail = text[-3000:]
        # the launcher SIGTERMs the other ranks when one is killed: look at all of the output
        killed = "code -9" in text or "Killed" in text or "SIGKILL" in text
        log(
            f"{name}: failed (rc "
            f"{r.returncode}{', a rank was killed: out of memory?' if killed else ''})"
        )
        shutil.rmtree(out / "run", ignore_errors=True)
        return [{"failed": True, "killed": killed, "rc": r.returncode, "log_tail": tail[-1500:]}]
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    log(f"{name}: {time.time() - t0:.0f} s")
    shutil.rmtree(out / "run", ignore_errors=True)
    return reports


# --- data -----------------------------------------------------------------------------------------


def demo_shards(root: Path) -> Path:
    from memtree.pipeline.demo import run_demo

    shards = root / "pipeline" / "shards"
    if not (shards / "manifest.json").exists():
        log(f"building the demo's pipeline under {root}")
        run_demo(root)
    return shards


def synthetic_shards(
    demo: Path,
    out: Path,
    *,
    branching: int,
    per_subtree: int,
    seed: int = 0,
    data_subtrees: int | None = None,
    fanout: int | None = None,
) -> Path:
    """memtree-shards v1 for a 3-level tree of `branching`: `per_subtree` samples of random tokens
    per level-1 subtree, each at a uniform leaf of its subtree; the demo's tokenizer and seq_len.
    data_subtrees / fanout (fixed rows): only the first `data_subtrees` subtrees have data, and
    their samples sit under the first `fanout` children at levels 2 and 3, so every tree gets the
    same samples over the same number of distinct rows and only the bank grows."""
    from streaming import MDSWriter

    from memtree.pipeline.shards import MDS_COLUMNS, stream_name

    base = json.loads((demo / "manifest.json").read_text())
    vocab_dir = (demo / base["tokenizer"]).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copytree(vocab_dir, out / "tokenizer") if vocab_dir.is_dir() else shutil.copy(
        vocab_dir, out / "tokenizer.json"
    )
    from memtree.training.data import tokenizer_vocab_size

    vocab = tokenizer_vocab_size(demo, base)
    rng = np.random.default_rng(seed)
    seq, eot, b = int(base["seq_len"]), int(base["eot_id"]), branching
    f = b if fanout is None else fanout
    streams = []
    for s in range(b if data_subtrees is None else data_subtrees):
        with MDSWriter(
            out=str(out / stream_name(s)),
            columns=MDS_COLUMNS,
            compression="zstd",
            hashes=["xxh64"],
            progress_bar=False,
        ) as w:
            for i in range(per_subtree):
                leaf = (s * b + int(rng.integers(f))) * b + int(rng.integers(f))
                tokens = rng.integers(0, vocab - 1, size=seq - 1)
                tokens = (tokens + (tokens >= eot)).astype(np.int32)  # any token but the EOT
                w.write(
                    {
                        "tokens": np.append(tokens, eot).astype(np.int32),
                        "doc_bounds": np.array([0, seq], dtype=np.int32),
                        "path": np.array([s, leaf // b, leaf], dtype=np.int64),
                        "leaf": leaf,
                        "window_ids": np.array([s * per_subtree + i], dtype=np.int64),
                    }
                )
        index = json.loads((out / stream_name(s) / "index.json").read_text())
        streams.append(
            {
                "name": stream_name(s),
                "subtree": s,
                "n_samples": per_subtree,
                "shards": [
                    {
                        "file": (sh.get("zip_data") or sh["raw_data"])["basename"],
                        "samples": sh["samples"],
                    }
                    for sh in index["shards"]
                ],
            }
        )
    manifest = {
        **base,
        "branching": b,
        "levels": 3,
        "tree_id": f"synthetic-b{b}",
        "tokenizer": "tokenizer" if vocab_dir.is_dir() else "tokenizer.json",
        "streams": streams,
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


# --- parts ----------------------------------------------------------------------------------------


def part_comm(args, tmp: Path, shards: Path) -> list[dict]:
    rows = []
    for world in args.worlds:
        for bank in ("replicated", "sharded"):
            reps = _launch(
                world,
                [
                    f"data.shards={shards}",
                    f"data.batch_size={args.batch}",
                    "parallel.data=lanes",
                    f"parallel.bank={bank}",
                    *DEMO_TRAIN,
                ],
                steps=args.steps,
                warmup=args.warmup,
                tmp=tmp,
                name=f"comm-{bank}-{world}",
            )
            per = {}
            for r in reps:
                for k, v in r["bytes_per_step"].items():
                    per[k] = max(per.get(k, 0), v)
            anchor = reps[0]["anchor_grad_bytes"]
            ring = 2 * (world - 1) / world
            allowed = ring * (anchor + reps[0]["generic_row_bytes"]) + per.get("control", 0)
            total = sum(per.values())
            rows.append(
                {
                    "part": "comm",
                    "world": world,
                    "bank": bank,
                    **{f"bytes_{k}": v for k, v in per.items()},
                    "bytes_total": total,
                    "anchor_allreduce_bytes_expected": ring * anchor,
                    "allowed_bytes": allowed,
                    "meets_target": total <= allowed * 1.001 if bank == "sharded" else None,
                    "median_step_s": max(r["median_step_s"] for r in reps),
                    "peak_rss_gib": max(r["peak_rss_bytes"] for r in reps) / 2**30,
                }
            )
    for world in args.worlds:
        rep, sh = (
            next(r for r in rows if r["part"] == "comm" and r["world"] == world and r["bank"] == b)
            for b in ("replicated", "sharded")
        )
        sh["bytes_ratio_vs_replicated"] = sh["bytes_total"] / rep["bytes_total"]
    return rows


def part_scale(args, tmp: Path, demo: Path) -> list[dict]:
    """Every configuration at every bank size, `--repeats` rounds interleaved (all sizes and
    configurations once per round, so a slow spell of a shared host hits every size alike);
    a row's step time is the median over rounds of the slowest rank's median step."""
    from memtree.geometry import AnchorShape, MemoryConfig, plan

    anchor = AnchorShape(
        name="demo", n_layers=4, d_model=128, n_heads=4, head_dim=32, ffn_dim=512, vocab_size=1
    )
    base = plan(anchor, MemoryConfig(multipliers=(0, 64, 128), branching=4)).bank_params
    configs = [
        (k, a)
        for a in args.allocators
        for k in args.scale_banks
        if k == "sharded" or a == args.allocators[-1]
    ]  # the replicated baseline once
    fixed = {"data_subtrees": 4, "fanout": 4} if args.fixed_rows else {}
    shards = {
        b: synthetic_shards(
            demo, tmp / f"shards-b{b}", branching=b, per_subtree=args.per_subtree, **fixed
        )
        for b in args.branchings
    }
    runs: dict[tuple, list[dict]] = {}
    for rnd in range(args.repeats):
        for b in args.branchings:
            for bank, alloc in configs:
                if any(r.get("failed") for r in runs.get((b, bank, alloc), [])):
                    continue  # out of memory once is out of memory
                reps = _launch(
                    args.scale_world,
                    [
                        f"data.shards={shards[b]}",
                        f"data.batch_size={args.scale_batch}",
                        "parallel.data=lanes",
                        f"parallel.bank={bank}",
                        f"host_allocator={alloc}",
                        *DEMO_TRAIN,
                    ],
                    steps=args.steps,
                    warmup=args.warmup,
                    tmp=tmp,
                    name=f"scale-{bank}-{alloc}-b{b}-r{rnd}",
                )
                if reps[0].get("failed"):
                    runs.setdefault((b, bank, alloc), []).append(reps[0])
                    continue
                runs.setdefault((b, bank, alloc), []).append(
                    {
                        "median_step_s": max(r["median_step_s"] for r in reps),
                        "peak_rss_gib": max(r["peak_rss_bytes"] for r in reps) / 2**30,
                        "table_gib_per_rank": max(r["table_bytes"] for r in reps) / 2**30,
                        "bytes_total": max(sum(r["bytes_per_step"].values()) for r in reps),
                        "minor_faults_per_step": max(r["minor_faults_per_step"] for r in reps),
                        "sys_s_per_step": max(r["sys_s_per_step"] for r in reps),
                        "rows_updated_per_step": max(r["rows_updated_per_step"] for r in reps),
                    }
                )
    rows = []
    for b in args.branchings:
        bank_params = plan(anchor, MemoryConfig(multipliers=(0, 64, 128), branching=b)).bank_params
        for bank, alloc in configs:
            row = {
                "part": "scale",
                "branching": b,
                "bank": bank,
                "host_allocator": alloc,
                "fixed_rows": args.fixed_rows,
                "bank_params": bank_params,
                "bank_factor": bank_params / base,
            }
            got = runs[(b, bank, alloc)]
            if any(r.get("failed") for r in got):
                rows.append({**row, **next(r for r in got if r.get("failed"))})
                continue
            rows.append(
                {
                    **row,
                    **{k: statistics.median(r[k] for r in got) for k in got[0]},
                    "median_step_s_per_round": [r["median_step_s"] for r in got],
                }
            )
        shutil.rmtree(tmp / f"shards-b{b}", ignore_errors=True)
    for bank, alloc in configs:
        mine = [
            r
            for r in rows
            if r["bank"] == bank and r["host_allocator"] == alloc and not r.get("failed")
        ]
        for r in mine:
            r["step_ratio_vs_1x"] = r["median_step_s"] / mine[0]["median_step_s"]
            r["rss_growth_gib"] = r["peak_rss_gib"] - mine[0]["peak_rss_gib"]
    for r in rows:
        if r["bank"] == "sharded":
            r["meets_target"] = (not r.get("failed")) and r["step_ratio_vs_1x"] <= 1.1
    return rows


def torch_default_threads() -> int:
    """The intra-op threads torch picks in a fresh process without OMP_NUM_THREADS: what every
    rank ran with before `cpu_threads: auto`."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(r.stdout.strip())


def part_threads(args, tmp: Path, shards: Path) -> list[dict]:
    """The new thread default against the old one, `--repeats` rounds interleaved; a row's figure
    is the median over rounds."""
    old = torch_default_threads()
    configs = [
        ("auto (new default)", []),
        (f"torch default, {old} per rank (old)", [f"cpu_threads={old}"]),
    ]
    got: dict[str, list[dict]] = {}
    for rnd in range(args.repeats):
        for label, extra in configs:
            reps = _launch(
                2,
                [
                    f"data.shards={shards}",
                    f"data.batch_size={args.threads_batch}",
                    "parallel.data=lanes",
                    "parallel.bank=sharded",
                    *DEMO_TRAIN,
                    *extra,
                ],
                steps=args.steps,
                warmup=args.warmup,
                tmp=tmp,
                name=f"threads-{len(extra)}-r{rnd}",
                omp_threads=None,
            )
            if reps[0].get("failed"):
                got.setdefault(label, []).append(reps[0])
                continue
            step = max(r["median_step_s"] for r in reps)
            got.setdefault(label, []).append(
                {
                    "median_step_s": step,
                    "threads": [r["threads"] for r in reps],
                    "tokens_per_s": sum(r["tokens_per_step"] for r in reps) / step,
                }
            )
    rows = []
    for label, _ in configs:
        runs = [r for r in got[label] if not r.get("failed")]
        if not runs:
            rows.append({"part": "threads", "config": label, **got[label][0]})
            continue
        rows.append(
            {
                "part": "threads",
                "config": label,
                "world": 2,
                "threads_per_rank": runs[0]["threads"],
                "median_step_s": statistics.median(r["median_step_s"] for r in runs),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                "tokens_per_s_per_round": [r["tokens_per_s"] for r in runs],
            }
        )
    new, old_row = rows
    if "tokens_per_s" in new and "tokens_per_s" in old_row:
        new["ratio_vs_old"] = new["tokens_per_s"] / old_row["tokens_per_s"]
    return rows


def _print(rows: list[dict]) -> None:
    comm = [r for r in rows if r["part"] == "comm"]
    if comm:
        kinds = sorted(
            {
                k
                for r in comm
                for k in r
                if k.startswith("bytes_") and k != "bytes_total" and not k.startswith("bytes_ratio")
            }
        )
        print("bytes sent per rank per step (ring estimate):")
        print(
            " | ".join(
                ["world", "bank", *[k[6:] for k in kinds], "total", "allowed", "ratio", "target"]
            )
        )
        for r in comm:
            print(
                " | ".join(
                    fmt(x)
                    for x in [
                        r["world"],
                        r["bank"],
                        *[r.get(k, 0) for k in kinds],
                        r["bytes_total"],
                        r["allowed_bytes"],
                        r.get("bytes_ratio_vs_replicated"),
                        r["meets_target"],
                    ]
                )
            )
    threads = [r for r in rows if r["part"] == "threads"]
    if threads:
        print("\nthreads per rank, 2 ranks, sharded bank (demo shapes):")
        print("config | threads per rank | step s | tokens/s | new / old")
        for r in threads:
            if r.get("failed"):
                print(f"{r['config']} | failed, rc {r['rc']}")
                continue
            print(
                " | ".join(
                    fmt(x)
                    for x in [
                        r["config"],
                        "/".join(map(str, r["threads_per_rank"])),
                        r["median_step_s"],
                        r["tokens_per_s"],
                        r.get("ratio_vs_old"),
                    ]
                )
            )
    scale = [r for r in rows if r["part"] == "scale"]
    if scale:
        print("\nbank size at 4 ranks:")
        print(
            "branching | bank | host allocator | bank × demo | step s | step / 1× | page faults / "
            "step | "
            "sys s / step | rows updated / step | peak RSS GiB | tables GiB/rank | target"
        )
        for r in scale:
            if r.get("failed"):
                why = (
                    "a rank was killed (out of memory)" if r["killed"] else f"failed, rc {r['rc']}"
                )
                print(
                    f"{r['branching']} | {r['bank']} | {r['host_allocator']} | "
                    f"{fmt(r['bank_factor'])} | {why}"
                )
                continue
            print(
                " | ".join(
                    fmt(x)
                    for x in [
                        r["branching"],
                        r["bank"],
                        r["host_allocator"],
                        r["bank_factor"],
                        r["median_step_s"],
                        r["step_ratio_vs_1x"],
                        r["minor_faults_per_step"],
                        r["sys_s_per_step"],
                        r.get("rows_updated_per_step"),
                        r["peak_rss_gib"],
                        r["table_gib_per_rank"],
                        r.get("meets_target"),
                    ]
                )
            )


def _scale_series(rows: list[dict]) -> list[tuple[tuple[str, str], str]]:
    keys = sorted(
        {
            (r["bank"], r["host_allocator"])
            for r in rows
            if r["part"] == "scale" and not r.get("failed")
        }
    )
    styles = {
        ("replicated", "retain"): "--",
        ("replicated", "system"): "-.",
        ("sharded", "retain"): "-",
        ("sharded", "system"): ":",
    }
    return [(k, styles[k]) for k in keys]


def plot(rows: list[dict], path: Path) -> None:
    """Left: bytes a rank sends per step, by collective; right: step time and peak RSS per rank
    against the bank's size (4 ranks)."""
    from memtree.eval.plots import new_figure, save_png

    fig = new_figure(11, 4)
    ax = fig.add_subplot(1, 2, 1)
    comm = [r for r in rows if r["part"] == "comm"]
    kinds = sorted(
        {
            k
            for r in comm
            for k in r
            if k.startswith("bytes_")
            and k not in ("bytes_total",)
            and not k.startswith("bytes_ratio")
        }
    )
    labels = [f"{r['bank']}\n{r['world']} ranks" for r in comm]
    bottom = np.zeros(len(comm))
    for k in kinds:
        vals = np.array([r.get(k, 0) / 2**20 for r in comm])
        ax.bar(labels, vals, bottom=bottom, label=k[6:])
        bottom += vals
    ax.set_ylabel("MiB sent per rank per step (ring)")
    ax.set_title("Collectives per step, demo shapes")
    if comm:
        ax.legend(fontsize=7)
    ax2 = fig.add_subplot(1, 2, 2)
    for (bank, alloc), style in _scale_series(rows):
        pts = [
            r
            for r in rows
            if r["part"] == "scale"
            and r["bank"] == bank
            and r["host_allocator"] == alloc
            and not r.get("failed")
        ]
        ax2.plot(
            [r["bank_factor"] for r in pts],
            [r["median_step_s"] for r in pts],
            style,
            marker="o",
            label=f"{bank}, {alloc} malloc: step s",
        )
    ax2.set_xscale("log")
    ax2.set_xlabel("bank size (× the demo's)")
    ax2.set_ylabel("median step (s)")
    ax3 = ax2.twinx()
    for (bank, alloc), style in _scale_series(rows):
        pts = [
            r
            for r in rows
            if r["part"] == "scale"
            and r["bank"] == bank
            and r["host_allocator"] == alloc
            and not r.get("failed")
        ]
        ax3.plot(
            [r["bank_factor"] for r in pts],
            [r["peak_rss_gib"] for r in pts],
            style,
            marker="s",
            color="tab:red",
            alpha=0.6,
            label=f"{bank}, {alloc}: peak RSS",
        )
    ax3.set_ylabel("peak RSS per rank (GiB)")
    ax2.set_title("4 ranks: step time and memory vs bank size")
    if any(r["part"] == "scale" for r in rows):
        ax2.legend(loc="upper left", fontsize=7)
        ax3.legend(loc="lower right", fontsize=7)
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--parts", nargs="+", choices=["comm", "scale", "threads"], default=["comm", "scale"]
    )
    p.add_argument(
        "--demo-root",
        default=str(REPO / "runs" / "demo"),
        help="a demo run (its pipeline is built if absent)",
    )
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=16, help="global batch of the comm part")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians and means")
    p.add_argument("--branchings", type=int, nargs="+", default=[4, 8, 12, 17])
    p.add_argument("--scale-world", type=int, default=4)
    p.add_argument("--scale-batch", type=int, default=32)
    p.add_argument(
        "--per-subtree", type=int, default=48, help="synthetic samples per level-1 subtree"
    )
    p.add_argument(
        "--fixed-rows",
        action="store_true",
        help="scale part: data in 4 subtrees under 4 children per level whatever the branching, so "
        "batches touch the same number of distinct rows and only the bank grows",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="scale part: interleaved rounds (median over them)"
    )
    p.add_argument(
        "--scale-banks",
        nargs="+",
        choices=["replicated", "sharded"],
        default=["replicated", "sharded"],
    )
    p.add_argument(
        "--allocators",
        nargs="+",
        choices=["system", "retain"],
        default=["system", "retain"],
        help="scale part: the ranks' host_allocator settings (sharded runs each; the replicated "
        "baseline with the last)",
    )
    p.add_argument("--threads-batch", type=int, default=8, help="global batch of the threads part")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out = results_path(
        args.out, f"bank-parallel-{time.strftime('%Y-%m-%d')}.json", results_dir(__file__)
    )
    from threadpoolctl import threadpool_info

    # the BLAS / OpenMP each side ran with (the same for both: they are one script's launches)
    results = {
        "meta": run_meta(
            args,
            cpus=os.cpu_count(),
            threadpools=threadpool_info(),
            env={
                k: v for k, v in os.environ.items() if k.startswith(("OPENBLAS_", "OMP_", "MKL_"))
            },
            worker_env={"OMP_NUM_THREADS": "1 (comm, scale); unset (threads)"},
            usable_cores=len(os.sched_getaffinity(0)),
        ),
        "rows": [],
    }
    demo = demo_shards(Path(args.demo_root))
    with tempfile.TemporaryDirectory(prefix="memtree-bank-parallel-") as tmp:
        if "comm" in args.parts:
            results["rows"] += part_comm(args, Path(tmp), demo)
        if "scale" in args.parts:
            results["rows"] += part_scale(args, Path(tmp), demo)
        if "threads" in args.parts:
            results["rows"] += part_threads(args, Path(tmp), demo)
    plot(results["rows"], out.with_suffix(".png"))
    return finish(results, out, _print)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2]))
    sys.exit(main())
