"""Ctrl-C through the real entry point (issue 35): SIGINT to the whole process group of
`python -m occult ...`, as a terminal sends it. One line on stderr, exit status 130, no process
left behind; `occult train` saves the step it reached and says how to resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def start(*args: str, cwd: Path) -> tuple[subprocess.Popen, Path]:
    """`python -m occult ARGS` in a process group of its own (stdout piped, stderr to a file)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OCCULT_RANK_START", None)  # the default (spawned ranks): what a user's Ctrl-C meets
    err = cwd / f"stderr-{time.monotonic_ns()}.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "occult", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=f,
            text=True,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
    return proc, err


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 120) -> list[str]:
    """Read stdout until a line holds `needle`; the lines read."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    pytest.fail(f"no line with {needle!r} within {timeout} s: {''.join(lines)}")


def interrupt(proc: subprocess.Popen, err: Path, timeout: float = 60) -> tuple[int, str, str]:
    """SIGINT to the group; (exit status, rest of stdout, stderr) once it ended, and no process of
    the group is left (the ranks, multiprocessing's resource tracker)."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("processes of the interrupted command were left running")
        time.sleep(0.1)
    return proc.returncode, out, err.read_text()


@pytest.mark.parametrize("delay", [0.0, 1.0, 3.0])
def test_ctrl_c_while_demo_ranks_start_is_one_line(tmp_path, delay):
    """The ranks are spawned right after the `profiled ...` line and take seconds to import torch:
    a Ctrl-C then (or later) prints `occult: interrupted` alone, no rank's traceback."""
    proc, err = start("demo", "--steps", "50", cwd=tmp_path)
    wait_for_line(proc, "profiled")
    time.sleep(delay)
    code, _, stderr = interrupt(proc, err)
    assert code == 130, stderr
    assert stderr == "occult: interrupted\n"


TINY = [
    "--hidden",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--experts",
    "8",
    "--top-k",
    "2",
    "--expert-ffn",
    "16",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--eval-tokens",
    "256",
    "--device",
    "cpu",
    "--no-progress",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """tests/data/shakespeare_tiny prepared (vocabulary 300)."""
    pytest.importorskip("tokenizers")
    from occult.cli import main

    out = tmp_path_factory.mktemp("corpus") / "data"
    assert (
        main(
            [
                "data",
                "prepare",
                "--out",
                str(out),
                "--corpus-dir",
                str(REPO / "tests" / "data" / "shakespeare_tiny"),
                "--vocab-size",
                "300",
            ]
        )
        == 0
    )
    return out


def wait_for_file(proc: subprocess.Popen, path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.stat().st_size):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{path} not written (exit status {proc.poll()})")
        time.sleep(0.05)


def saved_losses(run: Path) -> list[float]:
    """The per-step training losses of the resume state in `run`."""
    import json

    from safetensors import safe_open

    with safe_open(str(run / "checkpoint.safetensors"), "pt") as f:
        return json.loads(f.metadata()["train_losses"])


def test_ctrl_c_in_train_saves_the_step_and_resume_continues(corpus, tmp_path):
    """After a logged step, Ctrl-C saves the step reached (no --save-every point needed) and says in
    one line how to resume; that command continues from the saved step."""
    argv = ["train", "--corpus-dir", str(corpus), "--out", "run", *TINY, "--steps", "100000", "--eval-every", "1"]
    proc, err = start(*argv, cwd=tmp_path)
    wait_for_file(proc, tmp_path / "run" / "metrics.jsonl")  # step 1 done and evaluated
    code, _, stderr = interrupt(proc, err)
    assert code == 130, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("occult: interrupted at step "), stderr
    step = int(lines[0].split()[4])
    assert step >= 1 and f"of 100000, saved in {Path('run') / 'checkpoint.safetensors'}" in lines[0]
    resume = lines[0].split("resume with  ")[1]
    assert resume == " ".join(["occult", *argv, "--resume"])
    losses = saved_losses(tmp_path / "run")
    assert len(losses) == step

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    again = subprocess.run(
        [sys.executable, "-m", "occult", *resume.split()[1:], "--stop-after", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert f"resumed {Path('run') / 'checkpoint.safetensors'} at step {step}" in again.stdout
    assert f"stopped at step {step + 2} of 100000" in again.stdout
    after = saved_losses(tmp_path / "run")
    assert len(after) == step + 2 and after[:step] == losses


def test_ctrl_c_before_a_step_leaves_no_out_directory(corpus, tmp_path, monkeypatch, capsys):
    """A Ctrl-C after --out was created but before a step was done (injected where the loop's parts
    are built, so the moment is certain): nothing saved, the --out this command created is gone
    again, and the command says only `occult: interrupted` (exit status 130)."""
    import occult.lm.train
    from occult.cli import main

    def ctrl_c(run):
        assert run.out.is_dir()  # created by the run
        raise KeyboardInterrupt

    monkeypatch.setattr(occult.lm.train, "_step_parts", ctrl_c)
    out = tmp_path / "run"
    assert main(["train", "--corpus-dir", str(corpus), "--out", str(out), *TINY, "--steps", "5"]) == 130
    assert capsys.readouterr().err == "occult: interrupted\n"
    assert not out.exists()
    out.mkdir()  # an --out the user made is left as it was
    assert main(["train", "--corpus-dir", str(corpus), "--out", str(out), *TINY, "--steps", "5"]) == 130
    assert out.is_dir() and not any(out.iterdir())
