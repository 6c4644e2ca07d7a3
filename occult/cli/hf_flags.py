"""Which flags `occult finetune --hf` refuses, and how a command line's named flags are noted.

`occult finetune` shares its flags between runs of occult checkpoints (`--init`) and of transformers models
(`--hf`). `OCCULT_CHECKPOINT_ONLY` names the flags only the former reads, with what `--hf` does instead; they are
refused with `--hf` when the command line names them (`refuse_occult_checkpoint_flags`), which argparse does not
record by itself: `note_when_given` makes the flags record themselves in `args.given_flags`. `occult profile`
of a transformers model directory (`occult.cli.hf`) notes its own such flags the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from occult.cli.registry import CommandError

_NO_EVAL, _FIXED = "it runs no validation evaluation", "the experts stay where --placement / --ep-placement put them"
# the flags of `occult finetune` that only a run of an occult checkpoint (--init) reads: what --hf does instead
OCCULT_CHECKPOINT_ONLY: dict[str, str] = {
    "--tokenizer": "it tokenizes with the model's own tokenizer",
    "--moe-only": "only the routers and experts train (--train chooses which)",
    "--no-moe-only": "only the routers and experts train (--train chooses which)",
    "--eval-every": _NO_EVAL,
    "--eval-tokens": _NO_EVAL,
    "--patience": _NO_EVAL,
    "--grad-sync": "DDP averages the routers and the experts are all-reduced over the replicas",
    "--fsdp-reshard": "DDP averages the routers (no FSDP2)",
    "--fsdp-units": "DDP averages the routers (no FSDP2)",
    **{f"--replace-{name}": _FIXED for name in ("every", "min-gain", "drift", "check-every", "samples", "method")},
    "--replace-wait": _FIXED,
}
HF_ONLY = ("--save-dtype",)  # and --data, which `occult.cli.lm` refuses with its own message


@functools.cache
def _noting(action_class: type) -> type:
    """A subclass of an argparse action class that also adds its option string to the namespace's `given_flags`."""

    def call(self: Any, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        action_class.__call__(self, parser, namespace, values, option_string)
        namespace.given_flags = frozenset(getattr(namespace, "given_flags", ())) | {option_string}

    return type(f"Noting{action_class.__name__}", (action_class,), {"__call__": call, "notes_given": True})


def note_when_given(p: Any, flags: Iterable[str]) -> None:
    """Make each of `flags` on parser `p` record itself in `args.given_flags` when the command line names it
    (by any spelling argparse accepts: `--flag=V`, an abbreviation): a default and an explicit value look alike."""
    p.set_defaults(given_flags=frozenset())
    actions = getattr(p, "_option_string_actions", {})
    for flag in flags:
        if flag in actions and not getattr(actions[flag], "notes_given", False):
            actions[flag].__class__ = _noting(type(actions[flag]))


def refuse_occult_checkpoint_flags(args: Any) -> None:
    """`occult finetune --hf`: a flag that only a run of an occult checkpoint reads is an error, not ignored."""
    for flag in sorted(getattr(args, "given_flags", ())):
        if flag in OCCULT_CHECKPOINT_ONLY:
            raise CommandError(
                f"{flag} applies to occult checkpoints (--init) only; with --hf {OCCULT_CHECKPOINT_ONLY[flag]}"
            )
