"""`memtree pipeline …` and `memtree demo-corpus`: thin wrappers over pipeline.run."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pipeline",
        help="corpus → embeddings → balanced hierarchical tree → cluster-tagged MDS streams",
        description="Run (or resume) the clustering pipeline. Finished stages are skipped.",
    )
    p.add_argument("config", nargs="?", help="YAML config (optional; flags and key=value override it)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. tree.levels=3")
    p.add_argument("--input", action="append", dest="inputs", help="JSONL/Parquet file or directory (repeatable)")
    p.add_argument("--out", help="run directory")
    p.add_argument("--levels", type=int)
    p.add_argument("--branching", type=int)
    p.add_argument("--window-tokens", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--tokenizer", help="local Hugging Face tokenizer directory")
    p.add_argument("--scheduler", help="address of an existing Dask scheduler")
    p.add_argument("--workers", type=int, help="LocalCluster workers (default: cores)")
    p.add_argument("--until", help="stop after this stage (ingest, tokenizer, window, embed, tree, assign, shards, report)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)

    m = sub.add_parser("demo-pipeline", help="only the pipeline part of `memtree demo` (default corpus → shards)")
    m.add_argument("--root", default="runs/demo", help="run directory (default runs/demo)")
    m.add_argument("--n-docs", type=int, default=4000)
    m.add_argument("overrides", nargs="*", help="pipeline key=value overrides")
    m.set_defaults(func=_demo)

    d = sub.add_parser("demo-corpus", help="write the embedded default corpus as JSONL")
    d.add_argument("out", help="output .jsonl path")
    d.add_argument("--n-docs", type=int, default=4000)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--facts", help="also write every fact with its mention count (JSONL) for the "
                                   "long-tail knowledge benchmark (memtree eval --facts)")
    d.set_defaults(func=_corpus)


def _run(args: argparse.Namespace) -> int:
    from memtree.config import load_config
    from pipeline.config import PipelineConfig
    from pipeline.run import run_pipeline

    config = args.config
    overrides = list(args.overrides)
    if config and "=" in config:  # no YAML given: the first positional is an override
        overrides.insert(0, config)
        config = None
    flags = {
        "out": args.out, "seed": args.seed, "tree.levels": args.levels, "tree.branching": args.branching,
        "window.window_tokens": args.window_tokens, "pack.seq_len": args.seq_len,
        "window.tokenizer": args.tokenizer, "dask.scheduler": args.scheduler, "dask.n_workers": args.workers,
    }
    overrides += [f"{k}={v}" for k, v in flags.items() if v is not None]
    if args.inputs:
        overrides.append("ingest.inputs=[" + ",".join(f'"{i}"' for i in args.inputs) + "]")
    if args.no_progress:
        overrides.append("progress=false")
    cfg = load_config(PipelineConfig, config, overrides)
    markers = run_pipeline(cfg, until=args.until)
    if "report" in markers:
        from pathlib import Path

        print(f"report: {Path(cfg.out) / 'report' / 'report.md'}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pipeline.demo import run_demo

    report = run_demo(args.root, n_docs=args.n_docs, overrides=args.overrides)
    print(f"\nDemo finished. Report: {report.resolve()}")
    return 0


def _corpus(args: argparse.Namespace) -> int:
    from pipeline.corpus import CorpusSpec, write_corpus_jsonl

    spec = CorpusSpec(n_docs=args.n_docs, seed=args.seed)
    n = write_corpus_jsonl(args.out, spec)
    print(f"wrote {n} documents to {args.out}", file=sys.stderr)
    if args.facts:
        from pipeline.corpus import write_facts_jsonl

        k = write_facts_jsonl(args.facts, spec)
        print(f"wrote {k} facts to {args.facts}", file=sys.stderr)
    return 0
