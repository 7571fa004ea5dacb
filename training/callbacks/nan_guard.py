"""Stop the run on a non-finite loss, naming the step and the batch's cluster paths.

The model's loss already raises on NaN/inf; this also covers losses that reach
Composer another way (e.g. a different model class) before the optimizer steps."""

from __future__ import annotations

import math

from composer.core import Callback, State
from composer.loggers import Logger


class NonFiniteGuard(Callback):
    def after_loss(self, state: State, logger: Logger) -> None:
        loss = state.loss
        value = float(loss.detach()) if hasattr(loss, "detach") else float("nan")
        if not math.isfinite(value):
            paths = state.batch.get("paths") if isinstance(state.batch, dict) else None
            raise FloatingPointError(
                f"non-finite loss {value} at step {int(state.timestamp.batch)}"
                + (f", batch paths {paths[:4].tolist()} …" if paths is not None else "")
            )
