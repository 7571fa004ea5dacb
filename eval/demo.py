"""The main job (`memtree demo`, `make demo`): pipeline → anchor pretraining → memory co-training → evaluation.

On the embedded default corpus: the clustering pipeline (pipeline/demo.yaml),
then an anchor-only run, then co-training that anchor with hierarchical FFN
memories (generic memory with probability 1/branching), then the long-tail
knowledge probes (anchor-only / generic / fetched, accuracy per frequency
bucket), held-out perplexity and the blocking experiment. Every stage resumes:
a finished training run (its exported anchor / bank) is not trained again.

This module sits at the top of the import graph because it drives every stage.
"""

from __future__ import annotations

import time
from pathlib import Path

from memtree.io import read_json

DEMO_TRAIN_YAML = Path(__file__).with_name("demo.yaml")


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def run_main_job(root: str | Path = "runs/demo", *, n_docs: int = 4000, pipeline_overrides: list[str] = (),
                 train_overrides: list[str] = (), anchor_steps: int = 150, cotrain_steps: int = 150,
                 max_probes: int = 0) -> Path:
    """Run (or resume) the whole demo under `root`; returns the evaluation report path."""
    from eval.experiments import blocking_eval, knowledge_eval, write_report
    from eval.longtail import build_probes, load_facts
    from eval.model import RunModel
    from eval.rag import RagIndex, routing_agreement
    from pipeline.corpus import CorpusSpec, write_facts_jsonl
    from pipeline.demo import run_demo
    from training.config import load_train_config
    from training.train import train

    root = Path(root)
    t0 = time.time()
    timings: dict[str, float] = {}
    run_demo(root, n_docs=n_docs, overrides=list(pipeline_overrides))
    timings["pipeline_s"] = time.time() - t0
    facts_path = root / "facts.jsonl"
    if not facts_path.exists():
        write_facts_jsonl(facts_path, CorpusSpec(n_docs=n_docs))
    shards = root / "pipeline" / "shards"

    common = [f"data.shards={shards}", *train_overrides]
    stages = (("anchor", ["mode=baseline", f"save_folder={root / 'train' / 'anchor'}", "run_name=demo-anchor",
                          "memory.multipliers=[]", f"max_duration={anchor_steps}ba"]),
              ("cotrain", ["mode=cotrain", f"save_folder={root / 'train' / 'cotrain'}", "run_name=demo-cotrain",
                           f"anchor_checkpoint={root / 'train' / 'anchor'}", f"max_duration={cotrain_steps}ba"]))
    for name, extra in stages:
        t = time.time()
        cfg = load_train_config(DEMO_TRAIN_YAML, common + extra)
        if (Path(cfg.save_folder) / "metrics.json").exists():
            _log(f"{name}: already trained ({cfg.save_folder}), skipping")
        else:
            _log(f"{name}: training ({cfg.max_duration}, mode {cfg.mode}) → {cfg.save_folder}")
            train(cfg)
        timings[f"{name}_s"] = time.time() - t

    t = time.time()
    rm = RunModel.load(root / "train" / "cotrain", tree_dir=root / "pipeline" / "tree")
    probes = build_probes(load_facts(facts_path), seed=0)
    if max_probes:
        probes = probes[:: max(1, len(probes) // max_probes)][:max_probes]
    _log(f"evaluating {len(probes)} probes × 3 memory settings, then blocking")
    knowledge = knowledge_eval(rm, probes)
    index = RagIndex.open(root / "pipeline")
    knowledge["routing"] = routing_agreement(index.texts(range(len(index.paths))), index.paths, probes,
                                             rm.route([p["context"] for p in probes]))
    domains = sorted({p["domain"] for p in probes})
    blocking = blocking_eval(rm, probes, target_domains=domains[:1])
    timings["eval_s"] = time.time() - t
    timings["total_s"] = time.time() - t0
    metrics = {name: read_json(root / "train" / name / "metrics.json")["train"] for name, _ in stages}
    files = write_report(root / "report", knowledge=knowledge, blocking=blocking,
                         meta={"documents": n_docs, "probes": len(probes), "train_metrics": metrics,
                               **{k: round(v, 1) for k, v in timings.items()}})
    return Path(files["markdown"])

