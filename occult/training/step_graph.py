"""A whole training step recorded once as one CUDA graph and replayed (`LoopSettings.captured_step`;
`occult train / finetune [--hf] --captured-step`).

An eager step costs the host every launch of its forward, backward, gradient sync, clipping and
optimizer (thousands at OLMoE's shape; 0.6-3 ms of host time per MoE layer call, docs/training.md).
Where the GPU waits for them (expert parallelism, small layers, a busy host) that is the step's
time; layer graphs (`--layer-graphs`) cut it per MoE call, not for the rest. A training step's shapes
are fixed, so the whole step is recorded once and replayed: the host then copies the batch in, fills
the learning rate and launches one graph.

How a run goes (`StepGraph.run`):

- the process's first `WARMUP_STEPS` steps run eagerly, as real steps, on occult's capture stream
  (Triton compiles, AdamW makes its state, the device transport's buffers grow);
- the next step is recorded (nothing runs while recording) and replayed; every later one replays
  after its batch is copied into the recorded input tensors;
- at the recording the optimizer becomes capturable (`make_capturable`: its step counts on the GPU,
  its learning rate a GPU tensor the loop fills each step, `set_lr`); the gradients then live in
  the graph's memory, written (not accumulated) by every replay;
- the losses and the gradient norm come out as copies; the routing statuses the recording made
  (NaN gates, ids out of range), combined into one inside the graph, are queued after each replay and
  read a step late without waiting,
  so bad routing raises `RoutingError` as from eager layers, every pending one at the end;
- a step whose model no longer matches the recording (`occult.training.signature`: a parameter or buffer
  replaced, a plain setting switched, a device transport's buffers grown) is recorded again.

On several ranks every rank records at the same step: the warm-up count is the same everywhere, and what changes
the signature (buffer growth, train/eval) happens on every rank at once. A change on one rank only would make it
record alone, its layers waiting in their host agreement for peers that replay instead, until that agreement's
timeout ends the run with an error (not a hang).

What a graph cannot hold is refused before any step (`check_capturable`). The adapters refuse the
rest (DDP's reducer, re-placement: `occult.lm.train`, `occult.integrations.hf.finetune`).

FSDP2 (`occult.lm.fsdp`) is recorded with the step: its hooks gather each unit's weights on its own streams
and free them after, all of it GPU work the graph holds (`fsdp_state_hook`), and its post-backward
reduce-scatters are waited for by the step's stream before the optimizer. Every block keeps its weights
gathered from its forward to its backward (`wrap_fsdp`): TorchTitan's CUDA-graph trainer reports that
resharding every unit after its forward makes a capture depend on work outside it
(CUDA_ERROR_STREAM_CAPTURE_ISOLATION), which is why it keeps the last block's (docs/training.md, FSDP2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn

from occult import settings
from occult.moe import status as pending
from occult.moe.capture_stream import capture_stream
from occult.moe.graphs import has_hooks
from occult.moe.layer import OccultMoE
from occult.teardown import hold_collectives
from occult.training.optim import fusable
from occult.training.signature import transport_generation

WARMUP_STEPS = 3  # eager steps of a process before its step is recorded


def check_capturable(model: nn.Module) -> None:
    """A `ValueError` naming why `model`'s training step cannot be recorded in a CUDA graph, else nothing."""
    flag = "captured_step (--captured-step)"
    params = list(model.parameters())
    if not params or any(p.device.type != "cuda" for p in params):
        raise ValueError(f"{flag} records a CUDA graph: it needs a CUDA device, every parameter on a GPU")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, OccultMoE)]
    for name, layer in layers:
        if layer.waits_for_gpu:
            raise ValueError(
                f"{flag}: MoE layer {name} reads its row counts on the host (--transport counts), which a CUDA "
                "graph cannot record; use --transport device (NCCL ranks of one host)"
            )
        if not layer.dispatcher.capturable:
            raise ValueError(
                f"{flag}: MoE layer {name} exchanges over gloo, whose collectives a CUDA graph cannot hold"
            )
        if layer.execution.graphs:
            raise ValueError(
                f"{flag} records every MoE layer inside the step: drop --layer-graphs (layer {name} replays its own)"
            )
    if settings.current().agreement == "step" and any(transport_generation(m) is not None for _, m in layers):
        raise ValueError(f"{flag} with OCCULT_AGREEMENT=step: the step's agreement runs on the host; unset it")
    if has_hooks(model, recorded=fsdp_state_hook):
        raise ValueError(f"{flag}: the model has forward hooks, which a replayed step would not call; remove them")


def fsdp_state_hook(module: nn.Module, hook: Callable) -> bool:
    """Whether `hook` is FSDP2's own on `module` (its state's pre- and post-forward): what it does, gather a
    unit's sharded weights before its forward and free them after, is GPU work on FSDP2's streams that a
    recording of the whole step holds, and the host state it keeps is the same after every step (every unit
    resharded once the backward ends), so a replayed step does without it."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return isinstance(module, FSDPModule) and getattr(hook, "__self__", None) is fully_shard.state(module)


def make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Switch `optimizer` to its capturable mode: step counts on the parameters' device, the learning rate
    a tensor there (filled by `set_lr`). The update is the same; the state it loaded is kept. A group whose
    parameters all sit on a GPU also takes the fused kernel where the optimizer has one (`occult.training.optim`;
    AdamW's capturable for-each path spends dozens of elementwise kernels a step on the step count and rate)."""
    if "capturable" not in optimizer.defaults:
        raise ValueError(
            f"{type(optimizer).__name__} has no capturable mode, so a CUDA graph cannot record its step: use AdamW"
        )
    for group in optimizer.param_groups:
        device = group["params"][0].device
        group["capturable"] = True
        if "fused" in optimizer.defaults and fusable(group["params"]):
            group["fused"], group["foreach"] = True, False
        if not torch.is_tensor(group["lr"]):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
    for p, state in optimizer.state.items():
        step = state.get("step")
        if torch.is_tensor(step) and step.device != p.device:
            state["step"] = step.to(device=p.device, dtype=torch.float32)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group's learning rate: filled in place where it is a tensor (a recorded step reads it)."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


class Recorder(Protocol):
    """How a step is recorded and replayed (`CudaRecorder`; tests replay by calling the step again)."""

    def eager(self, body: Callable[[Any], Any], batch: Any) -> Any: ...

    def prepare(self, optimizer: torch.optim.Optimizer) -> None: ...

    def record(self, body: Callable[[Any], Any], inputs: Any) -> None: ...

    def replay(self) -> Any: ...

    def statuses(self) -> list[torch.Tensor]: ...

    def release(self) -> None: ...


@contextlib.contextmanager
def autocast_cache_off() -> Iterator[None]:
    """Autocast's weight cache off inside (its on/off state and dtype as they are): a recording must make every
    cast itself, not read one made before it (`occult.moe.capture_stream`). The eager warm-up steps run inside it
    too: torch.compile guards on the flag, so a compiled layer warmed up with it on would compile again inside
    the recording (a compilation reads values to the host, which a capture refuses)."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


class CudaRecorder:
    """One CUDA graph on occult's capture stream (its BLAS workspaces outside every graph's memory:
    `occult.moe.capture_stream`), the warm-up steps on the same stream, both with autocast's weight cache off."""

    def __init__(self, device: torch.device) -> None:
        self.stream = capture_stream(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None
        self.kept: list[torch.Tensor] = []

    def eager(self, body: Callable[[Any], Any], batch: Any) -> Any:
        """`body(batch)` on the capture stream, ordered after and before the current stream's work."""
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream), autocast_cache_off():
            out = body(batch)
        current.wait_stream(self.stream)
        return out

    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        make_capturable(optimizer)

    def record(self, body: Callable[[Any], Any], inputs: Any) -> None:
        self.release()
        torch.cuda.synchronize(self.stream.device)
        torch.cuda.empty_cache()  # the eager steps' cached activations, for the graph's own pool
        graph = torch.cuda.CUDAGraph()
        try:
            with (
                pending.recording() as kept,
                autocast_cache_off(),
                torch.compiler.set_stance("fail_on_recompile"),
                torch.cuda.graph(graph, stream=self.stream),
            ):
                self.outputs = body(inputs)
                combined = pending.combined(kept)  # one status a replay to read, not one per layer call
        except Exception as e:
            raise RuntimeError(
                f"recording the training step failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); a compiled layer that compiles again inside the "
                "recording met inputs the warm-up steps did not (StepGraph.capture_scope), and a host read (.item(), "
                "a host-to-device copy from pageable memory) cannot be recorded: train without the captured step"
            ) from e
        self.graph, self.kept = graph, [combined] if combined is not None else []

    def replay(self) -> Any:
        self.graph.replay()
        return self.outputs

    def statuses(self) -> list[torch.Tensor]:
        return self.kept

    def release(self) -> None:
        self.graph, self.outputs, self.kept = None, None, []


@dataclass(eq=False)
class StepGraph:
    """A run's recorded step (module docstring). `run(body, batch)` returns `body(batch)`'s outputs (a
    tuple of tensors or None), eager, recorded or replayed; `close()` frees the graph and reads every
    pending routing status."""

    optimizer: torch.optim.Optimizer
    signature: Callable[[], Hashable]
    recorder: Recorder
    warmup: int = WARMUP_STEPS
    # entered around every eager warm-up step and the recording, so both take the same code paths (transformers
    # builds its attention masks otherwise while a capture runs: `occult.integrations.hf.graphed.masks_as_eager`)
    capture_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    inputs: Any = None
    recorded: Hashable = None
    replays: int = 0

    def __post_init__(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            hold_collectives(self)  # a graph holding NCCL collectives goes before its process groups

    def run(self, body: Callable[[Any], tuple], batch: Any) -> tuple:
        if self.warmup > 0:
            self.warmup -= 1
            with self.capture_scope():
                return self.recorder.eager(body, batch)
        self._raise_ready()
        signature = self.signature()
        if self.inputs is None or signature != self.recorded:
            self.inputs = tuple(t.clone() for t in _leaves(batch))
            self.recorder.prepare(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)  # the recording's backward makes them in its memory
            with self.capture_scope():
                self.recorder.record(lambda _: body(_rebuilt(batch, self.inputs)), self.inputs)
            self.recorded = signature
        else:
            new = _leaves(batch)
            if [(t.shape, t.dtype) for t in new] != [(t.shape, t.dtype) for t in self.inputs]:
                raise ValueError(
                    "a captured step replays one batch shape: this step's batch is "
                    f"{[tuple(t.shape) for t in new]}, the recorded one {[tuple(t.shape) for t in self.inputs]}; "
                    "keep the batch size and sequence length fixed, or train without --captured-step"
                )
            for static, t in zip(self.inputs, new):
                static.copy_(t, non_blocking=True)
        outputs = self.recorder.replay()
        self.replays += 1
        for status_D in self.recorder.statuses():
            pending.queue(status_D)
        return tuple(None if t is None else t.clone() for t in outputs)

    def _raise_ready(self) -> None:
        """The routing statuses of earlier replays the GPU has reached, raised if one is bad (no waiting)."""
        pending.raise_ready(self.recorder.statuses())

    def release(self) -> None:
        """Free the graph and its memory (idempotent); the next step records again."""
        self.recorder.release()
        self.inputs, self.recorded = None, None

    def close(self) -> None:
        """At the end of a run: the graph freed, every routing status it left read (`RoutingError`)."""
        had = bool(self.recorder.statuses())
        self.release()
        if had:
            pending.check_routing()


def _leaves(batch: Any) -> list[torch.Tensor]:
    """The batch's tensors (a tensor, or a tuple / list of them), in order."""
    if torch.is_tensor(batch):
        return [batch]
    if isinstance(batch, (tuple, list)) and all(torch.is_tensor(t) for t in batch):
        return list(batch)
    raise ValueError(
        f"a captured step needs its batch as a tensor or a tuple of tensors (fixed shapes), got {type(batch).__name__}"
    )


def _rebuilt(batch: Any, leaves: tuple[torch.Tensor, ...]) -> Any:
    """`batch`'s structure around `leaves`."""
    return leaves[0] if torch.is_tensor(batch) else type(batch)(leaves)


__all__ = [
    "WARMUP_STEPS",
    "check_capturable",
    "make_capturable",
    "set_lr",
    "Recorder",
    "CudaRecorder",
    "StepGraph",
]
