"""Expert similarity for similarity-based collaboration pruning (`occult.moe.pruning`): the cosine
of the experts' router-logit columns on profiling data, and its per-layer table files."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from occult._atomic import atomic_path

SIMILARITY_KEY = "layers.{}.similarity"
SIMILARITY_FORMAT = "occult-similarity-v1"


class PruningError(ValueError):
    """Bad arguments for device-limited routing (method, limit, similarity table, capacity)."""


# ----------------------------------------------------------------- helpers


def expert_similarity(logits_TE: torch.Tensor | np.ndarray) -> torch.Tensor:
    """[E, E] cosine similarity of the router-logit columns (an expert never seen scores 0)."""
    acc = SimilarityAccumulator(int(logits_TE.shape[-1]))
    acc.add(logits_TE)
    return acc.similarity()


class SimilarityAccumulator:
    """Streams router logits batch by batch into a Gram matrix; `similarity()` gives the cosines."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = int(num_experts)
        self.gram_EE = torch.zeros(self.num_experts, self.num_experts, dtype=torch.float64)
        self.tokens = 0

    def add(self, logits_TE: torch.Tensor | np.ndarray) -> None:
        x = torch.as_tensor(logits_TE).detach().reshape(-1, self.num_experts)
        x64 = x.to(torch.float64)
        self.gram_EE += (x64.T @ x64).cpu()
        self.tokens += x.shape[0]

    def similarity(self) -> torch.Tensor:
        if self.tokens == 0:
            raise PruningError("no router logits were added: profile at least one batch")
        norm = self.gram_EE.diagonal().clamp(min=0).sqrt()
        denom = norm[:, None] * norm[None, :]
        sim = torch.where(denom > 0, self.gram_EE / denom.clamp(min=1e-300), torch.zeros_like(denom))
        return sim.clamp(-1, 1).to(torch.float32)


def similarity_path(placement_path: str | os.PathLike) -> Path:
    """Where the similarity table of a placement lives: `X.json` -> `X.similarity.safetensors`."""
    p = Path(placement_path)
    stem = p.name[: -len(p.suffix)] if p.suffix else p.name
    return p.with_name(stem + ".similarity.safetensors")


def save_similarity(
    path: str | os.PathLike,
    similarity_LEE: Sequence[torch.Tensor] | torch.Tensor,
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """Write per-layer [E, E] similarity tables (safetensors, atomically)."""
    import safetensors.torch

    if isinstance(similarity_LEE, torch.Tensor) and similarity_LEE.dim() == 2:
        similarity_LEE = [similarity_LEE]
    tables = [torch.as_tensor(s) for s in similarity_LEE]
    if not tables:
        raise PruningError("no similarity tables to save")
    E = tables[0].shape[0]
    for i, s in enumerate(tables):
        if tuple(s.shape) != (E, E):
            raise PruningError(f"layer {i}: similarity table has shape {list(s.shape)}, expected [{E}, {E}]")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta.update(format=SIMILARITY_FORMAT, num_experts=str(E), num_layers=str(len(tables)))
    tensors = {SIMILARITY_KEY.format(i): s.detach().to(torch.float32).contiguous().cpu() for i, s in enumerate(tables)}
    with atomic_path(path) as tmp:
        safetensors.torch.save_file(tensors, str(tmp), metadata=meta)


def load_similarity(
    path: str | os.PathLike, num_experts: int | None = None, num_layers: int | None = None
) -> list[torch.Tensor]:
    """Read per-layer similarity tables; check E and the layer count when given."""
    from safetensors import safe_open

    p = str(path)
    if not os.path.isfile(p):
        raise PruningError(
            f"similarity table {p} does not exist: record one with `occult profile ... --similarity {p}`"
        )
    try:
        with safe_open(p, framework="pt") as f:
            keys = set(f.keys())
            n = 0
            while SIMILARITY_KEY.format(n) in keys:
                n += 1
            tables = [f.get_tensor(SIMILARITY_KEY.format(i)) for i in range(n)]
    except PruningError:
        raise
    except Exception as exc:
        raise PruningError(f"{p} is not a readable similarity file ({exc}); is it truncated or corrupted?") from None
    if not tables:
        raise PruningError(f"{p}: no tensors named 'layers.0.similarity', ...; not a similarity table")
    E = tables[0].shape[0]
    if num_experts is not None and E != num_experts:
        raise PruningError(f"{p}: tables are for {E} experts, but the model has {num_experts}")
    if num_layers is not None and len(tables) != num_layers:
        raise PruningError(f"{p}: {len(tables)} layer(s), but the model has {num_layers} MoE layers")
    return tables
