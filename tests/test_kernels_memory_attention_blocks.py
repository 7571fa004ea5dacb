"""Memory attention's block-major layout for per-token lists (per_token_layout="blocks",
kernels/memory_attention/blocks.py) against the gathered reference and the slot tiles.

The kernels run under TRITON_INTERPRET=1 without a GPU (memory_attention_cases sets it before
the kernels are imported), where chunks are small (CT = 16 // G tokens) so the tests' blocks
span several chunks. Shapes, inputs (ragged padding, a block repeated in a list, tokens
without memory) and the host-sync recorder come from memory_attention_cases.
"""

from __future__ import annotations

import pytest
import torch
from memory_attention_cases import (
    GPU_CASES,
    TOL_CPU,
    TOL_GPU,
    VIEW_OPS,
    Case,
    OpCount,
    check_case,
    check_host_syncs,
    check_lse_gradient,
    grads_of,
    interp,
    make_inputs,
    rel_err,
)

from memtree.kernels.memory_attention import memory_attention, memory_attention_naive, op

BLOCKS_CASES = [  # (case, sparse bank gradient)
    (Case(1, 6, 2, 63, 32, 9, 20, 4, True, "bias"), True),  # GQA 3, two T tiles
    (Case(1, 4, 4, 100, 64, 7, 12, 2, True, "mix"), False),  # fp32 dense: rows by block id
    (Case(2, 2, 1, 1, 80, 4, 20, 3, True, None), True),  # S = 1, D not a power of two
    (Case(1, 4, 2, 100, 16, 6, 20, 3, True, None), False),
    (Case(2, 4, 2, 37, 32, 6, 9, 3, True, "mix", torch.bfloat16), False),
    (Case(1, 4, 2, 63, 32, 8, 20, 4, True, "mix", torch.float16), False),  # mix's dC pass
    (Case(1, 2, 2, 63, 64, 6, 20, 4, True, "bias", torch.float16), True),
    (Case(1, 4, 2, 37, 32, 6, 16, 3, True, "mix"), True),  # T = BLOCK_N: unmasked loads
]


def _blocks(mode: str, **kw):
    def fn(q, bk, bv, idx, w):
        return memory_attention(
            q, bk, bv, idx, w, weight_mode=mode, impl="triton", per_token_layout="blocks", **kw
        )

    return fn


def check_blocks(case: Case, sparse: bool, device: str, tol: dict) -> None:
    check_case(case, device, tol, per_token_layout="blocks", sparse_grad=sparse)
    q, bk, bv, idx, w = make_inputs(case, device)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    mode = case.mode or "bias"
    # the layout asked for (grads_of densifies): rerun the bank gradient alone
    k = bk.detach().requires_grad_()
    _blocks(mode, sparse_grad=sparse)(q, k, bv, idx, w).backward(grad_out)
    assert k.grad.is_sparse == sparse


@interp
@pytest.mark.parametrize(
    "case,sparse", BLOCKS_CASES, ids=[f"{c}-{'sparse' if s else 'dense'}" for c, s in BLOCKS_CASES]
)
def test_blocks_match_reference(case, sparse):
    """Outputs and gradients (q, bank_k, bank_v, weights) against autograd through the
    gathered reference, in the inputs' dtypes and the requested bank-gradient layout."""
    check_blocks(case, sparse, "cpu", TOL_CPU)


GPU_BLOCKS_CASES = [c for c in GPU_CASES if c.per_token]


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("case", GPU_BLOCKS_CASES, ids=str)
def test_gpu_blocks_match_reference(case, sparse):
    """The compiled kernels (bf16/fp16 dots, atomics) at the GPU tile sizes."""
    check_blocks(case, sparse, "cuda", TOL_GPU)


@interp
@pytest.mark.parametrize("mode", ["bias", "mix"])
def test_blocks_equal_tiles(mode):
    """Both layouts compute the same function: outputs, saved statistics (the joint lse, or
    mix's per-entry lse) and every gradient."""
    case = Case(2, 4, 2, 21, 16, 7, 20, 3, True, mode)
    q, bk, bv, idx, w = make_inputs(case)
    wm = mode or "bias"
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    results = []
    for layout in ("tiles", "blocks"):
        _, lse, _, _ = op.memory_attention_fwd(
            q, bk, bv, idx, w, None, None, wm, 0.3, "triton", False, layout
        )
        out, grads = grads_of(
            lambda *a, lay=layout: memory_attention(
                *a, weight_mode=wm, impl="triton", sparse_grad=False, per_token_layout=lay
            ),
            (q, bk, bv, idx, w),
            grad_out,
        )
        results.append((lse, out, grads))
    (lse_t, out_t, g_t), (lse_b, out_b, g_b) = results
    assert torch.equal(torch.isinf(lse_t), torch.isinf(lse_b)) and torch.isinf(lse_t).any()
    finite = torch.isfinite(lse_t)
    torch.testing.assert_close(lse_b[finite], lse_t[finite], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_b, out_t, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_b, g_t, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@interp
@pytest.mark.parametrize("mode", ["bias", None])
def test_blocks_lse_is_differentiable(mode):
    """return_lse with a gradient on the lse (it folds into Delta): lse and every gradient
    against autograd through the reference; -inf for tokens that read nothing."""
    check_lse_gradient(
        Case(2, 4, 2, 23, 16, 6, 20, 3, True, mode), "triton", per_token_layout="blocks"
    )


@interp
@pytest.mark.parametrize(
    "case,sparse_grad,lse",
    [
        (Case(1, 2, 1, 100, 16, 6, 20, 2, True, "bias"), False, True),
        (Case(2, 4, 2, 1, 16, 5, 5, 3, True, None), False, True),
        (Case(2, 2, 1, 9, 16, 12, 10, 3, True, "mix"), False, False),
        (Case(2, 2, 1, 9, 16, 12, 10, 3, True, "mix"), True, False),
    ],
    ids=["bias-lse-S100", "none-lse-S1", "mix-dense", "mix-sparse"],
)
def test_blocks_have_no_host_sync(monkeypatch, case, sparse_grad, lse):
    """Forward (item table, kernel, merge) and backward synchronise nowhere with dense bank
    gradients; the sparse layout reads its row count once. Results as the reference."""
    check_host_syncs(monkeypatch, case, sparse_grad, lse, per_token_layout="blocks")


@interp
def test_blocks_compile_fullgraph_matches_eager():
    """torch.compile traces the blocks layout without graph breaks: the fake implementation
    gives the item table's static sizes. aot_eager traces forward and backward with fake
    tensors as inductor does, without inductor's code generation (~30 s here)."""
    case = Case(2, 4, 2, 6, 16, 5, 4, 3, True, "mix")
    q, bk, bv, idx, w = make_inputs(case)

    def fn(q, bk, bv, idx, w):
        out = memory_attention(
            q * 2,
            bk,
            bv,
            idx,
            w.softmax(-1),
            weight_mode="mix",
            sparse_grad=False,
            impl="triton",
            per_token_layout="blocks",
        )
        return out.square().sum()

    grad_out = torch.tensor(1.0)
    eager, g_eager = grads_of(fn, (q, bk, bv, idx, w), grad_out)
    compiled, g_comp = grads_of(
        torch.compile(fn, fullgraph=True, backend="aot_eager"), (q, bk, bv, idx, w), grad_out
    )
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(g_comp, g_eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@interp
@pytest.mark.parametrize("sparse_grad,mode", [(True, "bias"), (False, "mix")])
def test_blocks_opcheck(sparse_grad, mode):
    """The custom ops' schema, fake implementation (item table sizes) and autograd
    registration with the blocks layout."""
    case = Case(2, 2, 1, 3, 16, 4, 5, 2, True, mode)
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
        "triton",
        sparse_grad,
        "blocks",
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
        "triton",
        True,
        True,
        sparse_grad,
        "blocks",
    )
    torch.library.opcheck(op.memory_attention_bwd, bwd_args)


def test_item_table_matches_a_loop():
    """The item table against plain loops: one item per distinct block of a token's list at
    its first entry, coef = the summed weights of its entries; chunks are runs of one block
    of at most CT items covering every item once; unique blocks; counts within the static
    bounds."""
    from memtree.kernels.memory_attention.blocks import build_items

    g = torch.Generator().manual_seed(7)
    b, s, k, n, ct = 2, 9, 5, 6, 3
    idx = torch.randint(0, n, (b, s, k), generator=g)
    idx = idx.masked_fill(torch.rand(idx.shape, generator=g) < 0.3, -1)
    idx[0, :, :3] = 2  # a block three times in every list of sequence 0: several chunks
    idx[1, 4] = -1  # a token without memory
    w = torch.rand(idx.shape, generator=g) + 0.1
    tab = build_items(idx, w, n, ct)
    lay = tab.layout
    first = tab.first.view(b, s, k)
    coef = tab.coef.view(b, s, k)
    want_items = set()
    for bi in range(b):
        for si in range(s):
            for j in range(k):
                blk = int(idx[bi, si, j])
                if blk < 0:
                    assert first[bi, si, j] == -1
                    continue
                j0 = min(jj for jj in range(k) if idx[bi, si, jj] == blk)
                assert first[bi, si, j] == j0
                if j == j0:
                    want_items.add(((bi * s + si) * k + j, blk))
                    wsum = sum(float(w[bi, si, jj]) for jj in range(k) if idx[bi, si, jj] == blk)
                    assert abs(float(coef[bi, si, j]) - wsum) < 1e-6
                else:
                    assert coef[bi, si, j] == 0
    n_chunk = int(tab.n_chunk)
    assert n_chunk <= lay.n_chunks
    seen = []
    per_block: dict[int, int] = {}
    for c in range(n_chunk):
        start = int(tab.chunk_start[c])
        blk = int(tab.item_key[start])
        run = [
            start + i
            for i in range(ct)
            if start + i < lay.n_entries and int(tab.item_key[start + i]) == blk
        ]
        seen += [(int(tab.item_pos[p]), blk) for p in run]
        assert int(tab.ublocks[int(tab.chunk_u[c])]) == blk
        per_block[blk] = per_block.get(blk, 0) + 1
    assert sorted(seen) == sorted(want_items) and len(seen) == len(set(seen))
    assert per_block[2] > 1
    uniq = sorted({blk for _, blk in want_items})
    assert tab.ublocks[: len(uniq)].tolist() == uniq
    assert (tab.ublocks[len(uniq) :] == n).all()
    assert tab.ublocks.numel() == lay.u_max


@pytest.mark.parametrize("weighted", [False, True])
def test_item_table_build_stays_few_ops(weighted):
    """Each op of the build costs ~30 µs of host time on a GPU host: a regression guard on
    the count of non-view ops (48 now, weighted or not)."""
    from memtree.kernels.memory_attention import blocks

    case = Case(2, 4, 2, 37, 16, 50, 8, 5, True, "bias" if weighted else None)
    q, bk, bv, idx, w = make_inputs(case)
    blocks.plan(q, bk, bv, idx, w)  # per-shape constants are cached on the first call
    counter = OpCount()
    with counter:
        blocks.plan(q, bk, bv, idx, w)
    real = [o for o in counter.ops if o not in VIEW_OPS]
    assert len(real) <= 50, sorted(real)


def test_per_token_layout_is_validated():
    q, bk, bv, idx, _ = make_inputs(Case(1, 2, 2, 3, 16, 4, 5, 2, True, None))
    with pytest.raises(ValueError, match="per_token_layout"):
        memory_attention(q, bk, bv, idx, per_token_layout="block")
    from memtree.kernels.memory_attention import memory_attention_table

    with pytest.raises(ValueError, match="per_token_layout"):
        memory_attention_table(q, bk, bv, idx, per_token_layout="slots")


@interp
def test_blocks_layout_leaves_sequence_lists_to_tiles():
    """Per-sequence lists (B, k) have no per-token layout: "blocks" computes them as "tiles"."""
    case = Case(2, 4, 2, 21, 16, 6, 9, 3, False, "bias")
    q, bk, bv, idx, w = make_inputs(case)
    outs = [
        memory_attention(q, bk, bv, idx, w, impl="triton", per_token_layout=lay)
        for lay in ("tiles", "blocks")
    ]
    assert torch.equal(outs[0], outs[1])


@interp
def test_blocks_prebuilt_table():
    """A table built for the blocks layout serves blocks calls like a table built inside the
    op; calls of the other layout refuse it."""
    from memtree.kernels.memory_attention import memory_attention_table

    case = Case(1, 4, 2, 20, 16, 6, 9, 3, True, "mix")
    q, bk, bv, idx, w = make_inputs(case)
    table = memory_attention_table(q, bk, bv, idx, w, impl="triton", per_token_layout="blocks")
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    def read(q, bk, bv, idx, w, tbl=None, layout="blocks"):
        return memory_attention(
            q,
            bk,
            bv,
            idx,
            w,
            weight_mode="mix",
            impl="triton",
            sparse_grad=False,
            table=tbl,
            per_token_layout=layout,
        )

    own, g_own = grads_of(read, (q, bk, bv, idx, w), grad_out)
    shared, g_shared = grads_of(lambda *a: read(*a, tbl=table), (q, bk, bv, idx, w), grad_out)
    torch.testing.assert_close(shared, own)
    for a, b in zip(g_shared, g_own, strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="table was built for"):
        read(q, bk, bv, idx, w, tbl=table, layout="tiles")
    tiles = memory_attention_table(q, bk, bv, idx, w, impl="triton")
    with pytest.raises(ValueError, match="table was built for"):
        read(q, bk, bv, idx, w, tbl=tiles)


@interp
def test_blocks_backward_refused_under_deterministic_algorithms():
    """dQ and dK/dV meet in fp32 atomics: torch.use_deterministic_algorithms refuses the
    backward (forward has one writer per element and runs)."""
    q, bk, bv, idx, _ = make_inputs(Case(1, 2, 1, 5, 16, 4, 5, 2, True, None))
    q.requires_grad_()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out = memory_attention(q, bk, bv, idx, impl="triton", per_token_layout="blocks")
        with pytest.raises(RuntimeError, match="not deterministic"):
            out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(was)


@interp
@pytest.mark.parametrize("mode", ["bias", "mix"])
def test_blocks_query_gradient_alone(mode):
    """Only q requires a gradient (frozen bank, fixed weights): the backward skips dK/dV and
    dweights and dq still matches the reference."""
    case = Case(1, 4, 2, 21, 16, 6, 20, 3, True, mode)
    q, bk, bv, idx, w = make_inputs(case)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    dqs = []
    for fn in (_blocks(mode), lambda *a: memory_attention_naive(*a, weight_mode=mode)):
        ql = q.detach().requires_grad_()
        fn(ql, bk, bv, idx, w).backward(grad_out)
        dqs.append(ql.grad)
    assert rel_err(dqs[0], dqs[1]) < 1e-4


@interp
def test_auto_layout_follows_the_lists_locality():
    """per_token_layout="auto": the slot tiles for lists neighbouring tokens share, the
    block-major items where a tile names more than AUTO_BLOCKS_SLOTS_PER_K · k distinct
    blocks; explicit layouts, torch.use_deterministic_algorithms and per-sequence lists are
    left alone. The mean it reads equals the tile table's own slot count."""
    from memtree.kernels.memory_attention import kernel as K

    g = torch.Generator().manual_seed(0)
    n, k, s = 400, 3, 64
    q, bk, bv, _, _ = make_inputs(Case(1, 2, 2, s, 16, n, 4, k, True, None))
    local = torch.randint(0, n, (1, 1, k), generator=g).expand(1, s, k).contiguous()
    scattered = torch.randint(0, n, (1, s, k), generator=g)
    scattered[0, :5, 1] = -1  # padding is not a block
    for idx, want in ((local, "tiles"), (scattered, "blocks")):
        mean = float(op.slots_per_tile(q, bk, idx))
        assert mean == pytest.approx(
            K.plan(q, bk, bv, idx, None)[1].group_count.float().mean().item()
        )
        assert (mean / k > op.AUTO_BLOCKS_SLOTS_PER_K) == (want == "blocks")
        assert op.resolve_layout(q, bk, idx, "auto") == want
        table = op.memory_attention_table(q, bk, bv, idx, impl="triton")
        assert table.key[-1] == want
        # a call given that table under "auto" takes its layout; results match the explicit one
        shared = memory_attention(q, bk, bv, idx, impl="triton", table=table)
        explicit = memory_attention(q, bk, bv, idx, impl="triton", per_token_layout=want)
        torch.testing.assert_close(shared, explicit)
    assert op.resolve_layout(q, bk, scattered, "tiles") == "tiles"
    assert op.resolve_layout(q, bk, scattered[:, 0], "auto") == "tiles"  # per sequence
    torch.use_deterministic_algorithms(True)
    try:
        assert op.resolve_layout(q, bk, scattered, "auto") == "tiles"
    finally:
        torch.use_deterministic_algorithms(False)
