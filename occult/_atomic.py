"""Atomic file writes: a reader never sees a half-written output file (stdout, devices and FIFOs,
which cannot be replaced, are written in place); checkpoint directories published behind a
`latest` pointer (used by `occult.lm.sharded` and `occult.integrations.hf.checkpoint`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def _os_error(exc_type: type[OSError], err: int, what: str, path: str | Path) -> OSError:
    """An OSError whose message and `filename` name the user's target, never a temporary file."""
    return exc_type(err, what, str(path))


def _writable(st: os.stat_result, path: Path) -> bool:
    """Writable for this process, and not read-only by its mode: a file or directory with no write
    bit at all is read-only even for root (an atomic rename must not bypass that)."""
    return os.access(path, os.W_OK) and bool(st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


STDOUT = "-"
_FD_NAMES = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
_FD_LINK = re.compile(r"/(?:dev/fd|proc/(self|\d+)/fd)/(\d+)")
_stdout_fd = 1  # where a file written to stdout goes (`reserve_stdout` moves it)


def open_descriptor(path: str | os.PathLike) -> int | None:
    """The open descriptor of this process that `path` names, else None: `-` (stdout),
    /dev/stdout, /dev/stderr, /dev/fd/N, /proc/self/fd/N, or a symlink to one of them."""
    p = os.fspath(path)
    if p == STDOUT:
        return 1
    p = os.path.abspath(p)
    for _ in range(40):  # the kernel's own bound on a symlink chain
        if p in _FD_NAMES:
            return _FD_NAMES[p]
        m = _FD_LINK.fullmatch(p)
        if m and m.group(1) in (None, "self", str(os.getpid())):
            return int(m.group(2))
        if not os.path.islink(p):
            return None
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return None


def names_stdout(path: str | os.PathLike) -> bool:
    """True when writing `path` writes this process's standard output (`-`, /dev/stdout, ...)."""
    return open_descriptor(path) == 1


@contextlib.contextmanager
def reserve_stdout(reserve: bool = True) -> Iterator[None]:
    """Keep standard output for the one file written to it: inside the block, whatever this process
    (and the processes it starts) prints to stdout goes to stderr, and a file written to `-` or
    /dev/stdout goes to the real stdout. `reserve=False` does nothing."""
    global _stdout_fd
    if not reserve:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    previous, _stdout_fd = _stdout_fd, saved
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        _stdout_fd = previous


@dataclass(frozen=True)
class _Target:
    """Where a write to `path` lands: a regular file replaced by a rename (`file`, symlinks
    followed), or written in place: an open descriptor (`fd`) or a device / FIFO (`special`)."""

    path: Path
    file: Path
    fd: int | None = None
    special: bool = False

    @property
    def in_place(self) -> bool:
        return self.fd is not None or self.special


def _target(path: str | os.PathLike) -> _Target:
    if os.fspath(path) == "":
        raise _os_error(FileNotFoundError, errno.ENOENT, "is empty: give a file path", "")
    fd = open_descriptor(path)
    if fd is not None:
        return _Target(Path(path), Path(path), fd=_stdout_fd if fd == 1 else fd)
    real = Path(os.path.realpath(path))
    special = real.exists() and not real.is_dir() and not real.is_file()
    return _Target(Path(path), real, special=special)


def _check_descriptor(fd: int, path: Path) -> None:
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        raise _os_error(OSError, errno.EBADF, "cannot be written: that descriptor is not open", path) from None
    if flags & os.O_ACCMODE == os.O_RDONLY:
        raise _os_error(
            PermissionError, errno.EBADF, "cannot be written: that descriptor is open for reading only", path
        )


def check_writable(path: str | os.PathLike) -> Path:
    """Raise a clear OSError naming `path` if a file cannot be written there.

    Refused: an empty path, a directory, a read-only file, or a file in a read-only directory (or
    under a path component that is a file). Missing parent directories are fine (they are
    created). A symlink is judged by its target; stdout (`-`), a device or a FIFO by itself
    (they are written in place). Commands call this before their long part; `atomic_path` again.
    """
    target = _target(path)
    path = target.path
    if target.fd is not None:
        _check_descriptor(target.fd, path)
        return path
    real = target.file
    if real.is_dir():
        raise _os_error(IsADirectoryError, errno.EISDIR, "is a directory: give a file path (a name inside it)", path)
    if real.exists() and not _writable(real.stat(), real):
        raise _os_error(PermissionError, errno.EACCES, "is read-only: make it writable or choose another path", path)
    if target.special:
        return path
    parent = real.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise _os_error(NotADirectoryError, errno.ENOTDIR, f"cannot be written: {parent} is not a directory", path)
    if not _writable(parent.stat(), parent):
        raise _os_error(PermissionError, errno.EACCES, f"cannot be written: the directory {parent} is read-only", path)
    return path


def _write_in_place(tmp: Path, target: _Target) -> None:
    """Copy the finished temporary file into stdout, a device or a FIFO (opened, never replaced)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        fd = os.dup(target.fd) if target.fd is not None else os.open(target.file, os.O_WRONLY)
        try:
            with open(tmp, "rb") as src:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    except OSError as exc:
        raise _os_error(
            type(exc), exc.errno or errno.EIO, f"cannot be written ({exc.strerror or exc})", target.path
        ) from exc


def _replace(tmp: Path, target: _Target) -> None:
    """Rename the finished temporary file onto the regular file (the replaced file's mode kept)."""
    real = target.file
    if real.exists():  # keep the mode of the file replaced
        mode = stat.S_IMODE(real.stat().st_mode)
    else:  # mkstemp creates 0600 files; give a new one the usual permissions (umask applied)
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    try:
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except OSError as exc:
        raise _os_error(
            type(exc), exc.errno or errno.EIO, f"cannot be written ({exc.strerror or exc})", target.path
        ) from exc


def _temporary(target: _Target) -> Path:
    """A new empty temporary file: beside the file it will replace, or in the system's temporary
    directory for a file written in place."""
    real = target.file
    try:
        if target.in_place:
            fd, tmp = tempfile.mkstemp(prefix=".occult.", suffix=".tmp")
        else:
            real.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
    except OSError as exc:
        raise _os_error(
            type(exc), exc.errno or errno.EIO, f"cannot be written ({exc.strerror or exc})", target.path
        ) from exc
    os.close(fd)
    return Path(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path for the block to write; if the block succeeds, it becomes `path`.

    A regular file is replaced by a rename: a reader never sees half of it, a read-only file or
    directory is refused (`check_writable`), and the replaced file keeps its mode. A symlink is
    followed (its target replaced, the link kept). What is not a regular file is written in
    place once the block succeeds, never replaced: `-` (stdout), /dev/stdout, a device such as
    /dev/null, a FIFO (opening it waits for a reader). Errors name `path`, not the temporary file.
    """
    check_writable(path)
    target = _target(path)
    tmp_path = _temporary(target)
    try:
        try:
            yield tmp_path
        except OSError as exc:
            if exc.filename is not None and Path(exc.filename) == tmp_path:
                raise _os_error(type(exc), exc.errno or errno.EIO, exc.strerror or str(exc), target.path) from exc
            raise
        if target.in_place:
            _write_in_place(tmp_path, target)
        else:
            _replace(tmp_path, target)
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
