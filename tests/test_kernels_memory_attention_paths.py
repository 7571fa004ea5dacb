"""The SDPA (widened head) and FlexAttention paths of memory attention vs the reference.

Both compute `memory_attention` for per-sequence block lists; outputs and gradients (q, both
banks, weights) are checked against autograd through `memory_attention_naive` on odd and
ragged shapes: S not a tile multiple, T of 1 and 3, D not a multiple of 16, GQA, padding
entries and an all-padding sequence. On the CPU flex runs eagerly (torch's reference
FlexAttention); the compiled GPU kernels are the GPU machine's to check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from memtree.kernels.memory_attention import (
    flex_available,
    memory_attention_flex,
    memory_attention_naive,
    memory_attention_sdpa,
)
from memtree.kernels.memory_attention.flex import _as_sequence

needs_flex = pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention")

# max error relative to the reference's largest magnitude
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Case:
    s: int
    t: int
    d: int
    h: int
    h_kv: int
    k: int
    pad: bool  # padding entries, the last sequence all padding
    b: int = 3
    n: int = 12

    def __str__(self) -> str:
        return (
            f"S{self.s}-T{self.t}-D{self.d}-H{self.h}/{self.h_kv}-k{self.k}"
            f"{'-pad' if self.pad else ''}"
        )


CASES = [
    Case(s=1, t=1, d=8, h=4, h_kv=2, k=1, pad=True),
    Case(s=63, t=3, d=24, h=3, h_kv=3, k=5, pad=True),
    Case(s=100, t=16, d=64, h=4, h_kv=2, k=5, pad=True),
    Case(s=63, t=16, d=8, h=3, h_kv=3, k=1, pad=False),
    Case(s=100, t=3, d=24, h=4, h_kv=2, k=5, pad=False),
    Case(s=1, t=16, d=64, h=3, h_kv=3, k=5, pad=True),
]


def make(case: Case, dtype=torch.float32, seed: int = 0):
    """q (B, H, S, D), banks (N, T, H_kv, D), distinct block lists (B, k), weights (B, k) > 0
    (arbitrary, here 0, at padding), all requiring grad but the lists."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(case.b, case.h, case.s, case.d, generator=g)
    bank_k = torch.randn(case.n, case.t, case.h_kv, case.d, generator=g)
    bank_v = torch.randn(case.n, case.t, case.h_kv, case.d, generator=g)
    idx = torch.stack([torch.randperm(case.n, generator=g)[: case.k] for _ in range(case.b)])
    if case.pad:
        idx[1, 1::2] = -1  # ragged: every other entry of row 1 (all of it when k = 1)
        idx[-1] = -1
    weights = (torch.rand(case.b, case.k, generator=g) + 0.2).masked_fill(idx < 0, 0.0)
    q, bank_k, bank_v = (x.to(dtype).requires_grad_() for x in (q, bank_k, bank_v))
    return q, bank_k, bank_v, idx, weights.requires_grad_()


def assert_near(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    got, want = got.float(), want.float()
    assert got.shape == want.shape, what
    err = (got - want).abs().max().item() if want.numel() else 0.0
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1.0)  # zero grads: absolute
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} × {scale:.3g}"


def check_path(fn, case: Case, mode: str | None, dtype=torch.float32, lse: bool = False):
    """fn's output (and lse) and gradients against autograd through the reference."""
    q, bank_k, bank_v, idx, weights = make(case, dtype)
    w = None if mode is None else weights
    inputs = [q, bank_k, bank_v] + ([w] if w is not None else [])
    wm = mode or "bias"
    # the reference in fp32 from the same (rounded) inputs
    ref_in = [x.detach().float().requires_grad_() for x in inputs]
    ref_w = ref_in[3] if w is not None else None
    ref = memory_attention_naive(*ref_in[:3], idx, ref_w, weight_mode=wm, return_lse=lse)
    got = fn(q, bank_k, bank_v, idx, w, weight_mode=wm, **({"return_lse": True} if lse else {}))
    g = torch.Generator().manual_seed(1)
    if lse:
        (ref, ref_lse), (got, got_lse) = ref, got
        ref_lse = ref_lse.masked_fill(torch.isposinf(ref_lse), -math.inf)
        assert got_lse.dtype == torch.float32
        assert torch.equal(torch.isinf(got_lse), torch.isinf(ref_lse)), "lse: -inf rows"
        assert (got_lse[torch.isinf(got_lse)] < 0).all()
        finite = torch.isfinite(ref_lse)
        assert_near(got_lse[finite], ref_lse[finite], TOL[dtype], "lse")
    assert got.dtype == dtype and got.shape == q.shape
    assert_near(got, ref, TOL[dtype], "out")
    if case.pad:
        assert (got[-1] == 0).all(), "an all-padding sequence reads zeros"
    grad_out = torch.randn(got.shape, generator=g)
    loss_got, loss_ref = (got.float() * grad_out).sum(), (ref * grad_out).sum()
    if lse:
        # the lse is a result too: its gradient folds into the softmax's backward
        grad_lse = torch.randn(got_lse.shape, generator=g)
        loss_got = loss_got + torch.where(finite, got_lse, 0.0).mul(grad_lse).sum()
        loss_ref = loss_ref + torch.where(finite, ref_lse, 0.0).mul(grad_lse).sum()
    grads = torch.autograd.grad(loss_got, inputs)
    ref_grads = torch.autograd.grad(loss_ref, ref_in)
    for name, a, b in zip(("dq", "dK", "dV", "dw"), grads, ref_grads):
        assert torch.isfinite(a).all(), name
        assert a.dtype == (torch.float32 if name == "dw" else dtype), name
        assert_near(a, b, TOL[dtype], name)


@pytest.mark.parametrize("mode", [None, "bias", "mix"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_sdpa_matches_reference(case, mode):
    check_path(memory_attention_sdpa, case, mode)


@needs_flex
@pytest.mark.parametrize("mode", [None, "bias"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_flex_matches_reference(case, mode):
    check_path(memory_attention_flex, case, mode, lse=True)


@pytest.mark.parametrize(
    "fn,mode",
    [
        (memory_attention_sdpa, "bias"),
        (memory_attention_sdpa, "mix"),
        pytest.param(memory_attention_flex, "bias", marks=needs_flex),
    ],
    ids=["sdpa-bias", "sdpa-mix", "flex-bias"],
)
def test_bf16_inputs(fn, mode):
    check_path(fn, CASES[2], mode, dtype=torch.bfloat16)


def test_bf16_widened_head_keeps_the_log_weights_exact():
    """With q = 0 every logit is a log-weight, and with block n's values the unit vector e_n
    the read's n-th coordinate is exactly the weight of n's entry: the widened head's column
    must carry log(w)/scale to better than bf16's 2^-8 (one bf16 column moves a weight by up
    to ~3 % at D = 64, 8x this tolerance)."""
    g = torch.Generator().manual_seed(3)
    b, h, s, d, n, t, k = 4, 2, 3, 64, 16, 4, 6
    q = torch.zeros(b, h, s, d, dtype=torch.bfloat16)
    bank_k = torch.randn(n, t, h, d, generator=g).bfloat16()
    bank_v = torch.eye(n, d)[:, None, None, :].expand(n, t, h, d).bfloat16()
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b)])
    w = torch.softmax(4 * torch.randn(b, k, generator=g), -1)  # log w down to ~ -15
    got = memory_attention_sdpa(q, bank_k, bank_v, idx, w).float()  # (B, H, S, D)
    read = got.gather(3, idx[:, None, None, :].expand(b, h, s, k))  # (B, H, S, k)
    # the bf16 output's rounding (2^-8 relative) and SDPA's bf16 probabilities; one bf16
    # column measured 1.7e-2 here
    torch.testing.assert_close(read, w[:, None, None, :].expand_as(read), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("all_padding", [False, True])
def test_sdpa_sparse_grad_is_row_sparse_over_referenced_blocks(all_padding):
    case = CASES[1]
    q, bank_k, bank_v, idx, weights = make(case)
    if all_padding:
        idx = torch.full_like(idx, -1)
    out = memory_attention_sdpa(q, bank_k, bank_v, idx, weights, sparse_grad=True)
    ref_k, ref_v = (x.detach().clone().requires_grad_() for x in (bank_k, bank_v))
    ref = memory_attention_naive(q.detach(), ref_k, ref_v, idx, weights.detach())
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    want_rows = torch.unique(idx[idx >= 0])
    for bank, want in ((bank_k, ref_k.grad), (bank_v, ref_v.grad)):
        g = bank.grad
        assert g.layout == torch.sparse_coo and g.shape == bank.shape
        # one row per referenced block, nothing bank-sized
        assert g.sparse_dim() == 1 and g._nnz() == want_rows.numel()
        assert g.coalesce().values().shape == (want_rows.numel(), *bank.shape[1:])
        assert torch.equal(g.coalesce().indices()[0], want_rows)
        assert_near(g.to_dense(), want, TOL[torch.float32], "sparse bank grad")
    assert_near(out, ref, TOL[torch.float32], "out")


def test_sdpa_dense_grad_by_default():
    q, bank_k, bank_v, idx, weights = make(CASES[1])
    memory_attention_sdpa(q, bank_k, bank_v, idx, weights).sum().backward()
    assert bank_k.grad.layout == torch.strided and bank_k.grad.shape == bank_k.shape


@needs_flex
def test_flex_reads_the_bank_in_place():
    bank = torch.randn(12, 16, 2, 24)
    seq = _as_sequence(bank)  # (1, H_kv, N·T, D)
    assert seq.shape == (1, 2, 12 * 16, 24)
    assert seq._base is bank and seq.data_ptr() == bank.data_ptr()
    assert torch.equal(seq[0, 1, 5 * 16 + 3], bank[5, 3, 1])


def _compile_case():
    q, bank_k, bank_v, idx, weights = make(
        Case(s=5, t=3, d=8, h=4, h_kv=2, k=2, pad=True, b=2, n=6)
    )
    return q, bank_k, bank_v, idx, weights


def _check_compiled(backend: str) -> None:
    torch._dynamo.reset()
    q, bank_k, bank_v, idx, weights = _compile_case()
    fn = torch.compile(memory_attention_sdpa, fullgraph=False, backend=backend)
    out = fn(q, bank_k, bank_v, idx, weights)
    inputs = (q, bank_k, bank_v, weights)
    grads = torch.autograd.grad(out.sum(), inputs)
    ref = memory_attention_sdpa(q, bank_k, bank_v, idx, weights)
    ref_grads = torch.autograd.grad(ref.sum(), inputs)
    assert_near(out, ref, TOL[torch.float32], "compiled out")
    for a, b in zip(grads, ref_grads):
        assert_near(a, b, TOL[torch.float32], "compiled grad")


def test_sdpa_traces_under_torch_compile():
    """Dynamo and AOT autograd trace forward and backward (no inductor codegen: fast)."""
    _check_compiled("aot_eager")


@pytest.mark.slow
def test_sdpa_compiles_with_inductor():
    _check_compiled("inductor")


def test_errors():
    q, bank_k, bank_v, idx, weights = make(CASES[1])
    per_token = idx[:, None, :].expand(-1, q.shape[2], -1)
    with pytest.raises(ValueError, match="per-sequence block lists"):
        memory_attention_sdpa(q, bank_k, bank_v, per_token)
    with pytest.raises(ValueError, match="return_lse is not supported"):
        memory_attention_sdpa(q, bank_k, bank_v, idx, return_lse=True)
    with pytest.raises(ValueError, match="weight_mode must be"):
        memory_attention_sdpa(q, bank_k, bank_v, idx, weights, weight_mode="sum")
    with pytest.raises(ValueError, match="weights shape"):
        memory_attention_sdpa(q, bank_k, bank_v, idx, weights[:, :2])
    with pytest.raises(ValueError, match="multiple of memory KV heads"):
        memory_attention_sdpa(q[:, :2], bank_k, bank_v, idx)  # H=2, H_kv=3


@needs_flex
def test_flex_errors():
    q, bank_k, bank_v, idx, weights = make(CASES[1])
    per_token = idx[:, None, :].expand(-1, q.shape[2], -1)
    with pytest.raises(ValueError, match="per-sequence block lists"):
        memory_attention_flex(q, bank_k, bank_v, per_token)
    with pytest.raises(ValueError, match="'mix'.*not one joint softmax"):
        memory_attention_flex(q, bank_k, bank_v, idx, weights, weight_mode="mix")
    with pytest.raises(ValueError, match="in q's dtype"):
        memory_attention_flex(q, bank_k.double(), bank_v.double(), idx)


# ------------------------------------------------------------------------- on a GPU (-m gpu)
def _cuda_inputs(b, h, h_kv, s, d, n, t, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g)
    bank_k, bank_v = (
        torch.randn(n, t, h_kv, d, generator=g),
        torch.randn(n, t, h_kv, d, generator=g),
    )
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b)])
    w = torch.softmax(torch.randn(b, k, generator=g), -1)
    return [x.to("cuda", dtype) for x in (q, bank_k, bank_v)] + [idx.cuda(), w.cuda()]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["sdpa", "flex"])
def test_gpu_paths_match_reference(path, dtype):
    """On CUDA: SDPA's flash / cuDNN / efficient backends on the widened head, and FlexAttention's
    compiled kernel (T = 128, which every tile configuration divides), against the fp32 reference,
    outputs and gradients, GQA and router weights ("bias")."""
    if path == "flex" and not flex_available():
        pytest.skip("this torch has no FlexAttention")
    q, bank_k, bank_v, idx, w = _cuda_inputs(
        3, 8, 2, 200, 64, 24, 128 if path == "flex" else 48, 5, dtype
    )
    leaves = [x.detach().requires_grad_() for x in (q, bank_k, bank_v, w)]
    ref_leaves = [x.detach().float().requires_grad_() for x in (q, bank_k, bank_v, w)]
    fn = memory_attention_sdpa if path == "sdpa" else memory_attention_flex
    got = fn(*leaves[:3], idx, leaves[3])
    ref = memory_attention_naive(*ref_leaves[:3], idx, ref_leaves[3])
    dy = torch.randn_like(ref)
    (got.float() * dy).sum().backward()
    (ref * dy).sum().backward()
    tol = 1e-3 if dtype == torch.float32 else 3e-2  # TF32 / bf16 matmuls in the fused kernels
    assert_near(got.float(), ref, tol, "out")
    for name, a, r in zip(
        ("dq", "dbank_k", "dbank_v", "dweights"), leaves, ref_leaves, strict=True
    ):
        assert_near(a.grad.float(), r.grad, tol, name)
