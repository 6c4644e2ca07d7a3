"""OccultLM on N ranks (gloo, CPU): exactness against one process, sharded checkpoints, resharding, failures.

Every multi-rank run here averages the replicated gradients with torch DDP (`grad_sync="ddp"`, the
default); tests/lm/test_ddp.py compares it with the explicit all-reduce.
One spawn of 2 ranks (`two_ranks`, module scope) runs every multi-rank training the tests check:
    A  20 steps, experts over both ranks by a non-contiguous placement (checkpoint at step 10, 20)
    B  the same run stopped at 10, copied to C, then resumed to 20 from a model of other weights
    D  a 1-process checkpoint at step 10 (written by the parent) resumed on 2 ranks
    E  20 steps with the experts replicated on both ranks (EP size 1: EP x DP with 2 replicas)
The parent trains the single-process reference and resumes C (a 2-rank checkpoint) in 1 process.

Tolerance: the runs use AdamW with eps=1e-6. With the default eps=1e-8, a weight whose gradient is
near 1e-8 gets an update of about lr * g / (|g| + eps), so the last-bit differences of summing a
batch in two halves (true of any data parallelism) are amplified to ~1e-4 relative in a few such
weights; losses still agree to ~2e-7 (docs/training.md).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_helpers import MODEL, PLACEMENT, RTOL, TINY, config, one_process, snapshot
from _train_helpers import run as _run
from _train_helpers import train_config as cfg

from occult.distributed import RankFailure, run_ranks
from occult.lm.checkpoint import CheckpointError, load_model
from occult.lm.model import OccultLM
from occult.lm.parallel import full_model, setup_parallel, shard_model
from occult.lm.sharded import DCP_DIR, LATEST, find_sharded, load_sharded, read_sharded_meta, save_sharded
from occult.lm.train import FINAL, PLOT, make_optimizer, train, trainable_names
from occult.placement import Placement

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def two_rank_worker(rank: int, world_size: int, data, root: str) -> dict:
    root_p = Path(root)
    par = setup_parallel()
    placement = Placement.from_lists(PLACEMENT, 2)
    out = {"A": _run(par, data, root_p / "A", placement)}
    _run(par, data, root_p / "B", placement, stop_after=10)
    if rank == 0:
        shutil.copytree(root_p / "B", root_p / "C")
    par.barrier()
    out["B"] = _run(par, data, root_p / "B", placement, seed=123, resume=True)
    out["D"] = _run(par, data, root_p / "D", placement, seed=123, resume=True)
    out["E"] = _run(setup_parallel(ep_size=1), data, root_p / "E")
    out["files"] = sorted(os.listdir(root_p / "A"))
    return out


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """The single-process reference, the 2-rank runs, and C resumed in one process."""
    root = tmp_path_factory.mktemp("parallel")
    single = one_process(data, cfg(), root / "single")
    torch.manual_seed(0)
    train(OccultLM(config(data)), data, cfg(), root / "D", stop_after=10, progress=False, log=None)
    start = time.monotonic()
    ranks = run_ranks(two_rank_worker, 2, data, str(root), timeout_s=240)
    elapsed = time.monotonic() - start
    c = one_process(data, cfg(), root / "C", seed=7, resume=True)
    return {"root": root, "single": single, "ranks": ranks, "C": c, "elapsed": elapsed}


def assert_matches(got: dict, want: dict, exact: bool = False, steps: int = 20) -> None:
    """Losses per step, validation losses, and every parameter this rank holds."""
    assert len(got["losses"]) == len(want["losses"]) == steps
    if exact:
        assert got["losses"] == want["losses"] and got["val"] == want["val"]
    else:
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL)
        np.testing.assert_allclose(got["val"], want["val"], rtol=RTOL)
    for name, p in got["params"].items():
        q = want["params"][name]
        if name in got["ids"] and not np.array_equal(got["ids"][name], want["ids"][name]):
            assert len(want["ids"][name]) == MODEL["num_experts"]  # the single process holds every expert
            q = q[got["ids"][name]]
        if exact:
            assert np.array_equal(p, q), name
        else:
            err = np.abs(p - q).max() / np.abs(q).max()
            assert err <= RTOL, f"{name}: max |diff| / max |weight| = {err:.2e}"


def test_two_ranks_equal_one_process(runs):
    """The acceptance test: 2 ranks (experts sharded non-contiguously; or replicated) == 1 process, 20 steps."""
    single = runs["single"]
    for r, out in enumerate(runs["ranks"]):
        ids = out["A"]["ids"]["blocks.0.moe.moe.gate_up_proj"]
        assert sorted(ids) == [i for i, d in enumerate(PLACEMENT[0]) if d == r]
        assert_matches(out["A"], single)
        assert_matches(out["E"], single)
        assert len(out["E"]["ids"]["blocks.1.moe.moe.down_proj"]) == 8  # ep_size 1: every expert on each rank
    # The weights file of the 2-rank run holds every expert in expert-id order.
    full = load_model(runs["root"] / "A" / FINAL)
    for name, p in full.named_parameters():
        q = single["params"][name]
        assert np.abs(p.detach().numpy() - q).max() <= RTOL * np.abs(q).max(), name
    assert {FINAL, PLOT, DCP_DIR, "metrics.jsonl", "best.safetensors"} <= set(runs["ranks"][0]["files"])
    print(f"2-rank runs (5 trainings, 70 steps) took {runs['elapsed']:.1f} s")


def ep_dp_worker(rank: int, world_size: int, data, root: str) -> dict:
    par = setup_parallel(ep_size=2)
    assert (par.ep_rank, par.replicas) == (rank % 2, 2)
    return {
        sync: _run(
            par,
            data,
            Path(root) / f"F-{sync}",
            Placement.from_lists(PLACEMENT, 2),
            config=dict(steps=10, eval_every=5, grad_sync=sync),
        )
        for sync in ("ddp", "explicit")
    }


def four_rank_worker(rank: int, world_size: int, data, root: str) -> dict:
    """Both 4-rank checks in one spawn (a start-up of 4 ranks each otherwise)."""
    return {
        "ep_dp": ep_dp_worker(rank, world_size, data, root),
        "dedup2": two_level_worker(rank, world_size, data, root),
    }


@pytest.fixture(scope="module")
def four_ranks(data, tmp_path_factory) -> dict:
    """The 4-rank runs and their one-process reference (10 steps), shared by the two tests below."""
    root = tmp_path_factory.mktemp("four")
    single = one_process(data, cfg(steps=10, eval_every=5), root / "single")
    return {"single": single, "ranks": run_ranks(four_rank_worker, 4, data, str(root), timeout_s=300)}


def test_ep_groups_times_data_parallel_replicas(four_ranks):
    """4 ranks = 2 EP groups of 2 (experts sharded in each) x 2 replicas == 1 process, 10 steps (DDP and explicit)."""
    single = four_ranks["single"]
    for rank, runs in enumerate(out["ep_dp"] for out in four_ranks["ranks"]):
        out = runs["ddp"]
        assert sorted(out["ids"]["blocks.1.moe.moe.gate_up_proj"]) == [
            i for i, d in enumerate(PLACEMENT[1]) if d == rank % 2
        ]
        assert_matches(out, single, steps=10)
        assert_matches(runs["explicit"], single, steps=10)
        np.testing.assert_allclose(
            out["losses"], runs["explicit"]["losses"], rtol=2e-6
        )  # DDP == explicit: 3e-7 measured
        for name, p in out["params"].items():
            q = runs["explicit"]["params"][name]
            assert np.abs(p - q).max() <= 2e-6 * np.abs(q).max(), name


PLACEMENT_4 = [[3, 0, 1, 2, 2, 0, 1, 3], [0, 1, 2, 3, 3, 2, 1, 0]]  # 4 ranks = 2 nodes of 2


def two_level_worker(rank: int, world_size: int, data, root: str) -> dict:
    from occult.moe.two_level import TwoLevelDispatcher

    par = setup_parallel()
    torch.manual_seed(0)
    placement = Placement(np.array(PLACEMENT_4), 4, num_nodes=2)
    model = shard_model(full_model(config(data), par), par, placement, "dedup2")
    layers = list(model.moe_layers())
    assert all(isinstance(m.dispatcher, TwoLevelDispatcher) and m.dispatcher.num_nodes == 2 for m in layers)
    result = train(
        model, data, cfg(steps=10, eval_every=5), Path(root) / "dedup2", parallel=par, progress=False, log=None
    )
    return snapshot(model, result)


def test_two_level_dispatcher_trains_like_one_process(four_ranks):
    """`occult train --dispatcher dedup2`: 4 ranks as 2 nodes x 2, non-contiguous placement == 1 process, 10 steps."""
    single = four_ranks["single"]
    for rank, out in enumerate(out["dedup2"] for out in four_ranks["ranks"]):
        assert sorted(out["ids"]["blocks.0.moe.moe.gate_up_proj"]) == [
            i for i, d in enumerate(PLACEMENT_4[0]) if d == rank
        ]
        assert_matches(out, single, steps=10)


def test_two_level_cli_arguments_are_checked():
    """--dispatcher dedup2 gets its nodes from --nodes or the placement; contradictions are clear errors."""
    from argparse import Namespace
    from types import SimpleNamespace

    from occult.cli.lm import ep_placement_from_args

    par = SimpleNamespace(ep_size=4)
    args = dict(ep_placement=None, placement=None, dispatcher="dedup2", nodes=2, replace_every=0, replace_drift=0.0)
    got = ep_placement_from_args(Namespace(**args), par, 8)
    assert got.num_nodes == 2 and got.num_devices == 4 and list(got.expert_device(0)) == [0, 0, 1, 1, 2, 2, 3, 3]
    placed = Placement(np.array(PLACEMENT_4), 4, num_nodes=2)
    assert ep_placement_from_args(Namespace(**{**args, "nodes": None}), par, 8, placed) is placed
    flat = Placement(np.array(PLACEMENT_4), 4)
    assert ep_placement_from_args(Namespace(**args), par, 8, flat).num_nodes == 2
    for bad, match in [
        (dict(nodes=None), "needs the ranks' nodes"),
        (dict(nodes=3), "must be >= 2 and divide"),
        (dict(nodes=1), "must be >= 2"),
        (dict(replace_every=10), "does not support"),
        (dict(dispatcher="dedup"), "applies to --dispatcher dedup2 only"),
    ]:
        with pytest.raises(ValueError, match=match):
            ep_placement_from_args(Namespace(**{**args, **bad}), par, 8)
    with pytest.raises(ValueError, match="has 2 nodes"):
        ep_placement_from_args(Namespace(**{**args, "nodes": 4}), SimpleNamespace(ep_size=4), 8, placed)
    with pytest.raises(ValueError, match="needs several ranks"):
        ep_placement_from_args(Namespace(**args), None, 8)


def test_resume_and_reshard(runs):
    """10 steps + save + resume 10 == 20 straight (bit for bit on 2 ranks); 2 -> 1 and 1 -> 2 ranks."""
    for out in runs["ranks"]:
        assert_matches(out["B"], out["A"], exact=True)
        assert_matches(out["D"], runs["single"])  # 1 -> 2 ranks
    assert_matches(runs["C"], runs["single"])  # 2 -> 1 rank
    c = runs["root"] / "C"
    assert (c / FINAL).exists() and (c / "checkpoint.safetensors").exists()
    latest = find_sharded(runs["root"] / "A")
    assert latest.name == "step-00000020" and [
        p.name for p in latest.parent.iterdir() if p.name.startswith("step")
    ] == [latest.name]


def test_bad_checkpoints_are_clear_errors(runs, data, tmp_path):
    src = runs["root"] / "A"
    run = tmp_path / "run"
    shutil.copytree(src, run)
    (run / "model.safetensors").unlink()

    def resume(model_cfg=None, **kw):
        torch.manual_seed(0)
        model = OccultLM(model_cfg or config(data))
        return train(model, data, cfg(**kw), run, resume=True, progress=False, log=None)

    with pytest.raises(CheckpointError, match="pass --resume"):
        train(OccultLM(config(data)), data, cfg(), run, progress=False, log=None)
    with pytest.raises(CheckpointError, match="model config mismatch.*num_experts"):
        resume(config(data, num_experts=4))
    with pytest.raises(CheckpointError, match="training config mismatch.*lr"):
        resume(lr=1e-3)
    step_dir = find_sharded(run)
    shard = step_dir / "__1_0.distcp"
    blob = shard.read_bytes()
    shard.write_bytes(blob[:-50])
    with pytest.raises(CheckpointError, match="__1_0.distcp is truncated or corrupted"):
        resume()
    shard.write_bytes(blob)
    (step_dir / "occult.json").rename(step_dir / "gone.json")
    with pytest.raises(CheckpointError, match="not a complete occult checkpoint"):
        resume()
    (step_dir / "gone.json").rename(step_dir / "occult.json")
    (run / DCP_DIR / LATEST).write_text("step-00000099\n")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        resume()
    (run / DCP_DIR / LATEST).write_text(step_dir.name + "\n")
    assert resume().step == 20 and (run / FINAL).exists()  # intact again: loads, and the run ends


def test_crash_while_saving_keeps_the_previous_checkpoint(data, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = OccultLM(config(data))
    opt = make_optimizer(model, trainable_names(model, False), cfg())
    model(torch.randint(0, data.vocab_size, (2, 8)), torch.randint(0, data.vocab_size, (2, 8))).loss.backward()
    opt.step()
    meta = {"model_config": "{}", "step": "1"}
    first = save_sharded(tmp_path, model, opt, meta, step=1)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    real_save = dcp.save

    def dying_save(state, checkpoint_id, **kw):
        real_save(dict(list(state.items())[:3]), checkpoint_id=checkpoint_id, **kw)
        raise OSError("disk full")

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        save_sharded(tmp_path, model, opt, {**meta, "step": "2"}, step=2)
    assert find_sharded(tmp_path) == first
    doc = read_sharded_meta(first)
    assert doc["step"] == "1" and doc["world_size"] == 1
    load_sharded(first, doc, model, opt)
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
    monkeypatch.setattr(dcp, "save", real_save)
    second = save_sharded(tmp_path, model, opt, {**meta, "step": "2"}, step=2)  # clears the partial one
    assert find_sharded(tmp_path) == second and not first.exists()
    assert sorted(p.name for p in (tmp_path / DCP_DIR).iterdir()) == [LATEST, second.name]


def dying_rank_worker(rank: int, world_size: int, data, out: str) -> str:
    import occult.lm.train as T

    real = T.train_batch

    def batch(*args):
        if rank == 1 and args[4] == 3:
            os._exit(0)  # dies without a word at step 3
        return real(*args)

    T.train_batch = batch
    par = setup_parallel()
    torch.manual_seed(0)
    model = shard_model(full_model(config(data), par), par)
    train(model, data, cfg(eval_every=0, save_every=0), out, parallel=par, progress=False, log=None)
    return "finished"


def test_a_dying_rank_ends_the_others(data, tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(dying_rank_worker, 2, data, str(tmp_path), timeout_s=90, collective_timeout_s=10)
    message = str(info.value)
    assert "rank 1 died" in message
    assert "--- rank 0 ---" in message and "did not finish" not in message, message
    assert time.monotonic() - start < 60


def test_torchrun_cli_then_one_process(tmp_path, capsys):
    """`torchrun --nproc-per-node 2 -m occult train` (stopped early), resumed by `occult train` in one process."""
    pytest.importorskip("tokenizers")
    import subprocess
    import sys

    from occult.cli import main

    d = str(tmp_path / "data")
    assert main(["data", "prepare", "--out", d, "--corpus-dir", str(TINY), "--vocab-size", "300"]) == 0
    Placement.from_lists(PLACEMENT, 2).save(tmp_path / "p2.json")
    args = [
        "train",
        "--corpus-dir",
        d,
        "--out",
        str(tmp_path / "run"),
        "--hidden",
        "32",
        "--layers",
        "2",
        "--heads",
        "2",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--expert-ffn",
        "16",
        "--steps",
        "4",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--eval-every",
        "2",
        "--eval-tokens",
        "256",
        "--device",
        "cpu",
        "--no-progress",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "occult",
            *args,
            "--ep-placement",
            str(tmp_path / "p2.json"),
            "--stop-after",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "2 ranks: experts over 2 (dedup), 1 data-parallel replica(s); 2 of 4 rows per rank" in proc.stdout
    assert proc.stdout.count("model: ") == 1  # rank 0 alone prints
    assert find_sharded(tmp_path / "run").name == "step-00000002"
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0  # 2 ranks -> 1 process
    out = capsys.readouterr().out
    assert "step 4: val loss" in out and (tmp_path / "run" / PLOT).exists()
    assert load_model(tmp_path / "run" / FINAL).config.num_experts == 8
    assert main([*args[:-1], "--ep-size", "2"]) == 2  # a single process cannot shard over 2 ranks
    assert "needs that many ranks" in capsys.readouterr().err
