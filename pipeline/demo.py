"""The main job on the embedded default corpus (`memtree demo`, `make demo`).

Writes the deterministic synthetic corpus (pipeline.corpus) and runs the
pipeline with `pipeline/demo.yaml`. Later stages of memtree (training,
evaluation) extend the same run directory.
"""

from __future__ import annotations

from pathlib import Path

from memtree.config import load_config
from pipeline.config import PipelineConfig
from pipeline.corpus import CorpusSpec, write_corpus_jsonl
from pipeline.run import run_pipeline

DEMO_YAML = Path(__file__).with_name("demo.yaml")


def run_demo(root: str | Path = "runs/demo", *, n_docs: int = 4000, overrides: list[str] = ()) -> Path:
    """Run the demo pipeline under `root`; returns the report path."""
    root = Path(root)
    corpus = root / "corpus.jsonl"
    if not corpus.exists():
        n = write_corpus_jsonl(corpus, CorpusSpec(n_docs=n_docs))
        print(f"[demo] wrote the default corpus: {n} documents → {corpus}")
    cfg = load_config(
        PipelineConfig, DEMO_YAML,
        [f"out={root / 'pipeline'}", f'ingest.inputs=["{corpus}"]', *overrides],
    )
    run_pipeline(cfg)
    return Path(cfg.out) / "report" / "report.md"
