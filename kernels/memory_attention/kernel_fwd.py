"""Triton forward kernel of memory attention over slot tiles, and the tile helpers it shares
with the backward kernels (`kernel_bwd.py`).

`kernel.py` launches these kernels; its docstring describes the reference table they read and
the tiling. Every helper here is a `triton.jit` function inlined into the kernels that call it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def keep_mask(idx, n, EVEN: tl.constexpr):
    """Mask idx < n. When the launch knows n fills the tile (EVEN), an all-true constant
    instead: a mask over a run-time bound has constancy 1 along the head dimension, which
    cuts every K/V/Q load to 2-byte accesses; a constant one keeps them 16 bytes wide."""
    if EVEN:
        return tl.full(idx.shape, 1, tl.int1)
    return idx < n


@triton.jit
def row_setup(s0, hkv, G, TS, S_END, BLOCK_M: tl.constexpr):
    """Rows of a query tile: token offset in the tile, sequence position, head, mask."""
    rows = tl.arange(0, BLOCK_M)
    tok = rows // G
    s = s0 + tok
    h = hkv * G + rows % G
    rmask = (tok < TS) & (s < S_END)
    return tok, s, h, rmask


@triton.jit
def load_rows(ptr, b, h, s, dd, rmask, dmask, s_b, s_h, s_s, s_d, COMPUTE: tl.constexpr):
    """(BLOCK_M, BLOCK_D) rows of a (B, H, S, D) tensor."""
    offs = b * s_b + h[:, None] * s_h + s[:, None] * s_s + dd[None, :] * s_d
    return tl.load(ptr + offs, mask=rmask[:, None] & dmask[None, :], other=0.0).to(COMPUTE)


@triton.jit
def load_block_tile(ptr, blk, hkv, nn, dd, nmask, dmask, s_n, s_t, s_h, s_d, COMPUTE: tl.constexpr):
    """(BLOCK_N, BLOCK_D) tokens nn of block blk at KV head hkv."""
    offs = blk * s_n + hkv * s_h + nn[:, None] * s_t + dd[None, :] * s_d
    return tl.load(ptr + offs, mask=nmask[:, None] & dmask[None, :], other=0.0).to(COMPUTE)


@triton.jit
def slot_tile(
    it,
    n_tt,
    grp,
    tok,
    rmask,
    GroupBlocks,
    Coef,
    Ent,
    sg_g,
    sg_l,
    sc_g,
    sc_l,
    sc_t,
    se_g,
    se_l,
    se_t,
    T,
    BLOCK_N: tl.constexpr,
    EVEN_T: tl.constexpr,
):
    """Iteration `it` of a tile's flat (slot × T tile) loop: the slot's block id, tile index
    and token range, and per row the coefficient and first entry (-1: not referenced)."""
    sl = it // n_tt
    nt = it - sl * n_tt
    blk = tl.load(GroupBlocks + grp * sg_g + sl * sg_l).to(tl.int64)
    c = tl.load(Coef + grp * sc_g + sl * sc_l + tok * sc_t, mask=rmask, other=0.0)
    j = tl.load(Ent + grp * se_g + sl * se_l + tok * se_t, mask=rmask, other=-1)
    nn = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    return blk, nt, nn, keep_mask(nn, T, EVEN_T), c, j


@triton.jit
def online_softmax_step(m, l, acc, s2, v, COMPUTE: tl.constexpr, PREC: tl.constexpr):
    """One T tile of an online softmax in the log2 domain: the running row max m and sum l
    (BLOCK_M,) and output acc (BLOCK_M, BLOCK_D) fp32, updated with the tile's scores s2
    (BLOCK_M, BLOCK_N) and values v (BLOCK_N, BLOCK_D)."""
    m_new = tl.maximum(m, tl.max(s2, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s2 - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(COMPUTE), v, acc * alpha[:, None], input_precision=PREC)
    return m_new, l, acc


@triton.jit
def fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    GroupBlocks,
    GroupCount,
    Coef,
    Ent,
    sq_b,
    sq_h,
    sq_s,
    sq_d,
    sk_n,
    sk_t,
    sk_h,
    sk_d,
    sv_n,
    sv_t,
    sv_h,
    sv_d,
    so_b,
    so_h,
    so_s,
    so_d,
    sl_b,
    sl_h,
    sl_s,
    sl_j,
    sg_g,
    sg_l,
    sc_g,
    sc_l,
    sc_t,
    se_g,
    se_l,
    se_t,
    S,
    T,
    D,
    G,
    TS,
    n_s_tiles,
    scale_log2,
    PER_TOKEN: tl.constexpr,
    MIX: tl.constexpr,
    ONE_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_T: tl.constexpr,
    COMPUTE: tl.constexpr,
    PREC: tl.constexpr,
):
    """Output and log-sum-exp of one query tile. One flat loop over (slot, T tile), so the
    K/V loads of the next block are pipelined even when a block is a single tile.

    bias: online softmax over every slot, log2(coef) added to the scores.
    mix:  a softmax per slot (online across its T tiles), coef / l_u times its output
          added when the slot's last tile is done.
    """
    pid = tl.program_id(0)
    hkv = tl.program_id(1)
    b = (pid // n_s_tiles).to(tl.int64)
    if PER_TOKEN:
        grp = pid.to(tl.int64)
    else:
        grp = b
    tok, s, h, rmask = row_setup((pid % n_s_tiles) * TS, hkv, G, TS, S, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    dmask = keep_mask(dd, D, EVEN_D)
    q = load_rows(Q, b, h, s, dd, rmask, dmask, sq_b, sq_h, sq_s, sq_d, COMPUTE)
    lse_row = b * sl_b + h * sl_h + s * sl_s  # (BLOCK_M,)

    m = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: rows with no block stay NaN-free
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # mix over several T tiles: one slot
    n_tt = tl.cdiv(T, BLOCK_N)
    n_iter = tl.load(GroupCount + grp) * n_tt
    for it in range(n_iter):
        blk, nt, nn, nmask, c, j = slot_tile(
            it,
            n_tt,
            grp,
            tok,
            rmask,
            GroupBlocks,
            Coef,
            Ent,
            sg_g,
            sg_l,
            sc_g,
            sc_l,
            sc_t,
            se_g,
            se_l,
            se_t,
            T,
            BLOCK_N,
            EVEN_T,
        )
        k = load_block_tile(K, blk, hkv, nn, dd, nmask, dmask, sk_n, sk_t, sk_h, sk_d, COMPUTE)
        v = load_block_tile(V, blk, hkv, nn, dd, nmask, dmask, sv_n, sv_t, sv_h, sv_d, COMPUTE)
        s2 = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        if MIX:
            s2 = tl.where(nmask[None, :], s2, float("-inf"))
            jmask = rmask & (j >= 0)
            if ONE_TILE:  # the whole block is this tile: its exact softmax
                m_u = tl.max(s2, 1)
                p = tl.exp2(s2 - m_u[:, None])
                l_u = tl.sum(p, 1)
                p = p * (c / l_u)[:, None]
                acc = tl.dot(p.to(COMPUTE), v, acc, input_precision=PREC)
                tl.store(
                    Lse + lse_row + j * sl_j, (m_u + tl.log2(l_u)) * 0.6931471805599453, mask=jmask
                )
            else:
                first = nt == 0
                m = tl.where(first, -1.0e30, m)
                l = tl.where(first, 0.0, l)
                acc_u = tl.where(first, 0.0, acc_u)
                m, l, acc_u = online_softmax_step(m, l, acc_u, s2, v, COMPUTE, PREC)
                last = nt == n_tt - 1
                acc += tl.where(last, acc_u * (c / l)[:, None], 0.0)
                tl.store(
                    Lse + lse_row + j * sl_j,
                    (m + tl.log2(l)) * 0.6931471805599453,
                    mask=jmask & last,
                )
        else:
            bias2 = tl.where(c > 0, tl.log2(tl.maximum(c, 1.0e-30)), float("-inf"))
            s2 = tl.where(nmask[None, :], s2 + bias2[:, None], float("-inf"))
            m, l, acc = online_softmax_step(m, l, acc, s2, v, COMPUTE, PREC)
    if not MIX:
        # l == 0: the query references no valid block; it reads zeros and its
        # +inf log-sum-exp makes every backward probability exp(s - lse) zero.
        acc = acc / tl.where(l > 0, l, 1.0)[:, None]
        lse = tl.where(
            l > 0, (m + tl.log2(tl.where(l > 0, l, 1.0))) * 0.6931471805599453, float("inf")
        )
        tl.store(Lse + lse_row, lse, mask=rmask)
    offs = b * so_b + h[:, None] * so_h + s[:, None] * so_s + dd[None, :] * so_d
    tl.store(Out + offs, acc.to(Out.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
