"""The loss curve of a training run (matplotlib, optional): training loss per step, validation loss."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from occult._atomic import atomic_path


def plot_losses(
    path: str | os.PathLike, train_losses: Sequence[float], history: Sequence[Mapping], title: str = ""
) -> Path | None:
    """Write the curve to `path` (PNG or SVG by suffix); None when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train_losses:
        steps = range(1, len(train_losses) + 1)
        ax.plot(steps, train_losses, lw=0.8, alpha=0.5, color="tab:blue", label="train loss (per step)")
        w = max(1, len(train_losses) // 50)
        if w > 1:
            smooth = [
                sum(train_losses[max(0, i - w + 1) : i + 1]) / len(train_losses[max(0, i - w + 1) : i + 1])
                for i in range(len(train_losses))
            ]
            ax.plot(steps, smooth, lw=1.5, color="tab:blue", label=f"train loss (mean of {w})")
    val = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
    if val:
        ax.plot(*zip(*val), "o-", color="tab:orange", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=120)
    return path


__all__ = ["plot_losses"]
