"""`benchmarks/quality_ranks.py`: the quality study as real multi-rank training, on 2 CPU gloo ranks.

End to end on the bundled tiny corpus (base training, profile, placement, evaluation and
fine-tuning as 2-rank torchrun jobs), then the numbers checked against what they must be:
pruned to N=1 the dispatcher sends exactly one row per token and layer (E[C_T] == 1), the
dispatcher's rows equal the C_T counted from the routed ids, and the one-process simulated study
on the same weights and placement gives the same rows without fine-tuning.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "quality_ranks.py"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_two_ranks_end_to_end_numbers_consistent(tmp_path):
    out = tmp_path / "q"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--tiny",
        "--ranks",
        "2",
        "--seeds",
        "3",
        "--out",
        str(out),
        "--vocab",
        "512",
        "--experts",
        "16",
        "--top-k",
        "4",
        "--layers",
        "2",
        "--hidden",
        "32",
        "--expert-ffn",
        "16",
        "--train-steps",
        "8",
        "--eval-every",
        "4",
        "--ft-steps",
        "3",
        "--profile-tokens",
        "2048",
        "--eval-tokens",
        "2048",
        "--max-devices",
        "1",
        "--placement-method",
        "greedy",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "quality_ranks.json").read_text())
    assert (out / "quality_ranks.md").exists() and (out / "quality_ranks.svg").exists()
    seed = res["seeds"][0]
    assert seed["seed"] == 3 and seed["ranks"] == 2 and seed["placement_method"] == "greedy"
    rows = {r["name"]: r for r in seed["rows"]}
    assert set(rows) == {
        "standard routing (contiguous placement)",
        "placement only",
        "pruned N=1 (score)",
        "pruned N=1 (similarity)",
        "standard fine-tuning",
        "pruned N=1 (score) + fine-tuning",
        "pruned N=1 (similarity) + fine-tuning",
    }
    for r in rows.values():
        assert r["routed_tokens"] == 2 * r["val_tokens"] > 0  # validation tokens x MoE layers, over both ranks
        assert r["mean_ct"] == r["dispatch_rows"] / r["routed_tokens"]
        assert r["mean_ct"] == r["mean_ct_observed"], r["name"]  # dispatcher rows == C_T of the routed ids
        if r["max_devices"] == 1:
            assert r["mean_ct"] == 1.0 and r["dispatch_rows"] == r["routed_tokens"], r["name"]
        else:
            assert 1.0 < r["mean_ct"] <= 2.0, r["name"]
        assert math.isfinite(r["val_loss"]) and r["val_ppl"] == math.exp(r["val_loss"])
    std, plc = rows["standard routing (contiguous placement)"], rows["placement only"]
    assert abs(std["val_loss"] - plc["val_loss"]) < 1e-5  # the same function, other expert placement
    # fine-tuning moved the weights (MoE blocks), every run from the same base
    assert rows["standard fine-tuning"]["val_loss"] != std["val_loss"]
    check = res["simulation_check"][0]
    assert check["max_abs_mean_ct"] == 0.0 and check["max_abs_val_loss"] < 1e-5
    sim = {r["name"]: r for r in check["rows"]}
    assert sim[std["name"]]["mean_ct"] == std["mean_ct"]
    agg = {r["name"]: r for r in res["rows"]}
    assert agg["pruned N=1 (score) + fine-tuning"]["mean_ct"]["values"] == [1.0]
    assert agg["standard fine-tuning"]["rel_ppl"]["mean"] == 0.0


def _fake_seed(seed: int, ppl: dict[str, float], ct: dict[str, float]) -> dict:
    rows = []
    for name, p in ppl.items():
        ft = name.endswith("fine-tuning")
        n = 1 if "N=1" in name else None
        rows.append(
            {
                "name": name,
                "group": "",
                "max_devices": n,
                "method": "score" if n else None,
                "finetuned": ft,
                "val_loss": math.log(p),
                "val_ppl": p,
                "mean_ct": ct[name],
                "mean_ct_observed": ct[name],
            }
        )
    return {
        "seed": seed,
        "rows": rows,
        "train_curve": [[0, 6.0], [10, 5.0 - seed]],
        "train_steps_done": 10,
        "best_train_val": 5.0 - seed,
        "placement_method": "greedy",
        "placement_comparison": {"contiguous": 3.0},
        "seconds": {"train": 1.0},
        "vocab": 512,
        "train_tokens": 100,
        "val_tokens": 10,
        "ranks": 4,
    }


def test_aggregate_spread_targets_and_report(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import quality_ranks as qr

    names = [
        "standard routing (contiguous placement)",
        "pruned N=1 (score)",
        "standard fine-tuning",
        "pruned N=1 (score) + fine-tuning",
    ]
    seeds = [
        _fake_seed(0, dict(zip(names, [10.0, 12.0, 9.0, 9.18])), dict(zip(names, [3.0, 1.0, 2.0, 1.0]))),
        _fake_seed(1, dict(zip(names, [20.0, 22.0, 10.0, 10.5])), dict(zip(names, [3.2, 1.0, 2.2, 1.0]))),
    ]
    rows = {r["name"]: r for r in qr.aggregate(seeds)}
    ft = rows["pruned N=1 (score) + fine-tuning"]
    assert math.isclose(ft["rel_ppl"]["min"], 0.02) and math.isclose(ft["rel_ppl"]["max"], 0.05)
    assert math.isclose(ft["rel_ppl"]["mean"], 0.035)
    assert math.isclose(ft["rel_ppl"]["std"], math.sqrt(2) * 0.015)  # sample std of two values
    assert math.isclose(rows["pruned N=1 (score)"]["rel_ppl"]["mean"], (0.2 + 0.1) / 2)
    assert math.isclose(rows["standard fine-tuning"]["mean_ct"]["mean"], 2.1)
    (t,) = qr.targets(qr.aggregate(seeds))
    assert (t["limit"], t["limit_worst"]) == (0.03, 0.04) and t["met_mean"] is False and t["met_every_seed"] is False
    results = {
        "args": {
            "tiny": True,
            "seeds": "0,1",
            "layers": 2,
            "hidden": 8,
            "heads": 2,
            "experts": 64,
            "top_k": 8,
            "expert_ffn": 8,
            "seq_len": 8,
            "batch_size": 8,
            "ranks": 4,
            "warmup": 1,
            "lr": 1e-3,
            "patience": 3,
            "profile_tokens": 10,
            "ft_steps": 2,
            "ft_lr": 1e-3,
            "ft_warmup": 1,
        },
        "env": {"device": "test", "torch": "x", "python": "y", "date": "z"},
        "seeds": seeds,
        "rows": qr.aggregate(seeds),
        "targets": [t],
        "simulation_check": [],
        "wall_seconds": 1.0,
        "command": "cmd",
    }
    doc = tmp_path / "r.md"
    qr.render(results, doc)
    text = doc.read_text()
    assert "| pruned N=1 (score) + fine-tuning | yes |" in text and "+3.50% ± 2.12 [+2.00%, +5.00%]" in text
    assert "**missed**" in text
    svg = doc.with_suffix(".svg").read_text()
    assert svg.count("<circle") == 4 and svg.count("<line") > 20  # fine-tuned points with min..max bars


def test_recipe_runs_and_rows_only_every_seed_has(monkeypatch):
    """`--recipes`: the recipes phase fine-tunes every N x method plainly (re-evaluated when finished) and with
    each recipe (rows '... [RECIPE]', the TrainConfig changes of `RECIPES`); a row some seed lacks is left out."""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _quality_ranks_job as job
    import quality_ranks as qr

    args = argparse.Namespace(
        max_devices=[2, 1], methods=["score", "mass"], recipes=["distill", "experts"], ft_steps=100
    )
    tune = job.finetune_runs(args, recipes=False)
    assert [r[0] for r in tune][:2] == ["standard fine-tuning", "pruned N=2 (score) + fine-tuning"] and len(tune) == 5
    runs = {r[0]: r for r in job.finetune_runs(args, recipes=True)}
    assert len(runs) == 4 + 8 and runs["pruned N=1 (mass) + fine-tuning [distill]"][1:] == (
        "ft-n1-mass-distill",
        1,
        "mass",
        job.RECIPES["distill"],
    )
    assert job.RECIPES["experts"] == {"train_part": "experts"}
    names = ["standard routing (contiguous placement)", "standard fine-tuning", "pruned N=1 (score) + fine-tuning"]
    one = _fake_seed(0, dict(zip(names, [10.0, 9.0, 9.18])), dict(zip(names, [3.0, 2.0, 1.0])))
    two = _fake_seed(1, dict(zip(names[:2], [20.0, 10.0])), dict(zip(names[:2], [3.2, 2.2])))
    assert [r["name"] for r in qr.aggregate([one, two])] == names[:2]


def test_simulated_devices_in_one_process(tmp_path):
    """`--simulate` (the one-GPU study): one process, 4 devices simulated, seeds, N=3/2/1 and the distilled recipe."""
    out = tmp_path / "s"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--simulate",
        "--tiny",
        "--ranks",
        "4",
        "--seeds",
        "1,2",
        "--out",
        str(out),
        "--vocab",
        "512",
        "--experts",
        "16",
        "--top-k",
        "4",
        "--layers",
        "2",
        "--hidden",
        "32",
        "--expert-ffn",
        "16",
        "--train-steps",
        "8",
        "--eval-every",
        "4",
        "--ft-steps",
        "3",
        "--profile-tokens",
        "2048",
        "--eval-tokens",
        "2048",
        "--max-devices",
        "3",
        "1",
        "--methods",
        "score",
        "--recipes",
        "distill",
        "--placement-method",
        "greedy",
        "--drop-weights",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "quality_ranks.json").read_text())
    assert "4 devices simulated" in res["env"]["device"] and "--simulate" in res["command"]
    # --drop-weights: a finished seed keeps its base and every JSON/metrics file, no fine-tuning weights
    for seed in ("seed1", "seed2"):
        assert (out / seed / "base" / "best.safetensors").is_file() and (out / seed / "result.json").is_file()
        runs = sorted((out / seed).glob("ft-*"))
        assert len(runs) == 1 + 2 + 2 and all((r / "metrics.jsonl").is_file() for r in runs)
        assert not [f for r in runs for f in r.rglob("*.safetensors")] and not [
            d for r in runs for d in r.iterdir() if d.is_dir()
        ]
    assert "dropped the fine-tuning runs' weights" in proc.stdout + proc.stderr
    assert [s["seed"] for s in res["seeds"]] == [1, 2] and res["simulation_check"] == []
    rows = {r["name"]: r for r in res["rows"]}
    assert {"pruned N=3 (score) + fine-tuning", "pruned N=1 (score) + fine-tuning [distill]"} <= set(rows)
    for r in rows.values():
        ct = r["mean_ct"]["values"]
        if r["max_devices"] == 1:
            assert ct == [1.0, 1.0], r["name"]
        else:
            assert all(1.0 < c <= 4.0 for c in ct), r["name"]
        if r["max_devices"] == 3:
            assert all(c <= 3.0 for c in ct), r["name"]
    distilled = rows["pruned N=1 (score) + fine-tuning [distill]"]["val_loss"]["values"]
    plain = rows["pruned N=1 (score) + fine-tuning"]["val_loss"]["values"]
    assert distilled != plain  # the teacher's KL changed the updates


def test_longer_recipes_get_a_standard_reference_as_long_and_distil_from_it(monkeypatch):
    """A recipe that changes the schedule runs standard fine-tuning as long once (its reference row and its
    `distill_from` teacher), before the pruned runs; its rows' Δ ppl is against that row, not the default one."""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _quality_ranks_job as job
    import quality_ranks as qr

    args = argparse.Namespace(
        max_devices=[1],
        methods=["score"],
        ft_steps=100,
        out="/runs/seed0",
        recipes=["distill-ft", "experts-long", "distill-ft-experts-long", "distill-ft-experts-x4"],
    )
    runs = job.finetune_runs(args, recipes=True)
    names = [r[0] for r in runs]
    assert names.count("standard fine-tuning (200 steps)") == 1 and names.count("standard fine-tuning (400 steps)") == 1
    assert names.index("standard fine-tuning (400 steps)") < names.index(
        "pruned N=1 (score) + fine-tuning [distill-ft-experts-x4]"
    )
    by = {r[0]: r for r in runs}
    assert by["standard fine-tuning (200 steps)"][1:4] == ("ft-standard-s200", None, "score")
    assert by["standard fine-tuning (200 steps)"][4] == {"steps": 200, "eval_every": 50, "save_every": 50}
    teacher = lambda r: by[f"pruned N=1 (score) + fine-tuning [{r}]"][4]["distill_from"]  # noqa: E731
    assert teacher("distill-ft") == str(Path("/runs/seed0/ft-standard/model.safetensors"))
    assert teacher("distill-ft-experts-long") == str(Path("/runs/seed0/ft-standard-s200/model.safetensors"))
    assert teacher("distill-ft-experts-x4") == str(Path("/runs/seed0/ft-standard-s400/model.safetensors"))
    assert job.reference_of(args, job.recipe_changes(args, "experts-long")) == "standard fine-tuning (200 steps)"
    assert job.reference_of(args, job.recipe_changes(args, "distill")) == "standard fine-tuning"
    # the schedule is a multiple of --ft-steps: "-x4" is four times the plain fine-tune at any size
    args.ft_steps = 200
    assert job.recipe_changes(args, "distill-ft-x4")["steps"] == 800
    assert job.recipe_changes(args, "distill-ft-experts-x8") | {"distill_from": None} == {
        "train_part": "experts",
        "steps": 1600,
        "eval_every": 400,
        "save_every": 400,
        "distill_weight": 1.0,
        "distill_temperature": 1.0,
        "distill_from": None,
    }
    assert [r[1] for r in job.reference_runs(args, ["distill-ft-x4", "experts-x4", "long"])] == [
        "ft-standard-s800",
        "ft-standard-s400",
    ]
    names = [
        "standard routing (contiguous placement)",
        "standard fine-tuning",
        "standard fine-tuning (200 steps)",
        "pruned N=1 (score) + fine-tuning [experts-long]",
    ]
    seed = _fake_seed(0, dict(zip(names, [10.0, 9.0, 8.0, 8.4])), dict(zip(names, [3.0, 2.0, 2.0, 1.0])))
    for r in seed["rows"][2:]:
        r.update(finetuned=True, reference="standard fine-tuning (200 steps)")
    rows = {r["name"]: r for r in qr.aggregate([seed])}
    assert math.isclose(rows["pruned N=1 (score) + fine-tuning [experts-long]"]["rel_ppl"]["mean"], 0.05)


def test_report_of_a_simulated_run_says_so_and_draws_the_pareto_front(tmp_path, monkeypatch):
    """`--simulate` reports (the one-GPU study) name their method, count E[C_T] from routed ids (no claim about a
    dispatcher), and give the Pareto front of the fine-tuned rows (lower E[C_T] and lower perplexity)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _quality_ranks_report as rep
    import quality_ranks as qr

    names = [
        "standard routing (contiguous placement)",
        "standard fine-tuning",
        "pruned N=2 (score) + fine-tuning",
        "pruned N=1 (score) + fine-tuning",
        "pruned N=1 (similarity) + fine-tuning",
    ]
    ppl, ct = [10.0, 9.0, 9.1, 9.5, 9.6], [3.0, 2.5, 1.9, 1.0, 1.0]
    seed = _fake_seed(0, dict(zip(names, ppl)), dict(zip(names, ct)))
    seed["rows"][-1]["method"] = "similarity"  # simulated rows copy mean_ct into mean_ct_observed: no dispatcher claim
    seed["env"] = {"device": "one process, 4 devices simulated, on NVIDIA H200", "torch": "2.11"}  # ran elsewhere
    rows = qr.aggregate([seed])
    assert [r["name"] for r in rep.pareto_front(rows)] == names[3:0:-1]  # N=1 score, N=2, standard FT
    results = {
        "args": {
            "tiny": False,
            "simulate": True,
            "seeds": "0",
            "layers": 8,
            "hidden": 512,
            "heads": 8,
            "experts": 64,
            "top_k": 8,
            "expert_ffn": 128,
            "seq_len": 256,
            "batch_size": 64,
            "ranks": 4,
            "warmup": 1,
            "lr": 1e-3,
            "patience": 3,
            "profile_tokens": 10,
            "ft_steps": 2,
            "ft_lr": 1e-3,
            "ft_warmup": 1,
        },
        "env": {"device": "one process, 4 devices simulated", "torch": "x", "python": "y", "date": "z"},
        "seeds": [seed],
        "rows": rows,
        "targets": qr.targets(rows),
        "simulation_check": [],
        "wall_seconds": 1.0,
        "command": "cmd",
    }
    doc = tmp_path / "r.md"
    rep.render(results, doc)
    text = doc.read_text()
    assert text.startswith("# Collaboration pruning: quality study with simulated devices")
    assert "torchrun" not in text and "dispatcher's rows" not in text and "rows per rank" not in text
    assert "E[C_T] (routed ids on the placement)" in text
    assert "The seeds ran on one process, 4 devices simulated, on NVIDIA H200 (torch 2.11)." in text
    assert "did not record its machine" not in text
    assert (
        "Pareto front of the fine-tuned rows" in text and "pruned N=1 (similarity)" not in text.split("Pareto front")[1]
    )
    svg = doc.with_suffix(".svg").read_text()
    assert svg.count('stroke-dasharray="5,4"') == 1 and "routed ids on the placement" in svg
    del seed["env"]  # a seed from before the machine was recorded
    rep.render(results, doc)
    assert "Seed(s) 0 came from a run that did not record its machine" in doc.read_text()


def test_a_recipe_can_run_at_some_device_limits_only(monkeypatch):
    """`--recipes NAME@N,N`: that recipe's rows (and its reference run) only at those N; bad specs are errors."""
    import argparse

    import pytest

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _quality_ranks_job as job

    args = argparse.Namespace(
        max_devices=[3, 2, 1],
        methods=["score", "similarity"],
        ft_steps=100,
        out="/r/seed0",
        recipes=["distill-ft-x4@3,2", "distill-ft-experts-x8@1"],
    )
    names = [r[0] for r in job.finetune_runs(args, recipes=True)]
    tagged = [n for n in names if "[" in n]
    assert tagged == [
        f"pruned N={n} ({m}) + fine-tuning [distill-ft-x4]" for n in (3, 2) for m in ("score", "similarity")
    ] + [f"pruned N=1 ({m}) + fine-tuning [distill-ft-experts-x8]" for m in ("score", "similarity")]
    assert "standard fine-tuning (400 steps)" in names and "standard fine-tuning (800 steps)" in names
    assert job.parse_recipe("distill", [2, 1]) == ("distill", [2, 1])
    for bad, message in (
        ("distill@3", "must be one of --max-devices 2 1"),
        ("distill@", "after @ give device limits"),
        ("distill@a", "after @ give device limits"),
        ("nope@1", "unknown recipe"),
    ):
        with pytest.raises(ValueError, match=message):
            job.parse_recipe(bad, [2, 1])


def test_recipe_methods_limit_the_recipe_rows_not_the_plain_ones(monkeypatch):
    """`--recipe-methods score`: the recipes run with score only; the plain rows keep every --methods."""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _quality_ranks_job as job

    args = argparse.Namespace(
        max_devices=[3, 2, 1],
        methods=["score", "similarity"],
        ft_steps=100,
        out="/r/seed0",
        recipes=["distill-ft-x4@2,1"],
        recipe_methods=["score"],
    )
    names = [r[0] for r in job.finetune_runs(args, recipes=True)]
    assert [n for n in names if "[" in n] == [f"pruned N={n} (score) + fine-tuning [distill-ft-x4]" for n in (2, 1)]
    assert sum("(similarity) + fine-tuning" in n for n in names) == 3 and "standard fine-tuning (400 steps)" in names
    args.recipe_methods = None
    assert sum("[distill-ft-x4]" in r[0] for r in job.finetune_runs(args, recipes=True)) == 4


def test_reports_link_to_quality_md_from_wherever_they_are_written() -> None:
    """The generated reports sit in docs/, docs/results/ and its folders; each link must reach docs/quality.md."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _quality_ranks_report import quality_doc_link
    finally:
        sys.path.pop(0)
    for report in (
        ROOT / "docs" / "quality_ranks.md",
        ROOT / "docs" / "results" / "a.md",
        ROOT / "docs" / "results" / "x" / "b.md",
    ):
        assert (report.parent / quality_doc_link(report)).resolve() == ROOT / "docs" / "quality.md"
    for report in ROOT.glob("docs/**/quality_ranks*.md"):  # the committed ones
        for target in re.findall(r"\[quality\.md\]\(([^)]+)\)", report.read_text()):
            assert (report.parent / target).is_file(), (report, target)
