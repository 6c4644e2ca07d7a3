"""What the fuzz tests share: the CLI run in-process, and the checks every outcome must pass."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

from occult import cli


@dataclass
class Outcome:
    code: int
    out: str
    err: str


def run_cli(*argv: object) -> Outcome:
    """`occult ARGV` in this process; an exception other than SystemExit escapes (a traceback)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as exc:  # argparse
            code = exc.code
    return Outcome(int(code), out.getvalue(), err.getvalue())


def assert_clean(res: Outcome, flag: str | None = None, path: object = None) -> None:
    """rc 0, or rc 2 and one `occult: error:` line (naming `flag path` when given)."""
    assert "Traceback" not in res.err, res.err
    if res.code == 0:
        return
    assert res.code == 2, (res.code, res.err)
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("occult: error: "), res.err
    if flag is not None:
        assert lines[0].startswith(f"occult: error: {flag} {path}"), res.err


def assert_flag_error(res: Outcome) -> None:
    """A bad flag value: rc 0, or rc 2 and one `occult: error: ...` line (argparse errors are one line too,
    `occult.cli.parser`); `occult: warning:` lines may come first. A usage block or a traceback fails."""
    assert "Traceback" not in res.err and "usage:" not in res.err, res.err
    kept = [line for line in res.err.splitlines() if not line.startswith("occult: warning: ")]
    assert_clean(Outcome(res.code, res.out, "\n".join(kept)) if res.code else res)


def unchanged(path: Path, before: bytes) -> None:
    assert path.read_bytes() == before, f"{path} changed by a failed run"
