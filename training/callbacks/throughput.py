"""Training tokens per second (non-padding input tokens; wall clock between batch start and end)."""

from __future__ import annotations

import time

from composer.core import Callback, State
from composer.loggers import Logger


class TokenThroughput(Callback):
    def __init__(self) -> None:
        self.t0 = 0.0
        self.tokens = 0
        self.elapsed = 0.0

    def batch_start(self, state: State, logger: Logger) -> None:
        self.t0 = time.perf_counter()

    def batch_end(self, state: State, logger: Logger) -> None:
        dt = time.perf_counter() - self.t0
        labels = state.batch["labels"]
        n = int((labels != -100).sum())
        self.tokens += n
        self.elapsed += dt
        logger.log_metrics(
            {
                "throughput/tokens_per_sec": n / dt if dt > 0 else 0.0,
                "throughput/tokens_per_sec_avg": self.tokens / self.elapsed
                if self.elapsed
                else 0.0,
            }
        )
