"""Triton backward kernels of memory attention over slot tiles: dQ (with the coefficient
gradient dC) per query tile, and dK/dV per (chunk of a unique block's work, KV head, T tile).

`kernel.py` launches them (`backward`, `_bwd_dkv` there says why dK/dV partial sums meet in
fp32 atomic adds); the tile helpers they share with the forward kernel are in `kernel_fwd.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from memtree.kernels.memory_attention.kernel_fwd import (
    keep_mask,
    load_block_tile,
    load_rows,
    row_setup,
    slot_tile,
)


@triton.jit
def bwd_dq_kernel(
    Q,
    K,
    V,
    dO,
    Lse,
    Delta,
    dQ,
    dC,
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
    sdo_b,
    sdo_h,
    sdo_s,
    sdo_d,
    sdq_b,
    sdq_h,
    sdq_s,
    sdq_d,
    sl_b,
    sl_h,
    sl_s,
    sl_j,
    sdc_b,
    sdc_h,
    sdc_s,
    sdc_j,
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
    scale,
    scale_log2,
    PER_TOKEN: tl.constexpr,
    MIX: tl.constexpr,
    NEED_DC: tl.constexpr,
    ONE_TILE: tl.constexpr,
    DC_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_T: tl.constexpr,
    COMPUTE: tl.constexpr,
    PREC: tl.constexpr,
):
    """dQ for one query tile, and dC = ∂L/∂coef per (query row, first entry).

    bias: dS = coef·P·(dP − delta) with P = exp(s − lse), delta = rowsum(dO·O);
          dC = Σ_t P·(dP − delta).
    mix:  dC = dO·O_u = Σ_t P_u·dP; dS = coef·P_u·(dP − dC). When a block spans several
          T tiles, dC is complete only after all of them: a first launch (DC_PASS)
          accumulates it, the second reads it.
    Partial dC over several tiles is summed with atomics into the zeroed dC.
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
    do = load_rows(dO, b, h, s, dd, rmask, dmask, sdo_b, sdo_h, sdo_s, sdo_d, COMPUTE)
    row = b * sl_b + h * sl_h + s * sl_s  # (BLOCK_M,)
    dc_row = b * sdc_b + h * sdc_h + s * sdc_s
    if not MIX:
        lse2 = tl.load(Lse + row, mask=rmask, other=float("inf")) * 1.4426950408889634
        delta = tl.load(Delta + row, mask=rmask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_tt = tl.cdiv(T, BLOCK_N)
    n_iter = tl.load(GroupCount + grp) * n_tt
    for it in range(n_iter):
        blk, _, nn, nmask, c, j = slot_tile(
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
        jmask = rmask & (j >= 0)
        k = load_block_tile(K, blk, hkv, nn, dd, nmask, dmask, sk_n, sk_t, sk_h, sk_d, COMPUTE)
        v = load_block_tile(V, blk, hkv, nn, dd, nmask, dmask, sv_n, sv_t, sv_h, sv_d, COMPUTE)
        if MIX:
            lse2 = tl.load(Lse + row + j * sl_j, mask=jmask, other=float("inf"))
            lse2 = lse2 * 1.4426950408889634
        s2 = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        p = tl.where(nmask[None, :], tl.exp2(s2 - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        dc_ptr = dC + dc_row + j * sdc_j
        if MIX:
            if ONE_TILE:
                dc = tl.sum(p * dp, 1)
                tl.store(dc_ptr, dc, mask=jmask)
            elif DC_PASS:
                dc = tl.sum(p * dp, 1)
                tl.atomic_add(dc_ptr, dc, mask=jmask)
            else:
                dc = tl.load(dc_ptr, mask=jmask, other=0.0)
            ds = p * (dp - dc[:, None])
        else:
            ds = p * (dp - delta[:, None])
            if NEED_DC:
                if ONE_TILE:
                    tl.store(dc_ptr, tl.sum(ds, 1), mask=jmask)
                else:
                    tl.atomic_add(dc_ptr, tl.sum(ds, 1), mask=jmask)
        if not DC_PASS:
            dq = tl.dot((ds * c[:, None]).to(COMPUTE), k, dq, input_precision=PREC)
    if not DC_PASS:
        offs = b * sdq_b + h[:, None] * sdq_h + s[:, None] * sdq_s + dd[None, :] * sdq_d
        tl.store(
            dQ + offs, (dq * scale).to(dQ.dtype.element_ty), mask=rmask[:, None] & dmask[None, :]
        )


@triton.jit
def _dkv_tile(
    dk,
    dv,
    k,
    v,
    Q,
    dO,
    Lse,
    Delta,
    Coef,
    Ent,
    b,
    grp,
    sl,
    s0,
    s_lo,
    s_hi,
    hkv,
    dd,
    dmask,
    sq_b,
    sq_h,
    sq_s,
    sq_d,
    sdo_b,
    sdo_h,
    sdo_s,
    sdo_d,
    sl_b,
    sl_h,
    sl_s,
    sl_j,
    sc_g,
    sc_l,
    sc_t,
    se_g,
    se_l,
    se_t,
    G,
    TS,
    scale_log2,
    MIX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    COMPUTE: tl.constexpr,
    PREC: tl.constexpr,
):
    """Adds one query tile's contribution to a K/V tile's gradients (dk unscaled)."""
    _, s, h, rmask = row_setup(s0, hkv, G, TS, s_hi, BLOCK_M)
    gtok = s - s_lo  # token index inside the group (ignored per sequence: sc_t = 0)
    q = load_rows(Q, b, h, s, dd, rmask, dmask, sq_b, sq_h, sq_s, sq_d, COMPUTE)
    do = load_rows(dO, b, h, s, dd, rmask, dmask, sdo_b, sdo_h, sdo_s, sdo_d, COMPUTE)
    c = tl.load(Coef + grp * sc_g + sl * sc_l + gtok * sc_t, mask=rmask, other=0.0)
    row = b * sl_b + h * sl_h + s * sl_s
    if MIX:
        j = tl.load(Ent + grp * se_g + sl * se_l + gtok * se_t, mask=rmask, other=-1)
        jmask = rmask & (j >= 0)
        row = row + j * sl_j
    else:
        jmask = rmask
    lse2 = tl.load(Lse + row, mask=jmask, other=float("inf")) * 1.4426950408889634
    dl = tl.load(Delta + row, mask=jmask, other=0.0)
    s2t = tl.dot(k, tl.trans(q), input_precision=PREC) * scale_log2  # (BLOCK_N, BLOCK_M)
    pt = tl.exp2(s2t - lse2[None, :]) * c[None, :]
    dv = tl.dot(pt.to(COMPUTE), do, dv, input_precision=PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
    dst = pt * (dpt - dl[None, :])
    dk = tl.dot(dst.to(COMPUTE), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def bwd_dkv_kernel(
    Q,
    K,
    V,
    dO,
    Lse,
    Delta,
    AccK,
    AccV,
    NChunk,
    ChunkU,
    ChunkOff,
    UBlocks,
    PairOff,
    Pairs,
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
    sdo_b,
    sdo_h,
    sdo_s,
    sdo_d,
    sl_b,
    sl_h,
    sl_s,
    sl_j,
    sc_g,
    sc_l,
    sc_t,
    se_g,
    se_l,
    se_t,
    sa_u,
    sa_t,
    sa_h,
    sa_d,
    S,
    T,
    D,
    G,
    TS,
    n_s_tiles,
    scale,
    scale_log2,
    CHUNK,
    L,
    PER_TOKEN: tl.constexpr,
    MIX: tl.constexpr,
    ROW_BY_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_T: tl.constexpr,
    COMPUTE: tl.constexpr,
    PREC: tl.constexpr,
):
    """dK/dV of (chunk, KV head, T tile): a chunk is at most CHUNK consecutive query tiles
    ("units") of one unique block's work list, so a block read by many sequences (the shared
    chapter, a hierarchy's upper levels) is split over several programs. A block's units are
    its (group, slot) pairs × the tiles of a pair: one per pair for per-token lists, the
    sequence's S / TS tiles for per-sequence lists.

    Delta is delta (B, H, S) in bias mode and dC (B, H, S, k) in mix mode; the same formula
    dS = coef·P·(dP − Delta) then covers both. Partial sums are added with fp32 atomics into
    the zeroed AccK/AccV, row `block id` (ROW_BY_BLOCK, bank-shaped) or row u. The grid
    (from shapes alone) strides over the device-side chunk count NChunk.
    """
    hkv = tl.program_id(1)
    nn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = keep_mask(nn, T, EVEN_T)
    dd = tl.arange(0, BLOCK_D)
    dmask = keep_mask(dd, D, EVEN_D)
    omask = nmask[:, None] & dmask[None, :]
    if PER_TOKEN:  # query tiles per pair
        tpp = 1
    else:
        tpp = n_s_tiles
    for ch in range(tl.program_id(0), tl.load(NChunk), tl.num_programs(0)):
        u = tl.load(ChunkU + ch)
        blk = tl.load(UBlocks + u).to(tl.int64)
        p_lo = tl.load(PairOff + u)
        w_lo = (ch - tl.load(ChunkOff + u)) * CHUNK
        w_hi = tl.minimum(w_lo + CHUNK, (tl.load(PairOff + u + 1) - p_lo) * tpp)
        k = load_block_tile(K, blk, hkv, nn, dd, nmask, dmask, sk_n, sk_t, sk_h, sk_d, COMPUTE)
        v = load_block_tile(V, blk, hkv, nn, dd, nmask, dmask, sv_n, sv_t, sv_h, sv_d, COMPUTE)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for w in range(w_lo, w_hi):
            pair = tl.load(Pairs + p_lo + w // tpp)  # group · L + slot
            grp = pair // L
            sl = pair - grp * L
            if PER_TOKEN:
                b = (grp // n_s_tiles).to(tl.int64)
                s_lo = (grp % n_s_tiles) * TS
                s0 = s_lo
                s_hi = tl.minimum(s_lo + TS, S)
            else:
                b = grp.to(tl.int64)
                s_lo = 0
                s0 = (w % tpp) * TS
                s_hi = S
            dk, dv = _dkv_tile(
                dk,
                dv,
                k,
                v,
                Q,
                dO,
                Lse,
                Delta,
                Coef,
                Ent,
                b,
                grp,
                sl,
                s0,
                s_lo,
                s_hi,
                hkv,
                dd,
                dmask,
                sq_b,
                sq_h,
                sq_s,
                sq_d,
                sdo_b,
                sdo_h,
                sdo_s,
                sdo_d,
                sl_b,
                sl_h,
                sl_s,
                sl_j,
                sc_g,
                sc_l,
                sc_t,
                se_g,
                se_l,
                se_t,
                G,
                TS,
                scale_log2,
                MIX,
                BLOCK_M,
                COMPUTE,
                PREC,
            )
        if ROW_BY_BLOCK:
            row = blk
        else:
            row = u.to(tl.int64)
        offs = row * sa_u + nn[:, None] * sa_t + hkv * sa_h + dd[None, :] * sa_d
        tl.atomic_add(AccK + offs, dk * scale, mask=omask, sem="relaxed")
        tl.atomic_add(AccV + offs, dv, mask=omask, sem="relaxed")
