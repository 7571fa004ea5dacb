"""Memory attention read by block index: the public function, its checks and its custom ops.

`memory_attention` checks its arguments and calls `memtree::memory_attention_fwd`,
which returns (out, lse, table ints, table coef), the joint softmax's lse
differentiable (so reads of several banks can be merged exactly) and the Triton
path's reference table (`table.build_table`, built on the device; empty for the
reference), which is saved for `memtree::memory_attention_bwd`. Calls that read the
same lists at the same shapes (a model's layers) can share one table built beforehand
by `memory_attention_table` (`table=`): the op then skips the build and saves the
given table for backward.
That returns the gradients with the bank's part restricted to the referenced
blocks. Both ops dispatch inside: the Triton kernels (`kernel.py`'s slot tiles, or
`blocks.py`'s block-major items for per-token lists with per_token_layout="blocks") for CUDA
tensors (or when `impl="triton"` under TRITON_INTERPRET=1), the pure-torch
reference (`naive.py`) otherwise, with its explicit gathered backward. The ops are
opaque to torch.compile, which traces them through the fake implementations.

The Triton path does no host synchronisation in forward or backward with
sparse_grad=False (the bank's gradient bank-shaped, every shape static): the
table's data-dependent sizes are padded to static bounds. The sparse COO gradient
(sparse_grad=True) has one row per unique referenced block, a data-dependent
shape, so its backward reads that count once (one sync); torch.compile needs
the dense form unless torch._dynamo.config.capture_dynamic_output_shape_ops is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from memtree.kernels.block_lists import count_blocks, needs_bank_grad
from memtree.kernels.eager import plain
from memtree.kernels.memory_attention.naive import (
    memory_attention_naive,
    memory_attention_naive_backward,
)

IMPLS = ("auto", "triton", "reference")
PER_TOKEN_LAYOUTS = ("auto", "tiles", "blocks")


def _triton_kernels():
    """kernel.py, imported on the first Triton call only: it imports triton (heavy, and
    not needed on the CPU), and the kernels pick the interpreter when they are defined,
    so a TRITON_INTERPRET=1 set before that first call is honoured."""
    from memtree.kernels.memory_attention import kernel

    return kernel


def _kernels_for(block_idx: Tensor, per_token_layout: str):
    """The Triton module that computes these lists: `blocks.py` (block-major items) for
    per-token lists with per_token_layout="blocks", `kernel.py` (slot tiles) otherwise
    ("auto" is resolved before, `resolve_layout`)."""
    if per_token_layout == "blocks" and block_idx.ndim == 3:
        from memtree.kernels.memory_attention import blocks

        return blocks
    return _triton_kernels()


def _use_triton(q: Tensor, impl: str) -> bool:
    if impl == "reference" or (impl == "auto" and not q.is_cuda):
        return False
    if not q.is_cuda and not _triton_kernels().interpreting():
        raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1")
    return True


def _is_mix(weights: Tensor | None, weight_mode: str) -> bool:
    """Without weights both modes are the plain joint softmax."""
    return weights is not None and weight_mode == "mix"


def _fwd_impl(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None,
    table_ints: Tensor | None,
    table_coef: Tensor | None,
    weight_mode: str,
    scale: float,
    impl: str,
    sparse_grad: bool,
    per_token_layout: str,
    n_unique: int = -1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out (B, H, S, D), lse fp32 (B, H, S) or (B, H, S, k) in mix mode, table ints (n_int,)
    int32, table coef (n_coef,) fp32). table_ints/table_coef: a table built beforehand
    (`memory_attention_table`), or None to build it here; the returned table buffers are
    empty when one was given (an output may not alias an input) and for the reference.
    sparse_grad only selects the bank gradient's layout in backward; per_token_layout the
    Triton kernels of per-token lists (`_kernels_for`; the table is that layout's); n_unique
    the given table's unique-block count when already read (`MemoryTable.n_unique`), handed to
    backward, else -1."""
    mix = _is_mix(weights, weight_mode)
    if _use_triton(q, impl):
        given = None if table_ints is None else (table_ints, table_coef)
        out, lse, ints, coef = _kernels_for(block_idx, per_token_layout).forward(
            q, bank_k, bank_v, block_idx, weights, mix, scale, table=given
        )
        if given is not None:
            ints, coef = ints[:0].clone(), coef[:0].clone()
        return out, lse, ints, coef
    out, lse = memory_attention_naive(
        q,
        bank_k,
        bank_v,
        block_idx,
        weights,
        weight_mode="mix" if mix else "bias",
        scale=scale,
        return_lse=True,
    )
    return (
        out.contiguous(),
        lse.contiguous(),
        q.new_empty(0, dtype=torch.int32),
        q.new_empty(0, dtype=torch.float32),
    )


# The bodies stay reachable as plain functions (`IMPLS_BY_OP`): the host-sync test runs them
# under a dispatch mode, to which the custom ops themselves are opaque.
memory_attention_fwd = torch.library.custom_op("memtree::memory_attention_fwd", mutates_args=())(
    _fwd_impl
)


@memory_attention_fwd.register_fake
def _fwd_fake(
    q,
    bank_k,
    bank_v,
    block_idx,
    weights,
    table_ints,
    table_coef,
    weight_mode,
    scale,
    impl,
    sparse_grad,
    per_token_layout,
    n_unique=-1,
):
    b, h, s, _ = q.shape
    shape = (b, h, s, block_idx.shape[-1]) if _is_mix(weights, weight_mode) else (b, h, s)
    n_int, n_coef = 0, 0
    if _use_triton(q, impl) and table_ints is None:  # static bounds from the shapes alone
        n_int, n_coef = _kernels_for(block_idx, per_token_layout).table_numels(
            q, bank_k, bank_v, block_idx, weights is not None
        )
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        q.new_empty(shape, dtype=torch.float32),
        q.new_empty(n_int, dtype=torch.int32),
        q.new_empty(n_coef, dtype=torch.float32),
    )


def _bwd_impl(
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
    grad_lse: Tensor | None,
    weight_mode: str,
    scale: float,
    impl: str,
    need_kv: bool,
    need_dw: bool,
    sparse_grad: bool,
    per_token_layout: str,
    n_unique: int = -1,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq (B, H, S, D), blocks, dK, dV, dweights like weights).

    table_ints, table_coef: the reference table the forward op returned (Triton path), of
    the per_token_layout forward used.

    grad_lse: None, or the gradient (B, H, S) of the joint softmax's log-sum-exp
    (bias mode), which folds into delta: dS = P·(dP − (rowsum(dO·O) − dLSE)).
    sparse_grad: blocks (U,) int64 are the unique referenced block ids and dK/dV
    (U, T, H_kv, D) their gradients (U is data-dependent); otherwise dK/dV are
    bank-shaped and blocks is empty, so every shape is static. U = 0 without
    need_kv, dweights empty without need_dw.
    """
    mix = _is_mix(weights, weight_mode)
    need_dw = need_dw and weights is not None
    if _use_triton(q, impl):
        sparse = need_kv and sparse_grad
        dq, dk, dv, ublocks, n_u, dw = _kernels_for(block_idx, per_token_layout).backward(
            grad_out,
            q,
            bank_k,
            bank_v,
            block_idx,
            weights,
            out,
            lse.contiguous(),
            table_ints,
            table_coef,
            mix,
            scale,
            need_kv,
            need_dw,
            not sparse,
            grad_lse=grad_lse,
            count_unique=n_unique < 0,
        )
        blocks = block_idx.new_empty(0, dtype=torch.int64)
        if sparse:  # the one host sync (unless the shared table's count was read already):
            n = n_unique if n_unique >= 0 else int(n_u.item())  # U is data-dependent
            blocks, dk, dv = ublocks[:n].long(), dk[:n], dv[:n]
        return dq, blocks, dk, dv, dw
    # sparse: gradients for the referenced blocks only, never a bank-sized buffer; no
    # blocks at all without need_kv; dense (blocks=None to the reference) otherwise
    blocks = block_idx.new_empty(0, dtype=torch.int64)
    if need_kv and sparse_grad:
        blocks = torch.unique(block_idx[block_idx >= 0]).long()
    dq, dk, dv, dw = memory_attention_naive_backward(
        grad_out,
        q,
        bank_k,
        bank_v,
        block_idx,
        weights,
        weight_mode="mix" if mix else "bias",
        scale=scale,
        grad_lse=grad_lse,
        blocks=None if need_kv and not sparse_grad else blocks,
    )
    return dq.contiguous(), blocks, dk, dv, dw if need_dw else q.new_empty(0)


memory_attention_bwd = torch.library.custom_op("memtree::memory_attention_bwd", mutates_args=())(
    _bwd_impl
)
IMPLS_BY_OP = {
    "memtree::memory_attention_fwd": _fwd_impl,
    "memtree::memory_attention_bwd": _bwd_impl,
}


@memory_attention_bwd.register_fake
def _bwd_fake(
    grad_out,
    q,
    bank_k,
    bank_v,
    block_idx,
    weights,
    out,
    lse,
    table_ints,
    table_coef,
    grad_lse,
    weight_mode,
    scale,
    impl,
    need_kv,
    need_dw,
    sparse_grad,
    per_token_layout,
    n_unique=-1,
):
    if need_kv and sparse_grad:
        n_u = torch.library.get_ctx().new_dynamic_size()
        k_shape, v_shape = (n_u, *bank_k.shape[1:]), (n_u, *bank_v.shape[1:])
    else:
        n_u = 0
        k_shape = bank_k.shape if need_kv else (0, *bank_k.shape[1:])
        v_shape = bank_v.shape if need_kv else (0, *bank_v.shape[1:])
    dw = torch.empty_like(weights) if need_dw and weights is not None else q.new_empty(0)
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        block_idx.new_empty(n_u, dtype=torch.int64),
        bank_k.new_empty(k_shape),
        bank_v.new_empty(v_shape),
        dw,
    )


def _setup_context(ctx, inputs, output):
    (
        q,
        bank_k,
        bank_v,
        block_idx,
        weights,
        given_ints,
        given_coef,
        weight_mode,
        scale,
        impl,
        sparse_grad,
        per_token_layout,
        n_unique,
    ) = inputs
    out, lse, table_ints, table_coef = output
    if given_ints is not None:  # built once for several calls (memory_attention_table)
        table_ints, table_coef = given_ints, given_coef
    # the table built in forward is handed to backward rather than rebuilt there
    ctx.save_for_backward(q, bank_k, bank_v, block_idx, weights, out, lse, table_ints, table_coef)
    ctx.mark_non_differentiable(output[2], output[3])
    if _is_mix(weights, weight_mode):  # per-block statistics; only the joint lse is a result
        ctx.mark_non_differentiable(lse)
    ctx.args = (weight_mode, scale, impl, sparse_grad, per_token_layout, n_unique)


def _backward(ctx, grad_out, grad_lse, _grad_ints, _grad_coef):
    q, bank_k, bank_v, block_idx, weights, out, lse, table_ints, table_coef = ctx.saved_tensors
    weight_mode, scale, impl, sparse_grad, per_token_layout, n_unique = ctx.args
    need_q, need_k, need_v, _, need_w = ctx.needs_input_grad[:5]
    if _is_mix(weights, weight_mode):
        grad_lse = None
    bwd = _bwd_impl if getattr(ctx, "eager", False) else memory_attention_bwd
    dq, blocks, dk, dv, dw = bwd(
        grad_out,
        q,
        bank_k,
        bank_v,
        block_idx,
        weights,
        out,
        lse,
        table_ints,
        table_coef,
        grad_lse,
        weight_mode,
        scale,
        impl,
        need_k or need_v,
        need_w,
        sparse_grad,
        per_token_layout,
        n_unique,
    )
    if sparse_grad:  # like nn.Embedding(sparse=True): indices = the referenced block ids
        dk = torch.sparse_coo_tensor(blocks[None], dk, bank_k.shape, is_coalesced=True)
        dv = torch.sparse_coo_tensor(blocks[None], dv, bank_v.shape, is_coalesced=True)
    return (
        dq if need_q else None,
        dk if need_k else None,
        dv if need_v else None,
        None,
        dw if need_w else None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


memory_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerRead(torch.autograd.Function):
    """memory_attention_fwd's autograd for eager calls (`kernels.eager`): the registration's
    forward, context and backward without the custom op's per-call host work."""

    @staticmethod
    def forward(*inputs):
        return _fwd_impl(*inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)
        ctx.eager = True

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, *grads)


def check_arguments(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None,
    weight_mode: str,
    impl: str = "auto",
    per_token_layout: str = "auto",
) -> None:
    """ValueError for arguments `memory_attention` cannot take (its docstring's shapes), shared
    by the other paths of the same function (`sdpa.py`, `flex.py`)."""
    if weight_mode not in ("bias", "mix"):
        raise ValueError(f"weight_mode must be 'bias' or 'mix', got {weight_mode!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if per_token_layout not in PER_TOKEN_LAYOUTS:
        raise ValueError(
            f"per_token_layout must be one of {PER_TOKEN_LAYOUTS}, got {per_token_layout!r}"
        )
    if q.ndim != 4:
        raise ValueError(f"q must be (B, H, S, D), got shape {tuple(q.shape)}")
    if bank_k.ndim != 4 or bank_k.shape != bank_v.shape:
        raise ValueError(
            f"bank_k/bank_v must both be (N, T, H_kv, D), got "
            f"{tuple(bank_k.shape)} and {tuple(bank_v.shape)}"
        )
    b, h, s, d = q.shape
    if bank_k.shape[3] != d:
        raise ValueError(f"bank head dim {bank_k.shape[3]} != query head dim {d}")
    if h % bank_k.shape[2]:
        raise ValueError(f"query heads {h} must be a multiple of memory KV heads {bank_k.shape[2]}")
    if block_idx.dtype.is_floating_point or block_idx.dtype.is_complex:
        raise ValueError(f"block_idx must be an integer tensor, got {block_idx.dtype}")
    if (
        block_idx.ndim not in (2, 3)
        or block_idx.shape[0] != b
        or block_idx.shape[-1] < 1
        or (block_idx.ndim == 3 and block_idx.shape[1] != s)
    ):
        raise ValueError(
            f"block_idx must be (B={b}, k) or (B={b}, S={s}, k), got {tuple(block_idx.shape)}"
        )
    if weights is not None and weights.shape != block_idx.shape:
        raise ValueError(
            f"weights shape {tuple(weights.shape)} != block_idx shape {tuple(block_idx.shape)}"
        )
    if len({q.device, bank_k.device, bank_v.device, block_idx.device}) > 1:
        raise ValueError("q, bank_k, bank_v and block_idx must be on one device")


@dataclass(frozen=True, eq=False)
class MemoryTable:
    """The Triton path's reference table for one set of block lists, built once by
    `memory_attention_table` and passed to every `memory_attention` call that reads the same
    lists at the same shapes (a model's layers, one table per memory level and step).

    ints (n_int,) int32, coef (n_coef,) fp32: the table's buffers (kernel.py's docstring);
    key: what it was built for (shapes, dtypes, device, weighted, the per-token layout),
    checked on every use."""

    ints: Tensor
    coef: Tensor
    key: tuple
    block_idx: Tensor | None = field(default=None, repr=False)
    _count: list = field(default_factory=list, repr=False)  # the unique-block count, once read

    def n_unique(self) -> int:
        """Distinct block ids the lists reference (the sparse bank gradient's row count U):
        read on the first call (a host sync) and cached, so the calls sharing this table sync
        once between them instead of once each in backward."""
        if not self._count:
            self._count.append(count_blocks(self.block_idx))
        return self._count[0]


# per_token_layout="auto" takes the block-major items where a tile's distinct blocks exceed
# this many times k. On an H100 at moc's shape (k = 65, 64-token tiles, bf16; BENCHMARKS,
# 2026-11-27 14:40) the tiles took 6.5-7.7 ms forward+backward at 65-129 slots per tile and
# 63.8 at 2,588, the items 12.9-15.3 whatever the lists: the tiles' cost, linear in the slots,
# crosses the items' near 430 slots, 6.6 k.
AUTO_BLOCKS_SLOTS_PER_K = 6.0


def slots_per_tile(q: Tensor, bank_k: Tensor, block_idx: Tensor) -> Tensor:
    """Mean distinct blocks a query tile of the slot-tile layout names, () fp32 on the device:
    what the tiles' cost follows (`kernel.py`); per-token lists (B, S, k) only."""
    from memtree.kernels.memory_attention.kernel import tokens_per_tile

    ts = tokens_per_tile(q, bank_k, block_idx)
    s, k = block_idx.shape[1:]
    pad = -s % ts
    tiles = torch.nn.functional.pad(block_idx, (0, 0, 0, pad), value=-1).reshape(-1, ts * k)
    srt = tiles.sort(dim=1).values
    heads = (srt >= 0) & (srt != torch.nn.functional.pad(srt[:, :-1], (1, 0), value=-1))
    return heads.sum(1, dtype=torch.float32).mean()


def resolve_layout(q: Tensor, bank_k: Tensor, block_idx: Tensor, per_token_layout: str) -> str:
    """The per-token layout a call runs: "auto" becomes "blocks" for per-token lists whose
    tiles name more than AUTO_BLOCKS_SLOTS_PER_K · k distinct blocks (one host read of that
    mean, skipped where the tile size or the bank bounds it below), "tiles" otherwise, under
    torch.compile (no data-dependent choice in a graph) and under
    torch.use_deterministic_algorithms (the items' atomics are not reproducible)."""
    if (
        per_token_layout != "auto"
        or block_idx.ndim != 3
        or torch.compiler.is_compiling()
        or torch.are_deterministic_algorithms_enabled()
    ):
        return "tiles" if per_token_layout == "auto" else per_token_layout
    from memtree.kernels.memory_attention.kernel import tokens_per_tile

    k = block_idx.shape[-1]
    if (
        min(tokens_per_tile(q, bank_k, block_idx) * k, bank_k.shape[0])
        <= AUTO_BLOCKS_SLOTS_PER_K * k
    ):
        return "tiles"  # no tile can name enough blocks: nothing to read
    ratio = float(slots_per_tile(q, bank_k, block_idx)) / k
    return "blocks" if ratio > AUTO_BLOCKS_SLOTS_PER_K else "tiles"


def _table_key(
    q: Tensor, bank_k: Tensor, block_idx: Tensor, weights: Tensor | None, per_token_layout: str
) -> tuple:
    blocks = per_token_layout == "blocks" and block_idx.ndim == 3  # the table's kind
    return (
        tuple(q.shape),
        q.dtype,
        tuple(bank_k.shape),
        bank_k.dtype,
        tuple(block_idx.shape),
        weights is not None,
        q.device,
        "blocks" if blocks else "tiles",
    )


def memory_attention_table(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None = None,
    *,
    impl: str = "auto",
    per_token_layout: str = "auto",
) -> MemoryTable | None:
    """The reference table `memory_attention(q, bank_k, bank_v, block_idx, weights, impl=impl,
    per_token_layout=per_token_layout)` would build, built now so that several calls share it
    (`table=`; only calls with the same per-token layout). Only shapes, dtypes
    and devices are read from q and the banks; block_idx (B, k) or (B, S, k) and weights
    (same shape) are read in full, so a table is valid only for these lists and weights.
    None where the call would run the reference, which needs no table. The build is a few
    dozen small device ops and no host sync (each op costs host time: on an H100 the
    table's ~170 dispatched ops took 1.2 ms of host time against 0.09 ms on the device)."""
    check_arguments(q, bank_k, bank_v, block_idx, weights, "bias", impl, per_token_layout)
    if not _use_triton(q, impl):
        return None
    per_token_layout = resolve_layout(q, bank_k, block_idx, per_token_layout)
    ints, coef = _kernels_for(block_idx, per_token_layout).build(
        q, bank_k, bank_v, block_idx, weights
    )
    return MemoryTable(
        ints=ints,
        coef=coef,
        block_idx=block_idx,
        key=_table_key(q, bank_k, block_idx, weights, per_token_layout),
    )


def memory_attention(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None = None,
    *,
    weight_mode: str = "bias",
    scale: float | None = None,
    sparse_grad: bool | None = None,
    impl: str = "auto",
    return_lse: bool = False,
    table: MemoryTable | None = None,
    per_token_layout: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of the queries over the memory blocks each sequence (or token) names.

    Reads K/V by block id without gathering copies; the Triton kernel and `naive.py`
    implement the same function.

    Args:
        q: (B, H, S, D) queries from the token stream.
        bank_k, bank_v: (N, T, H_kv, D), the bank of N memory blocks (chapters) of T
            tokens; H % H_kv == 0 (GQA).
        block_idx: integer (B, k) per-sequence block lists, or (B, S, k) per-token lists;
            -1 marks padding (ragged k). A block may repeat within a list: it then counts
            once per entry.
        weights: None or float, same shape as block_idx (router weights). weight_mode
            "bias": one softmax over every referenced token, log(weight) added to the
            block's logits (weights must be > 0); "mix": a softmax per block, block
            outputs summed with the weights. Without weights both are the plain joint
            softmax (see the package docstring for which mode is exact for what).
        scale: the logits' scale, default 1/sqrt(D).
        sparse_grad: the bank's gradient as a sparse COO tensor (indices = the block ids,
            as nn.Embedding(sparse=True) gives) or scattered into a dense bank-shaped
            tensor. None: sparse when both banks are leaves (parameters), dense for
            computed banks (views and matmuls upstream do not take sparse gradients).
            True on a non-leaf bank is for callers whose upstream op accepts sparse
            gradients (training.bank's row views). The sparse form's row count (the
            number of unique blocks U) is data-dependent: its backward reads U on the host
            once (the dense form has no host sync at all), and torch.compile needs the
            dense form unless torch._dynamo.config.capture_dynamic_output_shape_ops is set.
        impl: "auto" (Triton on CUDA, the reference on CPU), "triton" (also on CPU under
            TRITON_INTERPRET=1), or "reference" (`memory_attention_naive`, everywhere).
        return_lse: also return the joint softmax's log-sum-exp (not in "mix" mode).
        table: the reference table from `memory_attention_table` for these same block_idx,
            weights and shapes, shared by several calls instead of built by each; None
            builds it here. A table built for other shapes is refused (ValueError); one
            built from other lists or weights of the same shapes is not detected. With
            sparse bank gradients the calls sharing a table read U once between them
            (`MemoryTable.n_unique`, at the first call) instead of once per backward.
        per_token_layout: how the Triton path computes per-token lists (B, S, k); ignored
            for per-sequence lists and by the reference. "tiles": slot tiles (`kernel.py`),
            a tile of tokens computes every block any of its tokens names, cheap when
            neighbouring tokens share blocks, up to ~40x the useful work when lists are
            random. "blocks": block-major (`blocks.py`), one (token, block) item per distinct
            block in a token's list, each block's items computed together and merged per
            token; its cost follows the useful work whatever the locality, plus an fp32
            (B, H, S, k, D) buffer of per-block reads, and its backward adds dq and the bank
            gradient with fp32 atomics (not bit-reproducible; refused under
            torch.use_deterministic_algorithms). "auto": "blocks" where a tile's lists
            name more than AUTO_BLOCKS_SLOTS_PER_K (6) · k distinct blocks (`resolve_layout`,
            one host read of that mean per call, or per table), "tiles" otherwise (and
            under torch.compile or deterministic algorithms). A table (`table=`) must come
            from the same layout; with "auto" the call takes the table's.

    Returns:
        out: (B, H, S, D) in q's dtype; no causal mask over memory; a query whose blocks
        are all padding reads zeros. With return_lse, (out, lse): lse fp32 (B, H, S), the
        log-sum-exp of the scaled logits (log-weights included), -inf for a query without
        valid blocks; differentiable. Reads of several banks (a hierarchical path's
        levels, whose blocks differ in size) merge exactly into one softmax over all
        their tokens: out = Σ_i softmax_i(lse_i) · out_i.

    Gradients: dq (B, H, S, D); the bank's gradient is computed only for the U unique
    referenced blocks and returned in the layout sparse_grad selects (sparse: a
    (U, T, H_kv, D) buffer, never a bank-sized one; dense: written straight into the
    bank-shaped tensor); d(weights) like weights. A block id >= N fails a device-side
    assertion (RuntimeError on the CPU) on the Triton path.
    """
    check_arguments(q, bank_k, bank_v, block_idx, weights, weight_mode, impl, per_token_layout)
    if return_lse and _is_mix(weights, weight_mode):
        raise ValueError(
            "return_lse: mix mode normalises each block on its own; there is no "
            "joint log-sum-exp to return"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if sparse_grad is None:
        sparse_grad = bank_k.is_leaf and bank_v.is_leaf
    ints = coef = None
    n_unique = -1
    if table is not None and _use_triton(q, impl):  # the reference reads no table
        if per_token_layout == "auto":  # the layout the table was built for
            per_token_layout = table.key[-1]
        key = _table_key(q, bank_k, block_idx, weights, per_token_layout)
        if table.key != key:
            raise ValueError(
                f"table was built for {table.key}, this call is {key} (shapes q, "
                "bank_k, block_idx, weighted, device, per-token layout)"
            )
        ints, coef = table.ints, table.coef
        if needs_bank_grad(bool(sparse_grad), bank_k, bank_v):
            n_unique = table.n_unique()
    elif _use_triton(q, impl):
        per_token_layout = resolve_layout(q, bank_k, block_idx, per_token_layout)
    fwd = _EagerRead.apply if plain(q, bank_k, bank_v) else memory_attention_fwd
    out, lse, _, _ = fwd(
        q,
        bank_k,
        bank_v,
        block_idx,
        weights,
        ints,
        coef,
        weight_mode,
        scale,
        impl,
        bool(sparse_grad),
        per_token_layout,
        n_unique,
    )
    if not return_lse:
        return out
    # the ops mark "nothing to normalise" with +inf (exp(s − lse) = 0); to callers it is -inf
    return out, lse.masked_fill(torch.isposinf(lse), -math.inf)
