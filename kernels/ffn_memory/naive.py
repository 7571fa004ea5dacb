"""Pure-torch reference for the fused FFN-memory read (forward and explicit backward).

It gathers every referenced block into an explicit (B, k, W, d) copy, which is
exactly what the Triton kernel avoids; it defines the semantics, is the CPU
implementation of the custom op, and checks the kernel's outputs and gradients.
Shapes are documented in `kernels.ffn_memory.op.ffn_memory`. All math is fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _gather(bank_w1: Tensor, bank_w2: Tensor, bank_w3: Tensor, block_idx: Tensor):
    """fp32 copies (B, k, W, d) of each pair's blocks, padding pairs zeroed, and the valid mask
    (B, k)."""
    valid = block_idx >= 0
    safe = block_idx.clamp(min=0)
    keep = valid[:, :, None, None]
    return tuple(
        torch.where(keep, w[safe].float(), 0.0) for w in (bank_w1, bank_w2, bank_w3)
    ), valid


def ffn_memory_naive(
    x: Tensor, bank_w1: Tensor, bank_w2: Tensor, bank_w3: Tensor, block_idx: Tensor
) -> Tensor:
    """Reference: x (B, S, d), bank_w* (N, W, d), block_idx int64 (B, k) with -1 = padding.

    Returns y (B, S, d) in x's dtype: Σ_j [silu(x W1[idx_j]ᵀ) ⊙ (x W2[idx_j]ᵀ)] W3[idx_j].
    Differentiable by autograd (the bank gradients come out dense).
    """
    (w1, w2, w3), _ = _gather(bank_w1, bank_w2, bank_w3, block_idx)  # (B, k, W, d)
    xf = x.float()
    h = F.silu(torch.einsum("bsd,bkwd->bksw", xf, w1)) * torch.einsum("bsd,bkwd->bksw", xf, w2)
    return torch.einsum("bksw,bkwd->bsd", h, w3).to(x.dtype)


def ffn_memory_naive_backward(
    dy: Tensor, x: Tensor, bank_w1: Tensor, bank_w2: Tensor, bank_w3: Tensor, block_idx: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Hand-written backward of `ffn_memory_naive` for the upstream gradient dy (B, S, d).

    Returns dx (B, S, d) in x's dtype and the per-pair weight gradients dw1, dw2, dw3,
    each (B, k, W, d) in fp32 (zero for padding pairs); summing them per block id gives
    the bank gradients.
    """
    (w1, w2, w3), valid = _gather(bank_w1, bank_w2, bank_w3, block_idx)  # (B, k, W, d)
    xf, dyf = x.float(), dy.float()
    a = torch.einsum("bsd,bkwd->bksw", xf, w1)  # (B, k, S, W)
    b = torch.einsum("bsd,bkwd->bksw", xf, w2)
    sig = torch.sigmoid(a)
    silu = a * sig
    dh = torch.einsum("bsd,bkwd->bksw", dyf, w3)
    da = dh * b * sig * (1 + a * (1 - sig))
    db = dh * silu
    dx = torch.einsum("bksw,bkwd->bsd", da, w1) + torch.einsum("bksw,bkwd->bsd", db, w2)
    keep = valid[:, :, None, None]
    dw1 = torch.einsum("bksw,bsd->bkwd", da, xf) * keep
    dw2 = torch.einsum("bksw,bsd->bkwd", db, xf) * keep
    dw3 = torch.einsum("bksw,bsd->bkwd", silu * b, dyf) * keep
    return dx.to(x.dtype), dw1, dw2, dw3
