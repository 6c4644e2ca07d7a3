"""Triton for the kernel tests (test_kernels.py, test_plan_kernel.py): compiled on a GPU, else its CPU
interpreter (`TRITON_INTERPRET=1`).

Import this before anything from `occult.kernels`: the interpreter must be on before Triton is first
imported (its own library functions, e.g. tl.cumsum, are decorated at import), and the kernels decide
interpreted vs compiled when they are first imported. Where another test module imported Triton
earlier in this process without the interpreter, `IN_PROCESS` is False: the tests marked
`needs_in_process` are skipped, and the module's `test_in_subprocess` runs the whole file in a fresh
process instead (`run_file_in_fresh_process`). Skips the importing module when Triton is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip(
    "triton", reason="triton is not importable: the Triton kernels cannot run (pip install triton)"
)


def _interpreter_usable() -> bool:
    if torch.cuda.is_available():
        return True
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.cumsum, InterpretedFunction)


IN_PROCESS = _interpreter_usable()
if IN_PROCESS:
    # kernels decide interpreted vs compiled when first imported: drop any compiled import
    for _name in [m for m in sys.modules if m.startswith("occult.kernels.")]:
        del sys.modules[_name]
needs_in_process = pytest.mark.skipif(not IN_PROCESS, reason="run in a fresh process by test_in_subprocess")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_file_in_fresh_process(path: str) -> None:
    """pytest on the test file `path` in a fresh process with the interpreter on; fails with its output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
