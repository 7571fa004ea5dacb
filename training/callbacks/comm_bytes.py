"""Bytes each rank sends per step, by collective (`comm/bytes/<kind>`), their sum and running
totals.

`MemoryAdamW.comm_bytes` counts the optimizer's own collectives (the bank's sparse rows, the
generic rows, the norm and size scalars). With `hook_ddp` (the default; config key
`comm_ddp_hook`) the anchor's DDP gradient all-reduce is counted too, by a DDP communication hook
that wraps the default all-reduce (the same division by the world size, then the same
all-reduce, so the training is unchanged; its cost is one Python call per gradient bucket, about
25 MB of gradients each). DDP takes one hook per model: every `CommBytes` of a run shares the one
it registers, and a hook of someone else's leaves the anchor uncounted.

The step's sum is `comm/bytes/step_total` only when it holds every collective of the step that
moves gradients or bank rows: the anchor's all-reduce is counted, or there is none (one rank).
Otherwise (hook off, another hook in place, an FSDP anchor whose reduce-scatter no hook sees) it
is `comm/bytes/step_total_excl_anchor`. Composer's own per-step scalars (the batch's token count,
the logged loss) are not counted. Every figure is the ring algorithm's bytes sent per rank
(`training.optim.ring_bytes`), as nccl-tests' bus bandwidth counts them.
"""

from __future__ import annotations

import logging

import torch.distributed as tdist
from composer.core import Callback, State
from composer.loggers import Logger

from memtree.training.optim import ring_bytes

log = logging.getLogger(__name__)


class CommBytes(Callback):
    def __init__(self, *, hook_ddp: bool = True) -> None:
        self.hook_ddp = hook_ddp
        self.totals: dict[str, int] = {}
        self.last: dict[str, int] = {}  # bytes sent in the last step, per kind
        self.complete = True  # whether the step's sum holds the anchor's gradient traffic
        self.ddp_counted = False
        self._ddp = 0
        self._seen: dict[str, int] = {}

    def fit_start(self, state: State, logger: Logger) -> None:
        from torch.nn.parallel import DistributedDataParallel

        world = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
        if isinstance(state.model, DistributedDataParallel):
            self.ddp_counted = self.hook_ddp and self._share_hook(state.model)
            self.complete = self.ddp_counted
        else:  # one rank has no anchor traffic; an FSDP anchor's collectives are not seen here
            self.complete = world == 1 or not getattr(state, "fsdp_enabled", False)

    def _share_hook(self, model) -> bool:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        counters = getattr(model, "_memtree_comm_counters", None)
        if counters is None:
            counters = []

            def counting(process_group, bucket):  # unannotated: DDP checks a hook's annotations
                buf = bucket.buffer()
                n = tdist.get_world_size(process_group)
                sent = ring_bytes("all_reduce", buf.numel() * buf.element_size(), n)
                for c in counters:
                    c._ddp += sent
                return allreduce_hook(process_group, bucket)

            try:
                model.register_comm_hook(None, counting)
            except RuntimeError as e:  # a hook of someone else's is in place
                log.warning("comm bytes: the anchor's DDP all-reduce is not counted (%s)", e)
                return False
            model._memtree_comm_counters = counters
        if self not in counters:
            counters.append(self)
        return True

    def batch_end(self, state: State, logger: Logger) -> None:
        opt = state.optimizers[0]
        now = dict(getattr(opt, "comm_bytes", {}))
        step = {k: v - self._seen.get(k, 0) for k, v in now.items()}
        self._seen = now
        if self.ddp_counted:
            step["anchor_ddp_all_reduce"], self._ddp = self._ddp, 0
        self.last = step
        for k, v in step.items():
            self.totals[k] = self.totals.get(k, 0) + v
        if step:
            total = "step_total" if self.complete else "step_total_excl_anchor"
            logger.log_metrics(
                {f"comm/bytes/{k}": v for k, v in step.items()}
                | {f"comm/bytes/{total}": sum(step.values())}
            )
