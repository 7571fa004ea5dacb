"""Memory attention as torch custom ops: forward, backward, fake shapes and autograd.

`memtree::memory_attention_fwd` returns (out, lse), the joint softmax's lse
differentiable (so reads of several banks can be merged exactly);
`memtree::memory_attention_bwd` returns the gradients with the bank's part
restricted to the referenced blocks. Both dispatch inside: the Triton kernels
for CUDA tensors (or when `impl="triton"` under TRITON_INTERPRET=1), the
pure-torch reference otherwise,
with its explicit gathered backward. The ops are opaque to
torch.compile (the reference table needs host syncs), which traces them through
the fake implementations. The bank's gradient is a sparse COO tensor over the
unique referenced blocks (the backward op's (U, T, H_kv, D) rows) or, with
sparse_grad=False, those rows scattered into a bank-shaped tensor; only the
latter has static shapes, which torch.compile needs unless
torch._dynamo.config.capture_dynamic_output_shape_ops is set.
"""

import torch
from torch import Tensor

from kernels.memory_attention.naive import (
    memory_attention_naive,
    memory_attention_naive_backward,
)

IMPLS = ("auto", "triton", "naive")


def use_triton(q: Tensor, impl: str) -> bool:
    if impl == "naive" or (impl == "auto" and not q.is_cuda):
        return False
    if not q.is_cuda:
        from kernels.memory_attention.kernel import interpreting

        if not interpreting():
            raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1")
    return True


def is_mix(weights: Tensor | None, weight_mode: str) -> bool:
    """Without weights both modes are the plain joint softmax."""
    return weights is not None and weight_mode == "mix"


@torch.library.custom_op("memtree::memory_attention_fwd", mutates_args=())
def memory_attention_fwd(
    q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor, weights: Tensor | None,
    weight_mode: str, scale: float, impl: str, sparse_grad: bool,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, S, D), lse fp32 (B, H, S) or (B, H, S, k) in mix mode). sparse_grad
    only selects the bank gradient's layout in backward."""
    mix = is_mix(weights, weight_mode)
    if use_triton(q, impl):
        from kernels.memory_attention.kernel import forward

        return forward(q, bank_k, bank_v, block_idx, weights, mix, scale)
    out, lse = memory_attention_naive(q, bank_k, bank_v, block_idx, weights,
                                      weight_mode="mix" if mix else "bias", scale=scale,
                                      return_lse=True)
    return out.contiguous(), lse.contiguous()


@memory_attention_fwd.register_fake
def _fwd_fake(q, bank_k, bank_v, block_idx, weights, weight_mode, scale, impl, sparse_grad):
    b, h, s, _ = q.shape
    shape = (b, h, s, block_idx.shape[-1]) if is_mix(weights, weight_mode) else (b, h, s)
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        shape, dtype=torch.float32)


@torch.library.custom_op("memtree::memory_attention_bwd", mutates_args=())
def memory_attention_bwd(
    grad_out: Tensor, q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor,
    weights: Tensor | None, out: Tensor, lse: Tensor, grad_lse: Tensor | None,
    weight_mode: str, scale: float, impl: str, need_kv: bool, need_dw: bool, sparse_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq (B, H, S, D), blocks, dK, dV, dweights like weights).

    grad_lse: None, or the gradient (B, H, S) of the joint softmax's log-sum-exp
    (bias mode), which folds into delta: dS = P·(dP − (rowsum(dO·O) − dLSE)).
    sparse_grad: blocks (U,) int64 are the unique referenced block ids and dK/dV
    (U, T, H_kv, D) their gradients (U is data-dependent); otherwise dK/dV are
    bank-shaped and blocks is empty, so every shape is static. U = 0 without
    need_kv, dweights empty without need_dw.
    """
    mix = is_mix(weights, weight_mode)
    need_dw = need_dw and weights is not None
    if use_triton(q, impl):
        from kernels.memory_attention.kernel import backward

        dq, blocks, dk, dv, dw = backward(grad_out, q, bank_k, bank_v, block_idx, weights, out,
                                          lse.contiguous(), mix, scale, need_kv, need_dw,
                                          grad_lse=grad_lse)
        if need_kv and not sparse_grad:
            dk = dk.new_zeros(bank_k.shape).index_copy_(0, blocks, dk)
            dv = dv.new_zeros(bank_v.shape).index_copy_(0, blocks, dv)
            blocks = blocks[:0].clone()
        return dq, blocks, dk, dv, dw
    # sparse: gradients for the referenced blocks only, never a bank-sized buffer; no
    # blocks at all without need_kv; dense (blocks=None to the reference) otherwise
    blocks = block_idx.new_empty(0, dtype=torch.int64)
    if need_kv and sparse_grad:
        blocks = torch.unique(block_idx[block_idx >= 0]).long()
    dq, dk, dv, dw = memory_attention_naive_backward(
        grad_out, q, bank_k, bank_v, block_idx, weights,
        weight_mode="mix" if mix else "bias", scale=scale, grad_lse=grad_lse,
        blocks=None if need_kv and not sparse_grad else blocks)
    return dq.contiguous(), blocks, dk, dv, dw if need_dw else q.new_empty(0)


@memory_attention_bwd.register_fake
def _bwd_fake(grad_out, q, bank_k, bank_v, block_idx, weights, out, lse, grad_lse, weight_mode,
              scale, impl, need_kv, need_dw, sparse_grad):
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
    q, bank_k, bank_v, block_idx, weights, weight_mode, scale, impl, sparse_grad = inputs
    out, lse = output
    ctx.save_for_backward(q, bank_k, bank_v, block_idx, weights, out, lse)
    if is_mix(weights, weight_mode):  # per-block statistics; only the joint lse is a result
        ctx.mark_non_differentiable(lse)
    ctx.args = (weight_mode, scale, impl, sparse_grad)


def _backward(ctx, grad_out, grad_lse):
    q, bank_k, bank_v, block_idx, weights, out, lse = ctx.saved_tensors
    weight_mode, scale, impl, sparse_grad = ctx.args
    need_q, need_k, need_v, _, need_w = ctx.needs_input_grad[:5]
    if is_mix(weights, weight_mode):
        grad_lse = None
    dq, blocks, dk, dv, dw = memory_attention_bwd(
        grad_out, q, bank_k, bank_v, block_idx, weights, out, lse, grad_lse, weight_mode, scale,
        impl, need_k or need_v, need_w, sparse_grad)
    if sparse_grad:  # like nn.Embedding(sparse=True): indices = the referenced block ids
        dk = torch.sparse_coo_tensor(blocks[None], dk, bank_k.shape, is_coalesced=True)
        dv = torch.sparse_coo_tensor(blocks[None], dv, bank_v.shape, is_coalesced=True)
    return (
        dq if need_q else None,
        dk if need_k else None,
        dv if need_v else None,
        None,
        dw if need_w else None,
        None, None, None, None,
    )


memory_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
