"""`memtree eval RUN …`: long-tail probes, held-out perplexity and memory blocking on a trained run."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a training run: anchor-only vs generic vs fetched memory, and memory blocking",
        description="Score the long-tail fact probes (accuracy per mention-frequency bucket) and held-out "
                    "perplexity with anchor-only, generic and fetched memories; optionally block the part "
                    "of the bank that chosen domains' probes route to (and a random control). Writes "
                    "results.json, report.md and PNGs.",
    )
    p.add_argument("run", help="a training run's save_folder (memtree_config.json, anchor.safetensors, bank/)")
    p.add_argument("--facts", required=True, help="facts JSONL (memtree demo-corpus --facts …)")
    p.add_argument("--tree", help="clustering tree directory (default: next to the run's shards)")
    p.add_argument("--held-out", help="JSONL of held-out documents ({'text': …}) for perplexity")
    p.add_argument("--max-probes", type=int, default=0, help="evaluate at most this many probes (0 = all)")
    p.add_argument("--block-domains", help="comma-separated domains whose probes' best match gets blocked")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="report directory (default RUN/eval)")
    p.set_defaults(func=_eval)

    d = sub.add_parser(
        "demo",
        help="the main job (what `make demo` runs): pipeline → anchor → memory co-training → evaluation",
        description="On the embedded default corpus: clustering pipeline, anchor pretraining, co-training "
                    "with hierarchical memories, then the long-tail probes, and memory blocking. Reruns "
                    "resume. Prints the report path.",
    )
    d.add_argument("--root", default="runs/demo", help="run directory (default runs/demo)")
    d.add_argument("--n-docs", type=int, default=4000)
    d.add_argument("--anchor-steps", type=int, default=150)
    d.add_argument("--cotrain-steps", type=int, default=150)
    d.add_argument("--max-probes", type=int, default=256, help="probes to evaluate (0 = all)")
    d.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                   help="training override for both stages (repeatable), e.g. --train data.batch_size=4")
    d.add_argument("overrides", nargs="*", help="pipeline key=value overrides")
    d.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eval.demo import run_main_job

    report = run_main_job(args.root, n_docs=args.n_docs, pipeline_overrides=args.overrides,
                          train_overrides=args.train, anchor_steps=args.anchor_steps,
                          cotrain_steps=args.cotrain_steps, max_probes=args.max_probes)
    print(Path(report).read_text())
    print(f"Demo finished. Report: {Path(report).resolve()}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from eval.experiments import blocking_eval, knowledge_eval, write_report
    from eval.longtail import build_probes, load_facts
    from eval.model import RunModel

    rm = RunModel.load(args.run, tree_dir=args.tree)
    probes = build_probes(load_facts(args.facts), seed=args.seed)
    if args.max_probes:
        step = max(1, len(probes) // args.max_probes)
        probes = probes[::step][: args.max_probes]
    held_out = []
    if args.held_out:
        with open(args.held_out, encoding="utf-8") as f:
            held_out = [json.loads(line) for line in f if line.strip()]
    knowledge = knowledge_eval(rm, probes, held_out)
    blocking = None
    if args.block_domains:
        blocking = blocking_eval(rm, probes, target_domains=args.block_domains.split(","), seed=args.seed)
    out = Path(args.out) if args.out else Path(args.run) / "eval"
    files = write_report(out, knowledge=knowledge, blocking=blocking,
                         meta={"run": str(Path(args.run).resolve()), "probes": len(probes)})
    print(Path(files["markdown"]).read_text())
    print(f"report: {Path(files['markdown']).resolve()}")
    return 0
