"""Shapes, inputs and checks shared by the memory-attention kernel tests.

test_kernels_memory_attention.py (the kernels against the reference),
test_kernels_memory_attention_table.py (the launch table, dK/dV chunks, host syncs) and
test_kernels_memory_attention_blocks.py (the block-major layout) import from here: `Case`
shapes; inputs with ragged padding, a block repeated in a list and queries without memory;
outputs and gradients of the Triton path against autograd through `memory_attention_naive`;
and the dispatch-mode recorders of host syncs and op counts. Without a GPU the Triton kernels
run under TRITON_INTERPRET=1, set here before the kernel module is first imported.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from memtree.kernels.memory_attention import memory_attention, memory_attention_naive, op

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="CPU Triton tests need TRITON_INTERPRET=1")

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
