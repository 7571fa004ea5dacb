"""Triton kernels for memory attention read by block index (forward, dQ, dK/dV).

Nothing is gathered: every program reads K/V rows straight out of the bank by
block id. The index lists are first turned into a *reference table* (seed 004
§8.5), built with a few torch ops on the device:

- queries are cut into tiles of TS tokens × the G query heads sharing one KV
  head (row r of a tile is token r // G, head r % G), so one K/V tile serves
  the whole GQA group;
- a *group* is a set of tokens that share one list of *slots* (the unique
  blocks they reference): a sequence for per-sequence lists (B, k), a tile
  for per-token lists (B, S, k). A group's slot list is loaded once per
  program and each slot's K/V serves every query of the tile; a per-query
  coefficient `coef` (the summed weights of that query's entries naming the
  slot's block; the entry count without weights; 0 when the query does not
  reference it) says how the slot enters the query's softmax. Repeated
  entries in a row therefore cost nothing extra: they only add to `coef`;
- `ent` maps (group, slot, token) to the first entry of that token's list
  naming the block, where per-entry statistics (mix-mode log-sum-exp, weight
  gradients) are stored;
- for dK/dV every unique block U owns one program per (KV head, T tile),
  which walks the (group, slot) pairs referencing it, so the bank gradient is
  written without atomics (bank-shaped, or a (U, T, H_kv, D) buffer).

The table is built once per call, in forward, with fixed-shape torch ops and no
host synchronisation: the slots per group and the unique blocks U are padded to
static bounds (`Layout`) and the real counts stay on the device, where the
kernels read them (loop bounds; dK/dV programs past the count exit at once), so
every grid comes from shapes alone. Forward returns the table as two flat
buffers and backward takes them instead of rebuilding it.

A tile computes every slot for all its queries (coef = 0 masks the rest), so
per-token lists cost in proportion to the unique blocks a tile touches: about
the per-sequence cost when neighbouring tokens share chapters, up to TS times
more when they share none. Tile sizes are fixed heuristics; a sweep on an H100
(bench/tune_attention.py, docs/BENCHMARKS.md) moved forward+backward by less than
the table's host time then (two syncs per call), so they were left as they are.

Softmax statistics are fp32 and scores are taken in the log2 domain. The
joint softmax ("bias") adds log2(coef) to the scores; "mix" normalises every
slot on its own and adds coef · (its output). Under TRITON_INTERPRET=1 every
tile is converted to fp32 after loading (the interpreter's bf16 arithmetic is
unreliable); on a GPU fp16/bf16 tiles feed tl.dot directly with fp32
accumulation, and fp32 inputs use IEEE (not TF32) dots.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = 1.4426950408889634


@triton.jit
def _keep(idx, n, EVEN: tl.constexpr):
    """Mask idx < n. When the launch knows n fills the tile (EVEN), an all-true constant
    instead: a mask over a run-time bound has constancy 1 along the head dimension, which
    cuts every K/V/Q load to 2-byte accesses; a constant one keeps them 16 bytes wide."""
    if EVEN:
        return tl.full(idx.shape, 1, tl.int1)
    return idx < n


@triton.jit
def _row_setup(s0, hkv, G, TS, S_END, BLOCK_M: tl.constexpr):
    """Rows of a query tile: token offset in the tile, sequence position, head, mask."""
    rows = tl.arange(0, BLOCK_M)
    tok = rows // G
    s = s0 + tok
    h = hkv * G + rows % G
    rmask = (tok < TS) & (s < S_END)
    return tok, s, h, rmask


@triton.jit
def _load_rows(ptr, b, h, s, dd, rmask, dmask, s_b, s_h, s_s, s_d, COMPUTE: tl.constexpr):
    """(BLOCK_M, BLOCK_D) rows of a (B, H, S, D) tensor."""
    offs = b * s_b + h[:, None] * s_h + s[:, None] * s_s + dd[None, :] * s_d
    return tl.load(ptr + offs, mask=rmask[:, None] & dmask[None, :], other=0.0).to(COMPUTE)


@triton.jit
def _load_block_tile(ptr, blk, hkv, nn, dd, nmask, dmask, s_n, s_t, s_h, s_d,
                     COMPUTE: tl.constexpr):
    """(BLOCK_N, BLOCK_D) tokens nn of block blk at KV head hkv."""
    offs = blk * s_n + hkv * s_h + nn[:, None] * s_t + dd[None, :] * s_d
    return tl.load(ptr + offs, mask=nmask[:, None] & dmask[None, :], other=0.0).to(COMPUTE)


@triton.jit
def _slot_tile(it, n_tt, grp, tok, rmask, GroupBlocks, Coef, Ent, sg_g, sg_l, sc_g, sc_l, sc_t,
               se_g, se_l, se_t, T, BLOCK_N: tl.constexpr, EVEN_T: tl.constexpr):
    """Iteration `it` of a tile's flat (slot × T tile) loop: the slot's block id, tile index
    and token range, and per row the coefficient and first entry (-1: not referenced)."""
    sl = it // n_tt
    nt = it - sl * n_tt
    blk = tl.load(GroupBlocks + grp * sg_g + sl * sg_l).to(tl.int64)
    c = tl.load(Coef + grp * sc_g + sl * sc_l + tok * sc_t, mask=rmask, other=0.0)
    j = tl.load(Ent + grp * se_g + sl * se_l + tok * se_t, mask=rmask, other=-1)
    nn = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    return blk, nt, nn, _keep(nn, T, EVEN_T), c, j


@triton.jit
def _fwd_kernel(
    Q, K, V, Out, Lse, GroupBlocks, GroupCount, Coef, Ent,
    sq_b, sq_h, sq_s, sq_d, sk_n, sk_t, sk_h, sk_d, sv_n, sv_t, sv_h, sv_d,
    so_b, so_h, so_s, so_d, sl_b, sl_h, sl_s, sl_j,
    sg_g, sg_l, sc_g, sc_l, sc_t, se_g, se_l, se_t,
    S, T, D, G, TS, n_s_tiles, scale_log2,
    PER_TOKEN: tl.constexpr, MIX: tl.constexpr, ONE_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_T: tl.constexpr, COMPUTE: tl.constexpr, PREC: tl.constexpr,
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
    tok, s, h, rmask = _row_setup((pid % n_s_tiles) * TS, hkv, G, TS, S, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    dmask = _keep(dd, D, EVEN_D)
    q = _load_rows(Q, b, h, s, dd, rmask, dmask, sq_b, sq_h, sq_s, sq_d, COMPUTE)
    lse_row = b * sl_b + h * sl_h + s * sl_s  # (BLOCK_M,)

    m = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: rows with no block stay NaN-free
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # mix over several T tiles: one slot
    n_tt = tl.cdiv(T, BLOCK_N)
    n_iter = tl.load(GroupCount + grp) * n_tt
    for it in range(n_iter):
        blk, nt, nn, nmask, c, j = _slot_tile(it, n_tt, grp, tok, rmask, GroupBlocks, Coef, Ent,
                                              sg_g, sg_l, sc_g, sc_l, sc_t, se_g, se_l, se_t,
                                              T, BLOCK_N, EVEN_T)
        k = _load_block_tile(K, blk, hkv, nn, dd, nmask, dmask, sk_n, sk_t, sk_h, sk_d, COMPUTE)
        v = _load_block_tile(V, blk, hkv, nn, dd, nmask, dmask, sv_n, sv_t, sv_h, sv_d, COMPUTE)
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
                tl.store(Lse + lse_row + j * sl_j, (m_u + tl.log2(l_u)) * 0.6931471805599453,
                         mask=jmask)
            else:
                first = nt == 0
                m = tl.where(first, -1.0e30, m)
                l = tl.where(first, 0.0, l)
                acc_u = tl.where(first, 0.0, acc_u)
                m_new = tl.maximum(m, tl.max(s2, 1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s2 - m_new[:, None])
                l = l * alpha + tl.sum(p, 1)
                acc_u = tl.dot(p.to(COMPUTE), v, acc_u * alpha[:, None], input_precision=PREC)
                m = m_new
                last = nt == n_tt - 1
                acc += tl.where(last, acc_u * (c / l)[:, None], 0.0)
                tl.store(Lse + lse_row + j * sl_j, (m + tl.log2(l)) * 0.6931471805599453,
                         mask=jmask & last)
        else:
            bias2 = tl.where(c > 0, tl.log2(tl.maximum(c, 1.0e-30)), float("-inf"))
            s2 = tl.where(nmask[None, :], s2 + bias2[:, None], float("-inf"))
            m_new = tl.maximum(m, tl.max(s2, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s2 - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(COMPUTE), v, acc * alpha[:, None], input_precision=PREC)
            m = m_new
    if not MIX:
        # l == 0: the query references no valid block; it reads zeros and its
        # +inf log-sum-exp makes every backward probability exp(s - lse) zero.
        acc = acc / tl.where(l > 0, l, 1.0)[:, None]
        lse = tl.where(l > 0, (m + tl.log2(tl.where(l > 0, l, 1.0))) * 0.6931471805599453,
                       float("inf"))
        tl.store(Lse + lse_row, lse, mask=rmask)
    offs = b * so_b + h[:, None] * so_h + s[:, None] * so_s + dd[None, :] * so_d
    tl.store(Out + offs, acc.to(Out.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, dO, Lse, Delta, dQ, dC, GroupBlocks, GroupCount, Coef, Ent,
    sq_b, sq_h, sq_s, sq_d, sk_n, sk_t, sk_h, sk_d, sv_n, sv_t, sv_h, sv_d,
    sdo_b, sdo_h, sdo_s, sdo_d, sdq_b, sdq_h, sdq_s, sdq_d, sl_b, sl_h, sl_s, sl_j,
    sdc_b, sdc_h, sdc_s, sdc_j,
    sg_g, sg_l, sc_g, sc_l, sc_t, se_g, se_l, se_t,
    S, T, D, G, TS, n_s_tiles, scale, scale_log2,
    PER_TOKEN: tl.constexpr, MIX: tl.constexpr, NEED_DC: tl.constexpr,
    ONE_TILE: tl.constexpr, DC_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_T: tl.constexpr, COMPUTE: tl.constexpr, PREC: tl.constexpr,
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
    tok, s, h, rmask = _row_setup((pid % n_s_tiles) * TS, hkv, G, TS, S, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    dmask = _keep(dd, D, EVEN_D)
    q = _load_rows(Q, b, h, s, dd, rmask, dmask, sq_b, sq_h, sq_s, sq_d, COMPUTE)
    do = _load_rows(dO, b, h, s, dd, rmask, dmask, sdo_b, sdo_h, sdo_s, sdo_d, COMPUTE)
    row = b * sl_b + h * sl_h + s * sl_s  # (BLOCK_M,)
    dc_row = b * sdc_b + h * sdc_h + s * sdc_s
    if not MIX:
        lse2 = tl.load(Lse + row, mask=rmask, other=float("inf")) * 1.4426950408889634
        delta = tl.load(Delta + row, mask=rmask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_tt = tl.cdiv(T, BLOCK_N)
    n_iter = tl.load(GroupCount + grp) * n_tt
    for it in range(n_iter):
        blk, _, nn, nmask, c, j = _slot_tile(it, n_tt, grp, tok, rmask, GroupBlocks, Coef, Ent,
                                             sg_g, sg_l, sc_g, sc_l, sc_t, se_g, se_l, se_t,
                                             T, BLOCK_N, EVEN_T)
        jmask = rmask & (j >= 0)
        k = _load_block_tile(K, blk, hkv, nn, dd, nmask, dmask, sk_n, sk_t, sk_h, sk_d, COMPUTE)
        v = _load_block_tile(V, blk, hkv, nn, dd, nmask, dmask, sv_n, sv_t, sv_h, sv_d, COMPUTE)
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
        tl.store(dQ + offs, (dq * scale).to(dQ.dtype.element_ty),
                 mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _dkv_tile(dk, dv, k, v, Q, dO, Lse, Delta, Coef, Ent, b, grp, sl, s0, s_lo, s_hi, hkv,
              dd, dmask, sq_b, sq_h, sq_s, sq_d, sdo_b, sdo_h, sdo_s, sdo_d,
              sl_b, sl_h, sl_s, sl_j, sc_g, sc_l, sc_t, se_g, se_l, se_t, G, TS, scale_log2,
              MIX: tl.constexpr, BLOCK_M: tl.constexpr, COMPUTE: tl.constexpr,
              PREC: tl.constexpr):
    """Adds one query tile's contribution to a K/V tile's gradients (dk unscaled)."""
    _, s, h, rmask = _row_setup(s0, hkv, G, TS, s_hi, BLOCK_M)
    gtok = s - s_lo  # token index inside the group (ignored per sequence: sc_t = 0)
    q = _load_rows(Q, b, h, s, dd, rmask, dmask, sq_b, sq_h, sq_s, sq_d, COMPUTE)
    do = _load_rows(dO, b, h, s, dd, rmask, dmask, sdo_b, sdo_h, sdo_s, sdo_d, COMPUTE)
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
def _bwd_dkv_kernel(
    Q, K, V, dO, Lse, Delta, dKu, dVu, NU, UBlocks, UOrder, PairOff, PairGroup, PairSlot, Coef,
    Ent,
    sq_b, sq_h, sq_s, sq_d, sk_n, sk_t, sk_h, sk_d, sv_n, sv_t, sv_h, sv_d,
    sdo_b, sdo_h, sdo_s, sdo_d, sl_b, sl_h, sl_s, sl_j,
    sc_g, sc_l, sc_t, se_g, se_l, se_t, su_u, su_t, su_h, su_d,
    S, T, D, G, TS, n_s_tiles, scale, scale_log2,
    PER_TOKEN: tl.constexpr, MIX: tl.constexpr, DENSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_T: tl.constexpr, COMPUTE: tl.constexpr, PREC: tl.constexpr,
):
    """dK/dV of one (unique block, KV head, T tile), summed over every query tile of
    every (group, slot) pair that references the block: one tile per pair for per-token
    lists, the sequence's S / TS tiles for per-sequence lists.

    Delta is delta (B, H, S) in bias mode and dC (B, H, S, k) in mix mode; the
    same formula dS = coef·P·(dP − Delta) then covers both. The grid covers the static
    bound U_max on the unique blocks; programs past the device-side count NU exit at once.
    DENSE: write row `block id` of bank-shaped dK/dV, else row u of (U_max, T, H_kv, D).
    """
    pid = tl.program_id(0)
    if pid >= tl.load(NU):
        return
    u = tl.load(UOrder + pid)  # heaviest blocks first
    hkv = tl.program_id(1)
    blk = tl.load(UBlocks + u).to(tl.int64)
    nn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = _keep(nn, T, EVEN_T)
    dd = tl.arange(0, BLOCK_D)
    dmask = _keep(dd, D, EVEN_D)
    k = _load_block_tile(K, blk, hkv, nn, dd, nmask, dmask, sk_n, sk_t, sk_h, sk_d, COMPUTE)
    v = _load_block_tile(V, blk, hkv, nn, dd, nmask, dmask, sv_n, sv_t, sv_h, sv_d, COMPUTE)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for pr in range(tl.load(PairOff + u), tl.load(PairOff + u + 1)):
        grp = tl.load(PairGroup + pr)
        sl = tl.load(PairSlot + pr)
        if PER_TOKEN:
            s_lo = (grp % n_s_tiles) * TS
            dk, dv = _dkv_tile(
                dk, dv, k, v, Q, dO, Lse, Delta, Coef, Ent, (grp // n_s_tiles).to(tl.int64),
                grp, sl, s_lo, s_lo, tl.minimum(s_lo + TS, S), hkv, dd, dmask,
                sq_b, sq_h, sq_s, sq_d, sdo_b, sdo_h, sdo_s, sdo_d, sl_b, sl_h, sl_s, sl_j,
                sc_g, sc_l, sc_t, se_g, se_l, se_t, G, TS, scale_log2,
                MIX, BLOCK_M, COMPUTE, PREC)
        else:
            for s0 in range(0, S, TS):
                dk, dv = _dkv_tile(
                    dk, dv, k, v, Q, dO, Lse, Delta, Coef, Ent, grp.to(tl.int64), grp, sl, s0,
                    0, S, hkv, dd, dmask,
                    sq_b, sq_h, sq_s, sq_d, sdo_b, sdo_h, sdo_s, sdo_d, sl_b, sl_h, sl_s, sl_j,
                    sc_g, sc_l, sc_t, se_g, se_l, se_t, G, TS, scale_log2,
                    MIX, BLOCK_M, COMPUTE, PREC)
    if DENSE:
        row = blk
    else:
        row = u.to(tl.int64)
    offs = row * su_u + nn[:, None] * su_t + hkv * su_h + dd[None, :] * su_d
    omask = nmask[:, None] & dmask[None, :]
    tl.store(dKu + offs, (dk * scale).to(dKu.dtype.element_ty), mask=omask)
    tl.store(dVu + offs, dv.to(dVu.dtype.element_ty), mask=omask)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True, kw_only=True)
class Launch:
    """Tile sizes of one call; the reference table depends on block_m (tokens per tile)."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    compute: tl.dtype
    prec: str
    even_d: bool  # D == block_d: no mask along the head dimension
    even_t: bool  # block_n divides T: no mask along a block's tokens

    @classmethod
    def choose(cls, q: Tensor, bank_k: Tensor, bank_v: Tensor, t: int, g: int,
               per_token: bool) -> Launch:
        d = q.shape[-1]
        block_d = max(16, triton.next_power_of_2(d))
        # Tiles are computed in the queries' precision: an fp32 bank read by bf16 queries
        # (a trainable bank under autocast) is cast tile by tile after loading, as the
        # gathered path casts its copy; accumulation is fp32 either way.
        if interpreting() or q.dtype == torch.float32:
            compute = tl.float32
        else:
            compute = tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16
        if interpreting():
            # Small tiles keep the interpreter fast and make tests cross tile edges.
            block_m, block_n, warps, stages = max(32, triton.next_power_of_2(g)), 16, 1, 1
        else:
            # Per-token tiles stay small so the union of blocks a tile touches stays
            # close to k (seed 004 §8.5: neighbouring tokens share chapters).
            block_m = 64 if per_token or block_d > 64 else 128
            block_m = max(block_m, triton.next_power_of_2(g))
            block_n = min(64 if block_d <= 64 else 32, max(16, triton.next_power_of_2(t)))
            stages = 3 if block_d <= 64 else 2
            if compute == tl.float32:  # fp32 tiles need twice the shared memory
                block_m, stages = max(64, triton.next_power_of_2(g)), 2
            warps = 4 if block_d <= 64 and block_m <= 64 else 8
        return cls(block_m=block_m, block_n=block_n, block_d=block_d, num_warps=warps,
                   num_stages=stages, compute=compute,
                   prec="tf32" if compute != tl.float32 else "ieee",
                   even_d=d == block_d, even_t=t % block_n == 0)

    def meta(self) -> dict:
        """Launch keywords shared by the three kernels."""
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_D": self.block_d,
                "EVEN_D": self.even_d, "EVEN_T": self.even_t, "COMPUTE": self.compute,
                "PREC": self.prec, "num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Static shapes of one call's reference table, from the shapes alone (no data): every
    data-dependent size is replaced by its upper bound and the real counts stay on the
    device (group_count, n_u), read by the kernels. The table travels from forward to
    backward as two flat buffers, `ints` (int32) and `coef` (fp32); these are their parts.

    G = groups (sequences, or query tiles for per-token lists), TPG = tokens per group
    (TS per token, 1 per sequence), L = slots per group <= min(TPG·k, N), U_max = unique
    blocks <= min(N, G·L).
    """

    per_token: bool
    tokens_per_tile: int  # TS
    n_s_tiles: int  # query tiles per sequence
    n_groups: int  # G
    n_slots: int  # L
    tpg: int  # TPG
    u_max: int  # U_max
    first_shape: tuple  # block_idx's shape

    @classmethod
    def of(cls, block_shape: tuple, s, n_bank, tokens_per_tile: int) -> Layout:
        # plain arithmetic (no int()): the fake implementation passes symbolic sizes
        per_token = len(block_shape) == 3
        b, k = block_shape[0], block_shape[-1]
        n_s_tiles = (s + tokens_per_tile - 1) // tokens_per_tile
        n_groups = b * n_s_tiles if per_token else b
        tpg = tokens_per_tile if per_token else 1
        n_slots = torch.sym_max(1, torch.sym_min(tpg * k, n_bank))
        u_max = torch.sym_max(1, torch.sym_min(n_bank, n_groups * n_slots))
        return cls(per_token=per_token, tokens_per_tile=tokens_per_tile, n_s_tiles=n_s_tiles,
                   n_groups=n_groups, n_slots=n_slots, tpg=tpg, u_max=u_max,
                   first_shape=tuple(block_shape))

    def int_parts(self) -> list[tuple[str, tuple]]:
        g, sl, u = self.n_groups, self.n_slots, self.u_max
        return [("group_blocks", (g, sl)), ("group_count", (g,)), ("ent", (g, sl, self.tpg)),
                ("first", self.first_shape), ("ublocks", (u,)), ("u_order", (u,)),
                ("pair_off", (u + 1,)), ("pair_group", (g * sl,)), ("pair_slot", (g * sl,)),
                ("n_u", (1,))]

    def numels(self) -> tuple:
        """(ints, coef) buffer sizes."""
        n_int = sum(math.prod(shape) for _, shape in self.int_parts())
        return n_int, self.n_groups * self.n_slots * self.tpg


@dataclass(frozen=True, kw_only=True)
class Table:
    """Reference table of one call (see the module docstring), views into `ints`/`coef`.
    G = groups, L = slots (static bounds, see Layout)."""

    layout: Layout
    ints: Tensor  # (n_int,) int32: every part below but coef
    group_blocks: Tensor  # (G, L) int32 block id per slot, -1 beyond the group's count
    group_count: Tensor  # (G,) int32 slots used
    coef: Tensor  # (G, L, TS) fp32 per sequence (G, L, 1), read with token stride 0
    ent: Tensor  # (G, L, TS) int32 first entry of the token naming the slot, -1 if none
    first: Tensor  # like block_idx, int32: first entry naming the same block, -1 for padding
    ublocks: Tensor  # (U_max,) int32 sorted unique referenced blocks; the first n_u are real
    u_order: Tensor  # (U_max,) int32 unique blocks by descending pair count (real ones first)
    pair_off: Tensor  # (U_max + 1,) int32 CSR offsets into pair_group/pair_slot
    pair_group: Tensor  # (G·L,) int32; the first P = pair_off[n_u] are the pairs
    pair_slot: Tensor  # (G·L,) int32
    n_u: Tensor  # (1,) int32 number of unique referenced blocks

    per_token = property(lambda self: self.layout.per_token)
    tokens_per_tile = property(lambda self: self.layout.tokens_per_tile)
    n_s_tiles = property(lambda self: self.layout.n_s_tiles)

    @classmethod
    def unpack(cls, layout: Layout, ints: Tensor, coef: Tensor) -> Table:
        parts, off = {}, 0
        for name, shape in layout.int_parts():
            n = math.prod(shape)
            parts[name] = ints[off:off + n].view(shape)
            off += n
        return cls(layout=layout, ints=ints,
                   coef=coef.view(layout.n_groups, layout.n_slots, layout.tpg), **parts)

    @property
    def coef_token_stride(self) -> int:
        return self.coef.stride(2) if self.per_token else 0

    @property
    def ent_token_stride(self) -> int:
        return self.ent.stride(2) if self.per_token else 0


def build_table(block_idx: Tensor, weights: Tensor | None, s: int, n_bank: int,
                tokens_per_tile: int) -> Table:
    """The reference table for block_idx (B, k) or (B, S, k) and weights of the same shape.

    No host synchronisation: fixed-shape torch ops only, every data-dependent size padded
    to its static bound (Layout) with the real counts left on the device. Entries that
    must not land anywhere (padding, repeats, unused slots) are routed to a spare last
    element that is dropped, rather than selected by boolean masks, each of which would
    be a sync (profiled on an H100: a dozen such syncs made this table cost 2.5 ms per
    call, four times the forward kernel). A block id >= n_bank fails a device-side
    assertion (RuntimeError on the CPU) instead of a host-side check.
    """
    lay = Layout.of(tuple(block_idx.shape), s, n_bank, tokens_per_tile)
    b, k = block_idx.shape[0], block_idx.shape[-1]
    dev = block_idx.device
    idx = block_idx.long()
    torch._assert_async((idx < n_bank).all(), "memory_attention: block_idx holds a block id "
                        "beyond the bank's blocks")
    w = None if weights is None else weights.float()
    if lay.per_token:
        pad = lay.n_s_tiles * tokens_per_tile - s
        idx = F.pad(idx, (0, 0, 0, pad), value=-1).reshape(b * lay.n_s_tiles, tokens_per_tile * k)
        if w is not None:
            w = F.pad(w, (0, 0, 0, pad)).reshape(idx.shape)
    tpg, n_slots = lay.tpg, lay.n_slots
    n_groups, n_ent = idx.shape  # (G, tokens per group · k)
    srt, order = idx.sort(dim=1, stable=True)  # padding (-1) first
    new = srt >= 0
    new[:, 1:] &= srt[:, 1:] != srt[:, :-1]
    slot_sorted = new.cumsum(1) - 1  # the slot of each sorted entry (< count <= L); -1 padding
    count = new.sum(1)  # (G,)
    # (G, L + 1): first entries of a block write its slot, the rest the spare column
    group_blocks = torch.full((n_groups, n_slots + 1), -1, dtype=torch.long, device=dev)
    group_blocks.scatter_(1, torch.where(new, slot_sorted, n_slots), srt)
    group_blocks = group_blocks[:, :n_slots]

    slot = torch.empty_like(slot_sorted).scatter_(1, order, slot_sorted)  # per original entry
    valid = idx >= 0
    pos = torch.arange(n_ent, device=dev)
    gi = torch.arange(n_groups, device=dev)[:, None]
    n_cells = n_groups * n_slots * tpg
    # flat (group, slot, token) cell of every entry; padding goes to the spare cell n_cells
    flat = torch.where(valid, (gi * n_slots + slot) * tpg + pos // k, n_cells)
    vals = w if w is not None else torch.ones(idx.shape, dtype=torch.float32, device=dev)
    coef = torch.zeros(n_cells + 1, dtype=torch.float32, device=dev)
    coef.index_add_(0, flat.flatten(), vals.flatten())
    ent = torch.full((n_cells + 1,), k, dtype=torch.int32, device=dev)
    ent.scatter_reduce_(0, flat.flatten(), (pos % k).int().expand(n_groups, n_ent).flatten(),
                        reduce="amin")
    first = torch.where(valid, ent[flat], -1)
    ent = torch.where(ent == k, -1, ent)[:n_cells]
    if lay.per_token:
        first = first.view(b, lay.n_s_tiles * tokens_per_tile, k)[:, :s]

    # Unique referenced blocks: sort the (group, slot) pairs by block id (unused slots, key
    # n_bank, last); a run of equal ids is one unique block, in ascending id order, and the
    # sort order itself lists each block's pairs contiguously (CSR).
    u_max = lay.u_max
    key = torch.where(group_blocks >= 0, group_blocks, n_bank).flatten()  # (G·L,)
    key_srt, by_u = key.sort(stable=True)
    head = key_srt < n_bank
    head[1:] &= key_srt[1:] != key_srt[:-1]  # first pair of each unique block
    uid = head.cumsum(0) - 1  # (G·L,) unique index of each sorted pair
    n_u = head.sum().reshape(1)
    n_pairs = (key < n_bank).sum().reshape(1)
    ublocks = torch.full((u_max + 1,), n_bank, dtype=torch.long, device=dev)
    ublocks.scatter_(0, torch.where(head, uid, u_max), key_srt)
    # pair_off[u] = first sorted pair of block u; n_pairs for padded u >= n_u (empty ranges)
    pair_off = n_pairs.expand(u_max + 2).clone()
    pair_off.scatter_(0, torch.where(head, uid, u_max + 1),
                      torch.arange(key.numel(), device=dev))
    pair_off = pair_off[:u_max + 1]
    per_u = pair_off[1:] - pair_off[:-1]  # (U_max,), 0 for padding: sorted after real blocks
    parts = {
        "group_blocks": group_blocks, "group_count": count, "ent": ent, "first": first,
        "ublocks": ublocks[:u_max], "u_order": torch.argsort(per_u, descending=True, stable=True),
        "pair_off": pair_off, "pair_group": by_u // n_slots, "pair_slot": by_u % n_slots,
        "n_u": n_u,
    }
    ints = torch.cat([parts[name].reshape(-1).to(torch.int32) for name, _ in lay.int_parts()])
    return Table.unpack(lay, ints, coef[:n_cells])


def _strides4(x: Tensor) -> tuple[int, int, int, int]:
    return tuple(x.stride())  # type: ignore[return-value]


def _lse_strides(lse: Tensor) -> tuple[int, int, int, int]:
    """(b, h, s, j) strides of a (B, H, S) or (B, H, S, k) statistic."""
    return (*lse.stride()[:3], lse.stride(3) if lse.ndim == 4 else 0)  # type: ignore[return-value]


def _launch_and_layout(q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor
                       ) -> tuple[Launch, Layout]:
    h, s = q.shape[1], q.shape[2]
    n, t, h_kv, _ = bank_k.shape
    launch = Launch.choose(q, bank_k, bank_v, t, h // h_kv, block_idx.ndim == 3)
    ts = max(1, launch.block_m // (h // h_kv))
    return launch, Layout.of(tuple(block_idx.shape), s, n, ts)


def table_numels(q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor) -> tuple:
    """(ints, coef) sizes of the table `forward` returns, from the shapes (fake tensors)."""
    return _launch_and_layout(q, bank_k, bank_v, block_idx)[1].numels()


def plan(q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor,
         weights: Tensor | None) -> tuple[Launch, Table]:
    """Tile sizes and reference table of one call (also used by bench/kernel_ops.py to report
    how many slots a tile touches)."""
    launch, lay = _launch_and_layout(q, bank_k, bank_v, block_idx)
    table = build_table(block_idx, weights, q.shape[2], bank_k.shape[0], lay.tokens_per_tile)
    return launch, table


def _expand_first(table: Table, x: Tensor, h: int, s: int) -> Tensor:
    """(B, H, S, k) per-entry values → the same values for every repeated entry."""
    first = table.first.long()
    first = first if table.per_token else first[:, None, :].expand(-1, s, -1)
    first = first[:, None].expand(-1, h, -1, -1)  # (B, H, S, k)
    return x.gather(-1, first.clamp(min=0)).masked_fill(first < 0, 0.0), first


def forward(q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor,
            weights: Tensor | None, mix: bool, scale: float
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """out (B, H, S, D) in q's dtype; lse fp32 (B, H, S), or (B, H, S, k) when mix; the
    reference table's (ints, coef) buffers, which `backward` takes instead of rebuilding."""
    b, h, s, d = q.shape
    t, h_kv = bank_k.shape[1:3]
    launch, table = plan(q, bank_k, bank_v, block_idx, weights)
    out = torch.empty((b, h, s, d), dtype=q.dtype, device=q.device)
    k = block_idx.shape[-1]
    lse_shape = (b, h, s, k) if mix else (b, h, s)
    lse = torch.full(lse_shape, math.inf, dtype=torch.float32, device=q.device)
    grid = (b * table.n_s_tiles, h_kv)
    _fwd_kernel[grid](
        q, bank_k, bank_v, out, lse, table.group_blocks, table.group_count, table.coef, table.ent,
        *_strides4(q), *_strides4(bank_k), *_strides4(bank_v), *_strides4(out), *_lse_strides(lse),
        *table.group_blocks.stride(), table.coef.stride(0), table.coef.stride(1),
        table.coef_token_stride, table.ent.stride(0), table.ent.stride(1), table.ent_token_stride,
        s, t, d, h // h_kv, table.tokens_per_tile, table.n_s_tiles, scale * _LOG2E,
        PER_TOKEN=table.per_token, MIX=mix, ONE_TILE=t <= launch.block_n, **launch.meta(),
    )
    if mix:
        lse, first = _expand_first(table, lse, h, s)
        lse = lse.masked_fill(first < 0, math.inf)
    return out, lse, table.ints, table.coef.view(-1)


def backward(grad_out: Tensor, q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor,
             weights: Tensor | None, out: Tensor, lse: Tensor, table_ints: Tensor,
             table_coef: Tensor, mix: bool, scale: float, need_kv: bool, need_dw: bool,
             dense_kv: bool, *, grad_lse: Tensor | None = None
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq (B, H, S, D); dK, dV in the bank's dtypes, bank-shaped (N, T, H_kv, D) when
    dense_kv, else (U_max, T, H_kv, D) rows for the padded unique blocks; those blocks
    (U_max,) int32 and their count n_u (1,) int32 (rows >= n_u are padding); dweights like
    weights (empty when not asked for). table_*: the buffers `forward` returned. grad_lse
    (B, H, S), the gradient of the joint lse (not mix), enters through delta."""
    b, h, s, d = q.shape
    t, h_kv = bank_k.shape[1:3]
    k = block_idx.shape[-1]
    launch, lay = _launch_and_layout(q, bank_k, bank_v, block_idx)
    table = Table.unpack(lay, table_ints, table_coef)
    need_dc = mix or need_dw
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dc = torch.zeros((b, h, s, k) if need_dc else (1, 1, 1, 1), dtype=torch.float32,
                     device=q.device)
    if mix:
        delta = lse  # unused: mix mode reads dC, written by the dQ kernel
    else:
        delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, S)
        if grad_lse is not None:  # d lse / d s = P, so dS = P·(dP − delta + dLSE)
            delta = delta - grad_lse.float()
    table_strides = (table.coef.stride(0), table.coef.stride(1), table.coef_token_stride,
                     table.ent.stride(0), table.ent.stride(1), table.ent_token_stride)
    dims = (s, t, d, h // h_kv, table.tokens_per_tile, table.n_s_tiles, scale, scale * _LOG2E)
    one_tile = t <= launch.block_n
    # mix with blocks of several T tiles: dC must be complete before dS, so a first
    # launch only accumulates it.
    for dc_pass in [True, False] if mix and not one_tile else [False]:
        _bwd_dq_kernel[(b * table.n_s_tiles, h_kv)](
            q, bank_k, bank_v, grad_out, lse, delta, dq, dc, table.group_blocks,
            table.group_count, table.coef, table.ent,
            *_strides4(q), *_strides4(bank_k), *_strides4(bank_v), *_strides4(grad_out),
            *_strides4(dq), *_lse_strides(lse), *_lse_strides(dc), *table.group_blocks.stride(),
            *table_strides, *dims, PER_TOKEN=table.per_token, MIX=mix, NEED_DC=need_dc,
            ONE_TILE=one_tile, DC_PASS=dc_pass, **launch.meta(),
        )
    rows = (bank_k.shape[0] if dense_kv else lay.u_max) if need_kv else 0
    # dense: rows of unreferenced blocks stay zero; sparse: padded rows are never written
    alloc = torch.zeros if dense_kv else torch.empty
    dk = alloc((rows, t, h_kv, d), dtype=bank_k.dtype, device=q.device)
    dv = alloc(dk.shape, dtype=bank_v.dtype, device=q.device)
    if need_kv:
        stats = dc if mix else delta
        # grid from the static bound U_max; programs past n_u return at once
        _bwd_dkv_kernel[(lay.u_max, h_kv, triton.cdiv(t, launch.block_n))](
            q, bank_k, bank_v, grad_out, lse, stats, dk, dv, table.n_u, table.ublocks,
            table.u_order, table.pair_off, table.pair_group, table.pair_slot, table.coef,
            table.ent, *_strides4(q), *_strides4(bank_k), *_strides4(bank_v),
            *_strides4(grad_out), *_lse_strides(lse), *table_strides, *_strides4(dk), *dims,
            PER_TOKEN=table.per_token, MIX=mix, DENSE=dense_kv, **launch.meta(),
        )
    if need_dw:
        dcs, _ = _expand_first(table, dc, h, s)
        dcs = dcs.sum(1)  # (B, S, k): weights are shared by the heads
        dw = (dcs if table.per_token else dcs.sum(1)).to(weights.dtype)
    else:
        dw = q.new_empty(0)
    return dq, dk, dv, table.ublocks, table.n_u, dw
