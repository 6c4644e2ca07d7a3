"""Pruning-aware fine-tuning recipes (`occult.lm.distill`: distillation from the unpruned model, what
trains) and seeded runs that repeat bit for bit (issue 28)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_helpers import PLACEMENT, TINY, config, train_config

from occult.distributed import run_ranks
from occult.lm.distill import distill_kl, distilled_loss, part_names
from occult.lm.model import OccultLM
from occult.lm.parallel import full_model, setup_parallel, shard_model
from occult.lm.train import FINAL, TrainConfig, finetune, train
from occult.placement import Placement

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PLACE4 = Placement(np.stack([np.random.default_rng(i).permutation(np.arange(8) % 4) for i in range(2)]), 4)
FT = dict(steps=6, eval_every=3, save_every=0, lr=3e-3, warmup_steps=1, moe_only=True)
# Distillation from the model itself when its routing is not limited: the same logits, KL exactly 0, but its
# gradient is W * T * p * (sum(p) - 1) per logit (log_softmax's backward), and sum(p) is 1 only to a few ulps
# (in an order that depends on the CPU's vector kernels). At W = 1000 that is ~1e-3 of the gradient of the
# tiny base's real KL under a 1-device limit, which moves the losses by ~1e-5: between the two.
DISTILL_NOISE_RTOL = 1e-6


@pytest.fixture(scope="module")
def base(data, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recipes")
    torch.manual_seed(0)
    train(
        OccultLM(config(data)),
        data,
        train_config(steps=10, eval_every=0, save_every=0),
        root / "base",
        progress=False,
        log=None,
        plot=False,
    )
    return root / "base" / FINAL


def tune(base: Path, data, out: Path, n: int | None = 1, method: str = "score", **kw):
    """(model, result) of a fine-tune of `base` limited to `n` of PLACE4's devices."""
    cfg = train_config(**{**FT, **kw})
    return finetune(
        base, data, cfg, out, max_devices=n, placement=PLACE4 if n else None, method=method, progress=False, log=None
    )


def params(model: OccultLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_distill_weight_zero_is_plain_finetuning_bit_for_bit(base, data, tmp_path):
    plain_m, plain = tune(base, data, tmp_path / "plain")
    zero_m, zero = tune(base, data, tmp_path / "zero", distill_weight=0.0, distill_temperature=2.0)
    assert zero.train_losses == plain.train_losses and [h["val_loss"] for h in zero.history] == [
        h["val_loss"] for h in plain.history
    ]
    assert all(torch.equal(p, params(plain_m)[n]) for n, p in params(zero_m).items())
    # (the tiny base's MoE output moves the logits little: KL ~1e-8, so a large weight to see it)
    dist_m, dist = tune(base, data, tmp_path / "dist", distill_weight=1000.0)
    assert dist.train_losses[0] == plain.train_losses[0]  # the logged loss is the cross-entropy
    # and the KL moved the weights: by more than its rounding-level gradient could (the test below)
    assert not np.allclose(dist.train_losses[1:], plain.train_losses[1:], rtol=DISTILL_NOISE_RTOL, atol=0)
    assert dist_m.routing.max_devices == 1 and all(r.max_devices == 1 for r in dist_m.routers())


def test_the_teacher_is_the_same_weights_with_standard_routing(base, data):
    from occult.lm.checkpoint import load_model

    model = load_model(base)
    x = torch.randint(0, data.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    with torch.no_grad():
        teacher = model(x, return_logits=True).logits
    model.set_routing(1, PLACE4, "score")
    out = distilled_loss(model, model, (x, y), 0.01, 0.5, 2.0)
    student = model(x, y, return_logits=True)
    want = student.loss + 0.01 * student.aux_loss + 0.5 * distill_kl(student.logits, teacher, 2.0)
    assert torch.allclose(out.total, want, rtol=1e-6) and torch.equal(out.logged, student.loss)
    assert all(r.max_devices == 1 for r in model.routers())  # the limit is back after the teacher's forward
    assert float(distill_kl(teacher, teacher, 3.0)) == 0.0  # t - t: exactly 0 term by term
    # The KL here (~1e-7) is a sum of differences of near-equal terms, below fp32's resolution of those terms:
    # only the noise floor holds. The formula is checked where the KL is of order 1.
    kl = float(distill_kl(student.logits, teacher, 2.0).detach())
    assert abs(kl - kl_float64(student.logits, teacher, 2.0)) <= kl_noise_floor(student.logits, teacher, 2.0)
    far_s, far_t = torch.randn(2, 2, 16, data.vocab_size, generator=torch.Generator().manual_seed(2))
    far_t = 4 * far_t  # a sharper teacher: KL ~8, and KL(t || s) far from KL(s || t)
    far = kl_float64(far_s, far_t, 2.0)
    assert kl_noise_floor(far_s, far_t, 2.0) < 1e-5 * far  # rel=1e-5 is above what rounding can do here
    assert float(distill_kl(far_s, far_t, 2.0)) == pytest.approx(far, rel=1e-5)


def kl_float64(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> float:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), mean over tokens, in float64: the reference."""
    log_q = torch.log_softmax(student_logits.detach().double() / temperature, -1)
    log_p = torch.log_softmax(teacher_logits.detach().double() / temperature, -1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean() * temperature**2)


def kl_noise_floor(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> float:
    """What fp32 rounding can move `distill_kl` by: each log-probability is rounded to eps of its size (and of
    the scaled logits it came from), and the KL sums them weighted by p: T^2 * mean over tokens of
    sum p * (|log p| + |log q|) + max |z|, times eps and a small factor."""
    z_q = student_logits.detach().double() / temperature
    z_p = teacher_logits.detach().double() / temperature
    log_q, log_p = torch.log_softmax(z_q, -1), torch.log_softmax(z_p, -1)
    terms = (log_p.exp() * (log_p.abs() + log_q.abs())).sum(-1) + z_q.abs().amax(-1) + z_p.abs().amax(-1)
    return 8 * torch.finfo(torch.float32).eps * temperature**2 * float(terms.mean())


def test_distillation_without_a_binding_limit_is_plain_finetuning(base, data, tmp_path):
    """4 of 4 devices: the student is the teacher (KL 0; its gradient 0 up to rounding)."""
    _, plain = tune(base, data, tmp_path / "plain", n=4)
    _, dist = tune(base, data, tmp_path / "dist", n=4, distill_weight=1000.0, distill_temperature=2.0)
    np.testing.assert_allclose(dist.train_losses, plain.train_losses, rtol=DISTILL_NOISE_RTOL, atol=0)


@pytest.mark.parametrize("part", ["routers", "experts"])
def test_train_part_updates_only_that_part(base, data, tmp_path, part):
    from occult.lm.checkpoint import load_model

    before = params(load_model(base))
    model, _ = tune(base, data, tmp_path / part, train_part=part)
    changed = {n for n, p in params(model).items() if not torch.equal(p, before[n])}
    assert changed == set(part_names(model, part))
    experts = set(model.expert_parameters())
    assert (changed <= experts) if part == "experts" else not (changed & experts)


def test_train_both_is_moe_only(base, data, tmp_path):
    a, ra = tune(base, data, tmp_path / "both", train_part="both")
    b, rb = tune(base, data, tmp_path / "default")
    assert ra.train_losses == rb.train_losses and all(torch.equal(p, params(b)[n]) for n, p in params(a).items())


def test_recipe_settings_are_checked():
    with pytest.raises(ValueError, match="distill_weight"):
        TrainConfig(distill_weight=-1.0)
    with pytest.raises(ValueError, match="distill_temperature"):
        TrainConfig(distill_temperature=0.0)
    with pytest.raises(ValueError, match="train_part"):
        TrainConfig(train_part="attention")


def _metrics(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock rates (which differ between runs by design)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if "per_s" not in k} for m in lines]


def _weights(path: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(training losses, tensors) of a weights file."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["train_losses"]), {k: f.get_tensor(k) for k in f.keys()}


def test_seeded_cli_train_and_finetune_repeat_bit_for_bit(tmp_path, capsys):
    """Two runs of the same `occult train` / `occult finetune` command (the tokenizer trained from the
    texts each time, distillation and the mass rule on): the same losses and weights, bit for bit."""
    pytest.importorskip("tokenizers")
    from occult.cli import main

    PLACE4.save(tmp_path / "p4.json")
    model = ["--hidden", "32", "--layers", "2", "--heads", "2", "--experts", "8", "--top-k", "2", "--expert-ffn", "16"]
    common = [
        "--corpus-dir",
        str(TINY),
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--eval-every",
        "3",
        "--eval-tokens",
        "256",
        "--device",
        "cpu",
        "--no-progress",
        "--seed",
        "3",
    ]
    for run in ("a", "b"):
        assert main(["train", *model, *common, "--steps", "6", "--out", str(tmp_path / f"train-{run}")]) == 0
        assert (
            main(
                [
                    "finetune",
                    "--init",
                    str(tmp_path / f"train-{run}" / FINAL),
                    *common,
                    "--steps",
                    "4",
                    "--out",
                    str(tmp_path / f"ft-{run}"),
                    "--placement",
                    str(tmp_path / "p4.json"),
                    "--max-devices",
                    "1",
                    "--prune-method",
                    "mass",
                    "--distill-weight",
                    "0.5",
                    "--distill-temperature",
                    "2",
                ]
            )
            == 0
        )
    capsys.readouterr()
    for kind in ("train", "ft"):
        a, b = tmp_path / f"{kind}-a", tmp_path / f"{kind}-b"
        assert _metrics(a) == _metrics(b) and len(_metrics(a)) == 2
        (losses_a, weights_a), (losses_b, weights_b) = _weights(a / FINAL), _weights(b / FINAL)
        assert losses_a == losses_b and weights_a.keys() == weights_b.keys()
        assert all(torch.equal(t, weights_b[k]) for k, t in weights_a.items())


def _twice_worker(rank: int, world_size: int, data, root: str) -> dict:
    """The same seeded 2-rank training and distilled, pruned fine-tune, twice."""
    root_p = Path(root)
    par = setup_parallel()
    p2 = Placement.from_lists(PLACEMENT, 2)
    out = {}
    for run in ("a", "b"):
        torch.manual_seed(4)
        model = shard_model(full_model(config(data), par), par, p2)
        res = train(
            model,
            data,
            train_config(steps=8, eval_every=4, save_every=0),
            root_p / f"train-{run}",
            parallel=par,
            progress=False,
            log=None,
            plot=False,
        )
        par.barrier()  # rank 0 wrote the weights file the fine-tune reads
        cfg = train_config(**{**FT, "distill_weight": 0.5, "train_part": "both"})
        _, ft = finetune(
            root_p / f"train-{run}" / FINAL,
            data,
            cfg,
            root_p / f"ft-{run}",
            max_devices=1,
            placement=p2,
            method="mass",
            progress=False,
            log=None,
            parallel=par,
            ep_placement=p2,
        )
        out[run] = (
            res.train_losses,
            [h["val_loss"] for h in res.history],
            ft.train_losses,
            [h["val_loss"] for h in ft.history],
        )
    return out


def test_two_rank_runs_repeat_bit_for_bit(data, tmp_path):
    for rank in run_ranks(_twice_worker, 2, data, str(tmp_path), timeout_s=240):
        assert rank["a"] == rank["b"] and len(rank["a"][2]) == FT["steps"]


def test_distill_from_another_checkpoint(base, data, tmp_path):
    """`distill_from`: the teacher is that checkpoint, frozen. Teacher = the base and no binding limit:
    the first step is plain fine-tuning (KL 0, zero gradient), then the student leaves the frozen base
    and the KL pulls it back; a teacher fine-tuned further gives yet another run."""
    plain_m, plain = tune(base, data, tmp_path / "plain", n=None)
    same_m, same = tune(base, data, tmp_path / "same", n=None, distill_weight=1000.0, distill_from=str(base))
    assert same.train_losses[0] == plain.train_losses[0]  # the same first forward: the same ops on the same data
    # the first update: the KL's rounding-level gradient only (DISTILL_NOISE_RTOL); then the KL pulls back
    np.testing.assert_allclose(same.train_losses[:2], plain.train_losses[:2], rtol=DISTILL_NOISE_RTOL, atol=0)
    assert not np.allclose(same.train_losses[2:], plain.train_losses[2:], rtol=DISTILL_NOISE_RTOL, atol=0)
    better = tmp_path / "plain" / FINAL  # the standard fine-tune as the teacher of a pruned run
    _, pruned = tune(base, data, tmp_path / "pruned_ft_teacher", distill_weight=1000.0, distill_from=str(better))
    _, pruned_self = tune(base, data, tmp_path / "pruned_self_teacher", distill_weight=1000.0)
    assert not np.allclose(pruned.train_losses[1:], pruned_self.train_losses[1:], rtol=DISTILL_NOISE_RTOL, atol=0)
    with pytest.raises(ValueError, match="distill_from"):
        TrainConfig(distill_from=str(base))  # without a weight


def test_cli_distill_from(base, data, tmp_path, capsys):
    from occult.cli import main

    pytest.importorskip("transformers")
    from occult.integrations import hf

    hf.tiny_random_model("olmoe", str(tmp_path / "m"), seed=3, vocab_size=96)
    args = ["finetune", "--hf", str(tmp_path / "m"), "--out", str(tmp_path / "o"), "--distill-weight", "1"]
    assert main([*args, "--distill-from", str(base)]) == 2  # an occult checkpoint cannot teach a transformers model
    assert "with --hf the teacher is a transformers model directory" in capsys.readouterr().err
