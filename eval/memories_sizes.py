"""How large each trained row of `memtree eval memories` (`eval.memories`) is: the fetched memory's
width per layer, the dense rows' shapes, and Mixture-of-Chapters / product-key layers sized to the
fetched memory's active parameters per token (and, with `bank: total`, to its total parameters)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from memtree.config import from_dict
from memtree.geometry import AnchorShape, Plan, layer_widths
from memtree.training.flops import moc_params, pkm_params
from memtree.training.layers.moc import MoCConfig
from memtree.training.layers.pkm import PKMConfig


def fetched_widths(p: Plan) -> dict[int, int]:
    """Per layer, the FFN hidden units all fetched blocks add (every level's block together)."""
    if p.memory.type != "ffn":
        raise ValueError(f"memory.type {p.memory.type!r}: only FFN memories are compared here")
    out: dict[int, int] = {}
    for m in p.memory.multipliers:
        for layer, w in layer_widths(p.anchor, p.memory, m).items():
            out[layer] = out.get(layer, 0) + w
    return out


def dense_shape(anchor: AnchorShape, p: Plan, size: str) -> AnchorShape:
    """`1x`: the anchor's own shape; `2x`: the anchor's blocks repeated until the model has ≥ 2× the
    anchor's parameters; `runtime`: every FFN widened by the fetched width per layer (= anchor +
    fetched parameters)."""
    if size == "1x":
        return dataclasses.replace(anchor, name="dense-1x")
    if size == "2x":
        n = anchor.n_layers
        while dataclasses.replace(anchor, n_layers=n).params() < 2 * anchor.params():
            n += 1
        return dataclasses.replace(anchor, name=f"dense-{n}l", n_layers=n)
    widths = set(fetched_widths(p).values())
    if len(widths) != 1 or len(fetched_widths(p)) != anchor.n_layers:
        raise ValueError(
            f"size runtime needs the same memory width on every layer, got {fetched_widths(p)}"
        )
    ffn = anchor.ffn_dim + widths.pop()
    return dataclasses.replace(anchor, name=f"dense-ffn{ffn}", ffn_dim=ffn)


def moc_active_params(anchor: AnchorShape, moc: MoCConfig) -> int:
    """Memory parameters a token reads in MoC layers: their own weights (router, W_Q, W_K, W_V, W_O,
    norms, variation 2's MLP) and the selected chapters' bank tokens (a factorised bank's B too)."""
    p = moc_params(anchor, moc)
    g = moc.geometry(d_model=anchor.d_model, n_layers=anchor.n_layers, anchor_heads=anchor.n_heads)
    banks = 1 if moc.shared_bank else len(moc.layers)
    read = moc.n_selected * moc.tokens_per_chapter * g.stored_dim
    read += moc.rank * anchor.d_model if moc.low_rank == "factorized" else 0
    return p["layers"] + p["kv"] + banks * read


def pkm_active_params(anchor: AnchorShape, pkm: PKMConfig) -> int:
    """Memory parameters a token reads in product-key layers: query projection, every sub-key (all
    are scored), k values per head, and the in / out projections."""
    vd = pkm.value_dim or anchor.d_model
    per = pkm.params(anchor.d_model) - pkm.n_slots * vd + pkm.heads * pkm.k * vd
    return per * len(pkm.resolved_layers(anchor.n_layers))


def _solve(active: Callable[[int], int], target: int, hi: int) -> int:
    """The integer x in [1, hi] whose (linear, increasing) `active(x)` is closest to `target`."""
    slope = active(2) - active(1)
    x = 1 + round((target - active(1)) / slope) if slope > 0 else 1
    return min(max(x, 1), hi)


def _closest(f: Callable[[int], int], target: int, lo: int, hi: int) -> int:
    """The integer x in [lo, hi] whose (increasing, not necessarily linear) f(x) is closest to
    target."""
    a, b = lo, hi
    while b - a > 1:  # f(a) < target <= f(b), or the bounds
        m = (a + b) // 2
        a, b = (m, b) if f(m) < target else (a, m)
    return min((a, b), key=lambda x: (abs(f(x) - target), x))


def size_moc(
    anchor: AnchorShape, fields: dict[str, Any], target: int, total: int | None = None
) -> MoCConfig:
    """The row's MoCConfig; without tokens_per_chapter, the T whose active parameters are closest to
    target. With total (bank: total), then n_chapters (≥ the chapters a token reads) such that the
    model's total parameters (anchor + every MoC parameter) come closest to it, at that T. The
    active parameters then exceed target: the router's weights grow with the chapters and every
    token runs them (on the demo's anchor and plan, re-solving T against them ends at T = 1 and
    37,182 chapters, 9.7M active)."""
    if "tokens_per_chapter" in fields:
        return from_dict(MoCConfig, fields, where="moc")
    t = _solve(
        lambda x: moc_active_params(
            anchor, from_dict(MoCConfig, {**fields, "tokens_per_chapter": x})
        ),
        target,
        hi=1 << 20,
    )
    m = from_dict(MoCConfig, {**fields, "tokens_per_chapter": t}, where="moc")
    if total is not None:
        size = lambda n: (
            anchor.params() + sum(moc_params(anchor, dataclasses.replace(m, n_chapters=n)).values())
        )
        m = dataclasses.replace(m, n_chapters=_closest(size, total, m.n_selected, 1 << 16))
    return m


def size_pkm(
    anchor: AnchorShape, fields: dict[str, Any], target: int, total: int | None = None
) -> PKMConfig:
    """The row's PKMConfig; without k, the slots per head (≤ n_keys) whose active parameters are
    closest. With total (bank: total), then n_keys such that the model's total parameters
    (`pkm_params`) come closest to it, at that k. The active parameters then exceed target: every
    token scores all 2·n_keys sub-keys per head (on the demo's 12 heads, even k = 1 stays above
    target at the total)."""
    if "k" in fields:
        return from_dict(PKMConfig, fields, where="pkm")
    n_keys = int(fields.get("n_keys", PKMConfig().n_keys))
    k = _solve(
        lambda x: pkm_active_params(anchor, from_dict(PKMConfig, {**fields, "k": x})),
        target,
        hi=n_keys,
    )
    pk = from_dict(PKMConfig, {**fields, "k": k}, where="pkm")
    if total is not None:
        size = lambda n: pkm_params(anchor, dataclasses.replace(pk, n_keys=n))
        pk = dataclasses.replace(pk, n_keys=_closest(size, total, pk.k, 1 << 14))
    return pk
