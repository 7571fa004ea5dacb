"""Writing a whole memory bank: `write_bank`, atomic and under the bank's writer lock.

Apart from `memstore.format` (the on-disk layout, which `memstore.locking` reads to name a
bank's lock holders) because the write takes that lock: with it in `format`, the two modules
imported each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from memtree.bank_init import paper_block
from memtree.geometry import AnchorShape, MemoryConfig
from memtree.io import atomic_dir, atomic_write_json
from memtree.memstore.format import (
    DIGEST_BYTES,
    GENERIC,
    BankError,
    BankInfo,
    LevelInfo,
    RecordCodec,
    build_manifest,
    digest,
    read_manifest,
    sums_name,
)
from memtree.memstore.locking import bank_writer, exclusive_change

# a block's initial values from its (level, cluster) and the bank's record codec: (P,) fp32
Init = Callable[[int, int, RecordCodec], torch.Tensor]


def paper_init(seed: int, std: float = 0.02) -> Init:
    """`write_bank`'s init with the App. I values (`memtree.bank_init.paper_block`), as the
    trainer's bank starts from."""

    def init(level: int, cluster: int, codec: RecordCodec) -> torch.Tensor:
        return paper_block(codec.layout, seed=seed, level=level, cluster=cluster, std=std)

    return init


def zeros_init(level: int, cluster: int, codec: RecordCodec) -> torch.Tensor:
    return torch.zeros(codec.params)


def write_bank(
    root: str | os.PathLike,
    *,
    anchor: AnchorShape,
    memory: MemoryConfig,
    dtype: str = "bf16",
    rank: int | None = None,
    tree_id: str | None = None,
    subtree: int | None = None,
    generic: bool = True,
    init: Init | None = None,
    blocks: Callable[[int], Iterable[tuple[int, torch.Tensor]]] | None = None,
    extra: dict[str, Any] | None = None,
    progress: bool = False,
) -> BankInfo:
    """Write a complete bank atomically (temp dir, then one rename over any old one), holding
    the bank's writer lock (`memstore.locking`; another writer: `BankBusy` naming it).

    Values come from `blocks(level)` — an iterable of (cluster or GENERIC, flat tensor)
    covering every slot — or, when not given, from `init` (default: App. I init, seed 0).
    """
    manifest = build_manifest(
        anchor=anchor,
        memory=memory,
        dtype=dtype,
        rank=rank,
        tree_id=tree_id,
        subtree=subtree,
        generic=generic,
        extra=extra,
    )
    init = init or paper_init(0)
    with (
        bank_writer(root, operation="write"),
        atomic_dir(root, publish_guard=lambda: exclusive_change(root)) as tmp,
    ):
        info = BankInfo(
            root=tmp,
            manifest=manifest,
            anchor=anchor,
            memory=memory,
            dtype=dtype,
            rank=rank,
            tree_id=tree_id,
            subtree=subtree,
            levels={int(k): LevelInfo(**v) for k, v in manifest["levels"].items()},
        )
        for lv in info.levels.values():
            codec = info.codec(lv.level)
            sums = bytearray(lv.n_slots * DIGEST_BYTES)
            seen = np.zeros(lv.n_slots, dtype=bool)
            if blocks is not None:
                source = blocks(lv.level)
            else:
                ids = [lv.first_cluster + i for i in range(lv.n_blocks)] + (
                    [GENERIC] if generic else []
                )
                source = ((c, init(lv.level, c, codec)) for c in ids)
            pad = bytes(lv.stride - lv.record_bytes)
            with open(tmp / lv.file, "wb") as f:
                f.truncate(lv.file_bytes)
                for cluster, values in tqdm(
                    source,
                    total=lv.n_slots,
                    disable=not progress,
                    desc=f"level {lv.level}",
                    unit="block",
                ):
                    s = lv.slot(cluster)
                    rec = codec.encode(values)
                    f.seek(s * lv.stride)
                    f.write(rec + pad)
                    sums[s * DIGEST_BYTES : (s + 1) * DIGEST_BYTES] = digest(rec)
                    seen[s] = True
            if not seen.all():
                missing = [
                    lv.first_cluster + int(i) if i < lv.n_blocks else "generic"
                    for i in np.flatnonzero(~seen)
                ]
                raise BankError(
                    f"level {lv.level}: no values given for slots "
                    f"{missing[:10]}{' …' if len(missing) > 10 else ''}"
                )
            (tmp / sums_name(lv)).write_bytes(bytes(sums))
        atomic_write_json(tmp / "manifest.json", manifest)
    return read_manifest(root)
