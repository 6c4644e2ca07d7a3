"""The main job (`occult demo`) and `occult bench` run end to end on CPU ranks and check themselves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _occult(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "occult", *args], capture_output=True, text=True, timeout=timeout)


def test_demo_runs_and_variants_agree():
    proc = _occult(
        "demo",
        "--world-size",
        "2",
        "--tokens",
        "96",
        "--steps",
        "1",
        "--hidden",
        "32",
        "--ffn",
        "16",
        "--experts",
        "8",
        "--top-k",
        "4",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""  # no progress bar: stderr is not a terminal
    out = proc.stdout
    assert "All variants match the dense reference" in out
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split() and line.split()[0] in ("standard", "dedup", "dedup+placement")
    }
    assert set(rows) == {"standard", "dedup", "dedup+placement"}
    sent = {name: int(r[2]) for name, r in rows.items()}
    assert sent["standard"] == 2 * 2 * 96 * 4  # dispatch + combine, T*k rows on each of 2 ranks
    assert sent["dedup+placement"] <= sent["dedup"] < sent["standard"]
    # the speed line names the variant, gives the table's ratio, says how it was measured and that CPU timing is noisy
    table = {name: float(r[-2]) for name, r in rows.items()}  # fwd+bwd ms
    line = next(part for part in out.split("; ") if part.startswith("fwd+bwd of dedup+placement vs standard: "))
    shown = float(line.split(": ")[1].split("x by the table's median times")[0])
    # the table rounds to 0.1 ms: the ratio of the rounded times is within that rounding of the ratio shown
    slack = 0.05 * (1 / table["dedup+placement"] + table["standard"] / table["dedup+placement"] ** 2) + 0.005
    assert shown == pytest.approx(table["standard"] / table["dedup+placement"], abs=slack), out
    assert "per round (median of 1 interleaved round(s)' ratios; noisy CPU timing)" in out
    assert "times are noisy" in out


def test_demo_speed_line_gives_the_tables_ratio_and_the_median_of_per_round_ratios():
    from occult.tools.demo import round_times, speed_line

    def rank(std, best):
        return {"standard": {"step_ms_all": std}, "dedup+placement": {"step_ms_all": best}}

    # round i's time is its slowest rank's: standard [10, 10, 40], dedup+placement [5, 10, 10]
    results = [rank([10, 10, 40], [5, 10, 10]), rank([8, 10, 10], [5, 5, 10])]
    assert round_times(results, "standard", "step_ms_all") == [10, 10, 40]
    # the table's medians give 10 / 10 = 1.00x; the per-round ratios 2, 1, 4 have the median 2.00x
    assert speed_line(results, noisy=True) == (
        "fwd+bwd of dedup+placement vs standard: 1.00x by the table's median times, 2.00x per round "
        "(median of 3 interleaved round(s)' ratios, range 1.00-4.00x; noisy CPU timing)"
    )
    assert speed_line(results, noisy=False).endswith("range 1.00-4.00x)")


def test_demo_check_fails_on_a_nan_wherever_it_is():
    import math

    from occult.tools.demo import worst_error

    assert worst_error([1e-6, 3e-5, 2e-6]) == 3e-5
    for errors in ([float("nan"), 1e-6], [1e-6, float("nan")]):
        assert math.isnan(worst_error(errors))  # max([1e-6, nan]) alone is 1e-6: a silent pass


def test_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = _occult(
        "bench",
        "--world-size",
        "2",
        "--tokens",
        "64",
        "--iters",
        "1",
        "--warmup",
        "1",
        "--input-sets",
        "1",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("shape"))
    assert lines.count(header) == 1  # the table is printed once, row by row as measured
    rows = [line for line in lines if line.startswith("tiny ")]
    # no syncs nor host time to count on CPU; the count exchange (no device transport without GPUs)
    assert len(rows) == 6 and all(line.split()[-3:] == ["n/a", "n/a", "counts"] for line in rows)
    legend = proc.stdout[proc.stdout.index("columns:") :]
    for column in (
        "E[C_T]",
        "fwd ms",
        "fwd+bwd",
        "floor",
        "experts",
        "a2a ms",
        "a2a GB/s",
        "TFLOP/s",
        "rel err",
        "syncs",
    ):
        assert f"  {column}" in legend or f", {column}" in legend, column
    result = json.loads(out.read_text())
    runs = {(r["routing"], r["variant"]): r for r in result["runs"]}
    assert len(runs) == 6  # 2 routings x 3 variants
    assert result["config"]["device"] == "cpu" and result["config"]["link"] == "cpu"  # where and from what code
    assert {"commit", "dirty", "date"} <= set(result["config"])
    for r in runs.values():
        assert r["rel_error"] < 1e-4 and r["host_syncs_fwd_bwd"] is None and r["expert_gflop_fwd"] > 0
    assert "layer MFU" not in proc.stdout  # no matmul rate measured on CPU
    assert runs[("random", "standard")]["mean_ct"] == 4.0  # tiny shape: top-4
    assert runs[("random", "dedup")]["mean_ct"] < 4.0


def test_bench_two_level_on_simulated_nodes(tmp_path):
    out = tmp_path / "bench.json"
    proc = _occult(
        "bench",
        "--world-size",
        "4",
        "--nodes",
        "2",
        "--variants",
        "dedup,dedup2",
        "--routing",
        "random",
        "--tokens",
        "32",
        "--iters",
        "1",
        "--warmup",
        "1",
        "--input-sets",
        "1",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {r["variant"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["dedup2"]["rel_error"] < 1e-4 and runs["dedup"]["rel_error"] < 1e-4


def _occult_here(capsys, *args: str) -> tuple[int, str, str]:
    """`occult ARGS` in this process (`occult.cli.main`, what `python -m occult` runs): (exit status, stdout,
    stderr); an argparse error's SystemExit becomes its status."""
    from occult.cli import main

    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_rejects_bad_shape(capsys):
    """Refused before any rank starts (in this process: no interpreter start per case; the entry point's
    exit statuses: tests/cli/test_usage.py)."""
    code, _, err = _occult_here(capsys, "bench", "--shapes", "nope")
    assert code == 2 and "unknown shape" in err
    code, out, err = _occult_here(capsys, "bench", "--world-size", "2", "--nodes", "3", "--backend", "gloo")
    assert code == 2 and "--nodes 3" in err and out == ""
    code, _, err = _occult_here(capsys, "bench", "--overlap-chunks", "2")  # removed (issue 36): an argparse error
    assert code == 2 and "unrecognized arguments: --overlap-chunks" in err


def test_bench_variants_read_sync_free_and_refuse_the_removed_chunks():
    import argparse

    from occult.cli.tools import BENCH_VARIANTS, choice_list
    from occult.tools.bench import variant_dispatcher, variant_sync_free, variant_transport

    parse = choice_list(BENCH_VARIANTS, "variant")
    assert parse("dedup@syncfree/graph,dedup") == ["dedup@syncfree/graph", "dedup"]
    assert [variant_sync_free(v) for v in ("dedup@syncfree/graph", "dedup@device/graph", "dedup")] == [
        True,
        False,
        False,
    ]
    assert (
        variant_dispatcher("dedup@syncfree/graph") == "dedup" and variant_transport("dedup@syncfree/graph") != "device"
    )
    for removed in ("dedup@chunks4/graph", "dedup@chunks2/graph"):  # the chunked schedule (removed, issue 36)
        with pytest.raises(argparse.ArgumentTypeError, match="chunks"):
            parse(removed)


def _on_a_terminal(*args: str) -> tuple[int, str, str]:
    """`python -m occult ARGS` with stderr a pseudo-terminal: (exit status, stdout, what the terminal got)."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns (a new one has 0)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "occult", *args], stdout=subprocess.PIPE, stderr=slave, text=True
        )
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not chunk:
                break
            seen += chunk
        out, _ = proc.communicate(timeout=300)
    finally:
        os.close(master)
    return proc.returncode, out, seen.decode(errors="replace")


def test_demo_draws_rank_0s_progress_bar_on_a_terminal_only():
    """stderr a terminal: rank 0's bar of the rounds, once (not once per rank); with `-q` nothing
    (and nothing when stderr is not a terminal: test_demo_runs_and_variants_agree)."""
    small = [
        "demo",
        "--world-size",
        "2",
        "--tokens",
        "64",
        "--steps",
        "3",
        "--hidden",
        "32",
        "--ffn",
        "16",
        "--experts",
        "8",
        "--top-k",
        "4",
    ]
    code, out, term = _on_a_terminal(*small)
    assert code == 0, out + term
    assert "demo rounds" in term and "4/4" in term
    assert term.count("0/4") == 1  # rank 0 alone
    code, out, term = _on_a_terminal(*small, "-q")
    assert code == 0 and term == "", out + term
