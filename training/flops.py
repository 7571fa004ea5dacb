"""Analytic FLOPs of an anchor with Mixture-of-Chapters layers, by seed 000 App. A.2's rules.

Counting rules (App. A.2): a linear layer costs 2·N·d_in·d_out; attention
matmuls (QKᵀ and AV together) 4·B·L_q·L_k·d; softmax 5 FLOPs per score plus 2
for masking and scaling; RMSNorm N·(4d + 4); RoPE 3·L·(d_q + d_kv); the SwiGLU
activation 5 per hidden unit; a residual add 1 per element; cross-entropy 5 per
vocabulary entry for each of the L - 1 predicted tokens. A MoC layer adds the
router (mean pooling B·d·(L - 1) + B·d, the linear layer over all C chapters,
softmax, top-k at ⌈log₂ k⌉ per chapter), the router's auxiliary-loss terms,
memory preprocessing (chapter weighting and RMSNorm of every selected memory
token), memory cross-attention over N_sel = (n_shared + k)·T tokens, an extra
RMSNorm and an extra residual; variation 2 also a second FFN with its norm and
residual. The backward pass is 2× the forward.

What the counts describe: the seed's per-sequence accounting, which projects
each sequence's N_sel memory tokens. `training/layers/moc.py` projects the batch's
unique chapters once, so with B > 1 it does at most this much memory work.
Backbone norms are counted as RMSNorm and q/k norms not at all, as in the seed
(AnchorLM's gain-only LayerNorms and OpenLM q/k norms cost slightly more).

The router auxiliary-loss count is the seed's (331,859 for one sequence and
4,097 chapters), which covers the load-balance loss, a squared-probability
balance term, the z-loss and the router entropy; App. A.2 prints only the
total, and the split into terms in `router_aux` follows the reference
estimator the seed names (scripts/estimate_flops.py). The model's own
auxiliary losses (load balance and z-loss) are a subset of it.

Low-rank memory, which the seed does not count: "factorized" adds
2·B·N_sel·r·d to expand the selected tokens; "reduced" runs the memory
attention at width r (W_Q d→r, W_K/W_V r→kv, W_O r→d).

Fine-tuning conditions (seed 004 §7.3, `finetune_accounting`): trainable parameters, bytes of
the memory bank and forward FLOPs per token of full fine-tuning, LoRA (unmerged while it trains:
2·r·(d_in + d_out) per token and adapted matrix; merged, it costs nothing at inference), memory
adapters (their MoC layers as counted above) and both together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from memtree.geometry import AnchorShape
from memtree.training.layers.moc import MoCConfig, bank_bytes
from memtree.training.layers.pkm import PKMConfig

SOFTMAX = 5  # FLOPs per softmax score (exp, sum, divide, max, subtract)
MASK_SCALE = 2  # masking and scaling per attention score
SWIGLU = 5  # SiLU (4) and the gate product (1) per hidden unit


def linear(n: int, d_in: int, d_out: int) -> int:
    return 2 * n * d_in * d_out


def attn_matmuls(batch: int, lq: int, lk: int, d: int) -> int:
    """QKᵀ and AV together."""
    return 4 * batch * lq * lk * d


def attn_elementwise(batch: int, heads: int, lq: int, lk: int) -> int:
    return batch * heads * lq * lk * (SOFTMAX + MASK_SCALE)


def rms_norm(n: int, d: int) -> int:
    return n * (4 * d + 4)


def router_aux(samples: int, chapters: int, top_k: int) -> int:
    """FLOPs of the router's auxiliary losses over `samples` routed sequences."""
    s, c, k = samples, chapters, max(top_k, 1)
    reduce_s = c * max(s - 1, 0)  # summing a (S, C) tensor over S
    selection_freq = s * c * (k - 1) + reduce_s + c
    mean_prob = reduce_s + c
    load_balance = c + (c - 1) + 1
    sq_prob_mean = s * c + reduce_s + c
    sq_prob_mse = c + c + (c - 1) + 1
    z_logsumexp = s * SOFTMAX * c
    z_square_mean = s + max(s - 1, 0) + 1
    entropy = s * c * 4
    return (
        selection_freq
        + mean_prob
        + load_balance
        + sq_prob_mean
        + sq_prob_mse
        + z_logsumexp
        + z_square_mean
        + entropy
    )


def _ffn(anchor: AnchorShape, tokens: int) -> dict[str, int]:
    d, f = anchor.d_model, anchor.ffn_dim
    up, gate, down = linear(tokens, d, f), linear(tokens, d, f), linear(tokens, f, d)
    act = tokens * f * SWIGLU
    return {"up": up, "gate": gate, "down": down, "swiglu": act, "total": up + gate + down + act}


def standard_layer(anchor: AnchorShape, *, seq_len: int, batch: int = 1) -> dict[str, int]:
    """One transformer block: self-attention, RoPE, two norms, SwiGLU FFN, two residual adds."""
    n, d = batch * seq_len, anchor.d_model
    q, k, v = linear(n, d, anchor.q_dim), linear(n, d, anchor.kv_dim), linear(n, d, anchor.kv_dim)
    o = linear(n, anchor.q_dim, d)
    matmuls = attn_matmuls(batch, seq_len, seq_len, anchor.q_dim)
    softmax = attn_elementwise(batch, anchor.n_heads, seq_len, seq_len)
    out = {
        "q": q,
        "k": k,
        "v": v,
        "o": o,
        "attn_matmuls": matmuls,
        "attn_softmax": softmax,
        "self_attn": q + k + v + o + matmuls + softmax,
        "rope": 3 * n * (anchor.q_dim + anchor.kv_dim),
        "norms": 2 * rms_norm(n, d),
        "mlp": _ffn(anchor, n)["total"],
        "residual": 2 * n * d,
    }
    out["total"] = out["self_attn"] + out["rope"] + out["norms"] + out["mlp"] + out["residual"]
    return out


def moc_layer(
    anchor: AnchorShape, moc: MoCConfig, *, seq_len: int, batch: int = 1
) -> dict[str, int]:
    """A block with a MoC memory layer: the standard block (`standard`) plus what memory adds
    (`extra`)."""
    g = moc.geometry(d_model=anchor.d_model, n_layers=anchor.n_layers, anchor_heads=anchor.n_heads)
    n, d, C, k = batch * seq_len, anchor.d_model, moc.n_chapters, moc.top_k
    n_sel = moc.n_selected * moc.tokens_per_chapter  # memory tokens per sequence
    m = batch * n_sel  # memory tokens the layer projects
    out = {"standard": standard_layer(anchor, seq_len=seq_len, batch=batch)["total"]}
    out["pooling"] = batch * d * (seq_len - 1) + batch * d
    out["router_linear"] = linear(batch, d, C)
    out["router_softmax"] = batch * C * SOFTMAX
    out["top_k"] = batch * C * max(1, math.ceil(math.log2(k)))
    out["router"] = out["pooling"] + out["router_linear"] + out["router_softmax"] + out["top_k"]
    out["router_aux"] = router_aux(batch, C, k)
    out["weighting"] = m * g.mem_dim
    out["memory_norm"] = rms_norm(m, g.mem_dim) if moc.memory_norm else 0
    out["expand"] = linear(m, moc.rank, d) if moc.low_rank == "factorized" else 0
    out["memory_preprocess"] = out["weighting"] + out["memory_norm"] + out["expand"]
    out["mem_q"] = linear(n, d, g.q_dim)
    out["mem_k"] = linear(m, g.mem_dim, g.kv_dim)
    out["mem_v"] = linear(m, g.mem_dim, g.kv_dim)
    out["mem_o"] = linear(n, g.q_dim, d)
    out["mem_attn_matmuls"] = attn_matmuls(batch, seq_len, n_sel, g.q_dim)
    out["mem_attn_softmax"] = attn_elementwise(batch, g.n_heads, seq_len, n_sel)
    out["memory_attn"] = sum(
        out[key]
        for key in ("mem_q", "mem_k", "mem_v", "mem_o", "mem_attn_matmuls", "mem_attn_softmax")
    )
    out["extra_norm"] = rms_norm(n, d)
    out["extra_residual"] = n * d
    out["second_mlp"] = (
        rms_norm(n, d) + _ffn(anchor, n)["total"] + n * d if moc.variation == 2 else 0
    )
    out["extra"] = sum(
        out[key]
        for key in (
            "router",
            "router_aux",
            "memory_preprocess",
            "memory_attn",
            "extra_norm",
            "extra_residual",
            "second_mlp",
        )
    )
    out["total"] = out["standard"] + out["extra"]
    return out


def head(anchor: AnchorShape, *, seq_len: int, batch: int = 1) -> dict[str, int]:
    """Final norm, LM head and cross-entropy."""
    n = batch * seq_len
    out = {
        "final_norm": rms_norm(n, anchor.d_model),
        "lm_head": linear(n, anchor.d_model, anchor.vocab_size),
        "ce_loss": batch * (seq_len - 1) * anchor.vocab_size * SOFTMAX,
    }
    out["total"] = out["final_norm"] + out["lm_head"] + out["ce_loss"]
    return out


@dataclass(frozen=True, kw_only=True)
class ModelFlops:
    layers: tuple[int, ...]  # forward FLOPs per block
    memory_attn: tuple[int, ...]  # per block: memory attention except W_O (0 without memory)
    head: int
    forward: int

    @property
    def backward(self) -> int:
        return 2 * self.forward

    @property
    def forward_backward(self) -> int:
        return 3 * self.forward

    def training(self, *, checkpointing: bool = False, memory_recompute: bool = False) -> int:
        """Forward + backward + recomputation: `checkpointing` re-runs every block's forward
        (Table 6: gradient checkpointing); `memory_recompute` also re-runs each memory attention
        before its output projection (the reference estimator's checkpointed memory attention)."""
        total = self.forward_backward
        if checkpointing:
            total += sum(self.layers)
        if memory_recompute:
            total += sum(self.memory_attn)
        return total


def pkm_block(
    anchor: AnchorShape, pkm: PKMConfig, *, seq_len: int, batch: int = 1
) -> dict[str, int]:
    """A block whose FFN a product-key memory layer replaces (seed 003 §3): the standard block
    with its SwiGLU MLP swapped for the memory lookup (`PKMConfig.flops`)."""
    out = standard_layer(anchor, seq_len=seq_len, batch=batch)
    out["memory_lookup"] = pkm.flops(anchor.d_model, batch * seq_len)
    out["total"] = out["total"] - out["mlp"] + out["memory_lookup"]
    out["mlp"] = 0
    return out


def ffn_memory(anchor: AnchorShape, widths: dict[int, int], *, tokens: int) -> int:
    """Forward FLOPs that hierarchical FFN memories add over `tokens` tokens: per layer,
    `widths[layer]` hidden units (all fetched blocks together) appended to the SwiGLU, so the same
    up, gate, down and activation counts as widening the FFN by that much (`_ffn`)."""
    d = anchor.d_model
    return sum(
        2 * linear(tokens, d, w) + linear(tokens, w, d) + tokens * w * SWIGLU
        for w in widths.values()
    )


def pkm_params(anchor: AnchorShape, pkm: PKMConfig) -> int:
    """Parameters of the anchor with its chosen FFNs replaced by memory layers."""
    ffn = 3 * anchor.d_model * anchor.ffn_dim
    n = len(pkm.resolved_layers(anchor.n_layers))
    return anchor.params() - n * ffn + n * pkm.params(anchor.d_model)


def model_flops(
    anchor: AnchorShape,
    moc: MoCConfig | None = None,
    *,
    seq_len: int,
    batch: int = 1,
    pkm: PKMConfig | None = None,
) -> ModelFlops:
    std = standard_layer(anchor, seq_len=seq_len, batch=batch)["total"]
    mem = moc_layer(anchor, moc, seq_len=seq_len, batch=batch) if moc is not None else None
    pk = pkm_block(anchor, pkm, seq_len=seq_len, batch=batch)["total"] if pkm is not None else None
    pk_layers = pkm.resolved_layers(anchor.n_layers) if pkm is not None else ()
    layers, attn = [], []
    for i in range(anchor.n_layers):
        has = mem is not None and i in moc.layers
        layers.append(mem["total"] if has else pk if i in pk_layers else std)
        attn.append(mem["memory_attn"] - mem["mem_o"] if has else 0)
    h = head(anchor, seq_len=seq_len, batch=batch)["total"]
    return ModelFlops(
        layers=tuple(layers), memory_attn=tuple(attn), head=h, forward=sum(layers) + h
    )


def iso_flop_depth(
    anchor: AnchorShape,
    moc: MoCConfig,
    *,
    seq_len: int,
    batch: int = 1,
    checkpointing: bool = False,
    memory_recompute: bool = False,
) -> int:
    """Depth of the dense baseline (the anchor's blocks repeated, no memory) whose training FLOPs
    first reach the MoC model's: the smallest n with dense(n) ≥ MoC."""
    target = model_flops(anchor, moc, seq_len=seq_len, batch=batch).training(
        checkpointing=checkpointing, memory_recompute=memory_recompute
    )
    n = 1
    while (
        model_flops(replace(anchor, n_layers=n), seq_len=seq_len, batch=batch).training(
            checkpointing=checkpointing
        )
        < target
    ):
        n += 1
    return n


# -- fine-tuning conditions (seed 004 §7.3) --------------------------------------------------------

LORA_MATRICES = {"attention": ("q", "k", "v", "o"), "all": ("q", "k", "v", "o", "w1", "w2", "w3")}


def _matrix_shapes(anchor: AnchorShape) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each projection of a block."""
    d, f = anchor.d_model, anchor.ffn_dim
    return {
        "q": (d, anchor.q_dim),
        "k": (d, anchor.kv_dim),
        "v": (d, anchor.kv_dim),
        "o": (anchor.q_dim, d),
        "w1": (d, f),
        "w2": (d, f),
        "w3": (f, d),
    }


def lora_params(anchor: AnchorShape, rank: int, targets: str = "all") -> int:
    """A (r, d_in) and B (d_out, r) on every targeted matrix of every block."""
    shapes = _matrix_shapes(anchor)
    return anchor.n_layers * sum(rank * sum(shapes[m]) for m in LORA_MATRICES[targets])


def lora_flops_per_token(anchor: AnchorShape, rank: int, targets: str = "all") -> int:
    """Forward FLOPs an unmerged adapter adds per token: x·Aᵀ, then ·Bᵀ, then the add."""
    shapes = _matrix_shapes(anchor)
    return anchor.n_layers * sum(
        linear(1, i, rank) + linear(1, rank, o) + o
        for i, o in (shapes[m] for m in LORA_MATRICES[targets])
    )


def moc_params(anchor: AnchorShape, moc: MoCConfig) -> dict[str, int]:
    """Parameters of MoC memory layers by the groups seed 004 §6.1 treats apart: "bank" (latent
    tables, a factorised bank's up-projection), "kv" (W_K, W_V) and "layers" (router, W_Q, W_O,
    the pre-norm gain, variation 2's MLP and its norm), as `training/layers/moc.py` builds them."""
    g = moc.geometry(d_model=anchor.d_model, n_layers=anchor.n_layers, anchor_heads=anchor.n_heads)
    d, n = anchor.d_model, len(moc.layers)
    per_bank = moc.n_chapters * moc.tokens_per_chapter * g.stored_dim
    per_bank += moc.rank * d if moc.low_rank == "factorized" else 0
    layer = d * moc.n_chapters + moc.n_chapters + d * g.q_dim + g.q_dim * d + d
    layer += 3 * d * anchor.ffn_dim + d if moc.variation == 2 else 0
    return {
        "bank": per_bank * (1 if moc.shared_bank else n),
        "kv": n * 2 * g.mem_dim * g.kv_dim,
        "layers": n * layer,
    }


def finetune_accounting(
    anchor: AnchorShape,
    method: str,
    *,
    seq_len: int,
    lora_rank: int = 0,
    lora_targets: str = "all",
    moc: MoCConfig | None = None,
    train_bank: bool = True,
    train_kv: bool = True,
) -> dict[str, int]:
    """What a fine-tuning condition trains and costs: trainable parameters, bytes of the memory
    bank as stored, forward FLOPs per token while training (unmerged LoRA) and at inference
    (LoRA merged). method: full | lora | mem_adapter | mem_adapter+lora
    (`training/finetune/continual.py`)."""
    base = model_flops(anchor, seq_len=seq_len).forward
    out = {"trainable_params": 0, "bank_bytes": 0, "base_flops_per_token": base // seq_len}
    train_fwd = infer_fwd = base
    if method == "full":
        out["trainable_params"] = anchor.params()
    if method in ("lora", "mem_adapter+lora"):
        out["trainable_params"] += lora_params(anchor, lora_rank, lora_targets)
        train_fwd += seq_len * lora_flops_per_token(anchor, lora_rank, lora_targets)
    if method.startswith("mem_adapter"):
        if moc is None:
            raise ValueError(f"method {method} needs the adapters' MoCConfig")
        p = moc_params(anchor, moc)
        out["trainable_params"] += (
            p["layers"] + (p["kv"] if train_kv else 0) + (p["bank"] if train_bank else 0)
        )
        out["adapter_params"] = sum(p.values())
        out["bank_bytes"] = bank_bytes(moc, anchor.d_model)
        extra = model_flops(anchor, moc, seq_len=seq_len).forward - base
        train_fwd += extra
        infer_fwd += extra
    out["train_flops_per_token"] = train_fwd // seq_len
    out["inference_flops_per_token"] = infer_fwd // seq_len
    return out
