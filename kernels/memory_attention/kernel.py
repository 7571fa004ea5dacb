"""Triton kernels for memory attention read by block index (forward, dQ, dK/dV): their tile
sizes, reference tables and launches. The kernels themselves are in `kernel_fwd.py` (forward,
with the tile helpers) and `kernel_bwd.py` (dQ, dK/dV); this module re-exports them.

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
`op.memory_attention_table`), with fixed-shape torch ops and no host synchronisation:
the slots per group and the unique blocks U are padded to static bounds (`Layout`) and
the real counts stay on the device, where the kernels read them (loop bounds; the dK/dV
grid strides over the device-side chunk count), so every grid comes from shapes alone.
Forward returns the table as two flat buffers and backward takes them instead of
rebuilding it.

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

from memtree.kernels.memory_attention.kernel_bwd import bwd_dkv_kernel, bwd_dq_kernel
from memtree.kernels.memory_attention.kernel_fwd import fwd_kernel
from memtree.kernels.memory_attention.table import Layout, Table, UnpackedTables, build_table

LOG2E = 1.4426950408889634


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
        return cls(
            block_m=block_m,
            block_n=block_n,
            block_d=block_d,
            num_warps=warps,
            num_stages=stages,
            compute=compute,
            prec="tf32" if compute != tl.float32 else "ieee",
            even_d=d == block_d,
            even_t=t % block_n == 0,
            dkv_chunk=chunk,
            dkv_programs=programs,
        )

    def meta(self) -> dict:
        """Launch keywords shared by the three kernels."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_D": self.block_d,
            "EVEN_D": self.even_d,
            "EVEN_T": self.even_t,
            "COMPUTE": self.compute,
            "PREC": self.prec,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


def strides4(x: Tensor) -> tuple[int, int, int, int]:
    return tuple(x.stride())  # type: ignore[return-value]


def lse_strides(lse: Tensor) -> tuple[int, int, int, int]:
    """(b, h, s, j) strides of a (B, H, S) or (B, H, S, k) statistic."""
    return (*lse.stride()[:3], lse.stride(3) if lse.ndim == 4 else 0)  # type: ignore[return-value]


# Tables this process built or read lately, unpacked once (see UnpackedTables): a shared
# table's views and dK/dV split are made once, not by every layer's forward and backward.
TABLES = UnpackedTables()


def _launch_and_layout(
    q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor, weighted: bool
) -> tuple[Launch, Layout]:
    key = (
        tuple(q.shape),
        q.dtype,
        tuple(bank_k.shape),
        tuple(block_idx.shape),
        weighted,
        interpreting(),
        torch.are_deterministic_algorithms_enabled(),
    )
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


def table_numels(
    q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor, weighted: bool
) -> tuple:
    """(ints, coef) sizes of the table `forward` returns, from the shapes (fake tensors)."""
    return _launch_and_layout(q, bank_k, bank_v, block_idx, weighted)[1].numels()


def plan(
    q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor, weights: Tensor | None
) -> tuple[Launch, Table]:
    """Tile sizes and reference table of one call (also used by bench/kernels/kernel_ops.py to
    report how many slots a tile touches)."""
    launch, lay = _launch_and_layout(q, bank_k, bank_v, block_idx, weights is not None)
    table = build_table(block_idx, weights, q.shape[2], bank_k.shape[0], lay.tokens_per_tile)
    return launch, TABLES.put(table)


def _expand_first(table: Table, x: Tensor, h: int, s: int) -> Tensor:
    """(B, H, S, k) per-entry values → the same values for every repeated entry."""
    first = table.first.long()
    first = first if table.per_token else first[:, None, :].expand(-1, s, -1)
    first = first[:, None].expand(-1, h, -1, -1)  # (B, H, S, k)
    return x.gather(-1, first.clamp(min=0)).masked_fill(first < 0, 0.0), first


def build(
    q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor, weights: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The reference table's (ints, coef) buffers for `forward(..., table=)`."""
    table = plan(q, bank_k, bank_v, block_idx, weights)[1]
    return table.ints, table.coef_buf


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
            raise ValueError(
                f"table buffers of {table[0].numel()} / {table[1].numel()} "
                f"elements; these shapes need {lay.numels()}"
            )
        table = TABLES.unpack(lay, *table)
    out = torch.empty((b, h, s, d), dtype=q.dtype, device=q.device)
    k = block_idx.shape[-1]
    lse_shape = (b, h, s, k) if mix else (b, h, s)
    # mix: entries never named keep +inf (nothing normalised); otherwise every row is written
    lse = (
        torch.full(lse_shape, math.inf, dtype=torch.float32, device=q.device)
        if mix
        else torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    )
    grid = (b * table.n_s_tiles, h_kv)
    fwd_kernel[grid](
        q,
        bank_k,
        bank_v,
        out,
        lse,
        table.group_blocks,
        table.group_count,
        table.coef,
        table.ent,
        *strides4(q),
        *strides4(bank_k),
        *strides4(bank_v),
        *strides4(out),
        *lse_strides(lse),
        *table.group_blocks.stride(),
        table.coef.stride(0),
        table.coef.stride(1),
        table.coef_token_stride,
        table.ent.stride(0),
        table.ent.stride(1),
        table.ent_token_stride,
        s,
        t,
        d,
        h // h_kv,
        table.tokens_per_tile,
        table.n_s_tiles,
        scale * LOG2E,
        PER_TOKEN=table.per_token,
        MIX=mix,
        ONE_TILE=t <= launch.block_n,
        **launch.meta(),
    )
    if mix:
        lse, first = _expand_first(table, lse, h, s)
        lse = lse.masked_fill(first < 0, math.inf)
    return out, lse, table.ints, table.coef_buf


def _bwd_dkv(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    stats: Tensor,
    table: Table,
    launch: Launch,
    mix: bool,
    dense_kv: bool,
    table_strides: tuple,
    dims: tuple,
) -> tuple[Tensor, Tensor]:
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
        q,
        bank_k,
        bank_v,
        grad_out,
        lse,
        stats,
        acc_k,
        acc_v,
        n_chunk,
        chunk_u,
        chunk_off,
        table.ublocks,
        table.pair_off,
        table.pairs,
        table.coef,
        table.ent,
        *strides4(q),
        *strides4(bank_k),
        *strides4(bank_v),
        *strides4(grad_out),
        *lse_strides(lse),
        *table_strides,
        *strides4(acc_k),
        *dims,
        launch.dkv_chunk,
        lay.n_slots,
        PER_TOKEN=table.per_token,
        MIX=mix,
        ROW_BY_BLOCK=dense_kv and direct,
        **launch.meta(),
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
    dc = torch.zeros(
        (b, h, s, k) if need_dc else (1, 1, 1, 1), dtype=torch.float32, device=q.device
    )
    if mix:
        delta = lse  # unused: mix mode reads dC, written by the dQ kernel
    else:
        delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, S)
        if grad_lse is not None:  # d lse / d s = P, so dS = P·(dP − delta + dLSE)
            delta = delta - grad_lse.float()
    table_strides = (
        table.coef.stride(0),
        table.coef.stride(1),
        table.coef_token_stride,
        table.ent.stride(0),
        table.ent.stride(1),
        table.ent_token_stride,
    )
    dims = (s, t, d, h // h_kv, table.tokens_per_tile, table.n_s_tiles, scale, scale * LOG2E)
    one_tile = t <= launch.block_n
    # mix with blocks of several T tiles: dC must be complete before dS, so a first
    # launch only accumulates it.
    for dc_pass in [True, False] if mix and not one_tile else [False]:
        bwd_dq_kernel[(b * table.n_s_tiles, h_kv)](
            q,
            bank_k,
            bank_v,
            grad_out,
            lse,
            delta,
            dq,
            dc,
            table.group_blocks,
            table.group_count,
            table.coef,
            table.ent,
            *strides4(q),
            *strides4(bank_k),
            *strides4(bank_v),
            *strides4(grad_out),
            *strides4(dq),
            *lse_strides(lse),
            *lse_strides(dc),
            *table.group_blocks.stride(),
            *table_strides,
            *dims,
            PER_TOKEN=table.per_token,
            MIX=mix,
            NEED_DC=need_dc,
            ONE_TILE=one_tile,
            DC_PASS=dc_pass,
            **launch.meta(),
        )
    if need_kv:
        dk, dv = _bwd_dkv(
            q,
            bank_k,
            bank_v,
            grad_out,
            lse,
            dc if mix else delta,
            table,
            launch,
            mix,
            dense_kv,
            table_strides,
            dims,
        )
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
    n_u = (
        dq.new_empty(0, dtype=torch.int32)
        if dense_kv or not count_unique
        else (table.ublocks < bank_k.shape[0]).sum()
    )
    return dq, dk, dv, table.ublocks, n_u, dw
