"""`occult.training.step_graph`: the training loop with `LoopSettings.captured_step`, recorded and replayed by a
recorder that replays by calling the step again (the loop's plumbing: warm-up steps, the batch copied into the
recorded inputs, the learning rate filled in place, outputs copied out of the recording's tensors, a changed model
recorded again, a batch of another shape refused, routing statuses queued after each replay). A real CUDA graph
needs a GPU: tests/gpu/test_captured_step_one_gpu.py."""

from __future__ import annotations

import pytest
import torch

from occult.moe.counts import RoutingError
from occult.training.loop import LoopSettings, StepLoss, StepParts, TrainLoop
from occult.training.step_graph import StepGraph, check_capturable, make_capturable, set_lr


class CallingRecorder:
    """Replays by calling the recorded step on the recorded inputs; like a CUDA graph, it writes every replay's
    outputs into the same tensors (made at the first replay)."""

    def __init__(self, statuses: list[torch.Tensor] | None = None) -> None:
        self.eager_calls = self.records = 0
        self.body = self.inputs = self.outputs = None
        self.kept = statuses or []

    def eager(self, body, batch):
        self.eager_calls += 1
        return body(batch)

    def prepare(self, optimizer) -> None:
        for group in optimizer.param_groups:  # the recorded step reads its learning rate from a tensor
            if not torch.is_tensor(group["lr"]):
                group["lr"] = torch.tensor(float(group["lr"]))

    def record(self, body, inputs) -> None:
        self.records += 1
        self.body, self.inputs, self.outputs = body, inputs, None

    def replay(self):
        fresh = self.body(self.inputs)
        if self.outputs is None:
            self.outputs = tuple(None if t is None else t.clone() for t in fresh)
        else:
            for static, t in zip(self.outputs, fresh):
                if static is not None:
                    static.copy_(t)
        return self.outputs

    def statuses(self):
        return self.kept

    def release(self) -> None:
        self.body = self.inputs = self.outputs = None


def _parts(model: torch.nn.Module, signature=lambda: 0, shapes=lambda step: (16, 8)) -> StepParts:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        rows, width = shapes(step)
        return torch.randn(rows, width, generator=g), torch.randn(rows, 1, generator=g)

    def loss(xy) -> StepLoss:
        x, y = xy
        err = (model(x) - y).square().mean()
        aux = model[0].weight.square().mean()
        return StepLoss(err + 0.01 * aux, err, aux)

    def clip(max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    return StepParts(
        batch=batch,
        loss=loss,
        sync=lambda: None,
        clip=clip,
        lr=lambda s: 1e-2 * (1 + s % 3),
        mean=lambda t: t,
        signature=signature,
    )


def _run(steps: int, captured: bool, recorder: CallingRecorder | None = None, warmup: int = 2, **parts_kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    settings = LoopSettings(steps, 0.5, 16, progress=False, log_every=3, captured_step=captured)
    loop = TrainLoop(_parts(model, **parts_kwargs), opt, settings)
    if captured:
        loop.graph = StepGraph(opt, loop.parts.signature, recorder, warmup=warmup)
    loop.run(steps)
    return loop, model, opt


def test_a_captured_loop_gives_the_eager_losses_norms_and_weights():
    eager, eager_model, _ = _run(9, captured=False)
    recorder = CallingRecorder()
    captured, captured_model, opt = _run(9, captured=True, recorder=recorder)
    assert (recorder.eager_calls, recorder.records, captured.graph.replays) == (2, 1, 7)
    # every step's own loss and norm, though a replay rewrites the same output tensors
    assert len(set(captured.losses)) == 9
    torch.testing.assert_close(torch.tensor(captured.losses), torch.tensor(eager.losses), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(captured.norms()), torch.tensor(eager.norms()), rtol=1e-6, atol=0)
    for a, b in zip(captured_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert all(
        torch.is_tensor(g["lr"]) and float(g["lr"]) == pytest.approx(1e-2 * (1 + 8 % 3)) for g in opt.param_groups
    )


def test_the_capture_scope_holds_the_warm_ups_and_the_recording_only():
    """What runs inside `StepGraph.capture_scope`: each eager warm-up step and the recording, never a replay."""
    inside = {"now": False, "entered": 0}

    class ScopeSeeing(CallingRecorder):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, bool]] = []

        def eager(self, body, batch):
            self.seen.append(("eager", inside["now"]))
            return super().eager(body, batch)

        def record(self, body, inputs) -> None:
            self.seen.append(("record", inside["now"]))
            super().record(body, inputs)

        def replay(self):
            self.seen.append(("replay", inside["now"]))
            return super().replay()

    import contextlib

    @contextlib.contextmanager
    def scope():
        inside["now"], inside["entered"] = True, inside["entered"] + 1
        try:
            yield
        finally:
            inside["now"] = False

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    recorder = ScopeSeeing()
    loop = TrainLoop(_parts(model), opt, LoopSettings(6, 0.5, 16, progress=False, captured_step=True))
    loop.graph = StepGraph(opt, loop.parts.signature, recorder, warmup=2, capture_scope=scope)
    loop.run(6)
    assert recorder.seen == [("eager", True)] * 2 + [("record", True)] + [("replay", False)] * 4, recorder.seen
    assert inside["entered"] == 3


def test_a_changed_model_is_recorded_again():
    recorder, version = CallingRecorder(), {"v": 0}

    def signature() -> int:
        return version["v"]

    class Bump:
        def start(self) -> None: ...

        def after_step(self, step: int, optimizer) -> None:
            if step == 5:
                version["v"] += 1

        def close(self) -> None: ...

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    loop = TrainLoop(
        _parts(model, signature=signature), opt, LoopSettings(8, 0.5, 16, progress=False, captured_step=True), [Bump()]
    )
    loop.graph = StepGraph(opt, signature, recorder, warmup=1)
    loop.run(8)
    assert (recorder.eager_calls, recorder.records, loop.graph.replays) == (1, 2, 7)


def test_a_batch_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="one batch shape"):
        _run(6, captured=True, recorder=CallingRecorder(), shapes=lambda step: (16 if step < 4 else 12, 8))


def test_a_bad_routing_status_of_a_replay_raises():
    bad = torch.tensor([0, 2])  # rank 1's ids out of range (a CPU status is read at once)
    with pytest.raises(RoutingError):
        _run(5, captured=True, recorder=CallingRecorder([bad]))


def test_the_loop_needs_a_signature_to_record():
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters())
    parts = _parts(model)
    parts.signature = None
    loop = TrainLoop(parts, opt, LoopSettings(2, 0.0, 16, progress=False, captured_step=True))
    with pytest.raises(ValueError, match="StepParts.signature"):
        loop.run(2)
    parts.signature = lambda: 0
    with pytest.raises(ValueError, match="records a CUDA graph: the parameters are on cpu"):
        TrainLoop(parts, opt, LoopSettings(2, 0.0, 16, progress=False, captured_step=True)).run(2)
    assert all(p.grad is None for p in model.parameters())  # refused before any step


def test_capturable_optimizers_and_devices():
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match="no capturable mode"):
        make_capturable(torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    make_capturable(opt)
    assert opt.param_groups[0]["capturable"] and torch.is_tensor(opt.param_groups[0]["lr"])
    assert not opt.param_groups[0]["fused"]  # fused kernels for GPU parameters only (tests/gpu: on a GPU)
    set_lr(opt, 0.25)
    assert float(opt.param_groups[0]["lr"]) == 0.25
    with pytest.raises(ValueError, match="needs a CUDA device"):
        check_capturable(model)


def test_a_recordings_statuses_are_combined_into_one():
    """One status a replay (a one-entry status, a one-rank layer's, counts for every rank); bad entries kept."""
    from occult.moe.status import combined as combined_status

    assert combined_status([]) is None
    got = combined_status([torch.tensor([0]), torch.tensor([0, 2, 0]), torch.tensor([[1]]), torch.tensor([0, 0, 3])])
    assert got.tolist() == [1, 2, 3]


def _hooks_seen(rank: int, world_size: int) -> tuple[bool, bool, bool]:
    """On a gloo group: has_hooks of a model sharded with FSDP2, without and with FSDP2's own hooks counted as
    recorded, then with a hook of the user's added."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from occult.moe.graphs import has_hooks
    from occult.training.step_graph import fsdp_state_hook

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    plain, recorded = has_hooks(model), has_hooks(model, recorded=fsdp_state_hook)
    model[1].register_forward_hook(lambda *args: None)
    return plain, recorded, has_hooks(model, recorded=fsdp_state_hook)


def test_fsdp2s_own_hooks_are_recorded_with_the_step_and_a_users_hook_still_counts():
    from occult.distributed import run_ranks

    got = run_ranks(_hooks_seen, 2, timeout_s=120)
    assert got == [(True, False, True)] * 2, got
