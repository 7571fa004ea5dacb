"""What both fused reads need to know about a block list on the host.

`count_blocks` is the sparse bank gradient's row count: data-dependent, so reading it is a host
sync; the ops' shared tables (`FFNTable`, `MemoryTable`) read it once for all the calls that
share them.
"""

from __future__ import annotations

import torch
from torch import Tensor


def count_blocks(block_idx: Tensor) -> int:
    """Distinct block ids block_idx (any shape, -1 = padding) references (a host sync)."""
    return int(torch.unique(block_idx[block_idx >= 0]).numel())


def needs_bank_grad(sparse_grad: bool, *banks: Tensor) -> bool:
    """Whether this call's backward will build a sparse bank gradient (so its row count is
    needed): sparse layout, autograd on, and some bank requiring grad."""
    return sparse_grad and torch.is_grad_enabled() and any(b.requires_grad for b in banks)
