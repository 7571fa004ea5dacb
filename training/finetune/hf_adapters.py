"""Memory adapters on a pretrained Hugging Face causal LM (seed 004 §7.3–7.4).

The Mixture-of-Chapters memory cross-attention of `training/layers/moc.py` (router, top-k chapters
of a latent bank, cross-attention from the hidden states), added as adapters to chosen decoder
layers of an HF model that was trained without it — the HF counterpart of
`training.finetune.adapters.attach_to_anchor`. `AdapterSpec` configures it; `AdapterSpec.moc_config`
resolves it against the model's shape and its errors (`ConfigError`) name the field and the
model's value.

`HFMemAdapter` holds the HF model (`self.hf`) and the new modules (`mem_layers`, `banks` and, for
variation 2, `ffn_norms` / `ffns`) side by side. The HF module tree is not wrapped or edited:
forward hooks, registered once at construction, put the memory into the residual stream, so
`self.hf.save_pretrained` still writes a plain checkpoint and `remove_hooks()` gives back exactly
the base model. Hooks are objects, not closures, so `copy.deepcopy` of the adapter re-points the
copy's hooks at the copy's modules.

Families: Llama / Qwen2 / Qwen3 / Gemma / Mistral style pre-norm decoders (`input_layernorm`,
`self_attn`, `post_attention_layernorm` before the MLP) and post-norm ones — Gemma 2 / 3 (four
norms: `post_attention_layernorm` on the attention output, `pre_feedforward_layernorm` before the
MLP) and OLMo 2 (no input norm; `post_attention_layernorm` on the attention output). Parallel
attention/MLP blocks (no point between the two) are refused for variation 1.

Placement, as `training.model.Block.forward` places the MoC sublayer in memtree's own anchor:
- variation 1 (Self-Attn → MemXAttn → MLP): x' = x + attn_delta, x'' = x' + moc(x'). A layer
  pre-hook keeps the layer's input x; a hook on the module whose output is the attention's
  residual delta — `self_attn` (pre-norm families; element 0 of its tuple) or
  `post_attention_layernorm` (post-norm families) — returns delta + moc(x + delta), so the layer's
  own `residual + delta` is x'' and its MLP reads x''.
- variation 2 (Self-Attn → MLP → MemXAttn → MLP): a hook on the layer's output y returns
  y' + ffn(ffn_norm(y')) with y' = y + moc(y); ffn is a gated MLP (the HF MLP's activation, its
  width) whose down projection starts at zero.

At init the memory layers' W_O (and variation 2's down projection) are zero, so every hook adds an
exact zero: the logits equal the base model's bit for bit. The new modules are created from
`seed` (the global RNG is left as it was). They run in their own dtype — the HF parameters' dtype,
except that a 16-bit model gets fp32 adapters: `MoCLayer` routes in fp32 and needs fp32 router
weights, and trainable fp32 adapters on a frozen half-precision base is the usual mixed-precision
practice; hidden states are cast in and the updates cast back.

Caveats: routing is per sequence over every position of the call (padding included, as memtree's
own MoC pools the whole row), so incremental decoding with a KV cache routes each step on its new
tokens only and differs from a full recompute. HF gradient checkpointing works (its recomputation
re-runs the hooks); with its reentrant variant (HF's default) and a frozen base nothing entering
the checkpointed layers requires grad and backward fails, so call `hf.enable_input_require_grads()`
first, as for PEFT adapters, or pass `gradient_checkpointing_kwargs={"use_reentrant": False}`.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Any

import torch
from torch import Tensor, nn

from memtree.training.finetune.adapters import AdapterSpec
from memtree.training.hf import (
    anchor_shape_from_hf,
    decoder_config,
    decoder_layers,
    load_hf_causal_lm,
)
from memtree.training.hooks import LayerHook, first_tensor
from memtree.training.layers.moc import MoCLayer, bank_for, build_banks, mean_aux_loss


class _GatedMLP(nn.Module):
    """down(act(gate(x)) ⊙ up(x)): variation 2's second MLP, in HF naming."""

    def __init__(self, d_model: int, ffn_dim: int, act: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)
        self.act_fn = act

    def forward(self, x: Tensor) -> Tensor:  # (B, S, d) → (B, S, d)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Captured(threading.local):
    """Variation 1: each layer's input, from its pre-hook until its attention-delta hook, per
    thread (concurrent forwards do not see each other's). Copies / pickles start empty."""

    def __init__(self) -> None:
        self.inputs: dict[int, Tensor] = {}

    def __reduce__(self):
        return (_Captured, ())


class _CaptureInput(LayerHook):
    """Decoder-layer pre-hook: keep x, the residual stream entering the layer."""

    def __call__(self, module, args, kwargs):
        self.owner._captured.inputs[self.layer] = first_tensor(args, kwargs)  # (B, S, d)


class _AttnDeltaHook(LayerHook):
    """On the attention's residual delta: delta + moc(x + delta), so the layer's own residual add
    yields x' + moc(x'). The layer computes x + delta itself, in the same order, so x' here is
    bitwise the stream the layer would continue with."""

    def __call__(self, module, args, out):
        x = self.owner._captured.inputs.pop(self.layer, None)
        if x is None:
            raise RuntimeError(
                f"memory adapter, layer {self.layer}: the attention delta arrived without "
                "the layer's input (was the module called outside its decoder layer?)"
            )
        delta = out[0] if isinstance(out, tuple) else out  # (B, S, d)
        delta = delta + self.owner._read(self.layer, x + delta)
        return (delta, *out[1:]) if isinstance(out, tuple) else delta


class _LayerOutputHook(LayerHook):
    """Variation 2, on the decoder layer's output (a tensor, or a tuple led by it)."""

    def __call__(self, module, args, out):
        y = out[0] if isinstance(out, tuple) else out  # (B, S, d)
        y = self.owner._variation2(self.layer, y)
        return (y, *out[1:]) if isinstance(out, tuple) else y


def _post_norm(layer: nn.Module) -> bool:
    """Whether the attention output is normalised before the residual add (Gemma 2/3: a separate
    pre-MLP norm; OLMo 2: no input norm), making `post_attention_layernorm` its last module."""
    return hasattr(layer, "pre_feedforward_layernorm") or not hasattr(layer, "input_layernorm")


class HFMemAdapter(nn.Module):
    """An HF causal LM with Mixture-of-Chapters memory adapters (see the module docstring).

    model: a loaded HF causal LM, or a local directory to load it from (`dtype`,
    `attn_implementation` apply then). spec: the adapter configuration. seed: the new modules'
    init. adapter_dtype: the new modules' dtype; None: the HF parameters' dtype, fp32 for a
    16-bit model. freeze_base: HF parameters get requires_grad False. The spec's freezes apply to
    the adapter: the bank is trainable only with bank_lr_factor > 0, W_K / W_V unless freeze_kv.
    """

    def __init__(
        self,
        model: nn.Module | str | os.PathLike,
        spec: AdapterSpec,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        attn_implementation: str | None = "sdpa",
        adapter_dtype: torch.dtype | None = None,
        freeze_base: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(model, str | os.PathLike):
            model = load_hf_causal_lm(model, dtype=dtype, attn_implementation=attn_implementation)
        self.hf = model
        self.spec = spec
        self.shape = anchor_shape_from_hf(model.config)
        a = self.shape
        # before anything is touched: a spec the model cannot hold leaves the model as it was
        self.moc = spec.moc_config(n_layers=a.n_layers, d_model=a.d_model, n_heads=a.n_heads)
        layers = decoder_layers(model)
        if len(layers) != a.n_layers:
            raise ValueError(f"config says {a.n_layers} layers, the model has {len(layers)}")
        self._check_layers(layers)
        ref = next(model.parameters())
        if adapter_dtype is None:
            adapter_dtype = (
                torch.float32 if ref.dtype in (torch.float16, torch.bfloat16) else ref.dtype
            )
        eps = float(getattr(decoder_config(model.config), "rms_norm_eps", None) or 1e-6)

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.mem_layers = nn.ModuleDict(
                {
                    str(i): MoCLayer(
                        self.moc,
                        d_model=a.d_model,
                        n_layers=a.n_layers,
                        anchor_heads=a.n_heads,
                        norm_eps=eps,
                    )
                    for i in self.moc.layers
                }
            )
            self.banks = build_banks(self.moc, a.d_model)
            if self.moc.variation == 2:
                self.ffn_norms = nn.ModuleDict(
                    {str(i): nn.RMSNorm(a.d_model, eps=eps) for i in self.moc.layers}
                )
                self.ffns = nn.ModuleDict(
                    {
                        str(i): _GatedMLP(a.d_model, a.ffn_dim, self._act(layers[i]))
                        for i in self.moc.layers
                    }
                )
                std = spec.init_std
                for ffn in self.ffns.values():
                    for lin in (ffn.gate_proj, ffn.up_proj):
                        nn.init.trunc_normal_(lin.weight, std=std, a=-2 * std, b=2 * std)
                    nn.init.zeros_(
                        ffn.down_proj.weight
                    )  # the second MLP adds nothing until trained
        for name in ("mem_layers", "banks", "ffn_norms", "ffns"):
            if hasattr(self, name):
                getattr(self, name).to(ref.device, adapter_dtype)

        if freeze_base:
            for p in self.hf.parameters():
                p.requires_grad_(False)
        for p in self.bank_parameters():
            p.requires_grad_(spec.bank_lr_factor > 0)
        for p in self._kv_parameters():
            p.requires_grad_(not spec.freeze_kv)

        self._captured = _Captured()
        self._handles: list[Any] = []
        for i in self.moc.layers:
            layer = layers[i]
            if self.moc.variation == 1:
                self._handles.append(
                    layer.register_forward_pre_hook(_CaptureInput(self, i), with_kwargs=True)
                )
                delta = layer.post_attention_layernorm if _post_norm(layer) else layer.self_attn
                self._handles.append(delta.register_forward_hook(_AttnDeltaHook(self, i)))
            else:
                self._handles.append(layer.register_forward_hook(_LayerOutputHook(self, i)))

    # -- structure ----------------------------------------------------------------
    def _check_layers(self, layers: nn.ModuleList) -> None:
        for i in self.moc.layers:
            layer = layers[i]
            name = type(layer).__name__
            if self.moc.variation == 1:
                if not hasattr(layer, "post_attention_layernorm"):
                    raise ValueError(
                        f"{name} (layer {i}) has no post_attention_layernorm: a parallel "
                        "attention/MLP block has no point between them for adapter variation 1"
                    )
                if not _post_norm(layer) and not hasattr(layer, "self_attn"):
                    raise ValueError(
                        f"{name} (layer {i}) has no self_attn; memory adapters support "
                        "Llama/Qwen/Gemma/OLMo-2 style decoder layers"
                    )

    @staticmethod
    def _act(layer: nn.Module) -> Any:
        """The HF MLP's activation (SiLU for Llama/Qwen, GELU-tanh for Gemma), copied so the two
        module trees share nothing; SiLU when the MLP does not expose one."""
        act = getattr(getattr(layer, "mlp", None), "act_fn", None)
        if act is None:
            return nn.SiLU()
        return copy.deepcopy(act) if isinstance(act, nn.Module) else act

    # -- hooks' arithmetic --------------------------------------------------------------
    def _read(self, i: int, h: Tensor) -> Tensor:
        """h (B, S, d) → the memory layer's residual update (B, S, d), in h's dtype."""
        mem = self.mem_layers[str(i)]
        return mem(h.to(mem.o.weight.dtype), bank_for(self.banks, i)).to(h.dtype)

    def _variation2(self, i: int, y: Tensor) -> Tensor:
        y = y + self._read(i, y)
        norm, ffn = self.ffn_norms[str(i)], self.ffns[str(i)]
        return y + ffn(norm(y.to(ffn.down_proj.weight.dtype))).to(y.dtype)

    def remove_hooks(self) -> None:
        """Detach from the HF model (it is then the plain base model again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._captured.inputs.clear()

    # -- forward ------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """The HF model's forward (`.logits` (B, S, V), `.loss` with labels); the hooks add the
        memory."""
        return self.hf(*args, **kwargs)

    def aux_loss(self) -> Tensor:
        """Mean over the memory layers of lb_coef·L_lb + z_coef·L_z from the last forward."""
        return mean_aux_loss(list(self.mem_layers.values()))

    # -- parameters ---------------------------------------------------------------
    def bank_parameters(self) -> list[nn.Parameter]:
        """The latent tables (sparse gradients) and a factorised bank's up-projection."""
        return list(self.banks.parameters())

    def _kv_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.mem_layers.values() for p in (m.k.weight, m.v.weight)]

    def adapter_parameters(self) -> dict[str, list[nn.Parameter]]:
        """The adapter's parameters by how §6.1 treats them (as `mem_adapter.adapter_groups`):
        "bank", "kv" (W_K, W_V of every memory layer) and "layers" (routers, W_Q, W_O, norms,
        variation 2's MLPs). No HF parameter is in any group."""
        kv = self._kv_parameters()
        kv_ids = {id(p) for p in kv}
        rest = list(self.mem_layers.parameters())
        if self.moc.variation == 2:
            rest += list(self.ffn_norms.parameters()) + list(self.ffns.parameters())
        return {
            "bank": self.bank_parameters(),
            "kv": kv,
            "layers": [p for p in rest if id(p) not in kv_ids],
        }
