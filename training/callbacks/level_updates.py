"""Memory updates per level: distinct blocks fetched (so updated) in the step, and in total.

Deeper levels are updated B^l times less often than the anchor (seed 002 §3);
this shows it on the run at hand."""

from __future__ import annotations

import torch
from composer.core import Callback, State
from composer.loggers import Logger

from memtree.training.composer_model import unwrap


class LevelUpdates(Callback):
    def __init__(self) -> None:
        self.step_rows: dict[int, set[int]] = {}
        self.total: dict[int, int] = {}

    def batch_start(self, state: State, logger: Logger) -> None:
        self.step_rows = {}

    def after_forward(self, state: State, logger: Logger) -> None:
        model = unwrap(state.model)
        if getattr(model, "bank", None) is None or not model.training:
            return
        generic = (
            model.last_use_generic
            if model.last_use_generic is not None
            else torch.zeros(0, dtype=torch.bool)
        )
        for lv, rows in model.last_slots.items():
            fetched = rows[~generic] if len(generic) == len(rows) else rows
            self.step_rows.setdefault(lv, set()).update(int(r) for r in fetched)

    def batch_end(self, state: State, logger: Logger) -> None:
        if not self.step_rows:
            return
        metrics = {}
        for lv, rows in self.step_rows.items():
            self.total[lv] = self.total.get(lv, 0) + len(rows)
            metrics[f"memory/updates/L{lv}"] = len(rows)
            metrics[f"memory/updates_total/L{lv}"] = self.total[lv]
        logger.log_metrics(metrics)
