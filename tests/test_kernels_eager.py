"""The fused reads' eager fast path and their per-table caches (kernels/eager.py,
kernels/memory_attention/table.py's UnpackedTables).

Eager calls run the ops' bodies through a plain autograd.Function rather than the custom op;
both paths must give the same outputs and gradients, and tracing (dispatch modes here,
torch.compile in the ops' own tests) must still see the custom op. A table shared by several
calls is unpacked and split for dK/dV once, and tables of equal shapes are never confused.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from memtree.kernels.ffn_memory import ffn_memory, ffn_memory_table
from memtree.kernels.memory_attention import memory_attention, memory_attention_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
interp_or_gpu = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton path on the CPU needs TRITON_INTERPRET=1",
)


class _Passthrough(TorchDispatchMode):
    """Intercepts nothing; its presence alone must route calls to the custom ops."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _attention_inputs(seed: int = 0, n: int = 9):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 21, 16, generator=g)
    bk, bv = torch.randn(2, n, 12, 2, 16, generator=g).unbind(0)
    idx = torch.randint(0, n, (2, 3), generator=g)
    idx[1, -1] = -1  # padding
    dy = torch.randn(q.shape, generator=g)
    return [t.to(DEVICE) for t in (q, bk, bv, idx, dy)]


def _attention_grads(q, bk, bv, idx, dy, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, bk, bv)]
    out = memory_attention(*leaves, idx, **kw)
    out.backward(dy)
    return out, [t.grad.to_dense() for t in leaves]


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=interp_or_gpu)])
def test_attention_eager_path_matches_the_custom_op(impl):
    q, bk, bv, idx, dy = _attention_inputs()
    out, grads = _attention_grads(q, bk, bv, idx, dy, impl=impl)
    assert type(out.grad_fn).__name__ == "_EagerReadBackward"
    with _Passthrough():
        out_op, grads_op = _attention_grads(q, bk, bv, idx, dy, impl=impl)
    assert "memtree_memory_attention_fwd" in type(out_op.grad_fn).__name__
    torch.testing.assert_close(out, out_op, rtol=0, atol=0)
    for a, b in zip(grads, grads_op, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # dK/dV chunks meet in atomics


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=interp_or_gpu)])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("shared", [False, True])
def test_ffn_eager_path_matches_the_custom_op(impl, sparse, shared):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 32, generator=g).to(DEVICE)
    banks = [torch.randn(5, 24, 32, generator=g).to(DEVICE) for _ in range(3)]
    idx = torch.tensor([[0, 3, -1], [3, 4, 4]], device=DEVICE)
    dy = torch.randn(x.shape, generator=g).to(DEVICE)
    table = ffn_memory_table(idx, 5) if shared else None

    def run():
        leaves = [x.detach().requires_grad_(), *(b.detach().requires_grad_() for b in banks)]
        y = ffn_memory(*leaves, idx, sparse_grad=sparse, impl=impl, table=table)
        y.backward(dy)
        return y, [t.grad.to_dense() for t in leaves]

    y, grads = run()
    assert type(y.grad_fn).__name__ == "_EagerFFNBackward"
    with _Passthrough():
        y_op, grads_op = run()
    assert "memtree_ffn_memory" in type(y_op.grad_fn).__name__
    torch.testing.assert_close(y, y_op, rtol=0, atol=0)
    for a, b in zip(grads, grads_op, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@interp_or_gpu
def test_shared_table_is_unpacked_and_split_once():
    """Three layers' reads of one shared table, forward and backward: one unpacked table and
    one dK/dV split between them; a second table of the same shapes (other lists) gets its
    own, and interleaving the two gives each call its own table's results."""
    from memtree.kernels.memory_attention import kernel as K

    q, bk, bv, idx, dy = _attention_inputs()
    idx2 = idx.flip(0)  # same shape, other lists
    K.TABLES.clear()
    tables = [memory_attention_table(q, bk, bv, i, impl="triton") for i in (idx, idx2)]
    want = [_attention_grads(q, bk, bv, i, dy, impl="triton") for i in (idx, idx2)]
    K.TABLES.clear()
    for _layer in range(3):
        for which in (0, 1):
            out, grads = _attention_grads(
                q,
                bk,
                bv,
                (idx, idx2)[which],
                dy,
                impl="triton",
                table=tables[which],
                sparse_grad=False,
            )
            torch.testing.assert_close(out, want[which][0])
            for a, b in zip(grads, want[which][1], strict=True):
                torch.testing.assert_close(a, b)
    assert len(K.TABLES.entries) == 2  # one entry per table, not per call
    assert [len(memo) for _, memo in K.TABLES.entries.values()] == [1, 1]  # one split each
    assert {key[2] for key in K.TABLES.entries} == {t.ints.data_ptr() for t in tables}
    layout = next(iter(K.TABLES.entries))[0]
    assert K.TABLES.unpack(layout, tables[0].ints, tables[0].coef) is K.TABLES.unpack(
        layout, tables[0].ints, tables[0].coef
    )


def test_unpacked_tables_stay_bounded():
    from memtree.kernels.memory_attention.table import UnpackedTables, build_table

    cache = UnpackedTables(size=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        cache.put(build_table(torch.randint(0, 9, (2, 3), generator=g), None, 21, 9, 32))
    assert len(cache.entries) == 3
