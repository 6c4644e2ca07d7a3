"""`occult.training.loop.TrainLoop` on a one-parameter model: what the progress bar is given, and
the loop's Ctrl-C stop (issue 35)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import tqdm.auto

from occult.training.hooks import StepHook
from occult.training.loop import LoopSettings, StepLoss, StepParts, TrainLoop


class RecordingBar:
    """Stands in for tqdm: records the bar's position at every `set_postfix`."""

    calls: list[tuple[int, dict]] = []

    def __init__(self, *args, initial: int = 0, **kwargs) -> None:
        self.n = initial
        RecordingBar.calls = []

    def update(self, n: int) -> None:
        self.n += n

    def set_postfix(self, post: dict, refresh: bool = True) -> None:
        RecordingBar.calls.append((self.n, dict(post)))

    def close(self) -> None:
        pass


class Evaluate(StepHook):
    """Puts `val=v<step>` on the bar every `every` steps, as occult.lm.train's evaluation does;
    optionally sends this process a SIGINT after step `ctrl_c_at`."""

    def __init__(self, loop: TrainLoop, every: int, ctrl_c_at: int | None = None) -> None:
        self.loop, self.every, self.ctrl_c_at = loop, every, ctrl_c_at

    def after_step(self, step: int, optimizer) -> None:
        if step % self.every == 0:
            self.loop.postfix["val"] = f"v{step}"
        if step == self.ctrl_c_at:
            os.kill(os.getpid(), signal.SIGINT)


def make_loop(steps: int, log_every: int, every: int, ctrl_c_at: int | None = None, stop_on_interrupt: bool = False):
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)

    def loss(batch: int) -> StepLoss:
        out = (w * batch).square().sum()
        return StepLoss(out, out.detach())

    parts = StepParts(
        batch=lambda s: s + 1, loss=loss, sync=lambda: None, clip=lambda m: None, lr=lambda s: 0.1, mean=lambda t: t
    )
    settings = LoopSettings(steps, 0.0, 1, progress=True, log_every=log_every, stop_on_interrupt=stop_on_interrupt)
    loop = TrainLoop(parts, opt, settings)
    loop.hooks = [Evaluate(loop, every, ctrl_c_at)]
    return loop


@pytest.fixture
def bar(monkeypatch):
    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)
    return RecordingBar


def test_bar_shows_the_evaluation_of_its_own_step(bar):
    """An evaluation at a logging step is on the bar at that step, not one evaluation later; one
    between logging steps is shown at once; the last postfix has the last evaluation."""
    make_loop(steps=12, log_every=3, every=2).run(12)
    shown = {n: post.get("val") for n, post in bar.calls}
    assert shown[2] == "v2" and shown[6] == "v6" and shown[12] == "v12"
    assert bar.calls[-1][0] == 12 and "loss" in bar.calls[-1][1]
    assert all(post.get("val") == f"v{n - n % 2}" for n, post in bar.calls)


def test_ctrl_c_ends_the_loop_after_the_step(bar):
    """With stop_on_interrupt, a SIGINT during step 3 ends the loop after it (no exception) and
    Python's handler is back; without it, the SIGINT is a KeyboardInterrupt."""
    loop = make_loop(steps=10, log_every=5, every=100, ctrl_c_at=3, stop_on_interrupt=True)
    loop.run(10)
    assert loop.interrupted and loop.step == 3 and len(loop.losses) == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        make_loop(steps=10, log_every=5, every=100, ctrl_c_at=3).run(10)


def test_the_step_scope_holds_the_forward_and_backward(bar):
    """`StepParts.scope(batch)` (the adapters' `occult.agreed_step`) is entered once per step with that
    step's batch, around its forward and backward and nothing else."""
    events: list[str] = []
    loop = make_loop(steps=3, log_every=3, every=100)
    parts = loop.parts
    inner_loss, inner_sync = parts.loss, parts.sync

    class Scope:
        def __init__(self, batch):
            self.batch = batch

        def __enter__(self):
            events.append(f"enter {self.batch}")

        def __exit__(self, *exc):
            events.append("exit")
            return False

    def loss(batch):
        events.append("loss")
        out = inner_loss(batch)
        out.total.register_hook(lambda g: events.append("backward") or g)
        return out

    parts.scope, parts.loss = Scope, loss
    parts.sync = lambda: events.append("sync") or inner_sync()
    loop.run(3)
    assert events == [e for b in (1, 2, 3) for e in (f"enter {b}", "loss", "backward", "exit", "sync")], events
