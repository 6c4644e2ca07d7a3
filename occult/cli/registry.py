"""What a command of `occult` is: `Command` (name, help, arguments, run), `CommandError`
(bad user input, printed as `occult: error: ...`, exit 2), and `lazy` / `lazy_command`, which
import a command's module only when that command runs. Shared argument types too.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any, Callable

EXIT_USAGE = 2

RunFn = Callable[[argparse.Namespace], "int | None"]


class CommandError(Exception):
    """A problem with the user's input, reported as `occult: error: ...` (exit 2)."""


@dataclass(frozen=True)
class Command:
    """A subcommand: `add_arguments(parser)` defines its flags, `run(args)` runs it (exit status)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: RunFn
    lazy: bool = False  # add_arguments imports a heavy module: call it only when the command is chosen


def _import_optional(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise


def lazy(module: str, attr: str = "main") -> RunFn:
    """A run function that imports `module` when the command runs and calls `module.attr(args)`."""

    def run(args: argparse.Namespace) -> int | None:
        mod = _import_optional(module)
        if mod is None:
            raise CommandError(f"'occult {args.command}' is not available in this installation ({module} is missing)")
        return getattr(mod, attr)(args)

    return run


def lazy_command(
    name: str,
    help: str,
    module: str,
    fallback_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> Command:
    """A command run by `module.main(args)`, with the flags of `module.add_arguments(parser)`
    (or `fallback_arguments` while the module defines none)."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        mod = _import_optional(module)
        adder = getattr(mod, "add_arguments", None) if mod is not None else None
        adder = adder or fallback_arguments
        if adder is not None:
            adder(parser)

    return Command(name, help, add_arguments, lazy(module), lazy=True)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v
