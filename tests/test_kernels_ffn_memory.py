"""The fused FFN-memory read (kernels.ffn_memory) against its pure-torch reference.

CPU tests run the Triton kernels in the interpreter (TRITON_INTERPRET=1, set
here before triton is imported) on tiny odd shapes; the `gpu` tests rerun the
comparisons with the compiled kernels on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from memtree.kernels.ffn_memory import ffn_memory, ffn_memory_naive, ffn_memory_table
from memtree.kernels.ffn_memory import kernel as ffn_kernel

interpreter = pytest.mark.skipif(
    not ffn_kernel.interpreting(), reason="needs TRITON_INTERPRET=1 to run Triton on CPU"
)
compiled = pytest.mark.skipif(ffn_kernel.interpreting(), reason="the kernels are interpreted")

# Relative (norm-wise) error allowed per dtype: fp32 accumulation everywhere, but the
# hidden activations and operands are rounded to the input dtype in the kernel.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# Ragged k with -1 padding, a block repeated within a row, blocks shared across rows.
IDX_B3 = [[2, 5, -1], [5, 5, 0], [-1, 2, 6]]
IDX_B1 = [[3, -1, 3, 1]]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm().clamp(min=1e-30))


def make_inputs(b, s, d, w, idx, dtype=torch.float32, n=7, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, d, generator=g)
    banks = [torch.randn(n, w, d, generator=g) / d**0.5 for _ in range(3)]
    dy = torch.randn(b, s, d, generator=g)
    block_idx = torch.tensor(idx, dtype=torch.int64)
    return (
        x.to(device, dtype),
        [t.to(device, dtype) for t in banks],
        block_idx.to(device),
        dy.to(device, dtype),
    )


def run_op(x, banks, block_idx, dy, **kw):
    """Output and gradients (dx, dw1, dw2, dw3; bank grads densified) of ffn_memory."""
    x = x.detach().requires_grad_()
    banks = [b.detach().requires_grad_() for b in banks]
    y = ffn_memory(x, *banks, block_idx, **kw)
    y.backward(dy)
    grads = [t.grad.to_dense() if t.grad.is_sparse else t.grad for t in (x, *banks)]
    return y.detach(), grads


def run_naive(x, banks, block_idx, dy):
    """fp32 output and gradients of the reference, by autograd, on fp32 copies of the inputs."""
    x = x.detach().float().requires_grad_()
    banks = [b.detach().float().requires_grad_() for b in banks]
    y = ffn_memory_naive(x, *banks, block_idx)
    y.backward(dy.float())
    return y.detach(), [t.grad for t in (x, *banks)]


def assert_matches_naive(x, banks, block_idx, dy, **kw):
    y, grads = run_op(x, banks, block_idx, dy, **kw)
    y_ref, grads_ref = run_naive(x, banks, block_idx, dy)
    tol = TOL[x.dtype]
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel_err(y, y_ref) < tol, ("y", rel_err(y, y_ref))
    for name, g, r, src in zip(("dx", "dw1", "dw2", "dw3"), grads, grads_ref, (x, *banks)):
        assert g.dtype == src.dtype and g.shape == src.shape, name
        assert rel_err(g, r) < tol, (name, rel_err(g, r))
    return y, grads


# (B, S, d, W, dtype): every B, S, d and dtype appears; W is never a power of two.
CASES = [
    (1, 1, 32, 24, torch.float32),
    (3, 63, 80, 40, torch.float32),
    (3, 100, 64, 24, torch.float16),
    (3, 1, 64, 40, torch.float16),
    (3, 63, 32, 40, torch.bfloat16),
    (1, 100, 80, 20, torch.bfloat16),
]


@interpreter
@pytest.mark.parametrize("b,s,d,w,dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_triton_matches_naive(b, s, d, w, dtype):
    x, banks, idx, dy = make_inputs(b, s, d, w, IDX_B3 if b == 3 else IDX_B1, dtype)
    assert_matches_naive(x, banks, idx, dy, impl="triton", sparse_grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_dispatch_matches_naive_autograd(dtype):
    # impl="auto" on CPU runs the reference forward and the hand-written backward.
    x, banks, idx, dy = make_inputs(3, 63, 80, 40, IDX_B3, dtype)
    y, _ = assert_matches_naive(x, banks, idx, dy)
    assert torch.equal(y, ffn_memory_naive(x, *banks, idx))  # the reference itself, not Triton


@interpreter
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_sparse_grad_only_on_referenced_blocks(impl):
    x, banks, idx, dy = make_inputs(3, 63, 32, 24, IDX_B3, n=9)
    x, banks = x.requires_grad_(), [b.requires_grad_() for b in banks]
    ffn_memory(x, *banks, idx, impl=impl).backward(dy)
    sparse = [b.grad for b in banks]
    _, dense = run_op(x, banks, idx, dy, impl=impl, sparse_grad=False)
    referenced = torch.tensor([0, 2, 5, 6])
    for g, full, bank in zip(sparse, dense[1:], banks):
        assert g.is_sparse and g.shape == bank.shape
        assert torch.equal(g._indices(), referenced[None])  # one entry per referenced block
        # Only the referenced blocks are stored: no bank-sized buffer behind the values.
        assert g._values().untyped_storage().nbytes() == 4 * g._values().element_size() * 24 * 32
        torch.testing.assert_close(g.to_dense(), full, rtol=1e-6, atol=1e-6)
        unreferenced = torch.ones(9, dtype=torch.bool)
        unreferenced[referenced] = False
        assert (
            full[unreferenced].abs().max() == 0
            and full[referenced].abs().amax(dim=(1, 2)).min() > 0
        )


@interpreter
def test_padding_only_rows_and_bank_views():
    # Banks are width slices of wider per-level tables (block stride 2W·d), x is a
    # non-contiguous bf16 view while the banks are fp32, and one sequence has nothing
    # but padding.
    x, tables, _, dy = make_inputs(3, 63, 32, 48, IDX_B3, n=7)
    x = x.transpose(0, 1).contiguous().transpose(0, 1)
    banks = [t[:, 10:34] for t in tables]  # (7, 24, 32) views
    assert banks[0].stride(0) == 48 * 32
    idx = torch.tensor([[1, 6, 6], [-1, -1, -1], [0, 6, -1]])
    y, grads = assert_matches_naive(
        x.bfloat16(), banks, idx, dy.bfloat16(), impl="triton", sparse_grad=False
    )
    assert y[1].abs().max() == 0 and grads[0][1].abs().max() == 0
    assert all(g.dtype == torch.float32 for g in grads[1:])
    # Dense gradients flow back through the slicing into the tables (sparse ones cannot:
    # slicing's backward has no sparse kernel).
    tables = [t.requires_grad_() for t in tables]
    ffn_memory(
        x.bfloat16(), *(t[:, 10:34] for t in tables), idx, impl="triton", sparse_grad=False
    ).backward(dy.bfloat16())
    for t, g in zip(tables, grads[1:]):
        torch.testing.assert_close(t.grad[:, 10:34], g, rtol=1e-6, atol=1e-6)
        assert t.grad[:, :10].abs().max() == 0 and t.grad[:, 34:].abs().max() == 0


@interpreter
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_matches_model_feedforward_memory_branch(impl):
    from memtree.geometry import AnchorShape, MemoryConfig
    from memtree.training.model import FeedForward, ModelConfig

    b, s, d, w = 3, 63, 64, 40
    idx = [[0, 4, 9], [0, 3, 9], [0, 4, 7]]  # one block per level, shared higher up
    x, banks, idx, _ = make_inputs(b, s, d, w, idx, n=10)
    # Plain-torch reference: gather the blocks explicitly, concatenate along the width.
    w1, w2, w3 = (bank[idx].flatten(1, 2) for bank in banks)  # (B, k·W, d)
    expected = (F.silu(x @ w1.mT) * (x @ w2.mT)) @ w3
    got = ffn_memory(x, *banks, idx, impl=impl)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    anchor = AnchorShape(n_layers=1, d_model=d, n_heads=2, head_dim=32, ffn_dim=96)
    ffn = FeedForward(ModelConfig(anchor=anchor, memory=MemoryConfig(multipliers=(1,))))
    with torch.no_grad():
        branch = ffn(x, {"w1": w1, "w2": w2, "w3": w3}) - ffn(x, None)
    torch.testing.assert_close(got, branch, rtol=1e-4, atol=1e-4)


@interpreter
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_opcheck(impl):
    x, banks, idx, dy = make_inputs(2, 5, 32, 24, [[2, 5, -1], [5, 5, 0]])
    x = x.transpose(0, 1).contiguous().transpose(0, 1)  # outputs are contiguous regardless
    torch.library.opcheck(
        torch.ops.memtree.ffn_memory.default,
        (x.requires_grad_(), *(b.requires_grad_() for b in banks), idx),
        {"sparse_grad": False, "impl": impl},
    )
    torch.library.opcheck(
        torch.ops.memtree.ffn_memory_backward.default,
        (dy, x.detach(), *(b.detach() for b in banks), idx, None, 6, impl),
    )
    # with a shared table (ffn_memory_table's packed pairs)
    table = ffn_memory_table(idx, banks[0].shape[0])
    torch.library.opcheck(
        torch.ops.memtree.ffn_memory.default,
        (x, *banks, idx, table.packed),
        {"sparse_grad": True, "num_slots": table.num_slots(), "impl": impl},
    )
    torch.library.opcheck(
        torch.ops.memtree.ffn_memory_backward.default,
        (dy, x.detach(), *(b.detach() for b in banks), idx, table.packed, 3, impl),
    )


def _compile_matches_eager(device: str, dtype: torch.dtype) -> None:
    x, banks, idx, dy = make_inputs(3, 63, 64, 40, IDX_B3, dtype, device=device)

    def f(x, w1, w2, w3, block_idx):
        return torch.tanh(ffn_memory(x, w1, w2, w3, block_idx, sparse_grad=False)) * 2

    def run(fn):
        leaves = [x.detach().requires_grad_(), *(b.detach().requires_grad_() for b in banks)]
        out = fn(*leaves, idx)
        out.backward(dy)
        return out.detach(), [t.grad for t in leaves]

    torch._dynamo.reset()
    out_c, grads_c = run(torch.compile(f, fullgraph=True))
    out_e, grads_e = run(f)
    tol = TOL[dtype]
    for got, ref in zip([out_c, *grads_c], [out_e, *grads_e]):
        assert rel_err(got, ref) < tol


def test_torch_compile_fullgraph_matches_eager():
    _compile_matches_eager("cpu", torch.float32)


def test_argument_errors_name_the_argument():
    x, banks, idx, _ = make_inputs(1, 4, 32, 24, IDX_B1)
    with pytest.raises(ValueError, match="impl"):
        ffn_memory(x, *banks, idx, impl="cuda")
    with pytest.raises(ValueError, match="block_idx"):
        ffn_memory(x, *banks, idx.int())
    with pytest.raises(ValueError, match="bank_w3"):
        ffn_memory(x, banks[0], banks[1], banks[2][:, :, :16], idx)
    with pytest.raises(ValueError, match="bank_w2"):
        ffn_memory(
            x, banks[0], banks[1].transpose(1, 2).contiguous().transpose(1, 2), banks[2], idx
        )
    with pytest.raises(ValueError, match="x must be"):
        ffn_memory(x[0], *banks, idx)
    with pytest.raises(ValueError, match="table was built for"):  # another N
        ffn_memory(x, *banks, idx, table=ffn_memory_table(idx, banks[0].shape[0] + 1))
    with pytest.raises(ValueError, match="block_idx must be int64"):
        ffn_memory_table(idx.int(), 7)


class UniqueCount(TorchDispatchMode):
    """Counts the distinct-block counts (aten unique + the host read of its size) that run under
    it: each is a host sync on a GPU. The custom ops are opaque to the mode; the count lives in
    the autograd formula or the table, both outside them."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "unique" in func._schema.name:
            self.n += 1
        return func(*args, **(kwargs or {}))


@interpreter
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("sparse_grad", [True, False])
def test_table_built_once_serves_every_call(impl, sparse_grad):
    """One ffn_memory_table passed to several calls on the same block lists (a model's layers
    reading a level) gives each call the output and gradients of a call that sorts its own
    pairs, and with sparse gradients counts the distinct blocks once for all of them."""
    x, banks, idx, dy = make_inputs(3, 63, 32, 24, IDX_B3, n=9)
    table = ffn_memory_table(idx, 9)
    assert table.packed.shape == (6, idx.numel()) and table.packed.dtype == torch.int64

    def three_layers(tbl):
        layers = [([b * (1 + i) for b in banks], x * (1 - 0.3 * i)) for i in range(3)]
        counter = UniqueCount()
        outs = []
        with counter:
            for bl, xl in layers:
                outs.append(run_op(xl, bl, idx, dy, impl=impl, sparse_grad=sparse_grad, table=tbl))
        return outs, counter.n

    own, syncs_own = three_layers(None)
    shared, syncs_shared = three_layers(table)
    for (y_o, g_o), (y_s, g_s) in zip(own, shared, strict=True):
        torch.testing.assert_close(y_s, y_o)
        for a, b in zip(g_s, g_o, strict=True):
            torch.testing.assert_close(a, b)
    assert (syncs_own, syncs_shared) == ((3, 1) if sparse_grad else (0, 0))


# ---------------------------------------------------------------------- CUDA (compiled kernels)
GPU_CASES = [
    (4, 257, 768, 320, torch.float32),
    (4, 1024, 768, 320, torch.bfloat16),
    (16, 1, 512, 200, torch.float16),
    (3, 100, 80, 40, torch.bfloat16),
]


@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("b,s,d,w,dtype", GPU_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_cuda_matches_naive(b, s, d, w, dtype):
    g = torch.Generator().manual_seed(1)
    k, n = 3, 3 * b
    idx = torch.randint(0, n, (b, k), generator=g)
    idx[0, 1] = idx[0, 0]  # a repeat within a row
    idx[:, 0] = idx[0, 0]  # and a block every sequence shares
    idx[-1, -1] = -1
    x, banks, idx, dy = make_inputs(b, s, d, w, idx.tolist(), dtype, n=n, device="cuda")
    assert_matches_naive(x, banks, idx, dy, sparse_grad=False)
    _, sparse = run_op(x, banks, idx, dy)
    _, dense = run_op(x, banks, idx, dy, sparse_grad=False)
    for a, c in zip(sparse, dense):
        torch.testing.assert_close(a, c)
    # the pair table shared by a model's layers (ffn_memory_table) gives the per-call results
    y_own, own = run_op(x, banks, idx, dy)
    y_shared, shared = run_op(x, banks, idx, dy, table=ffn_memory_table(idx, n))
    torch.testing.assert_close(y_shared, y_own)
    for a, c in zip(shared, own):
        torch.testing.assert_close(a, c)


@pytest.mark.gpu
@compiled
def test_cuda_torch_compile_fullgraph_matches_eager():
    _compile_matches_eager("cuda", torch.bfloat16)
