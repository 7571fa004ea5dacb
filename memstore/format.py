"""The on-disk memory-bank format (memtree-bank v1): layout, codecs, creation, verification.

A bank is a directory (see memstore/README.md for the full description):

    manifest.json        format, version, generation, tree binding, anchor + memory config,
                         storage dtype / rank, and per level: blocks, record and stride bytes
    level-<l>.bin        slots of `stride` bytes (a multiple of 4096): slot c = cluster c of
                         level l (local to the subtree for a per-subtree bank), then one
                         trailing slot for the generic memory
    level-<l>.sums       16-byte xxh3-128 digest of each slot's record (padding excluded)
    policy.json          blocked blocks and the fallback (memstore.policy)
    audit.jsonl          who blocked / deleted / edited what and when (memstore.audit)
    journal/             in-place edits waiting to be applied (memstore.commit)

Fixed-size aligned slots make a block addressable by arithmetic: fetching a
path is one contiguous `pread` per level, whatever the bank size, and aligned
offsets permit O_DIRECT reads. Only JSON and raw little-endian arrays are ever
parsed; nothing is unpickled, so a bank from an untrusted source cannot run code.

A record is one block's parameters, the concatenation of its `block_layout` tensors
(`memtree.geometry.join_block`; the layout work is all there), optionally factorised
(each 2-D tensor stored as U (a, r) · V (r, b)) and encoded in the storage dtype:
fp32/bf16/fp16 raw, or int8/int4 with one fp32 absmax scale per group of
`QUANT_GROUP` values (dequantised on fetch).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch
import xxhash

from memtree.clustering.tree import compute_tree_id
from memtree.config import from_dict, to_dict
from memtree.geometry import (
    DTYPES,
    QUANT_GROUP,
    AnchorShape,
    MemoryConfig,
    TensorSpec,
    block_layout,
    plan,
    split_block,
)
from memtree.io import check_format, read_json, restore_replaced_dir

FORMAT = "memtree-bank"
VERSION = 1
ALIGN = 4096
DIGEST_BYTES = 16
GENERIC = -1  # cluster id that names the generic memory's slot

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class BankError(ValueError):
    """A bank is malformed, corrupted, or does not match what it is used with."""


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def digest(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


# --------------------------------------------------------------------------- codecs


@dataclass(frozen=True)
class RecordCodec:
    """Encodes one block (flat float tensor of `params` values) to its record bytes and back."""

    layout: tuple[TensorSpec, ...]
    dtype: str
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise BankError(f"dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.rank is not None and self.rank < 1:
            raise BankError(f"rank must be >= 1, got {self.rank}")

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.layout)

    def _ranks(self) -> list[int]:
        return [min(self.rank, *t.shape) for t in self.layout] if self.rank else []

    @property
    def stored_values(self) -> int:
        if not self.rank:
            return self.params
        return sum(
            r * (t.shape[0] + t.shape[1]) for r, t in zip(self._ranks(), self.layout, strict=True)
        )

    @property
    def record_bytes(self) -> int:
        n = self.stored_values
        if self.dtype == "int8":
            return n + 4 * math.ceil(n / QUANT_GROUP)
        if self.dtype == "int4":
            return math.ceil(n / 2) + 4 * math.ceil(n / QUANT_GROUP)
        return n * TORCH_DTYPES[self.dtype].itemsize

    @property
    def stride(self) -> int:
        return align_up(self.record_bytes)

    # -- low-rank -------------------------------------------------------------
    def _factorise(self, flat: torch.Tensor) -> torch.Tensor:
        parts = []
        tensors = split_block(self.layout, flat)
        for r, t in zip(self._ranks(), self.layout, strict=True):
            m = tensors[t.name].double()
            u, s, vh = torch.linalg.svd(m, full_matrices=False)
            # split singular values evenly so U and V have similar scales (quantises better)
            root = s[:r].sqrt()
            parts += [(u[:, :r] * root).reshape(-1), (root[:, None] * vh[:r]).reshape(-1)]
        return torch.cat(parts).float()

    def _expand(self, stored: torch.Tensor) -> torch.Tensor:
        parts, off = [], 0
        for r, t in zip(self._ranks(), self.layout, strict=True):
            a, b = t.shape
            u = stored[off : off + a * r].view(a, r)
            off += a * r
            v = stored[off : off + r * b].view(r, b)
            off += r * b
            parts.append((u @ v).reshape(-1))
        return torch.cat(parts)

    # -- bytes ----------------------------------------------------------------
    def encode(self, flat: torch.Tensor) -> bytes:
        """flat: (params,) float tensor → record bytes (len == record_bytes)."""
        flat = torch.as_tensor(flat).detach().reshape(-1).cpu()
        if flat.numel() != self.params:
            raise BankError(f"block has {flat.numel()} values, the layout needs {self.params}")
        if not torch.isfinite(flat).all():
            raise BankError("block contains NaN or inf values; refusing to store it")
        vals = self._factorise(flat) if self.rank else flat.float()
        if self.dtype in TORCH_DTYPES:
            cast = vals.to(TORCH_DTYPES[self.dtype])
            if not torch.isfinite(cast).all():
                raise BankError(
                    f"block values overflow {self.dtype} (max |x| = {float(vals.abs().max()):.4g})"
                )
            return cast.contiguous().view(torch.uint8).numpy().tobytes()
        n = vals.numel()
        groups = math.ceil(n / QUANT_GROUP)
        padded = torch.zeros(groups * QUANT_GROUP, dtype=torch.float32)
        padded[:n] = vals
        g = padded.view(groups, QUANT_GROUP)
        qmax = 127 if self.dtype == "int8" else 7
        scale = g.abs().amax(dim=1) / qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(g / scale[:, None]).clamp(-qmax, qmax).reshape(-1)[:n]
        if self.dtype == "int8":
            payload = q.to(torch.int8).numpy().tobytes()
        else:  # two 4-bit values per byte, offset by 8 so they are unsigned
            u = (q + 8).to(torch.uint8)
            if n % 2:
                u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8)])
            payload = (u[0::2] | (u[1::2] << 4)).numpy().tobytes()
        return payload + scale.numpy().astype("<f4").tobytes()

    def decode(
        self, record: bytes | memoryview, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Record bytes → (params,) tensor. Raw float dtypes decode without a copy
        when no rank and no dtype change are asked for."""
        if len(record) < self.record_bytes:
            raise BankError(f"record has {len(record)} bytes, expected {self.record_bytes}")
        n = self.stored_values
        if self.dtype in TORCH_DTYPES:
            tdt = TORCH_DTYPES[self.dtype]
            buf = np.frombuffer(record, dtype=np.uint8, count=n * tdt.itemsize)
            vals = torch.from_numpy(buf.copy() if not buf.flags.writeable else buf).view(tdt)
        else:
            groups = math.ceil(n / QUANT_GROUP)
            nbytes = n if self.dtype == "int8" else math.ceil(n / 2)
            raw = np.frombuffer(record, dtype=np.uint8, count=nbytes)
            scale = torch.from_numpy(
                np.frombuffer(record, dtype="<f4", count=groups, offset=nbytes).copy()
            )
            if self.dtype == "int8":
                q = torch.from_numpy(raw.view(np.int8).astype(np.float32))
            else:
                b = torch.from_numpy(raw.astype(np.int16))
                q = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:n].float() - 8
            pad = torch.zeros(groups * QUANT_GROUP)
            pad[:n] = q
            vals = (pad.view(groups, QUANT_GROUP) * scale[:, None]).reshape(-1)[:n]
        if self.rank:
            vals = self._expand(vals.float())
        want = out_dtype or (
            vals.dtype if self.dtype in TORCH_DTYPES and not self.rank else torch.float32
        )
        return vals.to(want)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """(…, params) → {name: (…, *shape)} views, in layout order
        (`memtree.geometry.split_block`)."""
        return split_block(self.layout, flat)


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class LevelInfo:
    level: int
    multiplier: int
    n_blocks: int  # cluster slots in this file (B^l, or B^(l-1) for a per-subtree bank)
    first_cluster: int  # global id of slot 0 (non-zero in a per-subtree bank)
    params: int
    record_bytes: int
    stride: int
    file: str
    has_generic: bool

    @property
    def n_slots(self) -> int:
        return self.n_blocks + (1 if self.has_generic else 0)

    @property
    def file_bytes(self) -> int:
        return self.n_slots * self.stride

    def slot(self, cluster: int) -> int:
        """Slot of a global cluster id (or GENERIC)."""
        if cluster == GENERIC:
            if not self.has_generic:
                raise BankError(f"level {self.level}: this bank has no generic memory")
            return self.n_blocks
        local = cluster - self.first_cluster
        if not 0 <= local < self.n_blocks:
            raise BankError(
                f"level {self.level}: cluster {cluster} is not in this bank "
                f"(holds {self.first_cluster}…{self.first_cluster + self.n_blocks - 1})"
            )
        return local


@dataclass(frozen=True)
class BankInfo:
    """The parsed manifest."""

    root: Path
    manifest: dict[str, Any]
    anchor: AnchorShape
    memory: MemoryConfig
    dtype: str
    rank: int | None
    tree_id: str | None
    subtree: int | None
    levels: dict[int, LevelInfo]

    @property
    def generation(self) -> int:
        return int(self.manifest["generation"])

    def codec(self, level: int) -> RecordCodec:
        return RecordCodec(
            tuple(block_layout(self.anchor, self.memory, level)), self.dtype, self.rank
        )

    def level(self, level: int) -> LevelInfo:
        try:
            return self.levels[level]
        except KeyError:
            raise BankError(
                f"{self.root}: level {level} holds no memory (levels: {sorted(self.levels)})"
            ) from None


def _level_infos(
    anchor: AnchorShape,
    memory: MemoryConfig,
    dtype: str,
    rank: int | None,
    subtree: int | None,
    generic: bool,
) -> dict[int, LevelInfo]:
    out = {}
    B = memory.branching
    for lv in plan(anchor, memory).levels:
        if lv.multiplier == 0:
            continue
        codec = RecordCodec(tuple(block_layout(anchor, memory, lv.level)), dtype, rank)
        n_blocks = B ** (lv.level - 1) if subtree is not None else lv.n_blocks
        first = subtree * B ** (lv.level - 1) if subtree is not None else 0
        out[lv.level] = LevelInfo(
            level=lv.level,
            multiplier=lv.multiplier,
            n_blocks=n_blocks,
            first_cluster=first,
            params=codec.params,
            record_bytes=codec.record_bytes,
            stride=codec.stride,
            file=f"level-{lv.level}.bin",
            has_generic=generic,
        )
    return out


def build_manifest(
    *,
    anchor: AnchorShape,
    memory: MemoryConfig,
    dtype: str,
    rank: int | None,
    tree_id: str | None,
    subtree: int | None,
    generic: bool,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if dtype not in DTYPES:
        raise BankError(f"dtype {dtype!r} is not one of {list(DTYPES)}")
    if subtree is not None and not 0 <= subtree < memory.branching:
        raise BankError(f"subtree {subtree} must be in [0, {memory.branching})")
    levels = _level_infos(anchor, memory, dtype, rank, subtree, generic)
    if not levels:
        raise BankError(
            f"memory config {memory.multipliers} has no non-zero level; nothing to store"
        )
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "generation": 0,
        "tree_id": tree_id,
        "subtree": subtree,
        "anchor": to_dict(anchor),
        "memory": to_dict(memory),
        "dtype": dtype,
        "rank": rank,
        "align": ALIGN,
        "digest": "xxh3-128",
        "levels": {
            str(k): {f: getattr(v, f) for f in v.__dataclass_fields__} for k, v in levels.items()
        },
        "extra": extra or {},
    }
    manifest["layout_digest"] = layout_digest(manifest)
    return manifest


def layout_digest(manifest: dict[str, Any]) -> str:
    """Digest of the fields that decide how record bytes decode. Record digests cannot
    catch an edit of these (e.g. dtype bf16 → fp16 keeps every size), this does."""
    fixed = {
        k: manifest[k]
        for k in ("anchor", "memory", "dtype", "rank", "tree_id", "subtree", "align", "digest")
    }
    fixed["levels"] = {
        k: {f: v for f, v in lv.items() if f != "file"} for k, lv in manifest["levels"].items()
    }
    return xxhash.xxh3_128_hexdigest(json.dumps(fixed, sort_keys=True).encode())


def read_manifest(root: str | os.PathLike) -> BankInfo:
    root = Path(root)
    path = root / "manifest.json"
    restore_replaced_dir(root)
    if not path.exists():
        raise FileNotFoundError(f"{root}: not a memory bank (no manifest.json)")
    m = read_json(path)
    check_format(m, FORMAT, VERSION, path, error=BankError)
    anchor = from_dict(AnchorShape, m["anchor"], where="manifest.anchor")
    memory = from_dict(MemoryConfig, m["memory"], where="manifest.memory")
    levels = {int(k): LevelInfo(**v) for k, v in m["levels"].items()}
    info = BankInfo(
        root=root,
        manifest=m,
        anchor=anchor,
        memory=memory,
        dtype=m["dtype"],
        rank=m["rank"],
        tree_id=m["tree_id"],
        subtree=m["subtree"],
        levels=levels,
    )
    # The manifest must agree with what the geometry says these files hold.
    expect = _level_infos(
        anchor,
        memory,
        info.dtype,
        info.rank,
        info.subtree,
        any(v.has_generic for v in levels.values()),
    )
    if set(expect) != set(levels) or any(
        replace(v, file=expect[k].file) != expect[k] for k, v in levels.items()
    ):
        raise BankError(
            f"{path}: level table does not match its anchor/memory config (edited by hand?)"
        )
    if m.get("layout_digest") != layout_digest(m):
        raise BankError(
            f"{path}: anchor/memory/dtype/level fields do not match layout_digest (edited by hand?)"
        )
    return info


def is_url(path: str) -> bool:
    return "://" in path


def level_path(root: str | os.PathLike, lv: LevelInfo) -> str:
    """Where a level's file lives: in the bank directory, or wherever `relocate_level` moved it."""
    return lv.file if is_url(lv.file) or os.path.isabs(lv.file) else str(Path(root) / lv.file)


def _size(path: str) -> int | None:
    if is_url(path):
        fs, p = fsspec.core.url_to_fs(path)
        return fs.size(p) if fs.exists(p) else None
    return os.path.getsize(path) if os.path.exists(path) else None


def check_files(info: BankInfo) -> None:
    """Every level file and digest file exists with exactly the expected size."""
    for lv in info.levels.values():
        for p, size in (
            (level_path(info.root, lv), lv.file_bytes),
            (str(info.root / sums_name(lv)), lv.n_slots * DIGEST_BYTES),
        ):
            actual = _size(p)
            if actual is None:
                raise BankError(f"{p}: missing (level {lv.level})")
            if actual != size:
                raise BankError(
                    f"{p}: {actual:,} bytes, expected {size:,} "
                    f"(truncated or wrong file) for level {lv.level}"
                )


def sums_name(lv: LevelInfo) -> str:
    """Digests always stay in the bank directory, even when the level file moves."""
    return f"level-{lv.level}.sums"


def check_tree(info: BankInfo, tree: Any) -> None:
    """Refuse a tree the bank was not built for (compares clustering tree ids)."""
    tid = compute_tree_id(tree)
    if info.tree_id is None:
        raise BankError(f"{info.root}: bank is not bound to a tree; cannot check tree {tid}")
    if tid != info.tree_id:
        raise BankError(f"{info.root}: bank was built for tree {info.tree_id}, not tree {tid}")
    if tree.branching != info.memory.branching or tree.levels < info.memory.n_levels:
        raise BankError(
            f"{info.root}: bank needs branching {info.memory.branching} and {info.memory.n_levels} "
            f"levels; the tree has branching {tree.branching} and {tree.levels} levels"
        )


def verify_bank(root: str | os.PathLike, *, chunk_slots: int = 64) -> dict[str, Any]:
    """Check every record against its digest. Raises BankError naming the level,
    cluster and file of the first mismatch; returns counts when all pass."""
    info = read_manifest(root)
    check_files(info)
    checked = 0
    for lv in info.levels.values():
        sums = (info.root / sums_name(lv)).read_bytes()
        with _open_read(level_path(info.root, lv)) as f:
            for start in range(0, lv.n_slots, chunk_slots):
                n = min(chunk_slots, lv.n_slots - start)
                buf = memoryview(f.read(n * lv.stride))
                for i in range(n):
                    s = start + i
                    rec = buf[i * lv.stride : i * lv.stride + lv.record_bytes]
                    if digest(rec) != sums[s * DIGEST_BYTES : (s + 1) * DIGEST_BYTES]:
                        raise BankError(corrupt_message(info, lv, s))
                    checked += 1
    return {"blocks_checked": checked, "levels": sorted(info.levels), "generation": info.generation}


def _open_read(path: str):
    if is_url(path):
        return fsspec.open(path, "rb").open()
    return open(path, "rb")


def corrupt_message(info: BankInfo, lv: LevelInfo, slot: int) -> str:
    who = "generic memory" if slot == lv.n_blocks else f"cluster {lv.first_cluster + slot}"
    return (
        f"checksum mismatch: level {lv.level}, {who} (slot {slot}) "
        f"in {level_path(info.root, lv)}; the bank is corrupted"
    )
