"""One open store kept consistent with its bank on disk and with the other processes using it.

Built on `memstore.locking`: every write takes the bank's writer lock (a second writer waits
`wait` seconds, then fails naming the holder) and first reloads what another process changed, so
no update is lost. Reads hold the bank's reader lock for one fetch / gather and reload when the
bank's change counter moved: a fetch sees the old bank or the new one, never a mix, and a block
is honoured by every open store's next fetch. The store's own publications (a journal applied,
policy.json replaced) run under the exclusive lock and record the counter they set, so the store
does not reload its own change.

`BankSync` holds the locks, the counter this store last saw and the identity of the files its
levels were opened from (`bank_identity`): a reload with the same identity rereads only the
policy; any other reopens the levels. What a reload does is the store's (`reload` callbacks).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from memtree.memstore.format import BankInfo, read_manifest
from memtree.memstore.locking import ReadWriteLock, bank_writer


def bank_identity(root: Path, info: BankInfo) -> tuple:
    """What a reader's open files and digests depend on: the directory (a rewrite or merge
    replaces it), the generation (in-place edits) and where each level's file lives (relocate)."""
    return (
        os.stat(root).st_ino,
        info.generation,
        tuple(sorted((lv.level, lv.file) for lv in info.levels.values())),
    )


class BankSync:
    """The reader/writer locks of the bank at `root` as one store uses them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mutex = threading.RLock()  # one operation at a time per store: the lock fd is shared
        self.depth = 0
        self.rw = ReadWriteLock(root)
        self.seen: int | None = None  # the change counter as of this store's last (re)load
        self.identity: tuple | None = None

    def open(self, load: Callable[[], None]) -> None:
        """The first load, under the reader lock, noting the counter it saw."""
        with self.rw.shared() as seen:
            load()
            self.seen = seen

    def note(self, info: BankInfo) -> None:
        """The store's levels are now open on `info`'s files."""
        self.identity = bank_identity(self.root, info)

    def files_changed(self) -> bool:
        """Whether the bank's files changed since `note`; if not, only its policy can have."""
        return bank_identity(self.root, read_manifest(self.root)) != self.identity

    @contextlib.contextmanager
    def reading(self, reload: Callable[[], None]) -> Iterator[None]:
        """One consistent read: the reader lock held shared, the bank reloaded first if it
        changed."""
        with self.mutex:
            if self.depth:
                yield
                return
            with self.rw.shared() as counter:
                self.catch_up(counter, reload)
                self.depth = 1
                try:
                    yield
                finally:
                    self.depth = 0

    @contextlib.contextmanager
    def writing(self, operation: str, wait: float, reload: Callable[[], None]) -> Iterator[None]:
        """The bank's writer lock for one operation, with this store brought up to date first."""
        with bank_writer(self.root, operation=operation, wait=wait), self.mutex:
            self.refresh(reload)
            yield

    def refresh(self, reload: Callable[[], None]) -> bool:
        """Reload now if another process changed the bank; True if it had."""
        with self.mutex, self.rw.shared() as counter:
            return self.catch_up(counter, reload)

    def catch_up(self, counter: int, reload: Callable[[], None]) -> bool:
        """Reload if the bank's change counter moved past what this store last saw."""
        if counter == self.seen:
            return False
        reload()
        self.seen = counter
        return True

    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        """This store changes bytes on disk: readers wait, then reload; this store need not."""
        with self.rw.exclusive() as counter:
            yield
            self.seen = counter

    def close(self) -> None:
        self.rw.close()
