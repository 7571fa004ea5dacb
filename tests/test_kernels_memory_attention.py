"""Memory attention by block index: Triton kernel vs the gathered pure-torch reference.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (set by memory_attention_cases
before the kernel module is first imported), on tiny but odd shapes; `gpu`-marked tests run
the compiled kernels on CUDA. Reference gradients come from autograd through
`memory_attention_naive`. Outputs, lse and gradients, sparse bank gradients, the op's
registration (opcheck, torch.compile) and argument checks are here; the launch table, dK/dV
chunks and host syncs are test_kernels_memory_attention_table.py's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from memory_attention_cases import (
    GPU_CASES,
    TOL_CPU,
    TOL_GPU,
    Case,
    check_case,
    check_lse_gradient,
    grads_of,
    interp,
    make_inputs,
    rel_err,
)

from memtree.kernels.memory_attention import memory_attention, memory_attention_naive, op

# these modules test the slot tiles: per-token calls at per_token_layout="auto" must run them
pytestmark = pytest.mark.usefixtures("auto_layout_is_tiles")


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
