"""`memtree generate RUN --prompt TEXT | --prompts FILE.jsonl`: answer prompts with a trained run,
fetching each prompt's memory blocks from the bank's tiers, and print the answer with its timing.

The work is `training.generate.generator.Generator`; this module parses, checks what it can
before anything loads, and prints (a table per prompt, or `--json`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memtree.cli import Commands


def register(cli: Commands) -> None:
    p = cli.command(
        "generate",
        help="generate text with a trained run, its memory fetched per prompt "
        "from the bank's tiers",
        description="Route each prompt with the run's tree, fetch its path's blocks through "
        "memstore (tiers, checksums, blocking, session cache), attach them and decode with a KV "
        "cache. Prints each answer and its timing: route, fetch per level, attach, prefill, time "
        "to first token, decode tokens/s, resident bytes.",
    )
    p.add_argument(
        "run",
        help="a training run folder (memtree train run's save_folder, e.g. runs/demo/cotrain)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help='prompts, one JSON object per line with a "prompt" field, answered in order',
    )
    p.add_argument(
        "--memory",
        default="fetched",
        choices=("fetched", "generic", "none"),
        help="fetched: the prompt's path (default); generic: the bank's generic blocks; none: "
        "anchor alone",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=32, help="most tokens to generate (default 32)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed (default 0): the same seed, the same tokens",
    )
    p.add_argument("--tree", help="clustering tree folder (default: tree/ beside the run's shards)")
    p.add_argument(
        "--ram-bytes",
        type=int,
        default=1 << 30,
        help="the RAM tier's capacity; levels that do not fit go to the flash tier, deepest first "
        "(default 1 GiB)",
    )
    p.add_argument(
        "--cache-bytes",
        type=int,
        default=256 << 20,
        help="the flash tier's session cache of decoded blocks (default 256 MiB; 0: none)",
    )
    p.add_argument(
        "--session",
        action="store_true",
        help="with --prompts: also print, per prompt, the levels served from the session cache "
        "and the bytes fetched (seed 002 Fig. 5 right)",
    )
    p.add_argument(
        "--profile",
        metavar="PROFILE",
        help="with --session: replay the session's paths through the fetch simulator on this "
        "hardware profile (a YAML from `memtree memstore calibrate`, or a shipped name) and print "
        "measured against predicted fetch time per prompt",
    )
    p.add_argument(
        "--buffered",
        action="store_true",
        help="read the flash tier through the page cache (default: O_DIRECT, as a device's flash "
        "is read)",
    )
    p.add_argument(
        "--export",
        metavar="DIR",
        help="also write the anchor with --prompt's blocks merged (per --memory) as a Hugging Face "
        "model folder that AutoModelForCausalLM loads (a memtree architecture needs "
        "`import memtree.training.generate.export` first; the folder's config says which)",
    )
    p.add_argument(
        "--gate",
        metavar="LEVEL:QUANTILE",
        help="with --memory fetched: fetch only for a prompt whose cosine similarity to its "
        "level-LEVEL cluster (1, 2, … or leaf) reaches the QUANTILE of the training windows' own "
        "(e.g. leaf:0.01; calibrated on the pipeline's embed/embeddings.npy beside the tree), or "
        "a given similarity (leaf:=0.4); any other prompt is answered by the anchor alone, "
        "nothing fetched (memtree.clustering.gate)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--out", help="also write the JSON document to this file")
    p.set_defaults(func=_generate)


def read_prompts(path: str | Path) -> list[str]:
    """The "prompt" of every line of a JSONL file; a bad line is an error naming the file and
    line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--prompts {path}, line {n}: not JSON ({e.msg})") from None
            text = rec.get("prompt") if isinstance(rec, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise ValueError(
                    f'--prompts {path}, line {n}: needs a non-empty string "prompt" field'
                )
            prompts.append(text)
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts in the file")
    return prompts


def _generate(args: argparse.Namespace) -> int:
    from memtree.training.generate.generator import check_sampling

    check_sampling(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p
    )
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("--prompt: the prompt is empty")
    if args.session and args.prompts is None:
        raise ValueError("--session: needs --prompts FILE.jsonl (a session is several prompts)")
    if args.profile and not args.session:
        raise ValueError("--profile: needs --session (it predicts a session's fetch times)")
    if args.export and args.prompt is None:
        raise ValueError("--export: needs --prompt (one folder holds one prompt's path)")
    if args.export and Path(args.export).exists() and any(Path(args.export).iterdir()):
        raise ValueError(
            f"--export {args.export}: exists and is not empty (an export writes a new folder)"
        )
    if args.ram_bytes < 0 or args.cache_bytes < 0:
        raise ValueError("--ram-bytes / --cache-bytes: must be >= 0")
    gate = None
    if args.gate is not None:
        from memtree.clustering.gate import GateSpec

        if args.memory != "fetched":
            raise ValueError(f"--gate: gates fetched memory (--memory fetched), not {args.memory}")
        gate = GateSpec.parse(args.gate)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    from memtree.training.runfolder import finished_run

    finished_run(args.run)  # a folder that is no finished run, named before the model loads
    if args.memory != "none" and not (Path(args.run) / "bank").exists():
        raise ValueError(
            f"--memory {args.memory}: {Path(args.run) / 'bank'} does not exist (a run trained "
            "without memory); use --memory none"
        )

    from memtree.memstore.store import TierConfig
    from memtree.training.generate.generator import Generator

    tiers = [
        TierConfig(name="ram", kind="ram", capacity_bytes=args.ram_bytes),
        TierConfig(
            name="flash", kind="flash", cache_bytes=args.cache_bytes, direct=not args.buffered
        ),
    ]
    profile = None
    if args.profile:
        from memtree.memstore.sim.profiles import load_profile

        profile = load_profile(args.profile)
    gen = Generator.from_run(args.run, tree_dir=args.tree, tiers=tiers, bank=args.memory != "none")
    try:
        if gate is not None:
            from memtree.clustering.gate import calibrate

            gen.gate = calibrate(gen.tree, gate)
        load_s = gen.warm()
        results = [
            gen.generate(
                p,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                memory=args.memory,
            )
            for p in prompts
        ]
        doc: dict[str, Any] = {
            "run": str(args.run),
            "memory": args.memory,
            "warm_up_s": load_s,
            "sampling": {
                "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "seed": args.seed,
            },
            "placement": (
                {str(k): v for k, v in gen.store.placement.items()} if gen.store is not None else {}
            ),
            "gate": gen.gate.describe() if gen.gate is not None else None,
            "generations": [r.to_dict() for r in results],
            "store": gen.store.stats() if gen.store is not None else None,
        }
        if profile is not None:
            from memtree.training.generate.session import simulate_generations

            doc["simulation"] = simulate_generations(
                results,
                store=gen.store,
                anchor=gen.anchor,
                memory_config=gen.memory_config,
                profile=profile,
                cache_bytes=args.cache_bytes,
            )
        if args.export:
            doc["export"] = gen.export(args.export, prompt=args.prompt, memory=args.memory)
    finally:
        gen.close()
    if args.out:
        from memtree.io import atomic_write_json

        atomic_write_json(Path(args.out), doc)
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(format_generations(results, session=args.session))
        if "simulation" in doc:
            from memtree.training.generate.session import format_simulation

            print(format_simulation(doc["simulation"]))
        if args.export:
            e = doc["export"]
            print(
                f"exported: {e['path']} ({e['architecture']}, {e['memory']} memory merged: "
                f"{e['memory_merged']}, {e['params']:,} parameters); load it with "
                "AutoModelForCausalLM.from_pretrained"
                + (
                    ""
                    if e["model_type"] != "memtree_anchor"
                    else " after `import memtree.training.generate.export`"
                )
            )
    return 0


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f} ms"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_generations(results, *, session: bool = False) -> str:
    """Each prompt's answer and timing table; with `session`, the per-prompt cache table after."""
    lines = []
    for i, r in enumerate(results, 1):
        t, res = r.timing, r.resident
        used = "no memory: gated" if r.admitted is False else f"{r.memory} memory"
        lines += [f"[{i}] prompt: {r.prompt}", f"    answer ({used}, stop: {r.stop}): {r.text}"]
        if r.path is not None:
            lines.append(f"    path: {' → '.join(map(str, r.path))}")
        if r.admitted is not None:
            lines.append(
                f"    gate: similarity {r.similarity:.3f}, "
                + ("admitted" if r.admitted else "refused: the anchor alone, nothing fetched")
            )
        if "embed_s" in t:
            lines.append(
                f"    route    {_ms(t['embed_s'] + t['traverse_s'])} (embed {_ms(t['embed_s'])}, "
                f"traverse {_ms(t['traverse_s'])})"
            )
        for f in r.fetches:
            what = {
                "read": f"read {f.bytes_read:,} B",
                "cache": "session cache hit",
                "refused": "blocked: served by the bank's policy, nothing read",
            }[f.source]
            lines.append(f"    fetch L{f.level} {_ms(f.seconds)} ({f.tier}, {what})")
        if "attach_s" in t:
            lines.append(f"    attach   {_ms(t['attach_s'])}")
        lines += [
            f"    prefill  {_ms(t['prefill_s'])} ({r.prompt_tokens} prompt tokens)",
            f"    first token after {_ms(t['ttft_s'])}",
            (
                f"    decode   {t['decode_tokens']} tokens in {_ms(t['decode_s'])} "
                f"({t['decode_tok_s']:.1f} tokens/s)"
            ),
            (
                f"    resident anchor {_mib(res['anchor_bytes'])} + fetched "
                f"{_mib(res['fetched_bytes'])} + KV cache {_mib(res['kv_cache_bytes'])} (bank "
                f"{_mib(res['bank_bytes'])} on its tiers)"
            ),
        ]
    if session:
        lines += [
            "",
            "session: levels from the cache, bytes fetched, fetch time per prompt",
            f"{'prompt':>6}  {'cached levels':<14} {'fetched bytes':>14} {'fetch':>10}",
        ]
        for i, r in enumerate(results, 1):
            cached = ",".join(str(f.level) for f in r.fetches if f.source == "cache") or "-"
            nbytes = sum(f.bytes_read for f in r.fetches)
            lines.append(
                f"{i:>6}  {cached:<14} {nbytes:>14,} {_ms(r.timing.get('fetch_s', 0.0)):>10}"
            )
    return "\n".join(lines)
