"""Post-hoc hierarchical memories on a pretrained Hugging Face causal LM (seed 002 §4, Table 2,
App. A.6, App. I).

`HFMemoryModel` wraps an `AutoModelForCausalLM` loaded from a *local* directory (nothing is
ever downloaded) together with a `training.bank.TrainableBank`. A forward pass fetches one
block per level for every sequence (its tree path, or the generic memory), splits the blocks
into per-layer tensors with `training.model.assemble_memories` — the same layout our own
`AnchorLM` and the on-disk bank use — and applies them inside the HF decoder layers for that
forward only.

How memories get into the HF model: forward hooks registered once, at construction, on the
memory-carrying layers' modules. They read the memories of the call in progress from a
thread-local slot that `forward` (or the `use_memories` context manager) fills and always
clears on exit, so a call never leaks into the next one, a concurrent forward in another thread
sees only its own memories, and with nothing active the hooks are no-ops: `model.hf(...)` is
then exactly the base model. The HF module tree and its state dict are untouched (no wrapper
modules), so `model.hf.save_pretrained` still writes a plain checkpoint.

Supported memory types (`MemoryConfig.type`), for Llama / Qwen2 / Qwen3 / Gemma 3 style decoders
(`layer.self_attn.{q,k,v,o}_proj`, `layer.mlp.{gate,up,down}_proj`):
- "ffn": the memory widens the MLP's inner dim by W. HF `gate_proj` ↔ our w1, `up_proj` ↔ w2,
  `down_proj` ↔ w3; our w1/w2/w3 are stored (W, d), so
  `mlp(x) += (act(x·w1ᵀ) ⊙ (x·w2ᵀ))·w3`, per sequence. `act` is the MLP's own `act_fn`
  (SiLU for Llama/Qwen — exactly `AnchorLM`'s FFN memory — and GELU-tanh for Gemma 3, so the
  memory is a true widening of that model's FFN).
- "lora-ffn": LoRA deltas on the outputs of gate_proj / up_proj / down_proj (down_proj's
  input already includes the gate/up deltas, as in `AnchorLM`).
- "lora-qk": LoRA on q_proj / k_proj outputs (before any q/k norm and RoPE, as in `AnchorLM`).
- "lora-ov": LoRA on v_proj and o_proj outputs.
- "kv": m learned keys/values per layer read by the query in a separate softmax (no mask, no
  RoPE; the query is taken after the model's q-norm when it has one, before rotation; scale
  1/√head_dim even where the model uses another, e.g. Gemma's query_pre_attn_scalar); the read
  is added to the attention output before o_proj. This mirrors `AnchorLM`'s KV memory.
LoRA scale is `lora_alpha / r` with r the layer's rank summed over levels (as `AnchorLM`).

At App. I init (`paper_init`: FFN w3, LoRA B and KV values zero) every type adds an exact zero,
so the logits equal the base model's bit for bit (called with the same arguments: HF's
use_cache=True/False take different mask paths that differ in the last bit). The anchor is frozen by
default (Table 2); `cotrain=True` keeps its parameters trainable (the co-trained Qwen of App. A.6).

Not supported: HF gradient checkpointing (its recomputation runs in backward, after the
memories of the call were cleared — `forward` refuses rather than silently dropping them), and
generation with beam search / `num_return_sequences` > 1 (the batch no longer matches the
memories' batch; the hooks raise).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memtree.geometry import AnchorShape, MemoryConfig, memory_layers
from memtree.training.bank import TrainableBank
from memtree.training.hooks import LayerHook, first_tensor
from memtree.training.model import Memories, assemble_memories, lora_delta

# model_type → (qk_norm, norms_per_block) for the families whose norms differ from Llama's.
_QK_NORM = {
    "gemma3": "head",
    "gemma3_text": "head",
    "qwen3": "head",
    "qwen3_moe": "head",
    "olmo2": "full",
}
_FOUR_NORMS = {"gemma2", "gemma3", "gemma3_text"}
_ALWAYS_QKV_BIAS = {"qwen2", "qwen2_moe"}  # Qwen2 hard-codes bias=True on q/k/v


def decoder_config(config: Any) -> Any:
    """The decoder's config (Gemma 3's multimodal config nests it in `text_config`)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def anchor_shape_from_hf(config: Any, *, name: str | None = None) -> AnchorShape:
    """A transformers config (Llama / Qwen2 / Qwen3 / Gemma 3 text style) → `AnchorShape`.

    The fields memory geometry depends on are exact: n_layers, d_model, n_heads, n_kv_heads,
    head_dim (config.head_dim, else hidden_size // num_attention_heads) and ffn_dim
    (intermediate_size); so are vocab_size and tied_embeddings. `.params()` of the result is only
    approximate for an HF model: AnchorShape does not know about MLP biases, an o_proj bias
    (Llama's `attention_bias`), MoE or other norm variants. Report `hf_param_count(model)` for
    the real count.
    """
    cfg = decoder_config(config)
    missing = [
        k
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        if getattr(cfg, k, None) is None
    ]
    if missing:
        raise ValueError(
            f"config of type {type(cfg).__name__} lacks {missing}; "
            "expected a Llama/Qwen2/Gemma3-style decoder config"
        )
    model_type = getattr(cfg, "model_type", "") or ""
    d, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    qkv_bias = model_type in _ALWAYS_QKV_BIAS or bool(getattr(cfg, "attention_bias", False))
    if name is None:
        src = getattr(config, "name_or_path", "") or ""
        name = Path(src).name if src else (model_type or "hf")
    return AnchorShape(
        name=name,
        n_layers=int(cfg.num_hidden_layers),
        d_model=d,
        n_heads=heads,
        n_kv_heads=int(kv),
        head_dim=int(head_dim),
        ffn_dim=int(cfg.intermediate_size),
        vocab_size=int(cfg.vocab_size),
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_norm=_QK_NORM.get(model_type, "none"),
        norms_per_block=4 if model_type in _FOUR_NORMS else 2,
        qkv_bias=qkv_bias,
    )


def hf_param_count(model: nn.Module) -> int:
    """Parameters of a (HF) model, each counted once (tied embeddings share one tensor)."""
    return sum(p.numel() for p in model.parameters())


def _same_geometry(a: AnchorShape, b: AnchorShape) -> bool:
    keys = ("n_layers", "d_model", "n_heads", "kv_heads", "head_dim", "ffn_dim")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def load_hf_causal_lm(
    local_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "sdpa",
) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained` from a local directory only (never downloads)."""
    from transformers import AutoModelForCausalLM

    path = Path(local_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"HF model directory {str(path)!r} does not exist "
            "(only local checkpoints are loaded; nothing is downloaded)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"HF model directory {str(path)!r} has no config.json; "
            "expected a save_pretrained checkpoint"
        )
    kw: dict[str, Any] = {"local_files_only": True, "dtype": dtype}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), **kw)
    except TypeError:  # transformers < 4.56 only knows `torch_dtype`
        kw["torch_dtype"] = kw.pop("dtype")
        return AutoModelForCausalLM.from_pretrained(str(path), **kw)


def decoder_layers(hf: nn.Module) -> nn.ModuleList:
    for get in (lambda m: m.get_decoder().layers, lambda m: m.model.layers):
        try:
            layers = get(hf)
        except (AttributeError, ValueError, NotImplementedError):
            continue
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(
        f"{type(hf).__name__}: cannot find the decoder layers "
        "(expected model.layers, as in Llama/Qwen/Gemma)"
    )


class _CallState(threading.local):
    """Memories of the forward in progress, per thread. Copies/pickles start empty."""

    mem: Memories | None = None
    queries: dict[int, Tensor]

    def __init__(self) -> None:
        self.mem = None
        self.queries = {}

    def __reduce__(self):
        return (_CallState, ())


class _FFNHook(LayerHook):
    """mlp(x) += (act(x·w1ᵀ) ⊙ (x·w2ᵀ))·w3, i.e. the MLP widened by the memory rows."""

    def __init__(self, owner: HFMemoryModel, layer: int, act) -> None:
        super().__init__(owner, layer)
        self.act = act

    def __call__(self, module, args, kwargs, out):
        x = first_tensor(args, kwargs)
        lm = self.owner._layer_mem(self.layer, x)
        if lm is None:
            return None
        w1, w2, w3 = (lm[n].to(x.dtype) for n in ("w1", "w2", "w3"))  # (B, W, d) each
        h_mem = self.act(x @ w1.mT) * (x @ w2.mT)  # (B, S, W)
        return out + h_mem @ w3


class _LoRAHook(LayerHook):
    """linear(x) += scale·(x·Aᵀ)·Bᵀ."""

    def __init__(self, owner: HFMemoryModel, layer: int, a: str, b: str) -> None:
        super().__init__(owner, layer)
        self.a, self.b = a, b

    def __call__(self, module, args, kwargs, out):
        x = first_tensor(args, kwargs)
        lm = self.owner._layer_mem(self.layer, x)
        if lm is None:
            return None
        return out + lora_delta(x, lm[self.a], lm[self.b], self.owner.lora_alpha)


class _QueryHook(LayerHook):
    """KV memory: keep the layer's query (after the model's q-norm, before RoPE) for the read."""

    def __init__(self, owner: HFMemoryModel, layer: int, q_norm: nn.Module | None) -> None:
        super().__init__(owner, layer)
        self.q_norm = q_norm
        weight = getattr(q_norm, "weight", None)
        self.full_norm = weight is not None and weight.numel() == owner.anchor.q_dim

    def __call__(self, module, args, kwargs, out):
        x = first_tensor(args, kwargs)
        if self.owner._layer_mem(self.layer, x) is None:
            return
        a, q = self.owner.anchor, out
        if self.q_norm is not None and self.full_norm:  # OLMo-2 style norm over all heads
            q = self.q_norm(q)
        q = q.unflatten(-1, (a.n_heads, a.head_dim))  # (B, S, H, D)
        if self.q_norm is not None and not self.full_norm:  # per-head norm (Qwen3, Gemma 3)
            q = self.q_norm(q)
        self.owner._state.queries[self.layer] = q.transpose(1, 2)  # (B, H, S, D)


class _KVReadHook(LayerHook):
    """KV memory (o_proj pre-hook): attention output += softmax(q·Kᵀ/√D)·V over the m slots."""

    def _heads(self, t: Tensor, dtype: torch.dtype) -> Tensor:  # (B, m, kv_dim) → (B, H, m, D)
        a = self.owner.anchor
        t = t.to(dtype).unflatten(-1, (a.kv_heads, a.head_dim)).transpose(1, 2)
        groups = a.n_heads // a.kv_heads
        return t if groups == 1 else t.repeat_interleave(groups, dim=1)

    def __call__(self, module, args, kwargs):
        x = first_tensor(args, kwargs)
        lm = self.owner._layer_mem(self.layer, x)
        if lm is None:
            return None
        q = self.owner._state.queries.pop(self.layer, None)
        if q is None:
            raise RuntimeError(f"layer {self.layer}: KV memory read without a captured query")
        read = F.scaled_dot_product_attention(
            q, self._heads(lm["k"], q.dtype), self._heads(lm["v"], q.dtype)
        )  # (B, H, S, D)
        x = x + read.transpose(1, 2).flatten(2).to(x.dtype)  # (B, S, q_dim)
        return ((x, *args[1:]), kwargs) if args else ((), {**kwargs, "input": x})


class HFMemoryModel(nn.Module):
    """A pretrained HF causal LM + a trainable hierarchical memory bank.

    model: a loaded HF causal LM, or a local directory to load it from (`dtype`,
    `attn_implementation` apply then). memory: the memory configuration (type, multipliers,
    placement, branching); None takes the bank's. bank: a `TrainableBank` built for this
    model's geometry; None creates one with the App. I init (`seed`, `init_std`).
    """

    def __init__(
        self,
        model: nn.Module | str | os.PathLike,
        memory: MemoryConfig | None = None,
        *,
        bank: TrainableBank | None = None,
        dtype: torch.dtype = torch.float32,
        attn_implementation: str | None = "sdpa",
        cotrain: bool = False,
        freeze_anchor: bool | None = None,
        lora_alpha: float = 1.0,
        seed: int = 0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if isinstance(model, str | os.PathLike):
            model = load_hf_causal_lm(model, dtype=dtype, attn_implementation=attn_implementation)
        if freeze_anchor is None:
            freeze_anchor = not cotrain
        if freeze_anchor == cotrain:
            raise ValueError(f"freeze_anchor={freeze_anchor} contradicts cotrain={cotrain}")
        if lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be positive, got {lora_alpha}")
        if memory is None:
            if bank is None:
                raise ValueError("give a MemoryConfig or a TrainableBank")
            memory = bank.memory
        self.hf = model
        self.anchor = anchor_shape_from_hf(model.config)
        self.memory = memory
        self.cotrain = cotrain
        self.lora_alpha = float(lora_alpha)
        self._check_modules()
        self.memory_layer_ids = memory_layers(self.anchor, memory)  # raises on a bad placement
        if bank is None:
            bank = TrainableBank(self.anchor, memory, seed=seed, std=init_std)
        else:
            if not _same_geometry(bank.anchor, self.anchor):
                raise ValueError(
                    f"bank anchor {bank.anchor} does not match the model's geometry {self.anchor}"
                )
            if bank.memory != memory:
                raise ValueError(f"bank memory config {bank.memory} differs from {memory}")
        self.bank = bank
        for p in self.hf.parameters():
            p.requires_grad_(not freeze_anchor)
        self._state = _CallState()
        self._handles: list[Any] = []
        self._register_hooks()

    # -- structure ----------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        """The HF decoder layers (not registered again here: the state dict stays `hf.*`)."""
        return decoder_layers(self.hf)

    def _check_modules(self) -> None:
        a = self.anchor
        if len(self.layers) != a.n_layers:
            raise ValueError(f"config says {a.n_layers} layers, the model has {len(self.layers)}")
        need = {
            "ffn": ("mlp",),
            "lora-ffn": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
            "lora-qk": ("self_attn.q_proj", "self_attn.k_proj"),
            "lora-ov": ("self_attn.v_proj", "self_attn.o_proj"),
            "kv": ("self_attn.q_proj", "self_attn.o_proj"),
        }[self.memory.type]
        shapes = {
            "mlp.gate_proj": (a.d_model, a.ffn_dim),
            "mlp.up_proj": (a.d_model, a.ffn_dim),
            "mlp.down_proj": (a.ffn_dim, a.d_model),
            "self_attn.q_proj": (a.d_model, a.q_dim),
            "self_attn.k_proj": (a.d_model, a.kv_dim),
            "self_attn.v_proj": (a.d_model, a.kv_dim),
            "self_attn.o_proj": (a.q_dim, a.d_model),
        }
        for i, layer in enumerate(self.layers):
            for path in need:
                try:
                    mod = layer.get_submodule(path)
                except AttributeError:
                    raise ValueError(
                        f"{type(self.hf).__name__} layer {i} has no {path}; memory type "
                        f"{self.memory.type!r} supports Llama/Qwen/Gemma-style decoders only"
                    ) from None
                if path in shapes and isinstance(mod, nn.Linear):
                    got = (mod.in_features, mod.out_features)
                    if got != shapes[path]:
                        raise ValueError(
                            f"layer {i} {path}: (in, out) = {got}, but the config "
                            f"implies {shapes[path]}"
                        )

    def _register_hooks(self) -> None:
        kind = self.memory.type
        for i in self.memory_layer_ids:
            layer = self.layers[i]
            attn = getattr(layer, "self_attn", None)
            if kind == "ffn":
                self._hook(
                    layer.mlp, _FFNHook(self, i, getattr(layer.mlp, "act_fn", None) or F.silu)
                )
            elif kind == "lora-ffn":
                for mod, a, b in (
                    (layer.mlp.gate_proj, "w1_a", "w1_b"),
                    (layer.mlp.up_proj, "w2_a", "w2_b"),
                    (layer.mlp.down_proj, "w3_a", "w3_b"),
                ):
                    self._hook(mod, _LoRAHook(self, i, a, b))
            elif kind == "lora-qk":
                self._hook(attn.q_proj, _LoRAHook(self, i, "q_a", "q_b"))
                self._hook(attn.k_proj, _LoRAHook(self, i, "k_a", "k_b"))
            elif kind == "lora-ov":
                self._hook(attn.v_proj, _LoRAHook(self, i, "v_a", "v_b"))
                self._hook(attn.o_proj, _LoRAHook(self, i, "o_a", "o_b"))
            elif kind == "kv":
                self._hook(attn.q_proj, _QueryHook(self, i, getattr(attn, "q_norm", None)))
                self._handles.append(
                    attn.o_proj.register_forward_pre_hook(_KVReadHook(self, i), with_kwargs=True)
                )
            else:  # MemoryConfig validates the type; keep the error for future types
                raise ValueError(f"memory type {kind!r} is not supported on HF models")

    def _hook(self, module: nn.Module, fn) -> None:
        self._handles.append(module.register_forward_hook(fn, with_kwargs=True))

    def _layer_mem(self, i: int, x: Tensor) -> dict[str, Tensor] | None:
        """Layer i's memories of the call in progress (this thread), or None."""
        mem = self._state.mem
        if mem is None or i not in mem:
            return None
        lm = mem[i]
        batch = next(iter(lm.values())).shape[0]
        if x.shape[0] != batch:
            raise ValueError(
                f"layer {i}: input batch {x.shape[0]} does not match the memories' "
                f"batch {batch} (one memory per sequence; beam search and "
                "num_return_sequences > 1 are not supported)"
            )
        return lm

    # -- memories -----------------------------------------------------------------
    def memory_parameters(self) -> Iterator[nn.Parameter]:
        """The bank tables only (sparse gradients; give them to `MemoryAdamW`)."""
        yield from self.bank.bank_parameters()

    def anchor_parameters(self) -> Iterator[nn.Parameter]:
        """The HF model's parameters (trainable only with cotrain=True)."""
        yield from self.hf.parameters()

    def gather(
        self,
        batch: int,
        *,
        paths: Tensor | None = None,
        use_generic: Tensor | None = None,
        device: torch.device | None = None,
    ) -> Memories:
        """Fetch and assemble per-layer memories for `batch` sequences.

        paths (B, L): global cluster ids per level. use_generic (B,) bool: those sequences get
        the generic memory. Without paths every sequence gets the generic memory.
        """
        if paths is None:
            if use_generic is not None and not bool(use_generic.all()):
                raise ValueError(
                    "use_generic selects fetched memories for some sequences, "
                    "but no paths were given"
                )
            device = (
                device if device is not None else self.bank.tables[str(self.bank.levels[0])].device
            )
            paths = torch.zeros(batch, self.memory.n_levels, dtype=torch.long, device=device)
            use_generic = torch.ones(batch, dtype=torch.bool, device=device)
        elif paths.shape[0] != batch:
            raise ValueError(f"paths has {paths.shape[0]} rows for a batch of {batch}")
        blocks = self.bank(self.bank.slots(paths, use_generic))
        return assemble_memories(blocks, self.anchor, self.memory)

    @contextmanager
    def use_memories(
        self,
        memories: Memories | None = None,
        *,
        paths: Tensor | None = None,
        use_generic: Tensor | None = None,
        batch: int | None = None,
    ):
        """Apply memories to every call of `self.hf` inside the block (e.g. `hf.generate`).

        Give assembled `memories` (`gather`, or `assemble_memories` on blocks fetched from a
        memstore bank) or paths / use_generic (+ batch when paths is None). Not reentrant.
        """
        if self._state.mem is not None:
            raise RuntimeError("memories are already active in this thread (nested use_memories)")
        if memories is None:
            if batch is None:
                if paths is None:
                    raise ValueError("use_memories needs memories, paths, or batch")
                batch = paths.shape[0]
            memories = self.gather(batch, paths=paths, use_generic=use_generic)
        bad = [i for i in memories if i not in self.memory_layer_ids]
        if bad:
            raise ValueError(
                f"memories for layers {bad}, which carry no memory "
                f"(memory layers: {self.memory_layer_ids})"
            )
        self._state.mem, self._state.queries = memories, {}
        try:
            yield self
        finally:
            self._state.mem, self._state.queries = None, {}

    # -- forward ------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        *,
        paths: Tensor | None = None,
        use_generic: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        memories: Memories | None = None,
        **hf_kwargs,
    ):
        """input_ids (B, S) → the HF model's output (`.logits` (B, S, V), `.loss` with labels).

        paths (B, L) / use_generic (B,) pick each sequence's memory (none given: the generic
        memory for all); `memories` passes already assembled ones instead. Other keyword
        arguments go to the HF model; `use_cache` defaults to False.
        """
        if getattr(self.hf, "is_gradient_checkpointing", False) and self.training:
            raise RuntimeError(
                "HF gradient checkpointing recomputes layers in backward, after the "
                "call's memories are cleared; disable it for HFMemoryModel"
            )
        if memories is not None and (paths is not None or use_generic is not None):
            raise ValueError("give memories or paths/use_generic, not both")
        with self.use_memories(
            memories, paths=paths, use_generic=use_generic, batch=input_ids.shape[0]
        ):
            return self.hf(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels, **hf_kwargs
            )

    def remove_hooks(self) -> None:
        """Detach from the HF model (it is then the plain base model again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
