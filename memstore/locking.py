"""One writer per bank, and readers that never see a half-applied change.

Two advisory `flock(2)` locks live in files *beside* the bank directory, so they survive the
directory itself being replaced (a rewrite, a merge into an existing path):

    .NAME.lock     exclusive, held by the one process writing the bank for the whole operation
                   (write / replace, scatter / edit / delete, block / unblock, merge output,
                   relocate). Its content names the holder: pid, host, user, operation, since.
    .NAME.rwlock   shared by a reader for the span of one fetch / gather; exclusive by the
                   writer only while bytes on disk change (journal apply, manifest / policy
                   rename, directory swap). Its first 8 bytes are a change counter the writer
                   bumps under the exclusive lock: a reader compares it (one `pread`, under the
                   shared lock) with the value it last saw, and reloads manifest, digests and
                   policy when it moved. So a fetch sees the old bank or the new one, never a
                   mix, and a block is honoured by every reader's next fetch.

flock locks belong to an open file description, so they are released when the holding process
dies (a crashed writer never leaves the bank locked) and two `MemoryStore`s in one process
exclude each other like two processes do. The writer lock is re-entrant within a process
(one operation may call another, e.g. `delete` → `commit`). Both are advisory: a program that
edits the bank's files without memstore is not stopped. A bank whose parent directory cannot
be written (a read-only mount) is served without locks; nothing can write it there anyway.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import getpass
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from memtree.io import naming_path
from memtree.memstore.format import BankError, is_url, level_path, read_manifest

_COUNTER = 8  # bytes of the change counter at the start of the rwlock file
_POLL_S = 0.05


class BankBusy(BankError):
    """Another process holds the bank's writer lock."""


def whoami() -> str:
    """The user recorded in lock files and the audit log (MEMTREE_USER overrides)."""
    if os.environ.get("MEMTREE_USER"):
        return os.environ["MEMTREE_USER"]
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry in some containers
        return f"uid-{os.getuid()}"


def lock_paths(root: str | os.PathLike) -> tuple[Path, Path]:
    """(writer lock, reader/writer lock) files of the bank at `root`."""
    root = Path(os.path.abspath(root))
    return root.parent / f".{root.name}.lock", root.parent / f".{root.name}.rwlock"


def _open_lock(path: Path, write: bool) -> int | None:
    try:
        return os.open(path, (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY, 0o644)
    except FileNotFoundError:
        if write:
            raise
        return None
    except PermissionError:
        return None


def holder(root: str | os.PathLike) -> dict | None:
    """Who holds (or last held) the writer lock of the bank at `root`, as it recorded itself."""
    try:
        text = lock_paths(root)[0].read_text()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def _describe(h: dict | None) -> str:
    if not h:
        return "another process (it has not recorded itself yet)"
    return (
        f"pid {h.get('pid')} on {h.get('host')} (user {h.get('user')}, "
        f"{h.get('operation')!r}, since {h.get('since')})"
    )


_held: dict[str, list[int]] = {}  # lock path -> [fd, depth]: re-entrancy within this process
_held_mutex = threading.Lock()


@contextlib.contextmanager
def bank_writer(root: str | os.PathLike, *, operation: str, wait: float = 0.0) -> Iterator[None]:
    """Hold the bank's writer lock for the block. Another holder: wait up to `wait` seconds
    (0 = fail at once), then raise `BankBusy` naming the holder."""
    path = lock_paths(root)[0]
    key = str(path)
    with _held_mutex:
        if key in _held:
            _held[key][1] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _held_mutex:
                _held[key][1] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + max(wait, 0.0)
    while True:
        fd = _open_lock(path, write=True)
        if fd is None:
            raise BankError(
                f"{Path(root)}: cannot create the writer lock {path}; is the directory read-only?"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            if time.monotonic() >= deadline:
                raise BankBusy(
                    f"{Path(root)}: the bank is being written by {_describe(holder(root))}; one "
                    f"writer at a time (lock file {path}). Retry when it "
                    "finishes, or wait for it (--wait SECONDS / lock_wait=)"
                ) from None
            time.sleep(_POLL_S)
            continue
        if _same_file(fd, path):
            break
        os.close(
            fd
        )  # the holder removed the lock file with its bank before releasing: take the new one
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "user": whoami(),
        "operation": operation,
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv[:4]),
    }
    with contextlib.suppress(
        OSError
    ):  # who holds it is for messages only; a full disk must not stop the lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    with _held_mutex:
        _held[key] = [fd, 1]
    try:
        yield
    finally:
        with _held_mutex:
            _held.pop(key, None)
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # nobody holds it now
            if not Path(
                root
            ).exists():  # no bank (removed, or a first write that failed): no lock debris
                for p in lock_paths(root):
                    p.unlink(missing_ok=True)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


class ReadWriteLock:
    """The `.NAME.rwlock` of one bank for one `MemoryStore` (its own file description)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.path = lock_paths(root)[1]
        self.fd = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = _open_lock(self.path, write=True)
        except OSError:
            self.fd = _open_lock(
                self.path, write=False
            )  # read-only parent: unlocked, see the docstring

    def counter(self) -> int:
        if self.fd is None:
            return 0
        b = os.pread(self.fd, _COUNTER, 0)
        return int.from_bytes(b, "little") if len(b) == _COUNTER else 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[int]:
        """Hold the lock shared; yields the change counter."""
        if self.fd is None:
            yield 0
            return
        fcntl.flock(self.fd, fcntl.LOCK_SH)
        try:
            yield self.counter()
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[int]:
        """Hold the lock exclusively while changing the bank; the counter is bumped on exit, so
        every reader reloads before its next fetch. Yields the new counter value."""
        if self.fd is None:
            raise BankError(
                f"{self.path}: cannot create the bank's lock file; is the directory read-only?"
            )
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            if os.fstat(self.fd).st_size < _COUNTER:
                # allocate the counter before the change: bumping it afterwards then cannot fail on
                # a full disk
                with naming_path(self.path, kept="the bank was not changed"):
                    os.pwrite(self.fd, bytes(_COUNTER), 0)
            new = self.counter() + 1
            yield new
        finally:
            try:
                os.pwrite(self.fd, new.to_bytes(_COUNTER, "little"), 0)
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def remove_bank(root: str | os.PathLike) -> None:
    """Delete a bank: its directory, level files relocated outside it, and its lock files."""
    root = Path(root)
    with bank_writer(root, operation="remove"):
        try:
            info = read_manifest(root)
        except (FileNotFoundError, ValueError):
            info = None
        if info is not None:
            for lv in info.levels.values():
                p = level_path(root, lv)
                if not is_url(p) and not Path(p).resolve().is_relative_to(root.resolve()):
                    Path(p).unlink(missing_ok=True)
                    with contextlib.suppress(OSError):
                        Path(
                            p
                        ).parent.rmdir()  # the directory relocate_level made for it, if now empty
        shutil.rmtree(
            root, ignore_errors=True
        )  # the lock files go when the writer lock is released


@contextlib.contextmanager
def exclusive_change(root: str | os.PathLike) -> Iterator[int]:
    """`ReadWriteLock(root).exclusive()` for writers that hold no store (write_bank, merge,
    relocate)."""
    rw = ReadWriteLock(root)
    try:
        with rw.exclusive() as n:
            yield n
    finally:
        rw.close()


__all__ = [
    "BankBusy",
    "ReadWriteLock",
    "bank_writer",
    "exclusive_change",
    "holder",
    "lock_paths",
    "remove_bank",
    "whoami",
]
