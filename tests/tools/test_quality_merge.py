"""`benchmarks/quality_merge.py`: one seed's rows measured by several runs (one device call each) merged into one
result, only when the runs share the same base, placement and reference rows; the report says so."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _row(name: str, loss: float, ct: float, n=None, method=None, finetuned=False, reference=None) -> dict:
    return {
        "name": name,
        "group": "",
        "max_devices": n,
        "method": method,
        "finetuned": finetuned,
        "val_loss": loss,
        "val_ppl": math.exp(loss),
        "mean_ct": ct,
        "mean_ct_observed": ct,
        "reference": reference,
    }


def _seed_dir(run: Path, seed: int, rows: list[dict], seconds: dict, job: dict, placement: dict) -> None:
    d = run / f"seed{seed}"
    d.mkdir(parents=True)
    result = {
        "seed": seed,
        "rows": rows,
        "train_curve": [[0, 6.0], [10, 3.0]],
        "train_steps_done": 10,
        "best_train_val": 3.0 + seed,
        "placement_method": "greedy",
        "placement_comparison": {"contiguous": 3.6},
        "seconds": seconds,
        "vocab": 512,
        "train_tokens": 100,
        "val_tokens": 10,
        "ranks": 4,
        "ft_curves": {r["name"]: [[1, r["val_loss"]]] for r in rows if r["finetuned"]},
        "ft_seconds": {},
    }
    (d / "result.json").write_text(json.dumps(result))
    (d / "job.json").write_text(json.dumps(job))
    (d / "placement.json").write_text(json.dumps(placement))


def _two_runs(tmp_path: Path, seeds=(0, 1)) -> tuple[Path, Path, dict]:
    """Run A: score rows at N=2; run B: similarity rows at N=3/2 with a distilled recipe; shared references."""
    rng = random.Random()
    a, b = tmp_path / "a", tmp_path / "b"
    shared = {}
    for s in seeds:
        std, ft = 3.4 + rng.random() * 0.1, 3.3 + rng.random() * 0.1
        shared[s] = std
        base = [_row("standard routing (contiguous placement)", std, 3.6), _row("placement only", std, 3.0)]
        ref_ft = _row("standard fine-tuning", ft, 3.0, finetuned=True, reference="standard fine-tuning")
        placement = {"experts": [rng.randrange(4) for _ in range(8)]}
        rows_a = base + [
            _row("pruned N=2 (score)", std + 0.01, 1.9, 2, "score"),
            ref_ft,
            _row("pruned N=2 (score) + fine-tuning", ft + 0.01, 1.9, 2, "score", True, "standard fine-tuning"),
        ]
        long = _row(
            "standard fine-tuning (400 steps)",
            ft - 0.1,
            3.0,
            finetuned=True,
            reference="standard fine-tuning (400 steps)",
        )
        rows_b = base + [
            _row("pruned N=3 (similarity)", std + 0.005, 2.7, 3, "similarity"),
            _row("pruned N=2 (similarity)", std + 0.02, 1.9, 2, "similarity"),
            ref_ft,
            long,
            _row(
                "pruned N=2 (similarity) + fine-tuning [distill-ft-x4]",
                ft - 0.09,
                1.9,
                2,
                "similarity",
                True,
                "standard fine-tuning (400 steps)",
            ),
            _row(
                "pruned N=2 (similarity) + fine-tuning", ft + 0.02, 1.9, 2, "similarity", True, "standard fine-tuning"
            ),
        ]
        _seed_dir(
            a,
            s,
            rows_a,
            {"train": 100.0, "fine-tuning": 30.0, "total": 130.0},
            {"max_devices": [2], "methods": ["score"], "recipes": [], "recipe_methods": None},
            placement,
        )
        _seed_dir(
            b,
            s,
            rows_b,
            {"train": 110.0, "fine-tuning": 40.0, "recipes": 60.0, "total": 210.0},
            {
                "max_devices": [3, 2],
                "methods": ["similarity"],
                "recipes": ["distill-ft-x4@2"],
                "recipe_methods": ["similarity"],
            },
            placement,
        )
    return a, b, shared


def test_merge_takes_the_union_of_rows_in_study_order_and_adds_up_the_fine_tunes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import quality_merge

    a, b, _ = _two_runs(tmp_path)
    _seed_dir(a, 2, [], {"train": 1.0}, {}, {})  # a seed only one run holds is not merged
    assert quality_merge.main(["--out", str(tmp_path / "m"), str(a), str(b)]) == 0
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["seed0", "seed1"]
    merged = json.loads((tmp_path / "m" / "seed1" / "result.json").read_text())
    assert [r["name"] for r in merged["rows"]] == [
        "standard routing (contiguous placement)",
        "placement only",
        "pruned N=3 (similarity)",
        "pruned N=2 (score)",
        "pruned N=2 (similarity)",
        "standard fine-tuning",
        "pruned N=2 (score) + fine-tuning",
        "pruned N=2 (similarity) + fine-tuning",
        "standard fine-tuning (400 steps)",
        "pruned N=2 (similarity) + fine-tuning [distill-ft-x4]",
    ]
    assert merged["seconds"] == {"train": 100.0, "fine-tuning": 70.0, "recipes": 60.0, "total": 230.0}
    assert set(merged["ft_curves"]) == {r["name"] for r in merged["rows"] if r["finetuned"]}
    assert [m["methods"] for m in merged["merged_from"]] == [["score"], ["similarity"]]
    assert (tmp_path / "m" / "seed1" / "placement.json").read_text() == (a / "seed1" / "placement.json").read_text()


def test_merge_refuses_runs_that_are_not_the_same_seed(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import quality_merge

    a, b, _ = _two_runs(tmp_path, seeds=(0,))
    res = json.loads((b / "seed0" / "result.json").read_text())
    res["rows"][-1 - 3]["val_loss"] += 1e-6  # the shared standard fine-tune of run B moved: another configuration
    (b / "seed0" / "result.json").write_text(json.dumps(res))
    with pytest.raises(SystemExit, match="row 'standard fine-tuning' differs in val_loss"):
        quality_merge.main(["--out", str(tmp_path / "m"), str(a), str(b)])
    assert quality_merge.main(["--out", str(tmp_path / "m"), "--tol", "1e-5", str(a), str(b)]) == 0
    (b / "seed0" / "placement.json").write_text(json.dumps({"experts": [9] * 8}))
    with pytest.raises(SystemExit, match="placement.json differ"):
        quality_merge.main(["--out", str(tmp_path / "m2"), str(a), str(b)])
    with pytest.raises(SystemExit, match="nothing to merge"):
        quality_merge.main(["--out", str(tmp_path / "m3"), str(a), str(tmp_path / "empty")])


def test_report_of_merged_seeds_names_the_runs(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _quality_ranks_report as rep
    import quality_merge
    import quality_ranks as qr

    a, b, _ = _two_runs(tmp_path)
    quality_merge.main(["--out", str(tmp_path / "m"), str(a), str(b)])
    seeds = [json.loads((tmp_path / "m" / f"seed{s}" / "result.json").read_text()) for s in (0, 1)]
    rows = qr.aggregate(seeds)
    results = {
        "args": {
            "tiny": False,
            "simulate": True,
            "seeds": "0,1",
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
        "env": {"device": "cpu", "torch": "x", "python": "y", "date": "z"},
        "seeds": seeds,
        "rows": rows,
        "targets": qr.targets(rows),
        "simulation_check": [],
        "wall_seconds": 1.0,
        "command": "cmd",
    }
    doc = tmp_path / "r.md"
    rep.render(results, doc)
    text = doc.read_text()
    assert "Seed(s) 0, 1: rows merged from 2 runs of the same seed" in text
    assert (
        "`--max-devices 2 --methods score`; `--max-devices 3 2 --methods similarity --recipes distill-ft-x4@2 "
        "--recipe-methods similarity`" in text
    )
    assert "#   quality_ranks.py <the flags below, one seed> --max-devices 2 --methods score\n" in text
    assert "| pruned N=3 (similarity) | no |" in text and "reference" in text
    seeds[0].pop("merged_from")
    seeds[1].pop("merged_from")
    rep.render(results, doc)
    assert "merged" not in doc.read_text()
