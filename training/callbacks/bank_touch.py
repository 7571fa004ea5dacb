"""Fraction of the memory bank touched (fetched at least once) so far, per level and overall."""

from __future__ import annotations

import torch
from composer.core import Callback, State
from composer.loggers import Logger

from memtree.training.composer_model import unwrap


class BankTouch(Callback):
    def __init__(self) -> None:
        self.seen: dict[int, torch.Tensor] = {}

    def after_forward(self, state: State, logger: Logger) -> None:
        model = unwrap(state.model)
        bank = getattr(model, "bank", None)
        if bank is None or not model.training:
            return
        for lv, rows in model.last_slots.items():
            seen = self.seen.setdefault(lv, torch.zeros(bank.n_blocks[lv] + 1, dtype=torch.bool))
            seen[rows] = True

    def batch_end(self, state: State, logger: Logger) -> None:
        bank = getattr(unwrap(state.model), "bank", None)
        if bank is None or not self.seen:
            return
        metrics, touched, total = {}, 0, 0
        for lv, seen in self.seen.items():
            n = bank.n_blocks[lv]  # the generic row is not part of the bank
            frac = float(seen[:n].float().mean())
            metrics[f"memory/touched_frac/L{lv}"] = frac
            params = bank.tables[str(lv)].shape[1]
            touched += int(seen[:n].sum()) * params
            total += n * params
        metrics["memory/touched_frac"] = touched / total
        logger.log_metrics(metrics)
