"""Memory attention for per-sequence block lists through torch's FlexAttention.

`memory_attention_flex` computes `memory_attention` (see
`kernels.memory_attention.op.memory_attention`) for block lists (B, k) in the joint-softmax
modes (unweighted, "bias") by reading the bank in place: the bank is viewed as one KV
sequence (1, H_kv, N·T, D) shared by every batch row, and a BlockMask whose KV block size is
the memory block size T lists each sequence's blocks (`BlockMask.from_kv_blocks`, every
listed block "full", so the compiled kernel visits only those and evaluates no mask). Bias
weights enter through a score_mod adding log w from a (B, N) table, through which
d(weights) flows. "mix" (a softmax per block) is not one joint softmax and is refused.

Lists must name distinct blocks (MoC's do): the block mask visits a block once, where
`memory_attention` counts a repeated entry once per entry. Padding entries (-1) are left out
of the mask; a sequence without valid entries reads zeros (lse -inf).

Eager FlexAttention is torch's reference implementation: it scores every query against the
whole bank (B, H, S, N·T) and masks with the mask_mod, so it is exact but dense; it is what
runs on the CPU. compile=None compiles flex_attention once per process on CUDA, where the
fused Triton kernel runs. That kernel needs D >= 16 and memory blocks of T tokens that its
tiles divide (see `memory_attention_flex`). Its backward writes the bank's gradient as a
(B, H_kv, N·T, D) buffer summed over B (dense, bank-sized), and building the BlockMask makes
(B, ceil(S/128), N) int32 tables, so it suits small per-step banks more than whole ones.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
from torch import Tensor

from memtree.kernels.memory_attention.sdpa import check_per_sequence

Q_BLOCK = 128  # the query tile of the block mask: every tile of a sequence lists the same blocks

_COMPILED: list = []  # torch.compile(flex_attention), made on first use


def flex_available() -> bool:
    """Whether this torch has FlexAttention with BlockMask.from_kv_blocks."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


def _flex_fn(compile: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if not compile:
        return flex_attention
    if not _COMPILED:
        _COMPILED.append(torch.compile(flex_attention))
    return _COMPILED[0]


@functools.cache
def _lse_kwargs() -> dict:
    """How this torch asks flex_attention for the log-sum-exp: return_aux=AuxRequest(lse=True)
    where it exists (newer torch deprecates return_lse for it), else return_lse=True."""
    from torch.nn.attention import flex_attention as fa

    if (
        hasattr(fa, "AuxRequest")
        and "return_aux" in inspect.signature(fa.flex_attention).parameters
    ):
        return {"return_aux": fa.AuxRequest(lse=True)}
    return {"return_lse": True}


def _block_mask(block_idx: Tensor, valid: Tensor, member: Tensor, n: int, t: int, s: int):
    """The BlockMask of lists block_idx (B, k) over the bank as one KV sequence of N·T
    tokens: every query tile names the sequence's valid blocks, all as full blocks (no
    mask_mod in the compiled kernel); the mask_mod (member (B, N) bool, read by eager flex,
    which ignores the block tables) says the same per token."""
    from torch.nn.attention.flex_attention import BlockMask

    b = block_idx.shape[0]
    q_tiles = -(-s // Q_BLOCK)
    # valid ids first (ascending), then padding as block 0, which the counts leave unread;
    # the tables' last dim must span all N blocks (from_kv_blocks transposes them densely)
    order = torch.where(valid, block_idx, n).sort(dim=1).values
    order = torch.where(order == n, 0, order).to(torch.int32)[:, :n]
    listed = order.new_zeros((b, n))
    listed[:, : order.shape[1]] = order
    full_idx = listed[:, None, None, :].expand(b, 1, q_tiles, n).contiguous()
    full_num = valid.sum(1, dtype=torch.int32)[:, None, None].expand(b, 1, q_tiles).contiguous()
    partial_num = torch.zeros_like(full_num)
    partial_idx = torch.zeros_like(full_idx)

    def mask_mod(bi, hi, qi, kvi):
        return member[bi, kvi // t]

    return BlockMask.from_kv_blocks(
        partial_num,
        partial_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(Q_BLOCK, t),
        mask_mod=mask_mod,
        seq_lengths=(s, n * t),
    )


def _as_sequence(bank: Tensor) -> Tensor:
    """(N, T, H_kv, D) → (1, H_kv, N·T, D): a view when the bank's block rows are evenly
    spaced (bank.stride(0) == T·bank.stride(1), e.g. a contiguous bank), else a copy."""
    n, t, h_kv, d = bank.shape
    return bank.permute(2, 0, 1, 3).reshape(h_kv, n * t, d)[None]


def memory_attention_flex(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None = None,
    *,
    weight_mode: str = "bias",
    scale: float | None = None,
    return_lse: bool = False,
    compile: bool | None = None,
    kernel_options: dict | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`memory_attention` for per-sequence lists of distinct blocks, by FlexAttention.

    Args:
        q: (B, H, S, D). bank_k, bank_v: (N, T, H_kv, D) in q's dtype, H % H_kv == 0; read
            in place (`_as_sequence`).
        block_idx: integer (B, k) of distinct block ids per row, -1 = padding; per-token lists
            are refused (ValueError).
        weights: None or (B, k) > 0 with weight_mode "bias" (log w added to the block's
            logits); "mix" is refused (ValueError): a softmax per block is no joint softmax.
        scale: the logits' scale, default 1/sqrt(D).
        return_lse: also return lse (B, H, S) fp32, the log-sum-exp of the scaled logits
            (log-weights included), -inf for a query without valid blocks; differentiable.
        compile: run torch.compile(flex_attention) (made once per process); None: on CUDA
            only (eager flex is torch's dense reference, see the module docstring).
        kernel_options: passed to flex_attention (tile sizes of the compiled kernel).

    The compiled CUDA kernel needs D >= 16, and T (its KV block size) and the 128-token
    query tile divisible by its tiles. torch 2.7 checks the default configuration's tiles
    (kernel_options cannot lower them): forward BLOCK_N 128 for bf16/fp16 D=64 on
    H100/H200, 64 for bf16 D=128 (and other D), 32 for fp32 D=64; backward (BLOCK1, BLOCK2)
    (16, 16) for fp32, (64, 64) for bf16 D=64 and (64, 128) for D=128 on H100/H200,
    (32, 128) for bf16 D>=64 on A100. Newer torch honours kernel_options' forward BLOCK_M /
    BLOCK_N but still checks the backward against its defaults. So T must be a multiple of
    16 at the least and of 128 to train in bf16 everywhere; other T run eagerly.

    Returns:
        out (B, H, S, D) in q's dtype, or (out, lse) with return_lse.
    """
    path = "memory_attention_flex"
    check_per_sequence(q, bank_k, bank_v, block_idx, weights, weight_mode, path)
    if weights is not None and weight_mode == "mix":
        raise ValueError(
            f"{path}: weight_mode 'mix' (a softmax per block, outputs mixed by the "
            "weights) is not one joint softmax, which is all FlexAttention "
            "computes; use memory_attention or memory_attention_sdpa"
        )
    if not flex_available():
        raise ValueError(f"{path}: this torch has no FlexAttention with BlockMask.from_kv_blocks")
    if bank_k.dtype != q.dtype or bank_v.dtype != q.dtype:
        raise ValueError(
            f"{path}: the bank is read in place, so it must be in q's dtype "
            f"{q.dtype}, got {bank_k.dtype} and {bank_v.dtype}"
        )
    b, h, s, d = q.shape
    n, t, h_kv, _ = bank_k.shape
    compile = q.is_cuda if compile is None else compile
    if compile and q.is_cuda and (d < 16 or t % 16):
        raise ValueError(
            f"{path}: the compiled CUDA kernel needs D >= 16 and T a multiple of "
            f"16 (got D={d}, T={t}); pass compile=False for eager flex"
        )
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    valid = block_idx >= 0  # (B, k)
    # padding entries write into a dump column N, cut off after
    at = torch.where(valid, block_idx, n).long()
    member = torch.zeros((b, n + 1), dtype=torch.bool, device=q.device)
    member = member.scatter(1, at, True)[:, :n]  # (B, N)
    block_mask = _block_mask(block_idx, valid, member, n, t, s)

    score_mod = None
    if weights is not None:
        logw = torch.log(torch.where(valid, weights.float(), 1.0))  # (B, k) fp32
        # distinct ids: one write per block, so the gradient of each weight is its block's
        table = logw.new_zeros((b, n + 1)).scatter_add(1, at, logw)[:, :n]  # (B, N)

        def score_mod(score, bi, hi, qi, kvi):
            return score + table[bi, kvi // t]

    flex = _flex_fn(compile)
    extra = dict(_lse_kwargs()) if return_lse else {}
    res = flex(
        q,
        _as_sequence(bank_k),
        _as_sequence(bank_v),
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=h != h_kv,
        kernel_options=kernel_options,
        **extra,
    )
    if not return_lse:
        return res
    out, aux = res
    lse = aux if isinstance(aux, Tensor) else aux.lse  # (B, H, S); AuxOutput on newer torch
    return out, lse.float()
