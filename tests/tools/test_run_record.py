"""occult/tools/run_record.py: the commit, date and link a result file records, found without ever failing."""

from __future__ import annotations

import os
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from occult.settings import VARIABLES
from occult.tools import run_record
from occult.tools.run_record import code_commit, link_of, parse_commit


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.delenv("OCCULT_COMMIT", raising=False)
    return monkeypatch


def git_checkout(root: Path) -> str:
    """A one-commit checkout at `root`; its HEAD."""

    def git(*args: str) -> str:
        ident = ("-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false")
        return subprocess.run(["git", *ident, *args], cwd=root, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    (root / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("commit", "-q", "-m", "one")
    return git("rev-parse", "HEAD").strip()


def test_parse_commit_reads_the_dirty_suffix() -> None:
    assert parse_commit("abc1234\n") == ("abc1234", False)
    assert parse_commit(" abc1234-dirty  anything after\n") == ("abc1234", True)
    assert parse_commit("  \n") == (None, None)


def test_git_gives_head_and_whether_tracked_files_changed(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    head = git_checkout(tmp_path)
    (tmp_path / "untracked.json").write_text("{}")  # a result being written is not a code change
    assert code_commit(tmp_path) == (head, False)
    (tmp_path / "code.py").write_text("x = 2\n")
    assert code_commit(tmp_path) == (head, True)


def test_the_variable_wins_over_git(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    git_checkout(tmp_path)
    clean_env.setenv("OCCULT_COMMIT", "feed123-dirty")
    assert code_commit(tmp_path) == ("feed123", True)


def test_without_git_the_commit_file_then_null(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    assert code_commit(tmp_path / "sub") == (None, None)  # not a checkout, no COMMIT file
    (tmp_path / "sub" / "COMMIT").write_text("beef456\nsecond line ignored\n")
    assert code_commit(tmp_path / "sub") == ("beef456", False)
    clean_env.setenv("PATH", str(tmp_path / "no-git-here"))  # git itself missing: still no exception
    assert code_commit(tmp_path / "sub") == ("beef456", False)


def test_a_checkout_above_the_root_is_not_taken_for_it(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An installed copy inside some other repository must not record that repository's commit."""
    git_checkout(tmp_path)
    (tmp_path / "site").mkdir()
    assert code_commit(tmp_path / "site") == (None, None)


def test_link_from_the_device_count_and_nccl_p2p(clean_env: pytest.MonkeyPatch) -> None:
    assert link_of(1, on_gpu=False) == link_of(4, on_gpu=False) == "cpu"
    assert link_of(1, on_gpu=True) == "single-gpu"
    assert link_of(2, on_gpu=True) == "nvlink"
    clean_env.setenv("NCCL_P2P_DISABLE", "1")
    assert link_of(2, on_gpu=True) == "pcie-or-slow: NCCL_P2P_DISABLE=1"
    assert link_of(1, on_gpu=True) == "single-gpu"


def test_the_record_has_every_field_and_a_utc_date(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in VARIABLES:  # every setting at its default (CI sets TRITON_INTERPRET, the tests
        clean_env.delenv(name, raising=False)  # OCCULT_RANK_START)
    clean_env.setenv("OCCULT_COMMIT", "abc1234")
    for name in [n for n in os.environ if n.startswith("NCCL_")]:
        clean_env.delenv(name)
    for name in [n for n in os.environ if n.startswith("CUDA_")]:
        clean_env.delenv(name)
    clean_env.setenv("NCCL_BUFFSIZE", "16777216")
    clean_env.setenv("CUDA_SCALE_LAUNCH_QUEUES", "4x")
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # which GPUs, not how they run: left out
    clean_env.setenv("CUDA_HOME", "/usr/local/cuda")  # where the toolkit is: left out too
    record = run_record.run_record(2, on_gpu=True, root=tmp_path)
    assert set(record) == {"commit", "dirty", "date", "link", "settings", "nccl", "cuda"}
    assert record["nccl"] == {"NCCL_BUFFSIZE": "16777216"}  # NCCL's own tuning, recorded as the process had it
    assert record["cuda"] == {"CUDA_SCALE_LAUNCH_QUEUES": "4x"}  # the driver's, likewise
    assert (record["commit"], record["dirty"], record["link"]) == ("abc1234", False, "nvlink")
    assert record["settings"] == {}  # nothing but the commit set: every setting at its default
    clean_env.setenv("OCCULT_GEMM1", "Triton")
    clean_env.setenv("OCCULT_AGREEMENT", "call")  # set to its default: not a change
    assert run_record.run_record(1, on_gpu=True, root=tmp_path)["settings"] == {"OCCULT_GEMM1": "triton"}
    date = datetime.fromisoformat(str(record["date"]))
    assert date.utcoffset() == timedelta(0)
    assert abs(datetime.now(timezone.utc) - date) < timedelta(minutes=5)


def test_a_training_jobs_env_is_its_runs_where_they_agree() -> None:
    """scripts/_train_summary.py: the link report's env block from its multi-GPU runs' (the one-GPU run left out)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    try:
        import _train_summary
    finally:
        sys.path.pop(0)
    env = {
        "world_size": 2,
        "gpu": "H100",
        "commit": "abc",
        "dirty": False,
        "date": "2026-11-27T01:00:00+00:00",
        "link": "nvlink",
    }
    runs = {
        "1gpu": {"gpus": 1, "env": {**env, "link": "single-gpu", "date": "2026-11-28T00:00:00+00:00"}},
        "floor": {"gpus": 2, "env": env},
        "dedup_ddp": {"gpus": 2, "env": {**env, "dirty": True, "date": "2026-11-27T02:00:00+00:00"}},
    }
    assert _train_summary.jobs_env(runs, 2) == {**env, "dirty": True, "date": "2026-11-27T02:00:00+00:00"}
    assert _train_summary.jobs_env(runs, 4) is None  # no 4-GPU run in this job
    runs["dedup_ddp"]["env"]["commit"] = "def"
    assert _train_summary.jobs_env(runs, 2)["commit"] is None  # two commits: none named
    assert _train_summary.jobs_env({"floor": {"gpus": 2}}, 2) is None  # runs from before env blocks


def test_the_gpu_run_scripts_export_the_commit_only_where_git_knows_it(tmp_path: Path) -> None:
    """scripts/_gpu_runs_common.sh (sourced by one_gpu_runs.sh, multi_gpu_runs.sh, four_gpu_runs.sh)."""
    common = Path(__file__).resolve().parents[2] / "scripts" / "_gpu_runs_common.sh"
    show = 'source "$1"; echo "${OCCULT_COMMIT:-unset}"'

    def sourced(script: Path, cwd: Path, **env: str) -> str:
        run = subprocess.run(
            ["bash", "-c", show, "-", str(script)],
            cwd=cwd,
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", **env},
        )
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    head = git_checkout(tmp_path)
    (tmp_path / "scripts").mkdir()
    copy = tmp_path / "scripts" / common.name
    copy.write_text(common.read_text())
    assert sourced(copy, tmp_path) == head  # the script itself is untracked: not a change of tracked code
    (tmp_path / "code.py").write_text("x = 2\n")
    assert sourced(copy, tmp_path) == f"{head}-dirty"
    bare = tmp_path / "bare" / "scripts"
    bare.mkdir(parents=True)
    (bare / common.name).write_text(common.read_text())
    assert sourced(bare / common.name, tmp_path) == "unset"  # inside another checkout: not its commit
    assert sourced(copy, tmp_path, OCCULT_COMMIT="given") == "given"
