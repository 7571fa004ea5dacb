"""Build and run a Composer Trainer for a memtree config.

One process: `memtree train run CONFIG.yaml [key=value …]`.
Several ranks: `composer -n N -m memtree.training.train CONFIG.yaml [key=value …]`, or torchrun's
`-m memtree.training.train` (this module is what each rank runs; the launcher sets the distributed
environment). It works from an installed wheel and puts no stage folder on `sys.path`; in a source
checkout `composer -n N training/train.py …` runs the same file as a script.

What a run leaves in `save_folder`:
  memtree_config.yaml / memtree_config.json   the resolved config and its fingerprint
  checkpoints/                                 Composer checkpoints (model, optimizer, dataloader)
  anchor.safetensors                           the anchor's weights (input to frozen / cotrain runs)
  bank/                                        the memory bank in the memstore format
                                               (memtree-bank v1)
  metrics.json                                 final training metrics
  tpp.json                                     tokens per parameter of each memory level
                                               (memtree/tpp.py)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from memtree.config import ConfigError, dump_yaml, from_dict, to_dict
from memtree.geometry import plan
from memtree.io import atomic_path, atomic_write_json, atomic_write_text, naming_path, read_json
from memtree.memstore.format import read_manifest
from memtree.tpp import (
    bank_lr_ratio,
    format_tpp,
    leaf_tokens_from_manifest,
    parse_duration_epochs,
    tpp_table,
)
from memtree.training.bank import TrainableBank
from memtree.training.bank_shards import BankShardCheckpoints, export_bank
from memtree.training.callbacks import default_callbacks
from memtree.training.composer_model import MemtreeLM, unwrap
from memtree.training.config import MemorySection, TrainConfig, load_train_config
from memtree.training.data import (
    build_dataloader,
    read_shards_manifest,
    tokenizer_vocab_size,
    verify_shards,
)
from memtree.training.host_alloc import retain_freed_host_memory
from memtree.training.optim import MemoryAdamW
from memtree.training.parallel import parallel_layout
from memtree.training.ranks import (
    Placement,
    exit_after_lost_rank,
    last_complete_checkpoint,
    lost_rank,
    set_cpu_threads,
)
from memtree.training.read_choice import can_read_in_place, peek_batch, resolve_read

log = logging.getLogger(__name__)


def build_model(
    cfg: TrainConfig, *, shard: tuple[int, ...] | None = None, bank_init: str = "paper"
) -> tuple[MemtreeLM, dict[str, Any]]:
    """The model of `cfg`; `shard`: the level-1 subtrees whose bank rows this rank holds
    (`parallel.bank: sharded`), None for the whole bank; `bank_init`: how the bank's rows start
    ("empty": zeros, nothing drawn, for a model whose memories come from a store)."""
    manifest = read_shards_manifest(cfg.data.shards)
    vocab = tokenizer_vocab_size(cfg.data.shards, manifest)
    anchor = cfg.anchor_shape(vocab)
    memory = cfg.memory_config(int(manifest["branching"]))
    if memory is not None and memory.n_levels > int(manifest["levels"]):
        raise ConfigError(
            f"memory.multipliers: {memory.n_levels} levels, but the shards' tree has "
            f"{manifest['levels']}"
        )
    if cfg.model.vocab_size and cfg.model.vocab_size < vocab:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} is smaller than the tokenizer's {vocab}"
        )
    if cfg.model.moc is not None:
        try:  # the geometry's messages start with "moc…"
            cfg.model.moc.geometry(
                d_model=anchor.d_model, n_layers=anchor.n_layers, anchor_heads=anchor.n_heads
            )
        except ValueError as e:
            raise ConfigError(f"model.{e}") from None
    seq_len = int(manifest["seq_len"])
    subtree = (
        cfg.data.subtrees[0]
        if cfg.data.subtrees and len(cfg.data.subtrees) == 1 and memory
        else None
    )
    model = MemtreeLM(
        cfg.model_config(anchor, memory, seq_len=seq_len, attn_impl=attn_impl(cfg)),
        memory_settings=memory_settings(cfg),
        seed=cfg.seed,
        hf_dir=cfg.model.hf_dir,
        freeze_anchor=cfg.mode == "frozen",
        subtree=subtree,
        shard=shard,
        bank_init=bank_init,
    )
    if cfg.anchor_checkpoint:
        load_anchor(model, cfg.anchor_checkpoint)
    if cfg.memory.init_bank:
        if shard is not None:
            raise ConfigError(
                "memory.init_bank with parallel.bank: sharded is not supported yet: start the "
                "sharded run from scratch or an anchor, or train the bank replicated"
            )
        model.bank = load_bank(cfg.memory.init_bank, model, manifest)
        if model.hf is not None:
            model.hf.bank = model.bank
    return model, manifest


def load_run(
    save_folder: str | Path, cfg: TrainConfig | None = None
) -> tuple[MemtreeLM, TrainConfig, dict[str, Any], Any]:
    """A finished run, ready to score text: (model in eval mode with the run's anchor weights, its
    config, its shards manifest, its tokenizer). The bank is not opened here (memstore does that).
    `cfg`: the run's stored config with its paths resolved elsewhere (a run moved from where it
    trained, eval/runinfo.py); default: the config as stored."""
    folder = Path(save_folder)
    if cfg is None:
        cfg = from_dict(TrainConfig, read_json(folder / "memtree_config.json")["config"])
    # nothing to load at build time: the weights come from the run folder, the memories from its
    # bank through memstore; drawing the training bank's initial rows (seconds and GBs for a
    # pretrained anchor's bank) would be thrown away
    bare = dataclasses.replace(
        cfg,
        anchor_checkpoint=None,
        mode="scratch" if cfg.memory.multipliers else "baseline",
        memory=dataclasses.replace(cfg.memory, init_bank=None),
    )
    model, manifest = build_model(bare, bank_init="empty")
    model.model.load_state_dict(load_file(str(folder / "anchor.safetensors")))
    model.eval()
    tok_path = (Path(cfg.data.shards) / manifest["tokenizer"]).resolve()
    tokenizer = Tokenizer.from_file(
        str(tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path)
    )
    return model, cfg, manifest, tokenizer


def adopt_launcher_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Composer's distributed settings from a torchrun-style launch, returned as set.

    `composer -n N` sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and
    MASTER_PORT; torchrun (and the schedulers that follow it) names the node rank GROUP_RANK and
    sets no NODE_RANK, which Composer would then take as 0 on every node. Copied over when
    absent."""
    env = os.environ if env is None else env
    if "NODE_RANK" not in env and "GROUP_RANK" in env:
        env["NODE_RANK"] = env["GROUP_RANK"]
    return {
        k: env[k]
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
        if k in env
    }


def uses_gpu(cfg: TrainConfig) -> bool:
    """Whether the run trains on GPUs (`device: auto` means: if one is present)."""
    return torch.cuda.is_available() if cfg.device == "auto" else cfg.device == "gpu"


def attn_impl(cfg: TrainConfig) -> str:
    """`model.attn_impl` resolved: "auto" is FlexAttention where the run uses a GPU."""
    if cfg.model.attn_impl != "auto":
        return cfg.model.attn_impl
    return "flex" if uses_gpu(cfg) else "sdpa"


def memory_read(cfg: TrainConfig) -> str:
    """`memory.read` as the model is built with: explicit values as given; "auto" gathers on the
    CPU (the fused ops run their reference there, not faster:
    bench/training/training_steps.py --only read) and builds the in-place read where the run uses
    a GPU, as the candidate that `settle_memory_read` then keeps or drops by a timed probe."""
    if cfg.memory.read != "auto":
        return cfg.memory.read
    return "fused" if uses_gpu(cfg) else "gather"


def memory_settings(cfg: TrainConfig) -> MemorySection:
    """The `memory:` section as the model is built with it: `memory.read` resolved
    (`memory_read`)."""
    return dataclasses.replace(cfg.memory, read=memory_read(cfg))


def settle_memory_read(
    cfg: TrainConfig, model: MemtreeLM, loader: Any, *, device: torch.device | None, precision: str
) -> str:
    """`memory.read: auto` on a GPU (`device`; None: a CPU run) decided by measurement
    (`training.read_choice.resolve_read`: a cached or fresh probe of both reads on this model and a
    batch of the run's data, peeked without advancing `loader`); sets the model's mode and returns
    it. Rank 0 probes (its model moved to `device` first; an FSDP anchor goes back to its
    device after) and every rank takes its choice, so all ranks read alike."""
    if cfg.memory.read != "auto" or device is None or not can_read_in_place(model):
        return model.read
    from composer.utils import dist

    choice = ["gather"]
    if dist.get_global_rank() == 0:
        home = next(model.model.parameters()).device
        try:
            batch = peek_batch(loader, cfg.microbatch_size, seed=cfg.data.shuffle_seed)
            model.to(device)  # where Composer puts it anyway (an FSDP anchor goes back below)
            choice[0] = resolve_read(
                "auto", model, batch, on_gpu=True, precision=precision, allow_tf32=cfg.allow_tf32
            )
        except Exception as e:  # noqa: BLE001 — no probe batch: never leave the other ranks waiting below
            log.warning("memory.read auto: no probe (%s: %s) -> gather", type(e).__name__, e)
        if cfg.fsdp:
            model.model.to(home)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    model.read = choice[0]
    return choice[0]


def load_bank(path: str, model: MemtreeLM, manifest: dict[str, Any]):
    """A memstore bank as the starting bank, refused unless it fits this model, tree and subtree."""
    if model.bank is None:
        raise ConfigError("memory.init_bank: this run has no memory (memory.multipliers is empty)")
    info = read_manifest(path)
    problems = []
    if info.tree_id != manifest["tree_id"]:
        problems.append(f"tree {info.tree_id} vs the shards' tree {manifest['tree_id']}")
    strip = lambda a: {k: v for k, v in dataclasses.asdict(a).items() if k != "name"}
    if strip(info.anchor) != strip(model.anchor_shape):
        problems.append(
            f"anchor shape {strip(info.anchor)} vs the model's {strip(model.anchor_shape)}"
        )
    if info.memory != model.memory:
        problems.append(f"memory config {info.memory} vs {model.memory}")
    if info.subtree != model.bank.subtree:
        problems.append(f"subtree {info.subtree} vs the run's {model.bank.subtree}")
    if problems:
        raise ConfigError(
            f"memory.init_bank {path}: does not match this run: " + "; ".join(problems)
        )
    return TrainableBank.from_bank(path)


def load_anchor(model: MemtreeLM, path: str) -> None:
    """Anchor weights from `anchor.safetensors` (or a run directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "anchor.safetensors"
    if not p.exists():
        raise FileNotFoundError(
            f"anchor_checkpoint {path}: no anchor.safetensors there (a baseline run writes it)"
        )
    state = load_file(str(p))
    missing, unexpected = model.model.load_state_dict(state, strict=False)
    if unexpected or missing:
        raise ConfigError(
            f"anchor_checkpoint {p}: does not match the model "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )


def check_save_folder(cfg: TrainConfig, *, write: bool = True) -> None:
    """Refuse to resume a save folder whose checkpoints or exports come from a different config;
    with `write`, record this config there. A folder that holds only the config files of a start
    that failed before training (nothing trained yet) is taken over by the new config."""
    folder = Path(cfg.save_folder)
    meta = folder / "memtree_config.json"
    if meta.exists():
        old = read_json(meta)
        trained = _trained_outputs(folder)
        if old["fingerprint"] != cfg.fingerprint() and trained:
            new = to_dict(cfg)
            diffs = _diff(old["config"], new)
            raise ConfigError(
                f"save_folder={folder} holds checkpoints of another config ({', '.join(trained)}; "
                f"differs at {diffs[:5]}); use a new save_folder"
            )
    if not write:
        return
    folder.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"fingerprint": cfg.fingerprint(), "config": to_dict(cfg)}
    if cfg.pretrained and cfg.model.hf_dir:
        from memtree.pretrained import provenance

        record["pretrained"] = provenance(cfg.model.hf_dir)  # which weights, their hash and check
    atomic_write_json(meta, record)
    atomic_write_text(folder / "memtree_config.yaml", dump_yaml(cfg))


def _trained_outputs(folder: Path) -> list[str]:
    """What in a save folder came from training (checkpoints, exported anchor or bank), by name."""
    ckpts = folder / "checkpoints"
    found = [n for n in ("anchor.safetensors", "bank") if (folder / n).exists()]
    if ckpts.is_dir() and any(f.is_file() for f in ckpts.rglob("*")):
        found.insert(0, "checkpoints/")
    return found


def check_inputs(cfg: TrainConfig) -> None:
    """The run's input folders exist, before anything is written: an error names the key, the path
    and what produces it."""
    shards = Path(cfg.data.shards)
    if not (shards / "manifest.json").is_file():
        raise ConfigError(
            f"data.shards={shards}: no manifest.json there; give a pipeline run's shards/ "
            "directory (`memtree pipeline run … --out RUN` writes RUN/shards, "
            "`memtree pipeline demo` runs/demo/pipeline/shards)"
        )
    if cfg.anchor_checkpoint:
        p = Path(cfg.anchor_checkpoint)
        if not (p / "anchor.safetensors" if p.is_dir() or not p.suffix else p).is_file():
            raise ConfigError(
                f"anchor_checkpoint={p}: no anchor.safetensors there; give the save_folder of a "
                "finished run (a baseline run, e.g. "
                "`memtree train run training/yamls/tiny-baseline.yaml`, writes it)"
            )


def drop_unfinished_checkpoints(folder: Path) -> list[Path]:
    """Remove checkpoints newer than the one `latest-rank0.pt` points to.

    A run killed while saving leaves the newest file without the `latest` link
    updated; Composer would resume from the older one and then refuse to
    overwrite the newer name. Those files are incomplete by definition."""
    latest = folder / "latest-rank0.pt"
    if not latest.is_symlink():
        return []
    target = Path(os.readlink(latest)).name
    m = _BATCH.search(target)
    if not m:
        return []
    dropped = []
    for f in folder.glob("ep*-ba*-rank*.pt"):
        k = _BATCH.search(f.name)
        if k and int(k.group(1)) > int(m.group(1)):
            f.unlink()
            dropped.append(f)
    return dropped


_BATCH = re.compile(r"-ba(\d+)-")


def _diff(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{where}.{k}" if where else k)
        return out
    return [] if a == b else [where]


def run_tpp(cfg: TrainConfig, model: MemtreeLM, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The run's tokens-per-parameter table (memtree/tpp.py) from the shards' per-leaf counts (only
    the streams of `data.subtrees` where set) and `max_duration`; None without a hierarchical bank.
    Shards without per-leaf counts give a table-less note instead of an error: training does not
    need them."""
    if model.bank is None or model.memory is None:
        return None
    streams = [
        s
        for s in manifest["streams"]
        if cfg.data.subtrees is None or s["subtree"] in cfg.data.subtrees
    ]
    where = Path(cfg.data.shards) / "manifest.json"
    try:
        leaf = leaf_tokens_from_manifest({"streams": streams}, where)
    except ValueError as e:
        return {"error": str(e)}
    epochs = parse_duration_epochs(
        cfg.max_duration,
        epoch_tokens=sum(leaf.values()),
        epoch_samples=sum(int(s["n_samples"]) for s in streams),
        batch_size=cfg.data.batch_size,
        flag="max_duration",
    )
    dropout = (
        0.0 if cfg.mode == "frozen" else cfg.memory.dropout
    )  # a frozen anchor runs no anchor-only forwards
    ratio = bank_lr_ratio(
        bank_lr=cfg.memory.lr,
        lr_by_level=cfg.memory.lr_by_level,
        multipliers=model.memory.multipliers,
        anchor_lr=cfg.optim.lr,
    )
    table = tpp_table(
        plan(model.anchor_shape, model.memory),
        leaf,
        epochs=epochs,
        generic_prob=model.generic_prob,
        dropout=dropout,
        source=str(where),
        tree_levels=int(manifest["levels"]),
        lr_ratio=ratio,
    )
    return {"table": table, **table.to_dict()}


def record_tpp(cfg: TrainConfig, model: MemtreeLM, manifest: dict[str, Any]) -> None:
    """Log the run's TPP table at start and store it as SAVE_FOLDER/tpp.json (rank 0)."""
    from composer.utils import dist

    t = run_tpp(cfg, model, manifest)
    if t is None:
        return
    if "error" in t:
        log.warning("tokens per parameter not computed: %s", t["error"])
    else:
        text = format_tpp(t.pop("table"))
        log.info("%s", text)
        if dist.get_global_rank() == 0:
            print(text, flush=True)  # the console shows it whatever the logging level
    if dist.get_global_rank() == 0:
        atomic_write_json(Path(cfg.save_folder) / "tpp.json", t)


def bank_param_groups(bank: TrainableBank, memory: MemorySection) -> list[dict[str, Any]]:
    """The bank's optimizer groups: one at memory.lr, or one per level with memory.lr_by_level
    (level l's table at lr_by_level[l - 1])."""
    if not memory.lr_by_level:
        return [
            {
                "params": list(bank.bank_parameters()),
                "lr": memory.lr,
                "weight_decay": memory.weight_decay,
            }
        ]
    return [
        {
            "params": [table],
            "lr": memory.lr_by_level[int(lv) - 1],
            "weight_decay": memory.weight_decay,
        }
        for lv, table in bank.tables.items()
    ]


def build_trainer(
    cfg: TrainConfig, *, callbacks: list[Any] | None = None, loggers: list[Any] | None = None
):
    """The Composer Trainer for `cfg`. Before anything is built, with `data.verify_shards` (the
    default) every shard file the run reads is checked against its MDS index's size and hash
    (`training.data.verify_shards`; one read of the files, ~1 ms for the demo's 1.7 MB, disk-bound
    on large data), and a `memory.init_bank` is read through memstore's per-block digests, so
    corrupt inputs are named before any step."""
    from composer import DataSpec, Trainer
    from composer.devices import DeviceGPU
    from composer.optim import CosineAnnealingWithWarmupScheduler
    from composer.utils import dist, reproducibility

    check_inputs(cfg)
    check_save_folder(
        cfg, write=False
    )  # written once the model is built: a failed start leaves nothing
    if (
        cfg.data.verify_shards
    ):  # a flipped byte is named here, not trained on (or a zstd error mid-run)
        stats = verify_shards(cfg.data.shards, subtrees=cfg.data.subtrees)
        log.info(
            "verified %d shard files (%.1f MB) in %.2f s",
            stats["files"],
            stats["bytes"] / 1e6,
            stats["seconds"],
        )
    if cfg.autoresume:
        drop_unfinished_checkpoints(Path(cfg.save_folder) / "checkpoints")
    gpu = uses_gpu(cfg)
    if cfg.host_allocator == "retain" or (cfg.host_allocator == "auto" and not gpu):
        retain_freed_host_memory()  # before the model and the first batch allocate
    # the process group before the loader: a StreamingDataset built first opens one of its own on
    # MASTER_PORT and closes it, and the Trainer's second rendezvous on that port races the closing
    # store (a rank that reaches the dying one never joins: "1/2 clients joined" after 300 s); and
    # before the model, whose bank rows depend on the rank when the bank is sharded
    adopt_launcher_env()
    dist.initialize_dist("gpu" if gpu else "cpu")  # idempotent; the Trainer then reuses it
    # before the model and the loader allocate their thread pools' work
    threads = set_cpu_threads(cfg, gpu=gpu, local_ranks=dist.get_local_world_size())
    layout = parallel_layout(cfg)
    reproducibility.seed_all(cfg.seed)  # the model is built before the Trainer seeds anything
    model, manifest = build_model(cfg, shard=layout.shard if layout else None)
    check_save_folder(cfg)
    record_tpp(cfg, model, manifest)
    groups = []
    anchor_params = [p for p in model.anchor_parameters() if p.requires_grad]
    if cfg.optim.pkm_value_lr is not None and model.model.pkm_layers():
        values = [m.values.weight for m in model.model.pkm_layers()]
        anchor_params = [p for p in anchor_params if all(p is not v for v in values)]
        groups.append({"params": values, "lr": cfg.optim.pkm_value_lr, "weight_decay": 0.0})
    if anchor_params:
        groups.append(
            {"params": anchor_params, "lr": cfg.optim.lr, "weight_decay": cfg.optim.weight_decay}
        )
    if model.bank is not None:
        groups += bank_param_groups(model.bank, cfg.memory)
    moc_bank, moc_layers = model.moc_parameters()  # Table 6: their own learning rates
    for params, lr in ((moc_bank, cfg.optim.moc_bank_lr), (moc_layers, cfg.optim.moc_layer_lr)):
        if params:
            groups.append(
                {
                    "params": params,
                    "lr": cfg.optim.lr if lr is None else lr,
                    "weight_decay": cfg.optim.weight_decay,
                }
            )
    parallelism = fsdp_parallelism(cfg, model, gpu=gpu)
    optimizer = MemoryAdamW(
        groups,
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        max_grad_norm=cfg.optim.max_grad_norm,
        dense_sharded=parallelism is not None,
    )
    precision = cfg.precision if cfg.precision != "auto" else ("amp_bf16" if gpu else "fp32")
    extra: list[Any] = []
    if layout is None:
        loader = build_dataloader(
            cfg.data.shards,
            batch_size=cfg.data.batch_size,
            subtrees=cfg.data.subtrees,
            shuffle=cfg.data.shuffle,
            shuffle_seed=cfg.data.shuffle_seed,
            num_workers=cfg.data.num_workers,
            drop_last=cfg.data.drop_last,
        )
    else:
        loader = layout.loader(cfg)
        if layout.shard is not None:
            extra.append(layout.shard_bank(model.bank, optimizer, cfg))
    settle_memory_read(
        cfg,
        model,
        loader,
        precision=precision,
        device=torch.device("cuda", dist.get_local_rank()) if gpu else None,
    )
    # the loss is a mean over target tokens: weighting each microbatch by its share of the global
    # batch's target tokens (not of its samples) keeps the gradient that of the whole global batch,
    # whatever the world size or microbatching (elastic resumption, training/README.md)
    trainer = Trainer(
        model=model,
        train_dataloader=DataSpec(loader, get_num_tokens_in_batch=batch_tokens),
        accumulate_train_batch_on_tokens=True,
        max_duration=cfg.max_duration,
        optimizers=optimizer,
        schedulers=CosineAnnealingWithWarmupScheduler(
            t_warmup=cfg.optim.warmup, alpha_f=cfg.optim.alpha_f
        ),
        # the bank shards' saver first: Composer appends its own checkpoint saver after these
        callbacks=[
            *extra,
            Placement(cfg, layout, threads),
            *default_callbacks(comm_ddp_hook=cfg.comm_ddp_hook),
            *(callbacks or []),
        ],
        loggers=loggers,
        run_name=cfg.run_name,
        save_folder=str(Path(cfg.save_folder) / "checkpoints"),
        save_interval=cfg.save_interval,
        save_num_checkpoints_to_keep=cfg.save_num_checkpoints_to_keep,
        save_overwrite=not cfg.autoresume,
        device=DeviceGPU(allow_tf32=cfg.allow_tf32) if gpu else "cpu",
        precision=precision,
        seed=cfg.seed,
        **resume_args(cfg),
        device_train_microbatch_size=microbatch_size(cfg, layout, gpu=gpu),
        progress_bar=cfg.progress_bar,
        log_to_console=not cfg.progress_bar,
        console_log_interval=cfg.log_interval,
        parallelism_config=parallelism,
        step_schedulers_every_batch=True,
        # lanes position themselves from the restored timestamp instead of replaying skipped batches
        spin_dataloaders=layout is None,
    )
    if layout is not None:
        loader.batch_sampler.bind(
            lambda: (
                int(trainer.state.timestamp.epoch),
                int(trainer.state.timestamp.batch_in_epoch),
            )
        )
    return trainer


def resume_args(cfg: TrainConfig) -> dict[str, Any]:
    """How the Trainer resumes: Composer's `autoresume`, except across several nodes.

    Composer's autoresume names a signal file in the save folder after node 0 on every node, and
    each node's local rank 0 deletes it: nodes sharing the save folder (NFS, Lustre; the usual
    multi-node setup) race on it, and all but one fail with FileNotFoundError (Composer 0.32,
    mosaicml/llm-foundry#1736). There the latest checkpoint is resolved here and loaded as
    `load_path` (which Composer stages in a per-node temporary folder), the same state."""
    from composer.utils import dist

    if not cfg.autoresume or dist.get_world_size() == dist.get_local_world_size():
        return {"autoresume": cfg.autoresume}
    latest = Path(cfg.save_folder) / "checkpoints" / "latest-rank0.pt"
    return {"autoresume": False, "load_path": str(latest.resolve()) if latest.exists() else None}


def microbatch_size(cfg: TrainConfig, layout: Any, *, gpu: bool) -> int | str | None:
    """`microbatch_size`, or its default: Composer's OOM-driven "auto" on a GPU, one microbatch on
    the CPU. Lanes give the ranks batches of different sizes, which "auto" cannot start from: their
    default is one microbatch of the largest share any rank reads in a step."""
    if cfg.microbatch_size:
        return cfg.microbatch_size
    if layout is not None:
        return layout.max_rank_batch
    return "auto" if gpu else None


def batch_tokens(batch: dict[str, Any]) -> dict[str, int]:
    """Composer's token counts of a batch: `total` (every position, as Composer counts by default)
    and `loss_generating` (positions with a target, the loss's denominator)."""
    ids = batch["input_ids"]
    return {"total": int(ids.numel()), "loss_generating": int((batch["labels"] != -100).sum())}


def fsdp_parallelism(cfg: TrainConfig, model: MemtreeLM, *, gpu: bool) -> dict[str, Any] | None:
    """Composer's FSDP settings for `fsdp: true`, or None.

    Composer wraps each child of the ComposerModel on its own: the anchor is
    sharded block by block (`AnchorLM.fsdp_wrap_fn`), the bank is skipped
    (`TrainableBank._fsdp_wrap`) and stays whole on every rank. Composer does
    not move a model it shards, so the bank is put on this rank's GPU here."""
    if not cfg.fsdp:
        return None
    if not gpu:
        raise ConfigError(
            "fsdp: true needs GPUs (device: gpu); Composer's FSDP does not run on the CPU"
        )
    if model.hf is not None:
        raise ConfigError(
            "fsdp: true with model.hf_dir is not supported (the HF model's memory hooks call "
            "the unwrapped modules); use DDP for post-hoc runs (leave fsdp false)"
        )
    if model.bank is not None:
        from composer.utils import dist

        model.bank.to(torch.device("cuda", dist.get_local_rank()))
    # DEFAULT: bf16 compute, fp32 gradient reduction (PURE would reduce in bf16)
    return {
        "fsdp": {
            "sharding_strategy": "FULL_SHARD",
            "mixed_precision": "DEFAULT",
            "use_orig_params": True,
        }
    }


def anchor_state_dict(model: MemtreeLM) -> dict[str, torch.Tensor]:
    """The anchor's full weights on the CPU; under FSDP every rank must call this (it
    all-gathers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload pins host memory, which needs a GPU: off when the weights are on the CPU already
    on_gpu = any(p.is_cuda for p in model.model.parameters())
    full = get_model_state_dict(
        model.model, options=StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)
    )
    return {k: v.detach().cpu().contiguous() for k, v in full.items()}


def export(trainer: Any, cfg: TrainConfig) -> dict[str, str]:
    """Write the anchor weights and the bank (memstore format) next to the checkpoints."""
    from composer.utils import dist

    model: MemtreeLM = unwrap(trainer.state.model)
    folder = Path(cfg.save_folder)
    out = {"anchor": str(folder / "anchor.safetensors")}
    if model.bank is not None:
        out["bank"] = str(folder / "bank")
    state = anchor_state_dict(model)
    shards = None
    if model.bank is not None and model.bank.shard is not None:
        # every rank writes its rows at the last batch (unless the final checkpoint did), then
        # rank 0 streams them into the memstore format
        saver = next(c for c in trainer.state.callbacks if isinstance(c, BankShardCheckpoints))
        if saver.last_saved != int(trainer.state.timestamp.batch):
            saver.save(trainer.state)
        shards = saver.folder / f"ba{saver.last_saved}"
    if dist.get_global_rank() != 0:  # one writer; the others wait for it
        dist.barrier()
        return out
    # tied embeddings share storage; safetensors refuses shared tensors, so store copies
    with atomic_path(folder / "anchor.safetensors") as tmp:
        save_file({k: v.clone() for k, v in state.items()}, str(tmp))
    if model.bank is not None:
        manifest = read_shards_manifest(cfg.data.shards)
        if shards is None:
            model.bank.export(
                folder / "bank", dtype=cfg.memory.export_dtype, tree_id=manifest["tree_id"]
            )
        else:
            export_bank(
                shards,
                folder / "bank",
                anchor=model.bank.anchor,
                memory=model.bank.memory,
                dtype=cfg.memory.export_dtype,
                tree_id=manifest["tree_id"],
            )
    dist.barrier()
    return out


def _checkpoints_kept(folder: Path, autoresume: bool) -> str:
    latest = last_complete_checkpoint(folder)
    if latest is None:
        return "no checkpoint was complete yet"
    how = (
        "the rerun resumes from it and drops the unfinished one"
        if autoresume
        else "set autoresume: true to resume from it"
    )
    return f"the last complete checkpoint, {latest.name}, is intact; {how}"


def check_pretrained(cfg: TrainConfig) -> None:
    """Before a named pretrained anchor trains: its folder still has the bytes converted, and it
    still reads English as a pretrained model does (memtree.pretrained.check_folder)."""
    from memtree.pretrained import PretrainedError, check_folder, verify_folder

    try:
        verify_folder(cfg.model.hf_dir)
        got = check_folder(cfg.model.hf_dir)
    except PretrainedError as e:
        raise ConfigError(f"model.anchor: {cfg.pretrained}: {e}") from None
    log.info(
        "%s: perplexity %.1f on the check paragraph (random initialisation %.0f)",
        cfg.pretrained,
        got["perplexity"],
        got["random_init_perplexity"],
    )


def train(cfg: TrainConfig, *, callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Build and fit; export the anchor and bank. On several ranks, a lost rank (or the launcher's
    SIGTERM once one failed) ends the process with what is intact and the command that resumes
    (`training.ranks.exit_after_lost_rank`, exit code 75) instead of each survivor's traceback."""
    from composer.utils import dist

    if cfg.pretrained:
        check_pretrained(cfg)
    trainer = build_trainer(cfg, callbacks=callbacks)
    lost: BaseException | None = None
    try:
        ckpts = Path(cfg.save_folder) / "checkpoints"
        with naming_path(ckpts, kept=lambda: _checkpoints_kept(ckpts, cfg.autoresume)):
            trainer.fit()
        paths = export(trainer, cfg)
        metrics = {k: float(v) for k, v in trainer.state.train_metric_values.items()}
        atomic_write_json(Path(cfg.save_folder) / "metrics.json", {"train": metrics, **paths})
        return {"metrics": metrics, **paths, "trainer": trainer}
    except BaseException as e:
        if not lost_rank(e, dist.get_world_size()):
            raise
        lost = e
    finally:
        if lost is None:  # after a lost rank its barrier would wait for the rank or raise again
            trainer.close()
    exit_after_lost_rank(cfg, trainer, lost)  # ends the process


def rerun_plan(cfg: TrainConfig) -> tuple[str, TrainConfig]:
    """What rerunning `memtree train run` on `cfg` should do with its save folder, as the README
    promises ("rerunning a command resumes it"): ("finished", cfg) when the folder holds a finished
    run of the same config and duration (nothing to train); ("resume", cfg with autoresume) when it
    holds checkpoints of the same config (Composer continues from the latest, to a longer
    max_duration too); ("train", cfg) otherwise. A folder of another config is check_save_folder's
    error, as before."""
    folder = Path(cfg.save_folder)
    meta = folder / "memtree_config.json"
    if not meta.is_file():
        return "train", cfg
    old = read_json(meta)
    if old.get("fingerprint") != cfg.fingerprint():
        return "train", cfg
    if (folder / "metrics.json").is_file() and old["config"].get(
        "max_duration"
    ) == cfg.max_duration:
        return "finished", cfg
    if (folder / "checkpoints" / "latest-rank0.pt").exists() and not cfg.autoresume:
        return "resume", dataclasses.replace(cfg, autoresume=True)
    return "train", cfg


def run_once(cfg: TrainConfig, *, force: bool = False) -> dict[str, Any] | None:
    """`memtree train run`: train `cfg`, or resume it, or (a finished run of the same config and
    duration, unless `force`) report it and train nothing (returns None)."""
    action, cfg = ("train", cfg) if force else rerun_plan(cfg)
    folder = Path(cfg.save_folder)
    if action == "finished":
        print(
            f"{folder}: already trained with this config for {cfg.max_duration} (metrics.json); "
            "nothing to do (--force trains it again, a longer max_duration continues it)"
        )
        return None
    if action == "resume":
        print(f"{folder}: resuming from its latest checkpoint (same config)")
    result = train(cfg)
    print(
        f"done: {result['metrics']}; anchor {result['anchor']}"
        + (f"; bank {result['bank']}" if "bank" in result else "")
    )
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(
            "usage: composer -n N -m memtree.training.train CONFIG.yaml [key=value …]\n       "
            "torchrun --nnodes M --nproc-per-node N … -m memtree.training.train CONFIG.yaml "
            "[key=value …]",
            file=sys.stderr,
        )
        return 2
    config, overrides = (None, argv) if "=" in argv[0] else (argv[0], argv[1:])
    # a launcher's ranks always train (autoresume is the config's): no rerun check per rank
    run_once(load_train_config(config, overrides), force=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
