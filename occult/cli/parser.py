"""The argparse parser of `occult`: one-line usage errors, `--version`, and the command list a bare
`occult` prints.

argparse prints its whole usage block (up to 32 lines) before an error; `OneLineParser` prints
one line instead, `occult: error: <message> (see 'occult <command> --help')`, the same form as
every other error of the command (README's "Exit status"), and exits 2. Subparsers (`occult
data prepare`) inherit it. `occult` with no command lists the commands with their help lines
on stderr and exits 2 (no command is a usage error); `occult --help` shows the same list.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from occult.cli.registry import EXIT_HELP, EXIT_USAGE, Command, CommandError

BARE_HELP = "'occult' with no command lists the commands on stderr (exit status 2: a usage error)."


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, `occult: error: ...`, exit status 2."""

    help_hint: str | None = None  # set on the top-level parser: the chosen command's --help

    def error(self, message: str) -> NoReturn:
        """One line naming the problem (argparse's own message) and where the flags are described."""
        hint = self.help_hint if self.prog == "occult" and self.help_hint else f"{self.prog} --help"
        self.exit(EXIT_USAGE, f"occult: error: {' '.join(message.split())} (see '{hint}')\n")


class VersionAction(argparse.Action):
    """`--version`: `occult X.Y.Z` on stdout, exit 0 (the version looked up only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        try:
            print(f"occult {installed_version()}")
            sys.stdout.flush()
        except BrokenPipeError:
            pass
        except OSError as exc:
            parser.exit(EXIT_USAGE, f"occult: error: {stdout_error(exc)}\n")
        parser.exit(0)


def build_parser(commands: Sequence[Command], chosen: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser; lazy commands get their flags only when `chosen` names them."""
    parser = OneLineParser(
        prog="occult",
        description="Expert-parallel MoE with deduplicated all-to-all and co-activation-aware expert placement.",
        epilog=f"{EXIT_HELP} {BARE_HELP}",
    )
    parser.help_hint = f"occult {chosen} --help" if chosen in {c.name for c in commands} else "occult --help"
    parser.add_argument("--version", action=VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in commands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, epilog=EXIT_HELP)
        if not cmd.lazy or cmd.name == chosen:
            cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def installed_version() -> str:
    """occult's version as installed (the package metadata pip wrote from pyproject.toml, which
    `occult.__version__` matches); "unknown" when it is run from a tree that was never installed."""
    from importlib import metadata

    try:
        return metadata.version("occult")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def print_command_list(commands: Sequence[Command]) -> int:
    """What a bare `occult` prints (on stderr): each command and its help line; returns exit status 2."""
    width = max(len(c.name) for c in commands)
    lines = ["usage: occult COMMAND [FLAGS]   ('occult COMMAND --help': its flags; 'occult --help': more)", "commands:"]
    lines += [f"  {c.name:<{width}}  {c.help}" for c in commands]
    print("\n".join(lines), file=sys.stderr)
    return EXIT_USAGE


def stdout_error(exc: OSError) -> CommandError:
    """The error of a stdout that cannot take what was printed (`> /dev/full`), naming stdout; what is
    left in its buffer is discarded (no second message from the interpreter's flush at exit)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return CommandError(f"stdout: {exc.strerror or exc}")


def flush_stdout() -> None:
    """Flush what the command printed: a stdout that cannot take it is a `CommandError` naming stdout."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise stdout_error(exc) from None
