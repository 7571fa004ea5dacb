"""`memtree pipeline run|demo|demo-corpus|docs-corpus`: thin wrappers over pipeline.run,
pipeline.demo, pipeline.corpus and pipeline.debdocs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memtree.cli import Commands, add_config, add_overrides, config_and_overrides, nonneg, positive

# The dispatcher calls `register` for every command on each start: the libraries (Dask, the
# corpora, OmegaConf) are imported inside the command that runs, so `memtree --help` loads none.


def register(cli: Commands) -> None:
    sub = cli.verb("pipeline")
    p = sub.add_parser(
        "run",
        help="corpus → embeddings → balanced hierarchical tree → cluster-tagged MDS streams",
        description="Run (or resume) the clustering pipeline. Finished stages are skipped.",
    )
    add_config(p, "pipeline/yamls/*.yaml; flags and key=value override it")
    add_overrides(p, "tree.levels=3")
    p.add_argument(
        "--input",
        action="append",
        dest="inputs",
        help="JSONL/Parquet file or directory (repeatable)",
    )
    p.add_argument("--out", help="run directory")
    p.add_argument("--levels", type=positive)
    p.add_argument("--branching", type=positive)
    p.add_argument("--window-tokens", type=positive)
    p.add_argument("--seq-len", type=positive)
    p.add_argument("--seed", type=int)
    p.add_argument("--tokenizer", help="local Hugging Face tokenizer directory")
    p.add_argument("--scheduler", help="address of an existing Dask scheduler")
    p.add_argument("--workers", type=positive, help="LocalCluster workers (default: cores)")
    p.add_argument(
        "--until",
        help="stop after this stage "
        "(ingest, tokenizer, window, embed, tree, assign, shards, report)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)

    m = sub.add_parser(
        "demo", help="only the pipeline part of `memtree demo` (default corpus → shards)"
    )
    m.add_argument("--root", default="runs/demo", help="run directory (default runs/demo)")
    m.add_argument("--seed", type=int, default=0, help="corpus seed")
    add_overrides(m, "tree.levels=3", what="pipeline key=value overrides")
    m.set_defaults(func=_demo)

    d = sub.add_parser(
        "demo-corpus",
        help="write the embedded default corpus (entity-centric bios) to a directory",
        description="Writes DIR/corpus.jsonl, facts.jsonl (every fact with the number of "
        "documents stating it), heldout.jsonl and corpus.json. --topical writes the "
        "older topical-prose corpus to one JSONL file instead.",
    )
    d.add_argument("out", help="output directory (with --topical: a .jsonl path)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a pipeline.corpus.bios.BiosSpec field (repeatable), "
        "e.g. --set entities_per_subtopic=4",
    )
    d.add_argument(
        "--topical",
        action="store_true",
        help="the topical-prose corpus (pipeline/corpus/topical.py)",
    )
    d.add_argument(
        "--n-docs", type=positive, default=4000, help="--topical only: number of documents"
    )
    d.add_argument(
        "--facts", help="--topical only: also write every fact with its mention count (JSONL)"
    )
    d.set_defaults(func=_corpus)

    t = sub.add_parser(
        "docs-corpus",
        help="real text: Debian documentation packages → train/test JSONL",
        description="Download (apt-get download, no root) or read documentation packages and "
        "write OUT/train.jsonl, test.jsonl (split by a hash of each page's id), "
        "rejects.jsonl, corpus.json and README.md (pipeline/debdocs.py). Default: the "
        "Python 3.11 documentation sources (python3.11-doc), for `memtree eval longctx`; "
        "the real-text corpus of `memtree eval realtext` reads python3.11-doc and "
        "linux-doc-6.1 (pipeline/yamls/realdocs.yaml says how).",
    )
    t.add_argument("out", help="output directory")
    t.add_argument(
        "--package",
        action="append",
        default=[],
        help="a documentation package (repeatable; default python3.11-doc; known: python3.11-doc, "
        "linux-doc-6.1)",
    )
    t.add_argument(
        "--deb",
        action="append",
        default=[],
        help="a .deb already on disk (repeatable; matched to --package by its control file; "
        "default: CACHE/<package>_*.deb, downloaded if absent)",
    )
    t.add_argument(
        "--cache-dir", help="where packages are looked for and downloaded (default: OUT's parent)"
    )
    t.add_argument(
        "--prefix",
        default=None,
        help="path prefix of the files to keep inside the package "
        "(one package only; known packages have their own)",
    )
    t.add_argument(
        "--suffix", default=None, help="file name ending of the files to keep (one package only)"
    )
    t.add_argument("--test-fraction", type=float, default=0.1)
    t.add_argument(
        "--min-chars", type=nonneg, default=2000, help="shorter files are rejected (too_short)"
    )
    t.add_argument(
        "--max-chars",
        type=positive,
        default=None,
        help="keep each page's opening, up to this many characters, cut at a paragraph break "
        "(a corpus of short documents; default: whole pages)",
    )
    t.set_defaults(func=_docs)


def _run(args: argparse.Namespace) -> int:
    from memtree.config import load_config
    from memtree.pipeline.config import PipelineConfig
    from memtree.pipeline.run import run_pipeline

    config, overrides = config_and_overrides(args)
    flags = {
        "out": args.out,
        "seed": args.seed,
        "tree.levels": args.levels,
        "tree.branching": args.branching,
        "window.window_tokens": args.window_tokens,
        "pack.seq_len": args.seq_len,
        "window.tokenizer": args.tokenizer,
        "dask.scheduler": args.scheduler,
        "dask.n_workers": args.workers,
    }
    overrides += [f"{k}={v}" for k, v in flags.items() if v is not None]
    if args.inputs:
        overrides.append("ingest.inputs=[" + ",".join(f'"{i}"' for i in args.inputs) + "]")
    if args.no_progress:
        overrides.append("progress=false")
    if not args.out and not config and not any(o.startswith("out=") for o in overrides):
        raise ValueError(
            "no run directory: give --out RUN (or out=RUN, or a YAML config that sets out)"
        )
    cfg = load_config(PipelineConfig, config, overrides)
    markers = run_pipeline(cfg, until=args.until)
    if "report" in markers:
        print(f"report: {Path(cfg.out) / 'report' / 'report.md'}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from memtree.pipeline.corpus.bios import BiosSpec
    from memtree.pipeline.demo import run_demo

    report = run_demo(args.root, spec=BiosSpec(seed=args.seed), overrides=args.overrides)
    print(f"\nDemo finished. Report: {report.resolve()}")
    return 0


def _corpus(args: argparse.Namespace) -> int:
    if args.topical:
        from memtree.pipeline.corpus.topical import (
            CorpusSpec,
            write_corpus_jsonl,
            write_facts_jsonl,
        )

        spec = CorpusSpec(n_docs=args.n_docs, seed=args.seed)
        n = write_corpus_jsonl(args.out, spec)
        print(f"wrote {n} documents to {args.out}", file=sys.stderr)
        if args.facts:
            k = write_facts_jsonl(args.facts, spec)
            print(f"wrote {k} facts to {args.facts}", file=sys.stderr)
        return 0
    from omegaconf import OmegaConf

    from memtree.config import from_dict
    from memtree.pipeline.corpus.bios import BiosSpec, write_bios

    fields = {**OmegaConf.to_container(OmegaConf.from_dotlist(args.set)), "seed": args.seed}
    info = write_bios(args.out, from_dict(BiosSpec, fields, where="corpus"))
    print(
        f"wrote {info['documents']} documents and {info['n_facts']} facts to {args.out}",
        file=sys.stderr,
    )
    return 0


def _docs_command(args: argparse.Namespace) -> str:
    """The command line that builds this corpus again (for its README): the flags as given."""
    import shlex

    words = ["memtree", "pipeline", "docs-corpus", str(args.out)]
    for p in args.package:
        words += ["--package", p]
    for flag, value, default in (
        ("--prefix", args.prefix, None),
        ("--suffix", args.suffix, None),
        ("--test-fraction", args.test_fraction, 0.1),
        ("--min-chars", args.min_chars, 2000),
        ("--max-chars", args.max_chars, None),
    ):
        if value != default:
            words += [flag, str(value)]
    return shlex.join(words)


def _docs(args: argparse.Namespace) -> int:
    from memtree.pipeline.debdocs import deb_control, fetch_deb, known_source, write_docs_corpus

    for d in args.deb:
        if not Path(d).is_file():
            raise FileNotFoundError(
                f"--deb {d}: no such file (`apt-get download PACKAGE` writes one; leave --deb "
                "out to download it)"
            )
    given = {deb_control(d).get("Package", ""): Path(d) for d in args.deb}
    packages = args.package or list(given) or ["python3.11-doc"]
    stray = sorted(set(given) - set(packages))
    if stray:
        raise ValueError(f"--deb holds package(s) {stray}, which no --package names ({packages})")
    if len(packages) > 1 and (args.prefix is not None or args.suffix is not None):
        raise ValueError("--prefix / --suffix apply to one package; known packages have their own")
    try:
        srcs = [known_source(p, prefix=args.prefix, suffix=args.suffix) for p in packages]
    except ValueError as e:
        raise SystemExit(f"pipeline docs-corpus: {e} (--prefix, --suffix)") from None
    cache = Path(args.cache_dir) if args.cache_dir else Path(args.out).resolve().parent
    sources = [(s, given.get(s.package) or fetch_deb(s.package, cache)) for s in srcs]
    meta = write_docs_corpus(
        args.out,
        sources=sources,
        test_fraction=args.test_fraction,
        min_chars=args.min_chars,
        max_chars=args.max_chars,
        command=_docs_command(args),
    )
    rejected = (
        f"{meta['rejected']} rejected (each with its reason in {Path(args.out) / 'rejects.jsonl'})"
        if meta["rejected"]
        else "0 rejected"
    )
    print(
        f"{meta['files']} files → {meta['train']} train, {meta['test']} test, "
        f"{rejected} → {args.out}",
        file=sys.stderr,
    )
    return 0
