"""LoRA adapters on an anchor's attention and FFN matrices: the parameter-efficient finetuning
baseline of seed 003 (Hu et al. 2021), used by `memtree train finetune`
(training/finetune/continual.py). The anchor is memtree's own `AnchorLM` or a Hugging Face causal LM
with Llama / Qwen / Gemma style decoder layers (`self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj`: the same seven matrices).

`peft` is not used: both hosts' projections are `nn.Linear`s, so a
wrapper that keeps the frozen base and adds `scale · B A x` is the whole of it, and it keeps
the dependency set small. B starts at zero (the adapted model equals the base before the first
step); A is Kaiming-uniform as in the LoRA paper. `merge_lora` folds the adapters back into
the base weights, leaving a plain anchor of the original shape (what a device ships).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from memtree.training.hf import decoder_layers

# Module names (inside each block) that LoRA targets: attention q/k/v/o and SwiGLU w1/w2/w3.
ATTENTION = ("attn.q", "attn.k", "attn.v", "attn.o")
FFN = ("ffn.w1", "ffn.w2", "ffn.w3")
# The same matrices in a Hugging Face decoder layer (gate ↔ w1, up ↔ w2, down ↔ w3, as
# training/hf.py maps them).
HF_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
HF_FFN = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / rank) · x Aᵀ Bᵀ; base frozen, A (rank, in), B (out, rank)."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float) -> None:
        super().__init__()
        if rank <= 0 or rank > min(base.in_features, base.out_features):
            raise ValueError(
                f"LoRA rank {rank} must be in [1, {min(base.in_features, base.out_features)}] "
                f"for a {base.in_features}→{base.out_features} projection"
            )
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.rank, self.scale = rank, alpha / rank
        self.lora_a = nn.Parameter(
            torch.empty(rank, base.in_features, dtype=base.weight.dtype, device=base.weight.device)
        )
        self.lora_b = nn.Parameter(
            torch.zeros(base.out_features, rank, dtype=base.weight.dtype, device=base.weight.device)
        )
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.scale * ((x @ self.lora_a.mT) @ self.lora_b.mT)

    def merged(self) -> nn.Linear:
        """The base projection with the adapter folded in (W + scale · B A)."""
        with torch.no_grad():
            self.base.weight += self.scale * (self.lora_b @ self.lora_a)
        return self.base


def _blocks(
    model: nn.Module,
) -> tuple[list[tuple[str, nn.Module]], tuple[str, ...], tuple[str, ...]]:
    """(name prefix, block) per block, and the block's attention and FFN matrix names: an
    `AnchorLM`'s `blocks`, else a Hugging Face model's decoder layers."""
    if hasattr(model, "blocks"):
        return [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)], ATTENTION, FFN
    return [(f"layers.{i}", b) for i, b in enumerate(decoder_layers(model))], HF_ATTENTION, HF_FFN


def add_lora(model: nn.Module, *, rank: int, alpha: float, targets: str = "all") -> list[str]:
    """Wrap the anchor's projections in LoRA adapters and freeze everything else.

    model: an `AnchorLM` (its `blocks`) or a Hugging Face causal LM (its decoder layers); targets:
    "all" (attention and FFN matrices, the seed's "all linear projections") or "attention".
    Returns the wrapped modules' names. An AnchorLM block whose FFN is a memory layer has no FFN
    matrices to wrap (its memory stays frozen); an HF layer without one of the named matrices is
    an error naming it."""
    if targets not in ("all", "attention"):
        raise ValueError(f"lora targets must be 'all' or 'attention', got {targets!r}")
    blocks, attention, ffn = _blocks(model)
    hf = not hasattr(model, "blocks")
    names = attention + (ffn if targets == "all" else ())
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for prefix, block in blocks:
        for name in names:
            parent_name, attr = name.split(".")
            parent = getattr(block, parent_name, None)
            if parent is None and not hf:  # a memory layer took this block's FFN's place
                continue
            lin = getattr(parent, attr, None)
            if lin is None:
                raise ValueError(
                    f"{prefix}.{name}: {type(block).__name__} has no such module; LoRA on a "
                    "Hugging Face model targets Llama / Qwen / Gemma style layers "
                    f"({', '.join(names)})"
                )
            if not isinstance(lin, nn.Linear):
                raise TypeError(
                    f"{prefix}.{name} is {type(lin).__name__}, not an nn.Linear (LoRA twice?)"
                )
            setattr(parent, attr, LoRALinear(lin, rank=rank, alpha=alpha))
            wrapped.append(f"{prefix}.{name}")
    if not wrapped:
        raise ValueError("no projection to put LoRA on")
    return wrapped


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base projection (in place); returns how many were merged."""
    n = 0
    for module in list(model.modules()):
        for attr, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, attr, child.merged())
                n += 1
    return n
