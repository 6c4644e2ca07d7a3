"""Resuming `occult train`: checkpoints written by older code, more `--steps` on resume (the
learning-rate schedule extended), and the step a stopped run's report names."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from occult.lm.train import CHECKPOINT, FINAL, TrainConfig, lr_at, train
from occult.training.schedule import CosineSchedule

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

OLD = Path(__file__).resolve().parents[1] / "data" / "old_checkpoints"
TINY = Path(__file__).resolve().parents[1] / "data" / "shakespeare_tiny"


def _maker():
    """tests/data/old_checkpoints/make.py: the data, model and settings the fixtures were written with."""
    spec = importlib.util.spec_from_file_location("old_checkpoints_make", OLD / "make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("run", ["lm_one", "lm_two"])
def test_checkpoints_of_the_old_code_resume(run, tmp_path):
    """A one-process (safetensors) and a 2-rank (DCP) checkpoint written at step 4 of 8 by the code
    before `occult.training` resume in one process and continue as the old code did uninterrupted."""
    make = _maker()
    shutil.copytree(OLD / run, tmp_path / run)
    want = json.loads((OLD / "reference.json").read_text())["lm_straight"]
    res = train(
        make.lm_model(),
        make.lm_data(),
        TrainConfig(**make.LM_TRAIN),
        tmp_path / run,
        resume=True,
        progress=False,
        log=None,
        plot=False,
    )
    assert res.step == 8 and len(res.train_losses) == 8 and (tmp_path / run / FINAL).exists()
    torch.testing.assert_close(torch.tensor(res.train_losses[:4]), torch.tensor(want[:4]), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(res.train_losses[4:]), torch.tensor(want[4:]), rtol=1e-5, atol=0)
    assert [h["step"] for h in res.history] == [4, 8]


def test_schedule_extension_keeps_the_rate_and_decays_to_the_new_end():
    base = CosineSchedule(lr=1.0, warmup_steps=10, steps=100, min_lr_ratio=0.1)
    assert [base(s) for s in range(0, 101, 10)] == [
        lr_at(s, TrainConfig(steps=100, lr=1.0, warmup_steps=10)) for s in range(0, 101, 10)
    ]
    longer = base.extended(60, 200)
    assert longer.restarts == ((60, base(60), 200),) and longer.total == 200
    assert all(longer(s) == base(s) for s in range(61))  # the steps done are unchanged
    assert longer(200) == pytest.approx(0.1) and longer(130) == pytest.approx((base(60) + 0.1) / 2)
    assert all(longer(s) >= longer(s + 1) for s in range(60, 200))
    assert base.extended(5, 200) == CosineSchedule(1.0, 10, 200, 0.1)  # inside the warm-up: nothing decayed yet
    again = longer.extended(150, 300)  # a second extension keeps the first
    assert [r[0] for r in again.restarts] == [60, 150] and all(again(s) == longer(s) for s in range(151))
    back = CosineSchedule(1.0, 10, 300, 0.1).resumed(again.to_json(), 300, 150)  # as a checkpoint rebuilds it
    assert back == again and CosineSchedule(1.0, 10, 200, 0.1).resumed(None, 100, 60) == longer
    finished = base.extended(100, 150)  # a finished run continued: at the floor
    assert all(finished(s) == pytest.approx(0.1) for s in range(100, 151))
    assert base.extended(60, 100) is base


def test_resume_with_more_steps_continues_the_run(data, tmp_path):
    """`steps` 12 on a checkpoint of an 8-step run at step 5: the run goes on to 12, the schedule extended
    (kept in the checkpoint: stopping and resuming again gives the same weights as going straight on)."""
    from _train_helpers import config

    from occult.lm.model import OccultLM

    def model():
        torch.manual_seed(0)
        return OccultLM(config(data))

    c = dict(
        steps=8,
        batch_size=4,
        seq_len=32,
        lr=3e-3,
        warmup_steps=2,
        eval_every=4,
        save_every=4,
        eval_tokens=256,
        device="cpu",
    )
    first = train(model(), data, TrainConfig(**c), tmp_path / "a", stop_after=5, progress=False, log=None, plot=False)
    assert first.step == 5
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    longer = TrainConfig(**{**c, "steps": 12})
    logs: list[str] = []
    straight_model = model()
    straight = train(
        straight_model, data, longer, tmp_path / "a", resume=True, progress=False, log=logs.append, plot=False
    )
    assert straight.step == 12 and len(straight.train_losses) == 12 and (tmp_path / "a" / FINAL).exists()
    assert straight.train_losses[:5] == first.train_losses
    old_lr = lr_at(5, TrainConfig(**c))
    assert any(f"continuing from step 5 at learning rate {old_lr:.3g}" in line for line in logs), logs
    part = train(model(), data, longer, tmp_path / "b", resume=True, stop_after=3, progress=False, log=None, plot=False)
    assert part.step == 8 and not (tmp_path / "b" / FINAL).exists()
    resumed_model = model()
    resumed = train(resumed_model, data, longer, tmp_path / "b", resume=True, progress=False, log=None, plot=False)
    assert resumed.train_losses == straight.train_losses
    for (n, p), (_, q) in zip(straight_model.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(Exception, match="at step 12, past --steps 10; pass --steps 12 or more"):
        train(model(), data, TrainConfig(**{**c, "steps": 10}), tmp_path / "b", resume=True, progress=False, log=None)
    assert (tmp_path / "b" / CHECKPOINT).exists()


def test_cli_resume_with_more_steps_and_the_stopped_runs_report(tmp_path, capsys):
    """Through the real entry point: `--stop-after 3 --eval-every 2` reports the step-2 evaluation as
    step 2 (not 3), and `--resume --steps 6` on a 4-step run continues it."""
    pytest.importorskip("tokenizers")
    from occult.cli import main

    d = str(tmp_path / "data")
    assert main(["data", "prepare", "--out", d, "--corpus-dir", str(TINY), "--vocab-size", "300"]) == 0
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
    capsys.readouterr()
    assert main([*args, "--steps", "4", "--stop-after", "3"]) == 0
    out = capsys.readouterr().out
    assert "step 2: val loss" in out and "step 3: val loss" not in out, out
    assert "stopped at step 3 of 4" in out, out
    assert main([*args, "--steps", "4", "--resume"]) == 0
    assert "step 4: val loss" in capsys.readouterr().out
    assert main([*args, "--steps", "6", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed" in out and "step 6: val loss" in out, out
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4, 6]
