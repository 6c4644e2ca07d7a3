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
    err = cwd / f"stderr-{time.monotonic_ns()}.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "occult", *map(str, args)], stdout=subprocess.PIPE, stderr=f,
                                text=True, cwd=cwd, env=env, start_new_session=True)
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
