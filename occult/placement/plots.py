"""Co-activation heat maps ordered by device, before and after a placement (matplotlib, optional).

Each row of the figure is one layer: the left panel orders experts by the baseline placement
(contiguous unless given), the right one by the new placement. A good placement shows bright
blocks on the diagonal (collaboration inside a device) and a dark background. Cells are
co-activation counts divided by the token count (the diagonal, an expert's own load, is left
out so that it does not swamp the scale); lines mark device boundaries.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from occult._atomic import atomic_path
from occult.placement.layout import Placement

DEFAULT_MAX_LAYERS = 8


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plotting needs matplotlib, an optional extra: pip install 'occult[plots]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def coactivation_heatmaps(
    path: str | os.PathLike,
    coacts_LEE: Sequence[np.ndarray],
    placement: Placement,
    baseline: Placement | None = None,
    layers: Sequence[int] | None = None,
    num_tokens: Sequence[int] | None = None,
    labels: tuple[str, str] = ("contiguous", "placed"),
    title: str | None = None,
) -> list[int]:
    """Draw before/after heat maps of the given layers (default: the first 8) to `path`; return them.

    The image format follows the file suffix (png, pdf, svg, ...); the write is atomic.
    """
    plt = _pyplot()
    L = len(coacts_LEE)
    if baseline is None:
        baseline = Placement.contiguous(placement.num_experts, placement.num_devices, placement.num_layers)
    if layers is None:
        layers = list(range(min(L, DEFAULT_MAX_LAYERS)))
    layers = [int(i) for i in layers]
    for i in layers:
        if not 0 <= i < L:
            raise ValueError(f"layer {i} is out of range: there are {L} layer(s)")
    per = placement.experts_per_device
    E = placement.num_experts
    fig, axes = plt.subplots(len(layers), 2, figsize=(9, 4.2 * len(layers)), squeeze=False)
    for row, i in enumerate(layers):
        C = np.asarray(coacts_LEE[i], dtype=np.float64).copy()
        np.fill_diagonal(C, 0.0)
        if num_tokens is not None and num_tokens[i]:
            C /= float(num_tokens[i])
        vmax = max(float(C.max()), 1e-12)
        for col, (p, label) in enumerate(((baseline, labels[0]), (placement, labels[1]))):
            order = p.placed_order(i)
            ax = axes[row, col]
            im = ax.imshow(C[np.ix_(order, order)], cmap="magma", vmin=0.0, vmax=vmax, interpolation="nearest")
            for d in range(1, p.num_devices):
                ax.axhline(d * per - 0.5, color="cyan", lw=0.8)
                ax.axvline(d * per - 0.5, color="cyan", lw=0.8)
            ax.set_title(f"layer {i}: {label}", fontsize=10)
            ticks = np.arange(per / 2 - 0.5, E, per)
            ax.set_xticks(ticks, [f"dev {d}" for d in range(p.num_devices)], fontsize=7)
            ax.set_yticks(ticks, [f"dev {d}" for d in range(p.num_devices)], fontsize=7)
        fig.colorbar(
            im, ax=list(axes[row]), shrink=0.8, label="co-activations per token" if num_tokens else "co-activations"
        )
    if title:
        fig.suptitle(title)
    suffix = os.path.splitext(str(path))[1].lstrip(".").lower() or "png"
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=suffix, dpi=110)
    finally:
        plt.close(fig)
    return layers
