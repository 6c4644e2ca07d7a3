"""Shared test fixtures.

The CPU suite starts its gloo ranks (`occult.distributed.run_ranks`) from a fork server that
loaded torch once (`OCCULT_RANK_START=forkserver`): a rank test's start-up falls from ~1.8 s to
~0.2 s. Set before any test runs; the Ctrl-C tests run the command line without it (the default,
spawned ranks, is what users get). This file starts that server itself, while pytest collects, with
transformers and occult loaded too (`RANK_SERVER_PRELOAD`)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

import pytest
import torch

os.environ.setdefault("OCCULT_RANK_START", "forkserver")

# What the fork server loads before the first rank forks from it, on top of `occult._rank_preload` (torch,
# SIGINT ignored): what most rank functions of the suite import (the transformers MoE families, occult's layer
# and integrations, numpy, and pytest, which every test module imports). Forked with it imported, a rank starts
# in ~0.1 s instead of importing ~3.5 s of modules on 2 cores, four ranks sharing them: the same code runs.
# A module that is not installed is skipped (the fork server ignores ImportError).
RANK_SERVER_PRELOAD = [
    "occult._rank_preload",
    "pytest",
    "numpy",
    "safetensors.torch",
    "transformers",
    "transformers.models.olmoe.modeling_olmoe",
    "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "occult",
    "occult.distributed",
    "occult.integrations.hf",
]
# The environment those imports see, which some of them read once, at import: the values every rank of the
# suite runs with (the test modules set them when collected, and a rank takes its caller's environment): Triton's
# CPU interpreter (its library functions are decorated at import; tests/kernels/_triton_interpreter.py) and
# transformers offline (huggingface_hub reads HF_HUB_OFFLINE at import).
RANK_SERVER_ENV = {"TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}


def _start_rank_fork_server() -> None:
    """Start `run_ranks`' fork server now, with `RANK_SERVER_PRELOAD` imported, while pytest collects.

    `occult.distributed.rank_context` names only `occult._rank_preload`; its call has no effect once the server
    runs (a server that died is started again with that list). CPU machines only: NCCL ranks are spawned, and
    the GPU suite's gloo ranks keep the library's own preload. Not in a pytest started by a test (it inherits
    PYTEST_CURRENT_TEST; tests/tools/test_gpu_run_scripts.py), which would import all that for nothing."""
    if (
        os.environ["OCCULT_RANK_START"] != "forkserver"
        or "forkserver" not in multiprocessing.get_all_start_methods()
        or "PYTEST_CURRENT_TEST" in os.environ
        or torch.cuda.is_available()
    ):
        return
    saved = {name: os.environ.get(name) for name in RANK_SERVER_ENV}
    os.environ.update(RANK_SERVER_ENV)
    try:
        multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_SERVER_PRELOAD)
        multiprocessing.forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_start_rank_fork_server()


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Tiny models run several times faster on one thread (and far faster on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
