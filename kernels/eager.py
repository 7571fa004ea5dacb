"""When a kernel op may skip its torch.library custom op and run its body directly.

Both fused reads (`kernels.memory_attention`, `kernels.ffn_memory`) are custom ops so that
torch.compile can trace them; in eager mode the custom op's own per-call work (dispatch,
default filling, the outputs' alias check) is host time, ~0.15 ms per forward+backward here,
and on a GPU a training step's fused reads are host-bound (bench/kernels/profile_reads.py). So eager
calls go through a plain autograd.Function with the same forward, context and backward; only
tracing (torch.compile, fake or functional tensors, dispatch modes) needs the custom op.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def plain(*tensors: Tensor) -> bool:
    """True for eager tensors (plain or parameters) with nothing tracing or intercepting."""
    return (
        not torch.compiler.is_compiling()
        and not is_in_torch_dispatch_mode()
        and all(type(t) in (Tensor, torch.nn.Parameter) for t in tensors)
    )
