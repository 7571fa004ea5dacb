"""Benchmarks of memory training steps, each against its baseline in the same run.

    # full run (~5 min on 2 idle CPU cores)
    .venv/bin/python -m bench.training.training_steps --wait-quiet 240
    # small variant (~20 s)
    .venv/bin/python -m bench.training.training_steps --quick
    .venv/bin/python -m bench.training.training_steps --only overhead --out /tmp/overhead.json

Every timed step is a direct PyTorch training step: forward of `training.model.AnchorLM`
(memories fetched from a `training.bank.TrainableBank` and assembled with
`assemble_memories`), cross-entropy on random tokens, backward, optimizer step, zero_grad.
No Composer, no data loader: batches and cluster paths are drawn up front from fixed seeds.

Benchmarks (see bench/README.md for what each one compares):

  overhead  tokens/s of anchor + fetched FFN memory (fetched params = 10% of the anchor's
            params) vs the anchor alone; time ratio vs the FLOP ratio        target <= 1.2x
  banksize  step time with the bank x1 / x16 / x64 (16 / 256 / 1,024 blocks) at a fixed fetch
            size, sparse bank + MemoryAdamW; the same with dense grads + torch.optim.AdamW
                                                                  target: x64 <= 1.1x of x1
  state     MemoryAdamW optimizer state of the x64 bank after K steps vs a dense AdamW's
            2 x bank params x 4 bytes; fraction of bank rows touched              (info)
  read      step time of KV and FFN memories read in place by the fused ops
            (`TrainableBank.read`; on the CPU the ops run their pure-torch reference) vs
            gathered per-sequence copies (F.embedding + assemble_memories), same batches;
            the per-step losses of the two must agree                           (info)
            + `memory.read: auto` as the trainer resolves it (training/read_choice.py, a
            fresh cache): the mode chosen and its step time here
                                               target: auto <= 1.05x the faster of the two
            + Mixture-of-Chapters layers ("moc", issue 58) on the same anchor: a step per read
            ("fused" kernel, "gather" SDPA with the widened head, "flex"), same batches and
            seeds, and auto's choice    target: auto <= 1.03x the fastest read

Step times are medians over measured steps; warmup steps (the first steps of every model
instance) are excluded. Nothing is extrapolated: a figure is measured here or absent.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import resource
import sys
import time
from typing import Any

import torch

from bench.common import (
    command_line,
    finish,
    loadavg,
    log,
    machine_basics,
    machine_meta,
    pressure,
    results_dir,
    results_path,
    row,
    wait_quiet,
    write_results,
)
from bench.training.steps_models import (
    Trainer,
    anchor_shape,
    attn_fwd_flops_per_token,
    fetched_width,
    make_batches,
    matmul_params,
    median,
    mem_available,
    print_table,
    split_width,
)
from bench.training.steps_read import bench_read
from memtree.geometry import AnchorShape, MemoryConfig, plan

BENCHES = ("overhead", "banksize", "state", "read")
GiB = 1 << 30


# ------------------------------------------------------------------------------------ sizes
def sizes(quick: bool) -> dict[str, Any]:
    """Every size the benchmarks use; recorded verbatim in the JSON."""
    common = {
        "seed": 0,
        "lr": 1e-3,
        "betas": [0.9, 0.95],
        "max_grad_norm": 1.0,  # overhead only; banksize/state clip nothing (see bench_banksize)
        "fetch_fraction": 0.10,  # fetched params / anchor params (all params, embedding included)
        "level_weights": [4, 2, 1],  # split of the fetched FFN width over levels (overhead)
        "overhead_branching": 4,
        "banksize_level": 2,  # single memory level; blocks = branching ** level
        "banksize_branchings": [4, 16, 32],  # 16 / 256 / 1,024 blocks = x1 / x16 / x64
        "generic_prob": 1 / 16,  # same draws at every bank size
        "dense_max_bytes": 6 * GiB,  # cap on table + grad + 2 AdamW states for the dense variant
        "state_steps": 64,
        "state_checkpoints": [1, 4, 16, 64],
    }
    if quick:
        return common | {
            # the "tiny" training preset (training/config.py) with an 8k vocabulary
            "anchor": {
                "name": "tiny-v8192",
                "n_layers": 4,
                "d_model": 128,
                "n_heads": 4,
                "head_dim": 32,
                "ffn_dim": 512,
                "vocab_size": 8192,
            },
            "batch": 4,
            "seq_len": 128,
            "warmup_steps": 1,
            "overhead_rounds": 2,
            "overhead_steps_per_round": 3,
            "banksize_rounds": 1,
            "banksize_steps_per_round": 3,
            "state_seq_len": 16,
            "state_steps": 16,
            "state_checkpoints": [1, 4, 16],
        }
    return common | {
        # the "small" training preset (training/config.py) with an 8k vocabulary
        "anchor": {
            "name": "small-v8192",
            "n_layers": 8,
            "d_model": 256,
            "n_heads": 8,
            "head_dim": 32,
            "ffn_dim": 1024,
            "vocab_size": 8192,
        },
        "batch": 8,
        "seq_len": 256,
        "warmup_steps": 2,
        "overhead_rounds": 4,  # A B, B A, A B, B A
        "overhead_steps_per_round": 4,
        "banksize_rounds": 4,  # variants in order, then reversed, ...; each round rebuilds models
        "banksize_steps_per_round": 3,
        "state_seq_len": 32,  # rows touched do not depend on the sequence length
    }


# ------------------------------------------------------------------------ 1. overhead
def bench_overhead(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    a = anchor_shape(S)
    W = fetched_width(a, S["fetch_fraction"])
    mults = split_width(W, S["level_weights"])
    br = S["overhead_branching"]
    mem = MemoryConfig(multipliers=mults, branching=br)
    pl = plan(a, mem)
    n_a, n_m = matmul_params(a), pl.fetch_params
    T = S["seq_len"]
    tokens = S["batch"] * T
    attn = attn_fwd_flops_per_token(a, T)
    flops_anchor = 6 * n_a + 3 * attn  # per token, training (forward + 2x backward)
    flops_mem = 6 * (n_a + n_m) + 3 * attn
    flop_ratio = flops_mem / flops_anchor
    flop_ratio_no_attn = (n_a + n_m) / n_a
    non_embed = a.n_layers * a.block_params()
    info = {
        "anchor": S["anchor"],
        "anchor_params": a.params(),
        "anchor_non_embedding_params": non_embed,
        "anchor_matmul_params": n_a,
        "memory": {
            "multipliers": list(mults),
            "type": "ffn",
            "branching": br,
            "placement": "uniform",
        },
        "fetched_params": n_m,
        "fetched_over_anchor": n_m / a.params(),
        "fetched_over_non_embedding": n_m / non_embed,
        "bank_params": pl.bank_params,
        "attn_fwd_flops_per_token": attn,
        "flops_per_token": {"anchor": flops_anchor, "anchor_plus_memory": flops_mem},
        "flop_formula": "6·N_matmul + 3·(4·L·d_q·(S+1)/2) per token; N_matmul = block linears "
        "+ tied output head (+ fetched FFN memory)",
    }
    log(
        f"anchor {a.params():,} params ({n_a:,} in matmuls); memory {mults} branching {br}: "
        f"fetched {n_m:,} ({n_m / a.params():.1%} of the anchor, "
        f"{n_m / non_embed:.1%} of non-embedding); FLOP ratio {flop_ratio:.4f}"
    )
    warm, rounds, per = S["warmup_steps"], S["overhead_rounds"], S["overhead_steps_per_round"]
    n = warm + rounds * per
    batches = make_batches(
        S,
        n,
        seq_len=T,
        n_leaf=br ** len(mults),
        levels=len(mults),
        branching=br,
        seed=S["seed"] + 100,
    )
    runs = {
        "anchor": Trainer(S, a, None, max_grad_norm=S["max_grad_norm"]),
        "memory": Trainer(S, a, mem, max_grad_norm=S["max_grad_norm"]),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    warm_times: dict[str, list[float]] = {k: [] for k in runs}
    for k, tr in runs.items():
        for i in range(warm):
            dt, _ = tr.step(batches[i])
            warm_times[k].append(dt)
    order = []
    for r in range(rounds):
        seq = ["anchor", "memory"] if r % 2 == 0 else ["memory", "anchor"]
        for k in seq:
            for j in range(per):
                dt, loss = runs[k].step(batches[warm + r * per + j])
                times[k].append(dt)
                losses[k].append(loss)
            order.append(k)
            log(
                f"  round {r + 1} {k}: {[round(t, 3) for t in times[k][-per:]]} (CPU share "
                f"{[round(c, 2) for c in runs[k].cpu_share[-per:]]})"
            )
    t_a, t_m = median(times["anchor"]), median(times["memory"])
    time_ratio = t_m / t_a
    overhead = time_ratio / flop_ratio
    res = info | {
        "steps": {k: v for k, v in times.items()},
        "warmup": warm_times,
        "losses": losses,
        "order": order,
        "median_s": {"anchor": t_a, "memory": t_m},
        "cpu_share": {k: tr.cpu_share[warm:] for k, tr in runs.items()},
        "tokens_per_s": {"anchor": tokens / t_a, "memory": tokens / t_m},
        "time_ratio": time_ratio,
        "flop_ratio": flop_ratio,
        "flop_ratio_no_attention": flop_ratio_no_attn,
        "overhead": overhead,
    }
    data = (
        f"{S['anchor']['name']} B{S['batch']}xS{T}, FFN mem {list(mults)} br {br}, "
        f"fetched {n_m / a.params():.1%} of anchor"
    )
    rows = [
        row(
            "overhead",
            "tokens/s, anchor + memory vs anchor only",
            tokens / t_m,
            baseline=tokens / t_a,
            ratio=t_a / t_m,
            data=data,
            unit="tok/s",
        ),
        row("overhead", "step time ratio (memory / anchor)", time_ratio, data=data),
        row(
            "overhead",
            f"FLOP ratio (with attention; without: {flop_ratio_no_attn:.4f})",
            flop_ratio,
            data=data,
        ),
        row(
            "overhead",
            "time ratio / FLOP ratio",
            overhead,
            ratio=overhead,
            target="<= 1.2",
            met=overhead <= 1.2,
            data=data,
        ),
    ]
    return res, rows


# ------------------------------------------------------------------------ 2. banksize
def _banksize_variants(S: dict, a: AnchorShape, W: int) -> list[dict]:
    lv = S["banksize_level"]
    out = []
    base_blocks = S["banksize_branchings"][0] ** lv
    for sparse in (True, False):
        for br in S["banksize_branchings"]:
            mem = MemoryConfig(multipliers=(0,) * (lv - 1) + (W,), branching=br)
            pl = plan(a, mem)
            rows = br**lv + 1  # + generic row
            table_bytes = rows * pl.fetch_params * 4
            scale = br**lv // base_blocks
            out.append(
                {
                    "name": f"{'sparse' if sparse else 'dense'}-x{scale}",
                    "sparse": sparse,
                    "branching": br,
                    "blocks": br**lv,
                    "scale": scale,
                    "mem": mem,
                    "fetch_params": pl.fetch_params,
                    "table_rows": rows,
                    "table_bytes": table_bytes,
                    # dense: table + dense grad + exp_avg + exp_avg_sq
                    "dense_bytes": 4 * table_bytes,
                }
            )
    return out


def bench_banksize(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    """Same anchor, same token batches, same fetched block size (one memory level of width W,
    W from fetch_fraction), bank of 16 / 256 / 1,024 blocks. Each batch's 8 leaves are distinct
    and the generic draws are the same at every size, so every variant fetches the same number
    of distinct rows per step (with replacement, the 16-block bank would fetch fewer: less
    sparse-gradient and optimizer work, a bias in its favour). No gradient clipping here:
    torch.optim.AdamW has none, so both variants do exactly AdamW on the same gradients."""
    a = anchor_shape(S)
    W = fetched_width(a, S["fetch_fraction"])
    lv = S["banksize_level"]
    variants = _banksize_variants(S, a, W)
    avail = mem_available()
    cap = S["dense_max_bytes"] if avail is None else min(S["dense_max_bytes"], avail // 2)
    for v in variants:
        v["skip"] = None
        if not v["sparse"] and v["dense_bytes"] > cap:
            v["skip"] = (
                f"dense needs {v['dense_bytes'] / GiB:.1f} GiB (table + grad + 2 states) "
                f"> cap {cap / GiB:.1f} GiB"
            )
        log(
            f"  {v['name']}: {v['blocks']} blocks x {v['fetch_params']:,} params, table "
            f"{v['table_bytes'] / GiB:.2f} GiB" + (f" — SKIPPED: {v['skip']}" if v["skip"] else "")
        )
    warm, rounds, per = S["warmup_steps"], S["banksize_rounds"], S["banksize_steps_per_round"]
    runnable = [v for v in variants if not v["skip"]]
    times: dict[str, list[float]] = {v["name"]: [] for v in runnable}
    warm_times: dict[str, list[float]] = {v["name"]: [] for v in runnable}
    dense_state: dict[str, int] = {}
    sparse_state: dict[str, int] = {}
    distinct: dict[str, list[int]] = {}
    cpu: dict[str, list[float]] = {}
    order = []
    for r in range(rounds):
        seq = runnable if r % 2 == 0 else list(reversed(runnable))
        for v in seq:
            # same token batches for every variant; cluster ids scaled to this bank's size
            batches = make_batches(
                S,
                warm + per,
                seq_len=S["seq_len"],
                n_leaf=v["blocks"],
                levels=lv,
                branching=v["branching"],
                seed=S["seed"] + 200 + r,
                distinct=True,
            )
            t0 = time.perf_counter()
            tr = Trainer(S, a, v["mem"], sparse=v["sparse"], max_grad_norm=None)
            build = time.perf_counter() - t0
            for i in range(warm):
                warm_times[v["name"]].append(tr.step(batches[i])[0])
            for i in range(per):
                times[v["name"]].append(tr.step(batches[warm + i])[0])
            (sparse_state if v["sparse"] else dense_state)[v["name"]] = tr.bank_state_bytes()
            distinct.setdefault(v["name"], []).extend(tr.distinct_rows[warm:])
            cpu.setdefault(v["name"], []).extend(tr.cpu_share[warm:])
            order.append(v["name"])
            log(
                f"  round {r + 1} {v['name']} (built in {build:.1f}s): "
                f"{[round(t, 3) for t in times[v['name']][-per:]]} (CPU share "
                f"{[round(c, 2) for c in tr.cpu_share[warm:]]})"
            )
            del tr
    med = {k: median(t) for k, t in times.items()}
    res = {
        "fetched_width": W,
        "level": lv,
        "variants": [
            {
                k: (
                    val
                    if k != "mem"
                    else {"multipliers": list(val.multipliers), "branching": val.branching}
                )
                for k, val in v.items()
            }
            for v in variants
        ],
        "dense_cap_bytes": cap,
        "mem_available_bytes": avail,
        "steps": times,
        "warmup": warm_times,
        "median_s": med,
        "order": order,
        "distinct_rows_per_measured_step": distinct,
        "cpu_share": cpu,
        "bank_state_bytes_after_run": {"sparse": sparse_state, "dense": dense_state},
        "dense_optimizer": "torch.optim.AdamW defaults (foreach=None, fused=None)",
        "max_grad_norm": None,
    }
    rows = []
    fp = variants[0]["fetch_params"]
    base = med.get("sparse-x1")
    for v in variants:
        name = v["name"]
        data = (
            f"{v['blocks']} blocks x {fp:,} params ({v['table_bytes'] / GiB:.2f} GiB fp32), "
            f"level {lv}, br {v['branching']}"
        )
        kind = "sparse + MemoryAdamW" if v["sparse"] else "dense grads + torch AdamW"
        if v["skip"]:
            rows.append(
                row(
                    "banksize",
                    f"step time, {kind}, bank x{v['scale']}",
                    None,
                    data=f"{data}; not run: {v['skip']}",
                    unit="s",
                )
            )
            continue
        t = med[name]
        is_target = v["sparse"] and v["scale"] == max(x["scale"] for x in variants)
        ratio = t / base if base else None
        rows.append(
            row(
                "banksize",
                f"step time, {kind}, bank x{v['scale']} (vs sparse x1)",
                t,
                baseline=base,
                ratio=ratio,
                unit="s",
                data=data,
                target="<= 1.1" if is_target else "",
                met=(ratio <= 1.1) if is_target and ratio is not None else None,
            )
        )
        if not v["sparse"]:
            sp = med.get(f"sparse-x{v['scale']}")
            if sp:
                rows.append(
                    row(
                        "banksize",
                        f"dense / sparse step time at bank x{v['scale']}",
                        t / sp,
                        ratio=t / sp,
                        data=data,
                    )
                )
    return res, rows


# ---------------------------------------------------------------------------- 3. state
def bench_state(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    """Train the x64 bank (largest banksize configuration) for K steps with MemoryAdamW and
    read its optimizer state. A short sequence keeps this cheap: which rows a step touches
    depends only on the batch's paths, not on the sequence length."""
    a = anchor_shape(S)
    W = fetched_width(a, S["fetch_fraction"])
    lv = S["banksize_level"]
    br = S["banksize_branchings"][-1]
    mem = MemoryConfig(multipliers=(0,) * (lv - 1) + (W,), branching=br)
    fp = plan(a, mem).fetch_params
    blocks = br**lv
    rows_total = blocks + 1
    bank_params = rows_total * fp
    dense_bytes = 2 * bank_params * 4
    K = S["state_steps"]
    batches = make_batches(
        S,
        K,
        seq_len=S["state_seq_len"],
        n_leaf=blocks,
        levels=lv,
        branching=br,
        seed=S["seed"] + 300,
    )
    tr = Trainer(S, a, mem, sparse=True, max_grad_norm=None, seq_len=S["state_seq_len"])
    table = tr.bank.tables[str(lv)]
    checkpoints = []
    t0 = time.perf_counter()
    for k in range(1, K + 1):
        tr.step(batches[k - 1])
        if k in S["state_checkpoints"]:
            st = tr.opt.state[table]
            sb = tr.bank_state_bytes()
            touched = int(st["used"])
            checkpoints.append(
                {
                    "steps": k,
                    "state_bytes": sb,
                    "rows_touched": touched,
                    "rows_seen_by_fetch": len(tr.rows_seen[lv]),
                    "pool_capacity_rows": int(st["exp_avg"].shape[0]),
                    "fraction_touched": touched / rows_total,
                    "ratio_vs_dense": sb / dense_bytes,
                }
            )
            log(
                f"  after {k} steps: {touched}/{rows_total} rows touched, pool "
                f"{st['exp_avg'].shape[0]} rows, state {sb / 2**20:.1f} MiB "
                f"({sb / dense_bytes:.3f} of dense)"
            )
    total_state = tr.opt.state_bytes()
    anchor_state = total_state - tr.bank_state_bytes()
    res = {
        "blocks": blocks,
        "table_rows": rows_total,
        "fetch_params": fp,
        "bank_params": bank_params,
        "dense_adamw_state_bytes": dense_bytes,
        "seq_len": S["state_seq_len"],
        "batch": S["batch"],
        "checkpoints": checkpoints,
        "optimizer_state_bytes_total": total_state,
        "anchor_state_bytes": anchor_state,
        "seconds": time.perf_counter() - t0,
    }
    data = f"{blocks} blocks (+generic) x {fp:,} params, B{S['batch']}, {K} steps"
    rows = []
    for c in checkpoints:
        rows.append(
            row(
                "state",
                f"bank optimizer state after {c['steps']} steps "
                f"({c['rows_touched']}/{rows_total} rows touched = "
                f"{c['fraction_touched']:.1%}; pool {c['pool_capacity_rows']} rows)",
                c["state_bytes"] / 2**20,
                baseline=dense_bytes / 2**20,
                ratio=c["ratio_vs_dense"],
                unit="MiB",
                data=data,
            )
        )
    return res, rows


# ------------------------------------------------------------------------------------- main
def machine() -> dict:
    return machine_basics(torch_threads=torch.get_num_threads())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small, fast variant")
    ap.add_argument(
        "--only", choices=BENCHES, action="append", help="run only this benchmark (repeatable)"
    )
    date = _dt.date.today().isoformat()
    ap.add_argument(
        "--out",
        default=None,
        help="results JSON (default bench/training/results/training[-ONLY…]-DATE.json, so a "
        "partial run does not overwrite a full one)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one size from sizes() (JSON value); recorded in the JSON",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each benchmark, wait up to SECONDS for the 1-minute load "
        "average to drop below half the core count",
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the models train (fp32 on either)",
    )
    args = ap.parse_args(argv)
    S = sizes(args.quick) | {"device": args.device}
    for kv in args.set:
        key, _, val = kv.partition("=")
        if key not in S:
            ap.error(f"--set {kv}: unknown size {key!r}; sizes: {sorted(S)}")
        try:
            S[key] = json.loads(val)
        except json.JSONDecodeError:
            S[key] = val
    parts = "".join(f"-{b}" for b in args.only or [])
    out = results_path(args.out, f"training{parts}-{date}.json", results_dir(__file__))
    selected = args.only or list(BENCHES)
    results: dict[str, Any] = {
        "meta": {
            "command": command_line(),
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "quick": args.quick,
            "machine": machine(),
            "host": machine_meta(),
            "sizes": S,
            "loadavg_start": loadavg(),
        },
        "benchmarks": {},
        "rows": [],
    }
    fns = {
        "overhead": bench_overhead,
        "banksize": bench_banksize,
        "state": bench_state,
        "read": bench_read,
    }
    ctx: dict[str, Any] = {}
    for name in [b for b in BENCHES if b in selected]:
        waited = wait_quiet(args.wait_quiet, per_core=0.5)
        before = {"loadavg": loadavg(), "pressure": pressure()}
        log(f"=== {name} (load average {before['loadavg']}, cpu pressure {before['pressure']})")
        t0 = time.perf_counter()
        res, rows = fns[name](S, ctx)
        res["waited_for_quiet_s"] = waited
        res["load_before"] = before
        res["load_after"] = {"loadavg": loadavg(), "pressure": pressure()}
        res["bench_seconds"] = round(time.perf_counter() - t0, 1)
        # peak resident set of this process so far (Linux reports KiB)
        res["peak_rss_gib_so_far"] = round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2
        )
        results["benchmarks"][name] = res
        results["rows"] += rows
        write_results(results, out)  # partial results
        log(f"=== {name} done in {res['bench_seconds']}s (load average {loadavg()})")
    return finish(results, out, print_table)


if __name__ == "__main__":
    sys.exit(main())
