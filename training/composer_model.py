"""The Composer model: an anchor LM plus its trainable memory bank.

Each training sequence fetches the blocks of its cluster path from the bank
(or, with probability `generic_prob` = 1/branching by default, the generic
memory — seed 002 §4) and runs the anchor with them: KV and FFN memories are
read in place by the fused kernels (`memory_read="fused"`, the default here;
the trainer's `memory.read: auto` takes it on a GPU only where a start-up probe
finds it faster, `training/read_choice.py`), LoRA memories — and
everything with `memory_read="gather"` — from per-sequence copies assembled
per layer.
The draw for each sequence depends only on (seed, training-forward counter,
the sequence's tokens), and the counter is a buffer saved in checkpoints, so a
resumed run makes the same draws, also at another world size.

With `memory_dropout` p, a training forward runs the anchor alone with probability p, drawn
from (seed, counter) only, so every rank of a data-parallel step draws alike. A frozen anchor
(`freeze_anchor`) turns it off: such a forward would train nothing.

At evaluation `memory_mode` selects "fetched", "generic" or "none" (anchor only).

With a Mixture-of-Chapters model (`moc`, training/layers/moc.py) the memory is inside
the anchor; the training loss adds the router's auxiliary losses
(`AnchorLM.moc_aux_loss`, already weighted by their coefficients).
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import torch
import torch.nn.functional as F
from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity
from composer.models import ComposerModel

from memtree.training.bank import READ_IN_PLACE, TrainableBank
from memtree.training.config import MemorySection
from memtree.training.hf import HFMemoryModel
from memtree.training.layers.moc import read_modes
from memtree.training.model import AnchorLM, ModelConfig, assemble_memories

MemoryMode = Literal["fetched", "generic", "none"]


def unwrap(model: Any) -> Any:
    """The MemtreeLM inside a DDP/FSDP wrapper (Composer wraps the model for multi-GPU)."""
    return getattr(model, "module", model)


# The model takes the training config's `memory:` section as it is (one memory config from YAML
# to model); the name this module gave its subset before stays for callers that build models.
MemorySettings = MemorySection


class MemtreeLM(ComposerModel):
    """An anchor with its memories as a Composer model: the anchor (memtree's `AnchorLM` built
    from `config`, or a local Hugging Face causal LM, `hf_dir`), the bank of fetched blocks, the
    loss and metrics. `subtree` / `shard`: the bank rows this rank holds (one subtree's, or the
    level-1 subtrees of a sharded bank); `freeze_anchor`: train the memories alone; `bank_init`:
    `training.bank.TrainableBank`'s init ("empty" where the bank is read from a store instead)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        memory_settings: MemorySection | None = None,
        seed: int = 0,
        hf_dir: str | None = None,
        freeze_anchor: bool = False,
        subtree: int | None = None,
        shard: tuple[int, ...] | None = None,
        bank_init: str = "paper",
    ) -> None:
        super().__init__()
        anchor, memory, moc = config.anchor, config.memory, config.moc
        ms = memory_settings if memory_settings is not None else MemorySection()
        self.anchor_shape, self.memory = anchor, memory
        self.bank = (
            TrainableBank(
                anchor,
                memory,
                subtree=subtree,
                shard=shard,
                seed=seed,
                std=ms.init_std,
                init=bank_init,
            )
            if memory is not None
            else None
        )
        self.hf = None
        if hf_dir is not None:
            # post-hoc memories on a pretrained HF causal LM (Table 2); the HF model is the anchor
            if memory is None:
                raise ValueError("model.hf_dir: post-hoc training needs memory.multipliers")
            if moc is not None:
                raise ValueError(
                    "model.hf_dir: Mixture-of-Chapters layers are not supported on HF models"
                )
            self.hf = HFMemoryModel(
                hf_dir,
                memory,
                bank=self.bank,
                cotrain=not freeze_anchor,
                lora_alpha=config.lora_alpha,
                seed=seed,
            )
            self.model = self.hf.hf
        else:
            self.model = AnchorLM(config)
        # KV/FFN memories of our own anchor are read in place by the fused kernels; LoRA
        # memories and HF anchors (whose hooks take per-sequence tensors) are gathered;
        # Mixture-of-Chapters layers take any of their reads (`read_modes`)
        self._read = "gather"
        if self.read_modes():
            # "auto" as built: the in-place read where there is one (training resolves "auto" before
            # it builds the model: gather on the CPU, a timed choice on a GPU,
            # training.train.memory_read)
            self.read = "fused" if ms.read == "auto" else ms.read
        self.generic_prob = (
            (1.0 / memory.branching if ms.generic_prob is None else ms.generic_prob)
            if memory
            else 0.0
        )
        # Dropout lets the anchor keep learning what a fetched block would take over; a frozen
        # anchor learns nothing, and its anchor-only forward has no gradient to step on.
        self.memory_dropout = ms.dropout if memory and not freeze_anchor else 0.0
        self.seed = seed
        self.memory_mode: MemoryMode = "fetched"
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))
        if freeze_anchor:
            self.model.requires_grad_(False)
        # sparse gradients cannot go through DDP's buckets; MemoryAdamW reduces them itself
        sparse = [f"bank.tables.{lv}" for lv in self.bank.tables] if self.bank is not None else []
        if self.hf is None and self.model.moc_banks is not None:
            sparse += [f"model.moc_banks.{k}.weight" for k in self.model.moc_banks]
        if self.hf is None:
            sparse += [
                f"model.blocks.{i}.pkm.values.weight"
                for i, b in enumerate(self.model.blocks)
                if b.pkm is not None
            ]
        if sparse:
            self._ddp_params_and_buffers_to_ignore = sparse
        self.train_metrics = {"LanguageCrossEntropy": LanguageCrossEntropy()}
        self.eval_metrics = {
            "LanguageCrossEntropy": LanguageCrossEntropy(),
            "LanguagePerplexity": LanguagePerplexity(),
        }
        # what the last forward did, for callbacks: rows used per level, generic flags
        self.last_slots: dict[int, torch.Tensor] = {}
        self.last_use_generic: torch.Tensor | None = None
        self.last_seq_loss: torch.Tensor | None = None

    def read_modes(self) -> tuple[str, ...]:
        """The memory reads this model can switch between (`read`), empty when it has one way
        only: KV / FFN banks on our own anchor ("fused", "gather"), Mixture-of-Chapters layers
        (their `read_modes`: also "flex" in "bias" mode); LoRA memories, HF anchors and models
        without memory gather."""
        if self.hf is not None:
            return ()
        if self.bank is not None and self.memory.type in READ_IN_PLACE:
            return ("fused", "gather")
        moc = self.model.config.moc
        return read_modes(moc.weight_mode) if moc is not None else ()

    @property
    def read(self) -> str:
        """How every memory read of a forward runs: "fused" (the kernels, in place), "gather"
        (standard ops on gathered copies) or "flex" (FlexAttention, Mixture of Chapters only).
        Setting it switches the bank's read and every MoC layer's at once (the read probe does,
        training/read_choice.py)."""
        return self._read

    @read.setter
    def read(self, mode: str) -> None:
        modes = self.read_modes()
        if mode not in (modes or ("gather",)):
            raise ValueError(f"memory read {mode!r}: this model reads with {modes or ('gather',)}")
        self._read = mode
        for layer in self.moc_layers():
            layer.read = mode

    def moc_layers(self) -> list:
        """The anchor's Mixture-of-Chapters layers (none on an HF anchor)."""
        return [] if self.hf is not None else self.model.moc_layers()

    @property
    def read_in_place(self) -> bool:
        """Whether the bank's KV / FFN memories (or the MoC layers) are read by the fused
        kernels."""
        return self._read == "fused"

    @read_in_place.setter
    def read_in_place(self, fused: bool) -> None:
        self.read = "fused" if fused else "gather"

    def _draw_dropout(self) -> bool:
        """True when this training forward runs without memory (probability `memory_dropout`),
        keyed on (seed, forward counter) alone: the same on every rank and on resumption."""
        if self.memory_dropout <= 0:
            return False
        key = f"{self.seed}:{int(self.forwards)}:dropout".encode()
        u = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") / 2.0**64
        return u < self.memory_dropout

    def _draw_generic(self, batch: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) bool, True where a sequence reads the generic memory. Each sequence's draw is
        keyed on (seed, forward counter, its tokens `ids[i]`), not on the rank or its row, so a
        run resumed at another world size, where Streaming deals the same global batch out to
        more or fewer ranks, draws the same for every sequence (identical sequences in one
        forward draw alike). Without `ids` the row index stands in for the tokens."""
        rows = ids.detach().cpu().numpy() if ids is not None else None
        prefix = f"{self.seed}:{int(self.forwards)}:".encode()
        u = [
            int.from_bytes(
                hashlib.blake2b(
                    prefix + (rows[i].tobytes() if rows is not None else b"row%d" % i),
                    digest_size=8,
                ).digest(),
                "little",
            )
            / 2.0**64
            for i in range(batch)
        ]
        return torch.tensor(u, dtype=torch.float64) < self.generic_prob

    def memories_for(self, paths: torch.Tensor, use_generic: torch.Tensor):
        slots = self.bank.slots(paths.cpu(), use_generic.cpu())
        device = next(self.bank.parameters()).device
        rows = {lv: r.to(device) for lv, r in slots.items()}
        self.last_slots, self.last_use_generic = slots, use_generic
        if self.read_in_place:
            return self.bank.read(rows)
        return assemble_memories(self.bank(rows), self.anchor_shape, self.memory)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        ids = batch["input_ids"]
        mems = None
        if self.bank is not None and self.memory_mode != "none":
            B = ids.shape[0]
            if not self.training:
                mems = self.memories_for(
                    batch["paths"], torch.full((B,), self.memory_mode == "generic")
                )
            elif (
                self._draw_dropout()
            ):  # the anchor alone; callbacks see a forward that read no block
                self.last_slots, self.last_use_generic = {}, None
            else:
                mems = self.memories_for(batch["paths"], self._draw_generic(B, ids))
            if self.training:
                self.forwards += 1
        if self.hf is not None:
            # no document mask: the HF anchors were not trained with one (App. A.6)
            if mems is None:
                return self.model(input_ids=ids, use_cache=False).logits
            return self.hf(ids, memories=mems, use_cache=False).logits
        return self.model(ids, segment_ids=batch.get("segment_ids"), memories=mems)

    def loss(self, outputs: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        labels = batch["labels"]
        per_tok = F.cross_entropy(
            outputs.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none"
        ).view_as(labels)
        mask = labels != -100
        n = mask.sum()
        loss = per_tok.sum() / n.clamp(min=1)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"loss is {loss.item()} at training forward {int(self.forwards)}; batch paths "
                f"{batch['paths'][:4].tolist()} … — stopping (lower the LR or check the data)"
            )
        self.last_seq_loss = (per_tok.sum(1) / mask.sum(1).clamp(min=1)).detach()
        aux = self.model.moc_aux_loss() if self.training and self.hf is None else None
        return loss if aux is None else loss + aux

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return self.train_metrics if is_train else self.eval_metrics

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        metric.update(outputs, batch["labels"])

    def anchor_parameters(self):
        """Everything in the model except the MoC banks and layers (`moc_parameters`)."""
        moc = {id(p) for group in self.moc_parameters() for p in group}
        return (p for p in self.model.parameters() if id(p) not in moc)

    def moc_parameters(self) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        """(latent banks, memory layers), each its own optimizer group; empty without MoC."""
        return ([], []) if self.hf is not None else self.model.moc_parameters()
