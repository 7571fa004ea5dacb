"""Stage 1, ingest: raw inputs → normalised, de-duplicated document partitions.

Inputs are JSONL (optionally gzipped), Parquet, or directories of text files,
local or behind any fsspec URL. One Dask task reads one input unit (a file, or
a batch of small text files) and writes its records in chunks of
`partition_docs`; the driver then de-duplicates exact copies globally and a
second round of tasks writes the final partitions with global ordinals.

Every record that enters is either kept or written to `rejects.parquet` with
a reason, so `records_in == kept + rejected` holds exactly. Reasons:
malformed_json, not_an_object, missing_field, invalid_type, invalid_id,
invalid_utf8, binary (NUL bytes), oversize, empty, blank_line, unreadable,
unsupported_file_type, duplicate_content, duplicate_id.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from memtree.io import atomic_path, atomic_write_json, read_json
from memtree.pipeline.config import IngestConfig

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz")
PARQUET_SUFFIXES = (".parquet", ".pq")
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
TEXT_FILES_PER_UNIT = 256

DOC_SCHEMA = pa.schema(
    [
        ("doc_ordinal", pa.int64()),
        ("doc_id", pa.string()),
        ("text", pa.string()),
        ("source", pa.string()),
        ("meta", pa.string()),
    ]
)
RAW_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("text", pa.string()),
        ("content_hash", pa.string()),
        ("source", pa.string()),
        ("record", pa.string()),
        ("meta", pa.string()),
    ]
)
REJECT_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("record", pa.string()),
        ("doc_id", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]
)

# Control characters carry no text; tab and newline are kept. NUL is handled
# earlier (it marks binary data, which is rejected rather than cleaned).
_CONTROL = re.compile("[\x01-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def normalize_text(text: str) -> str:
    """NFC, unified newlines, control characters removed."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = unicodedata.normalize("NFC", text)
    return _CONTROL.sub("", text)


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class InputUnit:
    kind: str  # jsonl | parquet | text | unsupported
    urls: tuple[str, ...]


def _kind(name: str) -> str:
    low = name.lower()
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if low.endswith(TEXT_SUFFIXES):
        return "text"
    return "unsupported"


_GLOB = re.compile(r"[*?\[]")


def is_glob(url: str) -> bool:
    """Whether an input names a pattern (`*`, `?`, `[…]`) rather than one file or directory."""
    return bool(_GLOB.search(url))


def resolve_inputs(inputs: list[str]) -> list[str]:
    """`ingest.inputs` with glob patterns expanded (each pattern's matches sorted, patterns in the
    given order, a path named twice kept once); an input that does not exist, or a pattern that
    matches nothing, is an error naming it. A path that exists as written is taken literally,
    even with glob characters in its name."""
    if not inputs:
        raise ValueError(
            "ingest.inputs is empty: give at least one JSONL/Parquet file or directory "
            "(--input PATH, or ingest.inputs=[PATH,...]; globs such as data/*.jsonl are expanded)"
        )
    out: list[str] = []
    seen: set[str] = set()
    for url in inputs:
        fs, path = fsspec.core.url_to_fs(url)
        if fs.exists(path):
            found = [url]
        elif is_glob(url):
            if "://" in url:
                proto = url.split("://", 1)[0] + "://"
                found = [proto + f for f in sorted(fs.glob(path))]
            else:  # a local pattern keeps its form (relative stays relative); ** recurses
                found = sorted(glob.glob(url, recursive=True))
            if not found:
                raise FileNotFoundError(f"ingest.inputs: no file matches the pattern {url}")
        else:
            raise FileNotFoundError(f"ingest.inputs: input not found: {url}")
        for f in found:
            key = fsspec.core.url_to_fs(f)[1]  # the same file named twice is read once
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def expand_inputs(inputs: list[str]) -> list[InputUnit]:
    """Resolve files, directories and glob patterns into units of work, in a deterministic order."""
    units: list[InputUnit] = []
    for url in resolve_inputs(inputs):
        if "://" not in url:  # the Dask workers' working directory may not be this process's
            url = os.path.abspath(url)
        fs, path = fsspec.core.url_to_fs(url)
        proto = url.split("://", 1)[0] + "://" if "://" in url else ""
        if fs.isdir(path):
            files = sorted(fs.find(path))
            if not files:
                raise ValueError(f"ingest.inputs: input directory is empty: {url}")
            full = [proto + f if proto else f for f in files]
            texts = [f for f in full if _kind(f) == "text"]
            for f in full:
                k = _kind(f)
                if k != "text":
                    units.append(InputUnit(k, (f,)))
            for i in range(0, len(texts), TEXT_FILES_PER_UNIT):
                units.append(InputUnit("text", tuple(texts[i : i + TEXT_FILES_PER_UNIT])))
        else:
            k = _kind(url)
            units.append(InputUnit("jsonl" if k == "unsupported" else k, (url,)))
    return units


class _UnitWriter:
    """Collects one unit's kept records in chunks and its rejects."""

    def __init__(self, cfg: IngestConfig, raw_dir: Path, unit_index: int):
        self.cfg, self.raw_dir, self.unit_index = cfg, raw_dir, unit_index
        self.rows: list[dict[str, Any]] = []
        self.rejects: list[dict[str, str]] = []
        self.chunks: list[dict[str, Any]] = []
        self.records_in = 0

    def reject(self, source: str, record: str, reason: str, detail: str = "", doc_id: str = ""):
        self.rejects.append(
            {
                "source": source,
                "record": record,
                "doc_id": doc_id,
                "reason": reason,
                "detail": detail,
            }
        )

    def add(self, source: str, record: str, text: Any, doc_id: Any, meta: dict[str, Any]) -> None:
        """Validate one record's text/id and keep or reject it."""
        self.records_in += 1
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                return self.reject(source, record, "invalid_utf8", str(e))
        if not isinstance(text, str):
            return self.reject(
                source, record, "invalid_type", f"{self.cfg.text_field} is {type(text).__name__}"
            )
        if "\x00" in text:
            return self.reject(source, record, "binary", "NUL character in text")
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.cfg.max_doc_bytes:
            return self.reject(
                source, record, "oversize", f"{size} bytes > max_doc_bytes={self.cfg.max_doc_bytes}"
            )
        try:
            text = normalize_text(text)
            text.encode("utf-8")
        except UnicodeError as e:  # lone surrogates from JSON escapes
            return self.reject(source, record, "invalid_utf8", str(e))
        if not text.strip():
            return self.reject(source, record, "empty", "no text after normalisation")
        h = content_hash(text)
        if doc_id is None or doc_id == "":
            doc_id = f"sha:{h}"
        elif isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
            return self.reject(source, record, "invalid_id", f"id of type {type(doc_id).__name__}")
        self.rows.append(
            {
                "doc_id": str(doc_id),
                "text": text,
                "content_hash": h,
                "source": source,
                "record": record,
                "meta": json.dumps(meta, sort_keys=True, ensure_ascii=False, default=str),
            }
        )
        if len(self.rows) >= self.cfg.partition_docs:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        name = f"u{self.unit_index:05d}-{len(self.chunks):05d}.parquet"
        table = pa.Table.from_pylist(self.rows, schema=RAW_SCHEMA)
        with atomic_path(self.raw_dir / name) as tmp:
            pq.write_table(table, tmp)
        self.chunks.append({"name": name, "n": len(self.rows)})
        self.rows = []


def _meta(obj: dict[str, Any], keep: list[str]) -> dict[str, Any]:
    return {k: obj[k] for k in keep if k in obj}


def _read_jsonl(w: _UnitWriter, url: str) -> None:
    cfg = w.cfg
    with fsspec.open(url, "rb", compression="infer") as f:
        for lineno, raw in enumerate(f, start=1):
            rec = f"line {lineno}"
            line = raw.rstrip(b"\r\n")
            if not line.strip():
                # A final newline yields no line here; an interior blank line is a
                # (malformed) record and is accounted for, not skipped.
                w.records_in += 1
                w.reject(url, rec, "blank_line")
                continue
            try:
                s = line.decode("utf-8")
            except UnicodeDecodeError as e:
                w.records_in += 1
                w.reject(url, rec, "invalid_utf8", str(e))
                continue
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                w.records_in += 1
                w.reject(url, rec, "malformed_json", str(e))
                continue
            if not isinstance(obj, dict):
                w.records_in += 1
                w.reject(url, rec, "not_an_object", f"JSON {type(obj).__name__}")
                continue
            if cfg.text_field not in obj:
                w.records_in += 1
                w.reject(
                    url,
                    rec,
                    "missing_field",
                    f"no '{cfg.text_field}' field",
                    doc_id=str(obj.get(cfg.id_field, "")),
                )
                continue
            w.add(url, rec, obj[cfg.text_field], obj.get(cfg.id_field), _meta(obj, cfg.keep_fields))


def _read_parquet(w: _UnitWriter, url: str) -> None:
    cfg = w.cfg
    with fsspec.open(url, "rb") as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        if cfg.text_field not in names:
            # Every row lacks the field: reject each, so counts stay exact.
            for i in range(pf.metadata.num_rows):
                w.records_in += 1
                w.reject(url, f"row {i}", "missing_field", f"no '{cfg.text_field}' column")
            return
        cols = [c for c in [cfg.text_field, cfg.id_field, *cfg.keep_fields] if c in names]
        row = 0
        for batch in pf.iter_batches(columns=cols, batch_size=4096):
            for obj in batch.to_pylist():
                w.add(
                    url,
                    f"row {row}",
                    obj[cfg.text_field],
                    obj.get(cfg.id_field),
                    _meta(obj, cfg.keep_fields),
                )
                row += 1


def _read_text(w: _UnitWriter, url: str) -> None:
    try:
        with fsspec.open(url, "rb") as f:
            data = f.read()
    except Exception as e:  # noqa: BLE001 — permissions, broken links, remote errors: a reject
        w.records_in += 1
        w.reject(url, "file", "unreadable", f"{type(e).__name__}: {e}")
        return
    # A text file has no given id: its id is the content hash, stable wherever the corpus lives.
    w.add(url, "file", data, None, {})


def ingest_unit(unit_index: int, unit: InputUnit, cfg: IngestConfig, raw_dir: str) -> dict:
    """Dask task: read one input unit into raw chunk files; resumable via a done-marker."""
    raw = Path(raw_dir)
    done = raw / f"u{unit_index:05d}.done.json"
    if done.exists():
        return read_json(done)
    w = _UnitWriter(cfg, raw, unit_index)
    for url in unit.urls:
        if unit.kind == "unsupported":
            w.records_in += 1
            w.reject(
                url,
                "file",
                "unsupported_file_type",
                f"expected {JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES}",
            )
            continue
        try:
            {"jsonl": _read_jsonl, "parquet": _read_parquet, "text": _read_text}[unit.kind](w, url)
        except Exception as e:
            if unit.kind == "text":
                raise
            # A file that cannot be opened or parsed as a whole (corrupt Parquet,
            # broken gzip) is named in the error rather than half-ingested.
            raise ValueError(f"{url}: cannot read as {unit.kind}: {type(e).__name__}: {e}") from e
    w.flush()
    rej_name = f"u{unit_index:05d}.rejects.parquet"
    with atomic_path(raw / rej_name) as tmp:
        pq.write_table(pa.Table.from_pylist(w.rejects, schema=REJECT_SCHEMA), tmp)
    stats = {
        "unit": unit_index,
        "records_in": w.records_in,
        "chunks": w.chunks,
        "rejects": rej_name,
        "n_rejects": len(w.rejects),
    }
    atomic_write_json(done, stats)
    return stats


def write_docs_part(raw_path: str, out_path: str, offset: int, drop_rows: list[int]) -> int:
    """Dask task: drop de-duplicated rows and stamp global ordinals."""
    out = Path(out_path)
    t = pq.read_table(raw_path)
    keep = sorted(set(range(t.num_rows)) - set(drop_rows))
    t = t.take(pa.array(keep, type=pa.int64()))
    docs = pa.table(
        {
            "doc_ordinal": pa.array(range(offset, offset + t.num_rows), type=pa.int64()),
            "doc_id": t["doc_id"],
            "text": t["text"],
            "source": t["source"],
            "meta": t["meta"],
        },
        schema=DOC_SCHEMA,
    )
    with atomic_path(out) as tmp:
        pq.write_table(docs, tmp, compression="zstd")
    return t.num_rows


def dedup_plan(
    raw_dir: Path, chunks: list[str], *, dedup: bool
) -> tuple[dict[str, list[int]], list[dict]]:
    """First occurrence (in input order) wins; later exact copies and id clashes are rejected."""
    seen_hash: dict[str, str] = {}
    seen_id: dict[str, str] = {}
    drops: dict[str, list[int]] = {c: [] for c in chunks}
    rejects: list[dict] = []
    for name in chunks:
        t = pq.read_table(raw_dir / name, columns=["doc_id", "content_hash", "source", "record"])
        for i, (did, h, src, rec) in enumerate(
            zip(*(t[c].to_pylist() for c in ("doc_id", "content_hash", "source", "record")))
        ):
            if dedup and h in seen_hash:
                drops[name].append(i)
                rejects.append(
                    {
                        "source": src,
                        "record": rec,
                        "doc_id": did,
                        "reason": "duplicate_content",
                        "detail": f"same text as doc {seen_hash[h]}",
                    }
                )
                continue
            if did in seen_id:
                drops[name].append(i)
                rejects.append(
                    {
                        "source": src,
                        "record": rec,
                        "doc_id": did,
                        "reason": "duplicate_id",
                        "detail": f"id already used by {seen_id[did]}",
                    }
                )
                continue
            seen_hash.setdefault(h, did)
            seen_id[did] = f"{src} {rec}"
    return drops, rejects
