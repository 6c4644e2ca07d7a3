"""`TrainConfig.two_batch` (`occult train --two-batch`): each step's loss and backward as two interleaved
micro-batches (`occult.training.two_batch` through `TrainLoop`).

Two gloo ranks, experts sharded over both by a non-contiguous placement, train as one process does on the same
global batch (losses, validation losses and every weight within `RTOL`; the load-balancing loss off, since two
halves have two of it), with the dense gradients all-reduced after the backward or in buckets during it: the loop
really ran the halves (every step through `forward_halves`, the exchanges issued from both halves' threads,
interleaved), the expert-parallel layers sync-free. Refused before any step (every rank the same error, nothing
written): DDP and FSDP2 on several ranks, an odd batch per rank, layer graphs, re-placement, distillation; the same
at the command line. On GPUs (two streams, inside a recorded step): tests/gpu/test_collective_two_batch_option.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from _train_helpers import (
    PLACEMENT,
    RTOL,
    assert_matches,
    config,
    load_tiny,
    one_process,
    refusal_on_rank,
    run,
    train_config,
)

from occult.distributed import run_ranks
from occult.lm.model import OccultLM
from occult.lm.parallel import full_model, setup_parallel, shard_model
from occult.lm.train import train
from occult.moe import comm
from occult.moe.layer import OccultMoE
from occult.placement import Placement
from occult.training import loop

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
STEPS = 12
NO_AUX = dict(steps=STEPS, aux_loss_coef=0.0, eval_every=6, save_every=6, grad_sync="explicit")


class _Watch:
    """While entered: how many times the loop ran two halves, and the thread that issued each exchange."""

    def __enter__(self) -> _Watch:
        self.halves, self.issuers = 0, []
        self._saved = loop.forward_halves, comm._Exchange.forward
        forward_halves, exchange = self._saved

        def counted(*args, **kw):
            self.halves += 1
            return forward_halves(*args, **kw)

        def logged(ctx, *args):
            self.issuers.append(threading.current_thread().name)
            return exchange(ctx, *args)

        loop.forward_halves, comm._Exchange.forward = counted, staticmethod(logged)
        return self

    def __exit__(self, *exc) -> None:
        loop.forward_halves, comm._Exchange.forward = self._saved[0], staticmethod(self._saved[1])


def _two_batch_rank(rank: int, world_size: int, data, root: str) -> dict:
    par = setup_parallel()
    placement = Placement.from_lists(PLACEMENT, 2)
    with _Watch() as watch:
        snap = run(par, data, Path(root) / "two", placement, config={**NO_AUX, "two_batch": True})
    torch.manual_seed(0)
    model = shard_model(full_model(config(data), par), par, placement)
    with _Watch() as plain:
        train(model, data, train_config(**NO_AUX), Path(root) / "one", parallel=par, progress=False, log=None)
    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    overlap = run(
        par, data, Path(root) / "overlap", placement, config={**NO_AUX, "two_batch": True, "grad_sync": "overlap"}
    )
    return {
        **snap,
        "overlap": overlap,
        "halves": watch.halves,
        "issuers": watch.issuers,
        "plain_halves": plain.halves,
        "plain_issuers": set(plain.issuers),
        "sync_free_plain": any(m.sync_free for m in layers),
    }


def test_two_interleaved_halves_train_as_one_process(tmp_path):
    data = load_tiny()
    want = one_process(data, train_config(**{**NO_AUX, "grad_sync": "ddp"}), tmp_path / "single")
    got = run_ranks(_two_batch_rank, 2, data, str(tmp_path), timeout_s=300)
    for rank in got:
        assert_matches(rank, want, RTOL, steps=STEPS)
        assert_matches(rank["overlap"], want, RTOL, steps=STEPS)  # the dense all-reduces in buckets, during it
        assert rank["halves"] == STEPS  # every training step in two halves (evaluation: one batch)
        training = [name for name in rank["issuers"] if name.startswith("occult-two-batch")]
        assert len(training) == STEPS * 2 * 2 * 2  # steps x halves x layers x (dispatch, combine)
        first_step = [name[-1] for name in training[:8]]
        assert first_step == ["A", "B"] * 4, first_step  # A's dispatch, B's, A's combine, B's, ... on every rank
        assert rank["plain_halves"] == 0 and not any(n.startswith("occult-two-batch") for n in rank["plain_issuers"])
        assert not rank["sync_free_plain"]  # (only --two-batch switches the layers to sync-free)


@pytest.mark.parametrize("grad_sync, needle", [("ddp", "DDP's hooks"), ("fsdp", "FSDP2's hooks")])
def test_refused_on_every_rank_with_hooks_that_expect_one_forward(tmp_path, grad_sync, needle):
    got = run_ranks(refusal_on_rank, 2, load_tiny(), str(tmp_path), grad_sync, "two_batch", timeout_s=180)
    assert len(got) == 2 and all(needle in m and "--grad-sync explicit" in m for m in got), got
    assert not list(tmp_path.glob("**/*.safetensors"))


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"batch_size": 3}, "even number of rows per rank"),
        ({"layer_graphs": True}, "layer_graphs"),
        ({"replace_every": 5}, "re-placement"),
        ({"distill_weight": 0.5}, "distillation"),
    ],
)
def test_refused_in_one_process(tmp_path, kw, needle):
    data = load_tiny()
    model = OccultLM(config(data))
    with pytest.raises(ValueError, match=needle):
        train(model, data, train_config(two_batch=True, **kw), tmp_path / "run", progress=False, log=None)
    assert not list((tmp_path / "run").glob("*.safetensors"))


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_split_batch_gives_equal_micro_batches_and_refuses_what_it_cannot_split(parts):
    rows = 2 * parts
    x, y = torch.randn(rows, 3), torch.randint(0, 9, (rows,))
    micro = loop.split_batch((x, y), parts)
    assert len(micro) == parts and all(len(m[0]) == 2 for m in micro)
    assert torch.equal(torch.cat([m[0] for m in micro]), x) and torch.equal(torch.cat([m[1] for m in micro]), y)
    assert [type(m) for m in loop.split_batch([x, y], parts)] == [list] * parts
    with pytest.raises(ValueError, match=f"multiple of {parts + 1} rows"):
        loop.split_batch(torch.zeros(rows + 1, 2), parts + 1)
    with pytest.raises(ValueError, match="not dict"):
        loop.split_batch({"x": x}, parts)


@pytest.mark.parametrize(
    "argv, world, needle",
    [
        (["--grad-sync", "ddp"], "2", "--grad-sync explicit"),
        (["--layer-graphs"], "1", "--layer-graphs"),
        (["--batch-size", "6", "--grad-sync", "explicit"], "2", "even number of rows per rank"),
        (["--replace-every", "10"], "1", "--replace-every"),
    ],
)
def test_command_line_refusals_before_any_work(tmp_path, monkeypatch, argv, world, needle):
    from occult.cli import build_parser
    from occult.cli.registry import CommandError
    from occult.cli.run_checks import check_two_batch_args

    monkeypatch.setenv("WORLD_SIZE", world)
    args = build_parser().parse_args(["train", "--out", str(tmp_path / "run"), "--two-batch", *argv])
    with pytest.raises(CommandError, match=needle):
        check_two_batch_args(args)
    assert not (tmp_path / "run").exists()
