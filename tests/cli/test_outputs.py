"""Outputs a user can get wrong, and bad input to every command (issue 24): a read-only file or
directory, a directory where a file goes, a file where a directory goes, missing / empty /
garbage / truncated inputs, negative sizes. Each is refused with one line naming the user's path
(never a temporary file) and exit status 2; nothing is replaced or left behind.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch
from _cli_helpers import REPO, TRACE, occult, one_clean_line, run_main

from occult import cli
from occult._atomic import atomic_path, check_writable, write_text_atomic

CORPUS = REPO / "tests" / "data" / "shakespeare_tiny"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def read_only(path: Path) -> Path:
    path.chmod(stat.S_IMODE(path.stat().st_mode) & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    return path


# ------------------------------------------------------------------ the atomic writer itself
def test_atomic_write_keeps_mode_and_refuses_read_only(tmp_path):
    private = tmp_path / "private.json"
    private.write_text("old")
    private.chmod(0o600)
    write_text_atomic(private, "new")
    assert private.read_text() == "new" and stat.S_IMODE(private.stat().st_mode) == 0o600
    ro = tmp_path / "ro.json"
    ro.write_text("keep")
    read_only(ro)
    with pytest.raises(PermissionError) as exc:
        write_text_atomic(ro, "new")
    assert exc.value.filename == str(ro) and "read-only" in exc.value.strerror and ro.read_text() == "keep"
    with pytest.raises(IsADirectoryError) as exc:
        write_text_atomic(tmp_path, "x")
    assert exc.value.filename == str(tmp_path)
    rodir = tmp_path / "rodir"
    rodir.mkdir()
    read_only(rodir)
    with pytest.raises(PermissionError) as exc:
        write_text_atomic(rodir / "x.json", "x")
    assert exc.value.filename == str(rodir / "x.json") and str(rodir) in exc.value.strerror
    assert sorted(p.name for p in tmp_path.iterdir()) == ["private.json", "ro.json", "rodir"]  # no temporary left


def test_atomic_errors_name_the_target_not_the_temporary(tmp_path, monkeypatch):
    import tempfile

    target = tmp_path / "out.json"

    def refuse(prefix, suffix, dir):
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir, prefix + "abc" + suffix))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(PermissionError) as exc:
        with atomic_path(target):
            pass
    assert exc.value.filename == str(target) and ".tmp" not in str(exc.value)
    monkeypatch.undo()
    with pytest.raises(OSError) as exc:  # an error writing the temporary file names the target
        with atomic_path(target) as tmp:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
    assert exc.value.filename == str(target) and exc.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
    check_writable(tmp_path / "new" / "deeper" / "x.json")  # missing parents are fine


# ------------------------------------------------------------------ --out through the real entry point
def test_out_read_only_file_is_refused_and_kept(tmp_path, capsys):
    ro = tmp_path / "placement.json"
    ro.write_text("precious\n")
    read_only(ro)
    mode = ro.stat().st_mode
    code, out, err = run(capsys, "place", "--trace", TRACE, "--devices", 4, "--method", "greedy", "--out", ro)
    one_clean_line(code, err, f"--out {ro} is read-only")
    assert ro.read_text() == "precious\n" and ro.stat().st_mode == mode
    assert out == ""  # refused before the work


def test_out_directory_and_read_only_directory(tmp_path, capsys):
    adir = tmp_path / "adir"
    adir.mkdir()
    code, _, err = run(capsys, "place", "--trace", TRACE, "--devices", 4, "--method", "greedy", "--out", adir)
    one_clean_line(code, err, f"--out {adir} is a directory", f"--out {adir / 'placement.json'}")
    rodir = tmp_path / "rodir"
    rodir.mkdir()
    read_only(rodir)
    code, _, err = run(capsys, "place", "--trace", TRACE, "-d", 4, "-m", "greedy", "-o", rodir / "p.json")
    one_clean_line(code, err, f"--out {rodir / 'p.json'} cannot be written", f"the directory {rodir} is read-only")
    code, _, err = run(capsys, "place", "--trace", TRACE, "-d", 4, "-m", "greedy", "--plot", adir)
    one_clean_line(code, err, f"--plot {adir} is a directory")
    afile = tmp_path / "afile"
    afile.write_text("")
    code, _, err = run(capsys, "stats", "--trace", TRACE, "-d", 4, "--plot", afile / "x.png")
    one_clean_line(code, err, f"{afile} is not a directory")
    assert list(rodir.iterdir()) == [] and list(adir.iterdir()) == []


def test_bench_out_is_checked_before_the_ranks_start(tmp_path, capsys):
    code, out, err = run(capsys, "bench", "--world-size", 2, "--out", tmp_path)
    one_clean_line(code, err, f"--out {tmp_path} is a directory", "bench.json")
    assert out == ""


# ------------------------------------------------------------------ inputs: missing, empty, garbage, truncated
@pytest.mark.parametrize("content", [b"", b"garbage\n", None], ids=["empty", "garbage", "truncated"])
def test_bad_trace_and_placement_files(tmp_path, capsys, content):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(TRACE.read_bytes()[:300] if content is None else content)
    code, _, err = run(capsys, "place", "--trace", bad, "-d", 4)
    one_clean_line(code, err, str(bad))
    code, _, err = run(capsys, "stats", "--trace", TRACE, "--placement", bad)
    one_clean_line(code, err, str(bad))


def test_missing_and_directory_inputs(tmp_path, capsys):
    code, _, err = run(capsys, "place", "--trace", tmp_path / "nope.safetensors", "-d", 4)
    one_clean_line(code, err, "does not exist")
    code, _, err = run(capsys, "stats", "--trace", TRACE, "--placement", tmp_path)
    one_clean_line(code, err, f"--placement {tmp_path} is a directory")
    code, _, err = run(capsys, "finetune", "--init", tmp_path / "nope.safetensors", "--out", tmp_path / "ft")
    one_clean_line(code, err, "--init", "does not exist")
    code, _, err = run(capsys, "profile", "--model", tmp_path / "nope.safetensors", "--out", tmp_path / "t.safetensors")
    one_clean_line(code, err, "--model", "does not exist")
    code, _, err = run(capsys, "train", "--out", tmp_path / "run", "--corpus-dir", tmp_path / "nope")
    one_clean_line(code, err, "--corpus-dir", "does not exist")


def test_data_prepare_out_is_a_file_or_read_only(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    code, _, err = run(capsys, "data", "prepare", "--out", afile, "--corpus-dir", CORPUS, "--vocab-size", 300)
    one_clean_line(code, err, f"--out {afile} is a file, not a directory")
    assert afile.read_text() == "mine\n"
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(ro)
    code, _, err = run(capsys, "data", "prepare", "--out", ro, "--corpus-dir", CORPUS, "--vocab-size", 300)
    one_clean_line(code, err, f"--out {ro} cannot be written")
    code, _, err = run(capsys, "train", "--out", afile, "--corpus-dir", CORPUS)
    one_clean_line(code, err, f"--out {afile} is a file")


def test_profile_outputs_read_only(tmp_path, capsys):
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"")
    ro = tmp_path / "t.safetensors"
    ro.write_text("")
    read_only(ro)
    code, _, err = run(capsys, "profile", "--model", model, "--out", ro, "--corpus-dir", CORPUS)
    one_clean_line(code, err, f"--out {ro} is read-only")


# ------------------------------------------------------------------ sizes: argparse errors before any rank starts
@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--tokens", "-5"],
        ["demo", "--tokens", "0"],
        ["demo", "--world-size", "0"],
        ["demo", "--steps", "0"],
        ["demo", "--top-k", "-1"],
        ["demo", "--noise", "-1"],
        ["bench", "--tokens", "-1"],
        ["bench", "--tokens", "64,0"],
        ["bench", "--world-size", "0"],
        ["bench", "--iters", "0"],
        ["bench", "--warmup", "-1"],
        ["bench", "--nodes", "0"],
        ["bench", "--shapes", "nope"],
        ["bench", "--variants", "dedup,x"],
        ["bench", "--routing", "zipf"],
        ["train", "--out", "x", "--steps", "-3"],
        ["train", "--out", "x", "--lr", "0"],
        ["train", "--out", "x", "--batch-size", "0"],
        ["finetune", "--init", "x", "--out", "y", "--max-devices", "0"],
        ["data", "prepare", "--out", "x", "--vocab-size", "-1"],
        ["profile", "--model", "m", "--out", "t", "--tokens", "0"],
        ["place", "--trace", "t", "-d", "4", "--max-load", "-1"],
        ["place", "--trace", "t", "-d", "4", "--seed", "-1"],
        ["stats", "--trace", "t", "-d", "4", "--plot-layers", ","],
        ["stats", "--trace", "t", "-d", "4", "--plot-layers", "-1"],
        ["stats", "--trace", "t", "-d", "4", "--hidden", "0"],
    ],
)
def test_bad_sizes_are_usage_errors(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {argv[-2]}" in err and "Traceback" not in err, err


def test_negative_sizes_through_the_entry_point(capsys):
    """The first through `python -m occult` (a real process: no traceback, no rank output), the others through
    `cli.main` in this process, the function that entry point calls."""
    for i, argv in enumerate((["demo", "--tokens", "-5"], ["demo", "--world-size", "0"], ["bench", "--tokens", "-1"])):
        if i == 0:
            proc = occult(*argv, timeout=120)
            code, err = proc.returncode, proc.stderr
        else:
            code, _, err = run_main(capsys, *argv)
        assert code == 2, err
        assert "expected a positive integer" in err or "positive integers" in err, err
        assert "Traceback" not in err and "rank" not in err.lower().replace("--", ""), err


def test_demo_input_errors_exit_2_not_1(capsys):
    code, _, err = run(capsys, "demo", "--world-size", "3", "--backend", "gloo")
    one_clean_line(code, err, "64 experts cannot be split over 3 ranks")
    code, _, err = run(capsys, "demo", "--experts", "4", "--top-k", "8", "--world-size", "2", "--backend", "gloo")
    one_clean_line(code, err, "--top-k 8")
    code, _, err = run(capsys, "bench", "--world-size", "2", "--nodes", "3", "--backend", "gloo")
    one_clean_line(code, err, "--nodes 3")
    if not torch.cuda.is_available():
        for command in ("demo", "bench"):
            code, _, err = run(capsys, command, "--backend", "nccl")
            one_clean_line(code, err, "--backend nccl needs CUDA GPUs")


def test_help_documents_exit_statuses(capsys):
    for argv in (["--help"], ["demo", "--help"], ["place", "--help"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "exit status: 0 success; 1 the run failed" in out and "2 bad input or usage" in out


# ------------------------------------------------------------------ transformers models: bad calibration data
@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    pytest.importorskip("transformers")
    from occult.integrations import hf

    path = tmp_path_factory.mktemp("hf") / "tiny-olmoe"
    hf.tiny_random_model("olmoe", str(path))
    return path


def test_hf_profile_and_finetune_bad_data(tiny_hf, tmp_path, capsys):
    import numpy as np

    out = tmp_path / "trace.safetensors"
    garbage = tmp_path / "ids.safetensors"
    garbage.write_bytes(b"garbage\n")
    code, _, err = run(capsys, "profile", "--model", tiny_hf, "--out", out, "--data", garbage)
    one_clean_line(code, err, f"--data {garbage} is not readable calibration data")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, _, err = run(capsys, "profile", "--model", tiny_hf, "--out", out, "--data", empty)
    one_clean_line(code, err, f"--data {empty} holds no tokens")
    big = tmp_path / "big.npy"
    np.save(big, np.array([1, 2, 10**6]))
    code, _, err = run(capsys, "profile", "--model", tiny_hf, "--out", out, "--data", big)
    one_clean_line(code, err, "outside the model's vocabulary")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "fine"}\nnot json\n')
    code, _, err = run(capsys, "finetune", "--hf", tiny_hf, "--out", tmp_path / "ft", "--data", bad_jsonl, "--steps", 1)
    one_clean_line(code, err, f"--data {bad_jsonl} line 2")
    assert not out.exists()
    notjson = tmp_path / "notjson"
    notjson.mkdir()
    (notjson / "config.json").write_text("{garbage")
    code, _, err = run(capsys, "profile", "--model", notjson, "--out", out, "--data", "random")
    one_clean_line(code, err, f"--model {notjson}: its config.json is not a transformers config")
