"""The FFN-memory read: the public function, its checks and its custom ops.

`ffn_memory` checks its arguments and calls `memtree::ffn_memory`; the ops
(forward and `memtree::ffn_memory_backward`) pick the Triton kernels
(`kernel.py`) on CUDA (or on CPU under TRITON_INTERPRET=1 when impl="triton")
and the pure-torch reference (`naive.py`) otherwise. Both ops have fake
implementations, so torch.compile traces them as opaque nodes, and the forward
has an autograd formula that calls the backward op and turns its per-block
gradient slots into a sparse COO bank gradient or a dense one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from memtree.kernels.block_lists import count_blocks, needs_bank_grad
from memtree.kernels.eager import plain
from memtree.kernels.ffn_memory import kernel
from memtree.kernels.ffn_memory.naive import ffn_memory_naive, ffn_memory_naive_backward

IMPLS = ("auto", "triton", "reference")


def _use_triton(x: Tensor, impl: str) -> bool:
    if impl == "reference" or (impl == "auto" and x.device.type != "cuda"):
        return False
    if x.device.type == "cpu" and not kernel.interpreting():
        raise RuntimeError(
            "impl='triton' on CPU needs TRITON_INTERPRET=1 set before "
            "kernels.ffn_memory is first imported"
        )
    return True


def _groups(table: Tensor | None) -> kernel.PairGroups | None:
    return None if table is None else kernel.unpack_groups(table)


def _forward_impl(
    x: Tensor,
    bank_w1: Tensor,
    bank_w2: Tensor,
    bank_w3: Tensor,
    block_idx: Tensor,
    table: Tensor | None = None,
    *,
    sparse_grad: bool,
    num_slots: int = -1,
    impl: str,
) -> Tensor:
    if _use_triton(x, impl):
        return kernel.ffn_memory_forward(x, bank_w1, bank_w2, bank_w3, block_idx, _groups(table))
    return ffn_memory_naive(x, bank_w1, bank_w2, bank_w3, block_idx).contiguous()


_ffn_memory_op = torch.library.custom_op("memtree::ffn_memory", mutates_args=())(_forward_impl)


@_ffn_memory_op.register_fake
def _(x, bank_w1, bank_w2, bank_w3, block_idx, table=None, *, sparse_grad, num_slots=-1, impl):
    return x.new_empty(x.shape)


def _reference_backward(dy, x, bank_w1, bank_w2, bank_w3, block_idx, num_slots, groups=None):
    """The backward op's contract computed from the naive per-pair gradients."""
    dx, *pair_grads = ffn_memory_naive_backward(dy, x, bank_w1, bank_w2, bank_w3, block_idx)
    if groups is None:
        groups = kernel.group_pairs(block_idx, bank_w1.shape[0])
    pair_slot = torch.empty_like(groups.slot).scatter_(0, groups.order, groups.slot)  # (P,)
    valid = block_idx.reshape(-1) >= 0
    grads = []
    for g, bank in zip(pair_grads, (bank_w1, bank_w2, bank_w3)):
        out = g.new_zeros(num_slots, *bank.shape[1:])
        out.index_add_(0, pair_slot[valid], g.flatten(0, 1)[valid])
        grads.append(out.to(bank.dtype))
    return dx.contiguous(), *grads, kernel.slot_ids(groups, num_slots)


def _backward_impl(
    dy: Tensor,
    x: Tensor,
    bank_w1: Tensor,
    bank_w2: Tensor,
    bank_w3: Tensor,
    block_idx: Tensor,
    table: Tensor | None,
    num_slots: int,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    args = (dy, x, bank_w1, bank_w2, bank_w3, block_idx, num_slots, _groups(table))
    if _use_triton(x, impl):
        return kernel.ffn_memory_backward(*args)
    return _reference_backward(*args)


_ffn_memory_backward_op = torch.library.custom_op("memtree::ffn_memory_backward", mutates_args=())(
    _backward_impl
)


@_ffn_memory_backward_op.register_fake
def _(dy, x, bank_w1, bank_w2, bank_w3, block_idx, table, num_slots, impl):
    grads = [b.new_empty(num_slots, *b.shape[1:]) for b in (bank_w1, bank_w2, bank_w3)]
    return x.new_empty(x.shape), *grads, block_idx.new_empty(num_slots)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.sparse_grad = keyword_only_inputs["sparse_grad"]
    ctx.num_slots = keyword_only_inputs["num_slots"]
    ctx.impl = keyword_only_inputs["impl"]


def _bank_grad(slots: Tensor, ids: Tensor, bank: Tensor, sparse: bool) -> Tensor:
    """Slot gradients (U, W, d) with block ids (U,) -> the bank's gradient (N, W, d)."""
    if sparse:  # ids are the sorted distinct referenced blocks, exactly U of them
        return torch.sparse_coo_tensor(ids[None], slots, bank.shape, is_coalesced=True)
    # Unused slots (id -1) hold zeros; sending them to block 0 adds nothing.
    return slots.new_zeros(bank.shape).index_add_(0, ids.clamp(min=0), slots)


def _backward(ctx, dy):
    x, bank_w1, bank_w2, bank_w3, block_idx, table = ctx.saved_tensors
    if not ctx.sparse_grad:  # static upper bound, so the graph has no data-dependent shape
        num_slots = block_idx.numel()
    elif ctx.num_slots >= 0:  # counted once for a shared table (FFNTable.num_slots)
        num_slots = ctx.num_slots
    else:  # exact slot count: one host sync, like any data-dependent nnz
        num_slots = count_blocks(block_idx)
    bwd = _backward_impl if getattr(ctx, "eager", False) else torch.ops.memtree.ffn_memory_backward
    dx, g1, g2, g3, ids = bwd(
        dy, x, bank_w1, bank_w2, bank_w3, block_idx, table, num_slots, ctx.impl
    )
    banks = (bank_w1, bank_w2, bank_w3)
    bank_grads = [_bank_grad(g, ids, b, ctx.sparse_grad) for g, b in zip((g1, g2, g3), banks)]
    return dx, *bank_grads, None, None


_ffn_memory_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerFFN(torch.autograd.Function):
    """The op's autograd for eager calls (`kernels.eager`): the registration's forward,
    context and backward without the custom op's per-call host work."""

    @staticmethod
    def forward(x, bank_w1, bank_w2, bank_w3, block_idx, table, sparse_grad, num_slots, impl):
        return _forward_impl(
            x,
            bank_w1,
            bank_w2,
            bank_w3,
            block_idx,
            table,
            sparse_grad=sparse_grad,
            num_slots=num_slots,
            impl=impl,
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, sparse_grad, num_slots, impl = inputs
        _setup_context(
            ctx,
            tuple(tensors),
            {"sparse_grad": sparse_grad, "num_slots": num_slots, "impl": impl},
            output,
        )
        ctx.eager = True

    @staticmethod
    def backward(ctx, dy):
        return (*_backward(ctx, dy), None, None, None)


@dataclass(eq=False)
class FFNTable:
    """The (sequence, block) pairs of one block list sorted by block id, built once by
    `ffn_memory_table` and passed to every `ffn_memory` call that reads the same list (a
    model's layers, one table per memory level and step): each call then skips the sort
    (forward and backward), and with sparse gradients the distinct blocks are counted once
    (one host sync per table instead of one per call's backward).

    packed (6, P) int64, P = B·k: the sorted pairs (`kernel.pack_groups`); key: what it was
    built for (block_idx's shape, N, device), checked on every use."""

    packed: Tensor
    key: tuple
    block_idx: Tensor = field(repr=False)
    _num_slots: int | None = field(default=None, repr=False)

    def num_slots(self) -> int:
        """The distinct referenced blocks: counted on the first call (a host sync), cached."""
        if self._num_slots is None:
            self._num_slots = count_blocks(self.block_idx)
        return self._num_slots


def _table_key(block_idx: Tensor, n_blocks: int) -> tuple:
    return (tuple(block_idx.shape), int(n_blocks), block_idx.device)


def ffn_memory_table(block_idx: Tensor, n_blocks: int) -> FFNTable:
    """The sorted pairs `ffn_memory(x, …, block_idx)` with banks of `n_blocks` blocks builds in
    forward and again in backward, built now so that several calls share them (`table=`).

    block_idx: int64 (B, k) as for `ffn_memory`, read in full: the table is valid only for
    these lists. A handful of device ops (sort, two searchsorted, cumsum, stack) and no host
    sync."""
    if block_idx.dtype != torch.int64 or block_idx.ndim != 2:
        raise ValueError(
            f"block_idx must be int64 (B, k), got {block_idx.dtype} {tuple(block_idx.shape)}"
        )
    packed = kernel.pack_groups(kernel.group_pairs(block_idx, n_blocks))
    return FFNTable(packed=packed, key=_table_key(block_idx, n_blocks), block_idx=block_idx)


def _check(x: Tensor, banks: tuple[Tensor, Tensor, Tensor], block_idx: Tensor, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if x.ndim != 3:
        raise ValueError(f"x must be (B, S, d), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    for name, b in zip(("bank_w1", "bank_w2", "bank_w3"), banks):
        if b.ndim != 3 or b.shape != banks[0].shape or b.shape[2] != x.shape[2]:
            raise ValueError(
                f"{name} must be (N, W, d={x.shape[2]}) like bank_w1 "
                f"{tuple(banks[0].shape)}, got {tuple(b.shape)}"
            )
        if b.stride(2) != 1 or b.stride(1) != b.shape[2]:
            raise ValueError(
                f"{name}'s inner (W, d) dims must be contiguous, got strides {tuple(b.stride())}"
            )
        if b.dtype not in (torch.float32, torch.float16, torch.bfloat16) or b.device != x.device:
            raise ValueError(
                f"{name} must be a float32/float16/bfloat16 tensor on {x.device}, "
                f"got {b.dtype} on {b.device}"
            )
    if block_idx.dtype != torch.int64 or block_idx.ndim != 2 or block_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"block_idx must be int64 (B={x.shape[0]}, k), got {block_idx.dtype} "
            f"{tuple(block_idx.shape)}"
        )
    if block_idx.device != x.device:
        raise ValueError(f"block_idx must be on {x.device}, got {block_idx.device}")


def ffn_memory(
    x: Tensor,
    bank_w1: Tensor,
    bank_w2: Tensor,
    bank_w3: Tensor,
    block_idx: Tensor,
    *,
    sparse_grad: bool = True,
    impl: str = "auto",
    table: FFNTable | None = None,
) -> Tensor:
    """FFN-memory read: y = Σ_j [silu(x W1[idx_j]ᵀ) ⊙ (x W2[idx_j]ᵀ)] W3[idx_j].

    Args:
        x: (B, S, d) float32/float16/bfloat16 tokens (the FFN input).
        bank_w1, bank_w2, bank_w3: (N, W, d) banks of N blocks of memory width W. The
            inner (W, d) dims must be contiguous; the block stride is free, so views into
            a wider per-level table work. Cast to x's dtype for the matmuls.
        block_idx: int64 (B, k), each sequence's blocks, entries in [-1, N) (not checked
            on the device); -1 is padding. A sequence's memory is its blocks concatenated
            along the width, so the result is a sum over its blocks; repeats count twice.
        sparse_grad: bank gradients as sparse COO tensors (N, W, d) whose nnz are the
            referenced blocks (like nn.Embedding(sparse=True); costs one host sync per
            backward to count them), else dense (N, W, d) tensors (use this under
            torch.compile and torch.library.opcheck, and for banks that are slices of a
            table that requires grad: slicing's backward has no sparse kernel).
        impl: "auto" (Triton on CUDA, the reference elsewhere), "triton" (also on CPU
            under TRITON_INTERPRET=1), or "reference" (`ffn_memory_naive`).
        table: `ffn_memory_table(block_idx, N)` shared by several calls on the same block
            lists (a ValueError if built for another shape, N or device), or None to sort
            the pairs in this call.

    Returns:
        y: (B, S, d) in x's dtype, accumulated in fp32. Gradients flow to x (in x's dtype)
        and the banks (in their dtypes). The Triton path needs B·k·S < 2³¹.

    Gradients: dx (B, S, d), and for each bank a gradient on the referenced blocks only,
    computed as (U, W, d) slots for the U distinct blocks (never a bank-sized buffer) and
    returned as a sparse COO or dense (N, W, d) tensor as sparse_grad selects; with sparse
    gradients the banks must be leaves or views whose backward accepts them, which slices
    do not.
    """
    _check(x, (bank_w1, bank_w2, bank_w3), block_idx, impl)
    packed, num_slots = None, -1
    if table is not None:
        key = _table_key(block_idx, bank_w1.shape[0])
        if table.key != key:
            raise ValueError(
                f"table was built for (block_idx shape, N, device) {table.key}, this call has {key}"
            )
        packed = table.packed
        if needs_bank_grad(sparse_grad, bank_w1, bank_w2, bank_w3):
            num_slots = table.num_slots()
    if plain(x, bank_w1, bank_w2, bank_w3):
        return _EagerFFN.apply(
            x, bank_w1, bank_w2, bank_w3, block_idx, packed, sparse_grad, num_slots, impl
        )
    return _ffn_memory_op(
        x,
        bank_w1,
        bank_w2,
        bank_w3,
        block_idx,
        packed,
        sparse_grad=sparse_grad,
        num_slots=num_slots,
        impl=impl,
    )
