"""Ctrl-C in `occult train` / `occult finetune` (one process): what is left, and how to go on.

`occult.lm.train.train` ends the loop after the step under way and saves it before the
KeyboardInterrupt goes on; here it becomes one line on stderr naming the step saved and the
command that resumes it (exit status 130). With nothing saved, an `--out` this command created is
removed again. Under torchrun (several ranks) the interrupt goes on unchanged: `--resume`
continues from the last periodic checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

EXIT_INTERRUPTED = 130  # as occult.cli.main's


def resume_command(argv: list[str]) -> str:
    """The command line that continues the run `argv` started (`--resume` added)."""
    return shlex.join(["occult", *argv, *([] if "--resume" in argv else ["--resume"])])


def interruptible(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`run(args)`; on a KeyboardInterrupt in one process, the line above (module docstring)."""
    out = Path(args.out)
    created = not out.exists()
    try:
        return run(args)
    except KeyboardInterrupt:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise
    state = _saved_state(out)
    if state is None:
        if created and out.is_dir():
            shutil.rmtree(out, ignore_errors=True)  # everything in it is this command's
        raise KeyboardInterrupt
    path, step = state
    argv = getattr(args, "argv", None)
    how = f": resume with  {resume_command(argv)}" if argv is not None else ": resume with --resume"
    print(f"occult: interrupted at step {step} of {args.steps}, saved in {path}{how}", file=sys.stderr)
    return EXIT_INTERRUPTED


def _saved_state(out: Path) -> tuple[Path, int] | None:
    """(path, step) of the resume state in `out`, or None."""
    if not out.is_dir():
        return None
    from occult.lm.train import latest_state

    state = latest_state(out)
    return None if state is None else (state[1], int(state[2].get("step", 0)))
