"""The pruning-aware fine-tuning recipes of `hf.finetune` / `occult finetune --hf` (issue 28):
distillation from the unpruned model, what trains (routers, experts, both), the gate-mass rule.

One process, a tiny OLMoE pruned to 1 of 2 routing-only devices (the same placement as
tests/integrations/test_hf_finetune.py), fp32.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from occult.integrations import hf  # noqa: E402
from occult.placement import Placement  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

VOCAB = 96
PLACEMENT = Placement(np.array([[1, 0, 0, 1, 0, 1, 1, 0], [0, 1, 1, 0, 1, 0, 0, 1]]), 2)
CFG = dict(steps=4, batch_size=2, seq_len=12, lr=1e-2, warmup_steps=1, adam_eps=1e-6, seed=5, precision="fp32")


def _model(max_devices: int | None, method: str = "score"):
    model = hf.convert(hf.tiny_random_model("olmoe", seed=3, vocab_size=VOCAB))
    if max_devices is not None:
        hf.set_routing_placement(model, PLACEMENT, max_devices=max_devices, prune_method=method)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(VOCAB, (600,), generator=torch.Generator().manual_seed(11))


def _run(model, teacher=None, **cfg):
    return hf.finetune(model, _tokens(), hf.FinetuneConfig(**{**CFG, **cfg}), progress=False, log=None, teacher=teacher)


# What two fp32 runs that differ only by rounding-level gradients can give for a batch's mean loss: the
# reordering bound of an fp32 sum of the batch's token losses (n eps relative); a real change of the
# updates moves them by far more (the pruned distillation below: ~1e-4 relative).
LOSS_RTOL = CFG["batch_size"] * CFG["seq_len"] * torch.finfo(torch.float32).eps


def test_distillation_of_an_unpruned_model_is_plain_fine_tuning():
    """Teacher == student when nothing is pruned: the same logits, so the KL is exactly 0 and the run is
    the plain run up to rounding (also with the load-balancing loss, whose taps must skip the teacher).
    Not bit for bit: the KL's gradient is p * (sum(p) - 1) per logit (log_softmax's backward), and sum(p)
    is 1 only to a few ulps, in an order that depends on the CPU's vector kernels (AVX2, AVX-512); that
    rounding-level gradient can move the later losses by an ulp or so."""
    plain = _run(_model(None), aux_loss_coef=0.01)
    distilled = _run(_model(None), aux_loss_coef=0.01, distill_weight=2.0, distill_temperature=2.0)
    assert distilled.losses[0] == plain.losses[0]  # the same first forward: the same ops on the same data
    np.testing.assert_allclose(distilled.losses, plain.losses, rtol=LOSS_RTOL, atol=0)


def test_distillation_of_a_pruned_model_pulls_toward_standard_routing():
    plain_model, distilled_model = _model(1), _model(1)
    plain = _run(plain_model)
    distilled = _run(distilled_model, distill_weight=1.0)
    # the logged loss is the cross-entropy of the same first batch: the same ops on the same data
    assert distilled.losses[0] == plain.losses[0]
    # the KL term changed the updates: by more than rounding could
    assert not np.allclose(distilled.losses[1:], plain.losses[1:], rtol=10 * LOSS_RTOL, atol=0)
    for _, block in hf.moe_blocks(distilled_model):  # the teacher's standard routing was switched back off
        assert block.experts.router.max_devices == 1


@pytest.mark.parametrize("part", ["routers", "experts"])
def test_only_the_chosen_part_trains(part):
    model = _model(1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = _run(model, train_part=part)
    routers = {n for n, _ in model.named_parameters() if ".gate." in n}
    experts = {n for n, _ in model.named_parameters() if ".experts." in n and n not in routers}
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == (routers if part == "routers" else experts), sorted(moved)
    assert result.trained_parameters == sum(p.numel() for n, p in model.named_parameters() if n in moved)


def test_gate_mass_rule_limits_devices():
    model = _model(1, method="mass")
    ids = torch.randint(VOCAB, (2, 10))
    from occult.integrations.hf.aux_loss import RouterTaps

    taps = RouterTaps(model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for i, ids_TK in enumerate(taps.ids):
        devices = torch.tensor(np.array(PLACEMENT.expert_device(i)))[ids_TK]
        assert (devices == devices[:, :1]).all()  # every token's experts on one device
    taps.close()
    assert _run(model, steps=2).losses  # and it fine-tunes


def test_a_teacher_model_is_the_distillation_target():
    """teacher= (a frozen copy of the same weights, standard routing): the first update is the one of the
    self-teacher (same logits), later ones differ (the copy does not follow the student); it never moves."""
    own = _run(_model(1), distill_weight=1.0)
    teacher = _model(None)
    before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    cfg = hf.FinetuneConfig(**{**CFG, "distill_weight": 1.0, "distill_from": "teacher-dir"})
    copied = hf.finetune(_model(1), _tokens(), cfg, progress=False, log=None, teacher=teacher)
    # the first two steps: the same weights (a copy) and the same routing (none limited), so the same ops on
    # the same data; then the copy lags the student by more than rounding could move the losses
    assert copied.losses[:2] == own.losses[:2]
    assert not np.allclose(copied.losses[2:], own.losses[2:], rtol=10 * LOSS_RTOL, atol=0)
    assert all(torch.equal(p, before[n]) and not p.requires_grad for n, p in teacher.named_parameters())


def test_bad_teacher_settings_are_refused():
    with pytest.raises(ValueError, match="distill_from"):
        _run(_model(1), distill_weight=1.0, teacher=_model(None))
    with pytest.raises(ValueError, match="teacher="):
        _run(_model(1), distill_weight=1.0, distill_from="dir")
    with pytest.raises(ValueError, match="distill_weight > 0"):
        _run(_model(1), distill_from="dir", teacher=_model(None))
    other = hf.convert(hf.tiny_random_model("olmoe", seed=3, vocab_size=VOCAB + 8))
    with pytest.raises(ValueError, match="same tokenizer"):
        _run(_model(1), distill_weight=1.0, distill_from="dir", teacher=other)


def test_bad_recipe_settings_are_refused():
    with pytest.raises(ValueError, match="train_part"):
        hf.FinetuneConfig(train_part="heads")
    with pytest.raises(ValueError, match="distill"):
        hf.FinetuneConfig(distill_temperature=0)


def test_cli_runs_the_recipes(tmp_path, capsys):
    from occult.cli import main

    hf.tiny_random_model("olmoe", str(tmp_path / "m"), seed=3, vocab_size=VOCAB)
    PLACEMENT.save(tmp_path / "p.json")
    np.save(tmp_path / "ids.npy", _tokens().numpy())
    args = [
        "finetune",
        "--hf",
        str(tmp_path / "m"),
        "--out",
        str(tmp_path / "run"),
        "--data",
        str(tmp_path / "ids.npy"),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "8",
        "--no-progress",
        "--placement",
        str(tmp_path / "p.json"),
        "--max-devices",
        "1",
        "--prune-method",
        "mass",
        "--train",
        "experts",
        "--distill-weight",
        "0.5",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "training 0 router" in out and "distilling from standard routing (weight 0.5" in out
    teacher = tmp_path / "run" / "model"  # that run's weights as the teacher of the next
    assert main([*args[:4], str(tmp_path / "run2"), *args[5:], "--distill-from", str(teacher)]) == 0
    assert f"distilling from {teacher} (weight 0.5" in capsys.readouterr().out
    for bad, message in (
        ([], "needs --distill-weight"),
        (["--distill-from", str(tmp_path / "p.json")], "transformers model directory"),
    ):
        rest = [a for a in args[5:] if a not in ("--distill-weight", "0.5")] if bad == [] else args[5:]
        extra = ["--distill-from", str(teacher)] if bad == [] else bad
        assert main([*args[:4], str(tmp_path / "run3"), *rest, *extra]) != 0
        assert message in capsys.readouterr().err
