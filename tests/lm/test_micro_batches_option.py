"""`TrainConfig.micro_batches` / `pair_micro_batches` (`occult train --micro-batches K [--pair-micro-batches]`):
each rank's rows of a step as K micro-batches, their gradients accumulated in turn or paired (combined 1F1B:
`occult.training.accumulation` through `TrainLoop`).

Two gloo ranks, experts sharded over both by a non-contiguous placement, train as one process does on the same
global batch (losses, validation losses and every weight within `RTOL`; the load-balancing loss off, since K
micro-batches have K of it): in turn with the explicit sync, with DDP (its buckets reduced once a step, as many as
one batch's: `no_sync` around the earlier micro-batches), with FSDP2 (its gradient sync off for them) and with the
bucketed sync (each bucket all-reduced once a step), paired with the explicit and the bucketed sync. The loop
really paired them (each step's later micro-batches' exchanges issued from the forward thread, the rest from the
caller's or autograd's), the paired run's layers sync-free, the in-turn ones not. Refused before any step (the
same error on every rank, nothing written): pairing with DDP or FSDP2, rows per rank that K does not divide, with
two_batch, pairing with layer graphs, re-placement or distillation; the same at the command line. On GPUs (two
streams, inside a recorded step): tests/gpu/test_collective_two_batch_option.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _train_helpers import (
    PLACEMENT,
    RTOL,
    assert_matches,
    config,
    load_tiny,
    one_process,
    run,
    snapshot,
    train_config,
)

import occult.lm.step_options as step_options_module
import occult.lm.train as train_module
from occult.distributed import run_ranks
from occult.lm.model import OccultLM
from occult.lm.parallel import full_model, setup_parallel, shard_model
from occult.lm.train import TrainConfig, train
from occult.moe import comm
from occult.moe.layer import OccultMoE
from occult.placement import Placement
from occult.training.bucketed_sync import BucketedSync

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
STEPS = 8
NO_AUX = dict(steps=STEPS, aux_loss_coef=0.0, eval_every=4, save_every=4, grad_sync="explicit")
PAIRED = dict(micro_batches=2, pair_micro_batches=True)


class _Issuers:
    """While entered: the thread that issued each exchange's forward."""

    def __enter__(self) -> list[str]:
        self.saved = comm._Exchange.forward
        self.names: list[str] = []
        exchange = self.saved

        def logged(ctx, *args):
            self.names.append(threading.current_thread().name)
            return exchange(ctx, *args)

        comm._Exchange.forward = staticmethod(logged)
        return self.names

    def __exit__(self, *exc) -> None:
        comm._Exchange.forward = staticmethod(self.saved)


class _DdpReductions:
    """While entered: how many gradient buckets DDP reduced (a comm hook on every DDP the runs wrap)."""

    def __enter__(self) -> _DdpReductions:
        self.count, self.saved = 0, train_module.wrap_ddp

        def counted(state, bucket):  # (summed, as the hook wrap_ddp(summed=True) registers: the losses are scaled)
            self.count += 1
            work = dist.all_reduce(bucket.buffer(), group=state, async_op=True)
            return work.get_future().then(lambda f: f.value()[0])

        def wrap(*args, **kw):
            ddp = self.saved(*args, **{**kw, "summed": False})  # (one hook a DDP: this one, counting)
            if ddp is not None:
                ddp.register_comm_hook(ddp.process_group, counted)
            return ddp

        train_module.wrap_ddp = wrap
        return self

    def __exit__(self, *exc) -> None:
        train_module.wrap_ddp = self.saved


class _BucketLaunches:
    """While entered: how many buckets `BucketedSync` all-reduced."""

    def __enter__(self) -> _BucketLaunches:
        self.count, self.saved = 0, BucketedSync._launch

        def counted(sync, bucket):
            self.count += 1
            return self.saved(sync, bucket)

        BucketedSync._launch = counted
        return self

    def __exit__(self, *exc) -> None:
        BucketedSync._launch = self.saved


class _FsdpSyncOff:
    """While entered: how many micro-batches ran with FSDP2's gradient sync off."""

    def __enter__(self) -> _FsdpSyncOff:
        self.count, self.saved = 0, step_options_module.gradient_sync_off

        def counted(model):
            self.count += 1
            return self.saved(model)

        step_options_module.gradient_sync_off = counted
        return self

    def __exit__(self, *exc) -> None:
        step_options_module.gradient_sync_off = self.saved


def _micro_batch_rank(rank: int, world_size: int, data, root: str) -> dict:
    par = setup_parallel()
    placement = Placement.from_lists(PLACEMENT, 2)
    out = {"turn": run(par, data, Path(root) / "turn", placement, config={**NO_AUX, "micro_batches": 2})}
    for name, extra in (("ddp", {"micro_batches": 2}), ("ddp_one", {})):
        with _DdpReductions() as reduced:
            out[name] = run(par, data, Path(root) / name, placement, config={**NO_AUX, "grad_sync": "ddp", **extra})
        out[f"{name}_buckets"] = reduced.count
    for name, extra in (("overlap", {"micro_batches": 2}), ("overlap_paired", PAIRED)):
        with _BucketLaunches() as launched:
            out[name] = run(par, data, Path(root) / name, placement, config={**NO_AUX, "grad_sync": "overlap", **extra})
        out[f"{name}_launches"] = launched.count
    with _BucketLaunches() as launched:
        out["overlap_one"] = run(
            par, data, Path(root) / "overlap_one", placement, config={**NO_AUX, "grad_sync": "overlap"}
        )
    out["overlap_one_launches"] = launched.count
    with _FsdpSyncOff() as off:
        out["fsdp"] = run(
            par, data, Path(root) / "fsdp", placement, config={**NO_AUX, "grad_sync": "fsdp", "micro_batches": 2}
        )
    out["fsdp_off"] = off.count
    torch.manual_seed(0)
    model = shard_model(full_model(config(data), par), par, placement)
    with _Issuers() as issuers:
        result = train(
            model, data, train_config(**NO_AUX, **PAIRED), Path(root) / "paired", parallel=par, progress=False, log=None
        )
    out["paired"] = snapshot(model, result)
    out["issuers"] = issuers
    out["sync_free"] = all(m.sync_free for m in model.modules() if isinstance(m, OccultMoE))
    return out


def test_accumulated_micro_batches_train_as_one_process_in_turn_and_paired(tmp_path):
    data = load_tiny()
    want = one_process(data, train_config(**{**NO_AUX, "grad_sync": "ddp"}), tmp_path / "single")
    got = run_ranks(_micro_batch_rank, 2, data, str(tmp_path), timeout_s=300)
    for rank in got:
        for name in ("turn", "ddp", "fsdp", "overlap", "overlap_paired", "paired"):
            assert_matches(rank[name], want, RTOL, steps=STEPS)
        # the bucketed sync launched each bucket once a step, in turn and paired (the earlier backwards held)
        one = rank["overlap_one_launches"]
        assert rank["overlap_launches"] == rank["overlap_paired_launches"] == one > 0, (rank, one)
        # DDP reduced the sum once a step (`no_sync` around the first micro-batch), as many buckets as one batch;
        # FSDP2 held the first micro-batch's gradients back every step
        assert rank["ddp_buckets"] == rank["ddp_one_buckets"] > 0, (rank["ddp_buckets"], rank["ddp_one_buckets"])
        assert rank["fsdp_off"] == STEPS
        paired = [n for n in rank["issuers"] if n == "occult-1f1b-forward"]
        # steps x (the second micro-batch's forward) x layers x (dispatch, combine); evaluation: one batch, no thread
        assert len(paired) == STEPS * 1 * 2 * 2, len(paired)
        assert len(rank["issuers"]) > len(paired)  # the first micro-batch's forward and the evaluations: the caller's
        assert rank["sync_free"]


def test_one_micro_batch_in_turn_is_the_one_batch_step_bit_for_bit(tmp_path):
    """micro_batches=1 takes the one-batch path (the loop's own), so nothing differs at all."""
    data = load_tiny()
    want = one_process(data, train_config(**NO_AUX), tmp_path / "one")
    got = one_process(data, train_config(**NO_AUX, micro_batches=1), tmp_path / "also")
    assert got["losses"] == want["losses"]
    assert all((got["params"][n] == p).all() for n, p in want["params"].items())


def test_in_turn_in_one_process_matches_the_one_batch_step(tmp_path):
    data = load_tiny()
    want = one_process(data, train_config(**NO_AUX), tmp_path / "one")
    for k in (2, 4):
        got = one_process(data, train_config(**NO_AUX, micro_batches=k), tmp_path / f"k{k}")
        assert_matches(got, want, RTOL, steps=STEPS)


def _refusal_rank(rank: int, world_size: int, data, root: str, kw: dict) -> str:
    par = setup_parallel()
    torch.manual_seed(0)
    model = shard_model(full_model(config(data), par), par, None)
    try:
        train(model, data, train_config(**kw), Path(root) / "run", parallel=par, progress=False, log=None)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({**PAIRED, "grad_sync": "ddp"}, "DDP's hooks"),
        ({**PAIRED, "grad_sync": "fsdp"}, "FSDP2's hooks"),
        ({"micro_batches": 4, "grad_sync": "explicit"}, "multiple of 4 rows per rank"),
    ],
)
def test_refused_on_every_rank_before_any_step(tmp_path, kw, needle):
    got = run_ranks(_refusal_rank, 2, load_tiny(), str(tmp_path), kw, timeout_s=180)
    assert len(got) == 2 and all(needle in m for m in got), got
    assert not list(tmp_path.glob("**/*.safetensors"))


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"micro_batches": 3}, "multiple of 3 rows"),
        ({"micro_batches": 2, "two_batch": True}, "choose one"),
        ({**PAIRED, "layer_graphs": True}, "layer_graphs"),
        ({**PAIRED, "replace_every": 5}, "re-placement"),
        ({**PAIRED, "distill_weight": 0.5}, "distillation"),
    ],
)
def test_refused_in_one_process(tmp_path, kw, needle):
    data = load_tiny()
    model = OccultLM(config(data))
    with pytest.raises(ValueError, match=needle):
        train(model, data, train_config(**kw), tmp_path / "run", progress=False, log=None)
    assert not list((tmp_path / "run").glob("*.safetensors"))


@pytest.mark.parametrize("kw", [{"micro_batches": 0}, {"micro_batches": 1, "pair_micro_batches": True}])
def test_the_config_refuses_a_count_that_cannot_be(kw):
    with pytest.raises(ValueError, match="micro_batches must be"):
        TrainConfig(**kw)


@pytest.mark.parametrize(
    "argv, world, needle",
    [
        (["--micro-batches", "0"], "1", "give a count >= 1"),
        (["--pair-micro-batches"], "1", "--micro-batches 2 or more"),
        (["--micro-batches", "2", "--two-batch"], "1", "choose one"),
        (["--micro-batches", "3", "--batch-size", "4"], "1", "multiple of 3 rows per rank"),
        (
            ["--micro-batches", "2", "--pair-micro-batches", "--grad-sync", "ddp"],
            "2",
            "--grad-sync explicit or overlap",
        ),
        (
            ["--micro-batches", "2", "--pair-micro-batches", "--grad-sync", "fsdp"],
            "2",
            "--grad-sync explicit or overlap",
        ),
        (["--micro-batches", "2", "--pair-micro-batches", "--layer-graphs"], "1", "--layer-graphs"),
        (["--micro-batches", "2", "--pair-micro-batches", "--replace-every", "10"], "1", "--replace-every"),
    ],
)
def test_command_line_refusals_before_any_work(tmp_path, monkeypatch, argv, world, needle):
    from occult.cli import build_parser
    from occult.cli.registry import CommandError
    from occult.cli.run_checks import check_micro_batch_args

    monkeypatch.setenv("WORLD_SIZE", world)
    args = build_parser().parse_args(["train", "--out", str(tmp_path / "run"), "--batch-size", "4", *argv])
    with pytest.raises(CommandError, match=needle):
        check_micro_batch_args(args)
    assert not (tmp_path / "run").exists()
