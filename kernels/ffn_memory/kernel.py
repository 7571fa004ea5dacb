"""Triton grouped-GEMM kernels for the FFN-memory read, forward and backward.

Work is grouped by bank block, MoE style: the (sequence, block) pairs are
sorted by block id (`group_pairs`), and the S rows of every pair that uses one
block are concatenated into that block's *segment* (n_b·S rows). A row tile of
a segment can span several sequences, so one load of a weight tile serves
every sequence that references the block; no gathered copy of the bank is
made. Each kernel's grid is (sorted pair position, tile, ...): the programs of
the n_b positions of a segment together cover its cdiv(n_b·S, BM) row tiles,
the rest return at once, so shapes stay static (no host sync, no tile table).

Forward (two kernels): `_up` writes H = silu(X W1ᵀ) ⊙ (X W2ᵀ) per segment row
(P·S, W) in x's dtype; `_down` adds H W3 into an fp32 (B, S, d) buffer with
atomics, because a sequence's k blocks live in k different segments.
H is not saved for backward: `_bwd_h` recomputes X W1ᵀ and X W2ᵀ (two of the
backward's eight GEMMs) together with dH = dY W3ᵀ, so autograd keeps nothing
beyond the inputs, where the gather formulation keeps four (B, S, k·W)
activations and three (B, k, W, d) weight copies. `_dx` adds dA W1 + dB W2
into an fp32 dX buffer; `_dw` gives each unique block one program per
(W, d) tile that reduces over its whole segment and writes the block's
gradient slot directly (deterministic, no atomics, no bank-sized buffer).
The price is balance: a block every sequence shares reduces B·S rows in one
program per tile while a leaf block reduces S.

Operands are cast to x's dtype for tl.dot (the model casts fetched blocks the
same way) and accumulate in fp32; fp32 operands use TF32 only when
torch.backends.cuda.matmul.allow_tf32 is set, as torch's own matmuls do. On
CPU (TRITON_INTERPRET=1) every operand is converted to fp32 first, because the
interpreter's bf16 arithmetic is broken. Row arithmetic is int32, so
B·k·S < 2³¹.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor


class PairGroups(NamedTuple):
    """The (sequence, block) pairs sorted by block id; every field is (P,), P = B·k."""

    order: Tensor  # pair index b·k + j at each sorted position
    key: Tensor  # block id at each sorted position; N for padding, so padding sorts last
    seg_start: Tensor  # first sorted position of the position's segment
    seg_end: Tensor  # one past its last
    slot: Tensor  # rank of the position's block among the referenced blocks (its gradient slot)
    is_leader: Tensor  # bool: first position of a real block's segment


def group_pairs(block_idx: Tensor, n_blocks: int) -> PairGroups:
    """Sort the pairs of block_idx (B, k) by block id, with static shapes and no host sync."""
    flat = block_idx.reshape(-1)
    key, order = torch.sort(torch.where(flat >= 0, flat, n_blocks), stable=True)
    seg_start = torch.searchsorted(key, key, right=False)
    seg_end = torch.searchsorted(key, key, right=True)
    pos = torch.arange(flat.numel(), device=flat.device)
    is_leader = (seg_start == pos) & (key < n_blocks)
    slot = torch.cumsum(is_leader, 0) - 1
    return PairGroups(order, key, seg_start, seg_end, slot, is_leader)


def pack_groups(groups: PairGroups) -> Tensor:
    """The groups as one (6, P) int64 tensor (what a shared table passes through the custom
    ops, whose schema takes tensors): order, key, seg_start, seg_end, slot, is_leader."""
    return torch.stack([*groups[:5], groups.is_leader.long()])


def unpack_groups(packed: Tensor) -> PairGroups:
    """Inverse of `pack_groups`: views of packed (6, P), is_leader as bool."""
    order, key, seg_start, seg_end, slot, leader = packed.unbind(0)
    return PairGroups(order, key, seg_start, seg_end, slot, leader.bool())


def slot_ids(groups: PairGroups, num_slots: int) -> Tensor:
    """Block id held by each gradient slot (num_slots,) int64; -1 for slots past the referenced
    blocks."""
    ids = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=groups.key.device)
    # Non-leaders all write to the spare last entry, which is dropped.
    target = torch.where(groups.is_leader, groups.slot, num_slots)
    return ids.scatter_(0, target, torch.where(groups.is_leader, groups.key, -1))[:num_slots]


# Per-kernel tiles and launch options on CUDA: tensor-core sized, and the largest for
# which sm_90 ptxas reports no register spills with bf16, fp16 or fp32 operands (checked
# by compiling offline; none of this has been timed on a GPU). On the interpreter,
# larger tiles would mean fewer (slow, Python-level) programs, but 32 keeps several
# tiles and ragged masks in play at test shapes.
_CUDA = {
    "up": {"BM": 64, "BW": 64, "BK": 32, "num_warps": 8, "num_stages": 3},
    "down": {"BM": 64, "BW": 64, "BD": 64, "num_warps": 8, "num_stages": 3},
    "bwd_h": {"BM": 64, "BW": 64, "BK": 32, "num_warps": 8, "num_stages": 3},
    "dx": {"BM": 64, "BW": 32, "BD": 64, "num_warps": 8, "num_stages": 3},
    "dw": {"BW": 64, "BD": 64, "BR": 32, "num_warps": 8, "num_stages": 3},
}
_INTERPRETER = {
    name: {key: 32 if key.startswith("B") else v for key, v in cfg.items()}
    for name, cfg in _CUDA.items()
}


def interpreting() -> bool:
    """Whether the kernels were defined under TRITON_INTERPRET=1 (so they can run on CPU).

    Asked of the jitted object rather than the environment, which may have changed since
    import; by exclusion, because `triton.runtime.interpreter` is not an attribute of
    `triton.runtime` on every Triton release (3.6 does not import it)."""
    return not isinstance(_up, triton.runtime.JITFunction)


@triton.jit
def _segment_rows(
    pid_pos, pid_tile, key_ptr, start_ptr, end_ptr, order_ptr, S, K, N_BLOCKS, BM: tl.constexpr
):
    """This program's row tile of its segment.

    Returns (idle, block id, X row ids (BM,), row mask (BM,), the segment's first buffer
    row, the tile's first row within the segment, the segment's row count).
    """
    blk = tl.load(key_ptr + pid_pos)  # int64, it scales the bank's block stride
    # Row arithmetic in int32 (B·k·S < 2³¹): int64 division costs registers and spills.
    seg_start = tl.load(start_ptr + pid_pos).to(tl.int32)
    n_rows = (tl.load(end_ptr + pid_pos).to(tl.int32) - seg_start) * S
    row0 = ((pid_pos - seg_start) * tl.cdiv(S, BM) + pid_tile) * BM
    idle = (blk >= N_BLOCKS) | (row0 >= n_rows)
    r = row0 + tl.arange(0, BM)  # (BM,) rows within the segment
    mask = r < n_rows
    pair = tl.load(order_ptr + seg_start + r // S, mask=mask, other=0).to(tl.int32)
    x_row = ((pair // K) * S + r % S).to(tl.int64)  # rows of the (B·S, d) token matrix
    return idle, blk, x_row, mask, seg_start.to(tl.int64) * S, row0, n_rows


@triton.jit
def _weight_t(w_ptr, blk, sn, sw, D, W, w0, BK: tl.constexpr, BW: tl.constexpr):
    """Block pointer to the (BK, BW) tile W[blk, w0:w0+BW, 0:BK]ᵀ."""
    return tl.make_block_ptr(
        w_ptr + blk * sn,
        shape=(D, W),
        strides=(1, sw),
        offsets=(0, w0),
        block_shape=(BK, BW),
        order=(0, 1),
    )


@triton.jit
def _weight(w_ptr, blk, sn, sw, D, W, d0, BW: tl.constexpr, BD: tl.constexpr):
    """Block pointer to the (BW, BD) tile W[blk, 0:BW, d0:d0+BD]."""
    return tl.make_block_ptr(
        w_ptr + blk * sn,
        shape=(W, D),
        strides=(sw, 1),
        offsets=(0, d0),
        block_shape=(BW, BD),
        order=(1, 0),
    )


@triton.jit
def _rows(buf_ptr, seg_row, n_rows, W, row0, w0, BM: tl.constexpr, BW: tl.constexpr):
    """Block pointer to a (BM, BW) tile of a segment's rows in a (P·S, W) buffer."""
    return tl.make_block_ptr(
        buf_ptr + seg_row * W,
        shape=(n_rows, W),
        strides=(W, 1),
        offsets=(row0, w0),
        block_shape=(BM, BW),
        order=(1, 0),
    )


@triton.jit
def _rows_t(buf_ptr, seg_row, n_rows, W, w0, BW: tl.constexpr, BR: tl.constexpr):
    """Block pointer to the transposed (BW, BR) tile of a segment's first BR rows in a buffer."""
    return tl.make_block_ptr(
        buf_ptr + seg_row * W,
        shape=(W, n_rows),
        strides=(1, W),
        offsets=(w0, 0),
        block_shape=(BW, BR),
        order=(0, 1),
    )


@triton.jit
def _up(
    x_ptr,
    w1_ptr,
    w2_ptr,
    h_ptr,
    key_ptr,
    start_ptr,
    end_ptr,
    order_ptr,
    S,
    K,
    D,
    W,
    N_BLOCKS,
    s1n,
    s1w,
    s2n,
    s2w,
    BM: tl.constexpr,
    BW: tl.constexpr,
    BK: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    idle, blk, x_row, rmask, seg_row, row0, n_rows = _segment_rows(
        tl.program_id(0),
        tl.program_id(1),
        key_ptr,
        start_ptr,
        end_ptr,
        order_ptr,
        S,
        K,
        N_BLOCKS,
        BM,
    )
    if idle:
        return
    w0 = tl.program_id(2) * BW
    ck = tl.arange(0, BK)
    xp = x_ptr + x_row[:, None] * D + ck[None, :]  # (BM, BK) gathered token rows
    w1p = _weight_t(w1_ptr, blk, s1n, s1w, D, W, w0, BK, BW)
    w2p = _weight_t(w2_ptr, blk, s2n, s2w, D, W, w0, BK, BW)
    acc_a = tl.zeros((BM, BW), tl.float32)
    acc_b = tl.zeros((BM, BW), tl.float32)
    for k0 in range(0, D, BK):
        xt = tl.load(xp, mask=rmask[:, None] & (k0 + ck < D)[None, :], other=0.0).to(DOT)
        w1t = tl.load(w1p, boundary_check=(0, 1), padding_option="zero").to(DOT)  # (BK, BW)
        w2t = tl.load(w2p, boundary_check=(0, 1), padding_option="zero").to(DOT)
        acc_a = tl.dot(xt, w1t, acc_a, input_precision=PREC)  # (BM, BW)
        acc_b = tl.dot(xt, w2t, acc_b, input_precision=PREC)
        xp += BK
        w1p = tl.advance(w1p, (BK, 0))
        w2p = tl.advance(w2p, (BK, 0))
    h = acc_a * tl.sigmoid(acc_a) * acc_b
    hp = _rows(h_ptr, seg_row, n_rows, W, row0, w0, BM, BW)
    tl.store(hp, h.to(h_ptr.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _down(
    h_ptr,
    w3_ptr,
    y_ptr,
    key_ptr,
    start_ptr,
    end_ptr,
    order_ptr,
    S,
    K,
    D,
    W,
    N_BLOCKS,
    s3n,
    s3w,
    BM: tl.constexpr,
    BW: tl.constexpr,
    BD: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    idle, blk, x_row, rmask, seg_row, row0, n_rows = _segment_rows(
        tl.program_id(0),
        tl.program_id(1),
        key_ptr,
        start_ptr,
        end_ptr,
        order_ptr,
        S,
        K,
        N_BLOCKS,
        BM,
    )
    if idle:
        return
    d0 = tl.program_id(2) * BD
    hp = _rows(h_ptr, seg_row, n_rows, W, row0, 0, BM, BW)
    w3p = _weight(w3_ptr, blk, s3n, s3w, D, W, d0, BW, BD)
    acc = tl.zeros((BM, BD), tl.float32)
    for _ in range(0, W, BW):
        h = tl.load(hp, boundary_check=(0, 1), padding_option="zero").to(DOT)  # (BM, BW)
        w3 = tl.load(w3p, boundary_check=(0, 1), padding_option="zero").to(DOT)  # (BW, BD)
        acc = tl.dot(h, w3, acc, input_precision=PREC)
        hp = tl.advance(hp, (0, BW))
        w3p = tl.advance(w3p, (BW, 0))
    d = d0 + tl.arange(0, BD)
    tl.atomic_add(
        y_ptr + x_row[:, None] * D + d[None, :], acc, mask=rmask[:, None] & (d < D)[None, :]
    )


@triton.jit
def _bwd_h(
    x_ptr,
    dy_ptr,
    w1_ptr,
    w2_ptr,
    w3_ptr,
    h_ptr,
    da_ptr,
    db_ptr,
    key_ptr,
    start_ptr,
    end_ptr,
    order_ptr,
    S,
    K,
    D,
    W,
    N_BLOCKS,
    s1n,
    s1w,
    s2n,
    s2w,
    s3n,
    s3w,
    BM: tl.constexpr,
    BW: tl.constexpr,
    BK: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    idle, blk, x_row, rmask, seg_row, row0, n_rows = _segment_rows(
        tl.program_id(0),
        tl.program_id(1),
        key_ptr,
        start_ptr,
        end_ptr,
        order_ptr,
        S,
        K,
        N_BLOCKS,
        BM,
    )
    if idle:
        return
    w0 = tl.program_id(2) * BW
    ck = tl.arange(0, BK)
    offs = x_row[:, None] * D + ck[None, :]  # (BM, BK) gathered token rows
    w1p = _weight_t(w1_ptr, blk, s1n, s1w, D, W, w0, BK, BW)
    w2p = _weight_t(w2_ptr, blk, s2n, s2w, D, W, w0, BK, BW)
    w3p = _weight_t(w3_ptr, blk, s3n, s3w, D, W, w0, BK, BW)
    acc_a = tl.zeros((BM, BW), tl.float32)
    acc_b = tl.zeros((BM, BW), tl.float32)
    acc_dh = tl.zeros((BM, BW), tl.float32)
    for k0 in range(0, D, BK):
        xm = rmask[:, None] & (k0 + ck < D)[None, :]
        xt = tl.load(x_ptr + offs, mask=xm, other=0.0).to(DOT)
        dyt = tl.load(dy_ptr + offs, mask=xm, other=0.0).to(DOT)
        w1t = tl.load(w1p, boundary_check=(0, 1), padding_option="zero").to(DOT)  # (BK, BW)
        w2t = tl.load(w2p, boundary_check=(0, 1), padding_option="zero").to(DOT)
        w3t = tl.load(w3p, boundary_check=(0, 1), padding_option="zero").to(DOT)
        acc_a = tl.dot(xt, w1t, acc_a, input_precision=PREC)  # (BM, BW)
        acc_b = tl.dot(xt, w2t, acc_b, input_precision=PREC)
        acc_dh = tl.dot(dyt, w3t, acc_dh, input_precision=PREC)
        offs += BK
        w1p = tl.advance(w1p, (BK, 0))
        w2p = tl.advance(w2p, (BK, 0))
        w3p = tl.advance(w3p, (BK, 0))
    sig = tl.sigmoid(acc_a)
    silu = acc_a * sig
    tl.store(
        _rows(h_ptr, seg_row, n_rows, W, row0, w0, BM, BW),
        (silu * acc_b).to(h_ptr.dtype.element_ty),
        boundary_check=(0, 1),
    )
    tl.store(
        _rows(db_ptr, seg_row, n_rows, W, row0, w0, BM, BW),
        (acc_dh * silu).to(db_ptr.dtype.element_ty),
        boundary_check=(0, 1),
    )
    da = acc_dh * acc_b * sig * (1.0 + acc_a * (1.0 - sig))
    tl.store(
        _rows(da_ptr, seg_row, n_rows, W, row0, w0, BM, BW),
        da.to(da_ptr.dtype.element_ty),
        boundary_check=(0, 1),
    )


@triton.jit
def _dx(
    da_ptr,
    db_ptr,
    w1_ptr,
    w2_ptr,
    dx_ptr,
    key_ptr,
    start_ptr,
    end_ptr,
    order_ptr,
    S,
    K,
    D,
    W,
    N_BLOCKS,
    s1n,
    s1w,
    s2n,
    s2w,
    BM: tl.constexpr,
    BW: tl.constexpr,
    BD: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    idle, blk, x_row, rmask, seg_row, row0, n_rows = _segment_rows(
        tl.program_id(0),
        tl.program_id(1),
        key_ptr,
        start_ptr,
        end_ptr,
        order_ptr,
        S,
        K,
        N_BLOCKS,
        BM,
    )
    if idle:
        return
    d0 = tl.program_id(2) * BD
    dap = _rows(da_ptr, seg_row, n_rows, W, row0, 0, BM, BW)
    dbp = _rows(db_ptr, seg_row, n_rows, W, row0, 0, BM, BW)
    w1p = _weight(w1_ptr, blk, s1n, s1w, D, W, d0, BW, BD)
    w2p = _weight(w2_ptr, blk, s2n, s2w, D, W, d0, BW, BD)
    acc = tl.zeros((BM, BD), tl.float32)
    for _ in range(0, W, BW):
        da = tl.load(dap, boundary_check=(0, 1), padding_option="zero").to(DOT)  # (BM, BW)
        db = tl.load(dbp, boundary_check=(0, 1), padding_option="zero").to(DOT)
        w1 = tl.load(w1p, boundary_check=(0, 1), padding_option="zero").to(DOT)  # (BW, BD)
        w2 = tl.load(w2p, boundary_check=(0, 1), padding_option="zero").to(DOT)
        acc = tl.dot(da, w1, acc, input_precision=PREC)  # (BM, BD)
        acc = tl.dot(db, w2, acc, input_precision=PREC)
        dap = tl.advance(dap, (0, BW))
        dbp = tl.advance(dbp, (0, BW))
        w1p = tl.advance(w1p, (BW, 0))
        w2p = tl.advance(w2p, (BW, 0))
    d = d0 + tl.arange(0, BD)
    tl.atomic_add(
        dx_ptr + x_row[:, None] * D + d[None, :], acc, mask=rmask[:, None] & (d < D)[None, :]
    )


@triton.jit
def _dw(
    x_ptr,
    dy_ptr,
    h_ptr,
    da_ptr,
    db_ptr,
    g1_ptr,
    g2_ptr,
    g3_ptr,
    slot_ptr,
    key_ptr,
    start_ptr,
    end_ptr,
    order_ptr,
    S,
    K,
    D,
    W,
    N_BLOCKS,
    BW: tl.constexpr,
    BD: tl.constexpr,
    BR: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    seg_start = tl.load(start_ptr + pid).to(tl.int32)
    if (seg_start != pid) | (tl.load(key_ptr + pid) >= N_BLOCKS):
        return  # not the first position of a real block's segment
    n_rows = (tl.load(end_ptr + pid).to(tl.int32) - seg_start) * S
    w0 = tl.program_id(1) * BW
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    dmask = d < D
    cr = tl.arange(0, BR)
    seg_row = seg_start.to(tl.int64) * S
    hp = _rows_t(h_ptr, seg_row, n_rows, W, w0, BW, BR)
    dap = _rows_t(da_ptr, seg_row, n_rows, W, w0, BW, BR)
    dbp = _rows_t(db_ptr, seg_row, n_rows, W, w0, BW, BR)
    acc1 = tl.zeros((BW, BD), tl.float32)
    acc2 = tl.zeros((BW, BD), tl.float32)
    acc3 = tl.zeros((BW, BD), tl.float32)
    for r0 in range(0, n_rows, BR):
        r = r0 + cr
        rmask = r < n_rows
        pair = tl.load(order_ptr + seg_start + r // S, mask=rmask, other=0).to(tl.int32)
        x_row = ((pair // K) * S + r % S).to(tl.int64)
        offs = x_row[:, None] * D + d[None, :]  # (BR, BD) gathered token rows
        xm = rmask[:, None] & dmask[None, :]
        xt = tl.load(x_ptr + offs, mask=xm, other=0.0).to(DOT)
        dyt = tl.load(dy_ptr + offs, mask=xm, other=0.0).to(DOT)
        da_t = tl.load(dap, boundary_check=(0, 1), padding_option="zero").to(DOT)
        db_t = tl.load(dbp, boundary_check=(0, 1), padding_option="zero").to(DOT)
        h_t = tl.load(hp, boundary_check=(0, 1), padding_option="zero").to(DOT)
        acc1 = tl.dot(da_t, xt, acc1, input_precision=PREC)  # (BW, BD)
        acc2 = tl.dot(db_t, xt, acc2, input_precision=PREC)
        acc3 = tl.dot(h_t, dyt, acc3, input_precision=PREC)
        dap = tl.advance(dap, (0, BR))
        dbp = tl.advance(dbp, (0, BR))
        hp = tl.advance(hp, (0, BR))
    w = w0 + tl.arange(0, BW)
    out = tl.load(slot_ptr + pid) * W * D + (w[:, None] * D + d[None, :])
    m = (w < W)[:, None] & dmask[None, :]
    tl.store(g1_ptr + out, acc1.to(g1_ptr.dtype.element_ty), mask=m)
    tl.store(g2_ptr + out, acc2.to(g2_ptr.dtype.element_ty), mask=m)
    tl.store(g3_ptr + out, acc3.to(g3_ptr.dtype.element_ty), mask=m)


_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _launch_params(x: Tensor) -> tuple[dict[str, dict], dict]:
    """Per-kernel tiles, and the dot operand dtype and fp32 precision, for x's device and dtype."""
    if x.device.type == "cpu":
        return _INTERPRETER, {"DOT": tl.float32, "PREC": "ieee"}
    prec = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"  # as torch's fp32 matmuls
    return _CUDA, {"DOT": _TL_DTYPE[x.dtype], "PREC": prec}


def launch_configs(x: Tensor) -> dict[str, dict]:
    """The per-kernel tiles the launches read for x's device ({"up", "down", "bwd_h", "dx",
    "dw"} -> keywords): the live table, which bench/kernels/tune_ffn.py changes and restores."""
    return _launch_params(x)[0]


def _common_args(groups: PairGroups, s: int, k: int, d: int, w: int, n: int) -> tuple:
    return (groups.key, groups.seg_start, groups.seg_end, groups.order, s, k, d, w, n)


def _bank_strides(*banks: Tensor) -> tuple[int, ...]:
    return tuple(v for b in banks for v in (b.stride(0), b.stride(1)))


def ffn_memory_forward(
    x: Tensor,
    bank_w1: Tensor,
    bank_w2: Tensor,
    bank_w3: Tensor,
    block_idx: Tensor,
    groups: PairGroups | None = None,
) -> Tensor:
    """Triton forward: x (B, S, d), bank_w* (N, W, d), block_idx (B, k) -> y (B, S, d) in x's
    dtype. groups: `group_pairs(block_idx, N)` built beforehand (shared by several calls), or
    None to build them here."""
    bsz, s, d = x.shape
    n, w, _ = bank_w1.shape
    k = block_idx.shape[1]
    p = bsz * k
    y = torch.zeros(bsz, s, d, device=x.device, dtype=torch.float32)
    if p == 0 or s == 0 or d == 0 or w == 0:
        return y.to(x.dtype)
    x = x.contiguous()
    t, dot = _launch_params(x)
    groups = group_pairs(block_idx, n) if groups is None else groups
    common = _common_args(groups, s, k, d, w, n)
    h = torch.empty(p * s, w, device=x.device, dtype=x.dtype)  # segment-ordered rows
    up, down = t["up"], t["down"]
    _up[(p, triton.cdiv(s, up["BM"]), triton.cdiv(w, up["BW"]))](
        x, bank_w1, bank_w2, h, *common, *_bank_strides(bank_w1, bank_w2), **up, **dot
    )
    _down[(p, triton.cdiv(s, down["BM"]), triton.cdiv(d, down["BD"]))](
        h, bank_w3, y, *common, *_bank_strides(bank_w3), **down, **dot
    )
    return y.to(x.dtype)


def ffn_memory_backward(
    dy: Tensor,
    x: Tensor,
    bank_w1: Tensor,
    bank_w2: Tensor,
    bank_w3: Tensor,
    block_idx: Tensor,
    num_slots: int,
    groups: PairGroups | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Triton backward for the upstream gradient dy (B, S, d).

    Returns dx (B, S, d) in x's dtype; dw1, dw2, dw3 (num_slots, W, d) in the bank's dtype,
    slot u holding the gradient of the u-th smallest referenced block id (zeros past the
    last referenced block); and the slots' block ids (num_slots,) int64, -1 when unused.
    num_slots must be at least the number of distinct referenced blocks. groups: as in
    `ffn_memory_forward`.
    """
    bsz, s, d = x.shape
    n, w, _ = bank_w1.shape
    k = block_idx.shape[1]
    p = bsz * k
    groups = group_pairs(block_idx, n) if groups is None else groups
    ids = slot_ids(groups, num_slots)
    dx = torch.zeros(bsz, s, d, device=x.device, dtype=torch.float32)
    gs = [
        torch.zeros(num_slots, w, d, device=x.device, dtype=b.dtype)
        for b in (bank_w1, bank_w2, bank_w3)
    ]
    if p == 0 or s == 0 or d == 0 or w == 0 or num_slots == 0:
        return dx.to(x.dtype), *gs, ids
    x, dy = x.contiguous(), dy.to(x.dtype).contiguous()
    t, dot = _launch_params(x)
    common = _common_args(groups, s, k, d, w, n)
    h, da, db = (torch.empty(p * s, w, device=x.device, dtype=x.dtype) for _ in range(3))
    bh, bx, bw = t["bwd_h"], t["dx"], t["dw"]
    _bwd_h[(p, triton.cdiv(s, bh["BM"]), triton.cdiv(w, bh["BW"]))](
        x,
        dy,
        bank_w1,
        bank_w2,
        bank_w3,
        h,
        da,
        db,
        *common,
        *_bank_strides(bank_w1, bank_w2, bank_w3),
        **bh,
        **dot,
    )
    _dx[(p, triton.cdiv(s, bx["BM"]), triton.cdiv(d, bx["BD"]))](
        da, db, bank_w1, bank_w2, dx, *common, *_bank_strides(bank_w1, bank_w2), **bx, **dot
    )
    _dw[(p, triton.cdiv(w, bw["BW"]), triton.cdiv(d, bw["BD"]))](
        x, dy, h, da, db, *gs, groups.slot, *common, **bw, **dot
    )
    return dx.to(x.dtype), *gs, ids
