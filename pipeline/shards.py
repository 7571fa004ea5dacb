"""Stage 7, shards: windows of one leaf packed into sequences, written as MDS streams.

Windows are grouped by level-1 subtree (one MosaicML Streaming stream per
subtree, so a job can train on one subtree or mix them with
`streaming.Stream`), ordered by (leaf, document, window) and packed greedily
into samples of at most `seq_len` tokens. Each window is followed by an EOT
token when there is room (a full-length window fills its sample alone). A
window is never split across samples and samples never mix leaves.

MDS columns of every sample (format `memtree-shards` v1, pipeline/README.md):
  tokens      ndarray int32 (n,)        n <= seq_len
  doc_bounds  ndarray int32 (segments+1,) segment s is tokens[b[s]:b[s+1]] (a window + its EOT);
                                        attention must not cross segment boundaries
  path        ndarray int64 (levels,)   global cluster id per level (last = leaf)
  leaf        int64
  window_ids  ndarray int64 (segments,) global window ordinals (rows of embed/embeddings.npy)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memtree.io import atomic_path, atomic_write_json, check_format, naming_path, read_json

SHARDS_FORMAT = "memtree-shards"
SHARDS_VERSION = 1
MDS_COLUMNS = {
    "tokens": "ndarray:int32",
    "doc_bounds": "ndarray:int32",
    "path": "ndarray:int64",
    "leaf": "int64",
    "window_ids": "ndarray:int64",
}


def stream_name(subtree: int) -> str:
    return f"subtree-{subtree:03d}"


def split_part(windows_path: str, assign_path: str, split_dir: str, part: int) -> dict[int, int]:
    """Dask task: route one windows partition's rows into per-subtree pieces."""
    done = Path(split_dir) / f"part-{part:05d}.done.json"
    if done.exists():
        return {int(k): v for k, v in read_json(done).items()}
    w = pq.read_table(windows_path, columns=["doc_ordinal", "window_index", "tokens"])
    a = pq.read_table(assign_path, columns=["window_ordinal", "path", "leaf", "subtree"])
    if w.num_rows != a.num_rows:
        raise ValueError(
            f"{windows_path} has {w.num_rows} windows but {assign_path} has {a.num_rows}"
        )
    t = pa.table(
        {
            "window_ordinal": a["window_ordinal"],
            "doc_ordinal": w["doc_ordinal"],
            "window_index": w["window_index"],
            "tokens": w["tokens"],
            "path": a["path"],
            "leaf": a["leaf"],
            "subtree": a["subtree"],
        }
    )
    sub = t["subtree"].to_numpy()
    counts: dict[int, int] = {}
    for s in np.unique(sub):
        piece = t.filter(pa.array(sub == s))
        with atomic_path(Path(split_dir) / stream_name(int(s)) / f"part-{part:05d}.parquet") as tmp:
            pq.write_table(piece, tmp)
        counts[int(s)] = piece.num_rows
    atomic_write_json(done, {str(k): v for k, v in counts.items()})
    return counts


def pack_windows(lengths: np.ndarray, leaves: np.ndarray, seq_len: int) -> list[list[int]]:
    """Greedy in-order packing: sample = consecutive windows of one leaf, each + EOT if room."""
    samples: list[list[int]] = []
    cur: list[int] = []
    used = 0
    cur_leaf = None
    for i, (n, leaf) in enumerate(zip(lengths.tolist(), leaves.tolist())):
        if cur and (leaf != cur_leaf or used + n > seq_len):
            samples.append(cur)
            cur, used = [], 0
        cur.append(i)
        cur_leaf = leaf
        used += n + (1 if used + n < seq_len else 0)
    if cur:
        samples.append(cur)
    return samples


def write_stream(
    split_dir: str,
    out_dir: str,
    subtree: int,
    seq_len: int,
    eot_id: int,
    compression: str | None,
    hashes: list[str],
    size_limit: str,
) -> dict:
    """Dask task: pack one subtree's windows and write its MDS stream (redone whole if
    interrupted)."""
    from streaming import MDSWriter

    out = Path(out_dir)
    done = out.parent / f"{out.name}.done.json"
    if done.exists():
        return read_json(done)
    if out.exists():
        shutil.rmtree(out)  # partial stream from a killed run: MDS shards are not resumable
    pieces = sorted((Path(split_dir) / stream_name(subtree)).glob("part-*.parquet"))
    t = pa.concat_tables([pq.read_table(p) for p in pieces])
    leaf = t["leaf"].to_numpy()
    order = np.lexsort((t["window_index"].to_numpy(), t["doc_ordinal"].to_numpy(), leaf))
    t = t.take(pa.array(order))
    leaf = leaf[order]
    tokens = t["tokens"]
    lengths = pc_list_lengths(tokens)
    paths = np.stack(t["path"].to_numpy(zero_copy_only=False)).astype(np.int64)
    wids = t["window_ordinal"].to_numpy()
    samples = pack_windows(lengths, leaf, seq_len)
    flat = tokens.combine_chunks().values.to_numpy()
    offs = tokens.combine_chunks().offsets.to_numpy()
    sample_leaf: list[int] = []
    sample_tokens: list[int] = []
    n_tokens = 0
    with (
        naming_path(out, kept="the partial stream is rewritten whole on the rerun"),
        MDSWriter(
            out=str(out),
            columns=MDS_COLUMNS,
            compression=compression,
            hashes=hashes or None,
            size_limit=size_limit,
            progress_bar=False,
        ) as writer,
    ):
        for rows in samples:
            seq: list[np.ndarray] = []
            bounds = [0]
            for r in rows:
                seq.append(flat[offs[r] : offs[r + 1]])
                end = bounds[-1] + int(lengths[r])
                if end < seq_len:
                    seq.append(np.array([eot_id], dtype=np.int32))
                    end += 1
                bounds.append(end)
            tok = np.concatenate(seq).astype(np.int32)
            n_tokens += len(tok)
            writer.write(
                {
                    "tokens": tok,
                    "doc_bounds": np.asarray(bounds, dtype=np.int32),
                    "path": paths[rows[0]],
                    "leaf": int(leaf[rows[0]]),
                    "window_ids": wids[rows].astype(np.int64),
                }
            )
            sample_leaf.append(int(leaf[rows[0]]))
            sample_tokens.append(len(tok))
    index = read_json(out / "index.json")
    shards, start = [], 0
    for sh in index["shards"]:
        n = sh["samples"]
        leaves = sorted(set(sample_leaf[start : start + n]))
        stored = (sh.get("zip_data") or sh["raw_data"])["basename"]
        shards.append({"file": stored, "samples": n, "leaves": leaves})
        start += n
    leaves = sorted(set(leaf.tolist()))
    at = {lf: i for i, lf in enumerate(leaves)}
    leaf_samples, leaf_tokens = [0] * len(leaves), [0] * len(leaves)
    for lf, n in zip(sample_leaf, sample_tokens, strict=True):
        leaf_samples[at[lf]] += 1
        leaf_tokens[at[lf]] += n
    # per-leaf counts (aligned with `leaves`): what each memory block trains on per epoch
    # (memtree.tpp; `memtree memstore plan --shards`)
    meta = {
        "name": stream_name(subtree),
        "subtree": subtree,
        "n_samples": len(samples),
        "n_windows": int(t.num_rows),
        "n_tokens": n_tokens,
        "leaves": leaves,
        "leaf_samples": leaf_samples,
        "leaf_tokens": leaf_tokens,
        "shards": shards,
    }
    atomic_write_json(done, meta)
    return meta


def pc_list_lengths(arr) -> np.ndarray:
    return pc.list_value_length(arr).to_numpy().astype(np.int64)


def open_streams(shards_dir: str | Path, subtrees: list[int] | None = None, **stream_kw):
    """`streaming.Stream`s for the given level-1 subtrees (all when None) of a shards directory."""
    from streaming import Stream

    manifest = load_manifest(shards_dir)
    want = None if subtrees is None else set(subtrees)
    streams = []
    for s in manifest["streams"]:
        if want is None or s["subtree"] in want:
            streams.append(Stream(local=str(Path(shards_dir) / s["name"]), **stream_kw))
    if not streams:
        raise ValueError(f"{shards_dir}: no stream for subtrees {sorted(want or [])}")
    return streams


def load_manifest(shards_dir: str | Path) -> dict:
    p = Path(shards_dir) / "manifest.json"
    m = read_json(p)
    check_format(m, SHARDS_FORMAT, SHARDS_VERSION, p, what="memtree shards")
    return m
