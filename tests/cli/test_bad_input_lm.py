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
TINY_MODEL = ["--hidden", "16", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-ffn", "16"]
TINY_RUN = ["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0"]


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


# ------------------------------------------------------------------ occult train / finetune / profile
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, prepared) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "run"
    argv = ["train", "--corpus-dir", str(prepared), "--out", str(out), *TINY_MODEL, *TINY_RUN, "--no-progress"]
    assert cli.main(argv) == 0
    return out / "model.safetensors"


def train_argv(prepared: Path, out: Path, *extra) -> list:
    return ["train", "--corpus-dir", prepared, "--out", out, *TINY_MODEL, *TINY_RUN, *extra]


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--device", "foo"], ["--device foo", "not a device"]),
        (["--device", "cuda:x"], ["--device cuda:x"]),
        (["--device", "mps"], ["--device mps", "cpu or cuda"]),
        (["--batch-size", "100000000"], ["--batch-size 100000000", "GiB", "lower --batch-size"]),
        (["--hidden", "1000000000", "--heads", "1"], ["--hidden 1000000000", "GiB", "make it smaller"]),
        (["--device", "cpu", "--layer-graphs"], ["--layer-graphs", "CUDA device", "--device cpu"]),
        (["--device", "cpu", "--captured-step"], ["--captured-step", "CUDA device", "--device cpu"]),
        (["--fsdp-reshard", "after-forward"], ["--fsdp-reshard after-forward", "--grad-sync fsdp"]),
        (["--grad-sync", "explicit", "--fsdp-reshard", "after-backward"], ["--fsdp-reshard", "--grad-sync fsdp"]),
        (["--fsdp-units", "model"], ["--fsdp-units model", "--grad-sync fsdp"]),
        (
            ["--grad-sync", "fsdp", "--fsdp-units", "model", "--fsdp-reshard", "after-forward"],
            ["--fsdp-reshard after-forward", "--fsdp-units model", "drop one"],
        ),
    ],
)
def test_train_refuses_a_device_or_size_it_cannot_have(capsys, tmp_path, prepared, extra, needles):
    code, _, err = run(capsys, *train_argv(prepared, tmp_path / "run", *extra))
    one_clean_line(code, err, *needles)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a CUDA GPU")
@pytest.mark.parametrize("command", ["train", "finetune", "profile"])
def test_device_cuda_without_a_gpu_is_refused(capsys, tmp_path, prepared, checkpoint, command):
    argv = {
        "train": train_argv(prepared, tmp_path / "run"),
        "finetune": ["finetune", "--init", checkpoint, "--corpus-dir", prepared, "--out", tmp_path / "run"],
        "profile": ["profile", "--model", checkpoint, "--corpus-dir", prepared, "--out", tmp_path / "t.safetensors"],
    }[command]
    code, _, err = run(capsys, *argv, "--device", "cuda")
    one_clean_line(code, err, "--device cuda", "--device cpu")
    assert list(tmp_path.iterdir()) == []


def test_lr_out_of_range_is_refused_by_argparse(capsys, tmp_path, prepared):
    with pytest.raises(SystemExit) as exc:
        cli.main([str(a) for a in train_argv(prepared, tmp_path / "run", "--lr", "1e30")])
    assert exc.value.code == 2 and "--lr" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "failure, needles",
    [
        (FloatingPointError("training loss is nan at step 1"), ["--lr 0.001", "non-finite", "at step", "smaller --lr"]),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"), ["--batch-size 2", "out of memory"]),
    ],
)
def test_a_run_that_fails_names_the_flag_and_leaves_no_empty_out(
    capsys, tmp_path, prepared, monkeypatch, failure, needles
):
    from occult.training.loop import TrainLoop

    def fail(self, last):
        raise failure

    monkeypatch.setattr(TrainLoop, "run", fail)
    code, _, err = run(capsys, *train_argv(prepared, tmp_path / "run", "--lr", "1e-3"))
    one_clean_line(code, err, *needles)
    assert not (tmp_path / "run").exists()  # made by the run, nothing written: removed again
    kept = tmp_path / "kept"
    kept.mkdir()
    code, _, err = run(capsys, *train_argv(prepared, kept))
    assert code == 2 and kept.is_dir()  # an --out that existed before stays


def test_train_draws_no_bar_when_stderr_is_not_a_terminal(capsys, tmp_path, prepared):
    code, out, err = run(capsys, *train_argv(prepared, tmp_path / "run"))
    assert code == 0, err
    assert "step/s" not in err and "it/s" not in err and "model:" in out


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--max-devices", "9", "--placement", "PLACEMENT"], ["--max-devices 9", "4 devices", "1 to 4"]),
        (["--data", "random"], ["--data random", "--hf"]),
        (["--distill-from", "PLACEMENT", "--distill-weight", "1"], ["--distill-from"]),
        (["--device", "foo"], ["--device foo"]),
    ],
)
def test_finetune_refuses_flags_that_cannot_apply(capsys, tmp_path, prepared, checkpoint, extra, needles):
    placement = tmp_path / "p4.json"
    trace = tmp_path / "trace.safetensors"
    prof = ["profile", "--model", checkpoint, "--corpus-dir", prepared, "--out", trace, "--tokens", "256"]
    assert cli.main([str(a) for a in prof]) == 0
    assert cli.main(["place", "--trace", str(trace), "--devices", "4", "--out", str(placement)]) == 0
    capsys.readouterr()
    extra = [str(placement) if e == "PLACEMENT" else e for e in extra]
    argv = ["finetune", "--init", checkpoint, "--corpus-dir", prepared, "--out", tmp_path / "run", *TINY_RUN, *extra]
    code, _, err = run(capsys, *argv)
    one_clean_line(code, err, *needles)
    assert "--out" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("save_dtype", ["source", "bf16"])  # its default too: the flag is named, not its value
def test_finetune_of_a_checkpoint_refuses_save_dtype_of_hf(capsys, tmp_path, prepared, checkpoint, save_dtype):
    argv = ["finetune", "--init", checkpoint, "--corpus-dir", prepared, "--out", tmp_path / "run", *TINY_RUN]
    code, _, err = run(capsys, *argv, "--save-dtype", save_dtype)
    one_clean_line(code, err, "--save-dtype", "--hf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--data", "random"], ["--data random", "transformers models only"]),
        (["--device", "foo"], ["--device foo"]),
    ],
)
def test_profile_of_a_checkpoint_refuses_flags_that_cannot_apply(
    capsys, tmp_path, prepared, checkpoint, extra, needles
):
    argv = ["profile", "--model", checkpoint, "--corpus-dir", prepared, "--out", tmp_path / "t.safetensors", *extra]
    code, _, err = run(capsys, *argv)
    one_clean_line(code, err, *needles)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("flag", ["--out", "--similarity"])
def test_profile_names_an_output_that_cannot_be_written(capsys, tmp_path, prepared, checkpoint, flag):
    outputs = {"--out": tmp_path / "t.safetensors", "--similarity": tmp_path / "s.safetensors", flag: "/dev/full"}
    argv = ["profile", "--model", checkpoint, "--corpus-dir", prepared, "--tokens", "256"]
    code, _, err = run(capsys, *argv, *[x for kv in outputs.items() for x in kv])
    one_clean_line(code, err, f"{flag} /dev/full", "No space left")


# ------------------------------------------------------------ occult finetune --hf / profile of a transformers model
@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from occult.integrations import hf

    path = tmp_path_factory.mktemp("hf") / "olmoe"
    hf.tiny_random_model("olmoe", str(path), seed=1, vocab_size=96)
    return path


def hf_finetune_argv(hf_model: Path, out: Path, *extra) -> list:
    tiny = ["--steps", "1", "--batch-size", "2", "--seq-len", "8"]
    return ["finetune", "--hf", hf_model, "--out", out, "--data", "random", *tiny, *extra]


# each flag that only a run of an occult checkpoint reads, with a value --hf would have ignored (defaults included)
OCCULT_ONLY_FLAGS = [
    ["--tokenizer", "tok.json"],
    ["--moe-only"],
    ["--no-moe-only"],
    ["--eval-every", "200"],
    ["--eval-every=0"],
    ["--eval-tokens", "64"],
    ["--pat", "2"],  # an abbreviation argparse accepts for --patience
    ["--grad-sync", "ddp"],
    ["--fsdp-reshard", "after-forward"],
    ["--fsdp-units", "model"],
    ["--replace-every", "0"],
    ["--replace-min-gain", "0.1"],
    ["--replace-drift", "0.1"],
    ["--replace-check-every", "5"],
    ["--replace-samples", "16"],
    ["--replace-method", "greedy"],
    ["--replace-wait"],
]


@pytest.mark.parametrize("extra", OCCULT_ONLY_FLAGS, ids=lambda e: e[0])
def test_hf_finetune_refuses_the_flags_of_occult_checkpoints(capsys, tmp_path, hf_model, extra):
    flag = {"--pat": "--patience"}.get(extra[0], extra[0].split("=")[0])
    code, _, err = run(capsys, *hf_finetune_argv(hf_model, tmp_path / "run", *extra))
    one_clean_line(code, err, flag, "applies to occult checkpoints (--init) only")
    assert list(tmp_path.iterdir()) == []


def test_every_finetune_flag_is_read_by_hf_or_refused_with_it():
    """A flag of `occult finetune` that occult.cli.hf_finetune never reads must be refused with --hf, and
    a refused one never read there (a flag that becomes used with --hf leaves OCCULT_CHECKPOINT_ONLY)."""
    import re
    from argparse import _SubParsersAction

    from occult.cli import build_parser, hf_finetune, hf_flags

    source = Path(hf_finetune.__file__).read_text()
    (sub,) = [a for a in build_parser(chosen="finetune")._actions if isinstance(a, _SubParsersAction)]
    flags = [a for a in sub.choices["finetune"]._actions if a.option_strings and a.dest not in ("help", "init")]
    assert len(flags) > 40
    for action in flags:
        read = re.search(rf'args\.{action.dest}\b|args, "{action.dest}"', source) is not None
        refused = [f in hf_flags.OCCULT_CHECKPOINT_ONLY for f in action.option_strings]
        assert refused in ([True] * len(refused), [False] * len(refused)), action.option_strings
        assert read != refused[0], (action.option_strings, "read" if read else "neither read nor refused")


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--device", "foo"], ["--device foo"]),
        (["--max-devices", "9", "--placement", "PLACEMENT"], ["--max-devices 9", "2 devices", "1 to 2"]),
        (["--distill-from", "PLACEMENT", "--distill-weight", "1"], ["--distill-from"]),
    ],
)
def test_hf_finetune_refuses_flags_that_cannot_apply(capsys, tmp_path, hf_model, extra, needles):
    import numpy as np

    from occult.placement import Placement

    placement = tmp_path / "p2.json"
    Placement(np.array([[0, 0, 0, 0, 1, 1, 1, 1]] * 2), 2).save(placement)
    extra = [str(placement) if e == "PLACEMENT" else e for e in extra]
    code, _, err = run(capsys, *hf_finetune_argv(hf_model, tmp_path / "run", *extra))
    one_clean_line(code, err, *needles)
    assert not (tmp_path / "run").exists()


def test_hf_finetune_that_fails_names_the_flag_and_leaves_no_empty_out(capsys, tmp_path, hf_model, monkeypatch):
    from occult.training.loop import TrainLoop

    def diverge(self, last):
        raise FloatingPointError("training loss is nan at step 1; lower the learning rate")

    monkeypatch.setattr(TrainLoop, "run", diverge)
    code, _, err = run(capsys, *hf_finetune_argv(hf_model, tmp_path / "run"))
    one_clean_line(code, err, "--lr", "non-finite", "smaller --lr")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--device", "foo"], ["--device foo"]),
        (["--as-routed"], ["--as-routed", "occult checkpoints only"]),
        (["--split", "val"], ["--split", "occult checkpoints only"]),
        (["--corpus-dir", CORPUS], ["--corpus-dir", "occult checkpoints only"]),
    ],
)
def test_profile_of_a_transformers_model_refuses_flags_that_cannot_apply(capsys, tmp_path, hf_model, extra, needles):
    argv = ["profile", "--model", hf_model, "--data", "random", "--out", tmp_path / "t.safetensors"]
    code, _, err = run(capsys, *argv, *extra)
    one_clean_line(code, err, *needles)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--layer-graphs", "--captured-step"])
def test_hf_finetune_refuses_cuda_graphs_off_a_gpu(capsys, tmp_path, hf_model, flag):
    code, _, err = run(capsys, *hf_finetune_argv(hf_model, tmp_path / "run", "--device", "cpu", flag))
    one_clean_line(code, err, flag, "CUDA device")
    assert list(tmp_path.iterdir()) == []
