"""A converted model's whole forward captured once in a CUDA graph (`GraphedForward`).

An expert-parallel layer costs milliseconds of host time a call (plan, pack, all-to-alls, experts,
combine: ~100 launches and their Python); a forward of a 16-layer model is host-bound even when it
does not wait for the GPU. Where no MoE layer waits for the GPU (the device transport,
`ExecConfig(transport="device")`, or the sync-free schedule), the whole forward can be recorded once
and replayed: the host then costs one launch a call, and the call takes what the GPU work takes
(on 2 x H100, a captured OLMoE-shape prefill over the device transport runs at 1.12x the
replicated model's captured one; docs/history.md).

One graph serves one input shape [B, S]; fresh ids are copied into its input buffer before each
replay, and the logits are written into the same output buffer each time (clone what you keep).
Before each replay the model is compared with what was captured (`occult.training.signature.ModelSignature`: an
identity check while nothing changed): a parameter or buffer replaced, a plain setting switched or a device
transport's buffers grown since (by a forward of a larger shape) makes the call capture again first, where a
replay would read freed memory or take the old code path.

`micro_batches=2` (two-batch overlap): the batch's two halves are issued on two streams of the
capture, interleaved at every MoE layer's exchanges (`occult.moe.two_batch`: two threads pass a turn),
so that the replay runs one half's attention and experts while the other half's all-to-all is on the
wire. Sync-free layers only. Each half is a complete forward (the same function, rows split by
sequence). It pays where the all-to-alls are long against the compute (a slow link), not over NVLink
(docs/overlap.md has the measurements). `micro_batches=k` > 2: k micro-batches the same way, the turn
passing round them (more compute under each exchange, GEMMs of 1/k the rows).
Inference only (no autograd). Every rank of the group captures and replays together, like any
forward of a converted model. The graph holds the layers' collectives, so it is registered with
`occult.teardown` (released before any process group is destroyed); `release()` frees it sooner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from occult.moe.capture_stream import autocast_uncached
from occult.moe.layer import OccultMoE
from occult.moe.model_layers import exchanging_with_buffers, uncapturable_layers
from occult.moe.status import ReplayedStatus
from occult.moe.two_batch import MAX_PARTS, run_interleaved
from occult.teardown import hold_collectives
from occult.training.signature import ModelSignature


def host_waiting_layers(model: nn.Module) -> list[str]:
    """Names of the model's MoE layers that wait for the GPU in a forward (the count exchange on a
    group of several ranks, not sync-free): such a forward cannot be captured."""
    return [name for name, m in model.named_modules() if isinstance(m, OccultMoE) and m.waits_for_gpu]


@contextlib.contextmanager
def masks_as_eager() -> Iterator[None]:
    """Inside, transformers builds a causal attention mask under a CUDA graph capture as in an eager call: none at
    all (SDPA's `is_causal`: flash attention) for a forward on ids alone, the only call occult records (no attention
    mask, no position ids, no cache: GraphedForward, the captured training step). Left alone, transformers (5.17
    to 5.24 at least) materialises the mask while a capture runs, where the mask's checks would read values on the
    host, and SDPA then runs without flash attention (a slower backward above all). The warm-up and the capture
    both run inside, so a compiled decoder layer meets the same inputs in both and never recompiles in a capture.
    Two answers change: 'is a CUDA graph capturing?' (no) and 'are the positions several packed sequences?' (no:
    positions made from the sequence length); each only where that transformers release has it."""
    try:
        from transformers import masking_utils
        from transformers.utils import import_utils
    except ImportError:
        yield
        return
    answers = (
        (import_utils, "is_cuda_stream_capturing", lambda: False),
        (masking_utils, "find_packed_sequence_indices", lambda position_ids: None),
    )
    saved = [(module, name, getattr(module, name)) for module, name, _ in answers if hasattr(module, name)]
    for module, name, answer in answers:
        if hasattr(module, name):
            setattr(module, name, answer)
    try:
        yield
    finally:
        for module, name, before in saved:
            setattr(module, name, before)


def check_graphable(model: nn.Module, batch: int, micro_batches: int) -> None:
    """Raise unless `model`'s forward can be captured: no MoE layer waiting for the GPU or exchanging over gloo,
    and `micro_batches` a valid split of `batch` (`check_micro_batches`)."""
    waiting = host_waiting_layers(model)
    if waiting:
        raise ValueError(
            f"{len(waiting)} MoE layer(s) wait for the GPU in a forward (the count exchange), e.g. {waiting[0]}: "
            'convert with execution=ExecConfig(transport="device") or call occult.set_sync_free(model) first'
        )
    on_host = uncapturable_layers(model)
    if on_host:
        raise ValueError(
            f"{len(on_host)} MoE layer(s) exchange over a group whose collectives a CUDA graph cannot record "
            f"(gloo runs them on the host), e.g. {on_host[0]}: use NCCL process groups to capture"
        )
    check_micro_batches(model, batch, micro_batches)


def check_micro_batches(model: nn.Module, batch: int, micro_batches: int) -> None:
    """Raise unless `micro_batches` is 1, or 2 to `MAX_PARTS` dividing the batch with every expert-parallel layer
    sync-free (two exchanges of one group in flight at once would share the device transport's buffers)."""
    if not 1 <= micro_batches <= MAX_PARTS or batch % micro_batches:
        raise ValueError(
            f"micro_batches must be 1 to {MAX_PARTS} and divide the batch ({batch} sequences); got {micro_batches}"
        )
    on_device = exchanging_with_buffers(model)
    if micro_batches > 1 and on_device:
        raise ValueError(
            f"{micro_batches} interleaved micro-batches need sync-free MoE layers; {len(on_device)} are not, e.g. "
            f"{on_device[0]}: call occult.set_sync_free(model) first"
        )


class GraphedForward:
    """`model(input_ids=ids)` logits for ids [B, S] of one shape, replayed from a CUDA graph.

    `last_only`: the last position's logits [B, V] (a prefill; transformers' `logits_to_keep=1`),
    else every position's [B, S, V]. `warmup`: eager forwards at the shape before the capture (on
    a side stream: Triton compiles, buffers grow, the allocator settles). `micro_batches`: 1, or 2 to
    `occult.moe.two_batch.MAX_PARTS` dividing `batch` (module docstring; expert-parallel layers sync-free).
    `captures`: how many times the forward was captured (once more each time a call found the model changed).
    """

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        seq: int,
        last_only: bool = True,
        warmup: int = 3,
        micro_batches: int = 1,
    ) -> None:
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"GraphedForward captures a CUDA graph: the model is on {device.type}")
        if batch < 1 or seq < 1:
            raise ValueError(f"batch and seq must be >= 1, got {batch} and {seq}")
        check_graphable(model, batch, micro_batches)
        self.last_only, self.warmup, self.micro_batches = last_only, warmup, micro_batches
        self.ids_BS = torch.zeros(batch, seq, dtype=torch.long, device=device)
        self._model = model
        self._forward = self._forward_one if micro_batches == 1 else self._interleaved(device, micro_batches)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0  # how many times the forward was captured (again when the model changed)
        self._signature = ModelSignature(model)
        self._captured_for: tuple | None = None
        self._capture()
        if torch.distributed.is_initialized():  # its collectives must go before the process group
            hold_collectives(self)

    def _capture(self) -> None:
        """Warm up (eager forwards on a side stream, in the capture's autocast state: the weight cache off,
        `occult.moe.capture_stream`, so a compiled layer's guards hold in the capture), capture, and note what the
        model was (`occult.training.signature`)."""
        device = self.ids_BS.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad(), autocast_uncached(), masks_as_eager():
            for _ in range(self.warmup):
                self._forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        statuses = ReplayedStatus()  # what the layers report (dropped rows, bad routing), read after replays
        try:
            with (
                torch.no_grad(),
                autocast_uncached(),
                masks_as_eager(),
                torch.compiler.set_stance("fail_on_recompile"),
                torch.cuda.graph(graph),
                statuses.capture(),
            ):
                self.logits = self._forward()
        except Exception as e:
            raise RuntimeError(
                f"capturing the forward failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                "a compiled layer that recompiles inside the capture means its inputs there differ from the "
                "warm-up's (a capture cannot compile: it reads values on the host)"
            ) from e
        self.graph, self.statuses = graph, statuses
        self._captured_for = self._signature()
        self.captures += 1

    def _logits(self, ids_BS: torch.Tensor) -> torch.Tensor:
        out = self._model(input_ids=ids_BS, use_cache=False, logits_to_keep=1 if self.last_only else 0).logits
        return out[:, -1] if self.last_only else out

    def _forward_one(self) -> torch.Tensor:
        return self._logits(self.ids_BS)

    def _interleaved(self, device: torch.device, parts: int) -> Callable[[], torch.Tensor]:
        """The forward as `parts` micro-batches interleaved at the exchanges, each on its own stream forked from
        (and joined back into) the current one."""
        streams = tuple(torch.cuda.Stream(device) for _ in range(parts))

        def forward() -> torch.Tensor:
            main = torch.cuda.current_stream(device)
            for stream in streams:
                stream.wait_stream(main)
            micro = self.ids_BS.chunk(parts)
            logits = run_interleaved(lambda i: self._logits(micro[i]), streams)
            for stream, part in zip(streams, logits):
                main.wait_stream(stream)
                if not torch.cuda.is_current_stream_capturing():  # (a capture keeps its memory)
                    part.record_stream(main)
            return torch.cat(logits)

        return forward

    def __call__(self, ids_BS: torch.Tensor) -> torch.Tensor:
        """The logits of `ids_BS` (the captured shape), in the graph's output buffer. A model changed since the
        capture (a parameter or buffer replaced, a plain setting switched, a device transport's buffers grown:
        the graph would read freed memory or take the old code path) is captured again first."""
        if self.graph is None:
            raise RuntimeError("this GraphedForward was released")
        if tuple(ids_BS.shape) != tuple(self.ids_BS.shape):
            raise ValueError(
                f"ids of shape {tuple(ids_BS.shape)}: this graph was captured for {tuple(self.ids_BS.shape)}"
            )
        if self._signature() != self._captured_for:
            check_graphable(self._model, self.ids_BS.shape[0], self.micro_batches)
            self.release()
            self._capture()
        self.ids_BS.copy_(ids_BS)
        self.graph.replay()
        self.statuses.replayed()
        return self.logits

    def release(self) -> None:
        """Free the graph (and the collectives it holds) now."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
            self.graph = None
