"""Atomic file writes: a reader never sees a half-written output file; checkpoint directories
published behind a `latest` pointer (used by `occult.lm.sharded` and `occult.integrations.hf.checkpoint`)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp creates 0600 files; give the result the usual permissions (umask applied).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)
        os.replace(tmp_path, path)
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
