"""`memtree train finetune CONFIG.yaml`: continual finetuning on a stream of new data
(seed 003 §4–§5).

Input: a finished run (`run`: its save_folder, as `memtree train` leaves it) and a JSONL stream
(`data`): one record per batch, in the order the model meets them, {"id": …, "texts": [str, …]}
(a fact's N paraphrases, or a document chunk's augmentations). The stream is read in order and
each record becomes one batch and `steps_per_batch` gradient steps (1: the seed's immediate
update), never shuffled or revisited. Each text is its own sequence, padded to the batch's
longest; padding is neither trained on nor counted as a memory access.

Methods (`method`):
  sparse_memory  only the values of memory-layer slots: per batch, the slots the forward read are
                 counted, ranked by TF-IDF against the run's background counts
                 (training/layers/pkm.py) and only the top_t per layer keep their gradient
                 (`ranking: tf` ranks by counts alone, `all` keeps every accessed slot: the seed's
                 ablations). SGD by default.
  full           every parameter (AdamW, weight decay 0.1 by default: the seed's baseline).
  lora           LoRA adapters on every attention and FFN matrix (training/finetune/lora.py), merged
                 into the weights when the stream ends. AdamW by default.
  mem_adapter    memory cross-attention adapters (training/finetune/adapters.py, seed 004 §7.3): MoC
                 layers added to the chosen blocks (`adapter`), the base model frozen; the bank at
                 lr × adapter.bank_lr_factor (0: frozen, §6.1). A model that already has MoC
                 layers has its own memory trained this way instead (its pretrained bank). AdamW.
  mem_adapter+lora  both: the adapters and LoRA on the base's matrices (merged at the end).

`Finetuner` and `finetune_stream` also take a Hugging Face causal LM in place of the anchor (what
`memtree eval adapters` does with a pretrained model): full, lora and the mem_adapter methods on it,
its memory adapters `training/finetune/hf_adapters.py`'s `HFMemAdapter` (forward hooks; the
adapter's modules sit beside the model, not in its state dict).

What the run leaves in `save_folder`: anchor.safetensors and memtree_config.json (a run folder
that `load_run` / `memtree eval` open like any other), the background counts it was given
(pkm_background/, so a later finetune can continue), and finetune.json (format memtree-finetune
v1: the config, per-step loss and rows updated, and what changed: parameters and bytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm import tqdm

from memtree.config import ConfigError, is_int, load_config, to_dict
from memtree.io import (
    atomic_dir,
    atomic_path,
    atomic_write_json,
    check_format,
    iter_jsonl,
    read_json,
)
from memtree.training.data import build_dataloader
from memtree.training.finetune.adapters import AdapterSpec, adapter_groups, attach_to_anchor
from memtree.training.finetune.hf_adapters import HFMemAdapter
from memtree.training.finetune.lora import add_lora, merge_lora
from memtree.training.finetune.slots import (
    BACKGROUND_DIR,
    BackgroundCounts,
    access_counts,
    background_dir,
    collect_background,
    keep_rows,
    recording,
    trainable_rows,
)
from memtree.training.optim import MemoryAdamW
from memtree.training.train import load_run

FINETUNE_FORMAT = "memtree-finetune"
FINETUNE_VERSION = 1
METHODS = ("sparse_memory", "full", "lora", "mem_adapter", "mem_adapter+lora")


@dataclass(frozen=True, kw_only=True)
class FinetuneSpec:
    """How to update (the part of the config that the experiment sweeps).

    method: sparse_memory | full | lora; optimizer: sgd | adamw | auto (sgd for sparse_memory,
    adamw otherwise: each method's best in the seed); lr; weight_decay: AdamW's (-1: 0.1 for
    full and lora as in the seed, 0 for sparse_memory); top_t: slots trained per batch and memory
    layer; ranking: tfidf | tf | all; lora_rank, lora_alpha (0: 2 × rank), lora_targets: all |
    attention; steps_per_batch: gradient steps per record; adapter: the memory adapters of
    mem_adapter and mem_adapter+lora (`training.finetune.adapters.AdapterSpec`)."""

    method: str = "sparse_memory"
    optimizer: str = "auto"
    lr: float = 2.0
    weight_decay: float = -1.0
    top_t: int = 500
    ranking: str = "tfidf"
    lora_rank: int = 16
    lora_alpha: float = 0.0
    lora_targets: str = "all"
    steps_per_batch: int = 1
    adapter: AdapterSpec = dataclasses.field(default_factory=AdapterSpec)

    def __post_init__(self) -> None:
        checks = (
            ("method", self.method in METHODS, f"one of {METHODS}"),
            ("optimizer", self.optimizer in ("auto", "sgd", "adamw"), "auto, sgd or adamw"),
            (
                "optimizer",
                not (self.method.startswith("mem_adapter") and self.optimizer == "sgd"),
                "auto or adamw with a mem_adapter method (its bank in its own parameter group)",
            ),
            ("lr", isinstance(self.lr, int | float) and self.lr > 0, "positive"),
            (
                "weight_decay",
                isinstance(self.weight_decay, int | float)
                and (self.weight_decay >= 0 or self.weight_decay == -1),
                ">= 0, or -1 for the method's default",
            ),
            ("top_t", is_int(self.top_t) and self.top_t > 0, "a positive integer"),
            ("ranking", self.ranking in ("tfidf", "tf", "all"), "tfidf, tf or all"),
            ("lora_rank", is_int(self.lora_rank) and self.lora_rank > 0, "a positive integer"),
            (
                "lora_alpha",
                isinstance(self.lora_alpha, int | float) and self.lora_alpha >= 0,
                ">= 0 (0: 2 × rank)",
            ),
            ("lora_targets", self.lora_targets in ("all", "attention"), "all or attention"),
            (
                "steps_per_batch",
                is_int(self.steps_per_batch) and self.steps_per_batch > 0,
                "a positive integer",
            ),
        )
        for name, ok, want in checks:
            if not ok:
                raise ConfigError(f"finetune {name}={getattr(self, name)!r}: must be {want}")

    @property
    def resolved_optimizer(self) -> str:
        if self.optimizer != "auto":
            return self.optimizer
        return "sgd" if self.method == "sparse_memory" else "adamw"

    @property
    def resolved_weight_decay(self) -> float:
        if self.weight_decay >= 0:
            return float(self.weight_decay)
        return 0.0 if self.method == "sparse_memory" else 0.1

    @property
    def label(self) -> str:
        """A short name for plots and tables."""
        if self.method == "sparse_memory":
            sel = "all" if self.ranking == "all" else f"{self.ranking} t={self.top_t}"
            return f"sparse {sel} lr={self.lr:g}"
        if self.method == "lora":
            return f"lora r={self.lora_rank} lr={self.lr:g}"
        if self.method.startswith("mem_adapter"):
            a = self.adapter
            parts = [f"mem-adapter {a.layers}", f"{a.n_chapters}×{a.tokens_per_chapter}"]
            parts += [f"v{a.variation}"] if a.variation != 1 else []
            parts += [] if a.shared_bank else ["per-layer"]
            parts += [a.bank_dtype] if a.bank_dtype != "fp32" else []
            parts += [f"{a.low_rank} r={a.rank}"] if a.low_rank != "none" else []
            parts += (
                ["frozen bank" if a.bank_lr_factor == 0 else f"bank×{a.bank_lr_factor:g}"]
                if a.bank_lr_factor != 1
                else []
            )
            parts += ["frozen W_K W_V"] if a.freeze_kv else []
            parts += [f"+ lora r={self.lora_rank}"] if self.method.endswith("+lora") else []
            return " ".join(parts) + f" lr={self.lr:g}"
        return f"full lr={self.lr:g}"


@dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    """run: the pretrained run folder; data: the JSONL stream; save_folder: where the finetuned
    run goes; background: folder of the background counts (default: run/pkm_background);
    max_records: stop after this many (0: all); spec: how to update (`FinetuneSpec`); seed."""

    run: str
    data: str
    save_folder: str
    spec: FinetuneSpec = dataclasses.field(default_factory=FinetuneSpec)
    background: str = ""
    max_records: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.max_records) or self.max_records < 0:
            raise ConfigError(f"max_records must be an integer >= 0, got {self.max_records!r}")


def load_finetune_config(path: str | Path | None, overrides: Sequence[str] = ()) -> FinetuneConfig:
    return load_config(FinetuneConfig, str(path) if path else None, list(overrides))


# -- the update ------------------------------------------------------------------------------------


def batch_tensors(
    texts: Sequence[str],
    encode: Callable[[str], list[int]],
    *,
    pad_id: int,
    max_len: int,
    where: str = "",
) -> tuple[Tensor, Tensor]:
    """Texts → (ids (B, S) padded with pad_id, real (B, S) bool). Texts are cut to max_len
    tokens; an empty text or one of a single token (nothing to predict) is an error naming it."""
    seqs = []
    for j, t in enumerate(texts):
        ids = encode(t)[:max_len]
        if len(ids) < 2:
            raise ValueError(
                f"{where} text {j}: {len(ids)} token(s), nothing to learn from ({t[:60]!r})"
            )
        seqs.append(ids)
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), pad_id, dtype=torch.long)
    real = torch.zeros(len(seqs), S, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        real[i, : len(s)] = True
    return ids, real


def lm_loss(logits: Tensor, ids: Tensor, real: Tensor) -> Tensor:
    """Mean next-token cross-entropy over real target positions: logits (B, S, V), ids,
    real (B, S)."""
    tgt = ids[:, 1:].masked_fill(~real[:, 1:], -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tgt.flatten(), ignore_index=-100)


def load_background(folder: str | Path, model: nn.Module) -> dict[int, BackgroundCounts]:
    """The background counts of every memory layer of `model`, from `folder` (layer_{i}/ each);
    a missing layer or another memory size: an error naming it."""
    out = {}
    for i, b in enumerate(model.blocks):
        if getattr(b, "pkm", None) is not None:
            out[i] = BackgroundCounts.load(Path(folder) / f"layer_{i}", n_slots=b.pkm.cfg.n_slots)
    if not out:
        raise ValueError(
            "sparse_memory finetuning needs a model with a memory layer (model.pkm); this run has "
            "none"
        )
    return out


class Finetuner:
    """Applies one method to an in-memory anchor (`AnchorLM`, or a Hugging Face causal LM):
    `step(ids, real)` per batch.

    The model is changed in place (LoRA adapters are added on construction and folded back by
    `finish`; an HF model's memory adapters stay hooked in after `finish`, `hf_adapter`).
    background: per memory layer, required by sparse_memory with ranking tfidf."""

    def __init__(
        self,
        model: nn.Module,
        spec: FinetuneSpec,
        *,
        background: dict[int, BackgroundCounts] | None = None,
    ) -> None:
        self.model, self.spec = model, spec
        self.hf = not hasattr(
            model, "blocks"
        )  # memtree's AnchorLM has blocks; an HF model, decoder layers
        self.hf_adapter: HFMemAdapter | None = None
        self.memory = (
            {}
            if self.hf
            else {
                i: b.pkm for i, b in enumerate(model.blocks) if getattr(b, "pkm", None) is not None
            }
        )
        self.background = background or {}
        if spec.method == "sparse_memory":
            if not self.memory:
                raise ValueError(
                    "method sparse_memory needs a model with a memory layer (model.pkm); this one "
                    "has none"
                )
            if spec.ranking == "tfidf":
                missing = sorted(set(self.memory) - set(self.background))
                if missing:
                    raise ValueError(
                        f"no background counts for memory layer(s) {missing}: collect them first "
                        "(memtree train finetune-background RUN)"
                    )
                for i, m in self.memory.items():
                    if self.background[i].doc_freq.numel() != m.cfg.n_slots:
                        raise ValueError(
                            f"layer {i}: background counts cover "
                            f"{self.background[i].doc_freq.numel()} slots, the memory has "
                            f"n_slots={m.cfg.n_slots}"
                        )
            for p in model.parameters():
                p.requires_grad_(False)
            params = [m.values.weight for m in self.memory.values()]
            for p in params:
                p.requires_grad_(True)
        elif spec.method in ("lora", "mem_adapter+lora"):
            alpha = spec.lora_alpha or 2.0 * spec.lora_rank
            self.wrapped = add_lora(
                model, rank=spec.lora_rank, alpha=alpha, targets=spec.lora_targets
            )
            params = [p for p in model.parameters() if p.requires_grad]
        elif spec.method == "mem_adapter":
            for p in model.parameters():
                p.requires_grad_(False)
            params = []
        else:
            for p in model.parameters():
                p.requires_grad_(True)
            params = list(model.parameters())
        groups = None
        self.adapter = None
        if spec.method.startswith("mem_adapter"):
            # the adapters' init follows the torch seed the caller set, like LoRA's A
            seed = int(torch.initial_seed()) % 2**31
            if self.hf:  # the base's trainability is set above (frozen, or LoRA's alone)
                self.hf_adapter = HFMemAdapter(model, spec.adapter, seed=seed, freeze_base=False)
                mem = self.hf_adapter.adapter_parameters()
            else:
                if (
                    model.config.moc is None
                ):  # a pretrained MoC model keeps (and trains) its own memory
                    self.adapter = attach_to_anchor(model, spec.adapter, seed=seed)
                mem = adapter_groups(model, spec.adapter)
            dense = params + [p for p in mem["layers"] + mem["kv"] if p.requires_grad]
            bank = [p for p in mem["bank"] if p.requires_grad]
            groups = [{"params": dense}] + (
                [{"params": bank, "lr": spec.lr * spec.adapter.bank_lr_factor, "weight_decay": 0.0}]
                if bank
                else []
            )
            params = dense + bank
        self.params = params
        self.n_trainable = sum(p.numel() for p in {id(p): p for p in params}.values())
        if spec.resolved_optimizer == "sgd":
            # plain SGD (no momentum, no decay): the only torch optimizer that takes the memory's
            # sparse gradients as they are, and the seed's choice for sparse memory finetuning
            self.opt = torch.optim.SGD(params, lr=spec.lr)
        else:
            self.opt = MemoryAdamW(
                groups or params,
                lr=spec.lr,
                betas=(0.9, 0.999),
                weight_decay=spec.resolved_weight_decay,
            )
        self.n_steps = 0

    def step(self, ids: Tensor, real: Tensor, *, where: str = "") -> dict[str, Any]:
        """One gradient step on a batch: ids, real (B, S). Returns the loss and, for
        sparse_memory, per layer the slots accessed and trained."""
        self.module.train()
        rec = {}
        sparse = self.spec.method == "sparse_memory"
        with (
            recording(self.model) if sparse else contextlib.nullcontext() as logs
        ):  # only sparse needs the slots
            logits = (
                self.model(input_ids=ids, use_cache=False).logits if self.hf else self.model(ids)
            )
            loss = lm_loss(logits, ids, real)
        aux = None
        if self.spec.method.startswith("mem_adapter"):
            aux = self.hf_adapter.aux_loss() if self.hf else self.model.moc_aux_loss()
        self.opt.zero_grad(set_to_none=True)
        (loss if aux is None else loss + aux).backward()
        if sparse:
            for i, m in self.memory.items():
                counts = access_counts(logs[i][-1], m.cfg.n_slots, real)
                accessed = int((counts > 0).sum())
                if self.spec.ranking == "all":
                    keep = counts > 0
                else:
                    if self.spec.ranking == "tfidf":
                        df, n_bg = self.background[i].doc_freq, self.background[i].n_batches
                    else:  # TF only: an empty background gives every slot the same IDF, log 2
                        df, n_bg = torch.zeros_like(counts), 1
                    try:
                        keep = trainable_rows(counts, df, n_bg, self.spec.top_t)
                    except ValueError as e:
                        raise ValueError(f"{where}: layer {i}: {e}") from None
                g = m.values.weight.grad
                if g is not None:
                    m.values.weight.grad = keep_rows(g, keep)
                rec[f"layer_{i}"] = {"accessed": accessed, "trained": int(keep.sum())}
        self.opt.step()
        self.module.eval()
        self.n_steps += 1
        return {"loss": float(loss), **rec}

    @property
    def module(self) -> nn.Module:
        """What trains: the model, or the HF memory adapter that holds it beside its own modules."""
        return self.hf_adapter if self.hf_adapter is not None else self.model

    def added_state(self) -> dict[str, Tensor]:
        """Tensors the finetune added outside the model's state dict: an HF model's memory
        adapters."""
        if self.hf_adapter is None:
            return {}
        return {
            f"mem_adapter.{k}": v
            for k, v in self.hf_adapter.state_dict().items()
            if not k.startswith("hf.")
        }

    def finish(self) -> None:
        """Fold LoRA adapters into the weights and leave every parameter frozen."""
        if self.spec.method in ("lora", "mem_adapter+lora"):
            merge_lora(self.model)
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.opt.zero_grad(set_to_none=True)


def snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changes(
    before: dict[str, Tensor], model: nn.Module, *, added: dict[str, Tensor] | None = None
) -> dict[str, Any]:
    """What finetuning changed: parameters (elements), bytes (elements × their size), and per
    tensor the rows (first dimension) that differ: what a device would have to rewrite. Tensors
    the finetune added (memory adapters: new keys of the state dict, or `added` beside it) count
    under added_elements / added_bytes."""
    after = model.state_dict()
    gone = sorted(set(before) - set(after))
    if gone:
        raise ValueError(f"state dict keys disappeared: {gone[:4]}")
    new = [after[k] for k in sorted(set(after) - set(before))] + list((added or {}).values())
    n = rows = nbytes = 0
    tensors = {}
    for k, b in before.items():
        a = after[k]
        diff = a != b
        c = int(diff.sum())
        if c:
            r = int(diff.flatten(1).any(1).sum()) if diff.dim() > 1 else 1
            tensors[k] = {
                "elements": c,
                "rows": r,
                "of_rows": int(a.shape[0]) if a.dim() > 1 else 1,
            }
            n += c
            rows += r
            nbytes += c * a.element_size()
    total = sum(t.numel() for t in before.values())
    return {
        "elements": n,
        "of_elements": total,
        "bytes": nbytes,
        "rows": rows,
        "tensors": tensors,
        "added_elements": sum(t.numel() for t in new),
        "added_bytes": sum(t.numel() * t.element_size() for t in new),
    }


def finetune_stream(
    model: nn.Module,
    batches: Iterable[tuple[str, Tensor, Tensor]],
    spec: FinetuneSpec,
    *,
    background: dict[int, BackgroundCounts] | None = None,
    progress: bool = True,
    on_record: Callable[[int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Stream (record id, ids, real) batches through `Finetuner`; returns the step log, the
    trainable parameters (counted on the built modules) and what changed. The model is changed in
    place and left in eval mode with LoRA merged (an HF model keeps its memory adapters hooked
    in)."""
    before = snapshot(model)
    ft = Finetuner(model, spec, background=background)
    log = []
    t0 = time.time()
    for k, (rid, ids, real) in enumerate(
        tqdm(batches, desc=f"finetune {spec.label}", disable=not progress)
    ):
        for _ in range(spec.steps_per_batch):
            rec = ft.step(ids, real, where=f"record {rid}")
        log.append({"record": rid, **rec})
        if on_record is not None:
            on_record(k, rec)
    ft.finish()
    return {
        "records": len(log),
        "steps": ft.n_steps,
        "seconds": round(time.time() - t0, 2),
        "log": log,
        "trainable": ft.n_trainable,
        "changed": changes(before, model, added=ft.added_state()),
    }


def read_stream(path: str | Path, max_records: int = 0) -> list[tuple[str, list[str]]]:
    """The JSONL stream as (id, texts); a record without a non-empty list of strings under
    "texts" is an error naming the file and line."""
    out = []
    for n, rec in iter_jsonl(path):
        texts = rec.get("texts")
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{path}:{n}: a record needs 'texts', a non-empty list of strings")
        out.append((str(rec.get("id", n)), texts))
        if max_records and len(out) == max_records:
            break
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def check_run_folder(run: str | Path, key: str = "run") -> None:
    """`run` is a finished training run (its memtree_config.json and anchor.safetensors), else a
    ConfigError naming `key`, the path and what writes such a folder."""
    missing = [
        n for n in ("memtree_config.json", "anchor.safetensors") if not (Path(run) / n).is_file()
    ]
    if missing:
        raise ConfigError(
            f"{key}={run}: not a finished training run (no {' or '.join(missing)} there); give the "
            "save_folder of a `memtree train` run (a memory-layer model, model.pkm, for sparse "
            "memory finetuning; `memtree eval continual ROOT` trains one into ROOT/train/pkm)"
        )


def check_finetune_inputs(cfg: FinetuneConfig) -> None:
    """The finetune's inputs exist, before anything is loaded or written: an error names the key,
    the path and what produces the file."""
    check_run_folder(cfg.run)
    if not Path(cfg.data).is_file():
        raise ConfigError(
            f"data={cfg.data}: no such file; give a JSONL stream of batches, one "
            '{"id", "texts": [...]} record each (`memtree eval continual ROOT` writes one to '
            "ROOT/continual/stream.jsonl)"
        )
    tfidf = cfg.spec.method == "sparse_memory" and cfg.spec.ranking == "tfidf"
    if tfidf and cfg.background and not Path(cfg.background).is_dir():
        raise ConfigError(
            f"background={cfg.background}: no such folder; `memtree train finetune-background RUN` "
            f"collects a run's counts into RUN/{BACKGROUND_DIR} (or set spec.ranking=tf or all, "
            "which need none)"
        )


def finetune(cfg: FinetuneConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run a finetune from a config (the `memtree train finetune` command); returns finetune.json's
    record."""
    torch.manual_seed(cfg.seed)
    out = Path(cfg.save_folder)
    if (out / "finetune.json").exists():
        raise ValueError(
            f"{out} already holds a finished finetune (finetune.json); choose another save_folder"
        )
    check_finetune_inputs(cfg)
    composer_model, _train_cfg, manifest, tokenizer = load_run(cfg.run)
    model = composer_model.model
    bg_dir = Path(cfg.background or Path(cfg.run) / BACKGROUND_DIR)
    background = None
    if cfg.spec.method == "sparse_memory" and cfg.spec.ranking == "tfidf":
        try:
            background = load_background(bg_dir, model)
        except ValueError as e:
            if "no background counts" not in str(e):
                raise
            raise ValueError(
                f"{e} (`memtree train finetune-background {cfg.run}` collects them)"
            ) from None
    records = read_stream(cfg.data, cfg.max_records)
    pad_id, limit = int(manifest["eot_id"]), model.config.max_seq_len

    def batches():
        for rid, texts in records:
            ids, real = batch_tensors(
                texts,
                lambda t: tokenizer.encode(t).ids,
                pad_id=pad_id,
                max_len=limit,
                where=f"{cfg.data} record {rid}:",
            )
            yield rid, ids, real

    result = finetune_stream(model, batches(), cfg.spec, background=background, progress=progress)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "anchor.safetensors") as tmp:
        save_file(
            {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(tmp)
        )
    run_config = read_json(Path(cfg.run) / "memtree_config.json")
    if model.config.moc is not None:  # memory adapters were added: the run reopens with them
        run_config["config"]["model"]["moc"] = to_dict(model.config.moc)
    atomic_write_json(out / "memtree_config.json", run_config)
    if bg_dir.is_dir() and not (out / BACKGROUND_DIR).exists():
        shutil.copytree(bg_dir, out / BACKGROUND_DIR)
    record = {
        "format": FINETUNE_FORMAT,
        "version": FINETUNE_VERSION,
        "config": json.loads(json.dumps(dataclasses.asdict(cfg))),
        "label": cfg.spec.label,
        "optimizer": cfg.spec.resolved_optimizer,
        "weight_decay": cfg.spec.resolved_weight_decay,
        **result,
    }
    atomic_write_json(out / "finetune.json", record)
    return record


def collect_run_background(
    run: str | Path,
    *,
    batches: int = 1000,
    batch_size: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> dict[int, Path]:
    """Collect a run's background counts over `batches` batches of its own pretraining shards and
    store them with the checkpoint (run/pkm_background/layer_{i}, replaced whole); returns the
    folders. Default: 1,000 batches (the seed's count) of one training window each, about as many
    tokens as a finetuning batch of a fact's paraphrases (BackgroundCounts says why that
    matters)."""
    check_run_folder(run, key="RUN")
    composer_model, train_cfg, _, _ = load_run(run)
    loader = build_dataloader(
        train_cfg.data.shards,
        batch_size=batch_size,
        shuffle=True,
        shuffle_seed=seed,
        drop_last=False,
    )
    counts = collect_background(composer_model.model, loader, batches, progress=progress)
    with atomic_dir(Path(run) / BACKGROUND_DIR) as tmp:
        for i, bg in counts.items():
            bg.source = (
                f"{train_cfg.data.shards} (shuffle seed {seed}, {batch_size} sequence(s) per batch)"
            )
            bg.save(tmp / f"layer_{i}")
    return {i: background_dir(run, i) for i in counts}


def finetune_summary(path: str | Path) -> dict[str, Any]:
    """finetune.json read back, with a check of its format."""
    rec = read_json(path)
    check_format(rec, FINETUNE_FORMAT, FINETUNE_VERSION, path)
    return rec
