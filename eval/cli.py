"""`memtree eval knowledge RUN …` (long-tail probes, perplexity, RAG baseline, blocking),
`memtree eval sweep`, `eval retention`, `eval tasks` (your own task suite), `eval memories` (every
memory family beside dense models on the demo's probes), `eval realtext` (held-out perplexity of
the memory rows on real text) and the main job `memtree demo`. The systems' eval commands live in
their folders' cli.py (`camelot/`: eval longctx; `context/`: eval context-bank; `finetune/`: eval
continual, eval adapters)."""

from __future__ import annotations

import argparse
from pathlib import Path

from memtree.cli import Commands, add_config, add_overrides, config_and_overrides, nonneg
from memtree.eval.cli_common import (
    add_gate,
    apply_gate,
    check_demo_root,
    config_file,
    gate_spec,
    need_file,
    note,
    out_override,
)
from memtree.pretrained import SPECS as PRETRAINED

# Each command imports its library modules inside its handler: `memtree --help` loads every stage's
# cli.py, and the eval modules pull in torch and Composer.


def register(cli: Commands) -> None:
    """The eval stage's subcommands, in --help order, and the main job `memtree demo`."""
    sub = cli.verb("eval")
    for add in (
        _add_knowledge,
        _add_sweep,
        _add_retention,
        _add_tasks,
        _add_memories,
        _add_realtext,
    ):
        add(sub)
    _add_demo(cli)


def _add_knowledge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "knowledge",
        help="evaluate a training run: anchor-only vs generic vs fetched memory, and memory "
        "blocking",
        description="Score the long-tail fact probes (accuracy per mention-frequency bucket) and "
        "held-out perplexity with anchor-only, generic and fetched memories; optionally block the "
        "part of the bank that chosen domains' probes route to (and a random control). Writes "
        "results.json, report.md and PNGs.",
    )
    p.add_argument(
        "run", help="a training run's save_folder (memtree_config.json, anchor.safetensors, bank/)"
    )
    p.add_argument(
        "--facts",
        help="facts JSONL (default: facts.jsonl beside the run's pipeline run, as "
        "`memtree demo` lays it out; memtree pipeline demo-corpus writes one)",
    )
    p.add_argument(
        "--tree", help="clustering tree directory (default: tree/ beside the run's shards)"
    )
    p.add_argument(
        "--held-out",
        help="JSONL of held-out documents ({'text': …}) for perplexity (default: "
        "heldout.jsonl beside the run's pipeline run when there, as eval longctx)",
    )
    p.add_argument(
        "--max-probes", type=nonneg, default=0, help="evaluate at most this many probes (0 = all)"
    )
    p.add_argument(
        "--block-domains", help="comma-separated domains whose probes' best match gets blocked"
    )
    p.add_argument(
        "--rag",
        nargs="?",
        const="",
        metavar="PIPELINE_RUN",
        help="add the RAG baseline (App. H): the nearest training window of the question's leaf "
        "cluster in the context; datastore = this pipeline run (default: the run's shards' parent)",
    )
    p.add_argument(
        "--epochs",
        type=float,
        help="epochs the model trained over the corpus in all (exposures = mentions × epochs; "
        "default: counted from the run's max_duration and the anchor_checkpoint runs it continued, "
        "e.g. the demo's 2 + 5)",
    )
    p.add_argument(
        "--block-level",
        type=int,
        help="with --block-domains: tree level of the blocked subtrees, one of the levels the bank "
        "holds memory at (default: the shallowest; the demo's bank: 2, a domain); a level-L "
        "subtree is 1/branching^L of the tree",
    )
    p.add_argument(
        "--block-documents",
        metavar="IDS_FILE",
        help="forget a data owner: a text file of document ids (the ingest's doc_id), one per "
        "line; every block they trained is blocked (as `memtree memstore block --documents`, on "
        "the open store only) and the facts stated only in them are scored against all others, and "
        "their held-out pages (--owner-field) against everyone else's, before / after / a random "
        "control of the same bank fraction",
    )
    p.add_argument(
        "--pipeline-run",
        metavar="PIPELINE_RUN",
        help="with --block-documents: the pipeline run the bank trained on (default: the run's "
        "shards' parent)",
    )
    p.add_argument(
        "--min-share",
        type=float,
        help="with --block-documents: only blocks whose training tokens are at least this share "
        "the owner's, in [0, 1] (default 0: every block the documents trained)",
    )
    p.add_argument(
        "--allow-missing",
        action="store_true",
        help="with --block-documents: go on when some ids are not in the pipeline run",
    )
    p.add_argument(
        "--owner-field",
        metavar="FIELD",
        help="with --block-documents: the held-out records' field naming whose page it is (e.g. "
        "source, entity): the owner's pages take a value the owner's documents have "
        "(ingest.keep_fields)",
    )
    p.add_argument(
        "--fallback",
        choices=("zeros", "generic"),
        help="with --block-domains / --block-documents: what a blocked block reads as in these "
        "experiments (zeros: no memory; generic: the generic memory; default: the bank's policy)",
    )
    add_gate(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="report directory (default RUN/eval)")
    p.set_defaults(func=_eval)


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "sweep",
        help="train and evaluate every setting of a sweep YAML (memory location / size, App. F, "
        "Fig. 3)",
        description="Expand SWEEP.yaml (eval/yamls/sweep-*.yaml) into training runs, train each "
        "(finished runs are skipped), score them with anchor-only / generic / fetched memory and "
        "write OUT/results.json, OUT/report.md and OUT/sweep.png.",
    )
    s.add_argument("sweep", help="sweep YAML (eval/yamls/sweep-location.yaml, sweep-size.yaml)")
    add_overrides(s, "out=… eval.max_probes=64", what="sweep key=value overrides")
    s.add_argument(
        "--train",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="training override for every run (repeatable), applied last",
    )
    s.add_argument("--out", help="output folder (the sweep's `out`; same as out=PATH)")
    s.set_defaults(func=_sweep)


def _add_retention(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "retention",
        help="continue a memory run's anchor on other subtrees with the bank frozen; measure "
        "forgetting",
        description="From a run with a bank, continue training the anchor on a subset of level-1 "
        "subtrees with the bank frozen, then score the long-tail probes before and after "
        "(anchor-only / generic / fetched, revisited vs not-revisited subtrees, per frequency "
        "bucket). Writes OUT/results.json, OUT/report.md and OUT/retention.png.",
    )
    add_config(r, "eval/yamls/retention.yaml; optional")
    add_overrides(r, "run=… facts=… steps=…")
    r.add_argument("--out", help="output folder (the retention config's `out`; same as out=PATH)")
    r.set_defaults(func=_retention)


def _add_tasks(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "tasks",
        help="score a run on a suite of LLM-Foundry-style JSONL tasks (Table 1's layout)",
        description="Score every task of SUITE.yaml (eval/yamls/suite-example.yaml) anchor-only "
        "and, when the run has a bank, with generic and fetched memory; report each task and the "
        "common- / specific-knowledge group averages. Writes OUT/results.json, OUT/report.md, "
        "OUT/suite.png.",
    )
    t.add_argument(
        "suite",
        help="suite YAML (eval/yamls/suite-example.yaml); its task paths are relative to it",
    )
    t.add_argument("run", help="a training run's save_folder")
    t.add_argument(
        "--tree", help="clustering tree directory (default: tree/ beside the run's shards)"
    )
    add_gate(t)
    t.add_argument("--out", help="report directory (default RUN/eval-tasks)")
    t.set_defaults(func=_tasks)


def _add_demo(cli: Commands) -> None:
    d = cli.command(
        "demo",
        help="the main job (what `make demo` runs): pipeline → anchor → memory co-training → "
        "evaluation",
        description="On the embedded default corpus: clustering pipeline, anchor pretraining, "
        "co-training with hierarchical memories, then the long-tail probes, and memory blocking. "
        "Reruns resume. Prints the report path.",
    )
    d.add_argument("--root", default="runs/demo", help="run directory (default runs/demo)")
    d.add_argument(
        "--seed", type=int, default=0, help="corpus, training and probe seed (default 0)"
    )
    d.add_argument(
        "--corpus",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="pipeline.corpus.bios.BiosSpec field (repeatable), e.g. --corpus "
        "entities_per_subtopic=4",
    )
    d.add_argument(
        "--anchor-duration", default="2ep", help="anchor pretraining (Composer time, default 2ep)"
    )
    d.add_argument(
        "--cotrain-duration", default="5ep", help="co-training (Composer time, default 5ep)"
    )
    d.add_argument(
        "--memory-mode",
        choices=("cotrain", "frozen"),
        default=None,
        help="the memory stage: co-train the anchor with the memories (default), or train the "
        "memories alone on the frozen anchor (seed 002's row A3; with --anchor-duration 7ep, "
        "a converged anchor); frozen with --anchor",
    )
    d.add_argument(
        "--anchor",
        metavar="NAME",
        choices=sorted(PRETRAINED),
        help="seed 002's Table 2: a pretrained model ("
        + ", ".join(sorted(PRETRAINED))
        + ") is the "
        "frozen anchor: the pipeline tokenises with its tokenizer, there is no anchor stage "
        "(--anchor-duration unused), and the memories train alone on it for --cotrain-duration, "
        "sized by --train memory.multipliers=[…] (default: what 24 GB of memory trains, [0,48,80] "
        "for smollm2-135m, fetched 4.9 %% of the anchor; Table 2's ≈ 10 %% is [0,96,160], see "
        "`memtree memstore plan --anchor smollm2-135m --memory 0,96,160 --branching 4`)",
    )
    d.add_argument(
        "--max-probes", type=nonneg, default=0, help="probes to evaluate, evenly spread (0 = all)"
    )
    d.add_argument(
        "--target-domain", help="blocking target (default: the first domain in sorted order)"
    )
    d.add_argument("--no-rag", action="store_true", help="skip the RAG rows")
    d.add_argument(
        "--gate",
        type=gate_spec,
        metavar="LEVEL:QUANTILE",
        help="add the probes' gated row: fetched memory only for questions as close to their "
        "cluster as the QUANTILE of the training windows (e.g. leaf:0.01; memtree eval tasks "
        "--help says more)",
    )
    d.add_argument(
        "--train",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="training override for both stages (repeatable), e.g. --train data.batch_size=4",
    )
    add_overrides(d, "tree.levels=3", what="pipeline key=value overrides")
    d.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from memtree.eval.demo import run_main_job

    corpus = OmegaConf.to_container(OmegaConf.from_dotlist(args.corpus))
    report = run_main_job(
        args.root,
        corpus=corpus,
        pipeline_overrides=args.overrides,
        train_overrides=args.train,
        anchor_duration=args.anchor_duration,
        cotrain_duration=args.cotrain_duration,
        max_probes=args.max_probes,
        target_domain=args.target_domain,
        rag=not args.no_rag,
        seed=args.seed,
        memory_mode=args.memory_mode,
        anchor=args.anchor,
        gate=args.gate,
    )
    print(Path(report).read_text())
    print(f"Demo finished. Report: {Path(report).resolve()}")
    return 0


def _block_level(rm, args: argparse.Namespace) -> int | None:
    """--block-level checked against the bank before anything slow runs; default: the shallowest
    level that holds memory."""
    if not args.block_domains:
        if args.block_level is not None:
            raise ValueError(
                "--block-level applies to --block-domains only (nothing is blocked without it)"
            )
        return None
    if not rm.has_memory:
        raise ValueError(f"--block-domains: {args.run} has no memory bank to block")
    levels = sorted(rm.store.levels)
    if args.block_level is None:
        return levels[0]
    if args.block_level not in levels:
        raise ValueError(
            f"--block-level {args.block_level}: the bank {rm.store.root} holds memory at level(s) "
            f"{levels} only; pass --block-level {levels[0]}"
            + (f" (or {', '.join(map(str, levels[1:]))})" if len(levels) > 1 else "")
        )
    return args.block_level


def _owner_args(args: argparse.Namespace) -> list[str] | None:
    """--block-documents' ids, read and checked before anything slow runs (None: not asked)."""
    if not args.block_documents:
        for flag, val in (
            ("--pipeline-run", args.pipeline_run),
            ("--min-share", args.min_share),
            ("--owner-field", args.owner_field),
            ("--allow-missing", args.allow_missing or None),
        ):
            if val is not None:
                raise ValueError(f"{flag} applies to --block-documents only")
        return None
    from memtree.memstore.cli_common import read_document_ids
    from memtree.memstore.ownership import check_min_share

    if args.min_share is not None:
        check_min_share(args.min_share)
    return read_document_ids(args.block_documents, flag="--block-documents")


def _eval(args: argparse.Namespace) -> int:
    from memtree.eval.knowledge import blocking_eval, knowledge_eval, load_eval_inputs, write_report
    from memtree.eval.model import RunModel
    from memtree.eval.runinfo import (
        bank_state,
        demo_root,
        run_pretrained,
        run_tpp_table,
        trained_epochs,
    )

    rm = RunModel.load(args.run, tree_dir=args.tree)
    apply_gate(rm, args)
    level = _block_level(rm, args)  # fail fast: before the probes are scored
    owner_ids = _owner_args(args)
    if args.fallback and not (args.block_domains or owner_ids is not None):
        raise ValueError(
            "--fallback applies to --block-domains or --block-documents (nothing is blocked "
            "without one)"
        )
    if owner_ids is not None and not rm.has_memory:
        raise ValueError(f"--block-documents: {args.run} has no memory bank to block")
    root = demo_root(rm.config)
    if args.facts:
        facts = need_file(args.facts, "--facts")
    elif (root / "facts.jsonl").is_file():
        facts = root / "facts.jsonl"
        note("eval knowledge", f"facts: {facts} (beside the run's pipeline run; --facts to choose)")
    elif owner_ids is not None and args.held_out and not args.block_domains:
        facts = None  # real text: the owner's held-out pages against the others' only
        note("eval knowledge", "no facts (--facts): scoring held-out pages only")
    else:
        raise ValueError(
            "--facts: not given, and there is no facts.jsonl beside the run's pipeline run "
            f"({root})"
        )
    held = need_file(args.held_out, "--held-out") if args.held_out else None
    if held is None and (root / "heldout.jsonl").is_file():
        held = root / "heldout.jsonl"
        note(
            "eval knowledge",
            f"held-out documents: {held} (beside the run's pipeline run; --held-out to choose)",
        )
    elif held is None:
        note(
            "eval knowledge",
            "no held-out documents (--held-out FILE.jsonl): the perplexity column stays empty",
        )
    if owner_ids is not None and held is not None and not args.owner_field:
        note(
            "eval knowledge",
            "--owner-field not given: the owner's held-out pages are not told apart (facts only)",
        )
    epochs, how = (args.epochs, "--epochs") if args.epochs is not None else trained_epochs(args.run)
    if epochs is None:
        note(
            "eval knowledge",
            f"epochs: 1 (--epochs not given and the run's epochs cannot be counted: {how})",
        )
        epochs, how = 1.0, "default (not countable from the run)"
    else:
        note("eval knowledge", f"epochs: {epochs:g} ({how}; exposures = mentions × epochs)")
    probes, held_out = (
        ([], [])
        if facts is None
        else load_eval_inputs(
            facts, held_out=held, max_probes=args.max_probes, seed=args.seed, epochs=epochs
        )
    )
    if facts is None:
        from memtree.io import iter_jsonl

        held_out = [rec for _, rec in iter_jsonl(held)]
    plan = None
    if owner_ids is not None:  # every refusal before the slow part
        from memtree.eval.forgetting import plan_forgetting

        if args.owner_field and not held_out:
            raise ValueError(
                "--owner-field: there are no held-out pages to tell apart (--held-out FILE.jsonl)"
            )
        run = (
            need_file(args.pipeline_run, "--pipeline-run")
            if args.pipeline_run
            else Path(rm.config.data.shards).parent
        )
        plan = plan_forgetting(
            rm,
            run=run,
            ids=owner_ids,
            documents=args.block_documents,
            name=Path(args.block_documents).name,
            min_share=args.min_share or 0.0,
            seed=args.seed,
            allow_missing=args.allow_missing,
            owner_field=args.owner_field,
            log=lambda m: note("eval knowledge", m),
        )
        if probes and facts:
            from memtree.eval.forgetting import fact_statements, owner_probe_count
            from memtree.eval.longtail import load_facts

            listed = load_facts(facts)
            # counted once: forgetting_eval reads them from the plan instead of scanning the corpus
            # again
            plan = {**plan, "_statements": fact_statements(listed, run, owner_ids)}
            if owner_probe_count(probes, listed, plan["_statements"]) == 0:
                why = (
                    f"none of the {len(probes)} probes evaluated asks a fact only the owner's "
                    "documents state"
                    + (
                        f" (--max-probes {args.max_probes} keeps an evenly spread subset; 0 scores "
                        "all)"
                        if args.max_probes
                        else ""
                    )
                )
                if not (args.owner_field and held_out):
                    raise ValueError(f"--block-documents: {why}")
                note(
                    "eval knowledge",
                    f"--block-documents: {why}; the held-out pages still measure the owner",
                )
    targets = args.block_domains.split(",") if args.block_domains else []
    if targets:  # checked before the slow part: a typo, or no evaluated probe to block for
        from memtree.eval.longtail import load_facts

        domains = sorted({str(f.get("domain")) for f in load_facts(facts)})
        unknown = sorted(set(targets) - set(domains))
        if unknown:
            raise ValueError(f"--block-domains: {unknown} are not domains of {facts} ({domains})")
        if not any(p.get("domain") in targets for p in probes):
            raise ValueError(
                f"--block-domains: none of the {len(probes)} probes evaluated belongs to {targets} "
                "(--max-probes keeps an evenly spread subset)"
            )
    rag = None
    if args.rag is not None:
        from memtree.eval.rag import RagIndex

        rag = RagIndex.open(
            need_file(args.rag, "--rag") if args.rag else Path(rm.config.data.shards).parent
        )
    knowledge = knowledge_eval(rm, probes, held_out, rag=rag) if probes else None
    blocking = None
    if targets:
        blocking = blocking_eval(
            rm,
            probes,
            target_domains=targets,
            seed=args.seed,
            level=level,
            fraction=rm.store.info.memory.branching**-level,
            fallback=args.fallback,
        )
    forgetting = []
    if plan is not None:
        from memtree.eval.forgetting import forgetting_eval
        from memtree.eval.longtail import load_facts

        given = (
            {m: knowledge["modes"][m]["predictions"] for m in ("fetched", "generic")}
            if knowledge
            else None
        )
        forgetting.append(
            forgetting_eval(
                rm,
                plan,
                probes=probes,
                facts=load_facts(facts) if facts else (),
                held_out=held_out if args.owner_field else (),
                predictions=given,
                paths=knowledge.get("paths") if knowledge else None,
                fallback=args.fallback,
                log=lambda m: note("eval knowledge", m),
            )
        )
    out = Path(args.out) if args.out else Path(args.run) / "eval"
    meta = {
        "run": str(Path(args.run).resolve()),
        "facts": str(facts) if facts else None,
        "held_out": str(held) if held else None,
        "epochs": epochs,
        "epochs_from": how,
        "probes": len(probes),
    }
    files = write_report(
        out,
        knowledge=knowledge,
        blocking=blocking,
        meta=meta,
        bank=bank_state(rm.store.root) if rm.has_memory else None,
        tpp=run_tpp_table(args.run),
        forgetting=forgetting,
        pretrained=run_pretrained(args.run),
    )
    print(Path(files["markdown"]).read_text())
    print(f"report: {Path(files['markdown']).resolve()}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from memtree.eval.sweeps import load_sweep_config, run_sweep

    # eval.* paths resolve against the sweep YAML (missing ones named by key there)
    cfg = load_sweep_config(
        config_file(args.sweep, "SWEEP"), [*args.overrides, *out_override(args)], require_paths=True
    )
    result = run_sweep(cfg, train_overrides=args.train)
    print(Path(result["files"]["markdown"]).read_text(encoding="utf-8"))
    print(f"report: {result['files']['markdown']}")
    return 0


def _retention(args: argparse.Namespace) -> int:
    from memtree.eval.retention import load_retention_config, run_retention

    config, overrides = config_and_overrides(args)
    cfg = load_retention_config(
        config_file(config, "CONFIG"),
        [*overrides, *out_override(argparse.Namespace(overrides=overrides, out=args.out))],
    )
    where = f"(in {config} or its overrides)" if config else "(override)"
    need_file(Path(cfg.run) / "memtree_config.json", f"run={cfg.run} {where}: a training run needs")
    for key in ("facts", "held_out", "tree"):
        if getattr(cfg, key):
            need_file(getattr(cfg, key), f"{key} {where}:")
    result = run_retention(cfg)
    print(Path(result["files"]["markdown"]).read_text(encoding="utf-8"))
    print(f"report: {result['files']['markdown']}")
    return 0


def _tasks(args: argparse.Namespace) -> int:
    from memtree.eval.model import RunModel
    from memtree.eval.suite import load_suite_config, run_suite, write_suite_report

    cfg = load_suite_config(need_file(args.suite, "SUITE"))  # task paths resolve against the YAML
    rm = RunModel.load(args.run, tree_dir=args.tree)
    apply_gate(rm, args)
    result = run_suite(rm, cfg)
    out = Path(args.out) if args.out else Path(args.run) / "eval-tasks"
    files = write_suite_report(
        out, result, meta={"run": str(Path(args.run).resolve()), "suite": args.suite}
    )
    print(Path(files["markdown"]).read_text(encoding="utf-8"))
    print(f"report: {Path(files['markdown']).resolve()}")
    return 0


def _add_memories(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser(
        "memories",
        help="every memory family beside dense models on the demo's knowledge probes",
        description="On a `memtree demo` root: reuses the demo's runs (anchor only, + generic, + "
        "fetched hierarchical memory, RAG, RAG + fetched) and trains, on the same shards, seed and "
        "budget, dense models (the anchor's shape; >= 2x its parameters; anchor + fetched memory's "
        "runtime parameters), Mixture of Chapters and a product-key memory at the fetched memory's "
        "active parameters; scores every row on the same probes with paired 95 % intervals against "
        "the fetched row. Writes OUT/results.json, OUT/report.md, OUT/accuracy_vs_exposure.png "
        "(default OUT: ROOT/memories). Grid: eval/yamls/memories.yaml.",
    )
    m.add_argument(
        "root", help="a `memtree demo` root: facts.jsonl, heldout.jsonl, pipeline/, train/cotrain"
    )
    add_overrides(
        m,
        "max_probes=… 'train=[max_duration=10ba]'",
        what="eval.memories.MemoriesConfig key=value overrides",
    )
    m.add_argument(
        "--rows",
        help="comma-separated row names to run (default: every row of the grid; the "
        "reference row is always scored)",
    )
    m.add_argument("--config", help="YAML with the grid (default eval/yamls/memories.yaml)")
    m.add_argument("--out", help="report folder (default ROOT/memories)")
    m.set_defaults(func=_memories)


def _memories(args: argparse.Namespace) -> int:
    from memtree.eval.memories import load_memories_config, run_memories

    check_demo_root(args.root, "eval memories", ("facts.jsonl", "pipeline/shards", "train/cotrain"))
    rows = [r.strip() for r in (args.rows or "").split(",") if r.strip()]
    cfg = load_memories_config(
        config_file(args.config, "--config"),
        [
            f"root={args.root}",
            *args.overrides,
            *([f"select=[{','.join(rows)}]"] if rows else []),
            *out_override(args),
        ],
    )
    print(Path(run_memories(cfg)).read_text(encoding="utf-8"))
    return 0


def _add_realtext(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser(
        "realtext",
        help="held-out perplexity of anchor / generic / fetched memory and dense-1x on real text",
        description="On a real-text pipeline run: trains an anchor, one co-training run per recipe "
        "from it and dense-1x (the anchor's shape for both stages' duration), then scores "
        "ROOT/corpus/test.jsonl cut into windows, each routed by its own text, with no memory, "
        "generic and fetched blocks. The default config, eval/yamls/realtext.yaml, is the "
        "real-text recipe in the order measured (ROOT runs/realdocs: `memtree pipeline docs-corpus "
        "runs/realdocs/corpus --package python3.11-doc --package linux-doc-6.1 --max-chars 10000 "
        "--test-fraction 0.16` then `memtree pipeline run pipeline/yamls/realdocs.yaml`). Other "
        "configs: eval/yamls/realtext-pydocs.yaml (the bank-LR grid on Python's documentation "
        "pages, ROOT runs/pydocs-short), eval/yamls/realtext-tpp.yaml (bank sizes), "
        "eval/yamls/realtext-pretrained.yaml (seed 002 Table 2 on a frozen SmolLM2). Writes "
        "OUT/results.json, OUT/report.md, OUT/perplexity.png (default OUT: ROOT/realtext).",
    )
    m.add_argument(
        "root",
        nargs="?",
        help="holds pipeline/ (shards, tree) and corpus/test.jsonl (default: the config's root, "
        "runs/realdocs in eval/yamls/realtext.yaml)",
    )
    add_overrides(
        m,
        "cotrain_duration=3ep held_out=… 'train=[…]'",
        what="eval.realtext.RealTextConfig key=value overrides",
    )
    m.add_argument(
        "--recipes",
        help="comma-separated recipe names to run (default: every recipe of the config)",
    )
    m.add_argument(
        "--config",
        help="YAML with the recipes (default eval/yamls/realtext.yaml, the real-text recipe)",
    )
    m.add_argument("--out", help="report folder (default ROOT/realtext)")
    m.set_defaults(func=_realtext)


def _realtext(args: argparse.Namespace) -> int:
    from memtree.eval.realtext import load_realtext_config, run_realtext

    picked = [r.strip() for r in (args.recipes or "").split(",") if r.strip()]
    cfg = load_realtext_config(
        config_file(args.config, "--config"),
        [
            *([f"root={args.root}"] if args.root else []),
            *args.overrides,
            *([f"select=[{','.join(picked)}]"] if picked else []),
            *out_override(args),
        ],
    )
    print(Path(run_realtext(cfg)).read_text(encoding="utf-8"))
    return 0
