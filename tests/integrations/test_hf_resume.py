"""Resuming `hf.finetune` from its sharded checkpoints (`occult.integrations.hf.checkpoint`).

One spawn of 2 gloo ranks (tiny OLMoE, experts over both ranks by a non-contiguous placement,
routing pruned to 1 of 2 devices, fp32, 12 steps):
    straight     12 steps, a checkpoint every 4
    interrupted  a checkpoint every 5, both ranks crash in the 8th forward (step 7), a fresh
                 model resumes from step 5: the same losses and weights as straight, bit for bit
The parent resumes the 2-rank step-5 checkpoint in one process (== a one-process run, to 1e-5),
checks that a save crashing half-way leaves the previous checkpoint in use, that a corrupt or
incomplete checkpoint, one of another model, expert count, settings or data, or an existing
checkpoint without `resume` is a clear error, and `occult finetune --hf --stop-after/--resume`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from _hf_helpers import trained_weights as _trained  # noqa: E402  (tests/integrations)

from occult.distributed import run_ranks  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.integrations.hf import checkpoint as ckpt  # noqa: E402
from occult.placement import Placement  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

VOCAB = 96
PLACEMENT = [[1, 0, 0, 1, 0, 1, 1, 0], [0, 1, 1, 0, 1, 0, 0, 1]]
CFG = dict(steps=12, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=2, adam_eps=1e-6, seed=3, precision="fp32")


def _placement() -> Placement:
    return Placement(np.array(PLACEMENT), 2)


def _tokens() -> torch.Tensor:
    return torch.randint(3, VOCAB, (3000,), generator=torch.Generator().manual_seed(11))


def _load(path: str, groups=None):
    if groups is None:
        return hf.load_sharded(path, routing_placement=_placement(), max_devices=1)
    return hf.load_sharded(path, group=groups.ep, placement=_placement(), max_devices=1)


def _crash_at(model, forward: int) -> None:
    calls = []

    def hook(*_):
        calls.append(1)
        if len(calls) == forward:
            raise RuntimeError("simulated crash")

    model.model.embed_tokens.register_forward_pre_hook(hook)


def two_ranks(rank: int, world_size: int, path: str, root: str) -> dict:
    groups = hf.setup_groups()
    cfg = hf.FinetuneConfig(**CFG)
    model = _load(path, groups)
    straight = hf.finetune(
        model, _tokens(), cfg, groups, progress=False, log=None, checkpoint_dir=f"{root}/straight", save_every=4
    )
    out = {"straight": {"losses": straight.losses, "params": _trained(model)}}
    model = _load(path, groups)
    _crash_at(model, 8)
    try:
        hf.finetune(
            model, _tokens(), cfg, groups, progress=False, log=None, checkpoint_dir=f"{root}/crash", save_every=5
        )
        out["crashed"] = "no"
    except RuntimeError as exc:
        out["crashed"] = str(exc)
    out["latest"] = (Path(root) / "crash" / "checkpoint" / "latest").read_text().strip()
    if rank == 0:
        shutil.copytree(f"{root}/crash", f"{root}/crash1")  # for the one-process resume
    torch.distributed.barrier()
    torch.manual_seed(100 + rank)  # the RNG state comes from the checkpoint
    model = _load(path, groups)
    resumed = hf.finetune(
        model,
        _tokens(),
        cfg,
        groups,
        progress=False,
        log=None,
        checkpoint_dir=f"{root}/crash",
        save_every=5,
        resume=True,
    )
    out["resumed"] = {"losses": resumed.losses, "params": _trained(model)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_resume")
    path = str(root / "olmoe")
    hf.tiny_random_model("olmoe", path, seed=1, vocab_size=VOCAB)
    ranks = run_ranks(two_ranks, 2, path, str(root), timeout_s=300, collective_timeout_s=120)
    model = _load(path)
    one = hf.finetune(model, _tokens(), hf.FinetuneConfig(**CFG), progress=False, log=None)
    single = {"losses": one.losses, "params": _trained(model)}
    model = _load(path)
    back = hf.finetune(
        model,
        _tokens(),
        hf.FinetuneConfig(**CFG),
        progress=False,
        log=None,
        checkpoint_dir=root / "crash1",
        resume=True,
    )
    return {
        "root": root,
        "path": path,
        "ranks": ranks,
        "single": single,
        "one_from_two": {"losses": back.losses, "params": _trained(model)},
    }


def _assert_same(got: dict, want: dict, rtol: float) -> None:
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=rtol, atol=0)
    assert got["params"].keys() == want["params"].keys()
    for key, q in want["params"].items():
        err = np.abs(got["params"][key] - q).max() / np.abs(q).max()
        assert err <= rtol, f"{key}: max |diff| / max |weight| = {err:.2e}"


def test_interrupted_run_resumed_equals_straight(runs):
    for res in runs["ranks"]:
        assert res["crashed"] == "simulated crash" and res["latest"] == "step-00000005"
        assert len(res["resumed"]["losses"]) == CFG["steps"]
        _assert_same(res["resumed"], res["straight"], 0.0)  # bit for bit
        _assert_same(res["straight"], runs["single"], 1e-5)  # and both are the one-process run
    assert sorted(os.listdir(runs["root"] / "crash" / "checkpoint")) == [
        "latest",
        "step-00000012",
    ]  # older ones removed


def test_one_process_resumes_a_two_rank_checkpoint(runs):
    _assert_same(runs["one_from_two"], runs["single"], 1e-5)


def test_a_save_crashing_half_way_leaves_the_previous_checkpoint(runs, tmp_path, monkeypatch):
    cfg = hf.FinetuneConfig(**{**CFG, "steps": 4})
    model = _load(runs["path"])
    real = os.replace

    def crash(src, dst):
        if Path(dst).name == "step-00000004":
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        hf.finetune(model, _tokens(), cfg, progress=False, log=None, checkpoint_dir=tmp_path, save_every=2)
    monkeypatch.undo()
    assert ckpt.find_state(tmp_path).name == "step-00000002" and (tmp_path / "checkpoint" / ".partial").is_dir()
    model = _load(runs["path"])
    res = hf.finetune(model, _tokens(), cfg, progress=False, log=None, checkpoint_dir=tmp_path, resume=True)
    np.testing.assert_array_equal(res.losses, runs["single"]["losses"][:4])


def test_bad_checkpoints_are_clear_errors(runs, tmp_path):
    cfg = hf.FinetuneConfig(**CFG)
    src = runs["root"] / "straight"

    def resume(model_dir=runs["path"], run=src, model=None, tokens=None, **kw):
        model = model or _load(model_dir)
        c = hf.FinetuneConfig(**{**CFG, **kw})
        return hf.finetune(
            model, _tokens() if tokens is None else tokens, c, progress=False, log=None, checkpoint_dir=run, resume=True
        )

    with pytest.raises(ckpt.FinetuneCheckpointError, match="already holds a checkpoint"):
        hf.finetune(_load(runs["path"]), _tokens(), cfg, progress=False, log=None, checkpoint_dir=src)
    hf.tiny_random_model("olmoe", str(tmp_path / "olmoe16"), seed=1, vocab_size=VOCAB, num_experts=16)
    sixteen = hf.load_sharded(str(tmp_path / "olmoe16"))
    with pytest.raises(ckpt.FinetuneCheckpointError, match=r"has \[8, 8\] experts per MoE layer, the model \[16, 16\]"):
        resume(model=sixteen)
    hf.tiny_random_model("qwen3_moe", str(tmp_path / "qwen"), seed=1, vocab_size=VOCAB)
    with pytest.raises(ckpt.FinetuneCheckpointError, match="is of a 'olmoe' model, this is 'qwen3_moe'"):
        resume(model=hf.load_sharded(str(tmp_path / "qwen"), routing_placement=_placement(), max_devices=1))
    hf.tiny_random_model("olmoe", str(tmp_path / "other"), seed=2, vocab_size=VOCAB)
    with pytest.raises(ckpt.FinetuneCheckpointError, match="frozen weights"):
        resume(model_dir=str(tmp_path / "other"))
    with pytest.raises(ckpt.FinetuneCheckpointError, match="routing rule"):
        resume(model=hf.load_sharded(runs["path"]))  # no pruning
    with pytest.raises(
        ckpt.FinetuneCheckpointError, match=r"training settings differ \(lr: checkpoint 0.01, now 0.02\)"
    ):
        resume(lr=2e-2)
    with pytest.raises(ckpt.FinetuneCheckpointError, match="training data"):
        resume(tokens=_tokens().flip(0))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(src, corrupt)
    step = ckpt.find_state(corrupt)
    shard = sorted(step.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.FinetuneCheckpointError, match="truncated or corrupted"):
        resume(run=corrupt)
    (step / "occult.json").unlink()
    with pytest.raises(ckpt.FinetuneCheckpointError, match="not a complete checkpoint"):
        resume(run=corrupt)
    (corrupt / "checkpoint" / "latest").write_text("step-99999999\n")
    with pytest.raises(ckpt.FinetuneCheckpointError, match="not a checkpoint directory"):
        resume(run=corrupt)


def test_cli_stop_after_then_resume(runs, tmp_path, capsys):
    from occult.cli import main

    np.save(tmp_path / "ids.npy", _tokens().numpy())
    args = [
        "finetune",
        "--hf",
        runs["path"],
        "--data",
        str(tmp_path / "ids.npy"),
        "--steps",
        "6",
        "--batch-size",
        "2",
        "--seq-len",
        "8",
        "--save-every",
        "2",
        "--no-progress",
        "--precision",
        "fp32",
    ]
    assert main([*args, "--out", str(tmp_path / "straight")]) == 0
    assert main([*args, "--out", str(tmp_path / "split"), "--stop-after", "3"]) == 0
    assert "stopped at step 3 of 6" in capsys.readouterr().out and not (tmp_path / "split" / "model").exists()
    assert main([*args, "--out", str(tmp_path / "split")]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "split"), "--resume"]) == 0
    assert "resumed" in capsys.readouterr().out
    a, b = (json.loads((tmp_path / d / "metrics.json").read_text())["losses"] for d in ("straight", "split"))
    assert len(a) == 6 and a == b
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "split" / "model")


def test_a_checkpoint_of_the_old_code_resumes(tmp_path):
    """A checkpoint written at step 3 of 6 by the code before `occult.training`
    (tests/data/old_checkpoints/make.py) resumes and continues as the old code did uninterrupted;
    with more --steps the run goes on past 6 (the schedule extended), the first 6 steps unchanged."""
    import importlib.util

    old = Path(__file__).resolve().parents[1] / "data" / "old_checkpoints"
    spec = importlib.util.spec_from_file_location("old_checkpoints_make", old / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    model_dir = str(tmp_path / "olmoe")
    hf.tiny_random_model("olmoe", model_dir, seed=1, **make.HF_MODEL)
    want = json.loads((old / "reference.json").read_text())["hf_straight"]
    for steps in (6, 8):
        run = tmp_path / f"run{steps}"
        shutil.copytree(old / "hf_one", run)
        cfg = hf.FinetuneConfig(**{**make.HF_TRAIN, "steps": steps})
        res = hf.finetune(
            hf.load_sharded(model_dir),
            make.hf_tokens(),
            cfg,
            progress=False,
            log=None,
            checkpoint_dir=run,
            resume=True,
            save_every=2,
        )
        assert len(res.losses) == steps == len(res.grad_norms)
        np.testing.assert_allclose(res.losses[:3], want[:3], rtol=1e-6, atol=0)
        same = 6 if steps == 6 else 5  # step 4 of the longer run uses the rate of step 4 of the new cosine
        np.testing.assert_allclose(res.losses[3:same], want[3:same], rtol=1e-5, atol=0)
        assert ckpt.find_state(run).name == f"step-{steps:08d}"
    with pytest.raises(ckpt.FinetuneCheckpointError, match="at step 8, past --steps 7; pass --steps 8 or more"):
        hf.finetune(
            hf.load_sharded(model_dir),
            make.hf_tokens(),
            hf.FinetuneConfig(**{**make.HF_TRAIN, "steps": 7}),
            progress=False,
            log=None,
            checkpoint_dir=tmp_path / "run8",
            resume=True,
        )
