"""Where a benchmark ran and from what code: the fields every result file's env block records beside the card.

`run_record(world, on_gpu)` gives {"commit", "dirty", "date", "link", "settings", "nccl"} (settings: the occult
environment variables that differ from their defaults, e.g. {"OCCULT_GEMM1": "triton"}; nccl: every NCCL_*
variable the process ran under, e.g. {"NCCL_P2P_DISABLE": "1", "NCCL_BUFFSIZE": "16777216"}: they move the
exchanges' speed, so a result says which it had);
benchmarks/_timing.py's `environment`, `occult bench` and the other writers under benchmarks/ and scripts/
merge it into their env block, so a result file says itself which code measured it, under which settings
and when (scripts/current_numbers.py prefers these to git's record of when the file was added). Where git
is missing (a GPU machine gets the working tree without `.git`), the commit comes from `OCCULT_COMMIT` or a
`COMMIT` file (docs/settings.md); none of them: null.
"""

from __future__ import annotations

import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from occult.settings import VARIABLES, Settings, current

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMIT_FILE = "COMMIT"
DIRTY_SUFFIX = "-dirty"


def parse_commit(text: str) -> tuple[str | None, bool | None]:
    """`HASH` or `HASH-dirty` -> (HASH, dirty); blank -> (None, None)."""
    words = text.strip().split()
    if not words:
        return None, None
    word = words[0]
    if word.endswith(DIRTY_SUFFIX):
        return word[: -len(DIRTY_SUFFIX)] or None, True
    return word, False


def git_commit(root: Path) -> tuple[str | None, bool | None]:
    """(HEAD, whether tracked files differ from it) of the git checkout at `root`; (None, None) where git
    is missing or `root` is not the top of a checkout (an installed copy inside some other repository)."""

    def git(*args: str) -> str | None:
        try:
            run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return run.stdout if run.returncode == 0 else None

    shown = git("rev-parse", "--show-toplevel", "HEAD")
    lines = shown.splitlines() if shown else []
    if len(lines) != 2 or Path(lines[0]).resolve() != root.resolve():
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return lines[1], None if status is None else bool(status.strip())


def code_commit(root: Path = REPO_ROOT) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the code that runs: OCCULT_COMMIT, else git at `root`, else `root`/COMMIT's first
    line, else (None, None). `dirty` is None where unknown; never raises."""
    if current().commit:
        return parse_commit(current().commit)
    commit, dirty = git_commit(root)
    if commit is not None:
        return commit, dirty
    try:
        return parse_commit((root / COMMIT_FILE).read_text(errors="replace").partition("\n")[0])
    except OSError:
        return None, None


def link_of(world: int, on_gpu: bool) -> str:
    """The link between the ranks: "cpu", "single-gpu", "pcie-or-slow: NCCL_P2P_DISABLE=1" (peer-to-peer off:
    traffic through the host), else "nvlink" (peer-to-peer on; the machines measured here have NVLink;
    the topology is not probed)."""
    if not on_gpu:
        return "cpu"
    if world <= 1:
        return "single-gpu"
    return "pcie-or-slow: NCCL_P2P_DISABLE=1" if current().nccl_p2p_disable else "nvlink"


def changed_settings() -> dict[str, str]:
    """The settings (docs/settings.md) that differ from their defaults, by variable name, as strings: what a
    result ran under besides the code (the commit is recorded on its own)."""
    now, default = current(), Settings()
    return {
        name: str(getattr(now, field))
        for name, field in VARIABLES.items()
        if field != "commit" and getattr(now, field) != getattr(default, field)
    }


def nccl_environment() -> dict[str, str]:
    """Every NCCL_* environment variable of this process, by name (sorted): NCCL's own tuning, which
    `changed_settings` does not cover."""
    return {name: value for name, value in sorted(os.environ.items()) if name.startswith("NCCL_")}


def cuda_environment() -> dict[str, str]:
    """Every CUDA_* environment variable of this process but CUDA_VISIBLE_DEVICES and where the toolkit is installed
    (CUDA_HOME, CUDA_PATH, CUDA_VERSION), by name (sorted): the driver's own tuning (e.g. CUDA_SCALE_LAUNCH_QUEUES,
    CUDA_DEVICE_MAX_CONNECTIONS)."""
    skip = {"CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "CUDA_VERSION"}
    return {name: value for name, value in sorted(os.environ.items()) if name.startswith("CUDA_") and name not in skip}


def run_record(world: int, on_gpu: bool, root: Path = REPO_ROOT) -> dict[str, str | bool | dict[str, str] | None]:
    """{"commit", "dirty", "date" (UTC, ISO-8601, now), "link", "settings", "nccl", "cuda"} for a result file's env
    block."""
    commit, dirty = code_commit(root)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return {
        "commit": commit,
        "dirty": dirty,
        "date": date,
        "link": link_of(world, on_gpu),
        "settings": changed_settings(),
        "nccl": nccl_environment(),
        "cuda": cuda_environment(),
    }
