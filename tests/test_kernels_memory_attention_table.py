"""Memory attention's launch table and host side, Triton path vs the gathered reference.

The table the kernels launch on (built once in forward, on the device; shared between calls
by memory_attention_table), the dK/dV chunks a shared block is cut into (and one chunk per
block under deterministic algorithms), the op count of the table build, and the host syncs of
forward and backward. Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (set by
memory_attention_cases before the kernel module is first imported); `gpu`-marked tests run
the compiled kernels on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from memory_attention_cases import (
    GPU_CASES,
    TOL_CPU,
    VIEW_OPS,
    Case,
    HostSyncs,
    OpCount,
    check_host_syncs,
    grads_of,
    interp,
    make_inputs,
    rel_err,
)

from memtree.kernels.memory_attention import (
    memory_attention,
    memory_attention_naive,
    memory_attention_table,
    op,
)
from memtree.kernels.memory_attention.table import dkv_chunks

# these modules test the slot tiles: per-token calls at per_token_layout="auto" must run them
pytestmark = pytest.mark.usefixtures("auto_layout_is_tiles")


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
