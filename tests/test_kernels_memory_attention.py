"""Memory attention by block index: Triton kernel vs the gathered pure-torch reference.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (set here before
the kernel module is first imported), on tiny but odd shapes; `gpu`-marked
tests run the compiled kernels on CUDA. Reference gradients come from autograd
through `memory_attention_naive`.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from memtree.kernels.memory_attention import (
    memory_attention,
    memory_attention_naive,
    memory_attention_table,
    op,
)
from memtree.kernels.memory_attention.table import dkv_chunks

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="CPU Triton tests need TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _auto_layout_is_tiles(monkeypatch):
    """This module tests the slot tiles: per-token calls left at per_token_layout="auto" must
    run them, though these small random lists would resolve to the block-major items
    (test_kernels_memory_attention_blocks.py tests those and the auto rule)."""
    monkeypatch.setattr(op, "AUTO_BLOCKS_SLOTS_PER_K", math.inf)


# Max error relative to the reference's largest magnitude. Under the interpreter
# tiles are fp32 after loading, so fp16/bf16 differ from the reference only by
# rounding of inputs/outputs; on a GPU P and dS are rounded to fp16/bf16 for the dots.
TOL_CPU = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
TOL_GPU = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class Case:
    b: int
    h: int
    h_kv: int
    s: int
    d: int
    n: int
    t: int
    k: int
    per_token: bool
    mode: str | None  # None: no weights
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        kind = "tok" if self.per_token else "seq"
        dt = str(self.dtype).removeprefix("torch.")
        return (
            f"{kind}-{self.mode}-{dt}-B{self.b}H{self.h}/{self.h_kv}S{self.s}D{self.d}"
            f"N{self.n}T{self.t}k{self.k}"
        )


CPU_CASES = [
    Case(3, 4, 2, 63, 32, 9, 20, 4, False, "bias"),
    Case(2, 6, 2, 1, 80, 5, 12, 3, False, "mix"),
    Case(2, 2, 2, 100, 64, 6, 7, 2, False, None),
    Case(2, 4, 1, 63, 32, 7, 20, 3, False, "mix", torch.float16),
    Case(2, 2, 1, 20, 64, 5, 12, 3, False, "bias", torch.bfloat16),
    Case(1, 6, 2, 63, 32, 9, 20, 3, True, "bias"),
    Case(1, 4, 4, 100, 64, 7, 12, 2, True, "mix"),
    Case(2, 2, 1, 1, 80, 4, 20, 3, True, None),
    Case(2, 4, 2, 37, 32, 6, 9, 3, True, "mix", torch.bfloat16),
    Case(1, 2, 2, 63, 64, 6, 20, 4, True, "bias", torch.float16),
    # T a multiple of the interpreter's BLOCK_N (16): the unmasked EVEN_T loads
    Case(2, 4, 2, 63, 32, 7, 32, 3, False, "bias"),
    Case(1, 4, 2, 37, 32, 6, 16, 3, True, "mix"),
]

GPU_CASES = [
    Case(2, 12, 12, 256, 64, 40, 64, 9, False, "mix", torch.bfloat16),
    Case(2, 12, 4, 255, 64, 40, 64, 9, False, "bias", torch.bfloat16),
    Case(2, 8, 2, 100, 80, 30, 37, 5, False, None, torch.float16),
    Case(2, 12, 12, 256, 64, 40, 64, 9, True, "mix", torch.bfloat16),
    Case(2, 8, 4, 63, 32, 30, 37, 6, True, "bias", torch.float16),
    Case(1, 4, 2, 100, 64, 12, 20, 4, True, "mix", torch.float32),
    Case(3, 4, 2, 1, 128, 12, 64, 4, False, "bias", torch.float32),
]


def make_inputs(case: Case, device: str = "cpu", seed: int = 0):
    """Non-contiguous q, bank_k, bank_v; block_idx, weights with ragged padding, a repeated
    block and queries whose every entry is padding."""
    g = torch.Generator().manual_seed(seed)
    c = case
    # Strided like real callers: q from (B, S, H, D) projections, K/V halves of one tensor.
    q = torch.randn(c.b, c.s, c.h, c.d, generator=g).transpose(1, 2)
    bank_k, bank_v = torch.randn(c.n, c.t, 2, c.h_kv, c.d, generator=g).unbind(2)
    shape = (c.b, c.s, c.k) if c.per_token else (c.b, c.k)
    idx = torch.randint(0, c.n, shape, generator=g)
    idx = idx.masked_fill(torch.rand(shape, generator=g) < 0.3, -1)  # ragged k
    idx[0, ..., 0] = 1
    if c.k > 1:
        idx[0, ..., 1] = 1  # the same block twice in one list
    if c.per_token:
        idx[-1, 1::3] = -1  # tokens without memory
    elif c.b > 2:
        idx[-1] = -1  # a sequence without memory
    weights = None
    if c.mode is not None:
        weights = torch.rand(shape, generator=g) * 0.9 + 0.1
    return (
        q.to(device, c.dtype),
        bank_k.to(device, c.dtype),
        bank_v.to(device, c.dtype),
        idx.to(device),
        None if weights is None else weights.to(device),
    )


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def grads_of(fn, inputs, grad_out):
    leaves = [
        x.detach().requires_grad_() if x is not None and x.is_floating_point() else x
        for x in inputs
    ]
    out = fn(*leaves)
    diff = [x for x in leaves if x is not None and x.requires_grad]
    grads = torch.autograd.grad(out, diff, grad_out)
    return out, [g.to_dense() if g.layout != torch.strided else g for g in grads]


def check_case(case: Case, device: str, tol: dict, **kw) -> None:
    """Outputs and gradients of the Triton path (kw: more memory_attention keywords) against
    autograd through the gathered reference, in the inputs' dtypes."""
    q, bk, bv, idx, w = make_inputs(case, device)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    mode = case.mode or "bias"

    def kernel(q, bk, bv, idx, w):
        return memory_attention(q, bk, bv, idx, w, weight_mode=mode, impl="triton", **kw)

    def ref(q, bk, bv, idx, w):
        return memory_attention_naive(q, bk, bv, idx, w, weight_mode=mode)

    inputs = (q, bk, bv, idx, w)
    out, grads = grads_of(kernel, inputs, grad_out)
    out_ref, grads_ref = grads_of(ref, inputs, grad_out)
    assert out.dtype == q.dtype and out.shape == q.shape
    names = ["dq", "dbank_k", "dbank_v", "dweights"]
    errors = {"out": rel_err(out, out_ref)}
    errors.update({n: rel_err(g, r) for n, g, r in zip(names, grads, grads_ref)})
    assert max(errors.values()) < tol[case.dtype], errors
    assert len(grads) == (4 if w is not None else 3)
    for g, x in zip(grads, [q, bk, bv, w]):
        assert g.dtype == x.dtype and g.shape == x.shape


@interp
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_kernel_matches_reference(case):
    check_case(case, "cpu", TOL_CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_kernel_matches_reference(case):
    check_case(case, "cuda", TOL_GPU)


@pytest.mark.gpu
def test_gpu_auto_dispatch_runs_triton():
    q, bk, bv, idx, w = make_inputs(GPU_CASES[0], "cuda")
    auto = memory_attention(q, bk, bv, idx, w, weight_mode="mix")
    triton = memory_attention(q, bk, bv, idx, w, weight_mode="mix", impl="triton")
    assert torch.equal(auto, triton)


@interp
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("mode", ["bias", "mix"])
def test_kernel_lse_matches_reference(per_token, mode):
    """The saved statistics: joint log-sum-exp per query, or per entry in mix mode
    (repeated entries share their block's value), +inf where nothing is normalised."""
    case = Case(3, 4, 2, 21, 32, 6, 20, 3, per_token, mode)
    q, bk, bv, idx, w = make_inputs(case)
    _, lse, _, _ = op.memory_attention_fwd(
        q, bk, bv, idx, w, None, None, mode, 0.3, "triton", True, "tiles"
    )
    _, lse_ref = memory_attention_naive(
        q, bk, bv, idx, w, weight_mode=mode, scale=0.3, return_lse=True
    )
    assert lse.shape == lse_ref.shape
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    finite = torch.isfinite(lse_ref)
    assert finite.any() and (~finite).any()
    torch.testing.assert_close(lse[finite], lse_ref[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=interp)])
@pytest.mark.parametrize("per_token", [False, True])
def test_sparse_grad_covers_only_referenced_blocks(impl, per_token):
    case = Case(2, 2, 1, 9, 16, 12, 10, 3, per_token, "mix")
    q, bk, bv, idx, w = make_inputs(case)
    grad_out = torch.randn(q.shape)
    results = {}
    for sparse in (True, False):
        k, v = bk.clone().requires_grad_(), bv.clone().requires_grad_()
        out = memory_attention(q, k, v, idx, w, weight_mode="mix", sparse_grad=sparse, impl=impl)
        out.backward(grad_out)
        results[sparse] = (k.grad, v.grad)
    referenced = torch.unique(idx[idx >= 0])
    for sparse_g, dense_g in zip(results[True], results[False]):
        assert sparse_g.is_sparse and dense_g.layout == torch.strided
        assert torch.equal(sparse_g._indices()[0], referenced)
        assert sparse_g._nnz() == referenced.numel() < case.n
        torch.testing.assert_close(sparse_g.to_dense(), dense_g)
        unreferenced = torch.ones(case.n, dtype=torch.bool)
        unreferenced[referenced] = False
        assert not dense_g[unreferenced].any() and dense_g[referenced].abs().sum() > 0


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("mode", ["bias", "mix", None])
def test_cpu_dispatch_gradients_match_autograd(per_token, mode):
    """On CPU "auto" runs the reference with its explicit backward (no autograd inside
    the op): it must equal autograd through the reference, weight gradients included."""
    case = Case(3, 4, 2, 7, 16, 6, 5, 4, per_token, mode)
    inputs = make_inputs(case)
    grad_out = torch.randn(inputs[0].shape)
    wm = mode or "bias"
    out, grads = grads_of(lambda *a: memory_attention(*a, weight_mode=wm), inputs, grad_out)
    out_ref, grads_ref = grads_of(
        lambda *a: memory_attention_naive(*a, weight_mode=wm), inputs, grad_out
    )
    torch.testing.assert_close(out, out_ref)
    for g, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=interp)])
@pytest.mark.parametrize("per_token,mode", [(False, "bias"), (True, None), (False, None)])
def test_lse_is_differentiable(impl, per_token, mode):
    """return_lse: the joint log-sum-exp and its gradient (folded into delta) against
    autograd through the gathered reference; -inf for queries that read nothing."""
    check_lse_gradient(Case(3, 4, 2, 11, 16, 6, 5, 3, per_token, mode), impl)


def check_lse_gradient(case: Case, impl: str, **kw) -> None:
    """The lse and every gradient of a loss on out and lse (kw: more memory_attention
    keywords) against autograd through the reference."""
    q, bk, bv, idx, w = make_inputs(case)
    g = torch.Generator().manual_seed(3)
    r_out, r_lse = torch.randn(q.shape, generator=g), torch.randn(q.shape[:3], generator=g)

    def loss(fn):
        def run(q, bk, bv, idx, w):
            out, lse = fn(q, bk, bv, idx, w)
            finite = torch.isfinite(lse)
            return (out * r_out).sum() + torch.where(finite, lse, 0.0).mul(r_lse).sum(), lse

        return run

    def ref(q, bk, bv, idx, w):
        out, lse = memory_attention_naive(q, bk, bv, idx, w, return_lse=True)
        return out, lse.masked_fill(torch.isposinf(lse), -math.inf)

    def kern(q, bk, bv, idx, w):
        return memory_attention(q, bk, bv, idx, w, impl=impl, return_lse=True, **kw)

    inputs = (q, bk, bv, idx, w)
    results = []
    for fn in (kern, ref):
        leaves = [
            x.detach().requires_grad_() if x is not None and x.is_floating_point() else x
            for x in inputs
        ]
        total, lse = loss(fn)(*leaves)
        diff = [x for x in leaves if x is not None and x.requires_grad]
        grads = torch.autograd.grad(total, diff)
        results.append((lse.detach(), [gr.to_dense() for gr in grads]))
    (lse, grads), (lse_ref, grads_ref) = results
    empty = torch.isneginf(lse_ref)
    assert empty.any() and torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse[~empty], lse_ref[~empty], rtol=1e-5, atol=1e-5)
    for gr, ref_g in zip(grads, grads_ref, strict=True):
        assert rel_err(gr, ref_g) < 1e-4


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=interp)])
def test_reads_of_two_banks_merge_into_one_softmax(impl):
    """A hierarchical path reads one block per level from banks whose blocks differ in size;
    merging the per-bank reads by their lse is SDPA over all the tokens, gradients included."""
    g = torch.Generator().manual_seed(5)
    b, h, h_kv, s, d = 3, 4, 2, 9, 16
    q = torch.randn(b, h, s, d, generator=g)
    banks = [
        (torch.randn(5, t, h_kv, d, generator=g), torch.randn(5, t, h_kv, d, generator=g))
        for t in (3, 7)
    ]
    rows = [torch.tensor([0, 4, 4]), torch.tensor([2, 1, 3])]
    grad_out = torch.randn(q.shape, generator=g)

    def merged(q, k1, v1, k2, v2):
        outs, lses = zip(
            *(
                memory_attention(q, k, v, r[:, None], impl=impl, return_lse=True)
                for (k, v), r in zip(((k1, v1), (k2, v2)), rows)
            )
        )
        w = torch.softmax(torch.stack(lses), dim=0)[..., None]  # (2, B, H, S, 1)
        return (w * torch.stack(outs)).sum(0)

    def sdpa(q, k1, v1, k2, v2):
        gk = torch.cat([k1[rows[0]], k2[rows[1]]], 1).transpose(1, 2).repeat_interleave(2, 1)
        gv = torch.cat([v1[rows[0]], v2[rows[1]]], 1).transpose(1, 2).repeat_interleave(2, 1)
        return F.scaled_dot_product_attention(q, gk, gv)

    inputs = (q, *banks[0], *banks[1])
    out, grads = grads_of(merged, inputs, grad_out)
    out_ref, grads_ref = grads_of(sdpa, inputs, grad_out)
    assert rel_err(out, out_ref) < 1e-5
    for gr, ref_g in zip(grads, grads_ref, strict=True):
        assert rel_err(gr, ref_g) < 1e-4


def test_return_lse_refuses_mix_mode():
    q, bk, bv, idx, w = make_inputs(Case(2, 2, 1, 3, 16, 4, 5, 2, False, "mix"))
    with pytest.raises(ValueError, match="return_lse"):
        memory_attention(q, bk, bv, idx, w, weight_mode="mix", return_lse=True)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=interp)])
def test_sparse_grad_modes(impl):
    """None: sparse for leaf banks, dense for computed ones; True: sparse even through a
    computed bank, for callers whose upstream accepts it (the trainer's row views)."""
    case = Case(2, 2, 1, 5, 16, 8, 4, 2, False, None)
    q, bk, bv, idx, _ = make_inputs(case)
    layouts = {}
    for sparse in (None, True):
        for leaf in (True, False):
            k0 = bk.clone().requires_grad_()
            v0 = bv.clone().requires_grad_()
            k, v = (k0, v0) if leaf else (k0 * 1, v0 * 1)
            out = memory_attention(q, k, v, idx, sparse_grad=sparse, impl=impl)
            if leaf:
                out.sum().backward()
                layouts[sparse, leaf] = k0.grad.layout
            else:
                (gk,) = torch.autograd.grad(out.sum(), k)
                layouts[sparse, leaf] = gk.layout
    assert layouts == {
        (None, True): torch.sparse_coo,
        (None, False): torch.strided,
        (True, True): torch.sparse_coo,
        (True, False): torch.sparse_coo,
    }


def test_bias_mode_is_mix_with_partition_weights():
    """The documented relation: bias(w) = mix(w_c Z_c / Σ_c w_c Z_c), Z_c = Σ_t exp(s_t)."""
    case = Case(2, 2, 2, 5, 16, 6, 8, 3, True, "bias")
    q, bk, bv, idx, w = make_inputs(case)
    _, log_z = memory_attention_naive(q, bk, bv, idx, w, weight_mode="mix", return_lse=True)
    valid = (idx >= 0)[:, None]  # (B, 1, S, k)
    wz = torch.where(valid, w[:, None] * torch.exp(torch.where(valid, log_z, 0.0)), 0.0)
    mix_w = wz / wz.sum(-1, keepdim=True).clamp_min(1e-30)  # (B, H, S, k)
    bias = memory_attention_naive(q, bk, bv, idx, w, weight_mode="bias")
    per_head = torch.stack(
        [  # mix weights depend on the head: one call per head
            memory_attention_naive(
                q[:, i : i + 1],
                bk[:, :, i : i + 1],
                bv[:, :, i : i + 1],
                idx,
                mix_w[:, i],
                weight_mode="mix",
            )[:, 0]
            for i in range(case.h)
        ],
        1,
    )
    torch.testing.assert_close(bias, per_head, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=interp)])
def test_unweighted_read_is_sdpa_on_gathered_blocks(impl):
    """Seed 000 Algorithm 1: attention over the concatenated selected chapters."""
    case = Case(2, 4, 2, 13, 32, 7, 12, 3, False, None)
    q, bk, bv, _, _ = make_inputs(case)
    idx = torch.tensor([[4, 0, 6], [2, 2, 5]])
    out = memory_attention(q, bk, bv, idx, impl=impl)
    gk = bk[idx].flatten(1, 2).transpose(1, 2).repeat_interleave(2, dim=1)  # (B, H, k·T, D)
    gv = bv[idx].flatten(1, 2).transpose(1, 2).repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, gk, gv), rtol=1e-4, atol=1e-5)


def test_all_padding_reads_zeros():
    case = Case(2, 2, 1, 4, 16, 3, 5, 2, False, "bias")
    q, bk, bv, _, w = make_inputs(case)
    idx = torch.tensor([[0, 2], [-1, -1]])
    out = memory_attention(q, bk, bv, idx, w)
    assert not out[1].any() and out[0].abs().sum() > 0


def test_non_leaf_bank_gets_dense_gradient():
    """MoC projects its unique chapters every step: the bank is computed, not a leaf."""
    case = Case(2, 2, 1, 6, 16, 5, 4, 2, False, "mix")
    q, _, _, idx, w = make_inputs(case)
    chapters = torch.randn(case.n, case.t, 24)
    proj = torch.nn.Linear(24, 2 * case.d)
    grads = []
    for fn in (memory_attention, memory_attention_naive):
        proj.zero_grad()
        kv = proj(chapters).unflatten(-1, (2, case.h_kv, case.d))  # (N, T, 2, H_kv, D)
        fn(q, kv[:, :, 0], kv[:, :, 1], idx, w, weight_mode="mix").sum().backward()
        grads.append(proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=interp)])
@pytest.mark.parametrize("sparse_grad", [True, False])
@pytest.mark.parametrize("per_token,mode", [(False, "mix"), (True, "bias")])
def test_opcheck(impl, sparse_grad, per_token, mode):
    case = Case(2, 2, 1, 3, 16, 4, 5, 2, per_token, mode)
    q, bk, bv, idx, w = make_inputs(case)
    args = (
        q.requires_grad_(),
        bk.requires_grad_(),
        bv.requires_grad_(),
        idx,
        w.requires_grad_(),
        None,
        None,
        mode,
        0.25,
        impl,
        sparse_grad,
        "tiles",
    )
    torch.library.opcheck(op.memory_attention_fwd, args)
    with torch.no_grad():
        out, lse, table_ints, table_coef = op.memory_attention_fwd(*args)
    grad_lse = None if mode == "mix" else torch.randn_like(lse)
    bwd_args = (
        torch.randn_like(out),
        q.detach(),
        bk.detach(),
        bv.detach(),
        idx,
        w.detach(),
        out,
        lse,
        table_ints,
        table_coef,
        grad_lse,
        mode,
        0.25,
        impl,
        True,
        True,
        sparse_grad,
        "tiles",
    )
    torch.library.opcheck(op.memory_attention_bwd, bwd_args)


@pytest.mark.parametrize("impl", ["auto", pytest.param("triton", marks=interp)])
def test_compile_fullgraph_matches_eager(impl):
    """torch.compile traces the op without graph breaks (CPU "auto": the reference; "triton":
    the kernels, whose fake implementation must give the table buffers' static sizes). The
    op is opaque to dynamo: host syncs inside it are test_triton_path_has_no_host_sync's."""
    case = Case(2, 4, 2, 6, 16, 5, 4, 3, True, "mix")
    q, bk, bv, idx, w = make_inputs(case)

    def fn(q, bk, bv, idx, w):
        out = memory_attention(
            q * 2, bk, bv, idx, w.softmax(-1), weight_mode="mix", sparse_grad=False, impl=impl
        )
        return out.square().sum()

    grad_out = torch.tensor(1.0)
    eager, g_eager = grads_of(fn, (q, bk, bv, idx, w), grad_out)
    compiled, g_comp = grads_of(torch.compile(fn, fullgraph=True), (q, bk, bv, idx, w), grad_out)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(g_comp, g_eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# Ops that make the host wait for the device: a read of a device value (.item(), int(),
# bool(), .tolist()) or an output whose size depends on the data.
SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::is_nonzero",
    "aten::equal",
    "aten::allclose",
    "aten::nonzero",
    "aten::argwhere",
    "aten::masked_select",
    "aten::masked_scatter",
    "aten::unique_dim",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
    "aten::bincount",
    "aten::histc",
}
INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _is_host_sync(name: str, args, kwargs) -> bool:
    if name in SYNC_OPS:
        return True
    if name == "aten::repeat_interleave":  # its output size is data-dependent unless given
        return kwargs.get("output_size") is None
    if name in INDEX_OPS:  # boolean-mask indexing: data-dependent size
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if name == "aten::_to_copy":  # device → host copy
        dev = kwargs.get("device")
        return dev is not None and torch.device(dev).type == "cpu" and args[0].device.type != "cpu"
    if name == "aten::copy_":
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


class HostSyncs(TorchDispatchMode):
    """Records the host-synchronising ops of what runs under it. The memtree custom ops are
    opaque to a dispatch mode (it sees the op, not its body), so their bodies run under the
    mode instead (op.IMPLS_BY_OP); Tensor.tolist/numpy, which dispatch nothing on the CPU,
    are patched to count as syncs."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.syncs: list[str] = []
        for meth in ("tolist", "numpy"):
            orig = getattr(torch.Tensor, meth)

            def spy(t, *a, _meth=meth, _orig=orig, **kw):
                self.syncs.append(f"Tensor.{_meth}")
                return _orig(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, meth, spy)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        body = op.IMPLS_BY_OP.get(name)
        if body is not None:
            with self:
                return body(*args, **kwargs)
        if _is_host_sync(name, args, kwargs):
            self.syncs.append(str(func))
        return func(*args, **kwargs)


@interp
@pytest.mark.parametrize(
    "case,sparse_grad,lse",
    [
        (Case(2, 4, 2, 63, 16, 7, 5, 3, False, "mix"), False, False),
        (Case(1, 2, 1, 100, 16, 6, 20, 2, True, "bias"), False, True),
        (Case(3, 2, 2, 1, 16, 5, 5, 3, False, None), False, True),
        (Case(2, 2, 1, 9, 16, 12, 10, 3, True, "mix"), True, False),
    ],
    ids=["seq-mix-S63", "tok-bias-lse-S100", "seq-none-lse-S1", "tok-mix-sparse"],
)
def test_triton_path_has_no_host_sync(monkeypatch, case, sparse_grad, lse):
    """Forward and backward of the Triton path (table built once in forward, on the device)
    synchronise nowhere with dense bank gradients; the sparse layout reads its row count U
    once (which also shows the recorder sees inside the ops). Results as the reference."""
    check_host_syncs(monkeypatch, case, sparse_grad, lse)


def check_host_syncs(monkeypatch, case: Case, sparse_grad: bool, lse: bool, **kw) -> None:
    """Records the host syncs of one Triton forward + backward (kw: more memory_attention
    keywords) under HostSyncs: none with dense bank gradients, one (the sparse gradient's
    row count) with sparse ones; output and gradients as the reference's."""
    q, bk, bv, idx, w = make_inputs(case)
    mode = case.mode or "bias"
    g = torch.Generator().manual_seed(2)
    r_out, r_lse = torch.randn(q.shape, generator=g), torch.randn(q.shape[:3], generator=g)

    def loss_and_grads(impl, record):
        leaves = [x.detach().requires_grad_() if x is not None else None for x in (q, bk, bv, w)]
        with record:
            res = memory_attention(
                leaves[0],
                leaves[1],
                leaves[2],
                idx,
                leaves[3],
                weight_mode=mode,
                impl=impl,
                sparse_grad=sparse_grad,
                return_lse=lse,
                **kw,
            )
            out, lse_v = res if lse else (res, None)
            loss = (out * r_out).sum()
            if lse:
                loss = loss + torch.where(torch.isfinite(lse_v), lse_v, 0.0).mul(r_lse).sum()
            loss.backward()
        return out.detach(), [x.grad.to_dense() for x in leaves if x is not None]

    rec = HostSyncs(monkeypatch)
    out, grads = loss_and_grads("triton", rec)
    assert len(rec.syncs) == (1 if sparse_grad else 0), rec.syncs
    monkeypatch.undo()
    out_ref, grads_ref = loss_and_grads("reference", contextlib.nullcontext())
    assert rel_err(out, out_ref) < 1e-4
    for gr, ref_g in zip(grads, grads_ref, strict=True):
        assert rel_err(gr, ref_g) < 1e-4


@interp
@pytest.mark.parametrize(
    "per_token,dtype", [(False, torch.float16), (True, torch.bfloat16), (False, torch.float32)]
)
def test_shared_block_gradient_is_split_across_programs(per_token, dtype):
    """A block every sequence reads (MoC's shared chapter) is cut into several dK/dV chunks
    whose partial sums meet in fp32 (atomics); dense bank gradients of every dtype (fp16/bf16
    through the fp32 buffer and the scatter into the bank's shape, fp32 straight into it)."""
    from memtree.kernels.memory_attention import kernel as K

    case = Case(4, 4, 2, 21, 16, 9, 12, 3, per_token, "bias", dtype)
    q, bk, bv, idx, w = make_inputs(case)
    idx[..., -1] = 0  # the shared chapter, in every list
    launch, table = K.plan(q, bk, bv, idx, w)
    _, _, n_chunk, _ = dkv_chunks(table, launch.dkv_chunk, case.n)
    n_u = int((table.ublocks < case.n).sum())
    assert int(n_chunk) > n_u + 2  # the shared block alone spans several chunks
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)

    def kern(q, bk, bv, idx, w):
        return memory_attention(q, bk, bv, idx, w, impl="triton", sparse_grad=False)

    out, grads = grads_of(kern, (q, bk, bv, idx, w), grad_out)
    out_ref, grads_ref = grads_of(memory_attention_naive, (q, bk, bv, idx, w), grad_out)
    assert rel_err(out, out_ref) < TOL_CPU[dtype]
    for gr, ref_g, x in zip(grads, grads_ref, (q, bk, bv, w), strict=True):
        assert gr.layout == torch.strided and gr.dtype == x.dtype
        assert rel_err(gr, ref_g) < TOL_CPU[dtype]


def test_deterministic_mode_keeps_each_block_in_one_chunk():
    """Chunks meet in atomic adds, whose order varies on a GPU; under
    torch.use_deterministic_algorithms every block is one chunk (one writer per element), and
    the gradients still match the reference."""
    from memtree.kernels.memory_attention import kernel as K

    case = Case(4, 4, 2, 21, 16, 9, 12, 3, False, "bias", torch.float32)
    q, bk, bv, idx, w = make_inputs(case)
    idx[..., -1] = 0  # the shared chapter: several chunks unless deterministic
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        launch, table = K.plan(q, bk, bv, idx, w)
        _, _, n_chunk, _ = dkv_chunks(table, launch.dkv_chunk, case.n)
        assert int(n_chunk) == int((table.ublocks < case.n).sum())  # one chunk per unique block
        grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))

        def kern(q, bk, bv, idx, w):
            return memory_attention(q, bk, bv, idx, w, impl="triton", sparse_grad=False)

        out, grads = grads_of(kern, (q, bk, bv, idx, w), grad_out)
    finally:
        torch.use_deterministic_algorithms(was)
    out_ref, grads_ref = grads_of(memory_attention_naive, (q, bk, bv, idx, w), grad_out)
    assert rel_err(out, out_ref) < TOL_CPU[torch.float32]
    for gr, ref_g in zip(grads, grads_ref, strict=True):
        assert rel_err(gr, ref_g) < TOL_CPU[torch.float32]


VIEW_OPS = {
    "aten.slice",
    "aten.view",
    "aten.expand",
    "aten.unsqueeze",
    "aten._unsafe_view",
    "aten.select",
    "aten.alias",
    "aten.as_strided",
}


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("per_token,weighted,bound", [(False, False, 30), (True, True, 40)])
def test_table_build_stays_few_ops(per_token, weighted, bound):
    """Each op of the table build costs ~30 µs of host time on a GPU host (more than the
    kernels at moc's shape): a regression guard on the count of non-view ops (28 / 38 now,
    77 / 78 before the build was reworked)."""
    from memtree.kernels.memory_attention import kernel as K

    case = Case(2, 4, 2, 37, 16, 50, 8, 5, per_token, "bias" if weighted else None)
    q, bk, bv, idx, w = make_inputs(case)
    K.plan(q, bk, bv, idx, w)  # per-shape constants are cached on the first call
    counter = OpCount()
    with counter:
        K.plan(q, bk, bv, idx, w)
    real = [o for o in counter.ops if o not in VIEW_OPS]
    assert len(real) <= bound, sorted(real)


@interp
@pytest.mark.parametrize(
    "case",
    [Case(2, 4, 2, 63, 16, 7, 20, 3, False, None), Case(1, 4, 2, 37, 16, 6, 9, 3, True, "mix")],
    ids=str,
)
def test_table_built_once_serves_every_call(case):
    """A table built by memory_attention_table and passed to several calls (a model's layers
    reading one level's lists) gives each call the outputs and gradients of a call that builds
    its own."""
    q, bk, bv, idx, w = _check_shared_table(case, "cpu", sparse_grad=False)
    # a table built elsewhere is refused by shape; the reference path takes none
    with pytest.raises(ValueError, match="table was built for"):
        memory_attention(
            q,
            bk[:-1],
            bv[:-1],
            idx,
            w,
            weight_mode=case.mode or "bias",
            impl="triton",
            table=memory_attention_table(q, bk, bv, idx, w, impl="triton"),
        )
    assert memory_attention_table(q, bk, bv, idx, w, impl="reference") is None


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("case", GPU_CASES[:2] + GPU_CASES[3:5], ids=str)
def test_gpu_shared_table_matches_own(case, sparse):
    _check_shared_table(case, "cuda", sparse_grad=sparse)


def _check_shared_table(case: Case, device: str, *, sparse_grad: bool):
    """Two layers' reads through one shared table give what per-call tables give; returns
    the inputs."""
    q, bk, bv, idx, w = make_inputs(case, device)
    mode = case.mode or "bias"
    table = memory_attention_table(q, bk, bv, idx, w, impl="triton")
    assert table is not None and table.ints.dtype == torch.int32
    g = torch.Generator().manual_seed(3)
    grad_out = torch.randn(q.shape, generator=g).to(q.device, q.dtype)
    for layer in range(2):  # the same table, two layers' reads (different queries and banks)
        ql, bkl, bvl = (x * (1 + layer) for x in (q, bk, bv))

        def read(q, bk, bv, idx, w, tbl=None):
            return memory_attention(
                q,
                bk,
                bv,
                idx,
                w,
                weight_mode=mode,
                impl="triton",
                sparse_grad=sparse_grad,
                table=tbl,
            )

        own, g_own = grads_of(read, (ql, bkl, bvl, idx, w), grad_out)
        shared, g_shared = grads_of(
            lambda *a: read(*a, tbl=table), (ql, bkl, bvl, idx, w), grad_out
        )
        torch.testing.assert_close(shared, own)
        for a, b in zip(g_shared, g_own, strict=True):
            torch.testing.assert_close(a, b)
    return q, bk, bv, idx, w


@interp
def test_prebuilt_table_skips_the_build_inside_the_op():
    """With a table given, the forward op's body dispatches none of the build's ops and still
    saves the table for backward (the op returns empty table buffers, which must not be what
    backward reads)."""
    case = Case(2, 4, 2, 20, 16, 7, 9, 3, False, "bias")
    q, bk, bv, idx, w = make_inputs(case)
    table = memory_attention_table(q, bk, bv, idx, w, impl="triton")
    counter = OpCount()
    with counter:
        out, lse, ints, coef = op.IMPLS_BY_OP["memtree::memory_attention_fwd"](
            q, bk, bv, idx, w, table.ints, table.coef, "bias", 0.25, "triton", False, "tiles"
        )
    assert ints.numel() == 0 and coef.numel() == 0
    assert not {"aten.sort", "aten.cumsum", "aten.scatter_reduce_"} & set(counter.ops), counter.ops
    own_out, own_lse, own_ints, _ = op.IMPLS_BY_OP["memtree::memory_attention_fwd"](
        q, bk, bv, idx, w, None, None, "bias", 0.25, "triton", False, "tiles"
    )
    assert torch.equal(own_ints, table.ints)  # the same table, built inside the op this time
    torch.testing.assert_close(out, own_out)
    torch.testing.assert_close(lse, own_lse)
    args = (
        q.requires_grad_(),
        bk.requires_grad_(),
        bv.requires_grad_(),
        idx,
        w.requires_grad_(),
        table.ints,
        table.coef,
        "bias",
        0.25,
        "triton",
        False,
        "tiles",
    )
    torch.library.opcheck(op.memory_attention_fwd, args)


@interp
def test_block_out_of_range_is_rejected():
    """A device-side assertion (no host sync): RuntimeError on the CPU, a device assert on
    a GPU."""
    q, bk, bv, _, _ = make_inputs(Case(1, 2, 1, 3, 16, 4, 5, 2, False, None))
    with pytest.raises(RuntimeError, match="beyond the bank"):
        memory_attention(q, bk, bv, torch.tensor([[0, 4]]), impl="triton")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    q, bk, bv, idx, _ = make_inputs(Case(1, 2, 1, 3, 16, 4, 5, 2, False, None))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        memory_attention(q, bk, bv, idx, impl="triton")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"weight_mode": "joint"}, "weight_mode"),
        ({"impl": "cuda"}, "impl"),
        ({"q": torch.zeros(1, 3, 3, 16)}, "multiple of memory KV heads"),
        ({"q": torch.zeros(1, 2, 3, 8)}, "head dim"),
        ({"block_idx": torch.zeros(1, 2)}, "integer"),
        ({"block_idx": torch.zeros(1, 4, 2, dtype=torch.long)}, "block_idx must be"),
        ({"weights": torch.ones(1, 3)}, "weights shape"),
    ],
)
def test_bad_arguments_are_named(change, match):
    q, bk, bv, idx, _ = make_inputs(Case(1, 2, 2, 3, 16, 4, 5, 2, False, None))
    kwargs = {"q": q, "bank_k": bk, "bank_v": bv, "block_idx": idx} | change
    with pytest.raises(ValueError, match=match):
        memory_attention(**kwargs)


def test_default_scale_is_inverse_sqrt_d():
    q, bk, bv, idx, _ = make_inputs(Case(1, 2, 1, 3, 16, 4, 5, 2, False, None))
    torch.testing.assert_close(
        memory_attention(q, bk, bv, idx), memory_attention(q, bk, bv, idx, scale=1 / math.sqrt(16))
    )


@interp
@pytest.mark.parametrize(
    "case",
    [Case(2, 4, 2, 63, 16, 7, 20, 3, False, None), Case(1, 4, 2, 37, 16, 6, 9, 3, True, "mix")],
    ids=str,
)
def test_shared_table_reads_the_sparse_row_count_once(monkeypatch, case):
    """With sparse bank gradients each call's backward reads the unique-block count U on the
    host; calls sharing a table read it once between them (MemoryTable.n_unique), and their
    sparse gradients are those of calls that build their own tables."""
    q, bk, bv, idx, w = make_inputs(case)
    mode = case.mode or "bias"
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    def layers(tbl):
        rec, grads = HostSyncs(monkeypatch), []
        with rec:
            for layer in range(3):
                leaves = [x.detach().mul(1 + layer).requires_grad_() for x in (q, bk, bv)]
                out = memory_attention(
                    *leaves, idx, w, weight_mode=mode, impl="triton", sparse_grad=True, table=tbl
                )
                out.backward(grad_out)
                assert leaves[1].grad.is_sparse
                grads.append([x.grad.to_dense() for x in leaves])
        monkeypatch.undo()
        return grads, rec.syncs

    own, syncs_own = layers(None)
    table = memory_attention_table(q, bk, bv, idx, w, impl="triton")
    assert table.n_unique() == int(torch.unique(idx[idx >= 0]).numel())
    fresh = memory_attention_table(q, bk, bv, idx, w, impl="triton")
    rec = HostSyncs(monkeypatch)
    with rec:
        fresh.n_unique()
        fresh.n_unique()  # cached: no second read
    monkeypatch.undo()
    shared, syncs_shared = layers(memory_attention_table(q, bk, bv, idx, w, impl="triton"))
    assert len(syncs_own) == 3, syncs_own  # one U read per backward
    assert syncs_shared == rec.syncs and len(rec.syncs) <= 2, (syncs_shared, rec.syncs)
    for g_s, g_o in zip(shared, own, strict=True):
        for a, b in zip(g_s, g_o, strict=True):
            torch.testing.assert_close(a, b)
