"""Pure-torch reference for memory attention read by block index.

It gathers the referenced blocks into an explicit (…, k·T, H, D) copy, which
is exactly what the Triton kernel avoids; it exists to define the semantics
and to check the kernel's outputs and gradients. The explicit backward is the
CPU backward of the custom op (autograd does not run inside an op's body);
tests check it against autograd through the forward. Shapes are documented in
`kernels.memory_attention.op.memory_attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class _Gathered:
    """Copies of the referenced blocks and the softmax over them.

    S' is S for per-token lists and 1 for per-sequence lists: one copy per
    sequence then serves all its queries by broadcasting."""

    valid: Tensor  # (B, S', k)
    safe: Tensor  # (B, S', k) block ids, padding → 0
    w: Tensor | None  # (B, S', k) fp32 weights
    mix: bool
    kk: Tensor  # (B, H, S', k, T, D) fp32
    vv: Tensor  # (B, H, S', k, T, D) fp32
    p: Tensor  # (B, H, S, k, T) probabilities, per block (unweighted) when mix
    lse: Tensor  # (B, H, S) or (B, H, S, k) when mix


def _gather(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None,
    weight_mode: str,
    scale: float,
) -> _Gathered:
    h = q.shape[1]
    t, h_kv = bank_k.shape[1:3]
    if h % h_kv:
        raise ValueError(f"query heads {h} must be a multiple of memory KV heads {h_kv}")
    if weight_mode not in ("bias", "mix"):
        raise ValueError(f"weight_mode must be 'bias' or 'mix', got {weight_mode!r}")
    idx = block_idx if block_idx.ndim == 3 else block_idx[:, None, :]  # (B, S', k)
    k = idx.shape[-1]
    valid = idx >= 0  # (B, S', k)
    safe = idx.clamp(min=0)
    groups = h // h_kv
    # (B, S', k, T, H_kv, D) → (B, H, S', k, T, D): an explicit copy per sequence (per token
    # for per-token lists).
    kk = bank_k.float()[safe].permute(0, 4, 1, 2, 3, 5).repeat_interleave(groups, dim=1)
    vv = bank_v.float()[safe].permute(0, 4, 1, 2, 3, 5).repeat_interleave(groups, dim=1)
    logits = torch.einsum("bhsd,bhsktd->bhskt", q.float(), kk) * scale  # (B, H, S, k, T)
    mask = valid[:, None, :, :, None]  # (B, 1, S, k, 1)
    neg = torch.finfo(torch.float32).min
    w = None
    if weights is not None:
        w = (weights if weights.ndim == 3 else weights[:, None, :]).float()  # (B, S', k)
    mix = weight_mode == "mix" and w is not None
    if not mix:
        if w is not None:
            # Padding weights are arbitrary (often 0): keep log() finite there so the
            # masked entries get a zero gradient rather than 0·inf = NaN.
            logits = logits + torch.log(torch.where(valid, w, 1.0))[:, None, :, :, None]
        logits = logits.masked_fill(~mask, neg).flatten(3)  # (B, H, S, k·T)
        p = torch.softmax(logits, dim=-1).unflatten(3, (k, t)) * mask  # no valid block → 0
        lse = torch.logsumexp(logits, dim=-1).masked_fill(~valid.any(-1)[:, None], math.inf)
    else:
        logits = logits.masked_fill(~mask, neg)
        p = torch.softmax(logits, dim=-1) * mask  # per block
        lse = torch.logsumexp(logits, dim=-1).masked_fill(~valid[:, None], math.inf)
    return _Gathered(valid=valid, safe=safe, w=w, mix=mix, kk=kk, vv=vv, p=p, lse=lse)


def _scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def memory_attention_naive(
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None = None,
    *,
    weight_mode: str = "bias",
    scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference: q (B, H, S, D), bank_k/bank_v (N, T, H_kv, D), block_idx (B, k) or (B, S, k).

    weights (same shape as block_idx) or None; weight_mode "bias" (one joint softmax
    over all referenced tokens, log-weight added to a block's logits) or "mix"
    (one softmax per block, block outputs summed with the weights). Entries of
    block_idx equal to -1 are padding. Returns (B, H, S, D) in q's dtype,
    computed in fp32.

    With return_lse, also the fp32 log-sum-exp of the logits that the kernel
    saves for its backward: (B, H, S) over all referenced tokens (log-weights
    included) for the joint softmax, (B, H, S, k) per entry for "mix"; +inf
    where there is nothing to normalise (a query without valid blocks, a
    padding entry).
    """
    g = _gather(q, bank_k, bank_v, block_idx, weights, weight_mode, _scale(q, scale))
    p = g.p * g.w[:, None, :, :, None] if g.mix else g.p
    out = torch.einsum("bhskt,bhsktd->bhsd", p, g.vv).to(q.dtype)
    return (out, g.lse) if return_lse else out


def memory_attention_naive_backward(
    grad_out: Tensor,
    q: Tensor,
    bank_k: Tensor,
    bank_v: Tensor,
    block_idx: Tensor,
    weights: Tensor | None = None,
    *,
    weight_mode: str = "bias",
    scale: float | None = None,
    grad_lse: Tensor | None = None,
    blocks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of `memory_attention_naive` for grad_out (B, H, S, D).

    Returns dq (B, H, S, D), dense d(bank_k), d(bank_v) (N, T, H_kv, D) and
    d(weights) like weights (None without weights), each in its input's dtype.
    bias: dS = P·(dP − rowsum(dO·O) + dLSE), d(weight) = Σ_t dS / weight.
    mix:  with O_c = softmax_c·V_c, d(weight) = dO·O_c and
          dS = weight·P_c·(dP − dO·O_c).

    grad_lse (B, H, S): the gradient reaching the joint softmax's log-sum-exp
    (bias mode only; d lse / d logit = P). blocks (U,) sorted unique block ids:
    return d(bank_k), d(bank_v) for those blocks only, (U, T, H_kv, D), so no
    bank-sized buffer is made (every referenced block must be among them).
    """
    h, d = q.shape[1], q.shape[3]
    n, t, h_kv, _ = bank_k.shape
    scale = _scale(q, scale)
    g = _gather(q, bank_k, bank_v, block_idx, weights, weight_mode, scale)
    do = grad_out.float()
    dp = torch.einsum("bhsd,bhsktd->bhskt", do, g.vv)  # (B, H, S, k, T)
    if g.mix and grad_lse is not None:
        raise ValueError("grad_lse: the per-block log-sum-exps of mix mode are not differentiable")
    if g.mix:
        w = g.w[:, None, :, :, None]  # (B, 1, S, k, 1)
        dc = torch.einsum("bhsd,bhskd->bhsk", do, torch.einsum("bhskt,bhsktd->bhskd", g.p, g.vv))
        ds = w * g.p * (dp - dc[..., None])
        p_eff = w * g.p
        dw_heads = dc  # (B, H, S, k)
    else:
        out = torch.einsum("bhskt,bhsktd->bhsd", g.p, g.vv)
        delta = (do * out).sum(-1)  # (B, H, S)
        if grad_lse is not None:
            delta = delta - grad_lse.float()
        ds = g.p * (dp - delta[..., None, None])
        p_eff = g.p
        dw_heads = None if g.w is None else ds.sum(-1) / torch.where(g.valid, g.w, 1.0)[:, None]
    dq = torch.einsum("bhskt,bhsktd->bhsd", ds, g.kk) * scale
    # per-sequence lists: sum over the queries here, not after a per-query copy
    spec = "bhsktd" if block_idx.ndim == 3 else "bhktd"
    dkk = torch.einsum(f"bhskt,bhsd->{spec}", ds, q.float()) * scale
    dvv = torch.einsum(f"bhskt,bhsd->{spec}", p_eff, do)
    if block_idx.ndim == 2:
        dkk, dvv = dkk[:, :, None], dvv[:, :, None]  # (B, H, 1, k, T, D)

    rows, ids = n, g.safe.flatten()
    if blocks is not None:
        # padding entries carry zero gradients; send them to any row
        rows = blocks.numel()
        ids = torch.searchsorted(blocks, ids).clamp(max=max(rows - 1, 0))

    def to_bank(x: Tensor, like: Tensor) -> Tensor:
        # (B, H, S', k, T, D) → sum the GQA group → (B·S'·k, T, H_kv, D) → add per block id.
        x = x.unflatten(1, (h_kv, h // h_kv)).sum(2).permute(0, 2, 3, 4, 1, 5).flatten(0, 2)
        if rows == 0:
            return x.new_zeros((0, t, h_kv, d), dtype=like.dtype)
        return (
            torch.zeros((rows, t, h_kv, d), dtype=torch.float32, device=q.device)
            .index_add_(0, ids, x)
            .to(like.dtype)
        )

    dw = None
    if dw_heads is not None:
        dw = dw_heads.sum(1).masked_fill(~g.valid, 0.0)  # (B, S, k)
        dw = (dw if block_idx.ndim == 3 else dw.sum(1)).to(weights.dtype)
    return dq.to(q.dtype), to_bank(dkk, bank_k), to_bank(dvv, bank_v), dw
