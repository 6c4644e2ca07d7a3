"""The one training step loop of `occult train`, `occult finetune` and `occult finetune --hf`.

`TrainLoop(parts, optimizer, settings, hooks).run(last)` does, per step on every rank:

    lr         `parts.lr(step)` into every parameter group
    batch      `parts.batch(step)`: this rank's rows of global batch `step` (a function of the
               seed and the step only, so the data position is the step and a resume is exact)
    loss       `parts.loss(batch)` -> `StepLoss` (the model's forward, its own precision)
    backward   `total.backward()` (DDP / FSDP2 hooks reduce dense gradients during it); the forward
               and backward run inside `parts.scope(batch)` (the adapters' `occult.agreed_step`:
               the expert-parallel ranks agree on their token counts once per step, not per layer)
    sync       `parts.sync()`: gradients of the global-batch loss (`occult.training.grads`)
    clip       `parts.clip(grad_clip)`: clip by the global norm; the norm is recorded
    step       `optimizer.step()`, then every hook's `after_step` (`occult.training.hooks`)
    metrics    every `log_every` steps (and at the last) the pending per-step losses become global
               means (`parts.mean`: one all-reduce), a non-finite loss stops the run with a clear
               error, and the progress bar (rank 0) shows loss, aux loss, lr, gradient norm,
               tokens/s and whatever the hooks put in `postfix` (shown after the hooks ran, so
               an evaluation at this step is on the bar at once)

With `LoopSettings.captured_step` everything from the loss to the optimizer step is recorded once as a
CUDA graph and replayed (`occult.training.step_graph`; `StepParts.signature` says when to record again).

With `LoopSettings.two_batch` the loss and backward run as two interleaved micro-batches
(`occult.training.two_batch`): `parts.split(batch, 2)` splits the batch, each half's loss runs on a thread and
stream of its own, passing a turn at every expert-parallel exchange so one half's all-to-all is on the wire
while the other computes, then one backward of the halves' mean `StepLoss` (the adapter checks the model's
layers first: `check_two_batch`).

With `LoopSettings.micro_batches = K` (K > 1) the step's batch is K micro-batches (`parts.split`), each's loss and
backward in turn, their gradients added, then one sync, clip and optimizer step (gradient accumulation; the logged
loss is their mean); with `LoopSettings.paired` micro-batch i+1's forward runs beside micro-batch i's backward
(`occult.training.accumulation`: combined 1F1B, one's all-to-alls under the other's compute; sync-free
expert-parallel layers, which the adapter checks).

With `LoopSettings.stop_on_interrupt` (one process only: ranks would disagree on the step), a
Ctrl-C ends the loop after the step under way, which the adapter then saves (`interrupted` is
set); a second Ctrl-C raises KeyboardInterrupt at once.

`TrainClock` counts training time between evaluations (hooks pause it for evaluations and
saves), for the tokens/s a run's metrics report. The model-specific parts (how a batch becomes
a loss, which parameters train, how gradients sync) are the adapters' (`occult.lm.train`,
`occult.integrations.hf.finetune`).
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from occult.training.accumulation import backward_accumulated
from occult.training.hooks import StepHook
from occult.training.step_graph import CudaRecorder, StepGraph, set_lr
from occult.training.two_batch import backward_halves, forward_halves

STEP_RANGE = "occult::train_step"  # a step's host range in profiles (occult.training.step_profile)


def to_device(batch_cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on `device` without the host waiting for the GPU: a GPU copy goes through pinned memory
    (from pageable memory it would wait for the stream to reach it, and a host that runs ahead of the GPU,
    e.g. launching recorded steps, would stop at every batch)."""
    if device.type != "cuda":
        return batch_cpu.to(device)
    return batch_cpu.pin_memory().to(device, non_blocking=True)


@dataclass
class StepLoss:
    """One forward's losses: `total` is what the backward runs on, `logged` the recorded loss
    (this rank's mean), `aux` a load-balancing loss shown on the progress bar (or None)."""

    total: torch.Tensor
    logged: torch.Tensor
    aux: torch.Tensor | None = None

    def scaled(self, factor: float) -> StepLoss:
        """The backward's loss times `factor` (a rank's share of the global mean: `occult.training.grads.loss_scale`),
        the logged ones as they are; itself where `factor` is 1."""
        return self if factor == 1.0 else StepLoss(self.total * factor, self.logged, self.aux)


def split_batch(batch: Any, parts: int) -> tuple[Any, ...]:
    """A batch's `parts` equal micro-batches along its first dimension: a tensor, or a tuple or list of them (e.g.
    inputs and labels). A `ValueError` for a first dimension `parts` does not divide, or another type."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % parts:
            raise ValueError(
                f"{parts} micro-batches split the batch in {parts} equal parts: give a batch of a multiple of {parts} "
                f"rows (got {tuple(batch.shape)})"
            )
        return tuple(batch.chunk(parts))
    if isinstance(batch, (tuple, list)):
        split = [split_batch(part, parts) for part in batch]
        return tuple(type(batch)(s[i] for s in split) for i in range(parts))
    raise ValueError(f"micro-batches split tensors, or tuples or lists of them, not {type(batch).__name__}")


@dataclass
class StepParts:
    """The model-specific parts of a step (module docstring)."""

    batch: Callable[[int], Any]
    loss: Callable[[Any], StepLoss]
    sync: Callable[[], None]
    clip: Callable[[float], torch.Tensor | None]
    lr: Callable[[int], float]
    mean: Callable[[torch.Tensor], torch.Tensor]
    scope: Callable[[Any], contextlib.AbstractContextManager] = lambda batch: contextlib.nullcontext()
    signature: Callable[[], Hashable] | None = None  # what a recorded step depends on (`captured_step`)
    # the context a captured step's warm-up steps and recording run in (`occult.training.step_graph.StepGraph`)
    capture_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    split: Callable[[Any, int], Sequence[Any]] = split_batch  # a batch's micro-batches (`two_batch`, `micro_batches`)
    # where the data-parallel hooks hold a micro-batch's gradients back (DDP's `no_sync`; FSDP2's gradient sync off):
    # every in-turn micro-batch but the last (`micro_batches`)
    unsynced: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    close: Callable[[], None] = lambda: None  # releases what the parts put on the model (hooks), at the run's end


@dataclass
class LoopSettings:
    """`steps`: the run's total (the bar and the last report); `tokens_per_step`: global."""

    steps: int
    grad_clip: float
    tokens_per_step: int
    desc: str = "train"
    progress: bool | None = None  # None: a bar only on a terminal
    main: bool = True
    log_every: int = 10
    stop_on_interrupt: bool = False  # a first Ctrl-C ends the loop after the current step (module docstring)
    captured_step: bool = False  # the step recorded once as a CUDA graph and replayed (module docstring)
    two_batch: bool = False  # the loss and backward as two interleaved micro-batches (module docstring)
    micro_batches: int = 1  # the step's batch as this many micro-batches, gradients accumulated (module docstring)
    paired: bool = False  # those micro-batches paired, a forward with the previous one's backward (combined 1F1B)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.tokens_per_step < 1 or self.log_every < 1 or self.micro_batches < 1:
            raise ValueError(
                f"need steps, tokens_per_step, log_every and micro_batches >= 1, got {self.steps}, "
                f"{self.tokens_per_step}, {self.log_every}, {self.micro_batches}"
            )
        if self.paired and self.micro_batches < 2:
            raise ValueError(f"paired micro-batches need micro_batches >= 2, got {self.micro_batches}")
        if self.two_batch and self.micro_batches > 1:
            raise ValueError("two_batch and micro_batches > 1 both split the step: choose one")


@dataclass
class TrainClock:
    """Training seconds and steps since the last `take()`; paused for evaluations and saves."""

    seconds: float = 0.0
    steps: int = 0
    since: float | None = None

    def run(self) -> None:
        if self.since is None:
            self.since = time.perf_counter()

    def pause(self) -> None:
        if self.since is not None:
            self.seconds += time.perf_counter() - self.since
            self.since = None

    def take(self) -> tuple[int, float]:
        """(steps, seconds) since the last take (the clock paused), then reset."""
        self.pause()
        out = (self.steps, self.seconds)
        self.steps, self.seconds = 0, 0.0
        return out


@dataclass
class TrainLoop:
    """The loop's state: steps done, every step's global loss, gradient norms (module docstring)."""

    parts: StepParts | None  # may be set after construction (e.g. after a resume), before `run`
    optimizer: torch.optim.Optimizer
    settings: LoopSettings
    hooks: Sequence[StepHook] = ()
    step: int = 0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[Any] = field(default_factory=list)  # tensors until `norms()`
    stopped: bool = False
    interrupted: bool = False  # a Ctrl-C ended the loop (`LoopSettings.stop_on_interrupt`)
    postfix: dict[str, str] = field(default_factory=dict)  # extra progress-bar fields (hooks)
    clock: TrainClock = field(default_factory=TrainClock)
    pending: list[torch.Tensor] = field(default_factory=list)
    graph: StepGraph | None = None  # the recorded step (`captured_step`; made by `run` where not given)

    def flush(self) -> float:
        """Record the pending steps' losses (means over the global batch); the last one."""
        if self.pending:
            self.losses.extend(self.parts.mean(torch.stack(self.pending).float()).tolist())
            self.pending.clear()
        return self.losses[-1] if self.losses else float("nan")

    def norms(self) -> list[float]:
        """Every step's gradient norm as floats."""
        self.grad_norms = [float(n) for n in self.grad_norms]
        return list(self.grad_norms)

    def stop(self) -> None:
        """End the run after this step (a hook's decision, e.g. validation loss flat)."""
        self.stopped = True

    def run(self, last: int) -> None:
        """Train until `last` steps are done (or a hook stops the run, or a Ctrl-C)."""
        from tqdm.auto import tqdm

        if self.parts is None:
            raise ValueError("TrainLoop.run needs its StepParts (TrainLoop.parts)")
        s = self.settings
        show = ((not s.progress) if s.progress is not None else None) if s.main else True
        bar = tqdm(total=s.steps, initial=self.step, desc=s.desc, unit="step", disable=show, dynamic_ncols=True)
        mark, shown, extra = (time.perf_counter(), self.step), {}, dict(self.postfix)
        if s.captured_step and self.graph is None:
            self.graph = self._step_graph()
        for hook in self.hooks:
            hook.start()
        finished = False
        try:
            with self._interruptible():
                while self.step < last and not self.stopped and not self.interrupted:
                    lr, out, gnorm = self._one_step()
                    bar.update(1)
                    logged = self.step % s.log_every == 0 or self.step == s.steps
                    if logged:
                        mark, shown = self._measure(mark, lr, out, gnorm)
                    for hook in self.hooks:
                        hook.after_step(self.step, self.optimizer)
                    if logged or self.postfix != extra:  # after the hooks: this step's evaluation too
                        extra = dict(self.postfix)
                        bar.set_postfix({**shown, **extra}, refresh=False)
            finished = True
        finally:
            if self.graph is not None and finished:
                self.graph.close()  # freed, and every routing status it left read
            elif self.graph is not None:
                self.graph.release()
            bar.close()
            for hook in self.hooks:
                hook.close()
        self.flush()

    @contextlib.contextmanager
    def _interruptible(self) -> Iterator[None]:
        """With `stop_on_interrupt`, the first SIGINT sets `interrupted` (the loop ends after this
        step) and puts Python's handler back, so a second one raises at once."""
        on = (
            self.settings.stop_on_interrupt
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if not on:
            yield
            return

        def first(signum: int, frame: Any) -> None:
            self.interrupted = True
            signal.signal(signal.SIGINT, signal.default_int_handler)

        signal.signal(signal.SIGINT, first)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _step_graph(self) -> StepGraph:
        """The recorded step of this run, on the parameters' GPU."""
        if self.parts.signature is None:
            raise ValueError("LoopSettings.captured_step needs StepParts.signature (what a recorded step depends on)")
        device = self.optimizer.param_groups[0]["params"][0].device
        if device.type != "cuda":
            raise ValueError(f"LoopSettings.captured_step records a CUDA graph: the parameters are on {device}")
        recorder = CudaRecorder(device)
        return StepGraph(self.optimizer, self.parts.signature, recorder, capture_scope=self.parts.capture_scope)

    def _one_step(self) -> tuple[float, StepLoss, torch.Tensor | None]:
        self.clock.run()
        with torch.profiler.record_function(STEP_RANGE):
            lr = self.parts.lr(self.step)
            set_lr(self.optimizer, lr)
            batch = self.parts.batch(self.step)
            outputs = self._body(batch) if self.graph is None else self.graph.run(self._body, batch)
        total, logged, aux, gnorm = outputs
        self.step += 1
        self.clock.steps += 1
        if gnorm is not None:
            self.grad_norms.append(gnorm)
        self.pending.append(logged)
        return lr, StepLoss(total, logged, aux), gnorm

    def _body(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One step's work from the loss to the optimizer: (total, logged, aux, gradient norm), detached
        (the autograd graph goes with the step)."""
        with self.parts.scope(batch):
            if self.settings.micro_batches > 1:
                out = self._accumulated_backward(batch)
            else:
                out = self._two_batch_loss(batch) if self.settings.two_batch else self.parts.loss(batch)
                self.optimizer.zero_grad(set_to_none=True)
                if self.settings.two_batch:
                    backward_halves(out.total)
                else:
                    out.total.backward()
        self.parts.sync()
        gnorm = self.parts.clip(self.settings.grad_clip)
        self.optimizer.step()
        aux = None if out.aux is None else out.aux.detach()
        return out.total.detach(), out.logged.detach(), aux, None if gnorm is None else gnorm.detach()

    def _accumulated_backward(self, batch: Any) -> StepLoss:
        """`micro_batches` forwards and backwards, each's gradients added to the zeroed ones (`backward_accumulated`:
        in turn or paired); the micro-batches' mean `StepLoss`, detached."""
        count = self.settings.micro_batches
        micro = self.parts.split(batch, count)
        device = self.optimizer.param_groups[0]["params"][0].device

        def forward_of(i: int) -> tuple[torch.Tensor | None, ...]:
            out = self.parts.loss(micro[i])
            return out.total / count, out.logged, out.aux

        self.optimizer.zero_grad(set_to_none=True)
        outs = backward_accumulated(forward_of, count, device, self.settings.paired, self.parts.unsynced)
        total, logged, aux = (None if o[0] is None else torch.stack(list(o)) for o in zip(*outs))
        return StepLoss(total.sum(0), logged.mean(0), None if aux is None else aux.mean(0))

    def _two_batch_loss(self, batch: Any) -> StepLoss:
        """The mean of the two halves' `StepLoss`, their forwards interleaved (`forward_halves`)."""
        halves = self.parts.split(batch, 2)
        device = self.optimizer.param_groups[0]["params"][0].device

        def forward_of(i: int) -> tuple[torch.Tensor | None, ...]:
            out = self.parts.loss(halves[i])
            return out.total, out.logged, out.aux

        first, second = forward_halves(forward_of, device)
        means = [None if a is None else (a + b) / 2 for a, b in zip(first, second)]
        return StepLoss(*means)

    def _measure(
        self, mark: tuple[float, int], lr: float, out: StepLoss, gnorm: torch.Tensor | None
    ) -> tuple[tuple[float, int], dict[str, str]]:
        """The global loss of the pending steps (a non-finite one stops the run), and the bar's
        fields: loss, aux, lr, tokens/s since `mark`, gradient norm."""
        last_loss = self.flush()
        if not math.isfinite(last_loss):
            raise FloatingPointError(f"training loss is {last_loss} at step {self.step}; lower the learning rate")
        now = time.perf_counter()
        tps = self.settings.tokens_per_step * (self.step - mark[1]) / max(1e-9, now - mark[0])
        post = {"loss": f"{last_loss:.4f}"}
        if out.aux is not None:
            post["aux"] = f"{float(out.aux.detach()):.3f}"
        post.update({"lr": f"{lr:.2e}", "tok/s": f"{tps:,.0f}"})
        if gnorm is not None:
            post["gnorm"] = f"{float(gnorm):.2f}"
        return (now, self.step), post


__all__ = [
    "STEP_RANGE",
    "to_device",
    "split_batch",
    "StepLoss",
    "StepParts",
    "LoopSettings",
    "TrainClock",
    "TrainLoop",
]
