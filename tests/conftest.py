"""Shared fixtures: a real Dask LocalCluster and small generated corpora."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def dask_client():
    """One real 2-worker process cluster for the whole session (workers keep models loaded)."""
    from pipeline.config import DaskConfig
    from pipeline.dask_utils import dask_client as make

    with make(DaskConfig(n_workers=2, threads_per_worker=1)) as client:
        yield client


def write_jsonl(path: Path, records: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus_records():
    from pipeline.corpus import CorpusSpec, generate_corpus

    return list(generate_corpus(CorpusSpec(n_docs=1200, seed=3, long_doc_fraction=0.01)))
