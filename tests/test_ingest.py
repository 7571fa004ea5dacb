"""Ingest on a real Dask cluster: reject reasons, reconciliation, inputs of every kind."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memtree.config import load_config
from memtree.pipeline.config import PipelineConfig
from memtree.pipeline.ingest import normalize_text
from memtree.pipeline.run import run_pipeline
from tests.conftest import write_jsonl


def _run(tmp_path, client, inputs, **over):
    ov = [f"{k}={v}" for k, v in over.items()]
    cfg = load_config(
        PipelineConfig,
        {
            "out": str(tmp_path / "run"),
            "progress": False,
            "ingest": {"inputs": [str(i) for i in inputs]},
        },
        ov,
    )
    return run_pipeline(cfg, until="ingest", client=client, log=lambda m: None)["ingest"]["stats"]


def test_reject_reasons_and_reconciliation(tmp_path, dask_client):
    f = tmp_path / "in.jsonl"
    lines = [
        {"id": "a", "text": "A perfectly good document about stars."},
        "{not json",
        "[1, 2, 3]",
        {"id": "b"},
        {"id": "c", "text": 42},
        {"id": "d", "text": "   \n\t "},
        {"id": "e", "text": "bad\u0000binary"},
        {"id": "f", "text": "x" * 300},
        {"id": "g", "text": "A perfectly good document about stars."},  # same content as a
        {"id": "a", "text": "Different text, same id."},
        {"id": ["list"], "text": "id of the wrong type"},
        {"text": "no id: the content hash becomes the id"},
    ]
    write_jsonl(f, lines)
    with open(f, "ab") as fh:
        fh.write(b"\n")  # blank interior line
        fh.write(b'{"id": "h", "text": "caf\xe9 latin-1"}\n')  # invalid UTF-8
    stats = _run(tmp_path, dask_client, [f], **{"ingest.max_doc_bytes": 200})
    assert stats["records_in"] == 14
    assert stats["kept"] + stats["rejected"] == stats["records_in"]
    assert stats["rejects_by_reason"] == {
        "binary": 1,
        "blank_line": 1,
        "duplicate_content": 1,
        "duplicate_id": 1,
        "empty": 1,
        "invalid_id": 1,
        "invalid_type": 1,
        "invalid_utf8": 1,
        "malformed_json": 1,
        "missing_field": 1,
        "not_an_object": 1,
        "oversize": 1,
    }
    rej = pq.read_table(tmp_path / "run" / "ingest" / "rejects.parquet").to_pylist()
    by_reason = {r["reason"]: r for r in rej}
    assert by_reason["malformed_json"]["record"] == "line 2"
    assert by_reason["malformed_json"]["source"] == str(f)
    assert "same text as doc a" in by_reason["duplicate_content"]["detail"]
    docs = pq.read_table(tmp_path / "run" / "ingest" / stats["parts"][0]["file"]).to_pylist()
    assert docs[0]["doc_id"] == "a"
    assert docs[-1]["doc_id"].startswith("sha:")
    assert [d["doc_ordinal"] for d in docs] == list(range(len(docs)))


def test_every_input_kind(tmp_path, dask_client):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "one.txt").write_text("Plain text file one about gardening.")
    (d / "sub" / "two.md").write_text("Markdown file two about railways.\r\nSecond line.")
    (d / "bad.txt").write_bytes(b"\xff\xfe binary junk \x00\x00")
    (d / "image.png").write_bytes(b"\x89PNG")
    with gzip.open(d / "more.jsonl.gz", "wt") as g:
        g.write(json.dumps({"id": "gz1", "text": "Gzipped record."}) + "\n")
    pq.write_table(
        pa.table({"id": ["p1", "p2"], "text": ["Parquet row one.", None], "domain": ["x", "y"]}),
        d / "t.parquet",
    )
    stats = _run(tmp_path, dask_client, [d], **{"ingest.keep_fields": "[domain]"})
    assert stats["records_in"] == 7
    assert stats["kept"] == 4
    assert stats["rejects_by_reason"] == {
        "invalid_type": 1,
        "invalid_utf8": 1,
        "unsupported_file_type": 1,
    }
    docs = pa.concat_tables(
        [pq.read_table(tmp_path / "run" / "ingest" / p["file"]) for p in stats["parts"]]
    ).to_pylist()
    texts = {x["text"] for x in docs}
    assert "Markdown file two about railways.\nSecond line." in texts  # newlines normalised
    assert any(json.loads(x["meta"]) == {"domain": "x"} for x in docs)


def test_fsspec_url_input(tmp_path, dask_client):
    f = write_jsonl(tmp_path / "a.jsonl", [{"id": "u1", "text": "Through a URL."}])
    stats = _run(tmp_path, dask_client, [f"file://{f}"])
    assert stats["kept"] == 1


def test_missing_input_named(tmp_path, dask_client):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        _run(tmp_path, dask_client, [tmp_path / "nope.jsonl"])


def test_normalize_text():
    assert normalize_text("e\u0301\r\nx\x07y\tz") == "\u00e9\nxy\tz"


def test_remote_output_through_fsspec(tmp_path, dask_client, monkeypatch):
    import fsspec

    monkeypatch.setenv("MEMTREE_STAGING", str(tmp_path / "staging"))
    f = write_jsonl(tmp_path / "a.jsonl", [{"id": "r1", "text": "Remote run."}, "{bad"])
    cfg = load_config(
        PipelineConfig,
        {"out": "memory://bucket/run", "progress": False, "ingest": {"inputs": [str(f)]}},
    )
    run_pipeline(cfg, until="ingest", client=dask_client, log=lambda m: None)
    fs = fsspec.filesystem("memory")
    assert fs.exists("/bucket/run/config.json")
    assert fs.exists("/bucket/run/ingest/_stage.json")
    with fs.open("/bucket/run/ingest/rejects.parquet", "rb") as fh:
        assert pq.read_table(fh).to_pylist()[0]["reason"] == "malformed_json"
    assert fs.exists("/bucket/run/ingest/docs/part-00000.parquet")
