"""CAMELoT's eval command: `memtree eval longctx`, long-context perplexity of a run's frozen
anchor (base / XL / Memorizing / CAMELoT, seed 001; the experiment is `longctx.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from memtree.cli import Commands, nonneg, positive
from memtree.eval.cli_common import need_file
from memtree.pretrained import SPECS as PRETRAINED

# Each command imports its library modules inside its handler, as eval/cli.py does.


def register(cli: Commands) -> None:
    """This folder's eval subcommands, in --help order."""
    sub = cli.verb("eval")
    for add in (_add_longctx,):
        add(sub)


def _add_longctx(sub: argparse._SubParsersAction) -> None:
    lc = sub.add_parser(
        "longctx",
        help="long-context perplexity of a run's frozen anchor: base / XL / Memorizing / CAMELoT "
        "(seed 001)",
        description="Run long documents through the run's frozen anchor window by window with each "
        "method and report perplexity, its ratio to base, perplexity per position bucket (0-L, "
        "L-2L, 2L-4L, …) and CAMELoT's ablations. Long documents: the --docs records sharing "
        "--group-by, joined with the end-of-text token. Writes OUT/results.json, OUT/report.md and "
        "OUT/ppl_vs_length.png.",
    )
    lc.add_argument(
        "run",
        help="a training run's save_folder (memtree_config.json, anchor.safetensors), or a "
        "pretrained model's name (smollm2-135m, gemma3-270m: `make pretrained`; needs --docs)",
    )
    lc.add_argument(
        "--method",
        default="base,xl,memorizing,camelot",
        help="comma-separated methods among base, xl, memorizing, camelot (default: all four)",
    )
    lc.add_argument("--window", type=positive, default=128, help="window L in tokens (default 128)")
    lc.add_argument(
        "--docs",
        help="JSONL of documents ({'text': …}; default: heldout.jsonl beside the run's "
        "pipeline run, as `memtree demo` lays it out)",
    )
    lc.add_argument(
        "--group-by",
        help="record key whose documents are joined into one long document; every record must have "
        "it ('none': every record alone; default: topic when every record has one, none when "
        "no record has one)",
    )
    lc.add_argument(
        "--max-docs",
        type=nonneg,
        default=0,
        help="score at most this many long documents (0 = all)",
    )
    lc.add_argument(
        "--slots",
        type=positive,
        default=4096,
        help="memory slots M per layer and KV head (default 4096)",
    )
    lc.add_argument(
        "--threshold", type=float, default=0.93, help="CAMELoT's novelty threshold R (default 0.93)"
    )
    lc.add_argument(
        "--layers", help="comma-separated memory-augmented layers (default: every layer), e.g. 2,3"
    )
    lc.add_argument("--no-ablations", action="store_true", help="skip CAMELoT's four ablations")
    lc.add_argument(
        "--visibility",
        choices=("causal", "full"),
        default="causal",
        help="which retrieved entries a query sees: causal (entries of tokens up to its own; "
        "default) or full (all L, as the seed's prefix reads — leaks the next token through "
        "the key it was retrieved with, so its perplexity is not a fair score; "
        "training/camelot/longdoc.py)",
    )
    lc.add_argument(
        "--sink",
        type=nonneg,
        default=0,
        help="keep the document's first N tokens as an attention sink before every later window, "
        "for every method, base included (default 0: none, the seed's setting; 4 as StreamingLLM "
        "for a pretrained model, whose attention leans on the sequence's first tokens)",
    )
    lc.add_argument(
        "--out",
        help="report directory (default RUN/eval-longctx; for a pretrained model "
        "runs/longctx-NAME)",
    )
    lc.set_defaults(func=_longctx)


def _longctx(args: argparse.Namespace) -> int:
    from memtree.eval.camelot.longctx import (
        group_key,
        load_records,
        long_documents,
        longctx_eval,
        write_longctx_report,
    )
    from memtree.eval.model import RunModel
    from memtree.eval.runinfo import demo_root
    from memtree.memstore.camelot.memory import CamelotConfig

    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    meta: dict = {}
    if args.run in PRETRAINED and not Path(args.run).exists():
        # CAMELoT is training-free: the pretrained model is scored as it was released, no run needed
        from memtree.pretrained import load_pretrained

        if not args.docs:
            raise SystemExit(
                f"eval longctx {args.run}: a pretrained model has no run beside it; pass --docs "
                "FILE.jsonl"
            )
        rm = load_pretrained(args.run)
        docs_path = need_file(args.docs, "--docs")
        out = Path(args.out) if args.out else Path("runs") / f"longctx-{args.run}"
        r = rm.record
        meta["model"] = (
            f"{r['title']} ({r['name']}), {r['quantisation']} dequantised to fp32: pretrained, not "
            f"the released bits; {r['licence']}; converted folder {r['hash']}"
        )
    else:
        rm = RunModel.load(args.run, bank=False)  # the frozen anchor only: no bank, no tree
        if args.docs:
            docs_path = need_file(args.docs, "--docs")
        else:
            docs_path = demo_root(rm.config) / "heldout.jsonl"
            if not docs_path.exists():
                raise FileNotFoundError(
                    f"eval longctx: no documents at {docs_path}; pass --docs FILE.jsonl"
                )
        out = Path(args.out) if args.out else Path(args.run) / "eval-longctx"
        meta["run"] = str(Path(args.run).resolve())
    records = load_records(docs_path)
    group_by = group_key(records, args.group_by, docs_path)
    layers = tuple(int(x) for x in args.layers.split(",") if x.strip()) if args.layers else None
    _keys, docs = long_documents(
        records, rm.encode, group_by=group_by, separator=rm.eot_id, max_docs=args.max_docs
    )
    results = longctx_eval(
        rm,
        docs,
        methods=methods,
        window=args.window,
        cfg=CamelotConfig(slots=args.slots, threshold=args.threshold, layers=layers),
        ablations=not args.no_ablations,
        visibility=args.visibility,
        sink=args.sink,
        log=print,
    )
    files = write_longctx_report(
        out,
        results,
        meta={**meta, "docs": str(docs_path), "group_by": group_by, "max_docs": args.max_docs},
    )
    print(Path(files["markdown"]).read_text(encoding="utf-8"))
    print(f"report: {Path(files['markdown']).resolve()}")
    return 0
