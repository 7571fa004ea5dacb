"""Memory adapters: Mixture-of-Chapters memory cross-attention added to a pretrained model
(seed 004 §6.1, §7.3–7.4).

An adapter is the MoC memory layer of `training/layers/moc.py` (router, top-k chapters of a latent
bank, cross-attention from the hidden states) inserted into chosen blocks of a model that was
trained without it, for fine-tuning on knowledge the model lacks. Its output projection W_O
starts at zero (and, with variation 2, so does the second MLP's down projection), so at
attachment the adapted model computes exactly the base model's logits; only training moves it.

`AdapterSpec` is the user-facing configuration (the `adapter:` block of a finetune spec):
- layers: which blocks get one, "all", "every:N" (every N-th block: N-1, 2N-1, …),
  "first:K", "last:K", or a comma list of 0-based indices ("0,3") (§2.3 "selective layers");
- variation 1 (Self-Attn → MemXAttn → MLP) or 2 (Self-Attn → MLP → MemXAttn → MLP) (§2.3);
- shared_bank: one bank read by every adapter layer, or one per layer (§3.1);
- bank_dtype: fp32 | bf16 | int8 | int4, the bank read as its stored values (§5.2, `moc.quantise`);
- low_rank: "factorized" (§7.4 option 1: full-d projections, the bank stored as A·B, A (C·T, r),
  B (r, d)) or "reduced" (option 2: projections to r and an r-dimensional bank);
- bank_lr_factor and freeze_kv: the §6.1 protections of a pretrained bank (bank learning rate a
  factor below the rest; 0 freezes it; optionally W_K, W_V frozen as well).

Two hosts: memtree's own `AnchorLM` (`attach_to_anchor`, in place; its blocks already run MoC
layers, so the adapter is exactly a MoC layer there) and Hugging Face causal LMs
(`training/finetune/hf_adapters.py`, by forward hooks). Both resolve the spec against the model with
`AdapterSpec.moc_config`, whose errors name the field and the model's value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtree.config import ConfigError, is_int
from memtree.training.layers.moc import BANK_DTYPES, MoCConfig, MoCLayer, bank_bytes, build_banks
from memtree.training.model import FeedForward, gain_norm


@dataclass(frozen=True, kw_only=True)
class AdapterSpec:
    """Memory adapter configuration (see the module docstring). n_heads / n_kv_heads 0: the
    model's attention heads; rank 0: none (required > 0 with low_rank)."""

    layers: str = "all"
    variation: int = 1
    shared_bank: bool = True
    n_chapters: int = 16
    tokens_per_chapter: int = 32
    top_k: int = 2
    n_shared: int = 1
    n_heads: int = 0
    n_kv_heads: int = 0
    low_rank: str = "none"
    rank: int = 0
    bank_dtype: str = "fp32"
    bank_lr_factor: float = 1.0
    freeze_kv: bool = False
    routed_scaling: float = 2.5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        checks = (
            (
                "layers",
                isinstance(self.layers, str) and self.layers.strip() != "",
                "all, every:N, first:K, last:K or a comma list of block indices",
            ),
            ("variation", self.variation in (1, 2), "1 or 2"),
            ("n_chapters", is_int(self.n_chapters) and self.n_chapters > 1, "an integer > 1"),
            (
                "tokens_per_chapter",
                is_int(self.tokens_per_chapter) and self.tokens_per_chapter > 0,
                "positive",
            ),
            (
                "n_shared",
                is_int(self.n_shared) and 0 <= self.n_shared < self.n_chapters,
                "in [0, n_chapters)",
            ),
            (
                "top_k",
                is_int(self.top_k) and 0 < self.top_k <= self.n_chapters - self.n_shared,
                f"in [1, n_chapters - n_shared = {self.n_chapters - self.n_shared}]",
            ),
            ("n_heads", is_int(self.n_heads) and self.n_heads >= 0, ">= 0 (0: the model's)"),
            ("n_kv_heads", is_int(self.n_kv_heads) and self.n_kv_heads >= 0, ">= 0 (0: n_heads)"),
            (
                "low_rank",
                self.low_rank in ("none", "factorized", "reduced"),
                "none, factorized or reduced",
            ),
            (
                "rank",
                is_int(self.rank) and (self.rank > 0) == (self.low_rank != "none"),
                "> 0 with low_rank factorized / reduced, 0 without",
            ),
            ("bank_dtype", self.bank_dtype in BANK_DTYPES, f"one of {tuple(BANK_DTYPES)}"),
            (
                "bank_lr_factor",
                isinstance(self.bank_lr_factor, int | float) and self.bank_lr_factor >= 0,
                ">= 0 (0 freezes the bank)",
            ),
            (
                "routed_scaling",
                isinstance(self.routed_scaling, int | float) and self.routed_scaling > 0,
                "positive",
            ),
            ("init_std", isinstance(self.init_std, int | float) and self.init_std > 0, "positive"),
        )
        for name, ok, want in checks:
            if not ok:
                raise ConfigError(f"adapter.{name}={getattr(self, name)!r}: must be {want}")

    def resolve_layers(self, n_layers: int) -> tuple[int, ...]:
        """The 0-based blocks that get an adapter on a model of n_layers blocks."""
        sel = self.layers.strip()
        kind, _, arg = sel.partition(":")
        if sel == "all":
            return tuple(range(n_layers))
        if kind in ("every", "first", "last"):
            if not arg.strip().isdigit() or int(arg) <= 0:
                raise ConfigError(f"adapter.layers={sel!r}: {kind}: needs a positive integer")
            k = int(arg)
            if k > n_layers:
                raise ConfigError(f"adapter.layers={sel!r}: the model has {n_layers} layers")
            if kind == "every":
                return tuple(range(k - 1, n_layers, k))
            return tuple(range(k)) if kind == "first" else tuple(range(n_layers - k, n_layers))
        try:
            ids = tuple(int(x) for x in sel.split(","))
        except ValueError:
            raise ConfigError(
                f"adapter.layers={sel!r}: must be all, every:N, first:K, last:K or a comma "
                "list of block indices"
            ) from None
        bad = [i for i in ids if not 0 <= i < n_layers]
        if bad:
            raise ConfigError(
                f"adapter.layers={sel!r}: block(s) {bad} out of range; the model has "
                f"{n_layers} layers (0..{n_layers - 1})"
            )
        if len(set(ids)) != len(ids):
            raise ConfigError(f"adapter.layers={sel!r}: a block is listed twice")
        return tuple(sorted(ids))

    def moc_config(self, *, n_layers: int, d_model: int, n_heads: int) -> MoCConfig:
        """The MoC layer configuration on a model of this shape; a spec the model cannot hold is
        an error naming the field and the model's value."""
        layers = self.resolve_layers(n_layers)
        heads = self.n_heads or n_heads
        kv = self.n_kv_heads or heads
        if self.rank > d_model:
            raise ConfigError(
                f"adapter.rank={self.rank} is larger than the model's d_model={d_model}"
            )
        width = self.rank if self.low_rank == "reduced" else d_model
        what = (
            f"adapter.rank={self.rank}"
            if self.low_rank == "reduced"
            else f"the model's d_model={d_model}"
        )
        if width % heads:
            src = (
                f"adapter.n_heads={self.n_heads}"
                if self.n_heads
                else f"the model's {n_heads} attention heads"
            )
            raise ConfigError(f"{src} does not divide the memory attention width ({what})")
        if heads % kv:
            raise ConfigError(f"adapter.n_kv_heads={kv} does not divide the {heads} memory heads")
        return MoCConfig(
            n_chapters=self.n_chapters,
            tokens_per_chapter=self.tokens_per_chapter,
            top_k=self.top_k,
            layers=layers,
            n_shared=self.n_shared,
            shared_bank=self.shared_bank,
            variation=self.variation,
            n_heads=heads,
            n_kv_heads=kv,
            routed_scaling=float(self.routed_scaling),
            init_std=float(self.init_std),
            zero_init_out=True,
            low_rank=self.low_rank,
            rank=self.rank or None,
            bank_dtype=self.bank_dtype,
        )


# -- memtree's own anchor --------------------------------------------------------------------------


def attach_to_anchor(model: nn.Module, spec: AdapterSpec, *, seed: int = 0) -> MoCConfig:
    """Insert memory adapters into an `AnchorLM` in place; returns their MoC configuration.

    The new modules are memtree's own MoC sublayers (`Block.moc`, `AnchorLM.moc_banks`), created
    on the model's device and dtype from `seed` (the global RNG is left as it was); the model's
    config gains `moc`, so a saved run reopens with its adapters. A model that already has MoC
    layers or product-key memories is refused (its memory is not an adapter's to replace)."""
    cfg = model.config
    if cfg.moc is not None or cfg.pkm is not None:
        raise ValueError(
            "the model already has a memory layer (moc / pkm); memory adapters go on a model "
            "without one (a MoC run's own memory is fine-tuned with method mem_adapter as it is)"
        )
    a = cfg.anchor
    moc = spec.moc_config(n_layers=a.n_layers, d_model=a.d_model, n_heads=a.n_heads)
    ref = next(model.parameters())
    new_cfg = dataclasses.replace(cfg, moc=moc)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in moc.layers:
            block = model.blocks[i]
            block.moc = MoCLayer(
                moc,
                d_model=a.d_model,
                n_layers=a.n_layers,
                anchor_heads=a.n_heads,
                norm_eps=cfg.norm_eps,
            ).to(ref.device, ref.dtype)
            block.moc_variation = moc.variation
            if moc.variation == 2:
                block.moc_ffn_norm = gain_norm(a.d_model, cfg.norm_eps).to(ref.device, ref.dtype)
                block.moc_ffn = FeedForward(new_cfg).to(ref.device, ref.dtype)
                for lin in (block.moc_ffn.w1, block.moc_ffn.w2):
                    nn.init.trunc_normal_(
                        lin.weight, std=spec.init_std, a=-2 * spec.init_std, b=2 * spec.init_std
                    )
                nn.init.zeros_(block.moc_ffn.w3.weight)  # the second MLP adds nothing until trained
        model.moc_banks = build_banks(moc, a.d_model).to(ref.device, ref.dtype)
    model._adapter_base_config = cfg
    model.config = new_cfg
    return moc


def detach_from_anchor(model: nn.Module) -> bool:
    """Remove adapters that `attach_to_anchor` added (the model is its base again); returns
    whether there were any."""
    base = getattr(model, "_adapter_base_config", None)
    if base is None:
        return False
    for block in model.blocks:
        if block.moc is not None:
            block.moc, block.moc_variation = None, None
            for name in ("moc_ffn_norm", "moc_ffn"):
                if hasattr(block, name):
                    delattr(block, name)
    model.moc_banks = None
    model.config = base
    del model._adapter_base_config
    return True


def adapter_groups(model: nn.Module, spec: AdapterSpec) -> dict[str, list[nn.Parameter]]:
    """An anchor's memory parameters by how §6.1 treats them: "bank" (the latent tables and a
    factorised bank's up-projection), "kv" (W_K, W_V of every memory layer) and "layers" (routers,
    W_Q, W_O, norms, variation 2's MLPs). Sets requires_grad on them: the bank only with
    bank_lr_factor > 0, kv unless freeze_kv."""
    banks, layers = model.moc_parameters()
    if not banks:
        raise ValueError("the model has no memory adapters (attach_to_anchor first)")
    kv_ids = {
        id(p) for b in model.blocks if b.moc is not None for p in (b.moc.k.weight, b.moc.v.weight)
    }
    groups = {
        "bank": banks,
        "kv": [p for p in layers if id(p) in kv_ids],
        "layers": [p for p in layers if id(p) not in kv_ids],
    }
    for p in groups["bank"]:
        p.requires_grad_(spec.bank_lr_factor > 0)
    for p in groups["kv"]:
        p.requires_grad_(not spec.freeze_kv)
    for p in groups["layers"]:
        p.requires_grad_(True)
    return groups


def adapter_summary(moc: MoCConfig, d_model: int) -> dict[str, Any]:
    """What a report says about an adapter configuration."""
    return {
        "layers": list(moc.layers),
        "variation": moc.variation,
        "shared_bank": moc.shared_bank,
        "chapters": moc.n_chapters,
        "tokens_per_chapter": moc.tokens_per_chapter,
        "top_k": moc.top_k,
        "low_rank": moc.low_rank,
        "rank": moc.rank,
        "bank_dtype": moc.bank_dtype,
        "bank_bytes": bank_bytes(moc, d_model),
    }
