"""scripts/one_gpu_runs.sh and scripts/multi_gpu_runs.sh: every part's commands (DRY_RUN=1), and clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, part: str, out: Path, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # python3 = this Python
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script), part, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": path, **env},
    )


@pytest.mark.parametrize(
    "script, parts",
    [
        (
            "one_gpu_runs.sh",
            [
                "kernels",
                "suite",
                "peer",
                "train",
                "layer_graphs",
                "captured_step",
                "optimizer",
                "native",
                "native_decode",
                "quality",
            ],
        ),
        (
            "multi_gpu_runs.sh",
            [
                "suite",
                "e2e",
                "e2e-slow",
                "graph",
                "decode",
                "publish",
                "publish-slow",
                "current",
                "current-slow",
                "issue52",
                "interleave",
                "placed-slow",
                "host-slow",
                "host-profile",
                "host-stall",
                "pair",
                "grid",
                "trace",
                "peer",
                "train",
                "train-slow",
                "serve",
                "serve-slow",
                "probe",
                "scale",
            ],
        ),
        ("four_gpu_runs.sh", ["olmoe", "olmoe-slow-floor", "qwen3", "layer", "serve", "serve-graph"]),
    ],
)
def test_dry_run_lists_every_part(tmp_path, script, parts):
    res = _run(script, "all", tmp_path, DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    names = [line.split(":")[0][3:] for line in res.stdout.splitlines() if line.startswith("== ")]
    for part in parts:
        one = _run(script, part, tmp_path, DRY_RUN="1")
        assert one.returncode == 0 and one.stdout.count("\n== ") + one.stdout.startswith("== ") >= 1, (part, one.stderr)
        assert all(line.split(":")[0][3:] in names for line in one.stdout.splitlines() if line.startswith("== "))
    if script != "four_gpu_runs.sh":  # the training parts read the carried corpus
        assert any("--corpus-dir .gpudata" in line for line in res.stdout.splitlines())
    bad = _run(script, "nope", tmp_path, DRY_RUN="1")
    assert bad.returncode == 2 and "unknown part 'nope'" in bad.stderr


def _two_gpu(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "two_gpu_training.sh"), str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": path, **env},
    )


def test_two_gpu_training_dry_run_and_errors(tmp_path):
    """Issue 38's script: every run of both parts listed, multicast off, a bad part or no GPUs is exit 2."""
    res = _two_gpu(tmp_path, "nvlink slow", "all", DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    names = [line.split(":")[0][3:] for line in res.stdout.splitlines() if line.startswith("== ")]
    assert {
        "train_nvlink_1gpu",
        "train_nvlink_dedup_fsdp",
        "train_nvlink_dedup_fsdp_model",
        "train_nvlink_dedup_fsdp_captured",
        "train_nvlink_dedup_counts_ddp",
        "train_slow_standard_ddp",
        "finetune_hf_2gpu",
        "resume_test",
        "replace_every",
    } <= set(names)
    assert not any(n.startswith("train_slow_") and "fsdp" in n for n in names)
    assert "NCCL_P2P_DISABLE=1" in next(line for line in res.stdout.splitlines() if "train_slow_floor" in line)
    bad = _two_gpu(tmp_path, "nvlink", "nope", DRY_RUN="1")
    assert bad.returncode == 2 and "unknown part 'nope'" in bad.stderr
    if not __import__("torch").cuda.is_available():
        none = _two_gpu(tmp_path, "nvlink", "train")
        assert none.returncode == 2 and "needs 2 GPUs" in none.stderr


def test_two_gpu_training_takes_more_gpus(tmp_path):
    """GPUS=4: the train part's multi-GPU runs on 4 ranks with 8 sequences each, the 1-GPU run on one, the more
    part's two-GPU runs still on 2; a count the script cannot run is exit 2 before any work."""
    res = _two_gpu(tmp_path, "nvlink", "all", DRY_RUN="1", GPUS="4")
    assert res.returncode == 0, res.stderr
    lines = {line.split(":")[0][3:]: line for line in res.stdout.splitlines() if line.startswith("== ")}
    for name in ("train_nvlink_floor", "train_nvlink_dedup_ddp", "train_nvlink_dedup_fsdp_captured"):
        assert "--nproc-per-node 4" in lines[name] and "--batch-size 32" in lines[name], lines[name]
    assert "--nproc-per-node" not in lines["train_nvlink_1gpu"] and "--batch-size 8" in lines["train_nvlink_1gpu"]
    assert "--nproc-per-node 2" in lines["finetune_hf_2gpu"] and "--nproc-per-node 2" in lines["replace_every"]
    for bad in ("1", "x"):
        res = _two_gpu(tmp_path, "nvlink", "train", DRY_RUN="1", GPUS=bad)
        assert res.returncode == 2 and f"GPUS={bad}: give 2 to 8" in res.stderr and "== " not in res.stdout


def _link_summary(out: Path, runs: dict[str, dict], *args: str) -> None:
    """Write each run summary as OUT/runs/NAME.json, then `_train_summary.py link OUT nvlink ARGS` (exit 0)."""
    import json

    (out / "runs").mkdir()
    for name, doc in runs.items():
        (out / "runs" / f"{name}.json").write_text(json.dumps(doc))
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "_train_summary.py"), "link", str(out), "nvlink", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr


def test_train_summary_names_the_job_by_its_gpus(tmp_path):
    """_train_summary.py link --gpus 4: OUT/train_{link}_4xGPU.json, its env block from the 4-GPU runs only."""
    import json

    runs = {}
    base = {"link": "nvlink", "tokens_per_s": 4000.0, "losses": [5.0, 4.0], "batch_size": 32, "seq_len": 8}
    for variant, gpus, tps, commit in (
        ("1gpu", 1, 1200.0, "aaaaaaa"),
        ("floor", 4, 1000.0, "bbbbbbb"),
        ("dedup_ddp", 4, 1100.0, "bbbbbbb"),
    ):
        env = {
            "world_size": gpus,
            "gpu": "card",
            "commit": commit,
            "dirty": False,
            "date": "2026-11-29T00:00:00+00:00",
            "link": "nvlink",
        }
        runs[f"train_nvlink_{variant}"] = dict(base, variant=variant, gpus=gpus, tokens_per_s_per_gpu=tps, env=env)
    _link_summary(tmp_path, runs, "--gpus", "4")
    doc = json.loads((tmp_path / "train_nvlink_4xGPU.json").read_text())
    assert doc["env"]["world_size"] == 4 and doc["env"]["commit"] == "bbbbbbb", doc["env"]
    assert doc["ratios"]["dedup_over_floor_per_gpu"] == pytest.approx(1.1)
    assert not (tmp_path / "train_nvlink_2xGPU.json").exists()


def test_train_report_table_and_plot(tmp_path):
    """scripts/train_report.py on a made-up link file: variants, ratios against the targets, a PNG."""
    import json

    pytest.importorskip("matplotlib")
    run = {
        "gpus": 2,
        "tokens_per_s": 2000.0,
        "tokens_per_s_per_gpu": 1000.0,
        "batch_size": 2,
        "seq_len": 8,
        "mfu": 0.1,
        "losses": [5.0, 4.9],
    }
    doc = {
        "link": "slow",
        "peak": None,
        "variants": {"floor": run, "dedup_ddp": dict(run, tokens_per_s_per_gpu=900.0)},
        "ratios": {"dedup_over_floor_per_gpu": 0.9, "dedup_over_standard": None},
        "loss_max_rel_diff_vs": "floor",
        "loss_max_rel_diff": {"dedup_ddp": 1e-3},
        "skipped": ["standard_ddp"],
    }
    (tmp_path / "train_slow_2xGPU.json").write_text(json.dumps(doc))
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_report.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "| slow | dedup_ddp | 2 | 900 | 2,000 | 10.0 | 8 | 1.0e-03 |" in res.stdout
    assert "| slow | EP dedup tokens/s per GPU / data-parallel floor | 0.900 | 0.85 | met |" in res.stdout
    assert "Skipped (over the time budget): slow: standard_ddp" in res.stdout
    assert (tmp_path / "train_report.png").stat().st_size > 0


def test_two_gpu_training_only_runs_the_named_variants(tmp_path):
    """ONLY= picks training runs by their LINK_VARIANT names (a partial rerun on one machine)."""
    res = _two_gpu(tmp_path, "nvlink slow", "train", DRY_RUN="1", ONLY="slow_floor nvlink_dedup_fsdp")
    assert res.returncode == 0, res.stderr
    names = [line.split(":")[0][3:] for line in res.stdout.splitlines() if line.startswith("== ")]
    assert [n for n in names if n.startswith("train_")] == ["train_slow_floor", "train_nvlink_dedup_fsdp"]
    assert names.index("warmup") < names.index("train_slow_floor")  # an uncounted run warms the machine first
    cold = _two_gpu(tmp_path, "nvlink", "train", DRY_RUN="1", ONLY="nvlink_dedup_fsdp", WARMUP="0")
    assert cold.returncode == 0 and "== warmup" not in cold.stdout, cold.stderr


def test_two_gpu_training_runs_rounds_in_turn(tmp_path):
    """ROUNDS=N: every chosen run once a round, the rounds one after another, each run named by its round; a count
    the script does not take is exit 2 before any work."""
    res = _two_gpu(tmp_path, "nvlink", "train", DRY_RUN="1", ROUNDS="2", ONLY="nvlink_dedup_ddp nvlink_dedup_fsdp")
    assert res.returncode == 0, res.stderr
    names = [line.split(":")[0][3:] for line in res.stdout.splitlines() if line.startswith("== train_")]
    assert names == [
        "train_nvlink_dedup_ddp_r1",
        "train_nvlink_dedup_fsdp_r1",
        "train_nvlink_dedup_ddp_r2",
        "train_nvlink_dedup_fsdp_r2",
    ]
    for bad in ("0", "x"):
        res = _two_gpu(tmp_path, "nvlink", "train", DRY_RUN="1", ROUNDS=bad)
        assert res.returncode == 2 and f"ROUNDS={bad}: give 1 to 9" in res.stderr and "== " not in res.stdout


def test_train_summary_takes_each_variant_s_median_round(tmp_path):
    """Several rounds of a variant in one job: the ratios use its median run, every round's tokens/s kept."""
    import json
    import random

    runs = {}
    env = {"world_size": 2, "gpu": "card", "commit": "c", "dirty": False, "date": "2026-11-30T00:00:00+00:00"}
    fsdp = [random.uniform(50.0, 150.0) for _ in range(3)]
    ddp = [random.uniform(150.0, 250.0) for _ in range(3)]
    for k, (a, b) in enumerate(zip(fsdp, ddp), 1):
        for variant, tps in (("dedup_ddp", b), ("dedup_fsdp", a)):
            doc = {"link": "nvlink", "variant": variant, "gpus": 2, "tokens_per_s": 2 * tps, "losses": [5.0, 4.0]}
            doc.update(tokens_per_s_per_gpu=tps, env=dict(env, link="nvlink"), round=k)
            runs[f"train_nvlink_{variant}_r{k}"] = doc
    _link_summary(tmp_path, runs)
    doc = json.loads((tmp_path / "train_nvlink_2xGPU.json").read_text())
    median = sorted(fsdp)[1] / sorted(ddp)[1]
    assert doc["ratios"]["dedup_fsdp_over_dedup_ddp"] == pytest.approx(median, rel=1e-12)
    assert doc["variants"]["dedup_fsdp"]["rounds_tokens_per_s_per_gpu"] == pytest.approx(fsdp)
    # round by round: numerator and denominator of one round, the drift between rounds left out
    paired = [a / b for a, b in zip(fsdp, ddp)]
    assert doc["ratios_per_round"]["dedup_fsdp_over_dedup_ddp"] == pytest.approx(paired, rel=1e-12)
    assert set(doc["ratios_per_round"]) == {"dedup_fsdp_over_dedup_ddp"}  # the only pair with two rounds or more
    del runs["train_nvlink_dedup_fsdp_r3"]  # the last round's run past the job's budget: the first two pair up
    (tmp_path / "skip").mkdir()
    _link_summary(tmp_path / "skip", runs)
    doc = json.loads((tmp_path / "skip" / "train_nvlink_2xGPU.json").read_text())
    assert doc["ratios_per_round"]["dedup_fsdp_over_dedup_ddp"] == pytest.approx(paired[:2], rel=1e-12)


@pytest.mark.parametrize(
    "stages, says",
    [
        ("4", "give stages among 1 (or its halves 1a, 1b), 2, 3"),
        ("2 x", "give stages among 1"),
        ("1 1b", "give one of 1, 1a, 1b"),
        ("1a 1b 2", "give one of 1, 1a, 1b"),
    ],
)
def test_gpu_suite_stages_are_checked(tmp_path, stages, says):
    res = subprocess.run(
        ["bash", str(ROOT / "tests" / "gpu" / "run.sh"), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OCCULT_GPU_SUITE_STAGES": stages},
    )
    assert res.returncode == 2 and says in res.stderr, res.stderr
    assert not (tmp_path / "rank0.xml").exists()  # refused before any test ran


def test_gpu_suite_halves_of_stage_one_cover_it_once(tmp_path):
    """Stage 1a's files and 1b's (every other collective file, by --ignore) are stage 1's, each in one half."""

    def targets(stage: str) -> list[str]:
        res = subprocess.run(
            ["bash", str(ROOT / "tests" / "gpu" / "run.sh"), str(tmp_path / stage)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **os.environ,
                "OCCULT_GPU_SUITE_ON_CPU": "1",
                "OCCULT_GPU_SUITE_STAGES": stage,
                "OCCULT_GPU_SUITE_DRY_RUN": "1",
            },
        )
        assert res.returncode == 0 and res.stdout.startswith(f"stage {stage}: "), (res.stdout, res.stderr)
        assert not (tmp_path / stage / "rank0.xml").exists()  # nothing ran
        return res.stdout.split(": ", 1)[1].split()

    assert targets("1") == ["tests/gpu"]
    first, second = targets("1a"), targets("1b")
    assert first and all((ROOT / f).is_file() and Path(f).name.startswith("test_collective_") for f in first)
    assert second == ["tests/gpu", *(f"--ignore={f}" for f in first)]


def test_gpu_suite_summary_keeps_the_run_s_versions(tmp_path):
    """A summary remade from a copy of OUT (another machine) names the GPU run's versions, not its own."""
    (tmp_path / "versions.txt").write_text("python 3.12.3\ntorch 2.11.0+cu130\n2 x NVIDIA H200\n")
    case = '<testcase classname="tests.gpu.test_x" name="{}" time="1.5">{}</testcase>'
    for r in (0, 1):
        (tmp_path / f"rank{r}.xml").write_text(
            f"<testsuites><testsuite>{case.format('test_a', '')}"
            f"{case.format('test_b', '<failure/>' if r else '')}</testsuite></testsuites>"
        )
    res = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu" / "summary.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "summary.md").read_text()
    assert "- torch 2.11.0+cu130\n- 2 x NVIDIA H200" in text and "2.13" not in text
    assert "| `test_x::test_b` | passed | FAILED | 1.5 |" in text and text.rstrip().endswith("1 passed, 1 failed")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu" / "summary.py"), str(fresh)], capture_output=True, timeout=60
    )
    assert (fresh / "versions.txt").read_text().startswith("python ")  # probed once, then kept


def test_gpu_suite_leaves_each_case_as_it_finishes(tmp_path):
    """Under run.sh every finished case is appended to OUT/progress-*.tsv (conftest.py), so a stage cut
    by an outer time limit, which never writes its JUnit report, is still summarised from them."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu/test_generate_graph.py", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OCCULT_GPU_SUITE_OUT": str(tmp_path)},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line.split("\t") for line in (tmp_path / "progress-single.tsv").read_text().splitlines()]
    assert rows and all(r[0].startswith("tests/gpu/test_generate_graph.py::") for r in rows)
    assert {r[1] for r in rows} == {"skipped"}  # no GPU here: skipped at setup, recorded all the same
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "versions.txt").write_text("python 3.12.3\n")
    for r, last in ((0, "passed"), (1, "FAILED")):
        (cut / f"progress-rank{r}.tsv").write_text(
            f"tests/gpu/test_x.py::test_a[bf16]\tpassed\t2.0\ntests/gpu/test_x.py::test_b\t{last}\t1.5\n"
        )
    (cut / "progress-single.tsv").write_text("tests/gpu/test_y.py::test_c\tpassed\t3.0\n")
    (cut / "single3.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_z" name="test_d" time="4.0"/>'
        "</testsuite></testsuites>"
    )
    res = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu" / "summary.py"), str(cut)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    text = (cut / "summary.md").read_text()
    assert "## Stage 1: collective tests, 2 ranks (cut before its end" in text
    assert (
        "| `test_x::test_a[bf16]` | passed | passed | 2.0 |" in text
        and "| `test_x::test_b` | passed | FAILED | 1.5 |" in text
    )
    assert (
        "## Stage 2: single-process GPU tests (cut before its end" in text
        and "| `test_y::test_c` | passed | 3.0 |" in text
    )
    assert "## Stage 3: single-process GPU tests\n" in text and "| `test_z::test_d` | passed | 4.0 |" in text
    assert text.rstrip().endswith("3 passed, 1 failed")
