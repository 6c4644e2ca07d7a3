"""Bad input to `occult data prepare`, `train`, `finetune` and `profile` (issue 51): each refused with
one line naming the flag, exit status 2, before any work; nothing existing damaged, nothing left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli_helpers import REPO, one_clean_line

from occult import cli

pytest.importorskip("tokenizers")

CORPUS = REPO / "tests" / "data" / "shakespeare_tiny"
TINY_MODEL = ["--hidden", "16", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2"]
TINY_RUN = ["--expert-ffn", "16", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0"]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def tree(path: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `path`."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "prep"
    assert cli.main(["data", "prepare", "--out", str(out), "--corpus-dir", str(CORPUS), "--vocab-size", "300"]) == 0
    return out


# ------------------------------------------------------------------ occult data prepare
@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--vocab-size", "10"], "--vocab-size 10"),
        (["--vocab-size", "300", "--val-fraction", "1.5"], "--val-fraction 1.5"),
        (["--val-fraction", "nan"], "--val-fraction nan"),
        (["--corpus-dir", "EMPTY"], "--corpus-dir"),
        (["--corpus", "nope"], "--corpus nope"),
    ],
)
def test_prepare_refuses_a_bad_flag_and_writes_nothing(capsys, tmp_path, flags, flag):
    empty = tmp_path / "empty"
    empty.mkdir()
    flags = [str(empty) if f == "EMPTY" else f for f in flags]
    if "--corpus-dir" not in flags and "--corpus" not in flags:
        flags += ["--corpus-dir", str(CORPUS)]
    code, _, err = run(capsys, "data", "prepare", "--out", tmp_path / "new", *flags)
    one_clean_line(code, err, flag)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no --out, no temporary directory


def test_prepare_never_damages_an_existing_corpus(capsys, tmp_path, prepared, monkeypatch):
    import occult.lm.data as D

    out = tmp_path / "prep"
    out.mkdir()
    for p in prepared.rglob("*"):
        if p.is_file():
            (out / p.relative_to(prepared)).parent.mkdir(parents=True, exist_ok=True)
            (out / p.relative_to(prepared)).write_bytes(p.read_bytes())
    before = tree(out)
    code, _, err = run(capsys, "data", "prepare", "--out", out, "--vocab-size", "300", "--val-fraction", "1.5")
    one_clean_line(code, err, "--val-fraction")
    assert tree(out) == before

    def broken(*a, **k):  # the last step fails: the corpus stays as it was, no temporary is left
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(D, "save_tokens", broken)
    code, _, err = run(capsys, "data", "prepare", "--out", out, "--corpus-dir", CORPUS, "--vocab-size", "280")
    assert code == 2 and "No space left" in err
    assert tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["prep"]
    code, _, err = run(
        capsys, "data", "prepare", "--out", tmp_path / "new", "--corpus-dir", CORPUS, "--vocab-size", "280"
    )
    assert code == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["prep"]  # nothing of a new --out
    monkeypatch.undo()
    code, _, err = run(capsys, "data", "prepare", "--out", out, "--corpus-dir", CORPUS, "--vocab-size", "280")
    assert code == 0, err
    assert json.loads((out / "manifest.json").read_text())["vocab_size"] == 280
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep"]


def test_train_refuses_a_corpus_whose_tokenizer_and_tokens_disagree(capsys, tmp_path, prepared):
    from occult.lm.data import train_tokenizer

    corpus = tmp_path / "prep"
    corpus.mkdir()
    for name in ("tokens.safetensors", "manifest.json"):
        (corpus / name).write_bytes((prepared / name).read_bytes())
    train_tokenizer(["abc abd " * 50], 260).save(str(corpus / "tokenizer.json"))
    code, _, err = run(capsys, "train", "--corpus-dir", corpus, "--out", tmp_path / "run", *TINY_MODEL, *TINY_RUN)
    one_clean_line(code, err, "--corpus-dir", "another tokenizer", "occult data prepare")
    # An old corpus (no tokenizer hash recorded): the ids are checked against the tokenizer's vocabulary.
    from occult.lm.data import load_tokens, save_tokens

    data = load_tokens(prepared / "tokens.safetensors")
    meta = {k: v for k, v in data.metadata.items() if k not in ("tokenizer_sha256", "vocab_size", "format")}
    save_tokens(corpus / "tokens.safetensors", data.train.numpy(), data.val.numpy(), data.vocab_size, meta)
    code, _, err = run(capsys, "train", "--corpus-dir", corpus, "--out", tmp_path / "run", *TINY_MODEL, *TINY_RUN)
    one_clean_line(code, err, "--corpus-dir", "outside the 260 entries", "occult data prepare")
    bad = tmp_path / "corrupt.json"
    bad.write_text("{not json")
    code, _, err = run(
        capsys, "train", "--corpus-dir", prepared, "--tokenizer", bad, "--out", tmp_path / "run", *TINY_MODEL, *TINY_RUN
    )
    one_clean_line(code, err, "--tokenizer", "not a valid tokenizer")
    assert not (tmp_path / "run").exists()
