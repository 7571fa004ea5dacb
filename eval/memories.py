"""`memtree eval memories ROOT`: every memory family on the demo's knowledge benchmark, beside dense
models of matched size (seed 002's headline, Table 1 and Fig. 1, at micro scale).

ROOT is a `memtree demo` root. Its anchor-only and co-training runs are reused as they are (the
rows of kind `demo`: anchor only, + generic, + fetched hierarchical memory, RAG, RAG + fetched, all
scored on the co-trained run as `memtree eval` scores it). Every other row is a model trained here
from scratch on the same shards, tokenizer, seed, batch size and optimiser settings (the co-training
run's stored config) for as long as the demo trained in all (anchor + co-training: the demo's 2 + 5
epochs), into ROOT/train/memories/<row>, reused only when trained from the same inputs
(`eval.demo.train_once`):

- `dense`: a memoryless model of the anchor's family; `size: 1x` is the anchor's shape trained alone
  for the whole duration (the demo's `none` row is the co-trained anchor without its memory, whose
  knowledge went partly into the bank), `size: 2x` repeats the anchor's blocks until
  the model has at least twice the anchor's parameters (the depth rule of
  `training.flops.iso_flop_depth`), `size: runtime` widens every FFN by the hierarchical memory's
  fetched width per layer, which gives exactly the parameters (and forward FLOPs) of anchor +
  fetched FFN memory, since an FFN memory block is extra SwiGLU hidden units;
- `moc`: the anchor with Mixture-of-Chapters memory layers (`training/layers/moc.py`);
- `pkm`: the anchor with a product-key memory layer in place of its middle FFN
  (`training/layers/pkm.py`).
  Both are sized to the fetched memory's active parameters per token (what a token reads besides
  the anchor: the fetched blocks; MoC's memory layers plus its selected chapters; PKM's query,
  sub-keys, k values per head and in/out projections), solving one knob when the grid leaves it
  out (`tokens_per_chapter`, `k`).

Every row is scored on the same probes (`eval.longtail`, the demo's exposure buckets and scorer,
`eval.knowledge.knowledge_eval`) and held-out documents. Paired comparisons against the reference
row (the fetched memory) use each probe's correctness difference d_i = c_i(row) - c_i(ref): mean
d and a normal-approximation 95 % interval mean ± 1.96 · sd(d) / √n (sd with n - 1), overall and
per exposure bucket (`paired_interval`). Accounting per row: total and runtime parameters, memory
active parameters, training FLOPs (`training.flops`, forward × 3 per trained sequence) and wall
time, inference FLOPs per token, bytes fetched per query and whether blocking is possible; the
fetched row carries the demo's subtree-blocking figures and MoC rows run the chapters' analogue
(`eval.chapter_blocking`) on the same target domain and share. The trained rows' sizes are solved by
`eval.memories_sizes`; the report (JSON, markdown, PNG) is written by `eval.memories_report`.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memtree.config import ConfigError, check_selection, from_dict, is_int, load_config, to_dict
from memtree.eval.chapter_blocking import chapter_blocking_eval
from memtree.eval.demo import shards_fingerprint, train_once
from memtree.eval.heldout import paired_interval
from memtree.eval.knowledge import knowledge_eval, load_eval_inputs
from memtree.eval.longtail import BUCKETS, bucket_label, exposure
from memtree.eval.memories_sizes import (
    dense_shape,
    fetched_widths,
    moc_active_params,
    pkm_active_params,
    size_moc,
    size_pkm,
)
from memtree.eval.model import RunModel
from memtree.eval.rag import RagIndex
from memtree.eval.runinfo import duration_epochs, resolve_stored, run_config
from memtree.geometry import AnchorShape, Plan, plan
from memtree.io import read_json
from memtree.pipeline.corpus.bios import BiosSpec
from memtree.training.config import TrainConfig
from memtree.training.data import read_shards_manifest, tokenizer_vocab_size
from memtree.training.flops import ffn_memory, moc_params, model_flops, pkm_params
from memtree.training.layers.moc import MoCConfig
from memtree.training.layers.pkm import PKMConfig

DEFAULT_YAML = Path(__file__).parent / "yamls" / "memories.yaml"
KINDS = ("demo", "dense", "moc", "pkm")
DEMO_SETTINGS = ("none", "generic", "fetched", "rag", "rag+fetched")
DENSE_SIZES = ("1x", "2x", "runtime")
BUDGETS = ("steps", "flops")
BANKS = ("active", "total")
_OWNER = {"demo": "setting", "dense": "size", "moc": "moc", "pkm": "pkm"}  # the key each kind takes
# Bytes per token id a RAG window adds to the model's input (int32 ids).
TOKEN_ID_BYTES = 4

# Whether a row's knowledge can be blocked per cluster at inference, and how (seed 002 Fig. 6b).
BLOCKING = {
    "none": "no: the anchor's knowledge is spread over shared weights",
    "generic": "no: one block every query reads",
    "fetched": "yes: block a subtree's blocks (they read as the generic memory); memstore.blocking",
    "rag": "yes: drop the subtree's windows from the datastore",
    "rag+fetched": "yes: both of the above",
    "dense": "no: the knowledge is spread over shared weights",
    "moc": (
        "analogue only: mask chapters out of the router's top-k; chapters are learned by routing, "
        "not aligned with the tree's clusters, so no set of chapters is known to hold a domain"
    ),
    "pkm": (
        "analogue only: mask memory slots; slots are chosen per token by key similarity, so no set "
        "of slots is known to hold a domain"
    ),
}


@dataclass(frozen=True, kw_only=True)
class MemoryRow:
    """One row of the grid. name: its label (a folder name under ROOT/train/memories for trained
    rows); kind: demo | dense | moc | pkm; setting (demo): none | generic | fetched | rag |
    rag+fetched; size (dense): 1x | 2x | runtime; moc / pkm: `training.layers.moc.MoCConfig` /
    `training.layers.pkm.PKMConfig` fields, `tokens_per_chapter` / `k` left out to size the memory
    to the fetched memory's active parameters; train: training overrides for this row, after the
    grid's; budget (trained rows): `steps`, the demo's duration (the same tokens and steps as the
    fetched row), or `flops`, as many batches as give the fetched row's training FLOPs
    (`training.flops`); bank (moc / pkm): `active`, only the active parameters matched to the
    fetched memory's, or `total`, also the model's total parameters matched to anchor + the fetched
    row's whole bank (n_chapters / n_keys solved at the active-matched tokens_per_chapter / k; the
    active parameters then come out above the fetched memory's)."""

    name: str
    kind: str
    setting: str = ""
    size: str = ""
    moc: dict[str, Any] = field(default_factory=dict)
    pkm: dict[str, Any] = field(default_factory=dict)
    train: list[str] = field(default_factory=list)
    budget: str = "steps"
    bank: str = "active"

    def __post_init__(self) -> None:
        where = f"rows.{self.name}"
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", self.name):
            raise ConfigError(
                f"{where}: name must be letters, digits and _ . + - (it names a folder)"
            )
        if self.kind not in KINDS:
            raise ConfigError(f"{where}.kind: {self.kind!r} is not one of {list(KINDS)}")
        for kind, key in _OWNER.items():
            if kind != self.kind and getattr(self, key):
                raise ConfigError(
                    f"{where}.{key}: only for kind {kind} rows (this row is kind {self.kind})"
                )
        if self.kind == "demo" and self.setting not in DEMO_SETTINGS:
            raise ConfigError(
                f"{where}.setting: {self.setting!r} is not one of {list(DEMO_SETTINGS)}"
            )
        if self.kind == "dense" and self.size not in DENSE_SIZES:
            raise ConfigError(f"{where}.size: {self.size!r} is not one of {list(DENSE_SIZES)}")
        if self.kind == "demo" and self.train:
            raise ConfigError(
                f"{where}.train: a demo row reuses the demo's runs and trains nothing"
            )
        if self.bank not in BANKS:
            raise ConfigError(f"{where}.bank: {self.bank!r} is not one of {list(BANKS)}")
        if self.bank == "total" and self.kind not in ("moc", "pkm"):
            raise ConfigError(
                f"{where}.bank: total is for moc and pkm rows (this row is kind {self.kind})"
            )
        if self.budget not in BUDGETS:
            raise ConfigError(f"{where}.budget: {self.budget!r} is not one of {list(BUDGETS)}")
        if self.budget != "steps" and self.kind == "demo":
            raise ConfigError(
                f"{where}.budget: a demo row reuses the demo's runs and trains nothing"
            )
        if self.budget == "flops" and any(
            o.split("=", 1)[0].strip() == "max_duration" for o in self.train
        ):
            raise ConfigError(
                f"{where}: budget flops sets max_duration; drop max_duration from train"
            )
        if self.kind == "moc":
            from_dict(MoCConfig, {"tokens_per_chapter": 1, **self.moc}, where=f"{where}.moc")
        if self.kind == "pkm":
            from_dict(PKMConfig, {"k": 1, **self.pkm}, where=f"{where}.pkm")


@dataclass(frozen=True, kw_only=True)
class MemoriesConfig:
    """root: a `memtree demo` root; rows: the grid; select: the rows to run (empty: all; the
    reference row is always scored); reference: the row paired intervals compare against (a demo
    row); max_probes: probes, evenly spread (0: all); train: training overrides for every trained
    row (e.g. a shorter max_duration for a smoke run; then the rows no longer match the demo's
    budget); out: report folder (default ROOT/memories)."""

    root: str = "runs/demo"
    rows: list[MemoryRow] = field(default_factory=list)
    select: list[str] = field(default_factory=list)
    reference: str = "fetched"
    max_probes: int = 0
    train: list[str] = field(default_factory=list)
    out: str = ""
    # blocking experiments of the rows that have one (fetched: the demo's own; moc: the chapters'
    # analogue, eval.chapter_blocking) on the demo's blocking target and share (ROOT/report)
    blocking: bool = True

    def __post_init__(self) -> None:
        names = [r.name for r in self.rows]
        check_selection(
            names,
            self.select,
            key="rows",
            flag="--rows",
            noun="row",
            empty="no row to run (eval/yamls/memories.yaml lists them)",
        )
        ref = next((r for r in self.rows if r.name == self.reference), None)
        if ref is None or ref.kind != "demo" or ref.setting not in ("generic", "fetched", "none"):
            raise ConfigError(
                f"reference: {self.reference!r} must name a demo row scored without RAG "
                f"(the grid's rows: {names})"
            )
        if not is_int(self.max_probes) or self.max_probes < 0:
            raise ConfigError(f"max_probes must be an integer >= 0, got {self.max_probes!r}")

    def selected(self) -> list[MemoryRow]:
        """The rows to run, in grid order, the reference row included."""
        keep = set(self.select or [r.name for r in self.rows]) | {self.reference}
        return [r for r in self.rows if r.name in keep]


def load_memories_config(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> MemoriesConfig:
    return load_config(MemoriesConfig, str(path or DEFAULT_YAML), list(overrides))


# -- the demo's runs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoRuns:
    """What the rows share: the demo's co-training run and the anchor run it continued, the anchor's
    shape, the hierarchical memory's plan, and how much the demo trained."""

    root: Path
    cotrain: Path
    cfg: TrainConfig  # the co-training run's config, paths resolved
    anchor_cfg: TrainConfig
    shape: AnchorShape
    plan: Plan
    seq_len: int
    n_samples: int
    anchor_epochs: float
    cotrain_epochs: float

    @property
    def epochs(self) -> float:
        return self.anchor_epochs + self.cotrain_epochs

    def duration(self) -> str:
        """The demo's whole training (anchor + co-training) as one Composer duration: epochs when
        both stages count whole epochs, else batches at the co-training's batch size."""
        if (
            all(str(c.max_duration).strip().endswith("ep") for c in (self.anchor_cfg, self.cfg))
            and float(self.epochs).is_integer()
        ):
            return f"{int(self.epochs)}ep"
        return f"{max(1, round(self.epochs * self.n_samples / self.cfg.data.batch_size))}ba"


def open_demo(root: str | Path) -> DemoRuns:
    """The demo's runs under `root`; errors name the missing piece."""
    root = Path(root)
    cotrain = root / "train" / "cotrain"
    cfg = run_config(cotrain)
    if not cfg.memory.multipliers or not cfg.anchor_checkpoint:
        raise ValueError(
            f"{cotrain}: not a co-training run with hierarchical memory continuing an anchor run "
            "(memory.multipliers, anchor_checkpoint); run `memtree demo` for ROOT"
        )
    anchor_dir = resolve_stored(
        cotrain, "anchor_checkpoint", cfg.anchor_checkpoint, must="memtree_config.json"
    )
    anchor_cfg = run_config(anchor_dir)
    manifest = read_shards_manifest(cfg.data.shards)
    shape = cfg.anchor_shape(tokenizer_vocab_size(cfg.data.shards, manifest))
    mem = cfg.memory.geometry(int(manifest["branching"]))
    epochs = [duration_epochs(c.max_duration, c) for c in (anchor_cfg, cfg)]
    if None in epochs:
        raise ValueError(
            f"{cotrain}: the demo's durations ({anchor_cfg.max_duration}, {cfg.max_duration}) are "
            "not countable in epochs"
        )
    n_samples = sum(int(s["n_samples"]) for s in manifest["streams"])
    return DemoRuns(
        root=root,
        cotrain=cotrain,
        cfg=cfg,
        anchor_cfg=anchor_cfg,
        shape=shape,
        plan=plan(shape, mem),
        seq_len=int(manifest["seq_len"]),
        n_samples=n_samples,
        anchor_epochs=epochs[0],
        cotrain_epochs=epochs[1],
    )


# -- the trained rows' models (their sizes are solved in eval/memories_sizes.py) -----------------


@dataclass(frozen=True)
class RowModel:
    """The model a trained row trains: its anchor shape and memory layers (None: none)."""

    shape: AnchorShape
    moc: MoCConfig | None = None
    pkm: PKMConfig | None = None


def row_model(row: MemoryRow, demo: DemoRuns) -> RowModel | None:
    """What a row trains (None for demo rows, which reuse the demo's runs)."""
    target = demo.plan.fetch_params
    # bank: total, the fetched row's total parameters: the anchor, every block and the generic ones
    total = demo.shape.params() + demo.plan.bank_params + target if row.bank == "total" else None
    if row.kind == "dense":
        return RowModel(shape=dense_shape(demo.shape, demo.plan, row.size))
    if row.kind == "moc":
        return RowModel(shape=demo.shape, moc=size_moc(demo.shape, row.moc, target, total))
    if row.kind == "pkm":
        return RowModel(shape=demo.shape, pkm=size_pkm(demo.shape, row.pkm, target, total))
    return None


# -- accounting ------------------------------------------------------------------------------------


def accounting(
    row: MemoryRow,
    demo: DemoRuns,
    model: RowModel | None,
    *,
    rag_tokens: float | None = None,
    epochs: float | None = None,
) -> dict[str, Any]:
    """Parameters (total, runtime = what one query runs with, memory_active = what a token reads
    besides the anchor), training FLOPs (forward × 3 per sequence trained, `training.flops`; a
    trained row over `epochs`, default the demo's), inference FLOPs per token, bytes fetched per
    query and blocking."""
    if row.kind == "demo":
        return _demo_accounting(row.setting, demo, rag_tokens)
    assert model is not None
    fwd = model_flops(model.shape, model.moc, seq_len=demo.seq_len, pkm=model.pkm).forward
    sequences = (demo.epochs if epochs is None else epochs) * demo.n_samples
    out = {
        "train_flops": 3 * fwd * sequences,
        "inference_flops_per_token": fwd / demo.seq_len,
        "blocking": BLOCKING[row.kind],
    }
    if row.kind == "dense":
        n = model.shape.params()
        return {
            **out,
            "total_params": n,
            "runtime_params": n,
            "memory_active_params": 0,
            "fetch": {"bytes": 0, "per": "query", "note": "no memory"},
        }
    sizes = (
        _moc_sizes(demo.shape, model.moc)
        if row.kind == "moc"
        else _pkm_sizes(demo.shape, model.pkm)
    )
    return {**out, **sizes}


def _demo_accounting(setting: str, demo: DemoRuns, rag_tokens: float | None) -> dict[str, Any]:
    """A demo row: the co-trained run read with `setting`; its training is the demo's (anchor-only
    epochs, then co-training epochs with the FFN memory's extra units)."""
    S, a, p = demo.seq_len, demo.shape, demo.plan
    anchor_fwd = model_flops(a, seq_len=S).forward
    mem_fwd = ffn_memory(a, fetched_widths(p), tokens=S)
    mem = setting in ("generic", "fetched", "rag+fetched")
    train = (
        3
        * demo.n_samples
        * (anchor_fwd * demo.anchor_epochs + (anchor_fwd + mem_fwd) * demo.cotrain_epochs)
    )
    bank = {
        "generic": p.fetch_params,
        "fetched": p.bank_params + p.fetch_params,
        "rag+fetched": p.bank_params + p.fetch_params,
    }.get(setting, 0)  # blocks + the generic ones
    active = p.fetch_params if mem else 0
    per_query = (
        p.fetch_bytes(demo.cfg.memory.export_dtype) if setting in ("fetched", "rag+fetched") else 0
    )
    if setting.startswith("rag") and rag_tokens is not None:
        per_query += round(rag_tokens * TOKEN_ID_BYTES)
    out = {
        "total_params": a.params() + bank,
        "runtime_params": a.params() + active,
        "memory_active_params": active,
        "train_flops": train,
        "inference_flops_per_token": (anchor_fwd + (mem_fwd if mem else 0)) / S,
        "fetch": {"bytes": per_query, "per": "query", "note": _fetch_note(setting, demo)},
        "blocking": BLOCKING[setting],
    }
    if setting.startswith("rag"):
        out["rag_context_tokens"] = rag_tokens
    return out


def _moc_sizes(a: AnchorShape, m: MoCConfig) -> dict[str, Any]:
    active = moc_active_params(a, m)
    g = m.geometry(d_model=a.d_model, n_layers=a.n_layers, anchor_heads=a.n_heads)
    banks = 1 if m.shared_bank else len(m.layers)
    read = banks * m.n_selected * m.tokens_per_chapter * g.stored_dim * 4  # fp32 bank in RAM
    return {
        "total_params": a.params() + sum(moc_params(a, m).values()),
        "runtime_params": a.params() + active,
        "memory_active_params": active,
        "fetch": {
            "bytes": read,
            "per": "sequence",
            "note": f"{m.n_selected} chapters × {m.tokens_per_chapter} tokens read per sequence, "
            "from a bank held in RAM",
        },
    }


def _pkm_sizes(a: AnchorShape, pk: PKMConfig) -> dict[str, Any]:
    vd = pk.value_dim or a.d_model
    layers = len(pk.resolved_layers(a.n_layers))
    active = pkm_active_params(a, pk)
    replaced = 3 * a.d_model * a.ffn_dim * layers  # the FFNs the memory layers take the place of
    return {
        "total_params": pkm_params(a, pk),
        "runtime_params": a.params() - replaced + active,
        "memory_active_params": active,
        "fetch": {
            "bytes": pk.heads * pk.k * vd * 4 * layers,
            "per": "token",
            "note": f"{pk.heads} heads × k={pk.k} value rows per token, from a table held in RAM",
        },
    }


def _fetch_note(setting: str, demo: DemoRuns) -> str:
    dtype = demo.cfg.memory.export_dtype
    return {
        "none": "no memory",
        "generic": "the generic blocks, the same for every query (resident)",
        "fetched": f"the query's blocks on its path, {dtype}",
        "rag": f"the kept head of one training window, as {TOKEN_ID_BYTES}-byte token ids",
        "rag+fetched": f"the path's blocks ({dtype}) + one window's kept tokens",
    }[setting]


# -- training --------------------------------------------------------------------------------------


def row_folder(demo: DemoRuns, row: MemoryRow) -> Path:
    return demo.root / "train" / "memories" / row.name


def row_train_config(
    demo: DemoRuns, row: MemoryRow, model: RowModel, overrides: Sequence[str] = ()
) -> TrainConfig:
    """The co-training run's config as a memoryless from-scratch run of `model`, for the demo's
    whole duration; then the grid's and the row's overrides."""
    d = to_dict(demo.cfg)
    duration = demo.duration() if row.budget == "steps" else equal_flops_duration(demo, model)
    d.update(
        mode="baseline",
        anchor_checkpoint=None,
        save_folder=str(row_folder(demo, row)),
        run_name=f"memories-{row.name}",
        max_duration=duration,
        autoresume=False,
    )
    d["memory"] = {**d["memory"], "multipliers": []}
    shape = {
        k: v
        for k, v in dataclasses.asdict(model.shape).items()
        if k != "vocab_size" and v is not None
    }
    d["model"] = {
        **d["model"],
        "anchor": "custom",
        "shape": shape,
        "moc": to_dict(model.moc) if model.moc else None,
        "pkm": to_dict(model.pkm) if model.pkm else None,
    }
    return load_config(TrainConfig, d, [*overrides, *row.train])


def equal_flops_duration(demo: DemoRuns, model: RowModel) -> str:
    """The batches at which `model` has spent the fetched row's training FLOPs (forward × 3 per
    sequence, `training.flops`), as a Composer duration."""
    target = _demo_accounting("fetched", demo, None)["train_flops"]
    fwd = model_flops(model.shape, model.moc, seq_len=demo.seq_len, pkm=model.pkm).forward
    return f"{max(1, round(target / (3 * fwd) / demo.cfg.data.batch_size))}ba"


def train_row(
    demo: DemoRuns,
    row: MemoryRow,
    model: RowModel,
    overrides: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train the row unless its folder finished a run from the same inputs; returns {folder,
    action, train_s (the wall time Composer recorded), duration, epochs}."""
    from streaming.base.util import clean_stale_shared_memory

    tcfg = row_train_config(demo, row, model, overrides)
    inputs = {
        "config": tcfg.fingerprint(),
        "duration": tcfg.max_duration,
        "upstream": shards_fingerprint(Path(demo.cfg.data.shards)),
    }
    folder = Path(tcfg.save_folder)
    _, action = train_once(row.name, tcfg, inputs, log=log)
    clean_stale_shared_memory()  # the next row opens the shards again in this process
    return {
        "folder": str(folder),
        "action": action,
        "train_s": checkpoint_wall_seconds(folder),
        "duration": tcfg.max_duration,
        "epochs": duration_epochs(tcfg.max_duration, tcfg),
    }


def checkpoint_wall_seconds(run: str | Path) -> float | None:
    """The training wall time Composer recorded in a run's latest checkpoint (its timestamp's
    total_wct); None without one."""
    import torch

    ckpt = Path(run) / "checkpoints" / "latest-rank0.pt"
    if not ckpt.exists():
        return None
    state = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)["state"]
    wct = state["timestamp"]["Timestamp"].get("total_wct")
    return None if wct is None else wct.total_seconds()


def demo_train_seconds(demo: DemoRuns) -> float | None:
    """The demo's anchor + co-training wall time, from each run's latest Composer checkpoint (the
    demo's report reads 0 s for a stage it reused)."""
    anchor = resolve_stored(
        demo.cotrain, "anchor_checkpoint", demo.cfg.anchor_checkpoint, must="memtree_config.json"
    )
    parts = [checkpoint_wall_seconds(anchor), checkpoint_wall_seconds(demo.cotrain)]
    return None if None in parts else round(sum(parts), 1)


# -- scoring ---------------------------------------------------------------------------------------


def paired_by_bucket(
    probes: Sequence[dict[str, Any]], a: Sequence[bool], b: Sequence[bool]
) -> list[dict[str, Any]]:
    """`paired_interval` per exposure bucket (the demo's buckets, `eval.longtail.BUCKETS`)."""
    ex = np.asarray([exposure(p) for p in probes])
    a, b = np.asarray(a), np.asarray(b)
    out = []
    for lo, hi in BUCKETS:
        idx = (ex >= lo) & (ex < hi)
        out.append({"bucket": bucket_label(lo, hi), **paired_interval(a[idx], b[idx])})
    return out


def correct(probes: Sequence[dict[str, Any]], predictions: Sequence[int]) -> np.ndarray:
    return np.asarray(predictions) == np.asarray([p["gold"] for p in probes])


def _row_result(mode: dict[str, Any]) -> dict[str, Any]:
    keep = ("accuracy", "accuracy_norm", "by_bucket", "predictions")
    return {**{k: mode[k] for k in keep}, "perplexity": mode.get("perplexity")}


def score_demo(
    demo: DemoRuns,
    rows: Sequence[MemoryRow],
    probes: list[dict[str, Any]],
    held: list[dict[str, Any]],
) -> tuple[dict[str, dict[str, Any]], float | None]:
    """The demo rows, scored on the co-trained run as `memtree eval` scores it; also returns the RAG
    rows' mean kept window tokens (None without RAG rows)."""
    t = time.time()
    rm = RunModel.load(demo.cotrain, tree_dir=demo.root / "pipeline" / "tree")
    settings = {r.setting for r in rows}
    modes = [m for m in ("none", "generic", "fetched") if m in settings]
    rag = RagIndex.open(demo.root / "pipeline") if settings & {"rag", "rag+fetched"} else None
    k = knowledge_eval(rm, probes, held, modes=modes, rag=rag)
    seconds = (time.time() - t) / max(len(rows), 1)
    out = {
        r.name: {**_row_result(k["modes"][r.setting]), "eval_s": round(seconds, 1)} for r in rows
    }
    tokens = float(np.mean(k["rag"]["kept_tokens"])) if rag is not None else None
    return out, tokens


def score_trained(
    folder: str | Path, probes: list[dict[str, Any]], held: list[dict[str, Any]]
) -> dict[str, Any]:
    """A trained row (no bank): accuracy, buckets and held-out perplexity, and its measured
    parameters."""
    t = time.time()
    rm = RunModel.load(folder, bank=False)
    k = knowledge_eval(rm, probes, held, modes=("none",))
    return {
        **_row_result(k["modes"]["none"]),
        "eval_s": round(time.time() - t, 1),
        "measured_params": sum(p.numel() for p in rm.model.parameters()),
    }


def run_memories(cfg: MemoriesConfig, *, log: Callable[[str], None] = print) -> Path:
    """The whole grid; returns the markdown report's path."""
    from memtree.eval.memories_report import write_memories_report

    t0 = time.time()
    demo = open_demo(cfg.root)
    out = Path(cfg.out) if cfg.out else demo.root / "memories"
    rows = cfg.selected()
    held_path = demo.root / "heldout.jsonl"
    probes, held = load_eval_inputs(
        demo.root / "facts.jsonl",
        held_out=held_path if held_path.is_file() else None,
        max_probes=cfg.max_probes,
        seed=demo.cfg.seed,
        epochs=demo.epochs,
    )
    log(
        f"[eval memories] {len(rows)} rows × {len(probes)} probes, {len(held)} held-out documents; "
        f"trained rows: {_given_duration(cfg.train) or demo.duration()} from scratch (the demo's "
        f"anchor + co-training: {demo.duration()})"
    )
    results: dict[str, dict[str, Any]] = {}
    demo_blocking = read_demo_blocking(demo)
    demo_rows = [r for r in rows if r.kind == "demo"]
    rag_tokens = None
    if demo_rows:
        scored, rag_tokens = score_demo(demo, demo_rows, probes, held)
        wall = demo_train_seconds(demo)
        for r in demo_rows:
            results[r.name] = {
                **scored[r.name],
                "train": {
                    "folder": str(demo.cotrain),
                    "action": "reused",
                    "train_s": wall,
                    "duration": "demo (anchor + co-training)",
                },
            }
            if r.setting == "fetched" and cfg.blocking and demo_blocking:
                results[r.name]["blocking_result"] = {"kind": "subtree", **demo_blocking}
    models = {}
    for r in rows:
        if r.kind == "demo":
            continue
        models[r.name] = row_model(r, demo)
        train = train_row(
            demo, r, models[r.name], cfg.train, log=lambda m: log(f"[eval memories] {m}")
        )
        log(f"[eval memories] {r.name}: scoring")
        results[r.name] = {**score_trained(train["folder"], probes, held), "train": train}
        if r.kind == "moc" and cfg.blocking and demo_blocking:
            log(
                f"[eval memories] {r.name}: blocking the chapters the "
                f"{demo_blocking['target_domains']} probes pick most, and as many random ones"
            )
            results[r.name]["blocking_result"] = {
                "kind": "chapters",
                **chapter_blocking_eval(
                    RunModel.load(train["folder"], bank=False),
                    probes,
                    target_domains=demo_blocking["target_domains"],
                    fraction=demo_blocking["fraction"],
                    seed=demo.cfg.seed,
                ),
            }
    ref = correct(probes, results[cfg.reference]["predictions"])
    for r in rows:
        res = results[r.name]
        ok = correct(probes, res["predictions"])
        res.update(
            name=r.name,
            kind=r.kind,
            spec=to_dict(r),
            **accounting(
                r,
                demo,
                models.get(r.name),
                rag_tokens=rag_tokens,
                epochs=res["train"].get("epochs"),
            ),
        )
        res["model"] = _describe(demo, models.get(r.name))
        res["paired"] = {
            "overall": paired_interval(ok, ref),
            "by_bucket": paired_by_bucket(probes, ok, ref),
        }
    report = {
        "format": "memtree-memories",
        "version": 1,
        "config": to_dict(cfg),
        "root": str(demo.root),
        "reference": cfg.reference,
        "n_probes": len(probes),
        "held_out_documents": len(held),
        "chance": 1 / len(probes[0]["choices"]) if probes else None,
        "demo": _demo_meta(demo),
        "rows": [results[r.name] for r in rows],
        "seconds": round(time.time() - t0, 1),
    }
    return write_memories_report(out, report)


def _given_duration(overrides: Sequence[str]) -> str | None:
    """The max_duration a grid-wide `train=[…]` override sets, if one does (the last wins)."""
    given = [
        o.split("=", 1)[1].strip()
        for o in overrides
        if o.split("=", 1)[0].strip() == "max_duration"
    ]
    return given[-1] if given else None


def read_demo_blocking(demo: DemoRuns) -> dict[str, Any] | None:
    """The demo's subtree-blocking experiment (ROOT/report/results.json's `blocking`), or None when
    the demo's report has none."""
    path = demo.root / "report" / "results.json"
    if not path.is_file():
        return None
    return read_json(path).get("blocking")


def _describe(demo: DemoRuns, model: RowModel | None) -> dict[str, Any]:
    if model is None:
        return {"shape": dataclasses.asdict(demo.shape), "memory": to_dict(demo.plan.to_dict())}
    return {
        "shape": dataclasses.asdict(model.shape),
        "moc": to_dict(model.moc) if model.moc else None,
        "pkm": to_dict(model.pkm) if model.pkm else None,
    }


def corpus_meta(root: Path) -> dict[str, Any] | None:
    """The demo corpus's size and the generator fields that differ from the default corpus (what
    makes e.g. `--corpus entities_per_subtopic=48` the headline's benchmark rather than the demo's);
    None when ROOT has no corpus.json."""
    path = root / "corpus.json"
    if not path.is_file():
        return None
    rec = read_json(path)
    default = BiosSpec().record()
    spec = BiosSpec.stored(rec.get("spec", {}))
    return {
        "documents": rec.get("documents"),
        "facts": rec.get("facts"),
        "spec_changes": {k: v for k, v in spec.items() if k in default and v != default[k]},
    }


def _demo_meta(demo: DemoRuns) -> dict[str, Any]:
    return {
        "cotrain": str(demo.cotrain),
        "anchor_params": demo.shape.params(),
        "plan": demo.plan.to_dict(),
        "epochs": demo.epochs,
        "anchor_epochs": demo.anchor_epochs,
        "cotrain_epochs": demo.cotrain_epochs,
        "duration": demo.duration(),
        "seq_len": demo.seq_len,
        "samples": demo.n_samples,
        "batch_size": demo.cfg.data.batch_size,
        "seed": demo.cfg.seed,
        "corpus": corpus_meta(demo.root),
    }
