"""One torchrun rank of the GPU suite: pytest with a JUnit report; rank 0 prints, the others log.

Every rank always exits 0 and writes pytest's exit code to OUT/rank{R}.rc, so torchrun never
stops a rank that is still writing its report because another rank finished first with failures.
"""

from __future__ import annotations

import os
import sys

import pytest


def main() -> None:
    rank = int(os.environ["RANK"])
    out = os.environ.get("OCCULT_GPU_SUITE_OUT", ".")
    if rank != 0:  # C-level output (NCCL, Triton) too
        log = os.open(os.path.join(out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    code = pytest.main([*sys.argv[1:], f"--junitxml={os.path.join(out, f'rank{rank}.xml')}"])
    with open(os.path.join(out, f"rank{rank}.rc"), "w") as f:
        f.write(f"{int(code)}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: the process group may be broken after a failure


if __name__ == "__main__":
    main()
