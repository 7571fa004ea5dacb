"""Where a multi-rank run's bank rows and data live (`parallel:` in the config, training/README.md).

`parallel_layout(cfg)` is None for the default (a replicated bank, Streaming's uniform batches).
Otherwise it plans the lanes (training/lanes.py) and places them, with the bank rows of their
level-1 subtrees, on G memory-parallel groups of W / G ranks; `ParallelLayout.loader` gives this
rank's data and, for a sharded bank, `shard_bank` tells the optimizer how each table is split and
returns the callback that checkpoints the shards (training/bank_shards.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtree.training.bank import TrainableBank
from memtree.training.bank_shards import BankShardCheckpoints
from memtree.training.config import TrainConfig
from memtree.training.data import Collate, read_shards_manifest, selected_streams
from memtree.training.lanes import LanePlan, Placement, build_lane_loader, place, plan_lanes
from memtree.training.optim import MemoryAdamW, RowShard


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    plan: LanePlan
    placement: Placement
    rank: int
    manifest: dict[str, Any]
    streams: list[dict[str, Any]]
    shard: (
        tuple[int, ...] | None
    )  # the level-1 subtrees whose bank rows this rank holds (sharded bank)

    @property
    def max_rank_batch(self) -> int:
        """The most samples any rank reads in one step (its group's per-step share over its
        replicas)."""
        pl = self.placement
        return max(
            -(-sum(self.plan.per_step[k] for k in lanes) // pl.replicas) for lanes in pl.lanes
        )

    @property
    def group(self) -> int:
        return self.placement.group_of(self.rank)

    def loader(self, cfg: TrainConfig):
        collate = Collate(int(self.manifest["seq_len"]), int(self.manifest["eot_id"]))
        return build_lane_loader(
            cfg.data.shards,
            self.manifest,
            self.streams,
            plan=self.plan,
            placement=self.placement,
            rank=self.rank,
            collate=collate,
            num_workers=cfg.data.num_workers,
        )

    def shard_bank(
        self, bank: TrainableBank, optimizer: MemoryAdamW, cfg: TrainConfig
    ) -> BankShardCheckpoints:
        """Mark each table as this rank's shard for the optimizer (its replica group's process group
        for the owned rows, the world for the generic row); the callback that checkpoints it."""
        import torch.distributed as tdist

        pl = self.placement
        pg = None
        if pl.replicas > 1:
            # every rank creates every group, in the same order (torch.distributed's rule)
            made = [tdist.new_group(pl.group_ranks(g)) for g in range(pl.groups)]
            pg = made[self.group]
        for lv in bank.levels:
            optimizer.shard_rows(
                bank.tables[str(lv)],
                RowShard(generic_row=bank.generic_slot(lv), group=pg, replicas=pl.replicas),
            )
        return BankShardCheckpoints(
            Path(cfg.save_folder) / "checkpoints" / "bank",
            cfg.save_interval,
            replica=pl.replica_of(self.rank),
            world_meta={"world": pl.world, "groups": pl.groups, "replicas": pl.replicas},
            # recorded so `memtree memstore export` writes the bank `training.train.export` does
            export={"dtype": cfg.memory.export_dtype, "tree_id": self.manifest.get("tree_id")},
        )


def parallel_layout(cfg: TrainConfig) -> ParallelLayout | None:
    """The lanes and their placement on this world, or None (uniform data, replicated bank).
    Call after the process group is initialised."""
    if not cfg.data_lanes:
        return None
    from composer.utils import dist

    manifest = read_shards_manifest(cfg.data.shards)
    streams = selected_streams(manifest, cfg.data.subtrees)
    plan = plan_lanes(
        streams,
        batch_size=cfg.data.batch_size,
        shuffle=cfg.data.shuffle,
        shuffle_seed=cfg.data.shuffle_seed,
    )
    world, rank = dist.get_world_size(), dist.get_global_rank()
    try:
        placement = place(
            plan, branching=int(manifest["branching"]), world=world, groups=cfg.parallel.bank_shards
        )
    except ValueError as e:
        from memtree.config import ConfigError

        raise ConfigError(str(e)) from None
    shard = placement.holds[placement.group_of(rank)] if cfg.parallel.bank == "sharded" else None
    return ParallelLayout(
        plan=plan, placement=placement, rank=rank, manifest=manifest, streams=streams, shard=shard
    )
