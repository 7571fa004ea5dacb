"""The model `memtree eval adapters` fine-tunes: a bios demo run's anchor (memtree's `AnchorLM`) or
a real pretrained Hugging Face causal LM (`memtree.pretrained`: SmolLM2-135M, Gemma 3 270M), behind
one interface, so the experiment (eval/finetune/adapters.py) reads the same for both.

A base gives the scorer of its pretrained weights (`rm`, what eval/tasks.py's scorers take), its
shape for training/flops.py's accounting (`shape`), and per condition a scorer on the same
pretrained weights again (`condition`): the anchor is reset in place (adapters detached, weights
reloaded), the HF model copied afresh (its memory adapters are forward hooks on the copy, which
goes with them).

An HF model is scored through `RunModel`'s Hugging Face path (the same forward, masks and head a
run with an HF anchor is scored with), without a run, bank or tree: `PretrainedRunModel`. Held-out
real text (`text_pieces`) is what forgetting is read on there, since a pretrained model never read
the bios corpus and its old-fact probes sit at chance.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtree.config import ConfigError
from memtree.eval.model import RunModel
from memtree.geometry import AnchorShape
from memtree.io import iter_jsonl
from memtree.pretrained import SPECS, LoadedPretrained, load_pretrained
from memtree.training.finetune.adapters import detach_from_anchor
from memtree.training.finetune.continual import FinetuneSpec
from memtree.training.hf import anchor_shape_from_hf
from memtree.training.layers.moc import MoCConfig

# The most tokens an HF model's scorer takes in one sequence: bios documents (~120 tokens) and the
# held-out text's pieces fit, and an 8k-position model need not be scored at 8k on a CPU.
HF_CONTEXT = 1024
TEXT_PIECE = 512  # tokens per piece of held-out text (less where the model's context is shorter)


@dataclass(frozen=True)
class BareHF:
    """Stands where a `RunModel` of an HF anchor keeps its `training.hf.HFMemoryModel`: it selects
    RunModel's HF forward, and without a bank RunModel never asks it for memories. `anchor`: the
    model's shape."""

    anchor: AnchorShape

    def use_memories(self, memories: Any, **_: Any) -> Any:
        raise ValueError("a bare pretrained model has no memories to read")


@dataclass
class PretrainedRunModel(RunModel):
    """`RunModel` on a bare HF causal LM. `adapted`: memory adapters are hooked in; they route over
    a whole row, so a multiple-choice item's choices are scored as separate sequences (as RunModel
    does for an AnchorLM with MoC layers) rather than packed into one row."""

    adapted: bool = False

    @property
    def packable(self) -> bool:
        return not self.adapted and super().packable

    @classmethod
    def of(cls, loaded: LoadedPretrained, shape: AnchorShape) -> PretrainedRunModel:
        positions = int(getattr(loaded.model.config, "max_position_embeddings", HF_CONTEXT))
        return cls(
            config=None,
            model=loaded.model,
            store=None,
            tokenizer=loaded.tokenizer,
            eot_id=loaded.eot_id,
            tree=None,
            hf=BareHF(shape),
            context=min(HF_CONTEXT, positions),
        )


class AnchorBase:
    """A memtree run's anchor, loaded once; every condition resets it in place."""

    hf = False

    def __init__(self, run: Path) -> None:
        self.rm = RunModel.load(run)
        self.model = self.rm.model
        self.shape: AnchorShape = self.model.config.anchor
        self.pretrained = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.meta: dict[str, Any] = {"run": str(run)}
        self.title = f"{run} ({self.shape.n_layers} × {self.shape.d_model})"

    def moc(self, spec: FinetuneSpec) -> MoCConfig:
        """The memory layers a mem_adapter condition trains (a MoC run's own, else the spec's)."""
        a = self.shape
        return self.model.config.moc or spec.adapter.moc_config(
            n_layers=a.n_layers, d_model=a.d_model, n_heads=a.n_heads
        )

    def attached(self, spec: FinetuneSpec) -> MoCConfig | None:
        """After a condition trained: the memory layers the model now has (None: none)."""
        return self.model.config.moc

    def condition(self, spec: FinetuneSpec) -> RunModel:
        self.restore()
        return self.rm

    def restore(self) -> None:
        detach_from_anchor(self.model)
        self.model.load_state_dict(self.pretrained)


class PretrainedBase:
    """A pretrained HF causal LM; every condition trains a fresh copy of its weights."""

    hf = True

    def __init__(self, loaded: LoadedPretrained) -> None:
        self.loaded = loaded
        self.shape = anchor_shape_from_hf(loaded.model.config, name=loaded.name)
        self.rm = PretrainedRunModel.of(loaded, self.shape)
        r = loaded.record
        self.meta = {"run": loaded.name, "model": r}
        q = r.get("quantisation", "")
        weights = (
            f"weights stored as {q}{' (4-bit)' if 'Q4' in q else ''}, dequantised to fp32: "
            "pretrained, but not bit for bit the released checkpoint"
            if q
            else "fp32 weights"
        )
        self.title = (
            f"{r.get('title', loaded.name)} ({loaded.name}, {self.shape.n_layers} × "
            f"{self.shape.d_model}; {weights}; licence {r.get('licence', 'unknown')}; upstream "
            f"{r.get('upstream', 'unknown')})"
        )

    def moc(self, spec: FinetuneSpec) -> MoCConfig:
        a = self.shape
        return spec.adapter.moc_config(n_layers=a.n_layers, d_model=a.d_model, n_heads=a.n_heads)

    def attached(self, spec: FinetuneSpec) -> MoCConfig | None:
        return self.moc(spec) if spec.method.startswith("mem_adapter") else None

    def condition(self, spec: FinetuneSpec) -> PretrainedRunModel:
        return dataclasses.replace(
            self.rm,
            model=copy.deepcopy(self.loaded.model),
            adapted=spec.method.startswith("mem_adapter"),
        )

    def restore(self) -> None:
        """Nothing to undo: the loaded model itself is never trained."""


def open_base(
    root: Path, run: str, pretrained: LoadedPretrained | None = None
) -> AnchorBase | PretrainedBase:
    """`pretrained` when given (a model already loaded); else `run`: a name of `memtree.pretrained`
    (smollm2-135m, gemma3-270m; a folder of that name wins), a memtree run folder, or empty for the
    demo's anchor ROOT/train/anchor."""
    if pretrained is not None:
        return PretrainedBase(pretrained)
    if run in SPECS and not Path(run).exists():
        return PretrainedBase(load_pretrained(run))
    folder = Path(run) if run else root / "train" / "anchor"
    if not (folder / "anchor.safetensors").exists():
        raise FileNotFoundError(
            f"{folder}: no trained anchor (run `memtree demo` first, or give run=: a run "
            f"folder or a pretrained model, {' or '.join(sorted(SPECS))})"
        )
    return AnchorBase(folder)


def text_pieces(path: str | Path, rm: RunModel, *, tokens: int) -> list[list[int]]:
    """Held-out real text as token pieces of `TEXT_PIECE` (or the model's context): the JSONL's
    {"text"} records in file order, each followed by the end-of-text token, until `tokens`
    tokens."""
    ids: list[int] = []
    for n, rec in iter_jsonl(path):
        text = rec.get("text")
        if not isinstance(text, str):
            raise ConfigError(f"held_out_text={path}:{n}: a record needs a string under 'text'")
        ids += rm.encode(text) + [rm.eot_id]
        if len(ids) >= tokens:
            break
    ids = ids[:tokens]
    if len(ids) < 2:
        raise ConfigError(f"held_out_text={path}: no text to score")
    piece = min(TEXT_PIECE, rm.max_seq_len)
    return [ids[i : i + piece] for i in range(0, len(ids), piece)]
