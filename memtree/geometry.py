"""Model shapes, memory geometry and parameter accounting (seed 002 §2.1–2.2, App. A, App. F,
App. I).

The shape vocabulary every stage shares: anchor shapes and presets, memory
configurations, which layers carry memory and how wide, the named tensors of a
block (`block_layout`) and how a flat block splits into them and joins back
(`split_block` / `join_block`). One place also answers "how big is everything":
the anchor's parameter count, the parameters of one memory block at each level,
what a path fetches, what the whole bank holds, and the bytes of each in every
storage dtype. The on-disk bank (`memstore.format`), the trainer and the fetch
simulator all size and cut their tensors from here, so the numbers the user
plans with are the numbers on disk. Pure Python: it works on torch tensors and
numpy arrays alike and imports neither torch nor any stage.

Conventions
- Levels are 1-based; level l of a tree with branching B has B**l clusters.
- A memory configuration (m_1 … m_L) holds one multiplier per level; m_l = 0
  means no memory at level l (no file, nothing fetched).
- The multiplier is the FFN expansion width (FFN), the rank (LoRA-*), or the
  number of learned key/value vectors (KV), per memory-carrying layer.
- Placement (App. F): "uniform" puts m on every layer. "early"/"middle"/"late"
  or an explicit layer list keep the *same parameter budget* as uniform
  (`preserve_total=True`, the App. F protocol) by widening the chosen layers to
  m·L/k in total, remainder spread over the first layers; with
  `preserve_total=False` every chosen layer gets exactly m.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

MemoryType = Literal["ffn", "lora-qk", "lora-ov", "lora-ffn", "kv"]
MEMORY_TYPES: tuple[str, ...] = ("ffn", "lora-qk", "lora-ov", "lora-ffn", "kv")
Placement = Literal["uniform", "early", "middle", "late", "explicit"]
PLACEMENTS: tuple[str, ...] = ("uniform", "early", "middle", "late", "explicit")

# Bytes per stored element. int8/int4 also carry one fp32 scale per group.
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5}
DTYPES: tuple[str, ...] = tuple(DTYPE_BYTES)
QUANT_GROUP = 128  # elements per quantisation scale (int8/int4)
SCALE_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class AnchorShape:
    """A decoder-only transformer's shape, enough to count its parameters.

    `qk_norm`: "full" = OpenLM gain-only norms over heads·head_dim on q and on k;
    "head" = per-head norms of size head_dim (Gemma 3); "none".
    `norms_per_block`: gain-only norms in a block besides q/k norms (2 for
    pre-attention + pre-FFN; Gemma 3 has 4).
    """

    name: str = "custom"
    n_layers: int
    d_model: int
    n_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int = 50_432
    n_kv_heads: int | None = None
    tied_embeddings: bool = True
    qk_norm: Literal["full", "head", "none"] = "full"
    norms_per_block: int = 2
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        for k in ("n_layers", "d_model", "n_heads", "head_dim", "ffn_dim", "vocab_size"):
            if getattr(self, k) <= 0:
                raise ValueError(
                    f"anchor {self.name}: {k} must be positive, got {getattr(self, k)}"
                )
        if self.qk_norm not in ("full", "head", "none"):
            raise ValueError(
                f"anchor {self.name}: qk_norm {self.qk_norm!r} is not one of 'full', 'head', 'none'"
            )
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise ValueError(
                f"anchor {self.name}: n_kv_heads={self.n_kv_heads} must divide "
                f"n_heads={self.n_heads}"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def block_params(self) -> int:
        d, q, kv = self.d_model, self.q_dim, self.kv_dim
        attn = d * q + 2 * d * kv + q * d
        if self.qkv_bias:
            attn += q + 2 * kv
        qk = {"full": q + kv, "head": 2 * self.head_dim, "none": 0}[self.qk_norm]
        return attn + 3 * d * self.ffn_dim + self.norms_per_block * d + qk

    def params(self) -> int:
        embed = self.vocab_size * self.d_model * (1 if self.tied_embeddings else 2)
        return self.n_layers * self.block_params() + embed + self.d_model  # + final norm


# App. A Tables 4–6 (OpenLM) and App. A.7 Table 8 (the 410M family at other
# depths). The HF shapes are the public configs of the models in Table 2.
ANCHOR_PRESETS: dict[str, AnchorShape] = {
    "openlm-160m": AnchorShape(
        name="openlm-160m",
        n_layers=35,
        d_model=512,
        n_heads=12,
        head_dim=32,
        ffn_dim=2048,
        tied_embeddings=True,
    ),
    "openlm-410m": AnchorShape(
        name="openlm-410m",
        n_layers=24,
        d_model=1024,
        n_heads=16,
        head_dim=64,
        ffn_dim=2816,
        tied_embeddings=False,
    ),
    "openlm-1.4b": AnchorShape(
        name="openlm-1.4b",
        n_layers=24,
        d_model=2048,
        n_heads=16,
        head_dim=128,
        ffn_dim=5632,
        tied_embeddings=False,
    ),
    "gemma3-270m": AnchorShape(
        name="gemma3-270m",
        n_layers=18,
        d_model=640,
        n_heads=4,
        n_kv_heads=1,
        head_dim=256,
        ffn_dim=2048,
        vocab_size=262_144,
        tied_embeddings=True,
        qk_norm="head",
        norms_per_block=4,
    ),
    "qwen2.5-0.5b": AnchorShape(
        name="qwen2.5-0.5b",
        n_layers=24,
        d_model=896,
        n_heads=14,
        n_kv_heads=2,
        head_dim=64,
        ffn_dim=4864,
        vocab_size=151_936,
        tied_embeddings=True,
        qk_norm="none",
        qkv_bias=True,
    ),
    "llama3.2-1b": AnchorShape(
        name="llama3.2-1b",
        n_layers=16,
        d_model=2048,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        ffn_dim=8192,
        vocab_size=128_256,
        tied_embeddings=True,
        qk_norm="none",
    ),
}
# Small shapes that train on a CPU in minutes (the trainer sets vocab_size from the tokenizer).
ANCHOR_PRESETS["tiny"] = AnchorShape(
    name="tiny", n_layers=4, d_model=128, n_heads=4, head_dim=32, ffn_dim=512
)
ANCHOR_PRESETS["small"] = AnchorShape(
    name="small", n_layers=8, d_model=256, n_heads=8, head_dim=32, ffn_dim=1024
)
for _depth in (12, 17, 19, 21, 22):  # Table 8: 260M/320M/350M/370M/385M anchors
    ANCHOR_PRESETS[f"openlm-410m-l{_depth}"] = replace(
        ANCHOR_PRESETS["openlm-410m"], name=f"openlm-410m-l{_depth}", n_layers=_depth
    )


def get_anchor(name: str) -> AnchorShape:
    try:
        return ANCHOR_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown anchor preset {name!r}; known: {sorted(ANCHOR_PRESETS)}"
        ) from None


def check_memory_shape(
    multipliers: Sequence[int],
    *,
    type: str,
    placement: str,
    layers: Sequence[int],
    allow_empty: bool = False,
) -> tuple[int, ...]:
    """The one check of a memory's shape, wherever it is given (a `MemoryConfig`, or the training
    config's `memory:` section, which may be empty for a run without memory): non-negative integer
    multipliers, a known type and placement, `layers` exactly with placement "explicit". Returns
    the multipliers as a tuple; raises ValueError naming the `memory.` key."""
    if not multipliers and not allow_empty:
        raise ValueError("memory.multipliers: need one multiplier per tree level")
    if any(isinstance(m, bool) or int(m) != m or m < 0 for m in multipliers):
        raise ValueError(
            f"memory.multipliers: must be non-negative integers, got {list(multipliers)}"
        )
    if placement not in PLACEMENTS:
        raise ValueError(
            f"memory.placement: {placement!r} is not one of {', '.join(map(repr, PLACEMENTS))}"
        )
    if type not in MEMORY_TYPES:
        raise ValueError(f"memory.type: {type!r} is not one of {list(MEMORY_TYPES)}")
    if placement == "explicit" and not layers:
        raise ValueError("memory.layers: placement='explicit' needs a non-empty layer list")
    if placement != "explicit" and layers:
        raise ValueError("memory.layers: only used with placement='explicit'")
    return tuple(int(m) for m in multipliers)


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """Hierarchical memory configuration (m_1 … m_L) and where it attaches."""

    multipliers: tuple[int, ...]
    type: MemoryType = "ffn"
    placement: Placement = "uniform"
    placement_layers: int = 10  # k layers for early/middle/late (App. F uses 10)
    layers: tuple[int, ...] = ()  # for placement="explicit"
    preserve_total: bool = True
    branching: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "multipliers",
            check_memory_shape(
                self.multipliers, type=self.type, placement=self.placement, layers=self.layers
            ),
        )
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.branching < 2:
            raise ValueError(f"memory.branching: must be >= 2, got {self.branching}")

    @property
    def n_levels(self) -> int:
        return len(self.multipliers)

    def n_blocks(self, level: int) -> int:
        return self.branching**level


def parse_multipliers(text: str) -> tuple[int, ...]:
    """'256,64,16,0' or '(256, 64, 16, 0)' → (256, 64, 16, 0)."""
    parts = [p.strip() for p in text.strip().strip("()[]").split(",") if p.strip()]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"memory config {text!r}: expected comma-separated integers like 256,64,16,0"
        ) from None


def memory_layers(anchor: AnchorShape, mem: MemoryConfig) -> list[int]:
    """Indices of the anchor layers that carry memory."""
    n, k = anchor.n_layers, mem.placement_layers
    if mem.placement == "uniform":
        return list(range(n))
    if mem.placement == "explicit":
        bad = [i for i in mem.layers if not 0 <= i < n]
        if bad or len(set(mem.layers)) != len(mem.layers):
            raise ValueError(
                f"memory.layers: {list(mem.layers)} must be distinct indices in [0, {n})"
            )
        return sorted(mem.layers)
    if not 0 < k <= n:
        raise ValueError(f"memory.placement_layers: {k} must be in [1, {n}] for a {n}-layer anchor")
    start = {"early": 0, "middle": (n - k) // 2, "late": n - k}[mem.placement]
    return list(range(start, start + k))


def layer_widths(anchor: AnchorShape, mem: MemoryConfig, m: int) -> dict[int, int]:
    """Per-layer multiplier for a level whose multiplier is m: {layer: width}."""
    layers = memory_layers(anchor, mem)
    if not mem.preserve_total or m == 0:
        return {i: m for i in layers}
    total, k = m * anchor.n_layers, len(layers)
    base, extra = divmod(total, k)
    return {i: base + (1 if j < extra else 0) for j, i in enumerate(layers)}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a memory block: name and shape (all tensors are 2-D)."""

    name: str
    shape: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def _layer_tensors(anchor: AnchorShape, kind: str, w: int) -> list[tuple[str, tuple[int, int]]]:
    """Tensors of one layer's memory of width w. Rows index the memory width where
    possible, so a block's FFN rows concatenate directly onto the SwiGLU inner dim."""
    d, f, q, kv = anchor.d_model, anchor.ffn_dim, anchor.q_dim, anchor.kv_dim
    if kind == "ffn":  # SwiGLU: out = W3ᵀ(silu(W1 x) ⊙ W2 x); each (w, d)
        return [("w1", (w, d)), ("w2", (w, d)), ("w3", (w, d))]
    if kind == "lora-qk":  # ΔW = B·A; A (r, in), B (out, r)
        return [("q_a", (w, d)), ("q_b", (q, w)), ("k_a", (w, d)), ("k_b", (kv, w))]
    if kind == "lora-ov":
        return [("v_a", (w, d)), ("v_b", (kv, w)), ("o_a", (w, q)), ("o_b", (d, w))]
    if kind == "lora-ffn":
        return [
            ("w1_a", (w, d)),
            ("w1_b", (f, w)),
            ("w2_a", (w, d)),
            ("w2_b", (f, w)),
            ("w3_a", (w, f)),
            ("w3_b", (d, w)),
        ]
    if kind == "kv":  # w learned keys and values per layer, per KV head
        return [("k", (w, kv)), ("v", (w, kv))]
    raise ValueError(f"unknown memory type {kind!r}")


def block_layout(anchor: AnchorShape, mem: MemoryConfig, level: int) -> list[TensorSpec]:
    """Ordered tensors of one level-`level` block; the flat block is their concatenation."""
    m = mem.multipliers[level - 1]
    if m == 0:
        return []
    out: list[TensorSpec] = []
    for layer, w in layer_widths(anchor, mem, m).items():
        if w == 0:
            continue
        out += [
            TensorSpec(f"layers.{layer}.{n}", s) for n, s in _layer_tensors(anchor, mem.type, w)
        ]
    return out


def _is_torch(x: Any) -> bool:
    # torch is never imported here (memtree stays light); a torch tensor means torch is loaded.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def split_block(layout: Sequence[TensorSpec], flat: Any) -> dict[str, Any]:
    """Flat block(s) (…, params) → {name: (…, *shape)} views, in layout order.

    `flat` is a torch tensor or a numpy array; the parts are views of it, so
    gradients flow back to a torch `flat`. The inverse of `join_block`.
    """
    numels = [t.numel for t in layout]
    lead = tuple(flat.shape[:-1])
    if _is_torch(flat):
        parts = flat.split(numels, dim=-1)  # one call: cheaper than slicing per tensor
        return {
            t.name: p.view(*lead, *t.shape) if p.is_contiguous() else p.reshape(*lead, *t.shape)
            for t, p in zip(layout, parts, strict=True)
        }
    if sum(numels) != flat.shape[-1]:
        raise ValueError(f"block has {flat.shape[-1]} values, the layout needs {sum(numels)}")
    out, off = {}, 0
    for t, n in zip(layout, numels, strict=True):
        out[t.name] = flat[..., off : off + n].reshape(*lead, *t.shape)
        off += n
    return out


def join_block(layout: Sequence[TensorSpec], tensors: Mapping[str, Any]) -> Any:
    """{name: (…, *shape)} → flat block(s) (…, params): each tensor row-major, in layout order.

    Torch tensors or numpy arrays (not mixed); the inverse of `split_block`.
    """
    if not layout:
        raise ValueError("empty layout: a level without memory has no block")
    missing = [t.name for t in layout if t.name not in tensors]
    if missing:
        raise ValueError(f"tensors missing from the block: {missing[:5]}")
    first = tensors[layout[0].name]
    lead = tuple(first.shape[: first.ndim - len(layout[0].shape)])
    parts = [tensors[t.name].reshape(*lead, t.numel) for t in layout]
    if _is_torch(first):
        return sys.modules["torch"].cat(parts, dim=-1)
    return sys.modules["numpy"].concatenate(parts, axis=-1)  # a numpy array: numpy is loaded


def stored_bytes(n_params: int, dtype: str) -> int:
    """Bytes to store n_params elements in dtype, including quantisation scales."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPES)}")
    if dtype in ("int8", "int4"):
        groups = math.ceil(n_params / QUANT_GROUP)
        payload = n_params if dtype == "int8" else math.ceil(n_params / 2)
        return payload + groups * SCALE_BYTES
    return int(n_params * DTYPE_BYTES[dtype])


@dataclass(frozen=True)
class LevelPlan:
    level: int
    multiplier: int
    n_blocks: int
    block_params: int

    @property
    def bank_params(self) -> int:
        return self.n_blocks * self.block_params


@dataclass(frozen=True)
class Plan:
    """Accounting for an anchor + memory configuration."""

    anchor: AnchorShape
    memory: MemoryConfig
    anchor_params: int
    levels: tuple[LevelPlan, ...]
    memory_layers: tuple[int, ...] = field(default=())

    @property
    def fetch_params(self) -> int:
        return sum(lv.block_params for lv in self.levels)

    @property
    def bank_params(self) -> int:
        return sum(lv.bank_params for lv in self.levels)

    @property
    def runtime_params(self) -> int:
        return self.anchor_params + self.fetch_params

    def fetch_bytes(self, dtype: str) -> int:
        return sum(stored_bytes(lv.block_params, dtype) for lv in self.levels)

    def bank_bytes(self, dtype: str) -> int:
        return sum(lv.n_blocks * stored_bytes(lv.block_params, dtype) for lv in self.levels)

    def to_dict(self) -> dict:
        return {
            "anchor": self.anchor.name,
            "memory": {
                "multipliers": list(self.memory.multipliers),
                "type": self.memory.type,
                "placement": self.memory.placement,
                "branching": self.memory.branching,
            },
            "memory_layers": list(self.memory_layers),
            "anchor_params": self.anchor_params,
            "fetch_params": self.fetch_params,
            "bank_params": self.bank_params,
            "runtime_params": self.runtime_params,
            "levels": [
                {
                    "level": lv.level,
                    "multiplier": lv.multiplier,
                    "n_blocks": lv.n_blocks,
                    "block_params": lv.block_params,
                    "bank_params": lv.bank_params,
                }
                for lv in self.levels
            ],
            "bytes": {
                dt: {"fetch": self.fetch_bytes(dt), "bank": self.bank_bytes(dt)} for dt in DTYPES
            },
        }


def plan(anchor: AnchorShape | str, memory: MemoryConfig | tuple[int, ...], **kw) -> Plan:
    """Account anchor, per-level block, fetched and bank parameters.

    `memory` may be a MemoryConfig or a multiplier tuple (then `kw` fills the
    other MemoryConfig fields, e.g. type="lora-ffn").
    """
    a = get_anchor(anchor) if isinstance(anchor, str) else anchor
    mem = (
        memory
        if isinstance(memory, MemoryConfig)
        else MemoryConfig(multipliers=tuple(memory), **kw)
    )
    levels = []
    for level, m in enumerate(mem.multipliers, start=1):
        params = sum(t.numel for t in block_layout(a, mem, level))
        levels.append(
            LevelPlan(
                level=level,
                multiplier=m,
                n_blocks=mem.n_blocks(level) if m else 0,
                block_params=params,
            )
        )
    return Plan(
        anchor=a,
        memory=mem,
        anchor_params=a.params(),
        levels=tuple(levels),
        memory_layers=tuple(memory_layers(a, mem)),
    )


def human(n: float, unit: str = "") -> str:
    """Paper-style rounding: 4,624,220,160 → '4.6B', 18,063,360 → '18.1M'."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}{unit}"
    return f"{n:g}{unit}"


def human_bytes(n: float) -> str:
    """Decimal units, as the paper's Table 3 ('9 GB' for 4.6B bf16 parameters)."""
    for div, suffix in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= div:
            return f"{n / div:.1f} {suffix}"
    return f"{int(n)} B"


def format_plan(p: Plan) -> str:
    """The table `memtree memstore plan` prints."""
    mem = p.memory
    lines = [
        (
            f"anchor   {p.anchor.name}: {p.anchor.n_layers} layers, d={p.anchor.d_model}, "
            f"{p.anchor.n_heads}×{p.anchor.head_dim} heads, ffn={p.anchor.ffn_dim}"
        ),
        (
            f"memory   type={mem.type} config=({','.join(map(str, mem.multipliers))}) "
            f"branching={mem.branching} placement={mem.placement} "
            f"layers={len(p.memory_layers)}/{p.anchor.n_layers}"
        ),
        "",
        f"{'level':>5} {'m':>6} {'blocks':>10} {'params/block':>14} {'bank params':>16}",
    ]
    for lv in p.levels:
        lines.append(
            f"{lv.level:>5} {lv.multiplier:>6} {lv.n_blocks:>10,} {lv.block_params:>14,} "
            f"{lv.bank_params:>16,}"
        )
    lines += [
        "",
        f"anchor params   {p.anchor_params:>16,}  ({human(p.anchor_params)})",
        # Table 2 sizes post-hoc memories by this share (≈ 10 % of the anchor, App. A.6)
        (
            f"fetched params  {p.fetch_params:>16,}  ({human(p.fetch_params)}, "
            f"{100 * p.fetch_params / p.anchor_params:.1f} % of the anchor)"
        ),
        f"bank params     {p.bank_params:>16,}  ({human(p.bank_params)})",
        f"runtime params  {p.runtime_params:>16,}  ({human(p.runtime_params)})  = anchor + fetched",
        "",
        f"{'dtype':>6} {'fetch bytes':>16} {'bank bytes':>20}",
    ]
    for dt in DTYPES:
        lines.append(
            f"{dt:>6} {p.fetch_bytes(dt):>16,} {p.bank_bytes(dt):>20,}  "
            f"({human_bytes(p.fetch_bytes(dt))} / {human_bytes(p.bank_bytes(dt))})"
        )
    return "\n".join(lines)
