"""Training, fine-tuning, checkpoints/resume and routing-trace profiling on a tiny CPU model."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from occult.lm.checkpoint import CheckpointError, load_model
from occult.lm.data import TokenData
from occult.lm.model import ModelConfig, OccultLM
from occult.lm.train import BEST, CHECKPOINT, FINAL, METRICS, TrainConfig, evaluate, finetune, lr_at, train
from occult.moe.pruning import load_similarity
from occult.placement import Placement
from occult.placement.trace import read_trace

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


TINY = Path(__file__).resolve().parents[1] / "data" / "shakespeare_tiny"
MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, num_experts=8, top_k=2, expert_ffn_size=16, max_seq_len=32)


@pytest.fixture(scope="module")
def data() -> TokenData:
    pytest.importorskip("tokenizers")
    from occult.lm.data import load_dataset

    return load_dataset(TINY, vocab_size=300, val_fraction=0.1)


def new_model(data, seed=0) -> OccultLM:
    torch.manual_seed(seed)
    return OccultLM(ModelConfig(vocab_size=data.vocab_size, **MODEL))


def cfg(**kw) -> TrainConfig:
    base = dict(
        steps=16,
        batch_size=4,
        seq_len=32,
        lr=3e-3,
        warmup_steps=3,
        eval_every=8,
        save_every=8,
        eval_tokens=512,
        device="cpu",
    )
    return TrainConfig(**{**base, **kw})


def test_lr_schedule():
    c = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, c) == pytest.approx(0.1) and lr_at(9, c) == pytest.approx(1.0)
    assert lr_at(10, c) == pytest.approx(1.0)
    assert lr_at(55, c) == pytest.approx(0.55)
    assert lr_at(100, c) == pytest.approx(0.1)
    assert all(lr_at(s, c) >= lr_at(s + 1, c) for s in range(10, 100))
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")


def test_training_learns_and_writes_files(data, tmp_path):
    model = new_model(data)
    start = evaluate(model, data.val, 8, 32, 512)
    t0 = time.perf_counter()
    res = train(model, data, cfg(steps=30, eval_every=15, save_every=15), tmp_path, progress=False, log=None)
    elapsed = time.perf_counter() - t0
    assert res.step == 30 and not res.stopped_early
    assert res.history[-1]["val_loss"] < start["val_loss"] - 0.3
    assert res.history[-1]["val_ppl"] == pytest.approx(math.exp(res.history[-1]["val_loss"]))
    for f in (CHECKPOINT, BEST, FINAL, METRICS):
        assert (tmp_path / f).is_file()
    lines = [json.loads(l) for l in (tmp_path / METRICS).read_text().splitlines()]
    assert [l["step"] for l in lines] == [15, 30]
    # training throughput per evaluation interval: 15 steps of 4 x 32 tokens, timed without evals and saves
    seconds = [15 * 4 * 32 / l["train_tokens_per_s"] for l in lines]
    assert all(l["train_tokens_per_s_per_rank"] == l["train_tokens_per_s"] for l in lines)  # one process
    assert 0 < sum(seconds) < elapsed
    back = load_model(tmp_path / FINAL)
    x = torch.randint(0, data.vocab_size, (2, 32))
    assert torch.equal(back(x).logits, model(x).logits)


def test_resume_is_exact_and_mismatches_are_refused(data, tmp_path):
    straight = new_model(data)
    train(straight, data, cfg(), tmp_path / "a", progress=False, log=None)
    part = new_model(data)
    r1 = train(part, data, cfg(), tmp_path / "b", stop_after=8, progress=False, log=None)
    assert r1.step == 8 and not (tmp_path / "b" / FINAL).exists()
    resumed = new_model(data, seed=123)  # other init: everything must come from the checkpoint
    r2 = train(resumed, data, cfg(), tmp_path / "b", resume=True, progress=False, log=None)
    assert r2.step == 16 and len(r2.history) == 2
    for (n, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(CheckpointError, match="pass --resume"):
        train(new_model(data), data, cfg(), tmp_path / "b", progress=False, log=None)
    with pytest.raises(CheckpointError, match="training config mismatch.*lr"):
        train(new_model(data), data, cfg(lr=1e-3), tmp_path / "b", resume=True, progress=False, log=None)
    with pytest.raises(CheckpointError, match="model config mismatch.*top_k"):
        torch.manual_seed(0)
        other = OccultLM(ModelConfig(vocab_size=data.vocab_size, **{**MODEL, "top_k": 1}))
        train(other, data, cfg(), tmp_path / "b", resume=True, progress=False, log=None)
    shifted = TokenData(data.train.roll(1), data.val, data.vocab_size, {})
    with pytest.raises(CheckpointError, match="training data differ"):
        train(new_model(data), data=shifted, cfg=cfg(), out_dir=tmp_path / "b", resume=True, progress=False, log=None)
    ckpt = tmp_path / "b" / CHECKPOINT
    blob = ckpt.read_bytes()
    ckpt.write_bytes(blob[: len(blob) - 100])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        train(new_model(data), data, cfg(), tmp_path / "b", resume=True, progress=False, log=None)


def test_plateau_stops_early(data, tmp_path):
    res = train(
        new_model(data),
        data,
        cfg(steps=40, eval_every=4, lr=1e-6, warmup_steps=0, patience=2, min_delta=0.05),
        tmp_path,
        progress=False,
        log=None,
    )
    assert res.stopped_early and res.step == 12
    assert (tmp_path / FINAL).exists()


def test_pruned_moe_only_finetune(data, tmp_path):
    base = new_model(data)
    train(base, data, cfg(), tmp_path / "base", progress=False, log=None)
    placement = Placement(np.stack([np.random.default_rng(i).permutation(np.arange(8) % 4) for i in range(2)]), 4)
    model, res = finetune(
        tmp_path / "base" / FINAL,
        data,
        cfg(steps=8, eval_every=4, lr=1e-3, moe_only=True),
        tmp_path / "ft",
        max_devices=1,
        placement=placement,
        progress=False,
        log=None,
    )
    assert model.routing.max_devices == 1
    assert res.history[-1]["mean_ct"] == pytest.approx(1.0)
    before = dict(base.named_parameters())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= set(model.moe_parameter_names())
    assert any("gate_up_proj" in n for n in changed) and any("router" in n for n in changed)
    back = load_model(tmp_path / "ft" / FINAL)
    assert back.routing.max_devices == 1 and back.routing.placement == placement
    assert evaluate(back, data.val, 8, 32, 512)["val_loss"] == pytest.approx(res.history[-1]["val_loss"], rel=1e-6)
    # Resuming a fine-tune from other initial weights is refused.
    train(new_model(data, seed=5), data, cfg(steps=4), tmp_path / "other", progress=False, log=None)
    with pytest.raises(CheckpointError, match="initial weights"):
        finetune(
            tmp_path / "other" / FINAL,
            data,
            cfg(steps=8, eval_every=4, lr=1e-3, moe_only=True),
            tmp_path / "ft",
            max_devices=1,
            placement=placement,
            resume=True,
            progress=False,
            log=None,
        )


def test_profile_writes_trace_and_similarity(data, tmp_path):
    from occult.lm.profile import profile_checkpoint, record_trace
    from occult.moe.routing import softmax_topk
    from occult.placement.solvers import place

    model = new_model(data)
    train(model, data, cfg(steps=4, eval_every=0, save_every=0), tmp_path / "m", progress=False, log=None)
    trace, sim_path = profile_checkpoint(
        tmp_path / "m" / FINAL,
        data,
        tmp_path / "trace.safetensors",
        tokens=1024,
        batch_size=4,
        with_scores=True,
        device="cpu",
        progress=False,
    )
    back = read_trace(tmp_path / "trace.safetensors")
    assert back.num_layers == 2 and back.num_experts == 8 and back.top_k == 2
    assert back.num_tokens == [1024, 1024] and back.scores[0].shape == (1024, 8)
    assert back.metadata["split"] == "train"
    sims = load_similarity(sim_path, num_experts=8, num_layers=2)
    assert sim_path == tmp_path / "trace.similarity.safetensors"
    assert torch.allclose(sims[0].diagonal(), torch.ones(8), atol=1e-5)
    # The trace holds the plain top-k of the router probabilities it stores.
    _, ids = softmax_topk(torch.as_tensor(back.scores[1]).log(), 2)
    assert (np.sort(ids.numpy(), 1) == np.sort(back.topk_ids[1], 1)).mean() > 0.99
    result = place(back, 4, "greedy")
    assert result.placement.num_devices == 4 and result.placement.num_layers == 2
    # A pruned model: plain top-k by default, the pruned ids with as_routed.
    model.set_routing(max_devices=1, placement=result.placement)
    x = [(torch.randint(0, data.vocab_size, (4, 32)),)]
    plain, _ = record_trace(model, x)
    routed, _ = record_trace(model, x, as_routed=True)
    from occult.placement.stats import mean_ct

    assert mean_ct(routed.topk_ids[0], result.placement.expert_device(0), 4) == 1.0
    assert mean_ct(plain.topk_ids[0], result.placement.expert_device(0), 4) > 1.0


def test_cli_defaults_mirror_the_dataclasses():
    from occult.cli import data as CD
    from occult.cli import lm as C
    from occult.lm import data as D

    m, t = ModelConfig(), TrainConfig()
    assert (C.HIDDEN, C.LAYERS, C.HEADS, C.EXPERTS, C.TOP_K, C.EXPERT_FFN, C.EXPERT_BACKEND) == (
        m.hidden_size,
        m.num_layers,
        m.num_heads,
        m.num_experts,
        m.top_k,
        m.expert_ffn_size,
        m.expert_backend,
    )
    assert (
        C.STEPS,
        C.BATCH_SIZE,
        C.SEQ_LEN,
        C.LR,
        C.MIN_LR_RATIO,
        C.WARMUP,
        C.WEIGHT_DECAY,
        C.GRAD_CLIP,
        C.AUX_LOSS_COEF,
        C.SEED,
        C.PRECISION,
        C.DEVICE,
        C.EVAL_EVERY,
        C.EVAL_TOKENS,
        C.SAVE_EVERY,
    ) == (
        t.steps,
        t.batch_size,
        t.seq_len,
        t.lr,
        t.min_lr_ratio,
        t.warmup_steps,
        t.weight_decay,
        t.grad_clip,
        t.aux_loss_coef,
        t.seed,
        t.precision,
        t.device,
        t.eval_every,
        t.eval_tokens,
        t.save_every,
    )
    assert C.ADAM_EPS == t.adam_eps
    assert (CD.VOCAB, CD.VAL_FRACTION) == (D.DEFAULT_VOCAB, D.DEFAULT_VAL_FRACTION)


def test_cli_pipeline(tmp_path, capsys):
    """occult data prepare -> train -> profile -> place -> finetune (pruned, similarity) -> resume refusal."""
    pytest.importorskip("tokenizers")
    from occult.cli import main

    d, small = (
        str(tmp_path / "data"),
        ["--batch-size", "4", "--seq-len", "32", "--eval-tokens", "256", "--no-progress", "--device", "cpu"],
    )
    assert main(["data", "prepare", "--out", d, "--corpus-dir", str(TINY), "--vocab-size", "300"]) == 0
    assert (
        main(
            [
                "train",
                "--corpus-dir",
                d,
                "--out",
                str(tmp_path / "base"),
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
                "6",
                "--eval-every",
                "3",
                *small,
            ]
        )
        == 0
    )
    best = str(tmp_path / "base" / BEST)
    sim = str(tmp_path / "placement.similarity.safetensors")
    assert (
        main(
            [
                "profile",
                "--model",
                best,
                "--corpus-dir",
                d,
                "--out",
                str(tmp_path / "trace.safetensors"),
                "--tokens",
                "256",
                "--batch-size",
                "4",
                "--similarity",
                sim,
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "place",
                "--trace",
                str(tmp_path / "trace.safetensors"),
                "--devices",
                "4",
                "--method",
                "greedy",
                "--out",
                str(tmp_path / "placement.json"),
                "-q",
            ]
        )
        == 0
    )
    ft = [
        "finetune",
        "--init",
        best,
        "--corpus-dir",
        d,
        "--out",
        str(tmp_path / "ft"),
        "--placement",
        str(tmp_path / "placement.json"),
        "--max-devices",
        "1",
        "--prune-method",
        "similarity",
        "--steps",
        "4",
        "--eval-every",
        "2",
        *small,
    ]
    assert main(ft) == 0
    out = capsys.readouterr().out
    assert "limited to 1 of 4 devices (similarity)" in out and "E[C_T] 1.000" in out
    assert load_model(tmp_path / "ft" / FINAL).routing.method == "similarity"
    assert main(ft) == 2  # a checkpoint is there: --resume or another --out
    assert "pass --resume" in capsys.readouterr().err
    assert main([*ft, "--resume"]) == 0
    (tmp_path / "placement.similarity.safetensors").unlink()
    assert main([*ft[:6], str(tmp_path / "ft2"), *ft[7:]]) == 2
    assert "similarity table" in capsys.readouterr().err


def test_quality_study_tiny_end_to_end(tmp_path):
    """benchmarks/quality_study.py --tiny (shortened): every phase runs and the report is written."""
    pytest.importorskip("tokenizers")
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "quality_study", Path(__file__).resolve().parents[2] / "benchmarks" / "quality_study.py"
    )
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    out = tmp_path / "q"
    args = [
        "--tiny",
        "--out",
        str(out),
        "--train-steps",
        "20",
        "--eval-every",
        "10",
        "--ft-steps",
        "4",
        "--device",
        "cpu",
        "--no-progress",
        "--placement-method",
        "greedy",
    ]
    assert study.main(args) == 0
    results = json.loads((out / "results.json").read_text())
    names = [r["name"] for r in results["rows"]]
    assert len(names) == 11 and names[0].startswith("standard routing") and "standard fine-tuning" in names
    by = {r["name"]: r for r in results["rows"]}
    # the placement is only measured (E[C_T]): the same model, the same ops on the same data
    assert by["placement only"]["val_loss"] == by[names[0]]["val_loss"]
    assert all(by[n]["mean_ct"] == 1.0 for n in names if "N=1" in n)
    assert all(by[n]["mean_ct"] <= 2.0 for n in names if "N=2" in n)
    text = (out / "quality.md").read_text()
    assert "| pruned N=1 (similarity) + fine-tuning | yes |" in text and (out / "quality.svg").read_text().startswith(
        "<svg"
    )
    assert study.main(args + ["--resume"]) == 0  # every phase reused
