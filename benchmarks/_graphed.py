"""A whole-model prefill captured in one CUDA graph (e2e.py's `/graph` variants, issue 36).

The expert-parallel layer costs ~2.5 ms of host time a call; with the device transport (or
sync-free dispatch on one rank) nothing in a forward waits for the GPU, so the whole forward can be
recorded once and replayed: the host then costs one launch a step, and the step shows what the GPU
work alone takes. Fresh token ids are copied into the captured input buffer before each replay.
The graph holds the layers' collectives, so it is registered with `occult.teardown` (released
before any process group is destroyed) and released when the variant is done.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from occult.teardown import hold_collectives


class GraphedPrefill:
    """`model(ids)[:, -1]` logits for ids [B, S] of one shape, replayed from a CUDA graph."""

    def __init__(self, model: nn.Module, batch: int, seq: int, device: torch.device, warmup: int = 3) -> None:
        self.ids_BS = torch.zeros(batch, seq, dtype=torch.long, device=device)
        forward = self._forward_fn(model)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():  # allocator and Triton warm-up off the capture stream
            for _ in range(warmup):
                forward()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.logits_BV = forward()
        hold_collectives(self)

    def _forward_fn(self, model: nn.Module) -> Callable[[], torch.Tensor]:
        def forward() -> torch.Tensor:
            return model(input_ids=self.ids_BS, use_cache=False, logits_to_keep=1).logits[:, -1]
        return forward

    def __call__(self, ids_BS: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the last position of `ids_BS` (its shape: the captured one)."""
        if self.graph is None:
            raise RuntimeError("this GraphedPrefill was released")
        self.ids_BS.copy_(ids_BS)
        self.graph.replay()
        return self.logits_BV

    def release(self) -> None:
        """Free the graph (and the collectives it holds) now."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
            self.graph = None
