"""Per-rank training memory for an anchor + memory bank: does a run fit its GPUs?

`memtree memstore plan … --ranks N --device-memory 80GiB` prints this. Before a multi-GPU run
it answers, for each way of laying the run out over W data-parallel ranks, how many bytes one
rank holds and whether that fits a device, so a user learns *before* launching that, say, a
21B-parameter bank cannot be replicated on 80 GiB cards but can be sharded over 8 of them.

Layouts (the trainer's `parallel.bank` and anchor wrapping):
- bank "replicated": every rank holds every row of every level table and its AdamW state;
  "sharded": the rows are split by level-1 subtree (level l has B**l rows, subtree s owns rows
  [s·B**(l-1), (s+1)·B**(l-1))) over G memory-parallel groups, G = the largest divisor of W
  that is at most B; a group's W/G ranks are replicas, each holding the rows of at most
  ceil(B/G) subtrees. Every level table also has one generic row every rank holds a replica of.
- anchor "ddp": every rank holds the whole anchor; "fsdp": full shard over the W ranks.

The model, in the dtypes memtree's trainer really uses (Composer amp_bf16 keeps fp32 masters):
- anchor: weights 4 B/param, gradients 4 B/param, AdamW exp_avg + exp_avg_sq 8 B/param. DDP:
  all of it on every rank. FSDP: ceil(params / W) of each per rank, plus the largest FSDP unit
  (one transformer block, or the vocab × d_model embedding table if larger) unsharded in fp32,
  counted twice because FSDP prefetches the next unit while computing the current one.
- bank tables: fp32, 4 B/param for every row the rank holds, the generic rows included.
- bank AdamW state: fp32 exp_avg + exp_avg_sq, 8 B/param per held row, plus an int64 pool index
  and an int64 step count per held row (16 B/row). The optimizer's state pool grows only to the
  rows ever updated, but within an epoch that is every held row, so this is the bound to plan by.
- bank sparse gradient of one step: a rank's ceil(global_batch / W) sequences touch at most
  min(sequences, rows held) distinct rows per level, each row P_level fp32 values.
- gradient all-gather: a replicated bank's optimizer gathers every rank's (rows, values) before
  stepping, W × the per-rank gradient (rows per level capped at the level's row count; nothing
  on one rank). A sharded bank sends no bank rows with one replica per group; with R = W/G > 1
  replicas its group gathers R × the per-rank gradient. The generic row is all-reduced in place.
- NOT modelled: activations, the attention/matmul workspace, communication buckets, allocator
  fragmentation and the CUDA context. Instead a `headroom` fraction of device memory (default
  0.2) is kept free for them: a layout fits when its total <= device bytes × (1 − headroom).

`seq_len` changes none of the modelled bytes (only activations depend on it); it is carried so
the report can state the batch in tokens. Pure Python, like the rest of `memtree/`.
"""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import asdict, dataclass
from typing import Literal

from memtree.geometry import Plan

Bank = Literal["replicated", "sharded"]
AnchorParallel = Literal["ddp", "fsdp"]
BANKS: tuple[str, ...] = ("replicated", "sharded")
ANCHOR_PARALLEL: tuple[str, ...] = ("ddp", "fsdp")
LAYOUTS: tuple[tuple[str, str], ...] = tuple((b, a) for b in BANKS for a in ANCHOR_PARALLEL)

FP32 = 4
ADAM_STATE = 2 * FP32  # exp_avg + exp_avg_sq
ROW_BOOKKEEPING = 8 + 8  # int64 pool index + int64 step count per held row
DEFAULT_GLOBAL_BATCH = 1024  # the paper's 2M-token batch at 2048 tokens per sequence
DEFAULT_SEQ_LEN = 2048
DEFAULT_HEADROOM = 0.2
MAX_RANKS = 4096

# (field, label) in print order; every field is bytes per rank
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("anchor_weights", "anchor weights (fp32)"),
    ("anchor_grads", "anchor gradients (fp32)"),
    ("anchor_optimizer", "anchor AdamW state (fp32 ×2)"),
    ("anchor_fsdp_units", "anchor FSDP units (2 × fp32)"),
    ("bank_tables", "bank tables (fp32)"),
    ("bank_optimizer", "bank AdamW state (fp32 ×2)"),
    ("bank_row_state", "bank row index+step (int64)"),
    ("bank_grads", "bank sparse gradient (fp32)"),
    ("bank_grad_gather", "bank gradient all-gather"),
)


@dataclass(frozen=True, kw_only=True)
class TrainingMemory:
    """Bytes one rank holds while training, by component (see the module docstring)."""

    bank: str
    anchor_parallel: str
    ranks: int
    groups: int  # memory-parallel groups G (1 for a replicated bank: every rank holds all)
    replicas: int  # ranks per group, R = W / G
    subtrees_per_rank: int  # level-1 subtrees whose rows the fullest rank holds
    sequences_per_rank: int
    seq_len: int
    rows_held: tuple[int, ...]  # per level, generic row included (0 for a level without memory)
    anchor_weights: int
    anchor_grads: int
    anchor_optimizer: int
    anchor_fsdp_units: int
    bank_tables: int
    bank_optimizer: int
    bank_row_state: int
    bank_grads: int
    bank_grad_gather: int

    @property
    def total(self) -> int:
        return sum(self.components().values())

    @property
    def anchor_total(self) -> int:
        return (
            self.anchor_weights + self.anchor_grads + self.anchor_optimizer + self.anchor_fsdp_units
        )

    @property
    def bank_state(self) -> int:
        """Tables + optimizer state + row bookkeeping: what a rank keeps between steps."""
        return self.bank_tables + self.bank_optimizer + self.bank_row_state

    def components(self) -> dict[str, int]:
        return {name: getattr(self, name) for name, _ in COMPONENTS}

    def to_dict(self) -> dict:
        return {**asdict(self), "rows_held": list(self.rows_held), "total": self.total}


@dataclass(frozen=True, kw_only=True)
class MinRanks:
    """The smallest rank count at which a layout fits, or None and why it never does."""

    ranks: int | None
    reason: str | None = None


def memory_groups(ranks: int, branching: int) -> int:
    """G: the largest divisor of the rank count that is at most the number of level-1 subtrees."""
    return max(g for g in range(1, min(ranks, branching) + 1) if ranks % g == 0)


def _check(ranks: int, bank: str, anchor_parallel: str, global_batch: int, seq_len: int) -> None:
    if bank not in BANKS:
        raise ValueError(f"bank {bank!r} is not one of {list(BANKS)}")
    if anchor_parallel not in ANCHOR_PARALLEL:
        raise ValueError(
            f"anchor_parallel {anchor_parallel!r} is not one of {list(ANCHOR_PARALLEL)}"
        )
    if global_batch < 1 or seq_len < 1:
        raise ValueError(
            f"global batch {global_batch} and sequence length {seq_len} must be positive"
        )
    if not 1 <= ranks <= global_batch:
        # a rank without a sequence of the global batch would have nothing to train on
        raise ValueError(
            f"ranks {ranks} must be between 1 and the global batch of {global_batch} sequences"
        )


def training_memory(
    plan: Plan,
    *,
    ranks: int,
    bank: Bank,
    anchor_parallel: AnchorParallel,
    global_batch: int = DEFAULT_GLOBAL_BATCH,
    seq_len: int = DEFAULT_SEQ_LEN,
) -> TrainingMemory:
    """Per-rank training bytes of `plan` on `ranks` data-parallel ranks."""
    _check(ranks, bank, anchor_parallel, global_batch, seq_len)
    anchor, B = plan.anchor, plan.memory.branching
    seqs = math.ceil(global_batch / ranks)  # the fullest rank's share

    if anchor_parallel == "ddp":
        shard, units = plan.anchor_params, 0
    else:
        shard = math.ceil(plan.anchor_params / ranks)  # FSDP pads flat params to a multiple of W
        unit = max(anchor.block_params(), anchor.vocab_size * anchor.d_model)
        units = 2 * FP32 * unit

    if bank == "replicated":
        groups, subtrees = 1, B
        # the optimizer all-gathers the sparse gradients of all W ranks (none on a single rank)
        gather_ranks = ranks if ranks > 1 else 0
    else:
        groups = memory_groups(ranks, B)
        subtrees = math.ceil(B / groups)
        replicas = ranks // groups
        gather_ranks = replicas if replicas > 1 else 0
    rows_held, tables, grads, gather_vals = [], 0, 0, 0
    for lv in plan.levels:
        if lv.n_blocks == 0:  # m_l = 0: no table at this level
            rows_held.append(0)
            continue
        level_rows = lv.n_blocks + 1
        held = level_rows if bank == "replicated" else subtrees * B ** (lv.level - 1) + 1
        rows_held.append(held)
        tables += held * lv.block_params
        touched = min(seqs, held)
        grads += touched * lv.block_params
        if bank == "replicated":  # a gather can bring no more distinct rows than the level has
            gather_vals += min(gather_ranks * touched, level_rows) * lv.block_params
        else:
            gather_vals += gather_ranks * touched * lv.block_params
    return TrainingMemory(
        bank=bank,
        anchor_parallel=anchor_parallel,
        ranks=ranks,
        groups=groups,
        replicas=ranks // groups,
        subtrees_per_rank=subtrees,
        sequences_per_rank=seqs,
        seq_len=seq_len,
        rows_held=tuple(rows_held),
        anchor_weights=FP32 * shard,
        anchor_grads=FP32 * shard,
        anchor_optimizer=ADAM_STATE * shard,
        anchor_fsdp_units=units,
        bank_tables=FP32 * tables,
        bank_optimizer=ADAM_STATE * tables,
        bank_row_state=ROW_BOOKKEEPING * sum(rows_held),
        bank_grads=FP32 * grads,
        bank_grad_gather=FP32 * gather_vals,
    )


def usable_bytes(device_bytes: int, headroom: float = DEFAULT_HEADROOM) -> float:
    """Device bytes left for the modelled components once the headroom is set aside."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom {headroom} must be in [0, 1)")
    if device_bytes <= 0:
        raise ValueError(f"device memory {device_bytes} must be positive")
    return device_bytes * (1 - headroom)


def fits(mem: TrainingMemory, device_bytes: int, *, headroom: float = DEFAULT_HEADROOM) -> bool:
    return mem.total <= usable_bytes(device_bytes, headroom)


def _never_reason(
    plan: Plan, bank: str, anchor_parallel: str, budget: float, last: int, at_last: TrainingMemory
) -> str:
    """Why a layout fits at no W <= last: name the part that does not shrink with W."""
    B, have, usable = plan.memory.branching, binary_bytes(at_last.bank_state), binary_bytes(budget)
    if bank == "replicated" and at_last.bank_state > budget:
        return (
            f"every rank holds the whole bank: its tables and AdamW state alone are {have}, "
            f"over the {usable} usable at any rank count"
        )
    if bank == "sharded" and at_last.subtrees_per_rank == 1 and at_last.bank_state > budget:
        return (
            f"sharded bank shards are level-1 subtrees: beyond {B} ranks the per-rank bank "
            f"stops shrinking, and one subtree's rows and AdamW state are {have}, over the "
            f"{usable} usable"
        )
    if anchor_parallel == "ddp" and at_last.anchor_total > budget:
        return (
            f"DDP keeps the whole anchor on every rank: its weights, gradients and AdamW "
            f"state are {binary_bytes(at_last.anchor_total)}, over the {usable} usable"
        )
    return (
        f"does not fit at any rank count up to {last} (each rank needs one of the global "
        f"batch's sequences): {binary_bytes(at_last.total)} per rank at {last} ranks, over "
        f"the {usable} usable"
    )


def min_ranks(
    plan: Plan,
    *,
    device_bytes: int,
    headroom: float = DEFAULT_HEADROOM,
    global_batch: int = DEFAULT_GLOBAL_BATCH,
    seq_len: int = DEFAULT_SEQ_LEN,
    max_ranks: int = MAX_RANKS,
) -> dict[tuple[str, str], MinRanks]:
    """For every (bank, anchor_parallel) layout, the smallest W in 1..max_ranks that fits.

    Ranks are capped at the global batch as well (each rank needs a sequence). The search is a
    scan, not a bisection: fitting is not monotone in W (a replicated bank's all-gather grows with
    W; the sharded layout follows the divisors of W)."""
    budget = usable_bytes(device_bytes, headroom)
    last = min(max_ranks, global_batch)
    out: dict[tuple[str, str], MinRanks] = {}
    for bank, par in LAYOUTS:
        found, mem = None, None
        for w in range(1, last + 1):
            mem = training_memory(
                plan,
                ranks=w,
                bank=bank,
                anchor_parallel=par,
                global_batch=global_batch,
                seq_len=seq_len,
            )
            if mem.total <= budget:
                found = w
                break
        assert mem is not None
        out[(bank, par)] = (
            MinRanks(ranks=found)
            if found is not None
            else MinRanks(ranks=None, reason=_never_reason(plan, bank, par, budget, last, mem))
        )
    return out


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "ki": 2**10,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mi": 2**20,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gi": 2**30,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "ti": 2**40,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str) -> int:
    """'80GiB' / '80Gi' → 80·2**30; '80GB' / '80G' → 80·10**9 (SI, as disks and `df -H` count);
    also K/M/T with or without i and B; a plain number is bytes. Units are case-insensitive."""
    m = _SIZE.fullmatch(str(text))
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise ValueError(
            f"size {text!r}: expected a number with an optional unit, e.g. 80GiB, 80GB, "
            "512MiB or 1TB (GiB/Gi = 2^30 bytes, GB/G = 10^9)"
        )
    n = round(float(m.group(1)) * unit)
    if n <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return n


def binary_bytes(n: float) -> str:
    """Binary units, one decimal: 64.0 GiB, 1.1 MiB; '-' for nothing at all."""
    if n == 0:
        return "-"
    for div, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.1f} {suffix}"
    return f"{int(n)} B"


@dataclass(frozen=True, kw_only=True)
class TrainingReport:
    """Every layout on one rank count, with its verdict and smallest fitting rank count."""

    ranks: int
    branching: int
    device_bytes: int
    headroom: float
    global_batch: int
    seq_len: int
    layouts: dict[tuple[str, str], TrainingMemory]
    fit: dict[tuple[str, str], bool]
    minimum: dict[tuple[str, str], MinRanks]

    @property
    def budget(self) -> float:
        return usable_bytes(self.device_bytes, self.headroom)

    def to_dict(self) -> dict:
        return {
            "ranks": self.ranks,
            "device_memory_bytes": self.device_bytes,
            "headroom": self.headroom,
            "usable_bytes": int(self.budget),
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "not_modelled": "activations, workspace, communication buckets, fragmentation "
            "(left to the headroom)",
            "layouts": {
                f"{b}+{a}": {
                    **self.layouts[(b, a)].to_dict(),
                    "fits": self.fit[(b, a)],
                    "min_ranks": self.minimum[(b, a)].ranks,
                    "min_ranks_reason": self.minimum[(b, a)].reason,
                }
                for b, a in LAYOUTS
            },
        }


def training_report(
    plan: Plan,
    *,
    ranks: int,
    device_bytes: int,
    headroom: float = DEFAULT_HEADROOM,
    global_batch: int = DEFAULT_GLOBAL_BATCH,
    seq_len: int = DEFAULT_SEQ_LEN,
) -> TrainingReport:
    layouts = {
        (b, a): training_memory(
            plan, ranks=ranks, bank=b, anchor_parallel=a, global_batch=global_batch, seq_len=seq_len
        )
        for b, a in LAYOUTS
    }
    return TrainingReport(
        ranks=ranks,
        branching=plan.memory.branching,
        device_bytes=device_bytes,
        headroom=headroom,
        global_batch=global_batch,
        seq_len=seq_len,
        layouts=layouts,
        fit={k: fits(m, device_bytes, headroom=headroom) for k, m in layouts.items()},
        minimum=min_ranks(
            plan,
            device_bytes=device_bytes,
            headroom=headroom,
            global_batch=global_batch,
            seq_len=seq_len,
        ),
    )


def format_training_report(r: TrainingReport, device_label: str | None = None) -> str:
    """The per-rank table `memtree memstore plan --ranks N --device-memory SIZE` prints
    (<= 100 cols).

    Rows are the components, columns the four layouts; binary units throughout, so the totals
    compare directly with a device sold in GiB."""
    device = device_label or binary_bytes(r.device_bytes)
    mems = [r.layouts[k] for k in LAYOUTS]
    tokens = r.global_batch * r.seq_len

    def row(label: str, cells: list[str]) -> str:
        return f"{label:<30}" + "".join(f"{c:>17}" for c in cells)

    lines = [
        (
            f"training memory per rank on {r.ranks} × {device}: global batch {r.global_batch:,} × "
            f"{r.seq_len:,} tokens ({tokens / 1e6:.1f}M tokens),"
        ),
        (
            f"up to {mems[0].sequences_per_rank} sequences per rank. "
            "Binary units (GiB = 2^30 bytes)."
        ),
        (
            f"Not modelled: activations and workspace; {r.headroom:.0%} of each device is left for "
            f"them ({binary_bytes(r.budget)} usable)."
        ),
        "",
        row("per rank", [f"{b}+{a.upper()}" for b, a in LAYOUTS]),
    ]
    for name, label in COMPONENTS:
        lines.append(row(label, [binary_bytes(getattr(m, name)) for m in mems]))
    lines.append(row("total", [binary_bytes(m.total) for m in mems]))
    lines.append(
        row(
            "bank rows on a rank",
            [
                f"all {r.branching} subtrees"
                if m.bank == "replicated"
                else f"{m.subtrees_per_rank} of {r.branching} subtrees"
                for m in mems
            ],
        )
    )
    lines.append(row("memory groups × replicas", [f"{m.groups} × {m.replicas}" for m in mems]))
    lines.append("")
    lines.append(
        row(f"fits on {r.ranks} × {device}", ["yes" if r.fit[k] else "no" for k in LAYOUTS])
    )
    notes: list[str] = []
    cells = []
    for k in LAYOUTS:
        mr = r.minimum[k]
        if mr.ranks is None:
            why = mr.reason
        elif mr.ranks < r.ranks and not r.fit[k]:
            # fitting is not monotone in W; say so rather than look like a contradiction
            why = (
                f"fits on {mr.ranks} but not on {r.ranks} ranks: more ranks do not always "
                "help (a replicated bank all-gathers every rank's gradient, a sharded one is "
                f"cut by the divisors of the rank count up to {r.branching})"
            )
        else:
            cells.append(f"{mr.ranks} rank{'s' if mr.ranks > 1 else ''}")
            continue
        notes.append(
            textwrap.fill(
                f"({len(notes) + 1}) {k[0]}+{k[1].upper()}: {why}",
                width=100,
                subsequent_indent="    ",
            )
        )
        # a bare number under "fits from" would read as "and on more": say which count does not
        cells.append(
            f"never ({len(notes)})"
            if mr.ranks is None
            else f"{mr.ranks}, not {r.ranks} ({len(notes)})"
        )
    lines.append(row("fits from", cells))
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)
