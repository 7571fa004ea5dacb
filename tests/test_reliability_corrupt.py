"""Corrupt inputs are found before training on them (issue 19): one flipped byte in a shard (the
stored .mds.zstd or the decompressed .mds Streaming leaves next to it), in a tree array file or in
a memory bank is reported with the file's path before any step runs.

All on real files: each test corrupts its own copy of a small real pipeline run."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from memtree.training.data import ShardError, verify_shards


@pytest.fixture(autouse=True)
def _clean_streaming_shm():
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    yield
    clean_stale_shared_memory()


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, dask_client) -> Path:
    """A real pipeline run up to the shards on 160 documents (2 × 4 tree, 256-token samples, several
    shards per stream); the torch embedder, which needs no int8 export (the slow part here)."""
    from memtree.config import load_config
    from memtree.pipeline.config import PipelineConfig
    from memtree.pipeline.corpus.topical import CorpusSpec, generate_corpus
    from memtree.pipeline.run import run_pipeline
    from tests.conftest import PIPELINE_OVERRIDES, write_jsonl

    records = list(generate_corpus(CorpusSpec(n_docs=160, seed=3, long_doc_fraction=0.01)))
    corpus = write_jsonl(tmp_path_factory.mktemp("corpus") / "c.jsonl", records)
    out = tmp_path_factory.mktemp("runs") / "small"
    cfg = load_config(
        PipelineConfig,
        {"out": str(out), "ingest": {"inputs": [str(corpus)]}},
        PIPELINE_OVERRIDES
        + [
            "tree.branching=4",
            "window.train_sample_docs=160",
            "pack.seq_len=256",
            "pack.size_limit=32kb",
            "embed.backend=torch",
            "embed.batch_size=32",
        ],
    )
    run_pipeline(cfg, until="shards", client=dask_client, log=lambda m: None)
    return out


@pytest.fixture
def run_copy(small_run, tmp_path) -> Path:
    """A copy of the run's shards, tokenizer (the manifest points to ../tokenizer) and tree."""
    out = tmp_path / "run"
    for part in ("shards", "tokenizer", "tree"):
        shutil.copytree(small_run / part, out / part)
    return out


def flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def decompress_first_run(stream: Path) -> list[Path]:
    """What a first training run leaves: iterate a StreamingDataset over the stream once, so
    Streaming extracts each shard.NNNNN.mds next to its .mds.zstd."""
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    ds = StreamingDataset(local=str(stream), batch_size=1, shuffle=False)
    assert sum(1 for _ in ds) == ds.num_samples
    del ds
    clean_stale_shared_memory()
    raw = sorted(stream.glob("shard.*.mds"))
    assert raw and all(p.with_name(p.name + ".zstd").is_file() for p in raw)
    return raw


def _cfg(shards: Path, folder: Path, *extra: str):
    from memtree.training.config import load_train_config

    shape = "model.shape={n_layers: 1, d_model: 32, n_heads: 2, head_dim: 16, ffn_dim: 64}"
    return load_train_config(
        None,
        [
            f"data.shards={shards}",
            f"save_folder={folder}",
            "data.batch_size=4",
            "optim.warmup=1ba",
            "max_duration=2ba",
            shape,
            *extra,
        ],
    )


def test_flipped_byte_in_compressed_shards_names_every_file(run_copy):
    shards = run_copy / "shards"
    stats = verify_shards(shards)  # a clean copy passes, hashed with the fastest recorded hash
    zipped = list(shards.glob("subtree-*/*.mds.zstd"))
    assert (
        stats["streams"] >= 2 and stats["files"] == len(zipped) and stats["algorithms"] == ["xxh64"]
    )
    assert stats["bytes"] == sum(p.stat().st_size for p in zipped) and not stats["unverified"]
    bad = [min((shards / name).glob("*.mds.zstd")) for name in ("subtree-000", "subtree-001")]
    for p in bad:
        flip(p)
    with pytest.raises(ShardError) as e:
        verify_shards(shards)
    msg = str(e.value)
    assert "2 problem(s)" in msg
    for p in bad:  # all bad files, each with its full path, not just the first
        assert f"{p.resolve()}: compressed shard has xxh64 " in msg
    assert "its index records" in msg and "re-run the `memtree pipeline` command" in msg
    # the subtree filter reads what build_dataloader reads: subtree 2's stream is intact
    verify_shards(shards, subtrees=[2])
    with pytest.raises(ShardError, match="subtree-001"):
        verify_shards(shards, subtrees=[1, 2])


def test_index_without_hashes_or_unreadable(run_copy):
    import json

    shards = run_copy / "shards"
    index_path = shards / "subtree-002" / "index.json"
    index = json.loads(index_path.read_text())
    for sh in index["shards"]:  # as `pack.hashes: []` writes it
        for part in ("raw_data", "zip_data"):
            sh[part]["hashes"] = {}
    index_path.write_text(json.dumps(index))
    with pytest.warns(UserWarning, match="only their sizes were checked"):
        stats = verify_shards(shards)
    assert stats["unverified"] and all("subtree-002" in p for p in stats["unverified"])
    with pytest.raises(ShardError, match="no hash in their MDS index"):
        verify_shards(shards, require_hashes=True)
    index["shards"][0]["samples"] += (
        1  # a digit changed in the index: it disagrees with manifest.json
    )
    index_path.write_text(json.dumps(index))
    with pytest.raises(ShardError, match=re.escape(f"{index_path.resolve()}: lists shards")):
        verify_shards(shards)
    index_path.write_text(index_path.read_text()[:-2])
    with pytest.raises(
        ShardError, match=re.escape(f"{index_path.resolve()}: unreadable MDS index")
    ):
        verify_shards(shards)


def test_flipped_byte_in_decompressed_shard_is_named(run_copy):
    shards = run_copy / "shards"
    stream = shards / "subtree-000"
    raw = decompress_first_run(stream)
    stats = verify_shards(shards)  # the compressed files and the extracted copy
    assert stats["files"] == len(list(shards.glob("subtree-*/*.mds.zstd"))) + len(raw)
    flip(raw[0])
    with pytest.raises(ShardError) as e:
        verify_shards(shards)
    msg = str(e.value)
    assert f"{raw[0].resolve()}: decompressed shard has xxh64 " in msg and "1 problem(s)" in msg
    assert f"delete this decompressed copy; Streaming re-extracts it from {raw[0].name}.zstd" in msg
    # a truncated copy: the size is reported
    raw[0].write_bytes(raw[0].read_bytes()[:-3])
    with pytest.raises(ShardError, match=r"decompressed shard is \d+ bytes, its index records \d+"):
        verify_shards(shards)
    raw[0].unlink()  # the advice works: Streaming extracts it again, and it verifies
    decompress_first_run(stream)
    verify_shards(shards)
    # a shard with neither file
    for p in stream.glob("shard.00000.mds*"):
        p.unlink()
    with pytest.raises(ShardError, match="shard.00000.mds.zstd or .*shard.00000.mds: missing"):
        verify_shards(shards)


def test_training_refuses_before_any_step(run_copy, tmp_path):
    from composer.core import Callback

    from memtree.training.train import build_trainer, train

    class Steps(Callback):
        n = 0

        def batch_end(self, state, logger) -> None:
            Steps.n += 1

    shards = run_copy / "shards"
    raw = decompress_first_run(shards / "subtree-001")
    # the case: Streaming reads this copy from now on, and trained on it silently
    flip(raw[0])
    with pytest.raises(ShardError, match=re.escape(f"{raw[0].resolve()}: decompressed shard")):
        train(_cfg(shards, tmp_path / "a"), callbacks=[Steps()])
    assert Steps.n == 0
    # a per-subtree job reads only its stream; the check follows the same selection
    trainer = build_trainer(_cfg(shards, tmp_path / "b", "data.subtrees=[0]"))
    trainer.close()
    # the check can be turned off (and is not part of the run's fingerprint)
    off = _cfg(shards, tmp_path / "c", "data.verify_shards=false")
    assert off.fingerprint() == _cfg(shards, tmp_path / "c").fingerprint()
    trainer = build_trainer(off)
    trainer.close()


def test_flipped_byte_in_tree_array_is_named(run_copy):
    from memtree.clustering.tree import load_tree

    tree = load_tree(run_copy / "tree")
    f = run_copy / "tree" / "centroids-l1.npy"
    flip(f, at=f.stat().st_size - 1)  # in the data, past the npy header
    with pytest.raises(ValueError) as e:
        load_tree(run_copy / "tree")
    msg = str(e.value)
    assert msg.startswith(f"{f}: checksum mismatch")
    assert f"records {tree.meta['files']['centroids-l1.npy']}" in msg and "sha256 " in msg


def test_flipped_byte_in_starting_bank_is_named_before_any_step(run_copy, tmp_path):
    """memory.init_bank is read whole through memstore, which checks each block's digest."""
    from memtree.memstore.format import BankError, level_path, read_manifest
    from memtree.training.train import build_model, build_trainer

    shards = run_copy / "shards"
    extra = ("mode=scratch", "memory.multipliers=[4,2]", "memory.read=gather")
    model, manifest = build_model(_cfg(shards, tmp_path / "x", *extra))
    bank = tmp_path / "bank"
    model.bank.export(bank, dtype="fp32", tree_id=manifest["tree_id"])
    trainer = build_trainer(_cfg(shards, tmp_path / "ok", *extra, f"memory.init_bank={bank}"))
    trainer.close()
    level = level_path(bank, read_manifest(bank).level(2))
    flip(Path(level), at=100)
    with pytest.raises(
        BankError, match=f"checksum mismatch: level 2, cluster .* in {re.escape(level)}"
    ):
        build_trainer(_cfg(shards, tmp_path / "bad", *extra, f"memory.init_bank={bank}"))
