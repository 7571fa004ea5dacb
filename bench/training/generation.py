"""`memtree generate` on a trained run, each figure against its baseline in the same run.

    # the demo's run (make demo first)
    .venv/bin/python -m bench.training.generation
    .venv/bin/python -m bench.training.generation --run RUN --prompts p.jsonl --tree TREE
    # fewer prompts and tokens
    .venv/bin/python -m bench.training.generation --quick

Figures (medians over the prompts):

  ttft        time to first token with a cold fetch from the flash tier (O_DIRECT, no session
              cache), with a warm session cache (the same prompt again), and for the anchor alone;
              the share of the cold one that is route + fetch + attach
  decode      decode tokens/s with fetched memory against the anchor alone (same prompts, the same
              token count: no stop at end-of-text)                               target >= 0.9x
  hf          prompt + N tokens with memtree's decoding against Hugging Face `generate` on the
              exported model of the same weights (`memtree generate --export`)
                                                                                 target >= 1.0x
  simulator   a session's measured fetch time (read + decode + attach, prompts that read a block)
              against `memstore simulate-fetch`'s prediction on a profile calibrated here, with
              the session's cache hits                           target: within 20 %, hits equal
  bound       bytes read per decoded token (anchor + fetched blocks + KV cache so far) over this
              machine's memory bandwidth measured in the same run: the fastest decode memory
              allows, and the share of it reached

Writes bench/training/results/generation-<date>.json (`--out`). Nothing is extrapolated.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import (
    log,
    machine_basics,
    machine_meta,
    prepare_blas_env,
    print_targets,
    results_dir,
    results_path,
    sgemm_gflops,
    write_results,
)
from memtree.memstore.store import TierConfig
from memtree.training.generate.generator import Generator, decode_tokens

KiB, MiB = 1024, 1 << 20


def memory_bandwidth_gbs(nbytes: int = 256 * MiB, repeats: int = 5) -> float:
    """This machine's copy bandwidth: bytes read + written per second by one large numpy copy."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def prompts_for(run: Path, given: str | None, n: int) -> list[str]:
    """Prompts from a JSONL file, else the demo's questions (facts.jsonl beside the pipeline
    run)."""
    if given:
        from memtree.training.generate.cli import read_prompts

        return read_prompts(given)[:n]
    for base in [run, *run.resolve().parents]:
        facts = base / "facts.jsonl"
        if facts.is_file():
            rows = [json.loads(line) for line in facts.read_text().splitlines() if line.strip()]
            rows = rows[:: max(1, len(rows) // n)][:n]
            return [f"The {r['label']} of {r['reference']} is" for r in rows]
    raise SystemExit(f"{run}: no facts.jsonl beside it; give --prompts FILE.jsonl")


def _median(xs) -> float:
    return float(statistics.median(xs))


def ttft(run: Path, tree: str | None, prompts: list[str], n_tokens: int) -> dict[str, Any]:
    cold_tiers = [
        TierConfig(name="ram", kind="ram", capacity_bytes=0),
        TierConfig(name="flash", kind="flash", cache_bytes=0, direct=True),
    ]
    warm_tiers = [
        TierConfig(name="ram", kind="ram", capacity_bytes=0),
        TierConfig(name="flash", kind="flash", cache_bytes=1 << 30, direct=True),
    ]
    out: dict[str, Any] = {}
    g = Generator.from_run(run, tree_dir=tree, tiers=cold_tiers)
    g.generate(prompts[0], max_new_tokens=2)  # loads the embedder and warms the code paths
    cold = [g.generate(p, max_new_tokens=n_tokens) for p in prompts]
    none = [g.generate(p, max_new_tokens=n_tokens, memory="none") for p in prompts]
    out["placement"] = {str(k): v for k, v in g.store.placement.items()}
    g.close()
    g = Generator.from_run(run, tree_dir=tree, tiers=warm_tiers)
    g.generate(prompts[0], max_new_tokens=2)
    warm = []
    for p in prompts:
        g.generate(p, max_new_tokens=1)  # fills the session cache with the prompt's blocks
        warm.append(g.generate(p, max_new_tokens=n_tokens))
    assert all(f.source == "cache" for w in warm for f in w.fetches), (
        "the warm run missed its session cache"
    )
    g.close()
    pre = [
        (c.timing["embed_s"] + c.timing["traverse_s"] + c.timing["fetch_s"] + c.timing["attach_s"])
        / c.timing["ttft_s"]
        for c in cold
    ]
    out.update(
        {
            "cold_ttft_ms": 1e3 * _median(c.timing["ttft_s"] for c in cold),
            "warm_ttft_ms": 1e3 * _median(w.timing["ttft_s"] for w in warm),
            "anchor_ttft_ms": 1e3 * _median(x.timing["ttft_s"] for x in none),
            "cold_route_ms": 1e3
            * _median(c.timing["embed_s"] + c.timing["traverse_s"] for c in cold),
            "cold_fetch_ms": 1e3 * _median(c.timing["fetch_s"] for c in cold),
            "warm_fetch_ms": 1e3 * _median(w.timing["fetch_s"] for w in warm),
            "cold_attach_ms": 1e3 * _median(c.timing["attach_s"] for c in cold),
            "cold_prefill_ms": 1e3 * _median(c.timing["prefill_s"] for c in cold),
            "route_fetch_attach_share": _median(pre),
            "fetched_bytes": cold[0].resident["fetched_bytes"],
            "anchor_bytes": cold[0].resident["anchor_bytes"],
            "bank_bytes": cold[0].resident["bank_bytes"],
            "prompts": len(prompts),
        }
    )
    return out


def decode_rates(g: Generator, prompts: list[str], n_tokens: int, repeats: int) -> dict[str, Any]:
    """Tokens/s of the decode steps (after the first token), fetched memory and anchor alone, the
    same prompts and exactly n_tokens each (no stop at end-of-text), best of `repeats` per
    prompt."""
    rows = {"fetched": [], "none": []}
    bound_bytes = []
    a = g.anchor
    for p in prompts:
        ids = g.encode(p)
        path = [int(c) for c in g.route(p)[0]]
        blocks = g.fetch(path, "fetched")[0]
        mems = g.attach(blocks, widen=True)  # as `memtree generate` decodes
        for name, m in (("fetched", mems), ("none", None)):
            best = 0.0
            for _ in range(repeats):
                _, _, t, _ = decode_tokens(
                    g.model, ids, m, max_new_tokens=n_tokens, eot_id=None, context=g.context
                )
                best = max(best, t["decode_tok_s"])
            rows[name].append(best)
        # what one decode step reads: every anchor weight, the fetched blocks, and the KV cache so
        # far
        kv_per_token = a.n_layers * 2 * a.kv_heads * a.head_dim * 4
        mean_len = len(ids) + n_tokens / 2
        anchor_bytes = sum(t.numel() * t.element_size() for t in g.model.parameters())
        fetched = sum(b.numel() * b.element_size() for b in blocks.values())
        bound_bytes.append(anchor_bytes + fetched + kv_per_token * mean_len)
    f, n = _median(rows["fetched"]), _median(rows["none"])
    return {
        "fetched_tok_s": f,
        "anchor_tok_s": n,
        "ratio": f / n,
        "bytes_per_token": _median(bound_bytes),
    }


def hf_compare(
    g: Generator, prompts: list[str], n_tokens: int, repeats: int, workdir: Path
) -> dict[str, Any]:
    """Prompt + n_tokens greedy, memtree's decoding against HF generate on the exported model of the
    same weights (the prompt's blocks merged), wall time, best of `repeats` per prompt."""
    from transformers import AutoModelForCausalLM

    import memtree.training.generate.export  # noqa: F401  (registers memtree_anchor)

    ours, theirs, archs = [], [], set()
    for i, p in enumerate(prompts):
        out = workdir / f"export-{i}"
        info = g.export(out, prompt=p)
        archs.add(info["architecture"])
        hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
        ids = g.encode(p)
        mems = g.attach(g.fetch(info["route_path"], "fetched")[0], widen=True)
        x = torch.tensor([ids])
        best_ours = best_hf = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            toks, _, _, _ = decode_tokens(
                g.model, ids, mems, max_new_tokens=n_tokens, eot_id=None, context=g.context
            )
            best_ours = min(best_ours, time.perf_counter() - t0)
            with torch.no_grad():
                t0 = time.perf_counter()
                hf_out = hf.generate(
                    x,
                    do_sample=False,
                    max_new_tokens=n_tokens,
                    min_new_tokens=n_tokens,
                    pad_token_id=g.eot_id,
                )
                best_hf = min(best_hf, time.perf_counter() - t0)
        if hf_out[0, len(ids) :].tolist() != toks:
            raise SystemExit(
                f"prompt {i}: the exported model decodes other tokens than memtree: "
                f"{hf_out[0, len(ids) :].tolist()} vs {toks}"
            )
        ours.append(n_tokens / best_ours)
        theirs.append(n_tokens / best_hf)
    o, t = _median(ours), _median(theirs)
    return {
        "memtree_tok_s": o,
        "hf_generate_tok_s": t,
        "ratio": o / t,
        "architecture": sorted(archs),
    }


def simulator(
    run: Path, tree: str | None, prompts: list[str], workdir: Path, repeats: int
) -> dict[str, Any]:
    """A session over the prompts (each twice, interleaved, so the cache has work) through the real
    store, against simulate_session on a profile calibrated here at the bank's block sizes (and two
    small ones, which pin the latency)."""
    from memtree.memstore.format import read_manifest
    from memtree.memstore.sim.calibrate import calibrate
    from memtree.training.generate.session import simulate_generations

    blocks = {lv.stride for lv in read_manifest(run / "bank").levels.values()}
    sizes = sorted({4 * KiB, 64 * KiB, *blocks})
    profile = calibrate(
        workdir / "calibrate",
        sizes=sizes,
        repeats=repeats,
        bank_bytes=64 * MiB,
        out=workdir / "here.yaml",
    )
    cache = 1 << 30
    tiers = [
        TierConfig(name="ram", kind="ram", capacity_bytes=0),
        TierConfig(name="flash", kind="flash", cache_bytes=cache, direct=True),
    ]
    g = Generator.from_run(run, tree_dir=tree, tiers=tiers)
    g.warm()
    trace = [p for pair in zip(prompts, prompts[::-1], strict=True) for p in pair]
    gens = [g.generate(p, max_new_tokens=1) for p in trace]
    sim = simulate_generations(
        gens,
        store=g.store,
        anchor=g.anchor,
        memory_config=g.memory_config,
        profile=profile,
        cache_bytes=cache,
    )
    g.close()
    f = sim["fetching_prompts"]
    return {
        "measured_ms": 1e3 * f["measured_s"],
        "predicted_ms": 1e3 * f["predicted_s"],
        "ratio": f["ratio"],
        "hits_agree": sim["hits_agree"],
        "hit_rate": sim["hit_rate"],
        "attach": sim["attach"],
        "calibrated_sizes": sizes,
        "profile": dataclasses.asdict(profile),
        "per_prompt": sim["per_prompt"],
        "profile_flash_read_s": profile.tier("flash").read_seconds(max(blocks)),
    }


def miss_path(run: Path, n: int = 32) -> dict[str, Any]:
    """Where a session's miss goes, for the deepest level's blocks on flash (O_DIRECT): the store's
    fetch without a session cache and with one (random distinct blocks, each read once), and the
    bare tier read with its buffers freed between reads against kept (as a cache keeps them)."""
    from memtree.memstore.store import MemoryStore

    out: dict[str, Any] = {}
    for name, cache in (("no_cache", 0), ("cache", 1 << 30)):
        tiers = [
            TierConfig(name="ram", kind="ram", capacity_bytes=0),
            TierConfig(name="flash", kind="flash", cache_bytes=cache, direct=True),
        ]
        with MemoryStore(run / "bank", tiers=tiers, verify="always", out_dtype=torch.float32) as st:
            level = max(st.levels)
            lv = st.info.levels[level]
            ids = np.random.default_rng(0).permutation(lv.n_blocks)[:n] + lv.first_cluster
            ts = []
            for c in ids:
                t0 = time.perf_counter()
                st.fetch_flat(level, int(c))
                ts.append(time.perf_counter() - t0)
            out[f"fetch_{name}_ms"] = 1e3 * _median(ts)
            if cache == 0:
                reader = st.levels[level].reader
                freed, kept, keep = [], [], []
                for i, c in enumerate(ids):
                    slot = lv.slot(int(c))
                    t0 = time.perf_counter()
                    rec = reader.read(slot)
                    (kept if i % 2 else freed).append(time.perf_counter() - t0)
                    if i % 2:
                        keep.append(rec)
                out["read_buffers_freed_ms"], out["read_buffers_kept_ms"] = (
                    1e3 * _median(freed),
                    1e3 * _median(kept),
                )
            out["level"], out["block_bytes"] = level, lv.record_bytes
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--run", default="runs/demo/train/cotrain")
    ap.add_argument("--tree", help="the run's tree (default: tree/ beside its shards)")
    ap.add_argument("--prompts", help="JSONL prompts (default: the demo's questions)")
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens, 1 repeat")
    ap.add_argument("--out")
    args = ap.parse_args()
    # OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset for this command (re-executes it)
    prepare_blas_env()
    if args.quick:
        args.n_prompts, args.tokens, args.repeats = 4, 16, 1
    run = Path(args.run)
    out = results_path(
        args.out, f"generation-{_dt.date.today().isoformat()}.json", results_dir(__file__)
    )
    prompts = prompts_for(run, args.prompts, args.n_prompts)
    meta = {
        "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "args": vars(args),
        "machine": machine_basics(torch_threads=torch.get_num_threads()),
        "host": machine_meta(),
    }
    log("machine: sgemm and memory bandwidth")
    meta["sgemm_gflops"] = sgemm_gflops()
    bandwidth = memory_bandwidth_gbs()
    meta["memory_bandwidth_gbs"] = bandwidth
    log(f"time to first token over {len(prompts)} prompts (cold flash, warm cache, anchor alone)")
    t = ttft(run, args.tree, prompts, args.tokens)
    g = Generator.from_run(run, tree_dir=args.tree)
    log("decode tokens/s: fetched memory against the anchor alone")
    d = decode_rates(g, prompts, args.tokens, args.repeats)
    log("memtree's decoding against HF generate on the exported model")
    with tempfile.TemporaryDirectory() as tmp:
        h = hf_compare(
            g, prompts[: max(2, len(prompts) // 4)], args.tokens, args.repeats, Path(tmp)
        )
        g.close()
        log("a session against the simulator on a profile calibrated here")
        s = simulator(run, args.tree, prompts, Path(tmp), 10 * args.repeats)
        s["miss_path"] = miss_path(run)
        s["miss_path"]["predicted_read_ms"] = 1e3 * s["profile_flash_read_s"]
    bound_tok_s = bandwidth * 1e9 / d["bytes_per_token"]
    rows = [
        {
            "bench": "ttft",
            "metric": "cold flash (fetched)",
            "value": t["cold_ttft_ms"],
            "unit": "ms",
            "baseline": t["anchor_ttft_ms"],
            "ratio": t["cold_ttft_ms"] / t["anchor_ttft_ms"],
            "target": "-",
            "met": "-",
            "data": f"route+fetch+attach {t['route_fetch_attach_share']:.0%} of it; baseline: "
            "anchor alone",
        },
        {
            "bench": "ttft",
            "metric": "warm session cache",
            "value": t["warm_ttft_ms"],
            "unit": "ms",
            "baseline": t["anchor_ttft_ms"],
            "ratio": t["warm_ttft_ms"] / t["anchor_ttft_ms"],
            "target": "-",
            "met": "-",
            "data": f"fetch {t['warm_fetch_ms']:.3f} ms warm vs {t['cold_fetch_ms']:.3f} ms cold",
        },
        {
            "bench": "decode",
            "metric": "tokens/s, fetched",
            "value": d["fetched_tok_s"],
            "unit": "tok/s",
            "baseline": d["anchor_tok_s"],
            "ratio": d["ratio"],
            "target": ">= 0.9x",
            "met": "yes" if d["ratio"] >= 0.9 else "no",
            "data": f"{args.tokens} tokens; baseline: anchor alone",
        },
        {
            "bench": "hf",
            "metric": "prompt + N tokens, tok/s",
            "value": h["memtree_tok_s"],
            "unit": "tok/s",
            "baseline": h["hf_generate_tok_s"],
            "ratio": h["ratio"],
            "target": ">= 1.0x",
            "met": "yes" if h["ratio"] >= 1.0 else "no",
            "data": f"HF generate on the export ({', '.join(h['architecture'])})",
        },
        {
            "bench": "simulator",
            "metric": "session fetch time",
            "value": s["measured_ms"],
            "unit": "ms",
            "baseline": s["predicted_ms"],
            "ratio": s["ratio"],
            "target": "0.8-1.2x, hits equal",
            "met": "yes"
            if s["ratio"] is not None and 0.8 <= s["ratio"] <= 1.2 and s["hits_agree"]
            else "no",
            "data": f"hit rate {s['hit_rate']['measured']:.2f} measured / "
            f"{s['hit_rate']['predicted']:.2f} predicted",
        },
        {
            "bench": "simulator",
            "metric": "one deepest-level miss, no cache",
            "value": s["miss_path"]["fetch_no_cache_ms"],
            "unit": "ms",
            "baseline": s["miss_path"]["predicted_read_ms"],
            "ratio": s["miss_path"]["fetch_no_cache_ms"] / s["miss_path"]["predicted_read_ms"],
            "target": "-",
            "met": "-",
            "data": (
                f"with a session cache {s['miss_path']['fetch_cache_ms']:.3f} ms; tier read, "
                "buffers freed / kept "
                f"{s['miss_path']['read_buffers_freed_ms']:.3f} / "
                f"{s['miss_path']['read_buffers_kept_ms']:.3f} ms"
            ),
        },
        {
            "bench": "bound",
            "metric": "decode tok/s vs bandwidth",
            "value": d["fetched_tok_s"],
            "unit": "tok/s",
            "baseline": bound_tok_s,
            "ratio": d["fetched_tok_s"] / bound_tok_s,
            "target": "-",
            "met": "-",
            "data": f"{d['bytes_per_token'] / MiB:.2f} MiB/token at {bandwidth:.1f} GB/s copy "
            "bandwidth",
        },
    ]
    results = {"meta": meta, "rows": rows, "ttft": t, "decode": d, "hf": h, "simulator": s}
    results["meta"]["finished"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    write_results(results, out)
    print()
    print_targets(rows, unit_on_baseline=True)
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
