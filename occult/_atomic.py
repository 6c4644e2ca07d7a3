"""Atomic file writes: a reader never sees a half-written output file; checkpoint directories
published behind a `latest` pointer (used by `occult.lm.sharded` and `occult.integrations.hf.checkpoint`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator


def _os_error(exc_type: type[OSError], err: int, what: str, path: Path) -> OSError:
    """An OSError whose message and `filename` name the user's target, never a temporary file."""
    return exc_type(err, what, str(path))


def _writable(st: os.stat_result, path: Path) -> bool:
    """Writable for this process, and not read-only by its mode: a file or directory with no write
    bit at all is read-only even for root (an atomic rename must not bypass that)."""
    return os.access(path, os.W_OK) and bool(st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def check_writable(path: str | os.PathLike) -> Path:
    """Raise a clear OSError naming `path` if a file cannot be written there atomically.

    Refused: `path` is a directory, a read-only file, or in a read-only directory (or under a
    path component that is a file). Missing parent directories are fine (they are created).
    Commands call this before their long part; `atomic_path` calls it again.
    """
    path = Path(path)
    if path.is_dir():
        raise _os_error(IsADirectoryError, errno.EISDIR, "is a directory: give a file path (a name inside it)", path)
    if path.exists() or path.is_symlink():
        st = path.stat() if path.exists() else path.lstat()
        if not _writable(st, path):
            raise _os_error(PermissionError, errno.EACCES, "is read-only: make it writable or choose another path", path)
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise _os_error(NotADirectoryError, errno.ENOTDIR, f"cannot be written: {parent} is not a directory", path)
    if not _writable(parent.stat(), parent):
        raise _os_error(PermissionError, errno.EACCES, f"cannot be written: the directory {parent} is read-only", path)
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.

    The target's permissions hold: a read-only file or directory is refused (`check_writable`),
    and a file that is replaced keeps its mode. Errors name `path`, not the temporary file.
    """
    path = check_writable(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _os_error(type(exc), exc.errno or errno.EIO, f"cannot be written ({exc.strerror or exc})", path) from exc
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        try:
            yield tmp_path
        except OSError as exc:
            if exc.filename is not None and Path(exc.filename) == tmp_path:
                raise _os_error(type(exc), exc.errno or errno.EIO, exc.strerror or str(exc), path) from exc
            raise
        if path.exists():  # keep the mode of the file replaced
            mode = stat.S_IMODE(path.stat().st_mode)
        else:  # mkstemp creates 0600 files; give a new one the usual permissions (umask applied)
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        try:
            os.chmod(tmp_path, mode)
            os.replace(tmp_path, path)
        except OSError as exc:
            raise _os_error(type(exc), exc.errno or errno.EIO, f"cannot be written ({exc.strerror or exc})", path) from exc
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file (read in 1 MiB pieces): checkpoints record it per file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def publish_step_dir(tmp: Path, root: Path, step: int, latest: str = "latest") -> Path:
    """Publish a finished checkpoint directory (one process calls it, after every writer is done).

    `tmp` is renamed to `root/step-SSSSSSSS` (with a `.N` suffix if a save at that step exists:
    the earlier one stays valid until the pointer moves), then `root/latest` is rewritten
    atomically to name it, then older step directories are removed. A crash at any point leaves
    `latest` naming a complete checkpoint. Returns the new directory.
    """
    name, i = f"step-{step:08d}", 0
    while (root / name).exists():
        i += 1
        name = f"step-{step:08d}.{i}"
    os.replace(tmp, root / name)
    write_text_atomic(root / latest, name + "\n")
    for other in root.iterdir():
        if other.name.startswith("step-") and other.name != name:
            shutil.rmtree(other, ignore_errors=True)
    return root / name


def latest_step_dir(root: Path, error: type[Exception], latest: str = "latest") -> Path | None:
    """The checkpoint directory `root/latest` names; None when there is no pointer, `error` when
    it names no checkpoint directory of `root`."""
    pointer = root / latest
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not name or "/" in name or not (root / name).is_dir():
        raise error(f"{pointer} names {name!r}, which is not a checkpoint directory in {root}")
    return root / name
