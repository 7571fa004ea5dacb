"""Block-major memory attention for per-token lists (`per_token_layout="blocks"`).

The slot tiles of `kernel.py` compute every block a tile of TS tokens names for all TS
tokens; with random per-token lists a tile names thousands of blocks and ~40× the useful
work is done (kernel.py's docstring has the numbers). Here the work is listed per block
instead, so each (token, block) pair is computed once:

- an *item* is a (token, block) pair, one per distinct valid block of a token's list. It
  lives at the token's first entry naming the block (`first`, as `ent` in the slot table),
  where its statistics are stored; the entries that repeat the block fold into its
  coefficient `coef` (their summed weights, or their count without weights). Padding (-1)
  makes no item; a token without a valid entry has none and reads zeros;
- items are sorted by block id and each block's run is cut into *chunks* of at most CT
  items (CT = BLOCK_M // G tokens: every token brings the G query heads of the KV head as
  rows, row r = item r // G, head r % G). One program per (chunk, KV head) loads the
  block's K/V once per T tile and serves the chunk's rows, gathered from anywhere in q;
- forward writes each item's own softmax read O_u (fp32) and log-sum-exp lse_u into
  buffers shaped (B, H, S, k, D) and (B, H, S, k) at the item's (b, h, s, first entry), so
  the merge is a reduction over k (torch ops): "bias" (and unweighted) takes
  out = Σ_u softmax_u(lse_u + log c_u) O_u and returns the joint lse; "mix" takes
  out = Σ_u c_u O_u and returns lse_u per entry, as the slot kernel does;
- backward is one kernel per (chunk, KV head): P from the saved joint lse (bias) or the
  item's own lse (mix), dS = c·P·(dP − Delta) with Delta = rowsum(dO·O) − dLSE (bias) or
  dC_u = rowsum(dO·O_u) = Σ_t P_u·dP (mix, a first pass over T tiles when the block has
  several). dK/dV of the chunk go to the block's rows and dQ to the token's rows by fp32
  atomics (a token's items sit in different programs), so dQ and dK/dV are not
  bit-reproducible; torch.use_deterministic_algorithms refuses this backward.

Static shapes, no host synchronisation: with E = B·S·k entries, the item arrays have E
elements (non-items sort last under the key N), chunks are at most
NC = ceil(E / CT) + min(N, E) (Σ_u ceil(n_u / CT) <= E / CT + U) and unique blocks at most
U_max = min(N, E); the real counts stay on the device (the grid strides over the chunk
count). Entries that must land nowhere are routed to spare element 0 (table.py's approach).
The table travels from forward to backward as two flat buffers like the slot table's; its
build is 48 non-view torch ops (test_item_table_build_stays_few_ops guards the count).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from memtree.kernels.memory_attention.kernel import (
    LOG2E,
    Launch,
    interpreting,
    lse_strides,
    strides4,
)
from memtree.kernels.memory_attention.kernel_fwd import keep_mask, online_softmax_step
from memtree.kernels.memory_attention.table import split_parts


@dataclass(frozen=True, kw_only=True)
class ItemLayout:
    """Static shapes of the item table, from the shapes alone (sizes may be symbolic)."""

    n_entries: int  # E = B·S·k
    chunk: int  # CT: items per chunk
    n_chunks: int  # NC, bound on the chunk count
    u_max: int  # bound on the unique referenced blocks

    @classmethod
    def of(cls, block_shape: tuple, n_bank, chunk: int) -> ItemLayout:
        e = block_shape[0] * block_shape[1] * block_shape[2]
        u_max = torch.sym_max(1, torch.sym_min(n_bank, e))
        return cls(n_entries=e, chunk=chunk, n_chunks=(e + chunk - 1) // chunk + u_max, u_max=u_max)

    def int_parts(self) -> list[tuple[str, tuple]]:
        e, nc = self.n_entries, self.n_chunks
        return [
            ("first", (e,)),
            ("item_pos", (e,)),
            ("item_key", (e,)),
            ("chunk_start", (nc + 1,)),
            ("chunk_u", (nc + 1,)),
            ("n_chunk", (1,)),
            ("ublocks", (self.u_max + 1,)),
        ]

    def numels(self) -> tuple:
        """(ints, coef) buffer sizes."""
        return sum(math.prod(shape) for _, shape in self.int_parts()), self.n_entries


@dataclass(frozen=True, kw_only=True)
class ItemTable:
    """The item table of one call: views into `ints` (int32) and `coef_buf` (fp32)."""

    layout: ItemLayout
    ints: Tensor
    coef_buf: Tensor
    first: Tensor  # (E,) first entry of the token naming the same block; -1 for padding
    item_pos: Tensor  # (E,) flat entry (b·S + s)·k + j of every item, by block; then the rest
    item_key: Tensor  # (E,) the block id of item_pos's entry; N past the items
    chunk_start: Tensor  # (NC,) index into item_pos of each chunk's first item
    chunk_u: Tensor  # (NC,) the chunk block's index in ublocks
    n_chunk: Tensor  # (1,) chunks used
    ublocks: Tensor  # (U_max,) sorted unique referenced blocks, then N

    @property
    def coef(self) -> Tensor:  # (E,) coefficient at every item's entry, 0 elsewhere
        return self.coef_buf

    @classmethod
    def unpack(cls, layout: ItemLayout, ints: Tensor, coef: Tensor) -> ItemTable:
        parts = split_parts(layout.int_parts(), ints)
        for name in ("chunk_start", "chunk_u", "ublocks"):  # skip the spare element 0
            parts[name] = parts[name][1:]
        return cls(layout=layout, ints=ints, coef_buf=coef, **parts)


@functools.lru_cache(maxsize=64)
def _aranges(device: torch.device, k: int, e: int) -> tuple[Tensor, Tensor]:
    """(k,) and (E,) int64 aranges, made once per shape (each op costs host time). Read only."""
    return (torch.arange(k, device=device), torch.arange(e, device=device))


def build_items(block_idx: Tensor, weights: Tensor | None, n_bank: int, chunk: int) -> ItemTable:
    """The item table for per-token lists block_idx (B, S, k) and weights of that shape.

    Per token: a stable sort of its entries puts each block's entries in a run whose head is
    its first entry (the items); every valid entry adds its weight at its run's head. Then
    all items sorted by block id, each block's run cut into chunks of `chunk` items."""
    lay = ItemLayout.of(tuple(block_idx.shape), n_bank, chunk)
    b, s, k = block_idx.shape
    e = lay.n_entries
    idx = block_idx.to(torch.int32).reshape(b * s, k)
    torch._assert_async(
        (idx < n_bank).all(),
        "memory_attention: block_idx holds a block id beyond the bank's blocks",
    )
    pos, ar = _aranges(idx.device, k, e)
    # Few ops (each costs host time, table.py's docstring): products with a mask stand for
    # where(mask, x, 0), and the parts are cast to int32 by one copy after the cat.
    srt, order = idx.sort(dim=1, stable=True)  # padding (-1) first
    pad = srt < 0
    head = ~pad & (srt != F.pad(srt[:, :-1], (1, 0), value=-1))
    run = (pos * head).cummax(1).values  # sorted position of each entry's run head
    first_srt = order.gather(1, run).masked_fill_(pad, -1)  # stable sort: the first entry
    first = torch.empty_like(first_srt).scatter_(1, order, first_srt)
    w = (
        (~pad).float()
        if weights is None
        else (weights.reshape(b * s, k).float().gather(1, order).masked_fill_(pad, 0.0))
    )
    # padding adds 0 at entry 0 (clamped -1): harmless whatever lives there
    coef = torch.zeros((b * s, k), dtype=torch.float32, device=idx.device)
    coef.scatter_add_(1, first_srt.clamp(min=0), w)

    key = idx.masked_fill(first != pos, n_bank).view(-1)  # (E,) non-items sort last
    key_srt, item_pos = key.sort(stable=True)  # stable: a block's tokens in sequence order
    key_srt = key_srt.long()
    real = key_srt < n_bank
    run_head = key_srt != F.pad(key_srt[:-1], (1, 0), value=-1)
    run_start = (ar * run_head).cummax(0).values
    chunk_head = real & ((ar - run_start) % chunk == 0)
    cid = chunk_head.cumsum(0)  # 1-based chunk of every chunk head
    dst = cid * chunk_head  # everything else onto spare element 0
    nc, u_max = lay.n_chunks, lay.u_max
    chunk_start = torch.zeros(nc + 1, dtype=torch.int64, device=idx.device).scatter_(0, dst, ar)
    uhead = run_head & real
    uid = uhead.cumsum(0)  # 1-based unique block of every item
    chunk_u = torch.zeros(nc + 1, dtype=torch.int64, device=idx.device).scatter_(0, dst, uid - 1)
    ublocks = torch.full((u_max + 1,), n_bank, dtype=torch.int64, device=idx.device)
    ublocks.scatter_(0, uid * uhead, key_srt)
    parts = {
        "first": first,
        "item_pos": item_pos,
        "item_key": key_srt,
        "chunk_start": chunk_start,
        "chunk_u": chunk_u,
        "n_chunk": cid[-1:],
        "ublocks": ublocks,
    }
    ints = torch.cat([parts[name].view(-1) for name, _ in lay.int_parts()]).to(torch.int32)
    return ItemTable.unpack(lay, ints, coef.view(-1))


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _chunk_rows(ch, ChunkStart, ItemKey, ItemPos, E, S, KL, G, CT, hkv, BLOCK_M: tl.constexpr):
    """Chunk ch's block id and, per row (item r // G, head r % G), the item's flat entry f,
    token (b, s), entry j, head h and mask (rows past the chunk or the block's run)."""
    start = tl.load(ChunkStart + ch)
    blk = tl.load(ItemKey + start)
    rows = tl.arange(0, BLOCK_M)
    item = rows // G
    p = start + item
    rmask = (item < CT) & (p < E)
    rmask = rmask & (tl.load(ItemKey + p, mask=rmask, other=-1) == blk)
    f = tl.load(ItemPos + p, mask=rmask, other=0).to(tl.int64)
    bs = f // KL
    return blk.to(tl.int64), f, bs // S, bs % S, f % KL, hkv * G + rows % G, rmask


@triton.jit
def _gather_rows(ptr, b, h, s, dd, rmask, dmask, s_b, s_h, s_s, s_d, COMPUTE: tl.constexpr):
    """(BLOCK_M, BLOCK_D) rows (b, h, s) of a (B, H, S, D) tensor, one token per row."""
    offs = b[:, None] * s_b + h[:, None] * s_h + s[:, None] * s_s + dd[None, :] * s_d
    return tl.load(ptr + offs, mask=rmask[:, None] & dmask[None, :], other=0.0).to(COMPUTE)


@triton.jit
def _kv_tile(ptr, blk, hkv, nn, dd, nmask, dmask, s_n, s_t, s_h, s_d, COMPUTE: tl.constexpr):
    offs = blk * s_n + hkv * s_h + nn[:, None] * s_t + dd[None, :] * s_d
    return tl.load(ptr + offs, mask=nmask[:, None] & dmask[None, :], other=0.0).to(COMPUTE)


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LseU,
    ItemPos,
    ItemKey,
    ChunkStart,
    NChunk,
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
    so_j,
    so_d,
    sl_b,
    sl_h,
    sl_s,
    sl_j,
    E,
    S,
    T,
    D,
    G,
    KL,
    CT,
    scale_log2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_T: tl.constexpr,
    COMPUTE: tl.constexpr,
    PREC: tl.constexpr,
):
    """Each item's own softmax over its block: O_u (fp32, normalised) and lse_u (natural
    log), at (b, h, s, j). The grid strides over the device-side chunk count."""
    hkv = tl.program_id(1)
    dd = tl.arange(0, BLOCK_D)
    dmask = keep_mask(dd, D, EVEN_D)
    n_tt = tl.cdiv(T, BLOCK_N)
    for ch in range(tl.program_id(0), tl.load(NChunk), tl.num_programs(0)):
        blk, _, b, s, j, h, rmask = _chunk_rows(
            ch, ChunkStart, ItemKey, ItemPos, E, S, KL, G, CT, hkv, BLOCK_M
        )
        q = _gather_rows(Q, b, h, s, dd, rmask, dmask, sq_b, sq_h, sq_s, sq_d, COMPUTE)
        m = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for nt in range(n_tt):
            nn = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = keep_mask(nn, T, EVEN_T)
            k = _kv_tile(K, blk, hkv, nn, dd, nmask, dmask, sk_n, sk_t, sk_h, sk_d, COMPUTE)
            v = _kv_tile(V, blk, hkv, nn, dd, nmask, dmask, sv_n, sv_t, sv_h, sv_d, COMPUTE)
            s2 = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
            s2 = tl.where(nmask[None, :], s2, float("-inf"))
            m, l, acc = online_softmax_step(m, l, acc, s2, v, COMPUTE, PREC)
        # every row has token 0 of its block, so l > 0
        acc = acc / l[:, None]
        offs = b * so_b + h * so_h + s * so_s + j * so_j  # (BLOCK_M,)
        tl.store(O + offs[:, None] + dd[None, :] * so_d, acc, mask=rmask[:, None] & dmask[None, :])
        tl.store(
            LseU + b * sl_b + h * sl_h + s * sl_s + j * sl_j,
            (m + tl.log2(l)) * 0.6931471805599453,
            mask=rmask,
        )


@triton.jit
def _p_dp(
    K,
    V,
    blk,
    hkv,
    nt,
    dd,
    dmask,
    q,
    do,
    lse2,
    sk_n,
    sk_t,
    sk_h,
    sk_d,
    sv_n,
    sv_t,
    sv_h,
    sv_d,
    T,
    scale_log2,
    BLOCK_N: tl.constexpr,
    EVEN_T: tl.constexpr,
    COMPUTE: tl.constexpr,
    PREC: tl.constexpr,
):
    """T tile nt of the block: its token range nn and mask, K and V tiles (BLOCK_N,
    BLOCK_D), probabilities P = exp2(s2 − lse2) and dP = dO·Vᵀ (BLOCK_M, BLOCK_N)."""
    nn = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = keep_mask(nn, T, EVEN_T)
    k = _kv_tile(K, blk, hkv, nn, dd, nmask, dmask, sk_n, sk_t, sk_h, sk_d, COMPUTE)
    v = _kv_tile(V, blk, hkv, nn, dd, nmask, dmask, sv_n, sv_t, sv_h, sv_d, COMPUTE)
    s2 = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    p = tl.where(nmask[None, :], tl.exp2(s2 - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    return nn, nmask, k, v, p, dp


@triton.jit
def _bwd_kernel(
    Q,
    K,
    V,
    dO,
    Lse,
    Delta,
    Coef,
    dQ,
    dC,
    AccK,
    AccV,
    ItemPos,
    ItemKey,
    ChunkStart,
    ChunkU,
    NChunk,
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
    sdl_b,
    sdl_h,
    sdl_s,
    sdc_b,
    sdc_h,
    sdc_s,
    sdc_j,
    sa_u,
    sa_t,
    sa_h,
    sa_d,
    E,
    S,
    T,
    D,
    G,
    KL,
    CT,
    scale,
    scale_log2,
    MIX: tl.constexpr,
    NEED_DC: tl.constexpr,
    NEED_KV: tl.constexpr,
    ONE_TILE: tl.constexpr,
    ROW_BY_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_T: tl.constexpr,
    COMPUTE: tl.constexpr,
    PREC: tl.constexpr,
):
    """dQ, dK/dV and dC of one chunk's items (see the module docstring): P = exp(s − Lse)
    with Lse the joint lse (bias, sl_j = 0) or the item's own (mix); dS = c·P·(dP − Delta).
    dQ (fp32) and AccK/AccV (fp32, row `block id` when ROW_BY_BLOCK else the block's unique
    index) take atomic adds; dC (per item, one writer) a store."""
    hkv = tl.program_id(1)
    dd = tl.arange(0, BLOCK_D)
    dmask = keep_mask(dd, D, EVEN_D)
    n_tt = tl.cdiv(T, BLOCK_N)
    for ch in range(tl.program_id(0), tl.load(NChunk), tl.num_programs(0)):
        blk, f, b, s, j, h, rmask = _chunk_rows(
            ch, ChunkStart, ItemKey, ItemPos, E, S, KL, G, CT, hkv, BLOCK_M
        )
        q = _gather_rows(Q, b, h, s, dd, rmask, dmask, sq_b, sq_h, sq_s, sq_d, COMPUTE)
        do = _gather_rows(dO, b, h, s, dd, rmask, dmask, sdo_b, sdo_h, sdo_s, sdo_d, COMPUTE)
        c = tl.load(Coef + f, mask=rmask, other=0.0)
        lse2 = (
            tl.load(Lse + b * sl_b + h * sl_h + s * sl_s + j * sl_j, mask=rmask, other=float("inf"))
            * 1.4426950408889634
        )
        dc = tl.zeros([BLOCK_M], tl.float32)
        if MIX:
            delta = dc
            if not ONE_TILE:  # dC_u must be complete before any dS
                for nt in range(n_tt):
                    _, _, _, _, p, dp = _p_dp(
                        K,
                        V,
                        blk,
                        hkv,
                        nt,
                        dd,
                        dmask,
                        q,
                        do,
                        lse2,
                        sk_n,
                        sk_t,
                        sk_h,
                        sk_d,
                        sv_n,
                        sv_t,
                        sv_h,
                        sv_d,
                        T,
                        scale_log2,
                        BLOCK_N,
                        EVEN_T,
                        COMPUTE,
                        PREC,
                    )
                    dc += tl.sum(p * dp, 1)
        else:
            delta = tl.load(Delta + b * sdl_b + h * sdl_h + s * sdl_s, mask=rmask, other=0.0)
        if ROW_BY_BLOCK:
            arow = blk
        else:
            arow = tl.load(ChunkU + ch).to(tl.int64)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for nt in range(n_tt):
            nn, nmask, k, _, p, dp = _p_dp(
                K,
                V,
                blk,
                hkv,
                nt,
                dd,
                dmask,
                q,
                do,
                lse2,
                sk_n,
                sk_t,
                sk_h,
                sk_d,
                sv_n,
                sv_t,
                sv_h,
                sv_d,
                T,
                scale_log2,
                BLOCK_N,
                EVEN_T,
                COMPUTE,
                PREC,
            )
            if MIX:
                if ONE_TILE:
                    dc = tl.sum(p * dp, 1)
                ds = p * (dp - dc[:, None])
            else:
                ds = p * (dp - delta[:, None])
                if NEED_DC:
                    dc += tl.sum(ds, 1)
            dsc = ds * c[:, None]
            dq = tl.dot(dsc.to(COMPUTE), k, dq, input_precision=PREC)
            if NEED_KV:
                dv_t = tl.dot(tl.trans((p * c[:, None]).to(COMPUTE)), do, input_precision=PREC)
                dk_t = tl.dot(tl.trans(dsc.to(COMPUTE)), q, input_precision=PREC)
                a_offs = arow * sa_u + nn[:, None] * sa_t + hkv * sa_h + dd[None, :] * sa_d
                omask = nmask[:, None] & dmask[None, :]
                tl.atomic_add(AccK + a_offs, dk_t * scale, mask=omask, sem="relaxed")
                tl.atomic_add(AccV + a_offs, dv_t, mask=omask, sem="relaxed")
        q_offs = b[:, None] * sdq_b + h[:, None] * sdq_h + s[:, None] * sdq_s + dd[None, :] * sdq_d
        tl.atomic_add(dQ + q_offs, dq * scale, mask=rmask[:, None] & dmask[None, :], sem="relaxed")
        if NEED_DC:
            tl.store(dC + b * sdc_b + h * sdc_h + s * sdc_s + j * sdc_j, dc, mask=rmask)


# ------------------------------------------------------------------------------ host side
def _launch_and_layout(
    q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor
) -> tuple[Launch, ItemLayout]:
    h = q.shape[1]
    n, t, h_kv, _ = bank_k.shape
    g = h // h_kv
    # The slot tiles' rows (64 for bf16/fp16 on a GPU, 32 for fp32 tiles, where the kernels
    # stop spilling): chunks of 64 / G tokens, a guess until a GPU times this kernel.
    launch = Launch.choose(q.shape[-1], q.dtype, t, g, True)
    if interpreting():  # small chunks: the tests' blocks then span several
        launch = dataclasses.replace(launch, block_m=max(16, triton.next_power_of_2(g)))
    return launch, ItemLayout.of(tuple(block_idx.shape), n, max(1, launch.block_m // g))


def table_numels(
    q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor, weighted: bool
) -> tuple:
    """(ints, coef) sizes of the table `forward` returns, from the shapes (fake tensors)."""
    return _launch_and_layout(q, bank_k, bank_v, block_idx)[1].numels()


def plan(
    q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor, weights: Tensor | None
) -> tuple[Launch, ItemTable]:
    """Tile sizes and item table of one call (bench/kernels/kernel_ops.py reports its chunks)."""
    launch, lay = _launch_and_layout(q, bank_k, bank_v, block_idx)
    return launch, build_items(block_idx, weights, bank_k.shape[0], lay.chunk)


def build(
    q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor, weights: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The item table's (ints, coef) buffers for `forward(..., table=)`."""
    table = plan(q, bank_k, bank_v, block_idx, weights)[1]
    return table.ints, table.coef_buf


def _first_bhsk(table: ItemTable, shape: tuple) -> Tensor:
    b, h, s, k = shape
    return table.first.view(b, 1, s, k).long().expand(b, h, s, k)


def forward(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None,
    mix: bool,
    scale: float,
    table: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """As `kernel.forward` for per-token lists block_idx (B, S, k): out (B, H, S, D) in q's
    dtype; lse fp32 (B, H, S) (+inf where nothing is read), or (B, H, S, k) per entry when
    mix (+inf for padding); the item table's (ints, coef) buffers for `backward`."""
    b, h, s, d = q.shape
    t, h_kv = bank_k.shape[1:3]
    k = block_idx.shape[-1]
    launch, lay = _launch_and_layout(q, bank_k, bank_v, block_idx)
    if table is None:
        tab = build_items(block_idx, weights, bank_k.shape[0], lay.chunk)
    else:
        if (table[0].numel(), table[1].numel()) != lay.numels():
            raise ValueError(
                f"table buffers of {table[0].numel()} / {table[1].numel()} "
                f"elements; these shapes need {lay.numels()}"
            )
        tab = ItemTable.unpack(lay, *table)
    # zeros, not empty: the merge multiplies non-item slots by a zero weight
    o_u = torch.zeros((b, h, s, k, d), dtype=torch.float32, device=q.device)
    lse_u = torch.full((b, h, s, k), -math.inf, dtype=torch.float32, device=q.device)
    _fwd_kernel[(min(lay.n_chunks, launch.dkv_programs), h_kv)](
        q,
        bank_k,
        bank_v,
        o_u,
        lse_u,
        tab.item_pos,
        tab.item_key,
        tab.chunk_start,
        tab.n_chunk,
        *strides4(q),
        *strides4(bank_k),
        *strides4(bank_v),
        *o_u.stride(),
        *lse_u.stride(),
        lay.n_entries,
        s,
        t,
        d,
        h // h_kv,
        k,
        lay.chunk,
        scale * LOG2E,
        **launch.meta(),
    )
    c = tab.coef.view(b, 1, s, k)
    if mix:
        a = c.expand(b, h, s, k)
        first = _first_bhsk(tab, (b, h, s, k))
        lse = lse_u.gather(-1, first.clamp(min=0)).masked_fill_(first < 0, math.inf)
    else:
        z = lse_u + c.log()  # (B, H, S, k); -inf off the items
        joint = torch.logsumexp(z, -1)  # (B, H, S); -inf for a token without items
        empty = torch.isneginf(joint)
        a = torch.exp(z - joint.masked_fill(empty, 0.0)[..., None])
        lse = joint.masked_fill_(empty, math.inf)
    out = torch.matmul(a[..., None, :], o_u)[..., 0, :]  # Σ_j a_j O_j: (B, H, S, D)
    return out.to(q.dtype), lse, tab.ints, tab.coef_buf


def _refuse_if_deterministic() -> None:
    if not torch.are_deterministic_algorithms_enabled():
        return
    msg = (
        "memory_attention per_token_layout='blocks': backward adds dQ and dK/dV with fp32 "
        "atomics, which is not deterministic; use per_token_layout='tiles'"
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(msg, stacklevel=3)
    else:
        raise RuntimeError(msg)


def backward(
    grad_out: Tensor,
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None,
    out: Tensor,
    lse: Tensor,
    table_ints: Tensor,
    table_coef: Tensor,
    mix: bool,
    scale: float,
    need_kv: bool,
    need_dw: bool,
    dense_kv: bool,
    *,
    grad_lse: Tensor | None = None,
    count_unique: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """As `kernel.backward`: dq (B, H, S, D); dK, dV bank-shaped (dense_kv) or (U_max, T,
    H_kv, D) rows of the unique blocks; those blocks (U_max,) int32 (N past the real ones)
    and their count (1,) (empty when dense); dweights like weights (empty unless need_dw)."""
    _refuse_if_deterministic()
    b, h, s, d = q.shape
    n, t, h_kv, _ = bank_k.shape
    k = block_idx.shape[-1]
    dev = q.device
    launch, lay = _launch_and_layout(q, bank_k, bank_v, block_idx)
    tab = ItemTable.unpack(lay, table_ints, table_coef)
    dq = torch.zeros((b, h, s, d), dtype=torch.float32, device=dev)
    dc = torch.zeros((b, h, s, k) if need_dw else (1, 1, 1, 1), dtype=torch.float32, device=dev)
    if mix:
        delta = dq  # unused: mix computes each item's dC_u in the kernel
    else:
        delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, S)
        if grad_lse is not None:  # d lse / d s = P, so dS = P·(dP − delta + dLSE)
            delta = delta - grad_lse.float()
    direct = bank_k.dtype == torch.float32 and bank_v.dtype == torch.float32
    rows = n if dense_kv and direct else lay.u_max
    shape = (rows, t, h_kv, d) if need_kv else (1, 1, 1, 1)
    acc_k = torch.zeros(shape, dtype=torch.float32, device=dev)
    acc_v = torch.zeros_like(acc_k)
    _bwd_kernel[(min(lay.n_chunks, launch.dkv_programs), h_kv)](
        q,
        bank_k,
        bank_v,
        grad_out,
        lse,
        delta,
        tab.coef,
        dq,
        dc,
        acc_k,
        acc_v,
        tab.item_pos,
        tab.item_key,
        tab.chunk_start,
        tab.chunk_u,
        tab.n_chunk,
        *strides4(q),
        *strides4(bank_k),
        *strides4(bank_v),
        *strides4(grad_out),
        *strides4(dq),
        *lse_strides(lse),
        *delta.stride()[:3],
        *lse_strides(dc),
        *strides4(acc_k),
        lay.n_entries,
        s,
        t,
        d,
        h // h_kv,
        k,
        lay.chunk,
        scale,
        scale * LOG2E,
        MIX=mix,
        NEED_DC=need_dw,
        NEED_KV=need_kv,
        ONE_TILE=t <= launch.block_n,
        ROW_BY_BLOCK=dense_kv and direct,
        **launch.meta(),
    )
    if not need_kv:
        dk = bank_k.new_empty((0, t, h_kv, d))
        dv = bank_v.new_empty(dk.shape)
    elif direct or not dense_kv:  # sparse rows past the real ones stay zero
        dk, dv = acc_k.to(bank_k.dtype), acc_v.to(bank_v.dtype)
    else:  # padded unique ids are n: they land in a spare last row that is dropped
        rows_of_u = tab.ublocks.long()
        dk = torch.zeros((n + 1, t, h_kv, d), dtype=bank_k.dtype, device=dev)
        dv = torch.zeros((n + 1, t, h_kv, d), dtype=bank_v.dtype, device=dev)
        dk = dk.index_copy_(0, rows_of_u, acc_k.to(bank_k.dtype))[:n]
        dv = dv.index_copy_(0, rows_of_u, acc_v.to(bank_v.dtype))[:n]
    if need_dw:  # an entry's weight enters through its block's item (its first entry)
        first = _first_bhsk(tab, (b, h, s, k))
        dw = dc.gather(-1, first.clamp(min=0)).masked_fill_(first < 0, 0.0).sum(1)
        dw = dw.to(weights.dtype)  # (B, S, k)
    else:
        dw = q.new_empty(0)
    n_u = (
        dq.new_empty(0, dtype=torch.int32)
        if dense_kv or not count_unique
        else (tab.ublocks < n).sum()
    )
    return dq.to(q.dtype), dk, dv, tab.ublocks, n_u, dw
