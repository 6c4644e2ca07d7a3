"""The `occult` command line: a thin front over the library.

    occult place --trace T --devices D [--method contiguous|greedy|hypergraph] [--out P] [--json] [--plot F]
    occult stats --trace T [--placement P | --devices D] [--json] [--plot F]
    occult demo  [--world-size N] [--tokens N] [--steps N] [--backend auto|gloo|nccl] ...
    occult bench [--world-size N] [--shapes olmoe,qwen3,deepseek,mixtral] [--tokens N] [--out F] ...
    occult data prepare --out DIR          occult train --out RUN [--corpus-dir DIR] ...
    occult profile --model CKPT|HF_DIR --out T [--data F]
    occult finetune --init CKPT --out RUN [--max-devices N --placement P]
    occult finetune --hf HF_DIR --out RUN [--data F] [--max-devices N --placement P]   (torchrun: N ranks)
    occult --version                       occult  (no command: the commands and their help lines, exit 2)

One file per command group: `place` (place, stats; `place_report` their tables), `tools` (demo,
bench), `data` (data prepare), `lm` (train, finetune, profile of occult checkpoints), `hf` (profile
and finetune of transformers models); `registry` says what a command is, `parser` builds the
argparse parser (one-line usage errors). Adding a command is one entry in `COMMANDS`: a `Command`
with a name, a help line, a function that adds its arguments to an argparse parser, and a function
that runs it with the parsed Namespace (`lazy("occult.module")` imports a module's `main(args)` only
when the command runs). `lazy_command(name, help, "occult.module")` does both for a module that has
`add_arguments(parser)` and `main(args)`; the module is imported only when that command is on the
command line, so `occult --help` and the other commands do not pay for it. Nothing in the library
imports from here.

Exit statuses, one convention for every command (`EXIT_HELP`, shown by every `--help`): 0 success; 1
the run failed (a check did not pass, e.g. a variant differs from the reference, or a rank crashed);
2 bad input or usage: argparse errors (a negative size, an unknown choice; one line, `occult: error:
<message> (see 'occult CMD --help')`, no usage block), no command at all, and `occult: error:
<message>` on stderr for missing or corrupt files, mismatched shapes, impossible device counts,
outputs that cannot be written (a directory, a read-only file or directory: the message names the
user's path, never a temporary file); 130 interrupted. Set OCCULT_DEBUG=1 to get the traceback too
(the exit status stays the same). Progress bars go to stderr, and only when it is a terminal.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from occult import settings
from occult.cli import data, hf, lm
from occult.cli.parser import build_parser as parser_of
from occult.cli.parser import flush_stdout, print_command_list, stdout_error
from occult.cli.place import PLACE, STATS
from occult.cli.registry import EXIT_FAILED, EXIT_HELP, EXIT_USAGE, Command, CommandError, RunFn, lazy, lazy_command
from occult.cli.tools import BENCH, DEMO


def _add_profile_args(p: argparse.ArgumentParser) -> None:
    """occult's own checkpoints (occult.cli.lm) and transformers model directories (--data)."""
    lm.add_profile_arguments(p)
    hf.add_profile_arguments(p)  # adds only the flags not defined above


def run_profile(args: argparse.Namespace) -> int | None:
    """occult profile: a transformers model directory (a config.json) or an occult checkpoint."""
    from occult._atomic import names_stdout

    if names_stdout(args.out) and not args.similarity:
        raise CommandError(
            f"--out {args.out} writes the trace to stdout; the similarity table goes beside --out "
            "by default: give --similarity PATH too"
        )
    if hf.is_transformers_model(args.model):
        return hf.run_profile(args)
    if os.path.isfile(os.path.join(args.model, "config.json")):
        raise CommandError(
            f"--model {args.model}: its config.json is not a transformers config (not JSON, or no "
            "model_type); give a transformers model directory or an occult checkpoint file"
        )
    return lm.run_profile(args)


PROFILE = Command(
    "profile",
    "record a routing trace (and expert similarity) of a checkpoint or a transformers model",
    _add_profile_args,
    run_profile,
)


def _add_finetune_args(p: argparse.ArgumentParser) -> None:
    lm.add_finetune_arguments(p)
    hf.add_finetune_arguments(p)  # --hf DIR (then --init is not needed)


def run_finetune(args: argparse.Namespace) -> int | None:
    """occult finetune: a transformers model directory (--hf) or an occult checkpoint (--init)."""
    if getattr(args, "hf", None):
        if args.init:
            raise CommandError("give --init (an occult checkpoint) or --hf (a transformers model directory), not both")
        return hf.run_finetune(args)
    if not args.init:
        raise CommandError(
            "occult finetune needs --init CKPT (an occult checkpoint) or --hf DIR (a transformers model)"
        )
    return lm.run_finetune(args)


FINETUNE = Command(
    "finetune",
    lm.FINETUNE.help + "; or a transformers model's routers and experts (--hf)",
    _add_finetune_args,
    run_finetune,
)

COMMANDS: list[Command] = [PLACE, STATS, DEMO, BENCH, data.DATA, lm.TRAIN, FINETUNE, PROFILE]

__all__ = [
    "COMMANDS",
    "EXIT_FAILED",
    "EXIT_HELP",
    "EXIT_USAGE",
    "Command",
    "CommandError",
    "RunFn",
    "build_parser",
    "lazy",
    "lazy_command",
    "main",
]


def build_parser(commands: Sequence[Command] | None = None, chosen: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser (`occult.cli.parser`); lazy commands get their flags only when `chosen` names them."""
    return parser_of(COMMANDS if commands is None else commands, chosen)


def _chosen_command(argv: Sequence[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def _error(message: str) -> int:
    print(f"occult: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _describe(exc: BaseException) -> str:
    """One line for the user: an OSError as `PATH: reason` (no errno, no repr quotes)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        two = f" -> {exc.filename2}" if exc.filename2 is not None else ""
        return f"{exc.filename}{two}: {exc.strerror}"
    if isinstance(exc, OSError) and exc.strerror:  # no path to name: stdout, if it fails the same way now
        if _stdout_fails_with(exc.errno):
            return str(stdout_error(exc))
        return exc.strerror  # the reason, without `[Errno N]`
    return str(exc) or type(exc).__name__


def _stdout_fails_with(errno: int | None) -> bool:
    """Whether an empty write to stdout fails with `errno` (e.g. ENOSPC into /dev/full)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # no file descriptor (e.g. captured)
        return False
    try:
        os.write(fd, b"")
    except OSError as exc:
        return errno is not None and exc.errno == errno
    return False


def _long_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{dest: its long flag} over the parser and its subcommands (`train_part` -> `--train`)."""
    flags: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags.update(_long_flags(sub))
        elif action.option_strings:
            flags[action.dest] = max(action.option_strings, key=len)
    return flags


def _check_values(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    """Refuse an empty value (`--out ""`) naming its flag; return the flags whose value names
    stdout (`-`, /dev/stdout), at most one: the file the command writes there."""
    from occult._atomic import names_stdout

    given = {flags[k]: v for k, v in vars(args).items() if k in flags and isinstance(v, str)}
    for flag, value in given.items():
        if not value:
            raise CommandError(f"{flag} is empty: give a value")
    to_stdout = [flag for flag, value in given.items() if names_stdout(value)]
    if len(to_stdout) > 1:
        raise CommandError(f"{' and '.join(to_stdout)} name stdout: only one output can go there")
    return to_stdout


def _run_command(args: argparse.Namespace, flags: dict[str, str]) -> int:
    """Run the chosen command, warnings as `occult: warning:` lines; with a file written to stdout,
    everything the command prints goes to stderr."""
    from occult._atomic import reserve_stdout

    def show_warning(
        message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        print(f"occult: warning: {message}", file=sys.stderr)

    to_stdout = _check_values(args, flags)
    with warnings.catch_warnings(), reserve_stdout(bool(to_stdout)):
        warnings.showwarning = show_warning
        code = int(args._run(args) or 0)
        flush_stdout()
        return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `occult` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return print_command_list(COMMANDS)
    parser = build_parser(chosen=_chosen_command(argv))
    args = parser.parse_args(argv)  # usage errors: one line, `occult: error: ...`, exit 2 (occult.cli.parser)
    args.argv = argv  # the command line as given (`occult train` names it to resume an interrupted run)
    try:
        debug = settings.current().debug  # OCCULT_DEBUG (docs/settings.md)
    except settings.SettingsError as exc:
        return _error(str(exc))
    try:
        return _run_command(args, _long_flags(parser))
    except KeyboardInterrupt:
        print("occult: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `occult place ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (CommandError, ValueError, OSError, ImportError) as exc:
        if debug:  # the traceback too; the exit status stays the same
            traceback.print_exc()
        return _error(_describe(exc))
