"""The placement solve of a re-placement (`occult.lm.replace`), inline or in a background process.

`solve_placement(ids_LNK, num_experts, num_devices, current_LE, method)` solves every layer on
the routing sample (`occult.placement.solvers.solve_layer`), relabels each layer's devices so
that as many experts as possible stay where they are (E[C_T] does not depend on the labels;
fewer experts move), and scores the current and the new placement on the same sample.

`SolveJob` runs it without stalling training: `mode="process"` starts
`python -m occult.lm.solve_job IN OUT` (a plain subprocess, so it also works inside daemonic
rank processes, where multiprocessing may not start children), `poll()` never blocks;
`mode="inline"` solves at once (deterministic; training waits).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from occult._atomic import atomic_path
from occult.placement.solvers import best_method, solve_layer
from occult.placement.stats import mean_ct


def relabel(new_E: np.ndarray, old_E: np.ndarray, num_devices: int) -> np.ndarray:
    """`new_E` with its device labels permuted to keep the most experts on their old device (greedy)."""
    overlap = np.zeros((num_devices, num_devices), dtype=np.int64)  # [new label, old device]
    np.add.at(overlap, (new_E, old_E), 1)
    mapping = -np.ones(num_devices, dtype=np.int64)
    free_old = np.ones(num_devices, dtype=bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        a, b = divmod(int(flat), num_devices)
        if mapping[a] < 0 and free_old[b]:
            mapping[a], free_old[b] = b, False
    return mapping[new_E]


def solve_placement(ids_LNK: np.ndarray, num_experts: int, num_devices: int, current_LE: np.ndarray,
                    method: str = "auto", seed: int = 0, threads: int | None = 1) -> dict[str, Any]:
    """{"placement" [L, E], "old_ct" [L], "new_ct" [L], "seconds"}: a new placement and both E[C_T]s."""
    t0 = time.perf_counter()
    method = best_method() if method == "auto" else method
    ids_LNK = np.asarray(ids_LNK)
    current_LE = np.asarray(current_LE, dtype=np.int64)
    out = np.empty_like(current_LE)
    old_ct, new_ct = [], []
    for i in range(ids_LNK.shape[0]):
        ids = ids_LNK[i].astype(np.int64)
        res = solve_layer(ids, num_experts, num_devices, method, seed=seed, threads=threads)
        out[i] = relabel(res.expert_device_E, current_LE[i], num_devices)
        old_ct.append(mean_ct(ids, current_LE[i], num_devices))
        new_ct.append(mean_ct(ids, out[i], num_devices))
    return {"placement": out, "old_ct": np.asarray(old_ct), "new_ct": np.asarray(new_ct),
            "seconds": np.asarray(time.perf_counter() - t0)}


class SolveJob:
    """One solve, started now; `poll()` -> None (still running) or the result dict (or raises)."""

    def __init__(self, ids_LNK: np.ndarray, num_experts: int, num_devices: int, current_LE: np.ndarray,
                 method: str = "auto", seed: int = 0, mode: str = "process") -> None:
        if mode not in ("process", "inline"):
            raise ValueError(f"mode must be 'process' or 'inline', got {mode!r}")
        self.started = time.perf_counter()
        self.mode = mode
        self._result: dict[str, Any] | None = None
        self._proc: subprocess.Popen | None = None
        if mode == "inline":
            self._result = solve_placement(ids_LNK, num_experts, num_devices, current_LE, method, seed)
            return
        self._dir = Path(tempfile.mkdtemp(prefix="occult-replace-"))
        args = dict(ids=np.asarray(ids_LNK), num_experts=num_experts, num_devices=num_devices,
                    current=np.asarray(current_LE), method=np.asarray(method), seed=seed)
        np.savez(self._dir / "in.npz", **args)
        self._err = open(self._dir / "stderr.txt", "wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        self._proc = subprocess.Popen([sys.executable, "-m", "occult.lm.solve_job", str(self._dir / "in.npz"),
                                       str(self._dir / "out.npz")], stdout=subprocess.DEVNULL, stderr=self._err, env=env)

    def poll(self, block: bool = False) -> dict[str, Any] | None:
        if self._result is not None or self._proc is None:
            return self._result
        code = self._proc.wait() if block else self._proc.poll()
        if code is None:
            return None
        self._err.close()
        try:
            if code != 0:
                tail = (self._dir / "stderr.txt").read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"the placement solver process failed (exit {code}): {' | '.join(tail)}")
            with np.load(self._dir / "out.npz") as f:
                self._result = {k: f[k] for k in f.files}
        finally:
            self._cleanup()
        return self._result

    def cancel(self) -> None:
        """Stop the solver process (if any) and remove its files."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._proc is not None:
            self._err.close()
            self._cleanup()

    def _cleanup(self) -> None:
        import shutil

        shutil.rmtree(self._dir, ignore_errors=True)
        self._proc = None


def main(argv: list[str] | None = None) -> int:
    """`python -m occult.lm.solve_job IN.npz OUT.npz` (what `SolveJob(mode="process")` runs)."""
    src, dst = (argv if argv is not None else sys.argv[1:])[:2]
    with np.load(src) as f:
        res = solve_placement(f["ids"], int(f["num_experts"]), int(f["num_devices"]), f["current"],
                              str(f["method"]), int(f["seed"]))
    with atomic_path(Path(dst)) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
