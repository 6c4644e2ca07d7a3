"""What the CLI tests share: `python -m occult` as a user runs it, and the one-line error check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "occult" / "data" / "example_trace.safetensors"


def occult(*args, cwd: Path | None = None, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    """`python -m occult ARGS`, as a user runs it (in `cwd`, default the repo; with `env` added)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run(
        [sys.executable, "-m", "occult", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        env=env,
        timeout=timeout,
    )


def one_clean_line(code: int, err: str, *needles: str) -> None:
    """Exit status 2 and exactly one `occult: error:` line naming the user's path (no temporary file,
    no traceback), containing every needle."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("occult: error: "), err
    assert ".tmp" not in err and "Traceback" not in err and "Errno" not in err, err
    for n in needles:
        assert n in err, err


def run_main(capsys, *argv) -> tuple[int, str, str]:
    """`occult.cli.main(ARGV)` in this process: (exit status, stdout, stderr); an argparse error's
    SystemExit becomes its status."""
    from occult import cli

    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def one_usage_line(code: int, err: str, command: str, *needles: str) -> None:
    """Exit status 2 and one line, `occult: error: ... (see 'occult COMMAND --help')`: no usage block."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("occult: error: "), err
    assert lines[0].endswith(f"(see 'occult {command} --help')".replace("occult  ", "occult ")), err
    assert "usage:" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
