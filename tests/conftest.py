"""Shared fixtures: a real Dask LocalCluster and small generated corpora."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch.compile's on-disk caches outlive a change to a custom op's schema and then replay
# stale graphs; each test session compiles afresh in its own directory.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="memtree-inductor-"))
# the timed GEMM choice (clustering.blas.remember_choice) is kept per test session, not in the
# user's cache: every pipeline of the session fits on the one choice, as runs on one host do
os.environ["MEMTREE_CACHE_DIR"] = tempfile.mkdtemp(prefix="memtree-cache-")


def _interpret_triton_without_a_gpu() -> None:
    """Run our Triton kernels in the interpreter on a CPU-only machine.

    `@triton.jit` reads TRITON_INTERPRET when a kernel module is imported, and
    training/ imports kernels/ — so it is set here, before any test module
    imports either, or kernels imported early would not run on the CPU."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()

# imported after TRITON_INTERPRET is set, so kernels imported through them run on the CPU
import torch

from memtree.geometry import AnchorShape

HEAVY_TESTS = Path(__file__).with_name("heavy_tests.txt")


def _heavy_test_ids() -> set[str]:
    """The node ids heavy_tests.txt lists (each line: measured seconds, then the id)."""
    ids = set()
    for line in HEAVY_TESTS.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            ids.add(line.split(maxsplit=1)[1].strip())
    return ids


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by `-m`
def pytest_collection_modifyitems(config, items):
    import torch

    # the heavy tests run under `-m slow` (make test-all), not in `make test`: CI's 90 minutes
    # did not hold the whole default suite on a 2-core AVX2 host (heavy_tests.txt says which)
    heavy = _heavy_test_ids()
    collected = set()
    for item in items:  # node ids are relative to the rootdir (the repo), wherever pytest runs
        if item.nodeid in heavy:
            item.add_marker(pytest.mark.slow)
            collected.add(item.nodeid)
    # items are not yet deselected by -k or -m here: a whole-suite run sees every listed test
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        stale = sorted(heavy - collected)
        if stale:
            raise pytest.UsageError(f"{HEAVY_TESTS}: no such test (renamed?): {stale}")

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def dask_client():
    """One real 2-worker process cluster for the whole session (workers keep models loaded)."""
    from memtree.pipeline.config import DaskConfig
    from memtree.pipeline.dask_utils import dask_client as make

    with make(DaskConfig(n_workers=2, threads_per_worker=1)) as client:
        yield client


def write_jsonl(path: Path, records: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    return path


@pytest.fixture(scope="session")
def corpus_records():
    from memtree.pipeline.corpus.topical import CorpusSpec, generate_corpus

    return list(generate_corpus(CorpusSpec(n_docs=1200, seed=3, long_doc_fraction=0.01)))


# Small pipeline settings shared by the end-to-end tests (2 × 8 tree, 512-token samples).
PIPELINE_OVERRIDES = [
    "tree.levels=2",
    "tree.branching=8",
    "tree.batch_size=1024",
    "tree.steps=10",
    "window.window_tokens=256",
    "window.vocab_size=2000",
    "window.train_sample_docs=400",
    "pack.seq_len=512",
    "pack.size_limit=256kb",
    "embed.max_seq_length=64",
    "ingest.partition_docs=100",
    "ingest.keep_fields=[domain,topic]",
    "progress=false",
]


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory, corpus_records, dask_client):
    """One real pipeline run on the 1,200-document corpus: (run dir, stage markers, seconds, corpus
    path)."""

    from memtree.config import load_config
    from memtree.pipeline.config import PipelineConfig
    from memtree.pipeline.run import run_pipeline

    corpus = write_jsonl(tmp_path_factory.mktemp("corpus") / "c.jsonl", corpus_records)
    out = tmp_path_factory.mktemp("runs") / "a"
    cfg = load_config(
        PipelineConfig, {"out": str(out), "ingest": {"inputs": [str(corpus)]}}, PIPELINE_OVERRIDES
    )
    t0 = time.time()
    markers = run_pipeline(cfg, client=dask_client, log=lambda m: None)
    return out, markers, time.time() - t0, corpus


def train_tiny_run(shards: Path, folder: Path, *overrides: str) -> Path:
    """Train a small memory run on `shards` into `folder` (scratch mode, fp32 bank); returns
    `folder`.

    Streaming's shared memory is cleaned before and after, as tests open several datasets."""
    from streaming.base.util import clean_stale_shared_memory

    from memtree.training.config import load_train_config
    from memtree.training.train import train

    clean_stale_shared_memory()
    train(
        load_train_config(
            None,
            [
                f"data.shards={shards}",
                f"save_folder={folder}",
                "mode=scratch",
                "optim.warmup=1ba",
                "memory.export_dtype=fp32",
                *overrides,
            ],
        )
    )
    clean_stale_shared_memory()
    return folder


def kill_when_ready(
    cmd: list[str], ready, *, env: dict[str, str], log: Path, timeout: float
) -> str | None:
    """Start `cmd` in its own session, its output to `log`; SIGKILL its process group once `ready()`
    holds (or at the deadline). None when it was killed while running and ready; else why not,
    with the exit code and the log's tail, so a crash, a run that outpaced the poll and a stall
    are told apart."""
    t0 = time.time()
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        while time.time() < t0 + timeout and proc.poll() is None and not ready():
            time.sleep(0.02)
        alive = proc.poll() is None
        if alive:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if alive and ready():
        return None
    return (
        f"{'killed at the deadline' if alive else f'exited (rc={proc.returncode})'} after "
        f"{time.time() - t0:.0f} s, not ready; log tail:\n{log.read_text(errors='replace')[-3000:]}"
    )


# A tiny grouped-query anchor with head q/k norms and qkv bias: the shape the frozen-model tests
# of CAMELoT (tests/test_camelot.py, tests/test_eval_longctx.py) run on.
TINY_GQA_ANCHOR = AnchorShape(
    name="tiny-gqa",
    n_layers=2,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=48,
    vocab_size=61,
    tied_embeddings=False,
    qk_norm="head",
    norms_per_block=4,
    qkv_bias=True,
)


@pytest.fixture
def one_torch_thread():
    """Tiny ops are dominated by thread hand-off on small CPU boxes: run a module on one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def auto_layout_is_tiles(monkeypatch):
    """Per-token memory_attention calls left at per_token_layout="auto" run the slot tiles,
    though small random lists would resolve to the block-major items: for the modules that
    test the tiles (test_kernels_memory_attention_blocks.py tests the items and the auto rule)."""
    from memtree.kernels.memory_attention import op

    monkeypatch.setattr(op, "AUTO_BLOCKS_SLOTS_PER_K", math.inf)


def cli_on_bank_copy(bank: Path, tmp_path: Path, capsys, names: dict[str, str]):
    """A fresh copy of `bank` at tmp_path/bank; the returned call(*argv) runs `memtree` with
    {bank} and `names` filled into argv and returns (rc, stdout, stderr)."""
    import shutil

    from memtree.cli import main

    shutil.copytree(bank, tmp_path / "bank")
    names = {"bank": str(tmp_path / "bank"), **names}
    capsys.readouterr()

    def call(*argv: str) -> tuple[int, str, str]:
        rc = main([a.format(**names) for a in argv])
        out = capsys.readouterr()
        return rc, out.out, out.err

    call.bank = tmp_path / "bank"
    call.names = names
    call.err = lambda: capsys.readouterr().err  # what a call that raised SystemExit printed
    return call
