"""The pipeline-only demo (`memtree pipeline demo`): the default corpus through the pipeline, no
training.

Writes the entity-centric default corpus (`pipeline.corpus.bios`: corpus.jsonl, facts.jsonl,
heldout.jsonl, corpus.json) under the run root unless it is there, then runs the pipeline with
`pipeline/yamls/demo.yaml`. The main job, `memtree demo` (`eval/demo.py`, what `make demo` runs),
calls this first and then trains and evaluates in the same run directory.
"""

from __future__ import annotations

from pathlib import Path

from memtree.config import load_config
from memtree.io import read_json
from memtree.pipeline.config import PipelineConfig
from memtree.pipeline.corpus.bios import BiosSpec, write_bios
from memtree.pipeline.run import run_pipeline

DEMO_YAML = Path(__file__).with_name("yamls") / "demo.yaml"


def run_demo(
    root: str | Path = "runs/demo", *, spec: BiosSpec | None = None, overrides: list[str] = ()
) -> Path:
    """Write the corpus (if absent) and run the demo pipeline under `root`; returns the report path.

    A root that already holds a corpus of another spec is refused: its pipeline stages and
    training runs belong to that corpus."""
    root = Path(root)
    spec = spec or BiosSpec()
    if (root / "corpus.json").exists():
        # a field added to BiosSpec later is absent from older records: BiosSpec.stored fills it in
        have, want = BiosSpec.stored(read_json(root / "corpus.json")["spec"]), spec.record()
        if have != want:
            raise ValueError(
                f"{root}: holds a corpus written with {have}, not {want}; use another --root"
            )
    else:
        info = write_bios(root, spec)
        print(
            f"[demo] wrote the default corpus: {info['documents']} documents, "
            f"{info['n_facts']} facts → {root}"
        )
    cfg = load_config(
        PipelineConfig,
        DEMO_YAML,
        [f"out={root / 'pipeline'}", f'ingest.inputs=["{root / "corpus.jsonl"}"]', *overrides],
    )
    run_pipeline(cfg)
    return Path(cfg.out) / "report" / "report.md"
