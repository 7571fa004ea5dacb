"""Training loss of sequences that used the generic memory vs their fetched memory.

Both come from the same batches (a sequence uses the generic memory with
probability 1/B), so the gap is the fetched memory's benefit on the training
stream, tracked as exponential moving averages."""

from __future__ import annotations

from composer.core import Callback, State
from composer.loggers import Logger

from memtree.training.composer_model import unwrap


class GenericVsFetchedLoss(Callback):
    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.ema: dict[str, float] = {}

    def _update(self, key: str, value: float) -> None:
        old = self.ema.get(key)
        self.ema[key] = value if old is None else self.decay * old + (1 - self.decay) * value

    def after_loss(self, state: State, logger: Logger) -> None:
        model = unwrap(state.model)
        if (
            getattr(model, "bank", None) is None
            or model.last_seq_loss is None
            or model.last_use_generic is None
        ):
            return
        loss, generic = model.last_seq_loss.cpu(), model.last_use_generic
        if generic.any():
            self._update("memory/loss_generic", float(loss[generic].mean()))
        if (~generic).any():
            self._update("memory/loss_fetched", float(loss[~generic].mean()))

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.ema:
            logger.log_metrics(dict(self.ema))
