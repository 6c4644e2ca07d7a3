"""`occult demo` and `occult bench`: the tools of `occult.tools`, declared lazily.

Each tool module defines `add_arguments(parser)` and `main(args)`; it is imported only when its
command is on the command line, so `occult --help` and the other commands do not pay for torch.
"""

from __future__ import annotations

from occult.cli.registry import lazy_command

DEMO = lazy_command("demo", "run a small expert-parallel MoE on CPU ranks (gloo) or GPUs", "occult.tools.demo")
BENCH = lazy_command("bench", "time one MoE layer on 1-N GPUs: standard vs dedup vs dedup+placement", "occult.tools.bench")
