"""Memory attention read by block index (seed 000 §5, seed 004 §8.5, seed 002 App. I).

Contract (the Triton kernel and `naive.py` implement the same function):

    memory_attention(q, bank_k, bank_v, block_idx, weights=None, *,
                     weight_mode="bias", scale=None, sparse_grad=None,
                     impl="auto", return_lse=False) -> out | (out, lse)

- q: (B, H, S, D) queries from the token stream.
- bank_k, bank_v: (N, T, H_kv, D) the bank of N memory blocks (chapters) of T
  tokens; H % H_kv == 0 (GQA).
- block_idx: int64 (B, k) per-sequence block lists, or (B, S, k) per-token
  lists; -1 marks padding (ragged k). A block may repeat within a list: it
  then counts once per entry.
- weights: None or float, same shape as block_idx (router weights).
  weight_mode "bias": one softmax over every referenced token, log(weight)
  added to the block's logits; "mix": a softmax per block, block outputs
  summed with the weights. Without weights both are the plain joint softmax.
- out: (B, H, S, D) in q's dtype; no causal mask over memory; a query whose
  blocks are all padding reads zeros.
- lse (return_lse, joint softmax only): fp32 (B, H, S) log-sum-exp of the
  scaled logits (log-weights included), -inf for a query without valid
  blocks; differentiable. Reads of several banks (a hierarchical path's
  levels, whose blocks differ in size) merge exactly into one softmax over
  all their tokens: out = Σ_i softmax_i(lse_i) · out_i.

Which weight mode is exact for what:
- weights=None: exactly seed 000 eq. (4) over the concatenated selected
  chapters M_S (Algorithm 1, sequence-level top-k), i.e. SDPA on the gathered
  blocks; also a hierarchical path's KV blocks read as one memory.
- "mix": exact for MoC's weighted routed read (as in mixture-of-experts):
  every chapter normalised on its own, outputs mixed by the router weights
  (fold a routed scaling factor into the weights). Gradients reach the
  router through d(weights) = dO · O_block.
- "bias": a joint softmax in which weight w_c multiplies every token of
  chapter c before normalisation: out = Σ_c w_c Z_c O_c / Σ_c w_c Z_c, with
  Z_c the chapter's partition sum and O_c its own softmax read. That is
  "mix" with the query-dependent weights w_c Z_c / Σ w Z (they sum to 1 and
  favour chapters the query matches), so the two differ in general. It is
  exact for attention over the concatenated chapters with the router as a
  log-prior on each chapter's tokens; constant weights give the unweighted
  read. Weights must be > 0.

Gradients: dq (B, H, S, D); the bank's gradient is computed only for the U
unique referenced blocks (a (U, T, H_kv, D) buffer, never a bank-sized one).
It is returned as a sparse COO tensor (indices = the block ids), as
nn.Embedding(sparse=True) gives, when sparse_grad is True, or when it is None
and both banks are leaves (parameters); otherwise it is scattered into a
dense bank-shaped tensor (computed banks: views and matmuls upstream do not
take sparse gradients). sparse_grad=True on a non-leaf bank is for callers
whose upstream op accepts sparse gradients (training.bank's row views).
torch.compile needs the dense form unless
torch._dynamo.config.capture_dynamic_output_shape_ops is set (U is
data-dependent). d(weights) like weights.

impl: "auto" (Triton on CUDA, the reference on CPU), "triton" (also on CPU
under TRITON_INTERPRET=1), "naive" (the reference everywhere).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kernels.memory_attention import op
from kernels.memory_attention.naive import memory_attention_naive

__all__ = ["memory_attention", "memory_attention_naive"]


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
) -> Tensor | tuple[Tensor, Tensor]:
    """q (B, H, S, D), bank_k/bank_v (N, T, H_kv, D), block_idx (B, k) or (B, S, k) int,
    weights like block_idx or None → (B, H, S, D) in q's dtype (see the module docstring);
    with return_lse also the joint softmax's lse, fp32 (B, H, S), -inf where nothing is read.

    scale defaults to 1/sqrt(D). Reads K/V by block id without gathering copies.
    sparse_grad None: sparse bank gradients for leaf banks, dense for computed ones.
    """
    _validate(q, bank_k, bank_v, block_idx, weights, weight_mode, impl)
    if return_lse and op.is_mix(weights, weight_mode):
        raise ValueError("return_lse: mix mode normalises each block on its own; there is no "
                         "joint log-sum-exp to return")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if sparse_grad is None:
        sparse_grad = bank_k.is_leaf and bank_v.is_leaf
    out, lse = op.memory_attention_fwd(q, bank_k, bank_v, block_idx, weights, weight_mode, scale,
                                       impl, bool(sparse_grad))
    if not return_lse:
        return out
    # the ops mark "nothing to normalise" with +inf (exp(s − lse) = 0); to callers it is -inf
    return out, lse.masked_fill(torch.isposinf(lse), -math.inf)


def _validate(q: Tensor, bank_k: Tensor, bank_v: Tensor, block_idx: Tensor,
              weights: Tensor | None, weight_mode: str, impl: str) -> None:
    if weight_mode not in ("bias", "mix"):
        raise ValueError(f"weight_mode must be 'bias' or 'mix', got {weight_mode!r}")
    if impl not in op.IMPLS:
        raise ValueError(f"impl must be one of {op.IMPLS}, got {impl!r}")
    if q.ndim != 4:
        raise ValueError(f"q must be (B, H, S, D), got shape {tuple(q.shape)}")
    if bank_k.ndim != 4 or bank_k.shape != bank_v.shape:
        raise ValueError(f"bank_k/bank_v must both be (N, T, H_kv, D), got "
                         f"{tuple(bank_k.shape)} and {tuple(bank_v.shape)}")
    b, h, s, d = q.shape
    if bank_k.shape[3] != d:
        raise ValueError(f"bank head dim {bank_k.shape[3]} != query head dim {d}")
    if h % bank_k.shape[2]:
        raise ValueError(f"query heads {h} must be a multiple of memory KV heads "
                         f"{bank_k.shape[2]}")
    if block_idx.dtype.is_floating_point or block_idx.dtype.is_complex:
        raise ValueError(f"block_idx must be an integer tensor, got {block_idx.dtype}")
    if block_idx.ndim not in (2, 3) or block_idx.shape[0] != b or block_idx.shape[-1] < 1 or (
            block_idx.ndim == 3 and block_idx.shape[1] != s):
        raise ValueError(f"block_idx must be (B={b}, k) or (B={b}, S={s}, k), got "
                         f"{tuple(block_idx.shape)}")
    if weights is not None and weights.shape != block_idx.shape:
        raise ValueError(f"weights shape {tuple(weights.shape)} != block_idx shape "
                         f"{tuple(block_idx.shape)}")
    if len({q.device, bank_k.device, bank_v.device, block_idx.device}) > 1:
        raise ValueError("q, bank_k, bank_v and block_idx must be on one device")
