"""Data placed next to its memory: global batches built from per-subtree lanes
(`parallel.data: lanes`).

With a sharded bank (`parallel.bank: sharded`, training/bank_shards.py) a rank holds the bank rows
of some level-1 subtrees only, so it must read only the sequences routed into them: then every row
a step fetches is local and no bank row crosses the network. The shards already keep one MDS
stream per level-1 subtree (pipeline/README.md); here each stream is a *lane*:

- lane k (level-1 subtree s_k, n_k samples) contributes b_k samples to every global batch of B
  sequences, b_k apportioned to n_k by largest remainders (each lane at least 1), so a batch is
  the mixture uniform sampling gives *in expectation*, without its per-batch spread;
- a lane reads its stream in a shuffled order of its own, drawn from (shuffle_seed, s_k, lane
  epoch) and redrawn each time the lane wraps; global step t takes positions [t·b_k, (t+1)·b_k)
  of that endless order, and an epoch is ⌊N / B⌋ steps (N = Σ n_k), so every sample of lane k is
  seen on average S·b_k / n_k times per epoch (1 up to the rounding of b_k);
- nothing above depends on the number of ranks: the global batch of step t is the same at any
  world size, and a run resumes on another number of ranks with the same batches;
- the ranks form G memory-parallel groups of R = W / G replicas (`place`); group g holds the rows
  of some level-1 subtrees and reads their lanes, its step samples dealt round-robin to its
  replicas. Lanes are dealt to the groups in a snake over b_k (largest first), so groups hold
  ⌊L/G⌋ or ⌈L/G⌉ lanes with near-equal per-step samples; subtrees without data are dealt to the
  groups holding fewest, so every group stores about B/G subtrees' rows.

Samples are read by index through Streaming's `StreamingDataset` (random access over the real
MDS shards, decompressed and cached by Streaming). The loader positions itself from the trainer's
clock (epoch, batch in epoch), so a resumed run does not replay the batches it skips.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass(frozen=True, kw_only=True)
class LanePlan:
    """The world-independent part: which samples make up every global batch."""

    subtrees: tuple[int, ...]  # lane k reads level-1 subtree subtrees[k]'s stream
    sizes: tuple[int, ...]  # n_k samples in lane k
    per_step: tuple[int, ...]  # b_k samples of lane k in every global batch
    batch_size: int  # B = Σ b_k
    steps_per_epoch: int
    shuffle: bool = True
    seed: int = 0

    @property
    def n_samples(self) -> int:
        return sum(self.sizes)

    def lane_samples(self, lane: int, step: int) -> np.ndarray:
        """(b_k,) lane-local sample indices lane `lane` contributes to global step `step`."""
        n, b = self.sizes[lane], self.per_step[lane]
        pos = np.arange(step * b, (step + 1) * b, dtype=np.int64)
        out = np.empty(b, dtype=np.int64)
        for epoch in np.unique(pos // n):
            at = pos // n == epoch
            out[at] = _lane_order(self.seed, self.subtrees[lane], int(epoch), n, self.shuffle)[
                pos[at] % n
            ]
        return out

    def composition(self) -> dict[str, Any]:
        """Each lane's share of a batch against uniform sampling's expectation (n_k / N) and its
        per-batch spread under uniform sampling (the binomial sd of the share), and the
        exposures per epoch of a sample of each lane (S·b_k / n_k; uniform sampling: 1)."""
        N, B, S = self.n_samples, self.batch_size, self.steps_per_epoch
        lanes = []
        for s, n, b in zip(self.subtrees, self.sizes, self.per_step, strict=True):
            p = n / N
            lanes.append(
                {
                    "subtree": s,
                    "samples": n,
                    "per_step": b,
                    "share": b / B,
                    "uniform_share": p,
                    "uniform_share_sd": float(np.sqrt(p * (1 - p) / B)),
                    "exposures_per_epoch": S * b / n,
                }
            )
        bias = [abs(x["share"] - x["uniform_share"]) for x in lanes]
        sd = [x["uniform_share_sd"] for x in lanes]
        exp = [x["exposures_per_epoch"] for x in lanes]
        return {
            "batch_size": B,
            "steps_per_epoch": S,
            "lanes": lanes,
            "max_share_bias": max(bias),
            "mean_uniform_share_sd": float(np.mean(sd)),
            "exposures_per_epoch": {"min": min(exp), "max": max(exp)},
        }


@lru_cache(maxsize=64)
def _lane_order(seed: int, subtree: int, epoch: int, n: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, subtree, epoch]).permutation(n).astype(np.int64)


def apportion(total: int, sizes: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """`total` split proportionally to `sizes` by largest remainders, every part at least 1."""
    if total < len(sizes):
        raise ValueError(
            f"a global batch of {total} cannot hold one sample of each of {len(sizes)} lanes "
            "(parallel.data: lanes); raise data.batch_size"
        )
    N = sum(sizes)
    quota = [total * n / N for n in sizes]
    parts = [max(1, int(q)) for q in quota]
    # hand out what is left by largest remainder; take back from the parts furthest above quota
    order = sorted(range(len(sizes)), key=lambda k: (-(quota[k] - int(quota[k])), k))
    i = 0
    while sum(parts) < total:
        parts[order[i % len(order)]] += 1
        i += 1
    while sum(parts) > total:
        k = max(
            (k for k in range(len(sizes)) if parts[k] > 1), key=lambda k: (parts[k] - quota[k], -k)
        )
        parts[k] -= 1
    return tuple(parts)


def plan_lanes(
    streams: list[dict[str, Any]], *, batch_size: int, shuffle: bool = True, shuffle_seed: int = 0
) -> LanePlan:
    """Lanes over the manifest's streams (those with samples; `training.data.selected_streams`)."""
    streams = sorted(streams, key=lambda s: s["subtree"])
    sizes = tuple(int(s["n_samples"]) for s in streams)
    if not sizes or min(sizes) <= 0:
        raise ValueError("plan_lanes: needs one or more streams with samples")
    per_step = apportion(batch_size, sizes)
    steps = sum(sizes) // batch_size
    if steps == 0:
        raise ValueError(f"data.batch_size {batch_size} is larger than the {sum(sizes)} samples")
    return LanePlan(
        subtrees=tuple(int(s["subtree"]) for s in streams),
        sizes=sizes,
        per_step=per_step,
        batch_size=batch_size,
        steps_per_epoch=steps,
        shuffle=shuffle,
        seed=shuffle_seed,
    )


@dataclass(frozen=True, kw_only=True)
class Placement:
    """The world-dependent part: which ranks hold which subtrees' rows and read which lanes."""

    world: int
    replicas: int  # R: ranks holding the same rows
    holds: tuple[tuple[int, ...], ...]  # group g → the level-1 subtrees whose bank rows it holds
    lanes: tuple[tuple[int, ...], ...]  # group g → the lanes (indices into LanePlan) it reads
    groups: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", len(self.holds))

    def group_of(self, rank: int) -> int:
        return rank // self.replicas

    def replica_of(self, rank: int) -> int:
        return rank % self.replicas

    def group_ranks(self, group: int) -> list[int]:
        return list(range(group * self.replicas, (group + 1) * self.replicas))


def default_groups(world: int, lanes: int) -> int:
    """G: the largest divisor of the world size that is at most the number of lanes."""
    return max(g for g in range(1, min(world, lanes) + 1) if world % g == 0)


def place(plan: LanePlan, *, branching: int, world: int, groups: int | None = None) -> Placement:
    """Deal the lanes and the level-1 subtrees' bank rows to G groups of W / G ranks."""
    L = len(plan.subtrees)
    G = default_groups(world, L) if groups is None else groups
    if G < 1 or world % G:
        raise ValueError(f"parallel.bank_shards {G} must divide the {world} ranks")
    if G > L:
        raise ValueError(
            f"parallel.bank_shards {G}: more shards than the {L} level-1 subtrees with data "
            f"{list(plan.subtrees)}; a shard must read one (use at most {L})"
        )
    R = world // G
    order = sorted(range(L), key=lambda k: (-plan.per_step[k], -plan.sizes[k], plan.subtrees[k]))
    lanes: list[list[int]] = [[] for _ in range(G)]
    for i, k in enumerate(order):  # snake: 0..G-1, G-1..0, …
        rnd, j = divmod(i, G)
        lanes[j if rnd % 2 == 0 else G - 1 - j].append(k)
    holds = [[plan.subtrees[k] for k in ks] for ks in lanes]
    for s in range(branching):  # subtrees without data in this run: rows stored where fewest are
        if s not in plan.subtrees:
            min(holds, key=len).append(s)
    for g in range(G):
        per_step = sum(plan.per_step[k] for k in lanes[g])
        if per_step < R:
            raise ValueError(
                f"bank shard {g} (subtrees {sorted(holds[g])}) gets {per_step} samples per "
                f"global batch, fewer than its {R} ranks; raise data.batch_size or "
                "parallel.bank_shards"
            )
    return Placement(
        world=world,
        replicas=R,
        holds=tuple(tuple(sorted(h)) for h in holds),
        lanes=tuple(tuple(sorted(ks)) for ks in lanes),
    )


class LaneBatches(DistributedSampler):
    """Per step, this rank's share of the global batch as StreamingDataset sample ids.

    A DistributedSampler (each rank draws a disjoint share of every global batch), which is what
    Composer checks a multi-rank map-style loader for; used as the loader's batch sampler."""

    def __init__(self, plan: LanePlan, placement: Placement, rank: int, offsets: list[int]) -> None:
        super().__init__(
            range(plan.n_samples), num_replicas=placement.world, rank=rank, shuffle=False
        )
        self.plan, self.placement, self.rank = plan, placement, rank
        self.offsets = offsets  # lane k's first sample id in the StreamingDataset
        self.clock: Callable[[], tuple[int, int]] | None = None
        self._epoch = 0

    def bind(self, clock: Callable[[], tuple[int, int]]) -> None:
        """Start each epoch's iteration at the trainer's (epoch, batches done in it)."""
        self.clock = clock

    def __len__(self) -> int:
        return self.plan.steps_per_epoch

    def rank_samples(self, step: int) -> list[int]:
        g = self.placement.group_of(self.rank)
        ids = np.concatenate(
            [self.plan.lane_samples(k, step) + self.offsets[k] for k in self.placement.lanes[g]]
        )
        return ids[self.placement.replica_of(self.rank) :: self.placement.replicas].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        epoch, done = self.clock() if self.clock is not None else (self._epoch, 0)
        self._epoch = epoch + 1
        S = self.plan.steps_per_epoch
        for step in range(epoch * S + done, (epoch + 1) * S):
            yield self.rank_samples(step)


class _ByIndex(Dataset):
    """A StreamingDataset read by sample id (map-style, for a batch sampler)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.dataset[i]


def build_lane_loader(
    shards: str | Path,
    manifest: dict[str, Any],
    streams: list[dict[str, Any]],
    *,
    plan: LanePlan,
    placement: Placement,
    rank: int,
    collate: Callable,
    num_workers: int = 0,
) -> DataLoader:
    """This rank's loader: `LaneBatches` over one StreamingDataset of every lane's stream (the same
    on every rank, as Streaming's shared state wants; a rank reads only its lanes' shards)."""
    from streaming import Stream, StreamingDataset

    by_subtree = {int(s["subtree"]): s for s in streams}
    lanes = [by_subtree[s] for s in plan.subtrees]
    dataset = StreamingDataset(
        streams=[Stream(local=str(Path(shards) / s["name"])) for s in lanes],
        shuffle=False,
        batch_size=1,
        replication=None,
        num_canonical_nodes=1,
    )
    offsets = [int(x) for x in dataset.sample_offset_per_stream]
    sizes = [int(x) for x in dataset.samples_per_stream]
    if tuple(sizes) != plan.sizes:
        raise ValueError(
            f"{shards}: the streams hold {sizes} samples, the manifest records {list(plan.sizes)}"
        )
    sampler = LaneBatches(plan, placement, rank, offsets)
    return DataLoader(
        _ByIndex(dataset), batch_sampler=sampler, collate_fn=collate, num_workers=num_workers
    )


def world_batches(plan: LanePlan, steps: range) -> list[list[tuple[int, int]]]:
    """The global batches of `steps` as (subtree, stream-local sample index), lane by lane: what
    every world size reads (for tests and the composition report)."""
    return [
        [
            (plan.subtrees[k], int(i))
            for k in range(len(plan.subtrees))
            for i in plan.lane_samples(k, t)
        ]
        for t in steps
    ]
