"""The GPU suite: NCCL, half precision and real shapes (docs/testing.md).

Two kinds of test live here:
- `test_collective_*.py` run under torchrun, one pytest process per GPU (`bash tests/gpu/run.sh`):
  every rank runs the same tests in the same order, and each test is a collective.
- the rest run in one plain pytest process on a GPU machine (kernels at real shapes, a killed
  rank under NCCL, which spawns its own ranks).

Without a CUDA GPU everything here is skipped, so the CPU suite (`python -m pytest -q -n 2`) collects
it harmlessly. `OCCULT_GPU_SUITE_ON_CPU=1` runs the collective tests on CPU gloo ranks under
torchrun instead: a check of the suite's own logic, not of NCCL or the Triton kernels.
`OCCULT_GPU_SUITE_BACKEND=gloo` runs them on GPUs with gloo collectives over CUDA tensors, ranks
sharing GPUs when there are more ranks than GPUs (NCCL refuses two ranks on one GPU): everything
on the GPU is real (half precision, Triton kernels, transformers models) except NCCL itself and
the CUDA-graph capture of collectives, which are skipped.

`OCCULT_GPU_SUITE_MEMORY_GIB=G` caps the caching allocator of every pytest process of the suite at G
GiB per GPU (`torch.cuda.set_per_process_memory_fraction`), so that a larger card checks what fits a
smaller one: 78 stands for an 80 GB H100 on an H200. Ranks that a test spawns itself are not capped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

ON_CPU = os.environ.get("OCCULT_GPU_SUITE_ON_CPU", "0") == "1"
UNDER_TORCHRUN = "RANK" in os.environ and "WORLD_SIZE" in os.environ
HAVE_GPU = torch.cuda.is_available()
COLLECTIVE_TIMEOUT_S = float(os.environ.get("OCCULT_GPU_SUITE_TIMEOUT_S", "120"))
BACKEND = "gloo" if ON_CPU else os.environ.get("OCCULT_GPU_SUITE_BACKEND", "nccl")
MEMORY_GIB = os.environ.get("OCCULT_GPU_SUITE_MEMORY_GIB", "")


def memory_cap_gib(text: str) -> float | None:
    """`OCCULT_GPU_SUITE_MEMORY_GIB` as a number of GiB, None where unset; a clear error where it is not a
    positive number."""
    if not text:
        return None
    try:
        gib = float(text)
    except ValueError:
        gib = float("nan")
    if not gib > 0:
        raise pytest.UsageError(
            f"OCCULT_GPU_SUITE_MEMORY_GIB={text!r}: give a positive number of GiB (78 for an 80 GB card)"
        )
    return gib


def pytest_report_header(config):
    if MEMORY_GIB and HAVE_GPU and not ON_CPU:
        return f"gpu suite: memory capped at {MEMORY_GIB} GiB per GPU (OCCULT_GPU_SUITE_MEMORY_GIB)"
    return None


def pytest_configure(config):
    """Cap this process's GPU memory where `OCCULT_GPU_SUITE_MEMORY_GIB` asks (module docstring): the rank's
    own GPU under torchrun, every visible GPU in a single process."""
    gib = memory_cap_gib(MEMORY_GIB)
    if gib is None or ON_CPU or not HAVE_GPU:
        return
    count = torch.cuda.device_count()
    devices = [int(os.environ.get("LOCAL_RANK", 0)) % count] if UNDER_TORCHRUN else range(count)
    for index in devices:
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), index)


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        collective = os.path.basename(str(item.fspath)).startswith("test_collective_")
        if collective:
            if not (HAVE_GPU or ON_CPU):
                item.add_marker(
                    pytest.mark.skip(reason="GPU suite: no CUDA GPU (bash tests/gpu/run.sh on a GPU machine)")
                )
            elif not UNDER_TORCHRUN:
                item.add_marker(
                    pytest.mark.skip(reason="collective GPU test: run under torchrun (bash tests/gpu/run.sh)")
                )
        else:
            if not HAVE_GPU:
                item.add_marker(
                    pytest.mark.skip(reason="GPU suite: no CUDA GPU (bash tests/gpu/run.sh on a GPU machine)")
                )
            elif UNDER_TORCHRUN:
                item.add_marker(pytest.mark.skip(reason="single-process GPU test: runs in run.sh's second stage"))


def pytest_runtest_logreport(report):
    """Under run.sh (OCCULT_GPU_SUITE_OUT set): append each case's outcome to OUT/progress-rank{R}.tsv
    (stage 1), OUT/progress-single.tsv (stage 2) or OUT/progress-single3.tsv (stage 3) as it finishes,
    so a stage cut by an outer time limit still leaves what ran (pytest writes its JUnit report only at
    the end; summary.py reads these where the report is missing); a failure's traceback goes to the
    matching OUT/failures-*.txt at once."""
    out = os.environ.get("OCCULT_GPU_SUITE_OUT")
    final = (
        report.when == "call"
        or (report.when == "setup" and not report.passed)
        or (report.when == "teardown" and report.failed)
    )
    if not out or not final:
        return
    state = (
        "ERROR"
        if report.failed and report.when != "call"
        else ("FAILED" if report.failed else "skipped" if report.skipped else "passed")
    )
    stage3 = os.environ.get("OCCULT_GPU_SUITE_STAGE") == "3"
    name = (
        f"progress-rank{os.environ['RANK']}.tsv"
        if UNDER_TORCHRUN
        else ("progress-single3.tsv" if stage3 else "progress-single.tsv")
    )
    with open(os.path.join(out, name), "a") as f:
        f.write(f"{report.nodeid}\t{state}\t{report.duration:.3f}\n")
    if report.failed:  # the traceback now: pytest prints it only at the end, which a time limit may cut
        with open(os.path.join(out, name.replace("progress-", "failures-").replace(".tsv", ".txt")), "a") as f:
            f.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(autouse=True)
def fresh_transports(request):
    """Every collective case starts with the device transports' buffers freed, as a new process would
    have them: no case depends on how far earlier cases grew them (they are shared by the group's
    layers), and their memory is back for the case's own tensors. Every rank runs the same cases in
    the same order, so every rank frees at the same point."""
    if os.path.basename(str(request.node.fspath)).startswith("test_collective_") and dist.is_initialized():
        import occult

        occult.release_transports()
    yield


@dataclass
class Ranks:
    """This process's place in the torchrun group the collective tests share."""

    rank: int
    world_size: int
    device: torch.device
    seed: int  # drawn fresh on rank 0 for this session and broadcast
    backend: str

    def all_max(self, value: float) -> float:
        """The largest value over all ranks (every rank asserts on the same number)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())


@pytest.fixture(scope="session")
def ranks() -> Ranks:
    from occult.distributed import init_distributed

    if BACKEND not in ("nccl", "gloo"):
        raise ValueError(f"OCCULT_GPU_SUITE_BACKEND must be 'nccl' or 'gloo', got {BACKEND!r}")
    if not ON_CPU:  # gloo ranks may share a GPU; NCCL's init_distributed sets the device itself
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    rank, world_size = init_distributed(BACKEND, timeout_s=COLLECTIVE_TIMEOUT_S)
    if world_size < 2:
        pytest.skip("collective GPU tests need at least 2 ranks")
    device = torch.device("cpu") if ON_CPU else torch.device("cuda", torch.cuda.current_device())
    # OCCULT_GPU_SUITE_SEED=N repeats a session (e.g. one whose seed a failure printed)
    fixed = os.environ.get("OCCULT_GPU_SUITE_SEED")
    seed_t = (
        torch.tensor([int(fixed)], dtype=torch.int64)
        if fixed
        else torch.randint(
            0,
            2**31 - 1,
            (1,),
            dtype=torch.int64,
            generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")),
        )
    )
    seed_t = seed_t.to(device)
    dist.broadcast(seed_t, src=0)
    seed = int(seed_t.item())
    if rank == 0:
        capped = f", memory capped at {MEMORY_GIB} GiB per GPU" if MEMORY_GIB and not ON_CPU else ""
        print(f"\n[gpu suite] {world_size} ranks on {device.type}, {BACKEND}, session seed {seed}{capped}")
    return Ranks(rank, world_size, device, seed, BACKEND)
