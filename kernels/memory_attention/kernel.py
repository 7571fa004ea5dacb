"""Triton kernels for memory attention read by block index (forward, dQ, dK/dV).

Nothing is gathered: every program reads K/V rows straight out of the bank by
block id. The index lists are first turned into a *reference table* (seed 004
§8.5), built with a few torch ops on the device (`table.py`):

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
- for dK/dV the (group, slot) pairs are listed per unique block, and a block's
  work (pairs × the query tiles of a pair) is cut into chunks of at most
  `Launch.dkv_chunk` query tiles, one program per (chunk, KV head, T tile), so a
  block that every sequence reads (the shared chapter: 8 sequences × 8 tiles at
  moc) is spread over several programs instead of one long walk. The partial
  sums meet through fp32 atomic adds (see `_bwd_dkv` for why not a reduced
  partial buffer): bit-exact reproducibility of dK/dV is not kept.

The table is built once per call in forward (or once for several calls by
`op.memory_attention_table`), with fixed-shape torch ops and no host synchronisation: the slots per group and the unique blocks U are padded to
static bounds (`Layout`) and the real counts stay on the device, where the
kernels read them (loop bounds; the dK/dV grid strides over the device-side chunk
count), so every grid comes from shapes alone. Forward returns the table as two
flat buffers and backward takes them instead of rebuilding it.

A tile computes every slot for all its queries (coef = 0 masks the rest), so
per-token lists cost in proportion to the unique blocks a tile touches: about
the per-sequence cost when neighbouring tokens share chapters, up to TS times
more when they share none. Tile sizes are fixed heuristics (`Launch.choose`), set
where the compiled kernels stop spilling registers: bench/kernels/tune_backward.py reads each
kernel's device time and the dK/dV kernel's spills per configuration on a GPU, which
timing the whole op (whose host work exceeds the kernels' time) cannot show.

Per-token *random* lists (bench/kernels/kernel_ops.py `token_idx(..., "random")`: B=8,
H=H_kv=12, S=1024, D=T=64, k=65 = the shared chapter + 64 drawn from 4,096;
bf16), on paper, forward (backward scales alike, ~2.5×). Useful work: 0.105
TFLOP. A tile of TS tokens touches U = 1 + 4096·(1 − (1 − 1/4096)^(64·TS))
blocks and loads each block's K/V (16 KiB per KV head) once for all its rows:

  scheme                          blocks/tile  FLOP (× useful)   K/V bytes
  slot tiles, TS = 16                    907    1.46 T (14×)      91 GB
  slot tiles, TS = 32                  1,613    2.60 T (25×)      81 GB
  slot tiles, TS = 64 (now)            2,590    4.17 T (40×)      65 GB
  slot tiles, TS = 128                 3,543    5.71 T (55×)      45 GB
  block-major, 32 tokens/chunk             –    0.117 T (1.1×)    3.7 GB K/V + 0.8 GB Q
                                                                  + 3.3 GB partials = 7.8 GB
  sequence-level lists (TS = 128)         65    0.105 T (1×)      0.8 GB

65 GB at ~3.3 TB/s is ~20 ms: the measured 17.5 ms forward is this traffic (some
of it from L2). No tile size helps both terms (smaller tiles cut FLOPs but load
more K/V per token; larger ones the reverse), and the launch cannot see whether
lists are local (where TS = 64 meets the ≤ 2× target) or random without a host
sync, so TS stays 64. The fix is *block-major* per-token attention: sort the
(token, first entry) items by block, cut each block's items into chunks of 32
tokens, one program per (chunk, KV head) loads the block's K/V once, gathers its
tokens' Q rows and writes each item's own softmax (O_u fp32, lse_u); a merge
then computes out = Σ_u a_u O_u with a_u = softmax_u(lse_u + log c_u) (bias) or
c_u (mix) — the kernel's existing lse merge. Backward alike: per chunk dS from
the joint lse, dQ rows and dK/dV partials added with fp32 atomics (dC = dO·O_u
needs no extra pass). ~8× fewer bytes and ~35× fewer FLOPs than now, at the
cost of a (B, S, k, H, D) partial buffer (1.7 GB fp32 here; bf16 halves it).
It exists as `blocks.py` (per_token_layout="blocks" of `op.memory_attention`: an item
table, a forward kernel, a torch merge over k of a (B, H, S, k, D) buffer, and one
backward kernel; chunks of 64 / G tokens on a GPU). On an H100 (2026-11-27) it took
15.3 ms forward+backward on random lists against these tiles' 63.8, and 12.9-13.3 against
6.5-7.7 on local ones; "auto" picks it where a tile names more than 6 k distinct blocks
(`op.resolve_layout`).

Softmax statistics are fp32 and scores are taken in the log2 domain. The
joint softmax ("bias") adds log2(coef) to the scores; "mix" normalises every
slot on its own and adds coef · (its output). Under TRITON_INTERPRET=1 every
tile is converted to fp32 after loading (the interpreter's bf16 arithmetic is
unreliable); on a GPU fp16/bf16 tiles feed tl.dot directly with fp32
accumulation, and fp32 inputs use IEEE (not TF32) dots.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from memtree.kernels.memory_attention.table import Layout, Table, UnpackedTables, build_table

LOG2E = 1.4426950408889634


@triton.jit
def keep_mask(idx, n, EVEN: tl.constexpr):
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
    dmask = keep_mask(dd, D, EVEN_D)
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
                m, l, acc_u = online_softmax_step(m, l, acc_u, s2, v, COMPUTE, PREC)
                last = nt == n_tt - 1
                acc += tl.where(last, acc_u * (c / l)[:, None], 0.0)
                tl.store(Lse + lse_row + j * sl_j, (m + tl.log2(l)) * 0.6931471805599453,
                         mask=jmask & last)
        else:
            bias2 = tl.where(c > 0, tl.log2(tl.maximum(c, 1.0e-30)), float("-inf"))
            s2 = tl.where(nmask[None, :], s2 + bias2[:, None], float("-inf"))
            m, l, acc = online_softmax_step(m, l, acc, s2, v, COMPUTE, PREC)
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
def bwd_dq_kernel(
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
    dmask = keep_mask(dd, D, EVEN_D)
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
def bwd_dkv_kernel(
    Q, K, V, dO, Lse, Delta, AccK, AccV, NChunk, ChunkU, ChunkOff, UBlocks, PairOff, Pairs,
    Coef, Ent,
    sq_b, sq_h, sq_s, sq_d, sk_n, sk_t, sk_h, sk_d, sv_n, sv_t, sv_h, sv_d,
    sdo_b, sdo_h, sdo_s, sdo_d, sl_b, sl_h, sl_s, sl_j,
    sc_g, sc_l, sc_t, se_g, se_l, se_t, sa_u, sa_t, sa_h, sa_d,
    S, T, D, G, TS, n_s_tiles, scale, scale_log2, CHUNK, L,
    PER_TOKEN: tl.constexpr, MIX: tl.constexpr, ROW_BY_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_T: tl.constexpr, COMPUTE: tl.constexpr, PREC: tl.constexpr,
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
        k = _load_block_tile(K, blk, hkv, nn, dd, nmask, dmask, sk_n, sk_t, sk_h, sk_d, COMPUTE)
        v = _load_block_tile(V, blk, hkv, nn, dd, nmask, dmask, sv_n, sv_t, sv_h, sv_d, COMPUTE)
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
                dk, dv, k, v, Q, dO, Lse, Delta, Coef, Ent, b, grp, sl, s0, s_lo, s_hi, hkv,
                dd, dmask, sq_b, sq_h, sq_s, sq_d, sdo_b, sdo_h, sdo_s, sdo_d,
                sl_b, sl_h, sl_s, sl_j, sc_g, sc_l, sc_t, se_g, se_l, se_t, G, TS, scale_log2,
                MIX, BLOCK_M, COMPUTE, PREC)
        if ROW_BY_BLOCK:
            row = blk
        else:
            row = u.to(tl.int64)
        offs = row * sa_u + nn[:, None] * sa_t + hkv * sa_h + dd[None, :] * sa_d
        tl.atomic_add(AccK + offs, dk * scale, mask=omask, sem="relaxed")
        tl.atomic_add(AccV + offs, dv, mask=omask, sem="relaxed")


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
    dkv_chunk: int  # query tiles per dK/dV chunk (see bwd_dkv_kernel)
    dkv_programs: int  # cap on the dK/dV grid's chunk axis (programs stride over chunks)

    @classmethod
    def choose(cls, d: int, dtype: torch.dtype, t: int, g: int, per_token: bool) -> Launch:
        """Tiles for head dim d, queries of dtype, blocks of t slots, g query heads per KV head."""
        block_d = max(16, triton.next_power_of_2(d))
        # Tiles are computed in the queries' precision: an fp32 bank read by bf16 queries
        # (a trainable bank under autocast) is cast tile by tile after loading, as the
        # gathered path casts its copy; accumulation is fp32 either way.
        if interpreting() or dtype == torch.float32:
            compute = tl.float32
        else:
            compute = tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
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
            # Register spills set these (bench/kernels/tune_backward.py on an H100, 2026-11-27): at
            # moc's bf16 shape the dK/dV kernel spilled with 8 warps and ran 1.58 ms against
            # 0.72 with 4 (the forward 0.61 against 0.41); fp32 tiles of 64 x 64 made it spill
            # 1,312 registers and run 10-15x slower than 32 x 32 tiles at a training step's
            # shapes (1.57 ms against 0.105 for blocks of 99 slots).
            if compute == tl.float32:
                block_m, block_n, stages = max(32, triton.next_power_of_2(g)), min(block_n, 32), 2
            warps = 4 if block_d <= 64 else 8
        # dK/dV chunks: small in the interpreter so the tests split blocks across programs.
        # Chunks of one block meet in fp32 atomic adds, whose order varies from run to run;
        # under torch.use_deterministic_algorithms every block is one chunk (one writer per
        # element: bit-reproducible, the shared blocks' work back on one program).
        chunk, programs = (2, 8) if interpreting() else (16, 4096)
        if torch.are_deterministic_algorithms_enabled():
            chunk = 1 << 30
        return cls(block_m=block_m, block_n=block_n, block_d=block_d, num_warps=warps,
                   num_stages=stages, compute=compute,
                   prec="tf32" if compute != tl.float32 else "ieee",
                   even_d=d == block_d, even_t=t % block_n == 0, dkv_chunk=chunk,
                   dkv_programs=programs)

    def meta(self) -> dict:
        """Launch keywords shared by the three kernels."""
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_D": self.block_d,
                "EVEN_D": self.even_d, "EVEN_T": self.even_t, "COMPUTE": self.compute,
                "PREC": self.prec, "num_warps": self.num_warps, "num_stages": self.num_stages}


def strides4(x: Tensor) -> tuple[int, int, int, int]:
    return tuple(x.stride())  # type: ignore[return-value]


def lse_strides(lse: Tensor) -> tuple[int, int, int, int]:
    """(b, h, s, j) strides of a (B, H, S) or (B, H, S, k) statistic."""
    return (*lse.stride()[:3], lse.stride(3) if lse.ndim == 4 else 0)  # type: ignore[return-value]


# Tables this process built or read lately, unpacked once (see UnpackedTables): a shared
# table's views and dK/dV split are made once, not by every layer's forward and backward.
TABLES = UnpackedTables()


def _launch_and_layout(q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor,
                       weighted: bool) -> tuple[Launch, Layout]:
    key = (tuple(q.shape), q.dtype, tuple(bank_k.shape), tuple(block_idx.shape), weighted,
           interpreting(), torch.are_deterministic_algorithms_enabled())
    if all(type(x) is int for x in (*key[0], *key[2], *key[3])):  # no symbolic sizes
        return _launch_and_layout_of(key)
    return _launch_and_layout_of.__wrapped__(key)


def clear_caches() -> None:
    """Forget the per-shape launches and the unpacked tables: for benchmarks that replace
    `Launch.choose` (bench/kernels/tune_*.py), whose cached choices would otherwise outlive them."""
    _launch_and_layout_of.cache_clear()
    TABLES.clear()


@functools.lru_cache(maxsize=256)
def _launch_and_layout_of(key: tuple) -> tuple[Launch, Layout]:
    """From the shapes alone, so cached per shape: each call of a training step's read
    otherwise redoes this arithmetic twice (forward and backward)."""
    q_shape, dtype, bank_shape, idx_shape, weighted = key[:5]
    h, s, d = q_shape[1], q_shape[2], q_shape[3]
    n, t, h_kv, _ = bank_shape
    launch = Launch.choose(d, dtype, t, h // h_kv, len(idx_shape) == 3)
    ts = max(1, launch.block_m // (h // h_kv))
    return launch, Layout.of(idx_shape, s, n, ts, weighted)


def tokens_per_tile(q: Tensor, bank_k: Tensor, block_idx: Tensor) -> int:
    """Tokens per query tile of per-token lists at these shapes (the table's TS)."""
    return _launch_and_layout(q, bank_k, bank_k, block_idx, False)[1].tokens_per_tile


def table_numels(q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor,
                 weighted: bool) -> tuple:
    """(ints, coef) sizes of the table `forward` returns, from the shapes (fake tensors)."""
    return _launch_and_layout(q, bank_k, bank_v, block_idx, weighted)[1].numels()


def plan(q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor,
         weights: Tensor | None) -> tuple[Launch, Table]:
    """Tile sizes and reference table of one call (also used by bench/kernels/kernel_ops.py to report
    how many slots a tile touches)."""
    launch, lay = _launch_and_layout(q, bank_k, bank_v, block_idx, weights is not None)
    table = build_table(block_idx, weights, q.shape[2], bank_k.shape[0], lay.tokens_per_tile)
    return launch, TABLES.put(table)


def _expand_first(table: Table, x: Tensor, h: int, s: int) -> Tensor:
    """(B, H, S, k) per-entry values → the same values for every repeated entry."""
    first = table.first.long()
    first = first if table.per_token else first[:, None, :].expand(-1, s, -1)
    first = first[:, None].expand(-1, h, -1, -1)  # (B, H, S, k)
    return x.gather(-1, first.clamp(min=0)).masked_fill(first < 0, 0.0), first


def build(q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor,
          weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """The reference table's (ints, coef) buffers for `forward(..., table=)`."""
    table = plan(q, bank_k, bank_v, block_idx, weights)[1]
    return table.ints, table.coef_buf


def forward(q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor,
            weights: Tensor | None, mix: bool, scale: float,
            table: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """out (B, H, S, D) in q's dtype; lse fp32 (B, H, S), or (B, H, S, k) when mix; the
    reference table's (ints, coef) buffers, which `backward` takes instead of rebuilding.
    table: (ints, coef) from `build` for the same lists and shapes, or None to build here."""
    b, h, s, d = q.shape
    t, h_kv = bank_k.shape[1:3]
    if table is None:
        launch, table = plan(q, bank_k, bank_v, block_idx, weights)
    else:
        launch, lay = _launch_and_layout(q, bank_k, bank_v, block_idx, weights is not None)
        if (table[0].numel(), table[1].numel()) != lay.numels():
            raise ValueError(f"table buffers of {table[0].numel()} / {table[1].numel()} "
                             f"elements; these shapes need {lay.numels()}")
        table = TABLES.unpack(lay, *table)
    out = torch.empty((b, h, s, d), dtype=q.dtype, device=q.device)
    k = block_idx.shape[-1]
    lse_shape = (b, h, s, k) if mix else (b, h, s)
    # mix: entries never named keep +inf (nothing normalised); otherwise every row is written
    lse = (torch.full(lse_shape, math.inf, dtype=torch.float32, device=q.device) if mix
           else torch.empty(lse_shape, dtype=torch.float32, device=q.device))
    grid = (b * table.n_s_tiles, h_kv)
    fwd_kernel[grid](
        q, bank_k, bank_v, out, lse, table.group_blocks, table.group_count, table.coef, table.ent,
        *strides4(q), *strides4(bank_k), *strides4(bank_v), *strides4(out), *lse_strides(lse),
        *table.group_blocks.stride(), table.coef.stride(0), table.coef.stride(1),
        table.coef_token_stride, table.ent.stride(0), table.ent.stride(1), table.ent_token_stride,
        s, t, d, h // h_kv, table.tokens_per_tile, table.n_s_tiles, scale * LOG2E,
        PER_TOKEN=table.per_token, MIX=mix, ONE_TILE=t <= launch.block_n, **launch.meta(),
    )
    if mix:
        lse, first = _expand_first(table, lse, h, s)
        lse = lse.masked_fill(first < 0, math.inf)
    return out, lse, table.ints, table.coef_buf


def _bwd_dkv(q: Tensor, bank_k: Tensor, bank_v: Tensor, grad_out: Tensor, lse: Tensor,
             stats: Tensor, table: Table, launch: Launch, mix: bool, dense_kv: bool,
             table_strides: tuple, dims: tuple) -> tuple[Tensor, Tensor]:
    """dK, dV: bank-shaped (dense_kv) or (U_max, T, H_kv, D) rows of the padded unique blocks.

    Chunks of one block add their partial sums with fp32 atomics, so dK/dV vary in the last
    bits from run to run unless torch.use_deterministic_algorithms is on, which makes every
    block one chunk (`Launch.choose`). (The deterministic split, a
    partial buffer per chunk reduced afterwards, would hold (chunks, T, H_kv, D) fp32: about
    U_max + G·L/C rows, gigabytes for per-token lists). fp32 banks accumulate straight into
    the zeroed gradient; fp16/bf16 ones into an fp32 (U_max, …) buffer, cast (and scattered
    into the bank's shape) afterwards."""
    lay = table.layout
    n, t, h_kv, d = bank_k.shape
    dev = q.device
    chunk_off, chunk_u, n_chunk, n_chunk_max = TABLES.chunks(table, launch.dkv_chunk, n)
    direct = bank_k.dtype == torch.float32 and bank_v.dtype == torch.float32
    rows = n if dense_kv and direct else lay.u_max
    acc_k = torch.zeros((rows, t, h_kv, d), dtype=torch.float32, device=dev)
    acc_v = torch.zeros_like(acc_k)
    grid = (min(n_chunk_max, launch.dkv_programs), h_kv, triton.cdiv(t, launch.block_n))
    bwd_dkv_kernel[grid](
        q, bank_k, bank_v, grad_out, lse, stats, acc_k, acc_v, n_chunk, chunk_u, chunk_off,
        table.ublocks, table.pair_off, table.pairs, table.coef, table.ent,
        *strides4(q), *strides4(bank_k), *strides4(bank_v), *strides4(grad_out),
        *lse_strides(lse), *table_strides, *strides4(acc_k), *dims, launch.dkv_chunk,
        lay.n_slots,
        PER_TOKEN=table.per_token, MIX=mix, ROW_BY_BLOCK=dense_kv and direct, **launch.meta(),
    )
    if direct:
        return acc_k, acc_v
    if not dense_kv:  # padded rows (u >= n_u) stay zero
        return acc_k.to(bank_k.dtype), acc_v.to(bank_v.dtype)
    # padded unique ids are n: they land in a spare last row that is dropped
    rows_of_u = table.ublocks[:-1].long()
    dk = torch.zeros((n + 1, t, h_kv, d), dtype=bank_k.dtype, device=dev)
    dv = torch.zeros((n + 1, t, h_kv, d), dtype=bank_v.dtype, device=dev)
    dk.index_copy_(0, rows_of_u, acc_k.to(bank_k.dtype))
    dv.index_copy_(0, rows_of_u, acc_v.to(bank_v.dtype))
    return dk[:n], dv[:n]


def backward(grad_out: Tensor, q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor,
             weights: Tensor | None, out: Tensor, lse: Tensor, table_ints: Tensor,
             table_coef: Tensor, mix: bool, scale: float, need_kv: bool, need_dw: bool,
             dense_kv: bool, *, grad_lse: Tensor | None = None, count_unique: bool = True
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq (B, H, S, D); dK, dV in the bank's dtypes, bank-shaped (N, T, H_kv, D) when
    dense_kv, else (U_max, T, H_kv, D) rows for the padded unique blocks; those blocks
    (U_max,) int32 and their count n_u (1,) int32 (rows >= n_u are padding; empty when dense
    or not count_unique); dweights like weights (empty when not asked for). table_*: the
    buffers `forward` returned. grad_lse (B, H, S), the gradient of the joint lse (not mix),
    enters through delta."""
    b, h, s, d = q.shape
    t, h_kv = bank_k.shape[1:3]
    k = block_idx.shape[-1]
    launch, lay = _launch_and_layout(q, bank_k, bank_v, block_idx, weights is not None)
    table = TABLES.unpack(lay, table_ints, table_coef)
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
    dims = (s, t, d, h // h_kv, table.tokens_per_tile, table.n_s_tiles, scale, scale * LOG2E)
    one_tile = t <= launch.block_n
    # mix with blocks of several T tiles: dC must be complete before dS, so a first
    # launch only accumulates it.
    for dc_pass in [True, False] if mix and not one_tile else [False]:
        bwd_dq_kernel[(b * table.n_s_tiles, h_kv)](
            q, bank_k, bank_v, grad_out, lse, delta, dq, dc, table.group_blocks,
            table.group_count, table.coef, table.ent,
            *strides4(q), *strides4(bank_k), *strides4(bank_v), *strides4(grad_out),
            *strides4(dq), *lse_strides(lse), *lse_strides(dc), *table.group_blocks.stride(),
            *table_strides, *dims, PER_TOKEN=table.per_token, MIX=mix, NEED_DC=need_dc,
            ONE_TILE=one_tile, DC_PASS=dc_pass, **launch.meta(),
        )
    if need_kv:
        dk, dv = _bwd_dkv(q, bank_k, bank_v, grad_out, lse, dc if mix else delta, table, launch,
                          mix, dense_kv, table_strides, dims)
    else:
        dk = bank_k.new_empty((0, t, h_kv, d))
        dv = bank_v.new_empty(dk.shape)
    if need_dw:
        dcs, _ = _expand_first(table, dc, h, s)
        dcs = dcs.sum(1)  # (B, S, k): weights are shared by the heads
        dw = (dcs if table.per_token else dcs.sum(1)).to(weights.dtype)
    else:
        dw = q.new_empty(0)
    # the sparse layout's row count, read on the host by the caller; not made when dense or
    # when the caller has it already (a shared table's n_unique)
    n_u = (dq.new_empty(0, dtype=torch.int32) if dense_kv or not count_unique
           else (table.ublocks < bank_k.shape[0]).sum())
    return dq, dk, dv, table.ublocks, n_u, dw
