"""Memory attention for per-sequence block lists through torch's scaled_dot_product_attention.

`memory_attention_sdpa` computes exactly `memory_attention` (same shapes and semantics, see
`kernels.memory_attention.op.memory_attention`) for block lists (B, k) by gathering each
sequence's blocks into a (B, H_kv, k·T, D) copy and calling SDPA, so the standard fused
kernels (flash, cuDNN, memory-efficient) do the work on a GPU. It is the fast standard path,
and the fair baseline for what the in-place Triton kernel saves (the gathered copy and,
with sparse_grad, the row-sparse bank gradient training pays anyway).

How each weighting reaches plain SDPA:
- unweighted: SDPA on the gathered blocks.
- "bias", the widened head: q' = [q, 1, 1, 0…], k' = [k, hi, lo, 0…] with hi + lo =
  log(w)/scale (the log-weight of the entry a key token belongs to, split in two so a bf16 k'
  keeps it to ~2^-16: `_widen`), padded to Dp = round_up(D + 2, 8) (the fused kernels want
  head dims in multiples of 8; v is padded too because flash wants equal head dims).
  With SDPA's scale set to the original 1/sqrt(D), q'·k'·scale = q·k·scale + log w exactly,
  so one joint softmax carries the router's log-prior and d(w) flows back through k'.
- "mix": a softmax per entry, i.e. SDPA batched over (B·k) with q repeated per entry, the
  entry outputs weighted by w and summed.

Padding entries (-1) gather zero K/V, and in the joint softmax their widened column holds a
huge negative logit, so they take no probability; a sequence with no valid entry then reads
a uniform average of zero values, i.e. zeros, with zero gradients. Unweighted calls widen
only when some entry is padding (one host read of that; always under torch.compile).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from memtree.kernels.memory_attention.op import check_arguments

# The widened column's value for padding tokens (before the scale): far enough below any
# real logit that exp() underflows to exactly 0 in fp32, yet finite so an all-padding row
# stays a uniform (zero) read instead of NaN. Capped for fp16, whose range is 65504.
_PAD_COLUMN = 1e30


def check_per_sequence(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None,
    weight_mode: str,
    path: str,
) -> None:
    """ValueError, naming `path` (the calling function), for arguments a per-sequence path
    cannot take: those `memory_attention` refuses (`op.check_arguments`), and per-token lists."""
    if block_idx.ndim == 3:
        raise ValueError(
            f"{path} takes per-sequence block lists (B, k) only; per-token lists "
            f"(B, S, k) {tuple(block_idx.shape)} need memory_attention"
        )
    try:
        check_arguments(q, bank_k, bank_v, block_idx, weights, weight_mode)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


class _SparseRows(torch.autograd.Function):
    """bank[ids] for sorted unique ids (U,), whose backward is a sparse COO gradient with
    exactly those row indices: what F.embedding(sparse=True) gives a 2-D table, for the
    (N, T, H_kv, D) bank (embedding wants bank.flatten(1), and a view's backward cannot
    reshape a sparse gradient)."""

    @staticmethod
    def forward(ctx, bank: Tensor, ids: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.bank_shape = bank.shape
        return bank.index_select(0, ids)  # (U, T, H_kv, D)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        return torch.sparse_coo_tensor(
            ids[None], grad.contiguous(), ctx.bank_shape, is_coalesced=True
        ), None


def _gather(bank: Tensor, block_idx: Tensor, valid: Tensor, ids: Tensor | None) -> Tensor:
    """(B, k, T, H_kv, D) copies of the listed blocks, zero for padding entries. ids: the
    batch's sorted unique block ids (sparse bank gradient through `_SparseRows`), or None
    for plain indexing (dense bank gradient)."""
    if ids is None:
        rows = bank[block_idx.clamp(min=0)]
        return torch.where(valid[:, :, None, None, None], rows, rows.new_zeros(()))
    rows = _SparseRows.apply(bank, ids)  # (U, T, H_kv, D)
    # one zero row past the U real ones serves every padding entry, also when U = 0
    rows = torch.cat([rows, rows.new_zeros((1, *rows.shape[1:]))])
    at = torch.searchsorted(ids, block_idx.clamp(min=0).contiguous())
    return rows[torch.where(valid, at, ids.numel())]


def _native_gqa(q: Tensor) -> bool:
    """Whether SDPA's enable_gqa keeps a fused kernel: only flash (CUDA, fp16/bf16) takes it;
    every other backend would fall back to the unfused math one, which is slower than
    repeating the (already copied) K/V heads."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q (B', H, S, E), k/v (B', H_kv, L, E) → (B', H, S, E)."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if _native_gqa(q):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def _widen(q: Tensor, kk: Tensor, vv: Tensor, column: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, H, S, D), kk/vv (B, H_kv, L, D), column (B, L) fp32, the value each key token's
    extra dimensions add to its logit → q' = [q, 1, 1, 0…], k' = [k, hi, lo, 0…], v' = [v, 0…],
    all with head dim Dp = round_up(D + 2, 8) (72 for D = 64, as with one column).

    The column is split in two, hi = column rounded to k's dtype and lo = the rest rounded
    again, so a bf16 k' carries log(w)/scale to ~2^-16 relative instead of bf16's 2^-8 (up to
    ~0.03 on a logit at D = 64, a 3 % error on a chapter's weight); the products with q's ones
    are exact and the kernels accumulate in fp32. hi is taken without gradient, so the whole
    gradient of the column flows once, through lo."""
    d = q.shape[-1]
    extra = -(d + 2) % 8  # zero dims after the two widened ones
    ones = q.new_ones((*q.shape[:3], 2))
    q2 = F.pad(torch.cat([q, ones], dim=-1), (0, extra))
    hi = column.detach().to(kk.dtype)
    lo = (column - hi.float()).to(kk.dtype)
    col = torch.stack([hi, lo], dim=-1)[:, None].expand(*kk.shape[:3], 2)  # (B, H_kv, L, 2)
    k2 = F.pad(torch.cat([kk, col], dim=-1), (0, extra))
    v2 = F.pad(vv, (0, extra + 2))
    return q2, k2, v2


def memory_attention_sdpa(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None = None,
    *,
    weight_mode: str = "bias",
    scale: float | None = None,
    sparse_grad: bool = False,
    return_lse: bool = False,
) -> Tensor:
    """`memory_attention` for per-sequence lists, by gathering the blocks and calling SDPA.

    Args:
        q: (B, H, S, D). bank_k, bank_v: (N, T, H_kv, D), H % H_kv == 0.
        block_idx: integer (B, k), -1 = padding; per-token lists (B, S, k) are refused
            (ValueError). A block repeated in a list counts once per entry, as in
            `memory_attention`.
        weights: None or (B, k); weight_mode "bias" (weights > 0, log-prior in one joint
            softmax, the widened head) or "mix" (a softmax per entry, outputs mixed).
        scale: the logits' scale, default 1/sqrt(D).
        sparse_grad: gather the batch's unique referenced rows so the banks' gradients are
            sparse COO tensors over exactly those block ids (like nn.Embedding(sparse=True);
            one host sync for the unique ids; for leaf banks, or upstream ops that take
            sparse gradients); False: plain indexing, dense bank-shaped gradients (fine for
            small computed banks).
        return_lse: not supported (SDPA does not return its log-sum-exp): ValueError.

    Returns:
        (B, H, S, D) in q's dtype; a sequence without valid entries reads zeros. The banks
        are read in q's dtype (the gathered copies are cast), the log-weights in fp32 and
        then split over two columns of k' (`_widen`), so low-precision runs keep them to
        ~2^-16 relative.
    """
    path = "memory_attention_sdpa"
    check_per_sequence(q, bank_k, bank_v, block_idx, weights, weight_mode, path)
    if return_lse:
        raise ValueError(
            f"{path}: return_lse is not supported (SDPA returns no log-sum-exp); "
            "use memory_attention or memory_attention_flex"
        )
    b, h, s, d = q.shape
    k = block_idx.shape[1]
    t = bank_k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    valid = block_idx >= 0  # (B, k)
    ids = torch.unique(block_idx[valid]) if sparse_grad else None  # (U,) sorted
    kk = _gather(bank_k, block_idx, valid, ids).to(q.dtype)  # (B, k, T, H_kv, D)
    vv = _gather(bank_v, block_idx, valid, ids).to(q.dtype)

    if weights is not None and weight_mode == "mix":
        # entries as batch: (B·k, H_kv, T, D) against q repeated per entry (B·k, H, S, D)
        kk = kk.permute(0, 1, 3, 2, 4).flatten(0, 1)
        vv = vv.permute(0, 1, 3, 2, 4).flatten(0, 1)
        qq = q[:, None].expand(b, k, h, s, d).flatten(0, 1)
        per_entry = _sdpa(qq, kk, vv, scale).unflatten(0, (b, k))  # (B, k, H, S, D)
        w = torch.where(valid, weights.float(), 0.0)  # (B, k); padding weighs nothing
        return torch.einsum("bkhsd,bk->bhsd", per_entry.float(), w).to(q.dtype)

    kk = kk.permute(0, 3, 1, 2, 4).flatten(2, 3)  # (B, H_kv, k·T, D)
    vv = vv.permute(0, 3, 1, 2, 4).flatten(2, 3)
    widen = (
        weights is not None or torch.compiler.is_compiling() or bool((~valid).any())
    )  # the host read: padding needs the widened column
    if not widen:
        return _sdpa(q, kk, vv, scale)
    pad = min(_PAD_COLUMN, torch.finfo(kk.dtype).max / 16)
    if weights is None:
        column = torch.zeros(valid.shape, dtype=torch.float32, device=q.device)
    else:
        # log() of 1 at padding keeps it finite, so its masked gradient is 0, not 0·inf
        column = torch.log(torch.where(valid, weights.float(), 1.0)) / scale
    column = torch.where(valid, column, -pad)  # (B, k)
    column = column[:, :, None].expand(b, k, t).flatten(1)  # (B, k·T), per key token
    q2, k2, v2 = _widen(q, kk, vv, column)
    return _sdpa(q2, k2, v2, scale)[..., :d]
