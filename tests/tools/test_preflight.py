"""`occult demo` and `occult bench` refuse, before any rank starts, what they could not run: sizes that
cannot be allocated, Triton or the device transport on CPU ranks, the two-level dispatch without
nodes. Each is one line naming the flag, exit status 2 (no rank is started: these are cheap)."""

from __future__ import annotations

import argparse

import pytest
import torch

from occult.tools import preflight
from occult.tools.bench import check_variants
from occult.tools.preflight import MemoryNeed, check_fits, out_of_memory, rank_failure
from tests.cli._cli_helpers import one_clean_line, run_main

HUGE = 10**12  # tokens: petabytes of activations on any machine


@pytest.mark.parametrize(
    "argv, named",
    [
        (["demo", "--tokens", HUGE], f"--tokens {HUGE}"),
        (["demo", "--hidden", 10**9], f"--hidden {10**9}"),
        (["demo", "--ffn", 10**9, "--world-size", 2], f"--ffn {10**9}"),
        (["bench", "--tokens", f"64,{HUGE}"], f"--tokens {HUGE}"),  # the largest of the list
    ],
)
def test_sizes_that_cannot_be_allocated_are_refused_naming_the_flag(capsys, argv, named):
    code, out, err = run_main(capsys, *argv, "--backend", "gloo")
    flag = named.split()[0]
    one_clean_line(code, err, named, "of host memory", f"lower {flag}")
    assert "rank(s)" not in out  # refused before the ranks start


def test_check_fits_compares_the_bound_with_host_and_gpu_memory(monkeypatch):
    need = MemoryNeed(
        host_bytes=10**9, gpu_bytes_per_rank=8 * 10**9, flags={"--tokens": 9, "--hidden": 7}, given=("--hidden",)
    )
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 2 * 10**9)
    monkeypatch.setattr(preflight, "gpu_total_bytes", lambda ranks: 80 * 10**9)
    check_fits("occult demo", need, on_gpu=True, ranks=2)  # fits both
    monkeypatch.setattr(preflight, "gpu_total_bytes", lambda ranks: 4 * 10**9)
    check_fits("occult demo", need, on_gpu=False, ranks=2)  # CPU ranks: the GPUs do not matter
    with pytest.raises(
        ValueError,
        match=r"needs at least 8.0 GB of memory on each GPU, and 4.0 GB is available: "
        r"lower --hidden$",
    ):
        check_fits("occult demo", need, on_gpu=True, ranks=2)
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 5 * 10**8)
    with pytest.raises(ValueError, match="with --tokens 9, --hidden 7 needs at least 1.0 GB of host memory"):
        check_fits("occult demo", need, on_gpu=False, ranks=2)
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: None)  # unknown: nothing refused
    check_fits("occult demo", need, on_gpu=False, ranks=2)


def test_host_memory_is_known_on_linux():
    available = preflight.available_host_bytes()
    assert available is None or 0 < available < 2**60


def test_a_rank_that_ran_out_of_memory_is_one_line_naming_the_flags():
    need = MemoryNeed(flags={"--tokens": 5, "--hidden": 3}, given=())
    report = (
        "1 of 2 rank(s) failed:\n--- rank 0 ---\nRuntimeError: [enforce fail at alloc_cpu.cpp:117] data. "
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes.\nTraceback ..."
    )
    error = out_of_memory("occult bench", need, report)
    assert (
        str(error) == "occult bench ran out of memory in a rank with --tokens 5, --hidden 3: lower --tokens or --hidden"
    )
    assert out_of_memory("occult bench", need, "1 of 2 rank(s) failed:\nValueError: something else") is None
    killed = "1 of 2 rank(s) failed:\n--- rank 1 ---\nrank 1 died (exit code -9) without reporting"
    assert "a rank was killed (SIGKILL, most often out of memory)" in str(out_of_memory("occult demo", need, killed))


def test_a_failed_run_raises_the_out_of_memory_line_or_prints_the_failure(capsys):
    need = MemoryNeed(flags={"--tokens": 5}, given=())
    with pytest.raises(ValueError, match="occult demo ran out of memory in a rank with --tokens 5") as info:
        rank_failure("occult demo", need, RuntimeError("rank 0: CUDA out of memory"))
    assert info.value.__suppress_context__
    assert rank_failure("occult bench", need, RuntimeError("1 of 2 rank(s) failed: boom")) == 1
    assert capsys.readouterr().err == "occult bench: FAILED: 1 of 2 rank(s) failed: boom\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks only")
@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--expert-backend", "triton"], ["--expert-backend triton", "use --expert-backend torch"]),
        (["--variants", "dedup,standard@device"], ["--variants standard@device", "drop the @device variants"]),
        (["--variants", "dedup2", "--world-size", 2], ["--variants dedup2", "give --nodes M", "--nodes 2"]),
    ],
)
def test_bench_refuses_what_cpu_ranks_cannot_run(capsys, flags, needles):
    code, out, err = run_main(capsys, "bench", *flags)
    one_clean_line(code, err, *needles)
    assert out == ""


def test_bench_warns_about_flags_its_variants_ignore():
    with pytest.warns(UserWarning, match="--nodes 2 is used by the dedup2 variant only: ignored by --variants dedup"):
        check_variants(["dedup"], on_gpu=False, world=2, nodes=2, expert_backend="torch")
    with pytest.warns(UserWarning, match="dedup@syncfree/graph: CUDA graphs replay on GPUs only"):
        check_variants(["dedup@syncfree/graph"], on_gpu=False, world=2, nodes=1, expert_backend="auto")
    check_variants(["dedup", "dedup2"], on_gpu=False, world=4, nodes=2, expert_backend="torch")  # all used: quiet


def test_the_defaults_fit(monkeypatch):
    """The lower bounds of the default jobs are small (a few hundred MB): they are never refused."""
    from occult.tools import bench, demo

    args = argparse.Namespace(
        tokens=None,
        hidden=None,
        ffn=None,
        experts=None,
        top_k=None,
        world_size=None,
        steps=5,
        noise=0.8,
        seed=0,
        quiet=True,
        shapes=None,
    )
    need = demo.memory_need(demo.demo_config(args, "gloo"), args)
    assert need.host_bytes < 10**9 and need.given == ()
    conf = dict(shapes=["tiny"], tokens=[256], input_sets=3)
    assert bench.memory_need(conf, 2, False, args).host_bytes < 10**9


@pytest.mark.parametrize("tool", ["demo", "bench"])
def test_a_rank_out_of_memory_reaches_the_user_as_one_line(capsys, monkeypatch, tool):
    """What the lower bound lets through and a rank then fails to allocate: one line, exit 2 (the
    ranks replaced by their failure report)."""
    import importlib

    from occult.distributed import RankFailure

    module = importlib.import_module(f"occult.tools.{tool}")

    def ranks_fail(*args, **kwargs):
        raise RankFailure(
            "2 of 2 rank(s) failed:\n--- rank 0 ---\nRuntimeError: DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 8 GB\nTraceback (most recent call last): ..."
        )

    monkeypatch.setattr(module, "run_ranks", ranks_fail)
    small = ["--hidden", 32, "--ffn", 16, "--experts", 8, "--top-k", 2] if tool == "demo" else ["--shapes", "tiny"]
    code, _, err = run_main(capsys, tool, "--backend", "gloo", "--world-size", 2, "--tokens", 64, *small)
    one_clean_line(code, err, f"occult {tool} ran out of memory in a rank with --tokens 64", "lower --tokens")
