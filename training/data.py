"""Training data: the pipeline's MDS streams → batches of tokens, document segments and cluster
paths.

Reads the shards through their documented format (`shards/manifest.json` +
one MDS stream per level-1 subtree, pipeline/README.md) with MosaicML
Streaming, so the dataloader state goes into Composer checkpoints and a
resumed run continues with the same samples. A per-subtree job (App. A.2)
opens only its subtree's stream.

Batch (B = batch size, S = the shards' seq_len):
  input_ids   (B, S) int64   tokens, padded with EOT
  labels      (B, S) int64   next token, -100 where the next token is padding or
                             starts another document (no cross-document targets)
  segment_ids (B, S) int64   document segment per token (padding gets its own)
  paths       (B, L) int64   global cluster id per tree level
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from tokenizers import Tokenizer

from memtree.io import check_format

SHARDS_FORMAT = "memtree-shards"
SHARDS_VERSION = 1


def read_shards_manifest(shards: str | Path) -> dict[str, Any]:
    path = Path(shards) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{shards}: no manifest.json; expected a pipeline run's shards/ directory"
        )
    m = json.loads(path.read_text())
    check_format(m, SHARDS_FORMAT, SHARDS_VERSION, path, what="memtree shards")
    return m


def tokenizer_vocab_size(shards: str | Path, manifest: dict[str, Any]) -> int:
    tok = (Path(shards) / manifest["tokenizer"]).resolve()
    path = tok / "tokenizer.json" if tok.is_dir() else tok
    return Tokenizer.from_file(str(path)).get_vocab_size()


class Collate:
    """MDS samples → one padded batch (see the module docstring)."""

    def __init__(self, seq_len: int, eot_id: int) -> None:
        self.seq_len, self.eot_id = seq_len, eot_id

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        B, S = len(samples), self.seq_len
        ids = np.full((B, S), self.eot_id, dtype=np.int64)
        seg = np.zeros((B, S), dtype=np.int64)
        valid = np.zeros((B, S), dtype=bool)
        paths = np.stack([np.asarray(s["path"], dtype=np.int64) for s in samples])
        for i, s in enumerate(samples):
            toks = np.asarray(s["tokens"], dtype=np.int64)
            if len(toks) > S:
                raise ValueError(f"sample of {len(toks)} tokens exceeds seq_len {S}")
            ids[i, : len(toks)] = toks
            valid[i, : len(toks)] = True
            bounds = np.asarray(s["doc_bounds"], dtype=np.int64)
            for k in range(len(bounds) - 1):
                seg[i, bounds[k] : bounds[k + 1]] = k
            seg[i, len(toks) :] = len(bounds)  # padding: a segment of its own
        labels = np.full((B, S), -100, dtype=np.int64)
        same_doc = (seg[:, 1:] == seg[:, :-1]) & valid[:, 1:]
        labels[:, :-1] = np.where(same_doc, ids[:, 1:], -100)
        return {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "segment_ids": torch.from_numpy(seg),
            "paths": torch.from_numpy(paths),
        }


def real_positions(labels: torch.Tensor) -> torch.Tensor:
    """(B, S) labels from `Collate` → (B, S) bool, True on real tokens: a position is padding
    when neither it nor its predecessor has a target (a document's last token has none itself)."""
    real = labels != -100
    real[:, 1:] |= labels[:, :-1] != -100
    return real


def build_dataloader(
    shards: str | Path,
    *,
    batch_size: int,
    subtrees: list[int] | None = None,
    shuffle: bool = True,
    shuffle_seed: int = 0,
    num_workers: int = 0,
    drop_last: bool = True,
):
    """A `StreamingDataLoader` over the shards (all subtrees, or the given ones)."""
    from streaming import Stream, StreamingDataLoader, StreamingDataset

    manifest = read_shards_manifest(shards)
    streams = [
        Stream(local=str(Path(shards) / s["name"])) for s in selected_streams(manifest, subtrees)
    ]
    if not streams:
        raise ValueError(
            f"{shards}: no samples for subtrees {sorted(subtrees) if subtrees else 'any'}"
        )
    from composer.utils import dist

    per_rank = batch_size // max(dist.get_world_size(), 1)
    if per_rank * max(dist.get_world_size(), 1) != batch_size:
        raise ValueError(
            f"data.batch_size {batch_size} must be divisible by the {dist.get_world_size()} ranks"
        )
    # num_canonical_nodes fixed (Streaming's default is the first run's node count): the global
    # sample order is the same at any number of nodes and ranks, so a run may resume at another
    # world size with the same global batches (1 = the default on one node, so orders are unchanged)
    dataset = StreamingDataset(
        streams=streams,
        shuffle=shuffle,
        shuffle_seed=shuffle_seed,
        batch_size=per_rank,
        replication=None,
        num_canonical_nodes=1,
    )
    collate = Collate(int(manifest["seq_len"]), int(manifest["eot_id"]))
    return StreamingDataLoader(
        dataset,
        batch_size=per_rank,
        collate_fn=collate,
        num_workers=num_workers,
        drop_last=drop_last,
    )


# -- shard verification ---------------------------------------------------------------------------

# Hash algorithms MDS may record, fastest first (xxHash ≫ md5 > sha1 > sha2); the check uses
# the first one a shard's index records.
_HASH_SPEED_ORDER = (
    "xxh3_64",
    "xxh64",
    "xxh3_128",
    "xxh128",
    "xxh32",
    "md5",
    "sha1",
    "blake2b",
    "blake2s",
    "sha256",
    "sha224",
    "sha512",
    "sha384",
    "sha3_256",
    "sha3_512",
)


class ShardError(ValueError):
    """Shard files that do not match what their stream's MDS index records (see `verify_shards`)."""


def selected_streams(
    manifest: dict[str, Any], subtrees: list[int] | None = None
) -> list[dict[str, Any]]:
    """The manifest's streams a run reads: those with samples, of the given subtrees (all when
    None) — the selection `build_dataloader` makes."""
    want = None if subtrees is None else set(subtrees)
    return [
        s
        for s in manifest["streams"]
        if s["n_samples"] > 0 and (want is None or s["subtree"] in want)
    ]


def _pick_hash(recorded: dict[str, str]) -> str | None:
    for algo in _HASH_SPEED_ORDER:
        if algo in recorded:
            return algo
    from streaming.base.hashing import is_hash

    return next((a for a in sorted(recorded) if is_hash(a)), None)


def _hash_file(path: Path, algo: str, chunk: int = 1 << 22) -> str:
    """Hex digest of a file, read in chunks; the same value as `streaming.base.hashing.get_hash`
    (MDSWriter's) on the whole content."""
    h = getattr(xxhash, algo)() if algo in xxhash.algorithms_available else hashlib.new(algo)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_shards(
    shards: str | Path,
    manifest: dict[str, Any] | None = None,
    subtrees: list[int] | None = None,
    *,
    require_hashes: bool = False,
) -> dict[str, Any]:
    """Check every shard file a run will read against its stream's MDS `index.json`.

    For each stream `build_dataloader` would open (`selected_streams`), the index is read and,
    for every shard, each file on disk is checked: the stored (compressed) `zip_data` file and,
    if present, the decompressed `raw_data` copy that Streaming leaves next to it after a first
    run (and reads instead of the compressed file from then on). Each file's size must equal the
    recorded `bytes` and its content the recorded hash — the fastest algorithm the index has
    (xxh64 in the pipeline's default `pack.hashes: [sha1, xxh64]`). A shard with neither file,
    a missing or unreadable index, or an index whose shards differ from `manifest.json`'s is an
    error too. Every problem found is reported in one `ShardError` naming each file, what was
    expected and found, and what to do.

    A file whose index records no hash (`pack.hashes: []`) gets only the size check: it is listed
    in the result's `unverified` and a warning says so; `require_hashes=True` makes it an error.
    Not an error by default because `pack.hashes: []` is a setting the pipeline accepts, and its
    shards should still train (with their sizes checked) rather than need the check turned off.

    Returns {"streams", "files", "bytes", "seconds", "algorithms", "unverified"}. Cost: one read of
    every file (the compressed shards plus any decompressed copies); xxh64 hashes at several GB/s,
    so the time is the disk's read time (training/README.md has a measurement).
    """
    t0 = time.perf_counter()
    root = Path(shards)
    manifest = manifest if manifest is not None else read_shards_manifest(shards)
    rebuild = (
        f"rebuild the shards: delete {root.resolve()} and re-run the `memtree pipeline` command "
        "that wrote it (finished stages are skipped, the shards stage is redone), or restore it "
        "from a copy"
    )
    problems: list[str] = []
    unverified: list[str] = []
    algos: set[str] = set()
    n_files = n_bytes = 0
    streams = selected_streams(manifest, subtrees)
    for stream in streams:
        local = (root / stream["name"]).resolve()
        index_path = local / "index.json"
        try:
            index = json.loads(index_path.read_text())
            entries = index["shards"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(
                f"{index_path}: unreadable MDS index ({type(e).__name__}: {e}); {rebuild}"
            )
            continue
        want = [(sh["file"], sh["samples"]) for sh in stream.get("shards", [])]
        have = [
            ((sh.get("zip_data") or sh.get("raw_data") or {}).get("basename"), sh.get("samples"))
            for sh in entries
        ]
        if want and have != want:
            problems.append(
                f"{index_path}: lists shards {have}, but {root / 'manifest.json'} records {want} "
                f"for stream {stream['name']}; {rebuild}"
            )
            continue
        for sh in entries:
            raw, zipped = sh.get("raw_data"), sh.get("zip_data")
            parts = [
                (info, kind)
                for info, kind in ((zipped, "compressed"), (raw, "decompressed"))
                if info
            ]
            present = [(info, kind) for info, kind in parts if (local / info["basename"]).is_file()]
            if not present:
                names = " or ".join(str(local / info["basename"]) for info, _ in parts)
                problems.append(f"{names}: missing (listed in {index_path}); {rebuild}")
                continue
            for info, kind in present:
                path = local / info["basename"]
                size = path.stat().st_size
                n_files += 1
                n_bytes += size
                if kind == "decompressed" and zipped:
                    fix = (
                        f"delete this decompressed copy; Streaming re-extracts it from "
                        f"{zipped['basename']} at the next start"
                    )
                else:
                    fix = rebuild
                if size != info["bytes"]:
                    problems.append(
                        f"{path}: {kind} shard is {size} bytes, its index records {info['bytes']} "
                        f"({index_path}); {fix}"
                    )
                    continue
                algo = _pick_hash(info.get("hashes") or {})
                if algo is None:
                    unverified.append(str(path))
                    continue
                algos.add(algo)
                got = _hash_file(path, algo)
                if got != info["hashes"][algo]:
                    problems.append(
                        f"{path}: {kind} shard has {algo} {got}, its index records "
                        f"{info['hashes'][algo]} ({index_path}); {fix}"
                    )
    if unverified:
        msg = (
            f"{root}: {len(unverified)} shard file(s) have no hash in their MDS index (pipeline "
            f"`pack.hashes: []`), only their sizes were checked, e.g. {unverified[0]}; re-run the "
            "shards stage with `pack.hashes: [sha1, xxh64]` to have their contents verified"
        )
        if require_hashes:
            problems.append(msg)
        else:
            warnings.warn(msg, stacklevel=2)
    if problems:
        raise ShardError(
            f"{root}: {len(problems)} problem(s) with the shards this run would read, "
            "found before training on them:\n  " + "\n  ".join(problems)
        )
    return {
        "streams": len(streams),
        "files": n_files,
        "bytes": n_bytes,
        "seconds": time.perf_counter() - t0,
        "algorithms": sorted(algos),
        "unverified": unverified,
    }
