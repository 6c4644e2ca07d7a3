"""What a command of `occult` is: `Command` (name, help, arguments, run), `CommandError`
(bad user input, printed as `occult: error: ...`, exit 2), and `lazy` / `lazy_command`, which
import a command's module only when that command runs. Shared argument types (`positive_int`,
`positive_int_list`, ...) and the output check every `--out` gets before the long part
(`check_output`; an empty path is refused naming its flag, `check_not_empty`).

Exit statuses, the same for every command (`EXIT_HELP` says it in `occult --help`):
0 success; 1 the run failed (a check did not pass, e.g. a variant differs from the reference, or
a rank crashed); 2 bad input or usage (argparse errors, missing / corrupt / mismatched input
files, an output that cannot be written); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_HELP = (
    "exit status: 0 success; 1 the run failed (a check did not pass, a rank crashed); 2 bad input or usage "
    "(a bad flag, a missing, corrupt or mismatched file, an output that cannot be written); 130 interrupted. "
    "OCCULT_DEBUG=1 adds the traceback of an error (the exit status stays the same)."
)

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


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        pass
    hint = ""
    try:
        number = float(text)
    except ValueError:
        number = float("nan")
    if number == number and abs(number) < float("inf") and number == int(number):  # 1e12: digits are asked for
        hint = f" (an integer in digits, e.g. {int(number)})"
    raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}{hint}")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (sizes, counts, steps)."""
    v = _int(text, "a positive integer")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0 (0 meaning off or none, as the flag's help says)."""
    v = _int(text, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def positive_int_at_most(limit: int) -> Callable[[str], int]:
    """argparse type: an integer in [1, limit] (a size that is allocated as a whole, e.g. a sequence length)."""

    def parse(text: str) -> int:
        v = positive_int(text)
        if v > limit:
            raise argparse.ArgumentTypeError(f"expected a positive integer up to {limit}, got {v}")
        return v

    return parse


MAX_SEED = 2**31 - 1  # what every consumer takes (Mt-KaHyPar's seed is a C int)


def seed_int(text: str) -> int:
    """argparse type: a random seed, an integer in [0, 2^31 - 1]."""
    v = _int(text, "an integer seed")
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed in [0, {MAX_SEED}], got {v}")
    return v


def positive_int_list(text: str) -> list[int]:
    """argparse type: a comma list of integers >= 1, e.g. `1,2,4`."""
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    values = [_int(t, "a comma list of positive integers") for t in items]
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def _finite_float(text: str, ok, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (ok(v) and abs(v) < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite {what.removeprefix('a ')}, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _finite_float(text, lambda v: v > 0, "a positive number")


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _finite_float(text, lambda v: v >= 0, "a number >= 0")


@contextlib.contextmanager
def writing(flag: str, path: str | os.PathLike | None) -> Iterator[None]:
    """Re-raise an OSError met writing the output of `flag` as a `CommandError` naming the flag and
    the user's path (`--out /dev/full: cannot be written (No space left on device)`)."""
    try:
        yield
    except OSError as exc:
        raise CommandError(f"{flag} {path}: {exc.strerror or exc}") from None


def check_not_empty(flag: str, path: str | None, what: str = "file") -> None:
    """Refuse an empty path (`--out ""`), naming the flag."""
    if path is not None and not str(path):
        raise CommandError(f"{flag} is empty: give a {what} path")


def check_output(flag: str, path: str | None, example: str | None = None) -> None:
    """Refuse an output file that cannot be written (empty, a directory, read-only, in a read-only
    directory) before a command does its work: `CommandError` naming the flag and the user's path.
    `-` (stdout), a device such as /dev/null, or a FIFO is fine: it is written in place."""
    check_not_empty(flag, path)
    if path is None:
        return
    from occult._atomic import check_writable

    try:
        check_writable(path)
    except OSError as exc:
        hint = ""
        if isinstance(exc, IsADirectoryError) and example:
            hint = f", e.g. {flag} {os.path.join(path, example)}"
        raise CommandError(f"{flag} {path} {exc.strerror}{hint}") from None


def check_output_dir(flag: str, path: str | None) -> None:
    """Refuse an output directory that is empty, stdout, an existing file, or cannot be created or written."""
    check_not_empty(flag, path, "directory")
    if path is None:
        return
    from occult._atomic import check_writable, names_stdout

    if names_stdout(path):
        raise CommandError(f"{flag} {path} names stdout, but this command writes a directory: give a directory path")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise CommandError(f"{flag} {path} is a file, not a directory: give a directory path (new or existing)")
    try:
        check_writable(p / ".occult-write-check")
    except OSError as exc:
        raise CommandError(f"{flag} {path} {exc.strerror}") from None


def check_input(flag: str, path: str | None, kind: str = "file") -> None:
    """Refuse an empty or missing input, or one of the wrong kind (`file`, `dir`, or `any`), naming the flag."""
    check_not_empty(flag, path, "directory" if kind == "dir" else "file")
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise CommandError(f"{flag} {path} does not exist")
    if kind == "file" and p.is_dir():
        raise CommandError(f"{flag} {path} is a directory: give the file itself")
    if kind == "dir" and not p.is_dir():
        raise CommandError(f"{flag} {path} is not a directory")
    if not os.access(p, os.R_OK):
        raise CommandError(f"{flag} {path} is not readable (permissions)")
