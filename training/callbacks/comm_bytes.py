"""Bytes each rank sends per step, by collective (`comm/bytes/<kind>`), and their running totals.

`MemoryAdamW.comm_bytes` counts the optimizer's own collectives (the bank's sparse rows, the
generic rows, the norm and size scalars). With `hook_ddp=True` the anchor's DDP gradient
all-reduce is counted too, by a DDP communication hook that wraps the default all-reduce (the
same division by the world size, then the same all-reduce, so the training is unchanged); DDP
takes one hook per model, so it is opt-in. Every figure is the ring algorithm's bytes sent per
rank (`training.optim.ring_bytes`), as nccl-tests' bus bandwidth counts them.
"""

from __future__ import annotations

import torch.distributed as tdist
from composer.core import Callback, State
from composer.loggers import Logger

from training.optim import ring_bytes


class CommBytes(Callback):
    def __init__(self, *, hook_ddp: bool = False) -> None:
        self.hook_ddp = hook_ddp
        self.totals: dict[str, int] = {}
        self.last: dict[str, int] = {}  # bytes sent in the last step, per kind
        self._ddp = 0
        self._seen: dict[str, int] = {}

    def fit_start(self, state: State, logger: Logger) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        if not self.hook_ddp or not isinstance(state.model, DistributedDataParallel):
            return

        def counting(process_group, bucket):  # unannotated: DDP checks a hook's annotations
            buf = bucket.buffer()
            self._ddp += ring_bytes("all_reduce", buf.numel() * buf.element_size(), tdist.get_world_size())
            return allreduce_hook(process_group, bucket)

        state.model.register_comm_hook(None, counting)

    def batch_end(self, state: State, logger: Logger) -> None:
        opt = state.optimizers[0]
        now = dict(getattr(opt, "comm_bytes", {}))
        step = {k: v - self._seen.get(k, 0) for k, v in now.items()}
        self._seen = now
        if self.hook_ddp:
            step["anchor_ddp_all_reduce"], self._ddp = self._ddp, 0
        self.last = step
        for k, v in step.items():
            self.totals[k] = self.totals.get(k, 0) + v
        if step:
            logger.log_metrics({f"comm/bytes/{k}": v for k, v in step.items()}
                               | {"comm/bytes/step_total": sum(step.values())})
