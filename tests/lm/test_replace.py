"""Re-placing experts while training (occult.lm.migrate / replace / solve_job), 2 CPU gloo ranks.

One spawn of 2 ranks (`migrations`) checks `migrate` directly: the loss of a fixed batch before
and after a migration to a random other placement (and against one process); the weights and
AdamW state after it are those before it, keyed by global expert id, bit for bit; a training step
after it equals the same step without it; device-limited routing follows the new placement (==
one process routed on it); bad placements are clear errors on both ranks. A second spawn
(`trainings`) runs `train` with migrations forced every 3 steps (the solver replaced by a random
placement, so they surely happen), the same run stopped after a migration and resumed, and one
with the real solver inline; the parent compares with a single-process run without migrations
and resumes the 2-rank checkpoint in one process. A 4-rank run (2 EP groups x 2 replicas) checks
that the replicas migrate alike.
"""

from __future__ import annotations

import json
import shutil
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_helpers import PLACEMENT as P0
from _train_helpers import RTOL, config, train_config

from occult.distributed import run_ranks
from occult.lm.data import train_batch
from occult.lm.migrate import current_placement, migrate
from occult.lm.model import OccultLM
from occult.lm.parallel import full_model, gathered_tensors, global_mean, setup_parallel, shard_model, sync_gradients
from occult.lm.replace import LOG_FILE
from occult.lm.sharded import state_tensors
from occult.lm.solve_job import SolveJob, SolverProcess, relabel, solve_placement
from occult.lm.train import TrainConfig, make_optimizer, train, trainable_names
from occult.placement import Placement, PlacementError
from occult.placement.synthetic import planted_trace

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

P1 = [[0, 0, 1, 1, 1, 0, 0, 1], [1, 1, 0, 0, 1, 0, 1, 0]]


def cfg(**kw) -> TrainConfig:
    return train_config(**{"steps": 12, "eval_every": 6, "save_every": 6, "eval_tokens": 256, **kw})


FORCED = dict(replace_every=3, replace_wait=True, replace_check_every=1, replace_min_gain=0.0)


class RandomJob:
    """Stands in for the solver: a random placement other than the current one (seeded by it)."""

    def __init__(self, ids, num_experts, num_devices, current_LE, method="auto", seed=0, mode="inline", server=None):
        rng = np.random.default_rng(zlib.crc32(np.ascontiguousarray(current_LE).tobytes()))
        out = np.array(current_LE)
        for row in out:
            while True:
                new = rng.permutation(np.arange(num_experts) // (num_experts // num_devices))
                if not np.array_equal(new, row):
                    row[:] = new
                    break
        self.started = time.perf_counter()
        self.result = {"placement": out, "old_ct": np.array([2.0]), "new_ct": np.array([1.0]), "seconds": np.array(0.0)}

    def poll(self, block=False):
        return self.result

    def cancel(self):
        pass


class BrokenJob:
    def __init__(self, *args, **kw):
        raise MemoryError("the solver ran out of memory")


def _step(model, opt, x, y, par):
    opt.zero_grad(set_to_none=True)
    model(x, y, return_logits=False).loss.backward()
    sync_gradients(model, par)
    opt.step()


def _by_id(model, opt) -> dict[str, np.ndarray]:
    """This rank's weights and AdamW state, expert tensors keyed by global expert id."""
    return {k: v.detach().numpy().copy() for k, v in state_tensors(model, opt)[0].items()}


def migrate_worker(rank: int, world_size: int, data) -> dict:
    par = setup_parallel()
    x, y = train_batch(data.train, 4, 32, 0, 0, rank, world_size)
    torch.manual_seed(0)
    full = full_model(config(data), par)
    loss = lambda m: float(global_mean(m(x, y).loss.detach().reshape(1), par))  # noqa: E731
    out: dict = {}
    models = []
    for _ in range(3):  # A is migrated after one step, B never, C layer by layer (one all-to-all per layer)
        m = shard_model(full, par, Placement.from_lists(P0, 2))
        o = make_optimizer(m, trainable_names(m, False), cfg())
        _step(m, o, x, y, par)
        models.append((m, o))
    (a, opt_a), (b, opt_b), (c, opt_c) = models
    out["before"], out["state_before"] = loss(a), _by_id(a, opt_a)
    stats = migrate(a, opt_a, Placement.from_lists(P1, 2), par)
    out["after"], out["state_after"] = loss(a), _by_id(a, opt_a)
    migrate(c, opt_c, Placement.from_lists(P1, 2), par, bucket_bytes=1)
    out["state_layerwise"] = _by_id(c, opt_c)
    out["moved"], out["placement"] = stats.experts_moved, current_placement(a).expert_device_LE.tolist()
    out["local_ids"] = a.moe_layers()[0].local_expert_ids.tolist()
    held = {id(p) for g in opt_a.param_groups for p in g["params"]}
    out["same_params"] = held == {id(p) for p in a.parameters()} and all(
        id(p) in held for p, _ in a.expert_parameters().values()
    )
    _step(a, opt_a, x, y, par)
    _step(b, opt_b, x, y, par)
    out["stepped_a"], out["stepped_b"] = _by_id(a, opt_a), _by_id(b, opt_b)
    # Device-limited routing follows the placement.
    torch.manual_seed(1)  # larger weights: the loss visibly depends on which experts are allowed
    limited = full_model(config(data, init_std=0.3), par)
    limited.set_routing(1, Placement.from_lists(P0, 2))
    lim = shard_model(limited, par, Placement.from_lists(P0, 2))
    out["limited_before"] = loss(lim)
    migrate(lim, None, Placement.from_lists(P1, 2), par)
    out["limited_after"] = loss(lim)
    out["router_map"] = [r.expert_device_E.tolist() for r in lim.routers()]
    out["routing_placement"] = lim.routing.placement.expert_device_LE.tolist()
    errors, out["loss_before_errors"] = [], loss(a)
    for bad in (Placement.contiguous(4, 2), Placement.contiguous(8, 4), "not a placement"):
        try:
            migrate(a, opt_a, bad, par)
        except PlacementError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    out["loss_after_errors"] = loss(a)
    return out


def two_rank_worker(rank: int, world_size: int, data, root: str) -> dict:
    """The migrations, then the trainings, in one spawn (a 2-rank start-up each otherwise)."""
    return {
        "migrations": migrate_worker(rank, world_size, data),
        "trainings": train_worker(rank, world_size, data, root),
    }


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("replace")
    return {"root": root, "ranks": run_ranks(two_rank_worker, 2, data, str(root), timeout_s=300)}


@pytest.fixture(scope="module")
def migrations(two_ranks):
    return [out["migrations"] for out in two_ranks["ranks"]]


def test_fixed_batch_loss_and_state_unchanged_by_a_migration(migrations):
    for out in migrations:
        assert out["moved"] == int((np.array(P0) != np.array(P1)).sum()) == 10 and out["placement"] == P1
        assert out["before"] != 0 and abs(out["after"] - out["before"]) <= 1e-6 * abs(out["before"])
        assert out["same_params"]  # the optimizer still holds the model's parameters
    # Every tensor, by global expert id, is the same after the migration, bit for bit (union of both ranks).
    before = {**migrations[0]["state_before"], **migrations[1]["state_before"]}
    after = {**migrations[0]["state_after"], **migrations[1]["state_after"]}
    assert before.keys() == after.keys() and any(".exp_avg_sq.expert" in k for k in after)
    for k in before:
        assert np.array_equal(before[k], after[k]), k
        for out in migrations:
            if k in out["state_after"]:
                assert np.array_equal(out["state_layerwise"][k], out["state_after"][k]), k
    assert sorted(migrations[0]["local_ids"]) == [e for e, d in enumerate(P1[0]) if d == 0]
    # ... and the state is where the new placement says: rank 0 holds P1's rank-0 experts.
    assert {
        int(k.rsplit("expert", 1)[1]) for k in migrations[0]["state_after"] if "blocks.0.moe.moe.down_proj.expert" in k
    } == {e for e, d in enumerate(P1[0]) if d == 0}


def test_a_step_after_migration_equals_a_step_without(migrations):
    a = {**migrations[0]["stepped_a"], **migrations[1]["stepped_a"]}
    b = {**migrations[0]["stepped_b"], **migrations[1]["stepped_b"]}
    assert a.keys() == b.keys()
    for k in a:
        scale = max(np.abs(b[k]).max(), 1e-12)
        assert np.abs(a[k] - b[k]).max() <= RTOL * scale, k
    assert a["optim.blocks.1.moe.moe.gate_up_proj.step"] == 2.0


def test_device_limited_routing_follows_the_new_placement(migrations, data):
    torch.manual_seed(1)
    full = OccultLM(config(data, init_std=0.3))
    x, y = train_batch(data.train, 4, 32, 0, 0)
    want = {}
    for name, p in (("before", P0), ("after", P1)):
        full.set_routing(1, Placement.from_lists(p, 2))
        want[name] = float(full(x, y).loss.detach())
    assert abs(want["before"] - want["after"]) > 1e-3  # the rule really depends on the placement
    for out in migrations:
        assert out["router_map"] == P1 and out["routing_placement"] == P1
        for name in want:
            assert abs(out[f"limited_{name}"] - want[name]) <= 1e-5 * abs(want[name])


def test_bad_placements_are_clear_errors_on_every_rank(migrations):
    for out in migrations:
        msgs = out["errors"]
        assert len(msgs) == 3
        assert "for 4 experts, the model has 8" in msgs[0] and "4 devices, the EP group 2" in msgs[1]
        assert "expected an occult.Placement" in msgs[2]
        assert out["loss_after_errors"] == out["loss_before_errors"]  # nothing changed


# ------------------------------------------------------------------ training
def _result(model, result) -> dict:
    tensors = gathered_tensors(model)
    return {
        "losses": list(result.train_losses),
        "val": [h["val_loss"] for h in result.history],
        "params": {k: v.numpy() for k, v in tensors.items()},
        "migrations": result.migrations,
        "placement": current_placement(model).expert_device_LE.tolist(),
    }


def _train(par, data, out, seed=0, **kw):
    torch.manual_seed(seed)
    model = shard_model(full_model(config(data), par), par, Placement.from_lists(P0, 2))
    conf = cfg(**{**FORCED, **kw.pop("config", {})})
    return _result(model, train(model, data, conf, out, parallel=par, progress=False, log=None, **kw))


def train_worker(rank: int, world_size: int, data, root: str) -> dict:
    import occult.lm.replace as replace

    root_p = Path(root)
    par = setup_parallel()
    real = _train(par, data, root_p / "real", config=dict(replace_every=3, steps=6, eval_every=3))
    replace.SolveJob = BrokenJob  # a solve that cannot start: every rank is told, training goes on
    out_broken = _train(par, data, root_p / "broken", config=dict(steps=4, eval_every=4, save_every=4, replace_every=2))
    replace.SolveJob = RandomJob  # migrations now surely happen, every 3 steps
    out = {"real": real, "broken": out_broken, "forced": _train(par, data, root_p / "forced")}
    _train(par, data, root_p / "stop", stop_after=7)
    if rank == 0:
        shutil.copytree(root_p / "stop", root_p / "stop1")
    par.barrier()
    out["resumed"] = _train(par, data, root_p / "stop", seed=123, resume=True)
    return out


@pytest.fixture(scope="module")
def trainings(data, two_ranks):
    root = two_ranks["root"]
    torch.manual_seed(0)
    ref = OccultLM(config(data))
    single = _result(ref, train(ref, data, cfg(), root / "single", progress=False, log=None))
    ranks = [out["trainings"] for out in two_ranks["ranks"]]
    torch.manual_seed(5)
    back = OccultLM(config(data))
    one = _result(back, train(back, data, cfg(**FORCED), root / "stop1", resume=True, progress=False, log=None))
    return {"root": root, "single": single, "ranks": ranks, "one": one}


def _close(got: dict, want: dict, exact: bool = False) -> None:
    if exact:
        assert got["losses"] == want["losses"] and got["val"] == want["val"]
    else:
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL)
        np.testing.assert_allclose(got["val"], want["val"], rtol=RTOL)
    for k, q in want["params"].items():
        p = got["params"][k]
        if exact:
            assert np.array_equal(p, q), k
        else:
            assert np.abs(p - q).max() <= RTOL * np.abs(q).max(), k


def test_training_with_migrations_equals_one_process_without(trainings):
    single = trainings["single"]
    for out in trainings["ranks"]:
        forced = out["forced"]
        assert [m["step"] for m in forced["migrations"]] == [3, 6, 9, 12]
        assert forced["placement"] != P0
        _close(forced, single)


def test_resume_after_a_migration(trainings):
    """Stopped at 7 (after migrations at 3 and 6), resumed from other weights: == straight, bit for bit."""
    for out in trainings["ranks"]:
        _close(out["resumed"], out["forced"], exact=True)
        assert out["resumed"]["placement"] == out["forced"]["placement"]
        assert [m["step"] for m in out["resumed"]["migrations"]] == [3, 6, 9, 12]
    doc = json.loads((next((trainings["root"] / "stop1" / "checkpoint").glob("step-*")) / "occult.json").read_text())
    saved = json.loads(doc["replace"])
    assert saved["last_solve"] == 6 and saved["placement"]["layers"] == doc["expert_placement"] != P0
    _close(trainings["one"], trainings["single"])  # the 2-rank checkpoint after migrations, on 1 process


def test_real_solver_inline(trainings):
    events = [json.loads(line) for line in (trainings["root"] / "real" / LOG_FILE).read_text().splitlines()]
    measures = [e for e in events if e["event"] == "measure"]
    assert [e["step"] for e in measures] == list(range(1, 7))
    assert all(1.0 <= e["mean_ct"] <= 2.0 for e in measures)
    decisions = [e for e in events if e["event"] in ("migrate", "keep")]
    assert [e["step"] for e in decisions] == [3, 6]
    for e in decisions:
        assert e["new_ct"] <= e["old_ct"] or e["event"] == "keep"
        assert (e["event"] == "migrate") == (e["gain"] > 0)
    broken = [json.loads(line) for line in (trainings["root"] / "broken" / LOG_FILE).read_text().splitlines()]
    assert [(e["step"], e["error"]) for e in broken if e["event"] == "solver_failed"] == [
        (2, "the solver ran out of memory"),
        (4, "the solver ran out of memory"),
    ]
    assert all(len(out["broken"]["losses"]) == 4 and not out["broken"]["migrations"] for out in trainings["ranks"])
    real = [out["real"] for out in trainings["ranks"]]
    # the logged loss is one all-reduced value (global_mean): the same bits on every rank
    assert real[0]["placement"] == real[1]["placement"] and real[0]["losses"] == real[1]["losses"]
    assert len(real[0]["migrations"]) == sum(e["event"] == "migrate" for e in decisions)


def ep_dp_worker(rank: int, world_size: int, data, root: str) -> dict:
    import occult.lm.replace as replace

    replace.SolveJob = RandomJob
    par = setup_parallel(ep_size=2)  # 2 EP groups x 2 replicas: both groups migrate alike
    return _train(par, data, Path(root) / "epdp", config=dict(steps=6, eval_every=3, save_every=0, replace_every=2))


def test_ep_groups_times_replicas_migrate_alike(data, tmp_path):
    """4 ranks = 2 EP groups x 2 replicas, migrations at 2, 4, 6 == 1 process without, 6 steps."""
    torch.manual_seed(0)
    ref = OccultLM(config(data))
    single = _result(
        ref, train(ref, data, cfg(steps=6, eval_every=3, save_every=0), tmp_path / "single", progress=False, log=None)
    )
    outs = run_ranks(ep_dp_worker, 4, data, str(tmp_path), timeout_s=240)
    for out in outs:
        assert [m["step"] for m in out["migrations"]] == [2, 4, 6] and out["placement"] == outs[0]["placement"] != P0
        _close(out, single)


# ------------------------------------------------------------------ solver
def test_solve_in_a_background_process_equals_inline():
    trace = planted_trace(2000, 16, 4, num_groups=4, num_layers=2, seed=3)
    ids = np.stack(trace.trace.topk_ids)
    current = np.tile(np.arange(16) % 4, (2, 1))
    job = SolveJob(ids, 16, 4, current, "greedy", mode="process")
    bad = SolveJob(ids, 15, 4, current, "greedy", mode="process")  # both run while this process goes on
    inline = solve_placement(ids, 16, 4, current, "greedy")
    deadline = time.monotonic() + 120
    while (res := job.poll()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert np.array_equal(res["placement"], inline["placement"])
    assert (inline["new_ct"] < inline["old_ct"]).all()  # a planted trace on a round-robin layout
    Placement(res["placement"], 4)  # balanced
    with pytest.raises(RuntimeError, match="solver failed.*cannot be split evenly"):
        bad.poll(block=True)
    server = SolverProcess()  # one long-lived process, two solves in a row
    try:
        for _ in range(2):
            again = SolveJob(ids, 16, 4, current, "greedy", mode="process", server=server).poll(block=True)
            assert np.array_equal(again["placement"], inline["placement"])
    finally:
        server.close()
    assert server.proc.poll() is not None and not server.dir.exists()


def test_relabel_keeps_experts_in_place():
    old = np.array([0, 0, 1, 1, 2, 2])
    assert relabel(np.array([2, 2, 0, 0, 1, 1]), old, 3).tolist() == old.tolist()
    new = np.array([1, 1, 2, 0, 0, 2])
    got = relabel(new, old, 3)
    assert (got == old).sum() == 4 and got.tolist() == [0, 0, 2, 1, 1, 2]  # the same partition, relabelled


def test_train_config_checks_and_cli():
    with pytest.raises(ValueError, match="replace_min_gain"):
        TrainConfig(replace_min_gain=1.5)
    with pytest.raises(ValueError, match="replace_method"):
        TrainConfig(replace_method="magic")
    assert not TrainConfig().replaces and TrainConfig(replace_drift=0.1).replaces
    from occult.cli import build_parser
    from occult.cli.lm import _train_config

    args = build_parser(chosen="train").parse_args(
        [
            "train",
            "--out",
            "x",
            "--replace-every",
            "50",
            "--replace-min-gain",
            "0.05",
            "--replace-drift",
            "0.1",
            "--replace-wait",
        ]
    )
    c = _train_config(args)
    from occult.cli import lm as C

    t = TrainConfig()
    assert (C.REPLACE_MIN_GAIN, C.REPLACE_CHECK, C.REPLACE_SAMPLES) == (
        t.replace_min_gain,
        t.replace_check_every,
        t.replace_samples,
    )
    assert (c.replace_every, c.replace_min_gain, c.replace_drift, c.replace_wait) == (50, 0.05, 0.1, True)
