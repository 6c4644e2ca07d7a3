"""Usage of `occult` itself: one-line argparse errors, `--version`, the command list of a bare
`occult`, and place / stats flags refused (or warned about) before any work, each naming its flag."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from occult import __version__, cli
from tests.cli._cli_helpers import REPO, TRACE, occult, one_clean_line, one_usage_line, run_main


def test_bare_occult_lists_every_command_and_exits_2():
    proc = occult()
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    for command in cli.COMMANDS:
        assert any(line.split()[:1] == [command.name] and command.help in line for line in proc.stderr.splitlines())
    assert "Traceback" not in proc.stderr and "error: the following arguments" not in proc.stderr


def test_version(capsys):
    code, out, err = run_main(capsys, "--version")
    assert (code, out.strip(), err) == (0, f"occult {__version__}", "")


def test_help_says_what_a_bare_occult_does(capsys):
    _, out, _ = run_main(capsys, "--help")
    assert "'occult' with no command lists the commands" in " ".join(out.split())


@pytest.mark.parametrize(
    "argv, command, needles",
    [
        (["demo", "--tokens", "1e12"], "demo", ["argument --tokens", "got '1e12'", "in digits, e.g. 1000000000000"]),
        (["bench", "--tokens", "64,2.5"], "bench", ["argument --tokens"]),
        (["demo", "--no-such-flag"], "demo", ["unrecognized arguments: --no-such-flag"]),
        (["nope"], "", ["invalid choice: 'nope'"]),
        (["place", "--devices", "4"], "place", ["required: --trace"]),
        (["place", "--trace", "t", "-d", "4", "--max-load", "inf"], "place", ["--max-load", "finite", "'inf'"]),
        (["place", "--trace", "t", "-d", "4", "--max-load", "0.9"], "place", ["--max-load", ">= 1"]),
        (["train", "--out", "x", "--lr", "nan"], "train", ["argument --lr", "nan"]),
        (["data", "prepare", "--vocab-size", "x"], "data prepare", ["argument --vocab-size"]),
    ],
)
def test_argparse_errors_are_one_line(capsys, argv, command, needles):
    code, out, err = run_main(capsys, *argv)
    assert out == ""
    one_usage_line(code, err, command, *needles)


def test_argparse_errors_through_the_entry_point():
    proc = occult("demo", "--tokens", "0", timeout=120)
    one_usage_line(proc.returncode, proc.stderr, "demo", "expected a positive integer, got 0")


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--plot", "heat.txt"], ["--plot heat.txt", "cannot write .txt", ".png"]),
        (["--plot-layers", "0"], ["--plot-layers", "give --plot FILE.png"]),
        (["--dtype", "int3"], ["--dtype int3", "unknown dtype"]),
    ],
)
@pytest.mark.parametrize("command", ["place", "stats"])
def test_report_flags_name_themselves_before_any_work(capsys, tmp_path, command, flags, needles):
    pytest.importorskip("matplotlib")
    code, out, err = run_main(
        capsys,
        command,
        "--trace",
        TRACE,
        "-d",
        4,
        "--out" if command == "place" else "-q",
        *([tmp_path / "p.json"] if command == "place" else []),
        *flags,
    )
    one_clean_line(code, err, *needles)
    assert out == "" and list(tmp_path.iterdir()) == []  # nothing written: refused before the solve


def test_mt_kahypar_flags_warn_when_the_method_does_not_use_them(capsys):
    code, out, err = run_main(capsys, "place", "--trace", str(TRACE), "-d", "4", "-m", "greedy", "--seed", 3, "--json")
    assert code == 0 and out.startswith("{"), err
    assert err.strip() == "occult: warning: --seed: used by --method hypergraph only, ignored by --method greedy"
    code, _, err = run_main(capsys, "place", "--trace", TRACE, "-d", 4, "-m", "hypergraph", "--seed", 3, "--json")
    assert code == 0 and "warning" not in err, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_output_device_names_its_flag(capsys):
    for flag in ("--out", "--plot"):
        if flag == "--plot":
            pytest.importorskip("matplotlib")
        code, _, err = run_main(capsys, "place", "--trace", str(TRACE), "-d", "4", "-m", "greedy", flag, "/dev/full")
        one_clean_line(code, err, f"{flag} /dev/full: cannot be written (No space left on device)")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "occult", "--version"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            timeout=120,
        )
    one_clean_line(proc.returncode, proc.stderr, "stdout: No space left on device")
    with open("/dev/full", "w") as full:  # a table larger than stdout's buffer fails while printing
        proc = subprocess.run(
            [sys.executable, "-m", "occult", "place", "--trace", str(TRACE), "-d", "4", "-m", "greedy", "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            timeout=120,
        )
    one_clean_line(proc.returncode, proc.stderr, "stdout: No space left on device")
