"""scripts/current_numbers.py: docs/results/CURRENT.md is what the result files give, and the newest file wins."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import current_numbers  # noqa: E402
import result_provenance  # noqa: E402
import targets_report  # noqa: E402

sys.path.pop(0)


def test_the_page_is_current() -> None:
    """CURRENT.md cannot drift from docs/results/: regenerate it with `python scripts/current_numbers.py`."""
    run = subprocess.run([sys.executable, "scripts/current_numbers.py", "--check"], cwd=ROOT, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()


def test_every_current_result_file_has_provenance() -> None:
    provenance = json.loads(current_numbers.PROVENANCE.read_text())
    jobs = list(current_numbers.result_files(current_numbers.RESULTS))
    assert jobs
    for rel, doc, _ in jobs:  # raises SystemExit naming the file if an entry is missing or a job's disagree
        entry = result_provenance.job_provenance(rel, doc, provenance)
        assert set(entry) >= {"commit", "date", "card", "link"}, rel


def e2e(world: int, prefill_ms: dict[str, float]) -> dict:
    variants = {
        v: {"check": {"passed": True}, "phases": {"prefill": {"ms_median": ms}}} for v, ms in prefill_ms.items()
    }
    return {"config": {"model": "olmoe", "phases": ["prefill"]}, "env": {"world_size": world}, "variants": variants}


def write(folder: Path, docs: dict[str, dict], provenance: dict[str, dict]) -> None:
    for name, doc in docs.items():
        (folder / name).write_text(json.dumps(doc))
    (folder / "provenance.json").write_text(json.dumps(provenance))


def prov(date: str, **extra: object) -> dict:
    return {"commit": "abc1234", "date": date, "card": "2 x H200", "link": "NVLink", **extra}


def test_the_newest_file_wins_not_the_best_nor_the_last_name(tmp_path: Path) -> None:
    older_and_better = e2e(2, {"replicated": 10.0, "dedup": 10.5})  # 1.05x
    newer_and_worse = e2e(2, {"replicated": 10.0, "dedup": 12.0})  # 1.20x
    docs = {"z_old.json": older_and_better, "a_new.json": newer_and_worse}
    write(
        tmp_path,
        docs,
        {"z_old.json": prov("2026-11-20T00:00:00+00:00"), "a_new.json": prov("2026-11-21T00:00:00+00:00")},
    )
    page = current_numbers.render(tmp_path, tmp_path / "provenance.json")
    assert "| 1.200x |" in page and "a_new.json" in page
    assert "1.050x" not in page and "z_old.json" not in page


def test_two_jobs_of_one_date_need_a_run_number(tmp_path: Path) -> None:
    docs = {
        "a.json": e2e(2, {"replicated": 10.0, "dedup": 11.0}),
        "b.json": e2e(2, {"replicated": 10.0, "dedup": 12.0}),
    }
    same = prov("2026-11-21T00:00:00+00:00")
    write(tmp_path, docs, {"a.json": same, "b.json": same})
    try:
        current_numbers.render(tmp_path, tmp_path / "provenance.json")
        raise AssertionError("a tie went unnoticed")
    except SystemExit as e:
        assert "tie" in str(e)
    write(tmp_path, docs, {"a.json": prov(same["date"], run=1), "b.json": same})
    assert "| 1.100x |" in current_numbers.render(tmp_path, tmp_path / "provenance.json")


def test_merged_files_are_not_read(tmp_path: Path) -> None:
    merged = {**e2e(2, {"replicated": 10.0, "dedup": 11.0}), "sources": {"x.json": ["dedup"]}}
    write(tmp_path, {"merged.json": merged}, {})
    assert "merged.json" not in current_numbers.render(tmp_path, tmp_path / "provenance.json")


def test_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    write(
        tmp_path, {"a.json": e2e(2, {"replicated": 10.0, "dedup": 11.0})}, {"a.json": prov("2026-11-21T00:00:00+00:00")}
    )
    assert current_numbers.main(["--results", str(tmp_path)]) == 0
    assert current_numbers.main(["--results", str(tmp_path), "--check"]) == 0
    (tmp_path / "CURRENT.md").write_text("edited by hand\n")
    assert current_numbers.main(["--results", str(tmp_path), "--check"]) == 1


def test_targets_report_keeps_the_newest_file_per_target(tmp_path: Path) -> None:
    """scripts/targets_report.py: one verdict per target, from the newest file by provenance, not the best."""
    docs = {
        "old.json": e2e(2, {"replicated": 10.0, "dedup": 10.2}),
        "new.json": e2e(2, {"replicated": 10.0, "dedup": 12.0}),
    }
    write(
        tmp_path, docs, {"old.json": prov("2026-11-20T00:00:00+00:00"), "new.json": prov("2026-11-21T00:00:00+00:00")}
    )
    rows = [r for r in targets_report.report([str(tmp_path)]).splitlines() if "whole model (olmoe)" in r]
    assert len(rows) == 1 and "1.200x" in rows[0] and "new.json" in rows[0] and "MISSED" in rows[0]


def test_a_file_recording_its_own_commit_and_date_needs_no_provenance_and_its_record_wins(tmp_path: Path) -> None:
    """A result written since the benchmarks record commit and date (occult/tools/run_record.py): ordered by
    the run's date, its commit shown (dirty marked); provenance.json only for the files that lack a record."""
    own = e2e(2, {"replicated": 10.0, "dedup": 12.0})  # 1.20x
    own["env"].update(
        gpu="NVIDIA H100 80GB HBM3", commit="0123456789ab", dirty=True, date="2026-11-28T05:00:00+00:00", link="nvlink"
    )
    older = e2e(2, {"replicated": 10.0, "dedup": 10.5})  # 1.05x, added by a later commit than own's run
    newer = e2e(2, {"replicated": 10.0, "dedup": 11.0})  # 1.10x
    entries = {"older.json": prov("2026-11-27T00:00:00+00:00"), "newer.json": prov("2026-11-29T00:00:00+00:00")}
    write(tmp_path, {"own.json": own, "older.json": older}, entries)
    assert current_numbers.main(["--results", str(tmp_path), "--stamp"]) == 0  # nothing to ask git for
    assert "own.json" not in json.loads((tmp_path / "provenance.json").read_text())
    row = next(r for r in current_numbers.render(tmp_path, tmp_path / "provenance.json").splitlines() if "own" in r)
    assert row.startswith("| 2 | NVLink | olmoe | prefill | 1.200x |")
    assert "| 2 x H100 | `0123456-dirty` | 2026-11-28 |" in row
    # an entry for the file itself loses to its record (card and link still taken from the entry)
    write(tmp_path, {"own.json": own}, {**entries, "own.json": prov("2026-11-30T00:00:00+00:00", commit="fff0000")})
    page = current_numbers.render(tmp_path, tmp_path / "provenance.json")
    assert "| 2 x H200 | `0123456-dirty` | 2026-11-28 |" in page and "fff0000" not in page
    write(tmp_path, {"own.json": own, "newer.json": newer}, entries)  # a newer run by provenance wins over it
    page = current_numbers.render(tmp_path, tmp_path / "provenance.json")
    assert "| 1.100x |" in page and "own.json" not in page
    own["env"]["date"] = "2026-11-28"  # no time zone: not a record; then provenance.json must have the file
    (tmp_path / "alone").mkdir()
    write(tmp_path / "alone", {"own.json": own}, {})
    try:
        current_numbers.render(tmp_path / "alone", tmp_path / "alone" / "provenance.json")
        raise AssertionError("a file without a usable record nor an entry went unnoticed")
    except SystemExit as e:
        assert "own.json" in str(e) and "provenance.json" in str(e)


def test_targets_report_orders_a_file_by_its_own_record(tmp_path: Path) -> None:
    """scripts/targets_report.py: a file's recorded run date, not its modification time (just now), orders it."""
    own = e2e(2, {"replicated": 10.0, "dedup": 12.0})
    own["env"].update(commit="0123456789ab", dirty=False, date="2026-11-26T05:00:00+00:00", link="nvlink")
    docs = {"own.json": own, "newer.json": e2e(2, {"replicated": 10.0, "dedup": 10.2})}
    write(tmp_path, docs, {"newer.json": prov("2026-11-27T00:00:00+00:00")})
    rows = [r for r in targets_report.report([str(tmp_path)]).splitlines() if "whole model (olmoe)" in r]
    assert len(rows) == 1 and "newer.json" in rows[0] and "1.020x" in rows[0]


def test_a_folder_of_training_runs_takes_its_runs_records_when_all_have_one(tmp_path: Path) -> None:
    """One two_gpu_training.sh call's runs (a folder, one job): its commit if all agree, its newest date."""

    def run(variant: str, tokens_per_s: float, date: str, commit: str = "0123456789ab") -> dict:
        env = {"world_size": 2, "gpu": "NVIDIA H100 80GB HBM3", "commit": commit, "dirty": False, "date": date}
        return {"variant": variant, "tokens_per_s": tokens_per_s, "link": "nvlink", "gpus": 2, "env": env}

    (tmp_path / "job").mkdir()
    runs = {
        "job/a.json": run("dedup_ddp", 1100.0, "2026-11-28T01:00:00+00:00"),
        "job/b.json": run("dedup_counts_ddp", 1000.0, "2026-11-28T02:00:00+00:00"),
    }
    write(tmp_path, runs, {})
    row = next(r for r in current_numbers.render(tmp_path, tmp_path / "provenance.json").splitlines() if "job/" in r)
    assert "| 1.100x |" in row and "| 2 x H100 | `0123456` | 2026-11-28 |" in row
    runs["job/b.json"] = run("dedup_counts_ddp", 1000.0, "2026-11-28T02:00:00+00:00", commit="fedcba987654")
    write(tmp_path, runs, {})  # two commits: not one job's record, so provenance.json must have the files
    try:
        current_numbers.render(tmp_path, tmp_path / "provenance.json")
        raise AssertionError("runs of two commits went unnoticed")
    except SystemExit as e:
        assert "provenance.json" in str(e)


def megatron(date: str, alltoall: float, occult: float, model: str = "olmoe") -> dict:
    """A benchmarks/megatron_train.py result: tokens/s per GPU per variant, losses per step, its own record."""
    env = {"world_size": 2, "gpu": "NVIDIA H200", "link": "nvlink", "commit": "0123456789ab", "dirty": False}
    env.update(date=date, megatron_core="0.19.2", transformer_engine=False)
    losses = {"alltoall": [10.0, 8.0], "occult": [10.01, 8.0]}  # max rel. diff 1e-3
    variants = {
        v: {"expert_module": "SequentialMLP", "losses": losses[v], "tokens_per_s_per_gpu": t, "step_ms_median": 1e6 / t}
        for v, t in (("alltoall", alltoall), ("occult", occult))
    }
    return {"args": {"model": model, "layers": 4}, "env": env, "variants": variants}


def test_a_megatron_job_gives_occult_over_alltoall_and_the_newest_job_wins(tmp_path: Path) -> None:
    """benchmarks/megatron_train.py: one row per (GPUs, link, model, layers), both sides from the newest job."""
    write(tmp_path, {"old.json": megatron("2026-11-28T01:00:00+00:00", 20000.0, 25000.0)}, {})
    rows = [r for r in current_numbers.render(tmp_path, tmp_path / "provenance.json").splitlines() if ".json" in r]
    assert rows == [
        "| 2 | NVLink | olmoe | 4 | 1 | plain | SequentialMLP (no TE) | 20,000 | 25,000 | 1.25x | 1.0e-03 | 2 x H200 | "
        "`0123456` | 2026-11-28 | [old.json](old.json) |"
    ]
    docs = {
        "old.json": megatron("2026-11-28T01:00:00+00:00", 20000.0, 25000.0),
        "new.json": megatron("2026-11-28T02:00:00+00:00", 20000.0, 22000.0),  # newer and worse: it wins
        "qwen3.json": megatron("2026-11-27T00:00:00+00:00", 10000.0, 9000.0, model="qwen3"),  # another question
    }
    write(tmp_path, docs, {})
    rows = [r for r in current_numbers.render(tmp_path, tmp_path / "provenance.json").splitlines() if ".json" in r]
    assert len(rows) == 2 and "| 1.10x |" in rows[0] and "new.json" in rows[0] and "old.json" not in "".join(rows)
    assert rows[1].startswith("| 2 | NVLink | qwen3 | 4 | 1 | plain |") and "| 0.90x |" in rows[1]


def test_a_megatron_job_with_the_overlap_gives_a_row_per_schedule(tmp_path: Path) -> None:
    """A job of 4 micro-batches a step with `+overlap` variants: a plain row and an overlap row, each pair from
    the job; a job of another micro-batch count is another question (it does not replace the other's row)."""
    job = megatron("2026-11-29T01:00:00+00:00", 20000.0, 24000.0)
    job["args"]["micro_batches"] = 4
    job["variants"]["alltoall+overlap"] = dict(job["variants"]["alltoall"], tokens_per_s_per_gpu=21000.0)
    job["variants"]["occult+overlap"] = dict(job["variants"]["occult"], tokens_per_s_per_gpu=27300.0)
    docs = {"overlap.json": job, "plain.json": megatron("2026-11-28T01:00:00+00:00", 20000.0, 22000.0)}
    write(tmp_path, docs, {})
    rows = [r for r in current_numbers.render(tmp_path, tmp_path / "provenance.json").splitlines() if ".json" in r]
    assert [r.split(" | ")[:6] for r in rows] == [
        ["| 2", "NVLink", "olmoe", "4", "1", "plain"],
        ["| 2", "NVLink", "olmoe", "4", "4", "overlap"],
        ["| 2", "NVLink", "olmoe", "4", "4", "plain"],
    ]
    assert "| 1.10x |" in rows[0] and "| 1.30x |" in rows[1] and "| 1.20x |" in rows[2]


def test_a_megatron_job_with_grouped_experts_gives_the_dispatcher_and_the_whole_against_megatron(
    tmp_path: Path,
) -> None:
    """`+grouped` variants (occult's grouped experts on both sides): a row of occult's dispatcher against Megatron's
    alltoall on the same grouped experts (plain and overlap), and one of occult's fastest variant against
    Megatron's alltoall with its own experts, all from the one job."""
    job = megatron("2026-11-29T01:00:00+00:00", 20000.0, 24000.0)
    job["args"]["micro_batches"] = 4
    grouped = dict(job["variants"]["alltoall"], expert_module="TEGroupedMLP(GroupedLinear)")
    for name, tokens in (
        ("alltoall+grouped", 25000.0),
        ("occult+grouped", 30000.0),
        ("occult+grouped+overlap", 32000.0),
    ):
        job["variants"][name] = dict(grouped, tokens_per_s_per_gpu=tokens, step_ms_median=1e6 / tokens)
    job["variants"]["alltoall+grouped+overlap"] = dict(grouped, tokens_per_s_per_gpu=26000.0)
    del job["variants"]["occult"]
    write(tmp_path, {"grouped.json": job}, {})
    rows = [r for r in current_numbers.render(tmp_path, tmp_path / "provenance.json").splitlines() if ".json" in r]
    cells = [r.split(" | ") for r in rows]
    assert [(c[5], c[9]) for c in cells] == [
        ("fastest occult (occult+grouped+overlap) / Megatron's alltoall", "1.60x"),
        ("grouped", "1.20x"),
        ("grouped+overlap", "1.23x"),
    ], rows
    assert cells[0][6] == "SequentialMLP / TEGroupedMLP(GroupedLinear) (no TE)"


def test_occults_fastest_megatron_variant_is_measured_against_megatrons_fastest_own(tmp_path: Path) -> None:
    """Where Megatron's own overlap beats its plain `alltoall`, occult's fastest variant gets a second whole-model row
    against it (a user would run it); never against a `+grouped` variant (those experts are occult's)."""
    job = megatron("2026-11-29T01:00:00+00:00", 20000.0, 24000.0)
    job["args"]["micro_batches"] = 8
    grouped = dict(job["variants"]["alltoall"], expert_module="TEGroupedMLP(GroupedLinear)")
    for name, tokens, variant in (
        ("alltoall+overlap", 22000.0, job["variants"]["alltoall"]),
        ("alltoall+grouped+overlap", 30000.0, grouped),
        ("occult+grouped+overlap", 33000.0, grouped),
    ):
        job["variants"][name] = dict(variant, tokens_per_s_per_gpu=tokens, step_ms_median=1e6 / tokens)
    del job["variants"]["occult"]
    write(tmp_path, {"grouped.json": job}, {})
    rows = [r for r in current_numbers.render(tmp_path, tmp_path / "provenance.json").splitlines() if ".json" in r]
    cells = [r.split(" | ") for r in rows]
    whole = [c for c in cells if c[5].startswith("fastest occult")]
    assert [(c[5], c[9]) for c in whole] == [
        ("fastest occult (occult+grouped+overlap) / Megatron's alltoall", "1.65x"),
        ("fastest occult (occult+grouped+overlap) / Megatron's fastest own (alltoall+overlap)", "1.50x"),
    ], rows


def test_a_one_gpu_job_of_compiled_variants_alone_gives_the_compiled_ratio(tmp_path: Path) -> None:
    """transformers + compile_layers against occult + compile_layers on one GPU, without the eager variants."""
    doc = e2e(1, {"native/compile": 46.0, "replicated/compile": 40.0})
    write(tmp_path, {"one.json": doc}, {"one.json": prov("2026-11-29T00:00:00+00:00", card="1 x H200")})
    page = current_numbers.render(tmp_path, tmp_path / "provenance.json")
    row = next(line for line in page.splitlines() if "one.json" in line)
    assert "| prefill | - | 1.15x (46.00 / 40.00) | - |" in row, row  # no eager pair; compiled 46.0 / 40.0


def test_a_file_run_under_changed_settings_says_so_beside_its_source(tmp_path: Path) -> None:
    """A result recorded under settings other than the defaults (run_record's `env.settings`) or NCCL tuning
    (`env.nccl`, beyond what every run sets) or CUDA driver tuning (`env.cuda`) names them."""
    doc = e2e(2, {"replicated": 10.0, "dedup": 11.0})
    doc["env"]["settings"] = {"OCCULT_GEMM1": "triton", "OCCULT_AGREEMENT": "step"}
    doc["env"]["nccl"] = {"NCCL_NVLS_ENABLE": "0", "NCCL_P2P_DISABLE": "1", "NCCL_BUFFSIZE": "16777216"}
    doc["env"]["cuda"] = {"CUDA_SCALE_LAUNCH_QUEUES": "4x", "CUDA_VERSION": "13.0.2"}  # (the toolkit's: not said)
    plain = e2e(2, {"replicated": 10.0, "dedup": 11.0})
    plain["config"]["model"], plain["env"]["settings"] = "qwen3", {}
    plain["env"]["nccl"] = {"NCCL_NVLS_ENABLE": "0", "NCCL_P2P_DISABLE": "1", "NCCL_VERSION": "2.28.3-1"}  # no tuning
    entries = {n: prov("2026-11-29T00:00:00+00:00") for n in ("changed.json", "plain.json")}
    write(tmp_path, {"changed.json": doc, "plain.json": plain}, entries)
    page = current_numbers.render(tmp_path, tmp_path / "provenance.json")
    row = next(line for line in page.splitlines() if "changed.json" in line)
    under = "(under CUDA_SCALE_LAUNCH_QUEUES=4x, NCCL_BUFFSIZE=16777216, OCCULT_AGREEMENT=step, OCCULT_GEMM1=triton)"
    assert row.endswith(f"[changed.json](changed.json) {under} |"), row
    assert next(line for line in page.splitlines() if "plain.json" in line).endswith("[plain.json](plain.json) |")


def test_the_fastest_ep_variants_host_time_per_moe_call_is_shown(tmp_path: Path) -> None:
    """e2e.py files since session 21 record host ms per MoE layer call; the page shows the fastest EP variant's
    (not another variant's), and '-' for a file without it."""
    job = e2e(2, {"replicated": 10.0, "dedup": 11.0, "dedup@device": 10.5})
    job["variants"]["dedup"]["phases"]["prefill"]["host_ms_per_moe_call"] = 0.9
    job["variants"]["dedup@device"]["phases"]["prefill"]["host_ms_per_moe_call"] = 0.125
    older = e2e(4, {"replicated": 10.0, "dedup": 11.0})
    write(
        tmp_path,
        {"new.json": job, "old.json": older},
        {"new.json": prov("2026-11-29T00:00:00+00:00"), "old.json": prov("2026-11-21T00:00:00+00:00")},
    )
    page = current_numbers.render(tmp_path, tmp_path / "provenance.json")
    row = next(line for line in page.splitlines() if "dedup@device 10.50 ms" in line)
    assert "| 0.125 |" in row and "0.900" not in page
    old_row = next(line for line in page.splitlines() if line.startswith("| 4 |"))
    assert "| 1.100x | dedup 11.00 ms | replicated 10.00 ms | - | - | - |" in old_row


def test_the_ep_ratio_back_to_back_is_the_same_two_variants(tmp_path: Path) -> None:
    """e2e.py since session 47 also times each phase back to back: the page gives the fastest EP variant over the
    floor (both chosen on the steps from an idle GPU) from those medians too, never another pair's."""
    job = e2e(2, {"replicated": 10.0, "replicated/compile": 9.0, "dedup": 11.0, "dedup@device": 10.5})
    for v, ms in (("replicated", 8.0), ("replicated/compile", 8.5), ("dedup", 7.0), ("dedup@device", 9.35)):
        job["variants"][v]["phases"]["prefill"]["ms_back_to_back_median"] = ms
    write(tmp_path, {"new.json": job}, {"new.json": prov("2026-12-01T00:00:00+00:00")})
    page = current_numbers.render(tmp_path, tmp_path / "provenance.json")
    row = next(line for line in page.splitlines() if "dedup@device 10.50 ms" in line)
    assert row.count("|") > 10 and "| 1.100x (9.35 / 8.50 ms) |" in row


def test_a_train_step_of_accumulated_micro_batches_is_its_own_question(tmp_path: Path) -> None:
    """e2e.py --accumulate K: its train figure is "train xK", beside (never instead of) the one-batch step's, even
    when newer."""

    def train_job(ms: dict[str, float], accumulate: int) -> dict:
        variants = {v: {"check": {"passed": True}, "phases": {"train": {"ms_median": t}}} for v, t in ms.items()}
        config = {"model": "olmoe", "phases": ["train"], "accumulate": accumulate}
        return {"config": config, "env": {"world_size": 2}, "variants": variants}

    docs = {
        "one.json": train_job({"replicated": 100.0, "dedup": 120.0}, 1),
        "four.json": train_job({"replicated": 400.0, "dedup": 420.0}, 4),
    }
    write(
        tmp_path,
        docs,
        {"one.json": prov("2026-11-20T00:00:00+00:00"), "four.json": prov("2026-11-21T00:00:00+00:00")},
    )
    page = current_numbers.render(tmp_path, tmp_path / "provenance.json")
    rows = [line for line in page.splitlines() if line.startswith("| 2 |") and "olmoe" in line]
    assert any("| train | 1.200x |" in r and "one.json" in r for r in rows), rows
    assert any("| train x4 | 1.050x |" in r and "four.json" in r for r in rows), rows


def test_a_one_gpu_job_of_transformers_compiled_and_a_recorded_step_gives_the_fastest_ratio(tmp_path: Path) -> None:
    """native/compile beside occult's recorded step alone (no replicated/compile): the page still answers
    "transformers compiled / occult's fastest" from that job, the newest, with "-" where a side is missing."""
    old = e2e(1, {"native/compile": 46.0, "replicated/compile": 40.0, "replicated/compile/stepgraph": 37.0})
    new = e2e(1, {"native/compile": 45.0, "replicated/compile/stepgraph": 38.0})
    entries = {
        "old.json": prov("2026-11-28T00:00:00+00:00", card="1 x H200"),
        "new.json": prov("2026-11-29T00:00:00+00:00", card="1 x H200"),
    }
    write(tmp_path, {"old.json": old, "new.json": new}, entries)
    rows = [
        line
        for line in current_numbers.render(tmp_path, tmp_path / "provenance.json").splitlines()
        if ".json](" in line
    ]
    native = [r for r in rows if "| prefill | " in r and "stepgraph" in r]
    assert len(native) == 1 and "new.json" in native[0], rows
    assert "| prefill | - | - | - | 1.18x (45.00 / replicated/compile/stepgraph 38.00)" in native[0], native[0]
    # what each side's user ran, where the job records it (e2e.py --optimizer adamw, --loss occult)
    new["variants"]["native/compile"]["phases"]["prefill"]["optimizer"] = "torch AdamW"
    new["variants"]["native/compile"]["loss"] = "transformers ForCausalLMLoss"
    new["variants"]["replicated/compile/stepgraph"]["phases"]["prefill"]["optimizer"] = "occult AdamW"
    new["variants"]["replicated/compile/stepgraph"]["loss"] = "occult cross_entropy"
    write(tmp_path, {"old.json": old, "new.json": new}, entries)
    page = current_numbers.render(tmp_path, tmp_path / "provenance.json")
    assert (
        "(45.00 / replicated/compile/stepgraph 38.00), torch AdamW + transformers ForCausalLMLoss / "
        "occult AdamW + occult cross_entropy |" in page
    )


def test_training_runs_that_record_their_model_are_a_question_of_their_own(tmp_path: Path) -> None:
    """Two two_gpu_training.sh jobs, the newer at another model size (SIZE=olmoe): both rows stay, each with the
    model its runs trained (runs that record none: the script's default size, its only one before SIZE);
    targets_report names the size in its label too."""

    def job(tps: dict[str, float], date: str, model: dict | None) -> dict:
        env = {"world_size": 2, "gpu": "NVIDIA H200", "commit": "0123456789ab", "dirty": False, "date": date}
        runs = {v: {"variant": v, "tokens_per_s_per_gpu": t, "tokens_per_s": 2 * t, "gpus": 2} for v, t in tps.items()}
        for r in runs.values():
            r.update({"model": model} if model else {})
        return {
            "link": "nvlink",
            "env": env,
            "variants": runs,
            "ratios": {"dedup_fsdp_over_dedup_ddp": 0.8 if not model else 1.05},
        }

    shape = {"hidden_size": 2048, "num_layers": 4, "num_experts": 64, "top_k": 8, "expert_ffn_size": 1024}
    docs = {
        "small/train_nvlink_2xGPU.json": job(
            {"dedup_ddp": 100.0, "dedup_fsdp": 80.0}, "2026-11-28T00:00:00+00:00", None
        ),
        "olmoe/train_nvlink_2xGPU.json": job(
            {"dedup_ddp": 100.0, "dedup_fsdp": 105.0}, "2026-11-29T00:00:00+00:00", shape
        ),
    }
    for name in docs:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    write(tmp_path, docs, {})
    rows = [r for r in current_numbers.render(tmp_path, tmp_path / "provenance.json").splitlines() if "fsdp over" in r]
    assert len(rows) == 2, rows
    small = "| 4 layers, hidden 1024, 64 experts x 512 | dedup fsdp over dedup ddp | 0.800x |"
    assert any(small in r for r in rows), rows
    assert any("| 4 layers, hidden 2048, 64 experts x 1024 | dedup fsdp over dedup ddp | 1.050x |" in r for r in rows)
    labels = [
        row[0] for name, doc in docs.items() for row in targets_report.train_rows(name, doc) if "FSDP2 / DDP" in row[0]
    ]
    assert labels == [
        "52: occult train, FSDP2 / DDP tokens/s per GPU, eager steps, 2 GPUs nvlink, 4 layers, hidden 1024, 64 experts "
        "x 512: >= 0.95",
        "52: occult train, FSDP2 / DDP tokens/s per GPU, eager steps, 2 GPUs nvlink, 4 layers, hidden 2048, 64 experts "
        "x 1024: >= 0.95",
    ]


def test_torchtitan_with_occults_dispatcher_compares_like_with_like() -> None:
    """Eager TorchTitan against the fastest eager `torchtitan+occult*`, compiled against compiled, TorchTitan's
    fastest against the fastest recorded (`/stepgraph`, which TorchTitan's own all-to-all cannot be), and eager
    TorchTitan against the fastest of all; a job without TorchTitan or without occult's dispatcher gives none."""
    timed = {
        "torchtitan": 233.0,
        "torchtitan/compile": 200.0,
        "torchtitan+occult@syncfree": 205.0,
        "torchtitan+occult+experts@syncfree": 210.0,
        "torchtitan+occult+experts@syncfree/compile": 160.0,
        "torchtitan+occult+experts@syncfree/stepgraph": 150.0,
        "torchtitan+occult+experts@syncfree/compile/stepgraph": 125.0,
        "dedup": 120.0,
    }
    eager, compiled, recorded, fastest = current_numbers.titan_dispatcher_cells(timed)
    assert eager.startswith("1.14x") and "torchtitan+occult@syncfree 205.00" in eager  # not a recorded one
    assert compiled.startswith("1.25x") and "(200.00 / torchtitan+occult+experts@syncfree/compile 160.00)" in compiled
    assert recorded.startswith("1.60x") and "(200.00 / torchtitan+occult+experts@syncfree/compile/stepgraph" in recorded
    assert fastest.startswith("1.86x")
    del timed["torchtitan/compile"]
    cells = current_numbers.titan_dispatcher_cells(timed)
    assert cells[1] == "-" and cells[2].startswith("1.86x")  # recorded: against TorchTitan's fastest left, eager
    for v in [v for v in timed if v.endswith("/stepgraph")]:
        del timed[v]
    assert current_numbers.titan_dispatcher_cells(timed)[2] == "-"
    assert current_numbers.titan_dispatcher_cells({"torchtitan": 1.0, "dedup": 1.0}) is None
    assert current_numbers.titan_dispatcher_cells({"torchtitan+occult": 1.0}) is None
