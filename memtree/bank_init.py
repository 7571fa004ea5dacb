"""The memory blocks' initial values (seed 002 App. I), one definition for every bank.

The trainer's in-memory bank (training/bank.py) and memstore's bank writer (`memtree memstore
init --init paper`, `write_bank`'s default) must start from the same values, bit for bit, so that
a bank written to disk and a bank built in a training run agree. Both stages may import only this
bottom layer in common, so the initialisation lives here, beside the block layouts it fills
(`memtree.geometry`), and not in memstore's disk format. Unlike geometry it needs torch: the
values come from torch's generator and init functions, as the anchor's own do.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from memtree.geometry import TensorSpec, join_block


def paper_block(
    layout: Sequence[TensorSpec], *, seed: int, level: int, cluster: int, std: float = 0.02
) -> torch.Tensor:
    """One flat fp32 block (P,) laid out as `layout`, with the App. I initialisation,
    deterministic per (seed, level, cluster): memories have no effect at step 0 (FFN W3, LoRA B
    and KV values are zero); W1, W2 and KV keys are truncated normal (±2σ), LoRA A Kaiming
    uniform, as nn.Linear's own."""
    g = torch.Generator().manual_seed(
        int.from_bytes(
            hashlib.blake2b(f"{seed}:{level}:{cluster}".encode(), digest_size=8).digest(), "little"
        )
        >> 1
    )
    tensors = {}
    for t in layout:
        role = t.name.rsplit(".", 1)[-1]
        x = torch.zeros(t.shape)
        if role in ("w1", "w2", "k"):
            torch.nn.init.trunc_normal_(x, std=std, a=-2 * std, b=2 * std, generator=g)
        elif role.endswith("_a"):
            torch.nn.init.kaiming_uniform_(x, a=math.sqrt(5), generator=g)
        tensors[t.name] = x
    return join_block(layout, tensors)
