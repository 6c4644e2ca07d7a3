"""Where a report script's Markdown and plot go (benchmarks/fourgpu_report.py, serve_plot.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from occult._atomic import write_text_atomic  # noqa: E402


def emit(text: str, md_path: str | None, plot: Callable[[str], None] | None, plot_path: str | None) -> None:
    """The tables to `md_path` (atomically) or stdout; then `plot(plot_path)` where a path is given."""
    if md_path:
        write_text_atomic(md_path, text)
    else:
        print(text)
    if plot_path and plot is not None:
        plot(plot_path)
