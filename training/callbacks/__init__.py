"""Training callbacks, one per file; `default_callbacks()` is what `memtree train` attaches."""

from __future__ import annotations

from memtree.training.callbacks.bank_touch import BankTouch
from memtree.training.callbacks.comm_bytes import CommBytes
from memtree.training.callbacks.generic_loss import GenericVsFetchedLoss
from memtree.training.callbacks.level_updates import LevelUpdates
from memtree.training.callbacks.nan_guard import NonFiniteGuard
from memtree.training.callbacks.throughput import TokenThroughput

__all__ = [
    "BankTouch",
    "CommBytes",
    "GenericVsFetchedLoss",
    "LevelUpdates",
    "NonFiniteGuard",
    "TokenThroughput",
    "default_callbacks",
]


def default_callbacks(*, comm_ddp_hook: bool = True) -> list:
    return [
        BankTouch(),
        LevelUpdates(),
        GenericVsFetchedLoss(),
        TokenThroughput(),
        NonFiniteGuard(),
        CommBytes(hook_ddp=comm_ddp_hook),
    ]
