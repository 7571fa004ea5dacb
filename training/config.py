"""Training configuration: YAML (llm-foundry style) validated into keyword-only dataclasses.

`memtree train run CONFIG.yaml key=value …` and
`composer -n N -m memtree.training.train CONFIG.yaml …` both go through `load_train_config`;
unknown keys and bad values are errors that name the key (and the allowed values). See
`training/yamls/` for examples.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from memtree.config import ConfigError, TimeString, is_int, load_config, to_dict
from memtree.geometry import (
    ANCHOR_PRESETS,
    AnchorShape,
    MemoryConfig,
    check_memory_shape,
    get_anchor,
)
from memtree.pretrained import SPECS as PRETRAINED
from memtree.training.hf import anchor_shape_from_hf
from memtree.training.layers.moc import READS, MoCConfig
from memtree.training.layers.pkm import PKMConfig
from memtree.training.model import ModelConfig

# how memory reads run (MemorySection.read); MemtreeLM takes all but "auto", which training resolves
MEMORY_READS: tuple[str, ...] = ("auto", *READS)

Mode = Literal["baseline", "frozen", "cotrain", "scratch"]


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    # a memtree.geometry preset name, "custom" with `shape`, or a named pretrained model
    # (memtree.pretrained: smollm2-135m, gemma3-270m), which becomes `hf_dir` when the config loads
    anchor: str = "tiny"
    shape: dict[str, Any] = field(default_factory=dict)  # AnchorShape fields overriding the preset
    vocab_size: int | None = None  # None: the shards' tokenizer vocabulary
    max_seq_len: int | None = None  # None: the shards' seq_len
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    lora_alpha: float = 1.0
    hf_dir: str | None = None  # post-hoc memories on this local HF causal LM (it is the anchor)
    moc: MoCConfig | None = (
        None  # Mixture-of-Chapters memory layers (training/layers/moc.py), mode 'baseline'
    )
    pkm: PKMConfig | None = (
        None  # product-key memory layers replacing FFNs (training/layers/pkm.py), mode 'baseline'
    )
    # document-masked attention: "sdpa" (dense mask), "flex" (block-sparse FlexAttention),
    # "auto" = flex on a GPU, sdpa on the CPU
    attn_impl: Literal["auto", "sdpa", "flex"] = "auto"


@dataclass(frozen=True, kw_only=True)
class MemorySection:
    """The `memory:` section: the one typed memory configuration from YAML to model, checked once
    here. Its shape (multipliers, type, placement, layers) becomes the bank's geometry
    (`geometry`: `memtree.geometry.MemoryConfig`, what memstore writes in a bank's manifest) once
    the shards give the tree's branching; the rest is how the model trains and reads its memory,
    and `MemtreeLM` takes this section as it is."""

    multipliers: tuple[int, ...] = ()  # empty: no memory (baseline)
    type: Literal["ffn", "lora-qk", "lora-ov", "lora-ffn", "kv"] = "ffn"
    placement: Literal["uniform", "early", "middle", "late", "explicit"] = "uniform"
    placement_layers: int = 10
    layers: tuple[int, ...] = ()
    generic_prob: float | None = None  # None: 1 / branching (seed 002 §4)
    # Probability that a training forward runs the anchor alone (no fetched or generic memory), so
    # the anchor keeps learning what every sequence shares and a fetched block does not override it
    # on entities it was not built for (the probes' most frequent facts; docs/BENCHMARKS.md).
    # 0: the paper.
    dropout: float = 0.0
    lr: float = 1e-3
    # One bank learning rate per tree level (as long as multipliers; a level without memory takes
    # any value), in place of `lr`: e.g. a low level-2 LR, so that the blocks many documents share
    # generalise, and a high leaf LR for the tail
    # (docs/benchmarks/2026-11-27-memory-families-2-core-vm.md, "A bank learning rate per level on
    # real text"). Empty: `lr` for all.
    lr_by_level: tuple[float, ...] = ()
    weight_decay: float = 0.0
    init_std: float = 0.02
    export_dtype: Literal["fp32", "bf16", "fp16", "int8", "int4"] = "bf16"
    init_bank: str | None = None  # start from this memstore bank (e.g. merged per-subtree banks)
    # "fused": KV/FFN memories read in place from the bank by the fused kernels (no per-sequence
    # copies); "gather": copy each sequence's blocks first; "auto": on a GPU, whichever a short
    # timed probe of both at start-up finds faster (fused only if <= 0.95x gather's step time;
    # cached per device / shape / batch / precision in $MEMTREE_CACHE_DIR/read-probe.json, default
    # ~/.cache/memtree; training/read_choice.py), gather on the CPU (where the fused ops run their
    # slower reference). LoRA memories are always gathered. Mixture-of-Chapters layers take the same
    # choice ("gather": SDPA on gathered chapters, the log-weights in a widened head) and, in "bias"
    # mode, "flex" (FlexAttention through a block mask from the block table; MoC only).
    read: Literal["auto", "fused", "gather", "flex"] = "auto"

    def __post_init__(self) -> None:
        try:
            multipliers = check_memory_shape(
                self.multipliers,
                type=self.type,
                placement=self.placement,
                layers=self.layers,
                allow_empty=True,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        object.__setattr__(self, "multipliers", multipliers)
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "lr_by_level", tuple(self.lr_by_level))
        if self.read not in MEMORY_READS:
            raise ConfigError(
                f"memory.read: the memory read {self.read!r} is not one of {list(MEMORY_READS)}"
            )
        gp = self.generic_prob
        if gp is not None and not 0 <= gp <= 1:
            raise ConfigError(f"memory.generic_prob: {gp} must be in [0, 1]")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"memory.dropout: {self.dropout} must be in [0, 1)")
        by_level = self.lr_by_level
        # without multipliers there is no bank (an anchor stage that shares its memory section)
        if by_level and multipliers and len(by_level) != len(multipliers):
            raise ConfigError(
                f"memory.lr_by_level: {len(by_level)} learning rates for "
                f"{len(multipliers)} levels (memory.multipliers); give one per level"
            )
        if any(not lr > 0 for lr in by_level):
            raise ConfigError(
                f"memory.lr_by_level: {list(by_level)}: every learning rate must be > 0"
            )

    def geometry(self, branching: int) -> MemoryConfig | None:
        """The bank's shape for a tree of `branching` children per node; None without memory."""
        if not any(self.multipliers):
            return None
        try:
            return MemoryConfig(
                multipliers=self.multipliers,
                type=self.type,
                placement=self.placement,
                placement_layers=self.placement_layers,
                layers=self.layers,
                branching=branching,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass(frozen=True, kw_only=True)
class DataSection:
    shards: str  # a pipeline run's shards/ directory (memtree-shards v1)
    subtrees: list[int] | None = None  # per-subtree job: train only these level-1 subtrees
    batch_size: int = 8  # global batch (sequences)
    shuffle: bool = True
    shuffle_seed: int = 0
    num_workers: int = 0
    # False: an epoch sees every sample exactly once (the last batch may be short), so exposure
    # counts (documents × epochs) are exact; True drops the ragged last batch of each epoch.
    drop_last: bool = True
    eval_fraction: float = 0.0  # reserved for held-out evaluation by eval/
    # check every shard file the run reads (compressed and decompressed copies) against the size
    # and hash its MDS index records before the Trainer is built (training.data.verify_shards);
    # not part of the fingerprint (it does not change what is trained)
    verify_shards: bool = True

    def __post_init__(self) -> None:
        # checked here, before the run's folder is written: a 0 or negative batch used to surface
        # as a negative epoch duration or a stray iterator traceback
        for key, low in (("batch_size", 1), ("num_workers", 0), ("shuffle_seed", 0)):
            v = getattr(self, key)
            if not is_int(v) or v < low:
                raise ConfigError(f"data.{key}: must be an integer >= {low}, got {v!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction: must be in [0, 1), got {self.eval_fraction!r}")
        if self.subtrees is not None and any(not is_int(s) or s < 0 for s in self.subtrees):
            raise ConfigError(
                f"data.subtrees: level-1 subtree indices (integers >= 0), got {self.subtrees!r}"
            )


@dataclass(frozen=True, kw_only=True)
class OptimSection:
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.05
    warmup: TimeString = "10ba"
    alpha_f: float = 0.1  # cooldown LR as a fraction of the peak
    max_grad_norm: float | None = 1.0
    moc_bank_lr: float | None = None  # MoC latent bank(s); None: lr
    moc_layer_lr: float | None = (
        None  # MoC routers, memory attention and variation-2 FFNs; None: lr
    )
    # memory-layer values (model.pkm), their own group without weight decay (a row is decayed only
    # when read, so decay would punish rarely read slots); None: lr and weight_decay like the rest
    pkm_value_lr: float | None = None


@dataclass(frozen=True, kw_only=True)
class ParallelSection:
    """How a multi-rank run splits the bank and the data (training/README.md, "Several ranks")."""

    # "replicated": every rank holds the whole bank and its AdamW state; sparse gradients are
    # all-gathered. "sharded": a rank holds some level-1 subtrees' rows (and their state) only,
    # reads only their data, and only the generic rows are all-reduced (training/bank_shards.py).
    bank: Literal["replicated", "sharded"] = "replicated"
    # "uniform": Streaming's shuffled order over all streams, dealt round-robin to the ranks;
    # "lanes": per-subtree lanes with a fixed share of every global batch (training/lanes.py);
    # "auto": lanes with a sharded bank, uniform otherwise
    data: Literal["auto", "uniform", "lanes"] = "auto"
    # G memory-parallel groups (each of world / G ranks holding the same rows); None: the largest
    # divisor of the world size that is at most the number of subtrees with data. Not part of the
    # fingerprint: it places the same computation on the ranks.
    bank_shards: int | None = None


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    data: DataSection
    run_name: str = "memtree"
    save_folder: str = "runs/train"
    mode: Mode = "baseline"
    anchor_checkpoint: str | None = (
        None  # frozen / cotrain: a Composer checkpoint of an anchor-only run
    )
    model: ModelSection = field(default_factory=ModelSection)
    memory: MemorySection = field(default_factory=MemorySection)
    optim: OptimSection = field(default_factory=OptimSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    max_duration: TimeString = "20ba"
    seed: int = 0
    device: Literal["auto", "cpu", "gpu"] = "auto"
    precision: Literal["auto", "fp32", "amp_bf16", "amp_fp16"] = "auto"
    # TF32 for fp32 matmuls on a GPU (torch's and the Triton kernels' dots): Composer's DeviceGPU
    # turns it on by default, so an fp32 GPU run is not IEEE fp32 unless this is false
    allow_tf32: bool = True
    microbatch_size: int | None = None
    save_interval: TimeString = "1000ba"
    save_num_checkpoints_to_keep: int = 2
    autoresume: bool = False
    log_interval: TimeString = "1ba"
    progress_bar: bool = False
    fsdp: bool = False
    # "retain": glibc malloc keeps freed tensor memory for reuse (no per-step mmap / page faults,
    # training/host_alloc.py); "system": malloc's defaults; "auto": retain when training on the CPU
    host_allocator: Literal["auto", "retain", "system"] = "auto"
    # torch's intra-op threads per rank on the CPU: "auto" = the usable cores (the process's
    # affinity) / the node's ranks, at least 1, when the node runs several ranks and
    # OMP_NUM_THREADS is unset (otherwise torch's count stands); N: N threads. torch's own
    # default gives every rank every core, which N ranks on a node oversubscribe N times. GPU
    # runs are left as they are (training/ranks.py)
    cpu_threads: int | Literal["auto"] = "auto"
    # count the anchor's DDP gradient all-reduce in comm/bytes/* through a DDP comm hook (the
    # default all-reduce, wrapped); false: the step's sum is logged as step_total_excl_anchor
    comm_ddp_hook: bool = True

    def __post_init__(self) -> None:
        if self.mode == "baseline" and self.memory.multipliers:
            raise ConfigError(
                "memory.multipliers: mode 'baseline' trains no memory; set mode to "
                "'frozen', 'cotrain' or 'scratch', or leave memory.multipliers empty"
            )
        if self.mode != "baseline" and not any(self.memory.multipliers):
            raise ConfigError(
                f"memory.multipliers: mode {self.mode!r} needs a non-zero memory configuration"
            )
        if self.mode in ("frozen", "cotrain") and not (
            self.anchor_checkpoint or self.model.hf_dir or self.model.anchor in PRETRAINED
        ):
            raise ConfigError(
                f"anchor_checkpoint: mode {self.mode!r} starts from a trained anchor; give its "
                "checkpoint (or use mode 'scratch')"
            )
        if (
            self.model.anchor not in ANCHOR_PRESETS
            and self.model.anchor not in PRETRAINED
            and self.model.anchor != "custom"
        ):
            raise ConfigError(
                f"model.anchor: {self.model.anchor!r} is not one of "
                f"{sorted(ANCHOR_PRESETS) + ['custom']} nor a pretrained model {sorted(PRETRAINED)}"
            )
        if self.model.anchor in PRETRAINED and self.mode == "baseline":
            raise ConfigError(
                f"model.anchor: {self.model.anchor!r} is a pretrained model, which gets its "
                "memories post-hoc: use mode 'frozen' (Table 2) or 'cotrain', with "
                "memory.multipliers"
            )
        if self.model.moc is not None:
            if self.mode != "baseline":
                raise ConfigError(
                    f"model.moc: a Mixture-of-Chapters model trains from scratch without "
                    f"hierarchical memories; use mode 'baseline', not {self.mode!r}"
                )
            if self.model.hf_dir:
                raise ConfigError(
                    "model.moc: not supported with model.hf_dir (the anchor must be AnchorLM)"
                )
            if self.fsdp:
                raise ConfigError(
                    "fsdp: the MoC latent bank's sparse gradients cannot be sharded; "
                    "multi-GPU MoC runs use DDP (leave fsdp false)"
                )
            if self.memory.read == "flex" and self.model.moc.weight_mode == "mix":
                raise ConfigError(
                    "memory.read: 'flex' has one joint softmax; model.moc.weight_mode 'mix' "
                    "(a softmax per chapter) reads with 'fused', 'gather' or 'auto'"
                )
        elif self.memory.read == "flex":
            raise ConfigError(
                "memory.read: 'flex' reads Mixture-of-Chapters layers only (model.moc); KV / FFN "
                "memories read with 'auto', 'fused' or 'gather'"
            )
        if self.model.pkm is not None:
            if self.mode != "baseline":
                raise ConfigError(
                    f"model.pkm: a memory-layer model trains without hierarchical memories; "
                    f"use mode 'baseline', not {self.mode!r}"
                )
            if self.model.hf_dir or self.model.moc is not None:
                raise ConfigError(
                    "model.pkm: not with model.hf_dir or model.moc (one kind of memory per model)"
                )
            if self.fsdp:
                raise ConfigError(
                    "fsdp: the memory layer's sparse value gradients cannot be sharded; use DDP"
                )
        par = self.parallel
        if par.bank == "sharded":
            if not any(self.memory.multipliers):
                raise ConfigError(
                    "parallel.bank: 'sharded' splits the memory bank, and this run has none "
                    "(memory.multipliers is empty)"
                )
            if par.data == "uniform":
                raise ConfigError(
                    "parallel.data: 'uniform' sends any rank any subtree's sequences, whose rows a "
                    "sharded bank keeps on other ranks (that exchange is not built); use 'lanes' "
                    "or 'auto'"
                )
            if self.fsdp:
                raise ConfigError(
                    "parallel.bank: 'sharded' with fsdp: true is not supported yet (not run on "
                    "GPUs); shard the bank with DDP for the anchor (fsdp: false)"
                )
            if self.data.subtrees is not None and len(self.data.subtrees) == 1:
                raise ConfigError(
                    "parallel.bank: 'sharded' with a per-subtree job (data.subtrees of one): its "
                    "bank is that subtree's rows already"
                )
        if par.bank_shards is not None and par.bank_shards < 1:
            raise ConfigError(f"parallel.bank_shards: {par.bank_shards} must be at least 1")
        t = self.cpu_threads
        if t != "auto" and (not isinstance(t, int) or isinstance(t, bool) or t < 1):
            raise ConfigError(
                f"cpu_threads: {t!r} must be 'auto' or a whole number of threads >= 1"
            )

    @property
    def pretrained(self) -> str | None:
        """The named pretrained anchor (memtree.pretrained), or None."""
        return self.model.anchor if self.model.anchor in PRETRAINED else None

    @property
    def data_lanes(self) -> bool:
        """Whether the run reads per-subtree lanes (training/lanes.py) rather than uniform
        batches."""
        par = self.parallel
        return par.data == "lanes" or (par.data == "auto" and par.bank == "sharded")

    def anchor_shape(self, vocab_size: int) -> AnchorShape:
        if self.model.hf_dir:
            from transformers import AutoConfig

            shape = anchor_shape_from_hf(
                AutoConfig.from_pretrained(self.model.hf_dir, local_files_only=True)
            )
            if shape.vocab_size < vocab_size:
                raise ConfigError(
                    f"model.hf_dir: the model's vocabulary ({shape.vocab_size}) is smaller than "
                    f"the shards' tokenizer ({vocab_size}); tokenize with the model's own tokenizer"
                )
            return shape
        fields = {f.name for f in dataclasses.fields(AnchorShape)}
        unknown = sorted(set(self.model.shape) - fields)
        if unknown:
            raise ConfigError(f"model.shape: unknown key(s) {unknown}; allowed: {sorted(fields)}")
        if self.model.anchor == "custom":
            base = dict(self.model.shape)
            base.setdefault("name", "custom")
        else:
            base = {**dataclasses.asdict(get_anchor(self.model.anchor)), **self.model.shape}
        base["vocab_size"] = self.model.vocab_size or vocab_size
        try:
            return AnchorShape(**base)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model: {e}") from None

    def memory_config(self, branching: int) -> MemoryConfig | None:
        """The bank's geometry (`MemorySection.geometry`) for the shards' `branching`."""
        return self.memory.geometry(branching)

    def model_config(
        self, anchor: AnchorShape, memory: MemoryConfig | None, *, seq_len: int, attn_impl: str
    ) -> ModelConfig:
        """The `model:` section as the model's architecture, for `anchor` (`anchor_shape`) with
        `memory` (`memory_config`); `seq_len`: the shards' window, the default `max_seq_len`;
        `attn_impl`: `model.attn_impl` resolved for the device (training.train.attn_impl)."""
        m = self.model
        try:
            return ModelConfig(
                anchor=anchor,
                memory=memory,
                max_seq_len=m.max_seq_len or seq_len,
                rope_theta=m.rope_theta,
                norm_eps=m.norm_eps,
                init_std=m.init_std,
                lora_alpha=m.lora_alpha,
                moc=m.moc,
                pkm=m.pkm,
                attn_impl=attn_impl,
            )
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None

    def fingerprint(self) -> str:
        """Hash of everything that shapes the model and its data: a checkpoint from a run
        with a different fingerprint is refused. Duration, saving and logging may change."""
        d = to_dict(self)
        for k in (
            "max_duration",
            "save_interval",
            "save_num_checkpoints_to_keep",
            "autoresume",
            "log_interval",
            "progress_bar",
            "save_folder",
            "run_name",
            "device",
            "microbatch_size",
            "allow_tf32",
            "host_allocator",
            "cpu_threads",
            "comm_ddp_hook",
        ):
            d.pop(k, None)
        d["data"].pop(
            "verify_shards", None
        )  # a check, not a setting: runs from before it keep their fingerprint
        d["parallel"].pop("bank_shards", None)  # placement only: a run may resume on other ranks
        if self.pretrained:
            # the name says which model; where this machine's cache keeps it does not change it
            d["model"].pop("hf_dir", None)
        if d["parallel"] == {"bank": "replicated", "data": "auto"}:
            del d["parallel"]  # the defaults: runs from before the section keep their fingerprint
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def load_train_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> TrainConfig:
    """The config of `path` with `overrides`; a named pretrained anchor's `model.hf_dir` is set to
    its converted folder (converted on first use)."""
    return with_pretrained(load_config(TrainConfig, str(path) if path else None, list(overrides)))


def with_pretrained(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with a named pretrained anchor's folder as `model.hf_dir` (a given hf_dir is an error:
    the name decides the model)."""
    if not cfg.pretrained:
        return cfg
    from memtree.pretrained import PretrainedError, pretrained_dir

    if cfg.model.hf_dir:
        raise ConfigError(
            f"model.hf_dir: give either a pretrained model's name (model.anchor: {cfg.pretrained}) "
            "or a local Hugging Face folder, not both"
        )
    try:
        folder = pretrained_dir(cfg.pretrained)
    except PretrainedError as e:
        raise ConfigError(f"model.anchor: {e}") from None
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_dir=str(folder)))
