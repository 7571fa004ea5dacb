"""The int8 OpenVINO embedding backend: local export, reuse, integrity, accuracy, pipeline and
routing."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from memtree.clustering.embed import SEQ_BUCKET, embed_texts, load_embedder
from memtree.clustering.embed_export import OV_INT8_FILE, export_openvino_int8, read_export
from memtree.config import load_config
from memtree.pipeline.config import PipelineConfig
from memtree.pipeline.run import run_pipeline
from tests.conftest import PIPELINE_OVERRIDES, write_jsonl

MSL = 64


@pytest.fixture(scope="module")
def texts(corpus_records):
    return [r["text"] for r in corpus_records[:160]]


@pytest.fixture(scope="module")
def export(tmp_path_factory, texts):
    from memtree.clustering.embed import default_model_path

    root = tmp_path_factory.mktemp("ov")
    out = root / "export"
    meta = export_openvino_int8(
        default_model_path(), out, texts[:48], max_seq_length=MSL, cache_dir=root / "cache"
    )
    assert meta.pop("obtained") == "calibrated"
    return out, meta


def test_export_is_recorded_and_reused(export, texts):
    from memtree.clustering.embed import default_model_path

    out, meta = export
    assert read_export(out)["files"] == meta["files"]
    assert (out / OV_INT8_FILE).is_file() and (out / OV_INT8_FILE).with_suffix(".bin").is_file()
    assert meta["calibration"]["n"] == 48 and meta["calibration"]["max_seq_length"] == MSL
    xml = out / OV_INT8_FILE
    before = xml.stat().st_mtime_ns
    again = export_openvino_int8(default_model_path(), out, texts[:48], max_seq_length=MSL)
    assert again.pop("obtained") == "reused"
    assert again == meta and xml.stat().st_mtime_ns == before  # same key: nothing rebuilt


def test_export_is_copied_from_the_cache_by_another_run(export, texts, tmp_path):
    """Issue 70: a second run over the same corpus sample (another output folder, or the embed
    stage's work folder renamed by a settings change) copies the cached export, not recalibrates."""
    from memtree.clustering.embed import default_model_path
    from memtree.clustering.embed_export import export_key_hash

    out, meta = export
    cache = out.parent / "cache"
    entries = list(cache.iterdir())
    assert [e.name for e in entries] == [
        export_key_hash(
            {
                k: meta[k]
                for k in ("backend", "source_weights_sha256", "quantization", "calibration")
            }
        )
    ]
    stamp = (entries[0] / OV_INT8_FILE).stat().st_mtime_ns
    other = tmp_path / "other-run" / "embedder"
    got = export_openvino_int8(
        default_model_path(), other, texts[:48], max_seq_length=MSL, cache_dir=cache
    )
    assert got.pop("obtained") == "cache"
    assert got["files"] == meta["files"] and read_export(other)["files"] == meta["files"]
    assert (
        entries[0] / OV_INT8_FILE
    ).stat().st_mtime_ns == stamp  # the cache entry itself untouched
    # another calibration sample is another key: not served from this entry
    assert (
        export_key_hash(
            {
                **{k: meta[k] for k in ("backend", "source_weights_sha256", "quantization")},
                "calibration": {**meta["calibration"], "n": 47},
            }
        )
        != entries[0].name
    )


def test_no_progress_silences_nncf(tmp_path, texts, capfd):
    from memtree.clustering.embed import default_model_path

    got = export_openvino_int8(
        default_model_path(), tmp_path / "quiet", texts[:8], max_seq_length=32, progress=False
    )
    assert got["obtained"] == "calibrated"
    out, err = capfd.readouterr()
    assert "nncf" not in (out + err).lower() and "Statistics collection" not in out + err, (
        out + err
    )[-2000:]


def test_int8_embeddings_close_to_torch(export, texts):
    out, _ = export
    held_out = texts[48:]
    ref = embed_texts(load_embedder(None, device="cpu", max_seq_length=MSL), held_out)
    got = embed_texts(
        load_embedder(str(out), max_seq_length=MSL, backend="openvino-int8", threads=1), held_out
    )
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cos = (got * ref).sum(1)
    # README's claim: every document at cosine >= 0.9964 to torch (min of 1,000 synthetic docs at
    # max_seq_length 256, bench/clustering/embed_backends.py). Here, 112 held-out docs at msl 64
    # calibrated on
    # 48: min 0.9978, mean 0.9985 (2026-11-29, x86 CPU). NNCF's default settings, without the
    # chosen smooth-quant alpha and float layer-0 FFN output (clustering/embed_export.py), give min
    # 0.9875 on README's data and fail this.
    # Without VNNI (an AVX2-only AMD EPYC VM, 2026-12-05) OpenVINO's int8 kernels multiply through
    # saturating 16-bit sums: min 0.9940, mean 0.9966 on this test's data; the README's bound is
    # for CPUs with VNNI or AMX (every host it was measured on before).
    assert cos.min() >= (0.9964 if _has_vnni() else 0.990), (cos.mean(), cos.min())


def _has_vnni() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def test_int8_batches_come_in_few_shapes(export, texts):
    """OpenVINO keeps memory per input shape (issue #16): lengths are padded to SEQ_BUCKET
    multiples, so a corpus of any size runs through at most max_seq_length / SEQ_BUCKET lengths, and
    the padding (masked) leaves the vectors as they were to int8 rounding."""
    out, _ = export
    m = load_embedder(str(out), max_seq_length=MSL, backend="openvino-int8", threads=1)
    short = ["a b", "one two three four five six seven"]
    lengths = {m[0].preprocess([t])["input_ids"].shape[1] for t in short + texts[:8]}
    assert lengths <= {SEQ_BUCKET * k for k in range(1, MSL // SEQ_BUCKET + 1)}, lengths
    assert (
        m[0].preprocess(short[:1])["input_ids"].shape[1] == SEQ_BUCKET
    )  # "[CLS] a b [SEP]" padded
    alone = np.stack([embed_texts(m, [t])[0] for t in short])
    together = embed_texts(m, short + texts[:6])[:2]  # padded to MSL beside the long texts
    assert ((alone * together).sum(1) > 0.999).all()
    # more than one batch: the last is filled with empty texts, which do not come back
    seen, encode = [], m.encode
    m.encode = lambda x, **kw: seen.append(len(x)) or encode(x, **kw)
    try:
        many = embed_texts(m, texts[:37], batch_size=8)
    finally:
        del m.encode  # the cached model's own method again
    assert seen == [40] and many.shape == (37, 384)
    assert ((many * embed_texts(m, texts[:37], batch_size=64)).sum(1) > 0.999).all()


def test_damaged_export_is_named(export, tmp_path):
    out, _ = export
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    binf = bad / Path(OV_INT8_FILE).with_suffix(".bin")
    data = bytearray(binf.read_bytes())
    data[len(data) // 2] ^= 0xFF
    binf.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="openvino_model_qint8_quantized.bin: checksum mismatch"):
        read_export(bad)
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_embedder(str(bad), backend="openvino-int8", max_seq_length=MSL)


def test_auto_backend_picks_by_device_and_corpus_size(monkeypatch):
    import memtree.clustering.embed as embedding
    from memtree.clustering.embed import auto_int8_min_windows, resolve_backend

    monkeypatch.setattr(embedding, "AUTO_INT8_BREAK_EVEN", {64: 2000, 256: 1000})
    assert [auto_int8_min_windows(m) for m in (32, 64, 128, 256, 512)] == [
        2000,
        2000,
        round(2000 - 1000 * 64 / 192),
        1000,
        1000,
    ]
    assert resolve_backend("auto", "cpu", 1000) == "openvino-int8"
    assert resolve_backend("auto", "cpu", 999) == "torch"
    assert resolve_backend("auto", "cpu", 1999, max_seq_length=64) == "torch"
    assert resolve_backend("auto", "cpu", 2000, max_seq_length=64) == "openvino-int8"
    assert resolve_backend("auto", "cpu") == "auto"  # the size not known yet: the stage settles it
    assert resolve_backend("auto", "cuda:0", 10**6) == "torch"
    assert resolve_backend("torch", "cpu", 10**6) == "torch"
    assert resolve_backend("openvino-int8", "cpu", 1) == "openvino-int8"


def test_auto_backend_in_the_pipeline_follows_the_corpus_size(
    tmp_path, corpus_records, dask_client, monkeypatch
):
    """A corpus under the break-even embeds with torch (no export, no calibration); the same
    corpus with the break-even at its size gets the int8 network, and the changed rule re-runs
    the stage."""
    import memtree.clustering.embed as embedding
    from memtree.clustering.tree import load_tree

    corpus = write_jsonl(tmp_path / "c.jsonl", corpus_records[:200])
    out = tmp_path / "run"
    cfg = load_config(
        PipelineConfig,
        {"out": str(out), "ingest": {"inputs": [str(corpus)]}},
        [*PIPELINE_OVERRIDES, "tree.branching=4", "embed.calibration_samples=40"],
    )
    assert cfg.embed.backend == "auto" and cfg.embed.max_seq_length == MSL
    lines: list[str] = []
    em = run_pipeline(cfg, client=dask_client, log=lines.append, until="embed")["embed"]["stats"]
    n = em["n"]
    assert 0 < n < embedding.auto_int8_min_windows(MSL)
    assert em["backend"] == "torch" and em["export"] is None and em["export_seconds"] == 0
    assert not (out / "embed" / "embedder").exists()
    assert f"[embed] backend auto: torch for {n:,} windows" in "\n".join(lines)
    monkeypatch.setattr(embedding, "AUTO_INT8_BREAK_EVEN", {MSL: n})
    em = run_pipeline(cfg, client=dask_client, log=lines.append)["embed"]["stats"]
    assert em["backend"] == "openvino-int8" and em["calibration"]["n"] == 40
    read_export(out / "embed" / em["export"])
    assert load_tree(out / "tree").meta["embedder"]["backend"] == "openvino-int8"


def test_backend_config_errors():
    with pytest.raises(ValueError, match="backend"):
        load_config(PipelineConfig, {"embed": {"backend": "onnx"}})
    with pytest.raises(ValueError, match="runs on the CPU"):
        load_config(PipelineConfig, {"embed": {"backend": "openvino-int8", "device": "cuda"}})
    with pytest.raises(ValueError, match="needs the export directory"):
        load_embedder(None, backend="openvino-int8")
    with pytest.raises(ValueError, match="mmap_threshold_mib"):
        load_config(PipelineConfig, {"embed": {"mmap_threshold_mib": 33}})


def test_pipeline_with_int8_backend_routes_queries_through_the_export(
    tmp_path, corpus_records, dask_client
):
    from memtree.clustering.route import route_texts
    from memtree.clustering.tree import load_tree

    corpus = write_jsonl(tmp_path / "c.jsonl", corpus_records[:400])
    out = tmp_path / "run"
    cfg = load_config(
        PipelineConfig,
        {"out": str(out), "ingest": {"inputs": [str(corpus)]}},
        [
            *PIPELINE_OVERRIDES,
            "tree.branching=4",
            "embed.backend=openvino-int8",
            "embed.calibration_samples=40",
        ],
    )
    markers = run_pipeline(cfg, client=dask_client, log=lambda m: None)
    em = markers["embed"]["stats"]
    assert em["backend"] == "openvino-int8" and em["calibration"]["n"] == 40
    read_export(out / "embed" / em["export"])
    # The run folder moves as a whole: the tree finds the export relative to itself.
    moved = tmp_path / "moved"
    out.rename(moved)
    tree = load_tree(moved / "tree")
    assert tree.meta["embedder"]["backend"] == "openvino-int8"
    w = pq.read_table(moved / "window" / "part-00000.parquet", columns=["text"])[
        "text"
    ].to_pylist()[:30]
    a = pq.read_table(moved / "assign" / "part-00000.parquet", columns=["path"])[
        "path"
    ].to_pylist()[:30]
    assert route_texts(tree, w).tolist() == a


def test_a_missing_export_is_named_not_a_raw_errno(tmp_path):
    """A tree copied without its pipeline's embed/embedder (issue 36's kind of cut)."""
    with pytest.raises(FileNotFoundError, match="no embedder export here.*RUN/embed/embedder"):
        read_export(tmp_path / "embedder")
