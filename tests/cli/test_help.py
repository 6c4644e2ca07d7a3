"""Every `--help` (issue 35, rows 5 and 11): each command and subcommand shows the exit statuses,
and every option says what it does and its default."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from occult import cli

REPO = Path(__file__).resolve().parents[2]


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every (sub)command of `parser`, nested ones too (`data prepare`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from command_paths(sub, (*prefix, name))


def options(path: tuple[str, ...]) -> Iterator[argparse.Action]:
    """The options of one (sub)command, its lazy flags included."""
    parser = cli.build_parser(chosen=path[0])
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    yield from (a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction))


ALL = sorted(set(command_paths(cli.build_parser())) | {("data", "prepare")})


@pytest.mark.parametrize("path", ALL, ids=" ".join)
def test_every_help_shows_the_exit_statuses(path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="200")
    proc = subprocess.run(
        [sys.executable, "-m", "occult", *path, "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "exit status: 0 success; 1 the run failed" in out and "2 bad input or usage" in out, out[-400:]


def test_every_option_says_what_it_does_and_its_default():
    missing = []
    for path in ALL:
        for action in options(path):
            flag = f"occult {' '.join(path)} {max(action.option_strings, key=len)}"
            if not action.help:
                missing.append(f"{flag}: no help text")
            elif action.default not in (None, False, argparse.SUPPRESS) and "default" not in action.help:
                missing.append(f"{flag}: its default {action.default!r} is not in its help")
    assert not missing, "\n".join(missing)
