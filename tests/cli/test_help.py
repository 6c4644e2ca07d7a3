"""Every `--help` (issue 35, rows 5 and 11): each command and subcommand shows the exit statuses,
and every option says what it does and its default."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
from _cli_helpers import run_main

from occult import cli


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
def test_every_help_shows_the_exit_statuses(path, capsys, monkeypatch):
    """`occult PATH --help` through `cli.main` in this process (what `python -m occult` calls; that entry point
    runs as a subprocess in test_cli.py's test_python_dash_m): no interpreter start per command."""
    monkeypatch.setenv("COLUMNS", "200")
    code, stdout, stderr = run_main(capsys, *path, "--help")
    assert code == 0, stderr
    out = " ".join(stdout.split())
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
