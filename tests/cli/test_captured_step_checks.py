"""`--captured-step`'s command-line checks (`occult.cli.run_checks.check_captured_step`), made before any work,
with a CUDA device assumed (the device itself is checked first, tests/cli/test_bad_input_lm.py): what a recorded
step cannot hold is named with the flag that fixes it; on several ranks `--hf` needs no --grad-sync (its adapter
syncs the routers explicitly in a captured step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from occult.cli import run_checks
from occult.cli.registry import CommandError


def _args(**kw) -> SimpleNamespace:
    base = dict(
        captured_step=True,
        device="cuda",
        layer_graphs=False,
        replace_every=0,
        replace_drift=0.0,
        grad_sync="explicit",
        transport="auto",
        ep_size=None,
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(autouse=True)
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(run_checks, "resolved_device", lambda device: "cuda:0")


@pytest.mark.parametrize(
    "world, kw, needles",
    [
        (1, dict(layer_graphs=True), ["drop --layer-graphs"]),
        (1, dict(replace_every=50), ["--replace-every", "drop one"]),
        (2, dict(grad_sync="ddp"), ["--grad-sync ddp", "DDP's reducer", "--grad-sync explicit, overlap or fsdp"]),
        (2, dict(transport="counts", ep_size=2), ["--transport counts", "--transport device"]),
    ],
)
def test_what_a_recorded_step_cannot_hold_is_refused(monkeypatch, world, kw, needles):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(CommandError) as exc:
        run_checks.check_captured_step(_args(**kw))
    assert all(n in str(exc.value) for n in needles), str(exc.value)


def test_accepted_settings(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    run_checks.check_captured_step(_args(grad_sync="ddp"))  # one process: no gradient sync to record
    monkeypatch.setenv("WORLD_SIZE", "4")
    run_checks.check_captured_step(_args(transport="device", ep_size=2))
    run_checks.check_captured_step(_args(transport="device", ep_size=2, grad_sync="fsdp"))  # recorded with the step
    run_checks.check_captured_step(_args(grad_sync="ddp"), hf=True)  # --hf: the routers synced explicitly
    run_checks.check_captured_step(_args(captured_step=False, grad_sync="fsdp", layer_graphs=True))
    # the count exchange's layers made sync-free (no host wait left to record) by two halves or paired micro-batches
    run_checks.check_captured_step(_args(transport="counts", ep_size=2, two_batch=True))
    run_checks.check_captured_step(_args(transport="counts", ep_size=2, pair_micro_batches=True, micro_batches=2))
