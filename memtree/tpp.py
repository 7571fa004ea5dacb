"""Tokens per parameter (TPP) of a memory bank: how much training data each block sees.

Seed 002 App. D trains 4,096 level-3 blocks of 860k parameters with up to 1.1T tokens (TPP up to
312) and finds that specific knowledge and perplexity improve steadily with TPP. A block that sees
few tokens for its parameters can store its windows verbatim instead of learning what its
cluster's documents share. This module counts, per level, the tokens routed to every block and
divides them by the block's parameters.

Inputs: a `memtree.geometry.Plan` (block sizes) and the tokens of one epoch per leaf, from a shards
manifest (`leaf_tokens` per stream, written by the shards stage since its version 2) or from a total
(`--tokens N`: every block of a level gets an equal share, a balanced tree's estimate). A level-l
block trains on the tokens of every leaf below it, on the forwards that fetch (not those that read
the generic row, probability `generic_prob`, nor those that run the anchor alone, `dropout`); the
generic row of a level trains on the others' complement. "Over the run" multiplies by the epochs.

Each threshold below names the measurement it comes from (docs/BENCHMARKS.md) and a warning fires
only where a measured run went wrong, not at the edge of what was tried; outside the measured range
a level or a learning rate gets a note instead. A level at or under `FETCH_WORSE_AT_TPP` is as low
as the one run whose fetched memory read held-out text worse than its generic memory; a level under
`GENERALISES_DOWN_TO` (the fewest tokens per parameter measured on real text, where the bank still
generalised) gets a note: untested, not known to fail. A bank LR at or above `HARMFUL_LR_RATIO` ×
the anchor's is the smallest ratio measured to harm held-out text; between `SAFE_LR_RATIO` (the
largest measured not to) and it, a note. A run that sets one of these on purpose and explains it in
its own report (the bios demo) runs under `deliberate(...)`: its console shows a short note for it
instead of the warning, and tpp.json and the report keep the warning.
Pure Python (no torch): `memtree memstore plan` prints it and `memtree train` logs and stores it
(`tpp.json` in the run folder); the demo and `memtree eval realtext` reports show it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memtree.geometry import Plan, human
from memtree.geometry import plan as plan_sizes

FORMAT = "memtree-tpp"
VERSION = 1

# Tokens per parameter over the run, per level. The fewest measured on real text, where the bank
# still generalised: docs/benchmarks/2026-12-02-realtext-tpp-amd-epyc.md, "Tokens per parameter on
# real text" (3.73M-token Python + Linux documentation corpus, one co-training epoch, bank LR 1e-3 =
# 1/3 of the anchor's): fetched memory beat dense-1x at every TPP tried, −0.0231 / −0.0250 / −0.0272
# / −0.0283 nats/token at 35.6 / 2.23 / 0.557 / 0.139, and at 0.139 (`l3m256-lr1e-3`, a
# 25.2M-parameter leaf bank) also dense-restart (−0.0084 [−0.0096, −0.0072]) and the generic memory.
# It is the smallest TPP tried there, not a measured onset of harm: a level under it gets a note
# (outside the measured range), and the sizing rule keeps every level at or above it.
GENERALISES_DOWN_TO = 0.139
# The TPP at and under which a run was measured to go wrong:
# docs/benchmarks/2026-12-05-pretrained-anchors-intel-xeon.md, "Pretrained anchors from PyPI", "The
# real-text row (2026-12-05)": memories at levels 2 and 3 on frozen SmolLM2-135M for 0.51 epochs of
# Python documentation openings, TPP over the run 0.0044 at level 2 and 0.00066 at level 3; fetched
# memory read the 33 held-out pages worse than the generic memory, +0.0339 nats/token [+0.0174,
# +0.0504], 27 of 33 pages worse (it still beat the model alone, −0.1144). That run differs in more
# than TPP (a frozen pretrained anchor, half an epoch): it is where a run went wrong, not a measured
# onset.
FETCH_WORSE_AT_TPP = 0.0044
# Bank LR / anchor LR. The largest ratio measured not to harm held-out text: 1× on pydocs-short
# (docs/benchmarks/2026-11-27-memory-families-2-core-vm.md, "Memory rows on real text", `mlr3e-3`:
# fetched − dense-1x +0.014 [−0.029, +0.058], interval across 0); 1/3× (`mlr1e-3` there, every
# `*-lr1e-3` recipe in "Tokens per parameter on real text") was the best measured on both corpora.
# Between this and HARMFUL_LR_RATIO: untested, a note.
SAFE_LR_RATIO = 1.0
# The smallest ratio measured to harm: bank 1e-2 against the anchor's 3e-3 (`mlr1e-2`, "Memory rows
# on real text": co-trained anchor + fetched memory − dense-1x +0.186 nats/token [+0.126, +0.247],
# 26 of 33 pages worse). 10× was worse on both corpora: `mlr3e-2` +0.298 [+0.236, +0.359] (31 / 33
# pages); "Tokens per parameter on real text" `l1m16-lr3e-2` +0.0107 [+0.0058, +0.0157] (201 / 324
# pages, TPP 35.6) and `l3m256-lr3e-2` +0.1277 [+0.1195, +0.1359] (314 / 324, TPP 0.139).
HARMFUL_LR_RATIO = 1.0e-2 / 3.0e-3
_RATIO_TOL = 1e-9  # a ratio computed from the same two LRs as HARMFUL_LR_RATIO counts as it

# The kinds of finding `deliberate` can mark as a run's own choice.
KINDS = ("tpp", "lr")
_DELIBERATE: ContextVar[tuple[tuple[str, str], ...]] = ContextVar(
    "memtree_tpp_deliberate", default=()
)


@contextmanager
def deliberate(**why: str) -> Iterator[None]:
    """Within it, `format_tpp` (what `memtree train` prints and logs) shows a finding of each kind
    named (`tpp`: a level's tokens per parameter, `lr`: the bank / anchor LR ratio) as one note that
    quotes `why` instead of a warning: for a run whose settings are chosen on purpose and explained
    in its own report (the bios demo, `eval.demo`). tpp.json and the reports keep the full
    warnings."""
    bad = sorted(set(why) - set(KINDS))
    if bad:
        raise ValueError(f"deliberate: unknown kind(s) {bad}; one of {list(KINDS)}")
    token = _DELIBERATE.set(tuple({**dict(_DELIBERATE.get()), **why}.items()))
    try:
        yield
    finally:
        _DELIBERATE.reset(token)


def deliberate_now() -> dict[str, str]:
    """The kinds marked deliberate by the enclosing `deliberate(...)` blocks, with why."""
    return dict(_DELIBERATE.get())


@dataclass(frozen=True)
class Finding:
    """One thing the table says: `severity` "warning" (a measured run went wrong there) or "note"
    (outside what was measured); `kind` "tpp" or "lr"; `subject` names the setting in a few
    words."""

    kind: str
    severity: str
    subject: str
    text: str


class TppError(ValueError):
    """Bad input to the TPP table, naming the flag or file."""


def leaf_tokens_from_manifest(
    manifest: Mapping[str, Any], where: str | Path = "shards manifest"
) -> dict[int, int]:
    """{leaf id: tokens of one epoch} from a shards manifest's streams (`leaves`, `leaf_tokens`).
    Shards written before the counts existed lack `leaf_tokens`: an error naming the file."""
    out: dict[int, int] = {}
    for s in manifest.get("streams", []):
        if "leaf_tokens" not in s:
            raise TppError(
                f"{where}: stream {s.get('name', '?')} has no per-leaf token counts (leaf_tokens; "
                "shards written before the shards stage's version 2): run `memtree pipeline` on "
                "the run again, which rewrites only the shards, or give --tokens N"
            )
        leaves, tokens = s["leaves"], s["leaf_tokens"]
        if len(leaves) != len(tokens):
            raise TppError(
                f"{where}: stream {s.get('name', '?')} lists {len(leaves)} leaves but "
                f"{len(tokens)} leaf_tokens"
            )
        for leaf, n in zip(leaves, tokens, strict=True):
            out[int(leaf)] = out.get(int(leaf), 0) + int(n)
    if not out:
        raise TppError(f"{where}: no streams")
    return out


@dataclass(frozen=True, kw_only=True)
class ShardCounts:
    """What a shards folder says about its data: tokens per leaf (one epoch) and the tree's
    shape."""

    manifest: Path
    leaf_tokens: dict[int, int]
    n_samples: int
    levels: int
    branching: int
    tree_id: str


def read_shards_counts(path: str | Path, flag: str = "--shards") -> ShardCounts:
    """The counts of a shards folder (RUN/shards) or a pipeline run folder holding one."""
    from memtree.io import check_format, read_json

    p = Path(path)
    manifest = (
        p / "manifest.json" if (p / "manifest.json").is_file() else p / "shards" / "manifest.json"
    )
    if not manifest.is_file():
        raise TppError(
            f"{flag} {path}: no manifest.json there or in {p / 'shards'}; give a pipeline run's "
            "shards/ folder (`memtree pipeline run … --out RUN` writes RUN/shards)"
        )
    m = read_json(manifest)
    # format only, as before: just the stream counts and tree shape are read here; the trainer's
    # reader (training/data.py) is the one that refuses a shards version it cannot read
    check_format(m, "memtree-shards", None, manifest, what="memtree shards", error=TppError)
    return ShardCounts(
        manifest=manifest,
        leaf_tokens=leaf_tokens_from_manifest(m, manifest),
        n_samples=sum(int(s["n_samples"]) for s in m["streams"]),
        levels=int(m["levels"]),
        branching=int(m["branching"]),
        tree_id=str(m.get("tree_id", "")),
    )


def parse_tokens(text: str | float, flag: str = "--tokens") -> int:
    """'3.5M', '2_000_000', '1e6' → a positive token count; anything else names `flag`."""
    s = str(text).strip().replace("_", "").replace(",", "")
    mult = 1
    if s[-1:].upper() in ("K", "M", "B", "T"):
        mult = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}[s[-1].upper()]
        s = s[:-1]
    try:
        value = float(s) * mult
    except ValueError:
        raise TppError(f"{flag} {text!r}: not a number of tokens (e.g. 3500000, 3.5M)") from None
    if not math.isfinite(value) or value < 1:
        raise TppError(f"{flag} {text!r}: must be a positive number of tokens")
    return round(value)


def even_leaf_tokens(total: int, plan: Plan, tree_levels: int | None = None) -> dict[int, int]:
    """A total spread evenly over the leaves of the plan's tree (the estimate without shards)."""
    n = plan.memory.branching ** (tree_levels or plan.memory.n_levels)
    base, extra = divmod(int(total), n)
    return {leaf: base + (1 if leaf < extra else 0) for leaf in range(n)}


@dataclass(frozen=True, kw_only=True)
class LevelTpp:
    level: int
    multiplier: int
    n_blocks: int
    block_params: int
    trained_blocks: int  # blocks that any training token reaches
    tokens_min: int  # per block, one epoch, among trained blocks
    tokens_median: float
    tokens_max: int
    tpp_epoch: float  # the level's fetched tokens of one epoch / its bank parameters
    tpp_run: float
    tpp_run_min: float  # per block, over the run
    tpp_run_median: float
    tpp_run_max: float
    generic_tpp_run: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True, kw_only=True)
class TppTable:
    epochs: float
    epoch_tokens: int
    generic_prob: float
    dropout: float
    source: str  # where the token counts came from
    levels: tuple[LevelTpp, ...]
    threshold: float = GENERALISES_DOWN_TO
    lr_ratio: float | None = None  # the bank's LR / the anchor's (None: not given)
    # the sizing rule: per tree level (level, the largest multiplier that keeps the level's TPP over
    # the run at or above `threshold`; 0: not even a multiplier of 1 does)
    max_multipliers: tuple[tuple[int, int], ...] = ()

    def outside_measured(self) -> list[LevelTpp]:
        """Levels under `threshold` (the fewest tokens per parameter measured), warned or noted."""
        return [lv for lv in self.levels if lv.tpp_run < self.threshold]

    def findings(self) -> list[Finding]:
        """Per level and for the LR ratio, what the measurements say about this table (module
        docstring)."""
        out = []
        for lv in self.outside_measured():
            seen = (
                f"level {lv.level}: each block sees {lv.tpp_run:.3g} training tokens per parameter "
                "over the run (a median block "
                f"{human(lv.tokens_median * self.epochs * self._fetch_share)} tokens for "
                f"{human(lv.block_params)} parameters)"
            )
            fix = (
                "Fewer or smaller blocks at this level (a lower multiplier, or memory one level "
                "up), or more data, raise it."
            )
            subject = f"level {lv.level} at {lv.tpp_run:.3g} tokens per parameter"
            if lv.tpp_run <= FETCH_WORSE_AT_TPP:
                out.append(
                    Finding(
                        "tpp",
                        "warning",
                        subject,
                        (
                            f"{seen}, at or under {FETCH_WORSE_AT_TPP:g}: the one run measured "
                            "this low (memories at levels 2 and 3 on frozen SmolLM2-135M, 0.0044 "
                            "and 0.00066 tokens per parameter) read held-out pages worse with its "
                            "fetched blocks than with the generic memory (+0.034 nats/token, 27 of "
                            "33 pages; that run also had a frozen pretrained anchor and half an "
                            f"epoch). {fix}"
                        ),
                    )
                )
            else:
                out.append(
                    Finding(
                        "tpp",
                        "note",
                        subject,
                        (
                            f"{seen}, under {self.threshold:g}, the fewest measured on real text "
                            "(where the bank still generalised); nothing between that and "
                            f"{FETCH_WORSE_AT_TPP:g} (where a run's fetched memory read worse than "
                            "its generic one) was measured, so whether these blocks generalise or "
                            f"store their windows is not known. {fix}"
                        ),
                    )
                )
        r = self.lr_ratio
        if r is not None and r > SAFE_LR_RATIO and self.levels:
            low = min(lv.tpp_run for lv in self.levels)
            subject = f"the bank's learning rate at {r:.3g}× the anchor's"
            if r >= HARMFUL_LR_RATIO * (1 - _RATIO_TOL):
                out.append(
                    Finding(
                        "lr",
                        "warning",
                        subject,
                        (
                            f"the bank learns at {r:.3g}× the anchor's learning rate, at or above "
                            f"{HARMFUL_LR_RATIO:.3g}× (bank 1e-2, anchor 3e-3), the smallest ratio "
                            "measured to harm text the model has not seen: co-trained at 3.3× and "
                            "10×, the bank took the anchor's share of the gradient, and anchor + "
                            "fetched memory read held-out pages worse than the anchor's shape "
                            "trained alone (+0.19 and +0.30 nats/token; at 10× on a second corpus "
                            "+0.011 with 35.6 tokens per parameter and +0.13 with 0.139, worse the "
                            f"bigger the bank; here the lowest level sees {low:.3g}). Set "
                            "memory.lr at or below optim.lr for such text (a third of it measured "
                            "best), unless the run is meant to memorise its documents (the bios "
                            "demo)."
                        ),
                    )
                )
            else:
                out.append(
                    Finding(
                        "lr",
                        "note",
                        subject,
                        (
                            f"the bank learns at {r:.3g}× the anchor's learning rate: between "
                            f"{SAFE_LR_RATIO:g}× (measured not to harm held-out text) and "
                            f"{HARMFUL_LR_RATIO:.3g}× (measured to harm it), untested; a third of "
                            "the anchor's rate measured best on real text."
                        ),
                    )
                )
        return out

    def warnings(self) -> list[str]:
        """One sentence per finding where a measured run went wrong, in words a user understands."""
        return [f.text for f in self.findings() if f.severity == "warning"]

    def notes(self) -> list[str]:
        """One sentence per finding outside what was measured (not a warning)."""
        return [f.text for f in self.findings() if f.severity == "note"]

    def console_lines(self, deliberate: Mapping[str, str] | None = None) -> list[str]:
        """The "warning: …" and "note: …" lines `format_tpp` prints. A finding of a kind in
        `deliberate` (default: the enclosing `deliberate(...)` blocks) is one note quoting why, not
        a warning."""
        chosen = deliberate_now() if deliberate is None else dict(deliberate)
        out = []
        for f in self.findings():
            if f.kind in chosen:
                out.append(
                    f"note: {f.subject} is this run's deliberate setting ({chosen[f.kind]}); "
                    "tpp.json records what was measured for it"
                )
            else:
                out.append(f"{f.severity}: {f.text}")
        return out

    @property
    def _fetch_share(self) -> float:
        return (1.0 - self.generic_prob) * (1.0 - self.dropout)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "epochs": self.epochs,
            "epoch_tokens": self.epoch_tokens,
            "generic_prob": self.generic_prob,
            "dropout": self.dropout,
            "source": self.source,
            "threshold": self.threshold,
            "lr_ratio": self.lr_ratio,
            "levels": [lv.to_dict() for lv in self.levels],
            "max_multipliers": {str(lv): m for lv, m in self.max_multipliers},
            "warnings": self.warnings(),
            "notes": self.notes(),
            "harmful_tpp": FETCH_WORSE_AT_TPP,
            "harmful_lr_ratio": HARMFUL_LR_RATIO,
        }


def bank_lr_ratio(
    *, bank_lr: float, lr_by_level: Sequence[float], multipliers: Sequence[int], anchor_lr: float
) -> float | None:
    """The fastest memory level's learning rate over the anchor's (None when the anchor's is 0):
    `lr_by_level` (memory.lr_by_level, one per level) overrides `bank_lr` (memory.lr) where given,
    and only levels with memory (multiplier > 0) count."""
    fastest = max(
        (lr for lr, m in zip(lr_by_level, multipliers, strict=False) if m), default=bank_lr
    )
    return fastest / anchor_lr if anchor_lr > 0 else None


def table_from_dict(
    t: Mapping[str, Any],
    *,
    threshold: float | None = None,
    lr_ratio: float | None = None,
    where: str | Path = "tpp table",
) -> TppTable:
    """A stored table (`TppTable.to_dict()`, e.g. a run's tpp.json) back as a TppTable, so that its
    warnings follow `threshold` (default: the stored one) and `lr_ratio` (default: the stored one).
    A run trained before a threshold changed is read under the current rule; its sizing rule is kept
    only when the threshold is the one it was computed for (it scales with 1 / threshold).
    `where` (the file it was read from) names it in the error for a table of another format.
    The warnings follow today's measured rule (`FETCH_WORSE_AT_TPP`, `HARMFUL_LR_RATIO`) whatever
    the table stored."""
    from memtree.io import check_format

    # no version check: this reader has never refused a table for its version
    check_format(t, FORMAT, None, where, error=TppError)
    stored = float(t["threshold"])
    threshold = stored if threshold is None else float(threshold)
    sizing = tuple((int(lv), int(m)) for lv, m in (t.get("max_multipliers") or {}).items())
    return TppTable(
        epochs=float(t["epochs"]),
        epoch_tokens=int(t["epoch_tokens"]),
        generic_prob=float(t["generic_prob"]),
        dropout=float(t["dropout"]),
        source=str(t["source"]),
        levels=tuple(LevelTpp(**lv) for lv in t["levels"]),
        threshold=threshold,
        lr_ratio=t.get("lr_ratio") if lr_ratio is None else float(lr_ratio),
        max_multipliers=sizing if threshold == stored else (),
    )


def tpp_table(
    plan: Plan,
    leaf_tokens: Mapping[int, int],
    *,
    epochs: float = 1.0,
    generic_prob: float | None = None,
    dropout: float = 0.0,
    source: str = "",
    threshold: float = GENERALISES_DOWN_TO,
    tree_levels: int | None = None,
    lr_ratio: float | None = None,
) -> TppTable:
    """Per level with memory: blocks, parameters per block, tokens per block of one epoch
    (min / median / max over the blocks any token reaches) and TPP per epoch and over `epochs`.

    leaf_tokens: {leaf id: tokens of one epoch}; generic_prob: the share of forwards that read the
    generic row (None: 1 / branching, the trainer's default); dropout: the share that runs the
    anchor alone; tree_levels: the tree's depth when the memory covers fewer levels (default: as
    many); lr_ratio: the bank's learning rate over the anchor's, for the warning on a bank that
    outpaces it."""
    if not epochs > 0:
        raise TppError(f"duration: must be positive, got {epochs} epochs")
    mem = plan.memory
    gp = 1.0 / mem.branching if generic_prob is None else float(generic_prob)
    if not 0.0 <= gp <= 1.0 or not 0.0 <= dropout < 1.0:
        raise TppError(f"generic_prob {gp} must be in [0, 1] and dropout {dropout} in [0, 1)")
    depth = tree_levels or mem.n_levels
    if depth < mem.n_levels:
        raise TppError(f"memory has {mem.n_levels} levels but the tree only {depth}")
    n_leaves = mem.branching**depth
    bad = [leaf for leaf in leaf_tokens if not 0 <= leaf < n_leaves]
    if bad:
        raise TppError(
            f"{source or 'leaf tokens'}: leaf ids {sorted(bad)[:5]} outside [0, {n_leaves}) of a "
            f"{depth}-level × {mem.branching} tree: the counts come from another tree"
        )
    total = int(sum(leaf_tokens.values()))
    fetch, generic = (1.0 - gp) * (1.0 - dropout), gp * (1.0 - dropout)
    levels = []
    for lv in plan.levels:
        if lv.multiplier == 0 or lv.block_params == 0:
            continue
        per_block: dict[int, int] = {}
        shift = mem.branching ** (depth - lv.level)
        for leaf, n in leaf_tokens.items():
            per_block[leaf // shift] = per_block.get(leaf // shift, 0) + int(n)
        counts = sorted(n for n in per_block.values() if n > 0) or [0]
        run = [n * fetch * epochs / lv.block_params for n in counts]
        levels.append(
            LevelTpp(
                level=lv.level,
                multiplier=lv.multiplier,
                n_blocks=lv.n_blocks,
                block_params=lv.block_params,
                trained_blocks=sum(1 for n in per_block.values() if n > 0),
                tokens_min=counts[0],
                tokens_median=float(statistics.median(counts)),
                tokens_max=counts[-1],
                tpp_epoch=total * fetch / lv.bank_params,
                tpp_run=total * fetch * epochs / lv.bank_params,
                tpp_run_min=run[0],
                tpp_run_median=float(statistics.median(run)),
                tpp_run_max=run[-1],
                generic_tpp_run=total * generic * epochs / lv.block_params,
            )
        )
    sizing = []
    for level in range(
        1, mem.n_levels + 1
    ):  # per unit of multiplier: block parameters are linear in it
        unit = plan_sizes(
            plan.anchor,
            replace(mem, multipliers=tuple(int(i == level) for i in range(1, mem.n_levels + 1))),
        )
        per_m = unit.levels[level - 1].bank_params
        sizing.append((level, int(total * fetch * epochs / (per_m * threshold)) if per_m else 0))
    return TppTable(
        epochs=float(epochs),
        epoch_tokens=total,
        generic_prob=gp,
        dropout=float(dropout),
        source=source,
        levels=tuple(levels),
        threshold=threshold,
        max_multipliers=tuple(sizing),
        lr_ratio=lr_ratio,
    )


def parse_duration_epochs(
    duration: str,
    *,
    epoch_tokens: int,
    epoch_samples: int | None = None,
    batch_size: int | None = None,
    flag: str = "--duration",
) -> float:
    """A Composer-style duration as epochs: '5ep', '3.5Mtok' (or '3500000tok'), '1200sp' (samples),
    '400ba' (batches, with batch_size); the units that need the data's size take it from the
    counts."""
    s = str(duration).strip()
    for unit in ("ep", "tok", "sp", "ba"):
        if s.endswith(unit):
            num = s[: -len(unit)]
            break
    else:
        raise TppError(
            f"{flag} {duration!r}: give epochs, tokens, samples or batches ('5ep', '3.5Mtok', "
            "'1200sp', '400ba')"
        )
    try:
        value = float(num) if unit == "ep" else float(parse_tokens(num, flag))
    except (TppError, ValueError):
        raise TppError(f"{flag} {duration!r}: {num!r} is not a number") from None
    if not value > 0:
        raise TppError(f"{flag} {duration!r}: must be positive")
    if unit == "ep":
        return value
    if unit == "tok":
        return value / epoch_tokens
    if epoch_samples is None:
        raise TppError(
            f"{flag} {duration!r}: samples and batches need the shards' sample count (give "
            "--shards)"
        )
    if unit == "sp":
        return value / epoch_samples
    if not batch_size:
        raise TppError(f"{flag} {duration!r}: batches need the batch size (--batch-size)")
    return value * batch_size / epoch_samples


def format_tpp(t: TppTable) -> str:
    """The table `memtree memstore plan` prints and `memtree train` logs, with its warnings and
    notes (`TppTable.console_lines`: inside `deliberate(...)`, a deliberate setting's is one
    note)."""
    lines = [
        (
            f"tokens per parameter ({t.source or 'given counts'}): {t.epoch_tokens:,} tokens per "
            f"epoch, {t.epochs:g} epochs; fetched on {(1 - t.generic_prob) * (1 - t.dropout):.1%} "
            f"of the forwards (generic {t.generic_prob:.3g}, anchor alone {t.dropout:.3g})"
        ),
        (
            f"{'level':>5} {'m':>5} {'blocks':>7} {'params/block':>13} "
            f"{'tokens/block/epoch min / median / max':>38} {'TPP/epoch':>10} {'TPP run':>9} "
            f"{'block TPP run min / med / max':>30}"
        ),
    ]
    for lv in t.levels:
        tok = f"{human(lv.tokens_min)} / {human(lv.tokens_median)} / {human(lv.tokens_max)}"
        blk = f"{lv.tpp_run_min:.3g} / {lv.tpp_run_median:.3g} / {lv.tpp_run_max:.3g}"
        lines.append(
            f"{lv.level:>5} {lv.multiplier:>5} {lv.n_blocks:>7,} {lv.block_params:>13,} {tok:>38} "
            f"{lv.tpp_epoch:>10.3g} {lv.tpp_run:>9.3g} {blk:>30}"
            + (
                ""
                if lv.trained_blocks == lv.n_blocks
                else f"  ({lv.n_blocks - lv.trained_blocks} blocks get no data)"
            )
        )
    if not t.levels:
        lines.append("  (no level holds memory)")
    if t.max_multipliers:
        lines.append(
            f"sizing rule (every level at TPP ≥ {t.threshold:g} over the run, the fewest "
            "measured): multiplier at most "
            + ", ".join(f"{m} at level {lv}" for lv, m in t.max_multipliers)
        )
    lines += t.console_lines()
    return "\n".join(lines)


def format_tpp_markdown(t: Mapping[str, Any]) -> list[str]:
    """A stored table (`TppTable.to_dict()`, e.g. a run's tpp.json) as markdown lines for
    reports."""
    lines = [
        (
            f"Tokens per parameter: {t['epoch_tokens']:,} tokens per epoch, {t['epochs']:g} epochs "
            f"({t['source']}); {t['threshold']:g} over the run is the fewest measured on real "
            "text, where the bank still generalised"
            + (
                f"; the bank learns at {t['lr_ratio']:.3g}× the anchor's LR"
                if t.get("lr_ratio")
                else ""
            )
            + "."
        ),
        "",
        (
            "| level | m | blocks | params / block | tokens / block / epoch (min / median / max) | "
            "TPP / epoch | TPP over the run |"
        ),
        "|---:|---:|---:|---:|---|---:|---:|",
    ]
    for lv in t["levels"]:
        lines.append(
            f"| {lv['level']} | {lv['multiplier']} | {lv['n_blocks']:,} | {lv['block_params']:,} | "
            f"{human(lv['tokens_min'])} / {human(lv['tokens_median'])} / {human(lv['tokens_max'])} "
            f"| {lv['tpp_epoch']:.3g} | {lv['tpp_run']:.3g} |"
        )
    if t.get("max_multipliers"):
        lines += [
            "",
            f"Sizing rule (every level at TPP ≥ {t['threshold']:g} over the run, the fewest "
            "measured): multiplier at most "
            + ", ".join(f"{m} at level {lv}" for lv, m in t["max_multipliers"].items())
            + ".",
        ]
    if t.get("warnings") or t.get("notes"):
        lines += [
            "",
            *(f"- warning: {w}" for w in t.get("warnings") or []),
            *(f"- note: {n}" for n in t.get("notes") or []),
        ]
    return lines
