"""What the optional fork server behind `occult.distributed.run_ranks` (CPU ranks,
`OCCULT_RANK_START=forkserver`) loads once: torch, so each rank forks with it imported instead of
importing it again (~1.5 s less per call on 2 cores), and SIGINT ignored. The fork server saves the handlers it finds
before it installs its own and hands them to every process it forks, so a rank starts ignoring the terminal's Ctrl-C,
which belongs to the caller (`occult._rank_signals` says why)."""

from __future__ import annotations

import signal

import torch  # noqa: F401  (loaded once, in the fork server)

signal.signal(signal.SIGINT, signal.SIG_IGN)
