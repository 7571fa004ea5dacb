"""Atomic, crash-safe file writes and small JSON helpers shared by every stage.

Every file memtree produces lands by write-to-temp + fsync + rename, so a
process killed at any instant leaves either the previous version or the new
one on disk, never a torn file. Directories are published the same way
(`atomic_dir`): a stage builds its output under a hidden temp name and renames
it into place only once complete.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

# Errors that mean "the storage could not take the write" (full, over quota, failing, read-only,
# over a file-size limit), as opposed to a bug: they are reported naming the path being written.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS})


class WriteFailed(OSError):
    """A write that the storage refused; the message names the path and what was kept."""


def utc_timestamp() -> str:
    """Now, UTC, ISO 8601 to the millisecond: the time stamp journals and manifests record."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


def write_error(
    path: str | os.PathLike, e: BaseException, kept: str = "", *, outer: bool = False
) -> BaseException:
    """`e` re-worded to name `path`, if it is a storage error (ENOSPC, EIO, …) anywhere in its
    chain; otherwise `e` itself. `kept` says what survives (default: the previous version).
    An error already naming a path is kept, unless `outer` (a directory being published names
    itself rather than one of its temp files)."""
    cause: BaseException | None = e
    while cause is not None and not (isinstance(cause, OSError) and cause.errno in DISK_ERRNOS):
        cause = cause.__cause__ or cause.__context__
    if cause is None or (isinstance(e, WriteFailed) and not outer):
        return e
    kept = kept or "nothing was replaced: the previous version, if any, is intact"
    return WriteFailed(
        cause.errno,
        f"could not write {path}: {os.strerror(cause.errno)}; {kept}. "
        "Free space (or fix the disk) and rerun: finished work is reused",
    )


@contextlib.contextmanager
def naming_path(
    path: str | os.PathLike, kept: str | Callable[[], str] = "", *, outer: bool = False
) -> Iterator[None]:
    """Re-raise storage errors from the block as `WriteFailed` naming `path` (see `write_error`);
    `kept` may be a function, asked only when the error happens."""
    try:
        yield
    except Exception as e:
        err = write_error(path, e, kept() if callable(kept) else kept, outer=outer)
        if err is e:
            raise
        raise err from e


def _fsync_dir(path: Path) -> None:
    # The rename itself must reach the disk, not just the file contents.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path`; on clean exit it is renamed onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        with naming_path(path):
            yield tmp_path
            with open(tmp_path, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp_path, path)
            _fsync_dir(path.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_save_npy(path: str | os.PathLike, arr: Any) -> None:
    """`np.save` atomically. Serialised in memory first: numpy's own file writes report a full
    disk as a short write without its errno, which `WriteFailed` could not recognise."""
    import numpy as np  # here, not at the top: memtree is the light base every stage imports

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    atomic_write_bytes(path, buf.getbuffer())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def dumps_json(obj: Any) -> str:
    """Canonical JSON (sorted keys, fixed indent) so reruns are byte-identical."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, dumps_json(obj))


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def check_format(
    meta: Any,
    fmt: str,
    version: int | tuple[int, ...] | frozenset[int] | set[int] | None,
    where: str | os.PathLike,
    *,
    what: str | None = None,
    error: type[Exception] = ValueError,
) -> None:
    """Raise `error` naming `where` (the file) unless `meta` (its parsed JSON) names format `fmt`
    and an accepted `version` (one int, a tuple / set of them, or None for a reader that takes
    every version). One wording for every on-disk manifest, so that a foreign file and a file of
    another version read the same whichever stage opens them; `what` names the kind of file in
    the first case when `fmt` alone would not say it."""
    got = meta.get("format") if isinstance(meta, Mapping) else type(meta).__name__
    if got != fmt:
        raise error(f"{where}: not a {what or fmt} file (format {got!r}, expected {fmt!r})")
    if version is None:
        return
    accepted = (version,) if isinstance(version, int) else tuple(sorted(version))
    v = meta.get("version")
    if v not in accepted:
        reads = " or ".join(str(a) for a in accepted)
        raise error(
            f"{where}: {fmt} version {v!r} is not supported (this memtree reads version {reads})"
        )


def read_format_json(path: str | os.PathLike, fmt: str, version: int, what: str) -> dict:
    """A JSON file that names its `format` and `version`; anything else is an error naming the
    file, the `what` it should have been, and what it holds."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the {what}: {e}") from e
    check_format(data, fmt, version, path, what=what)
    return data


def iter_jsonl(
    path: str | os.PathLike, error: type[Exception] = ValueError
) -> Iterator[tuple[int, Any]]:
    """(line number, record) for each non-blank line; a line that is not JSON raises `error`
    naming file:line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{lineno}: not valid JSON ({e})") from None


@contextlib.contextmanager
def atomic_dir(
    path: str | os.PathLike,
    *,
    publish_guard: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> Iterator[Path]:
    """Build a directory under a temp name; rename it onto `path` on clean exit.

    An existing `path` is replaced. A crash leaves only a `.name.tmp-*` sibling,
    which the next attempt removes. `publish_guard()` is entered around the renames only
    (e.g. a lock that keeps readers out while the old version is swapped for the new).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        with naming_path(path, outer=True):
            yield tmp
            _fsync_tree(tmp)
            with publish_guard() if publish_guard else contextlib.nullcontext():
                replace_dir(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Move a finished directory onto dst, replacing any previous version.

    A directory cannot be renamed over a non-empty one, so the old version is
    first moved aside; a crash between the two renames leaves `src` complete and
    the old version at `.name.tmp-old`, which `restore_replaced_dir` (called by
    readers) puts back, and the caller's rerun publishes the new one again.
    """
    src, dst = Path(src), Path(dst)
    if dst.exists():
        old = dst.parent / f".{dst.name}.tmp-old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    _fsync_dir(dst.parent)


def restore_replaced_dir(path: str | os.PathLike) -> bool:
    """Undo a `replace_dir` interrupted between its two renames: if `path` is missing
    but the moved-aside previous version is there, put it back. Returns True if it did."""
    path = Path(path)
    old = path.parent / f".{path.name}.tmp-old"
    if not path.exists() and old.is_dir():
        os.replace(old, path)
        _fsync_dir(path.parent)
        return True
    return False


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_checked_tensors(
    folder: str | os.PathLike, name: str, tensors: dict, manifest: dict
) -> Path:
    """folder/name.safetensors, then folder/name.json: `manifest` plus the tensors file's sha256.
    Both written atomically, the manifest last (a manifest names only a finished tensors file)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / f"{name}.safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    atomic_write_json(
        folder / f"{name}.json", {**manifest, "sha256": sha256_file(folder / f"{name}.safetensors")}
    )
    return folder


def read_checked_tensors(
    folder: str | os.PathLike, name: str, *, fmt: str, version: int, missing: str
) -> tuple[dict, dict]:
    """(tensors, manifest) written by `write_checked_tensors`. No manifest: FileNotFoundError
    "{folder}: {missing}"; another format / version or a tensors file failing its sha256: a
    ValueError naming the file."""
    from safetensors.torch import load_file

    folder = Path(folder)
    man_path = folder / f"{name}.json"
    if not man_path.exists():
        raise FileNotFoundError(f"{folder}: {missing}")
    man = read_json(man_path)
    check_format(man, fmt, version, man_path)
    if sha256_file(folder / f"{name}.safetensors") != man["sha256"]:
        raise ValueError(f"{folder}: {name}.safetensors does not match its sha256")
    return load_file(str(folder / f"{name}.safetensors")), man
