"""The placement solve of a re-placement (`occult.lm.replace`), inline or in a background process.

`solve_placement(ids_LNK, num_experts, num_devices, current_LE, method)` solves every layer on
the routing sample (`occult.placement.solvers.solve_layer`), relabels each layer's devices so
that as many experts as possible stay where they are (E[C_T] does not depend on the labels;
fewer experts move), and scores the current and the new placement on the same sample.

`SolveJob` runs it without stalling training: `mode="process"` hands it to a `SolverProcess`,
a long-lived `python -m occult.lm.solve_job --serve` (a plain subprocess, so it also works
inside daemonic rank processes, where multiprocessing may not start children; started once, so
its imports are paid once, in the background), and `poll()` never blocks; `mode="inline"`
solves at once (deterministic; training waits).
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

from occult._atomic import atomic_path, write_text_atomic
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


def solve_placement(
    ids_LNK: np.ndarray,
    num_experts: int,
    num_devices: int,
    current_LE: np.ndarray,
    method: str = "auto",
    seed: int = 0,
    threads: int | None = 1,
) -> dict[str, Any]:
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
    return {
        "placement": out,
        "old_ct": np.asarray(old_ct),
        "new_ct": np.asarray(new_ct),
        "seconds": np.asarray(time.perf_counter() - t0),
    }


class SolverProcess:
    """A long-lived `python -m occult.lm.solve_job --serve`: started once (its start-up, mostly
    imports, overlaps training), then one solve per line on its stdin ("IN.npz<TAB>OUT.npz")."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="occult-replace-"))
        self._err = open(self.dir / "stderr.txt", "wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "occult.lm.solve_job", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=self._err,
            env=env,
        )
        self._count = 0

    def submit(self, **arrays: Any) -> Path:
        """Queue one solve of `solve_placement(**arrays)`; returns the path its result will have."""
        self._count += 1
        src, dst = self.dir / f"in{self._count}.npz", self.dir / f"out{self._count}.npz"
        np.savez(src, **arrays)
        self.proc.stdin.write(f"{src}\t{dst}\n".encode())
        self.proc.stdin.flush()
        return dst

    def failure(self) -> str | None:
        """Why the process ended (exit code and the end of its stderr), or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        tail = (self.dir / "stderr.txt").read_text(errors="replace").strip().splitlines()[-3:]
        return f"exit {code}: {' | '.join(tail)}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._err.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


class SolveJob:
    """One solve, started now; `poll()` -> None (still running) or the result dict (or raises).

    `mode="process"` sends it to `server` (a `SolverProcess`; one of its own when None, closed
    when done); `"inline"` solves in the constructor."""

    def __init__(
        self,
        ids_LNK: np.ndarray,
        num_experts: int,
        num_devices: int,
        current_LE: np.ndarray,
        method: str = "auto",
        seed: int = 0,
        mode: str = "process",
        server: SolverProcess | None = None,
    ) -> None:
        if mode not in ("process", "inline"):
            raise ValueError(f"mode must be 'process' or 'inline', got {mode!r}")
        self.started = time.perf_counter()
        self.mode = mode
        self._result: dict[str, Any] | None = None
        if mode == "inline":
            self._result = solve_placement(ids_LNK, num_experts, num_devices, current_LE, method, seed)
            return
        self._owned = server is None
        self.server = SolverProcess() if server is None else server
        self._dst = self.server.submit(
            ids=np.asarray(ids_LNK),
            num_experts=num_experts,
            num_devices=num_devices,
            current=np.asarray(current_LE),
            method=np.asarray(method),
            seed=seed,
        )

    def poll(self, block: bool = False) -> dict[str, Any] | None:
        while self._result is None:
            err = Path(f"{self._dst}.err")
            if self._dst.exists():
                with np.load(self._dst) as f:
                    self._result = {k: f[k] for k in f.files}
                self._done()
            elif err.exists() or self.server.failure() is not None:
                why = err.read_text() if err.exists() else self.server.failure()
                self._done()
                raise RuntimeError(f"the placement solver failed ({why})")
            elif not block:
                return None
            else:
                time.sleep(0.02)
        return self._result

    def cancel(self) -> None:
        """Forget the solve (and stop its process when it is the job's own)."""
        if self._result is None and self.mode == "process":
            self._done()

    def _done(self) -> None:
        if self._owned:
            self.server.close()
        else:
            for f in (self._dst, Path(f"{self._dst}.err"), self._dst.with_name(self._dst.name.replace("out", "in", 1))):
                f.unlink(missing_ok=True)


def _solve_file(src: str, dst: str) -> None:
    with np.load(src) as f:
        res = solve_placement(
            f["ids"], int(f["num_experts"]), int(f["num_devices"]), f["current"], str(f["method"]), int(f["seed"])
        )
    with atomic_path(Path(dst)) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **res)


def main(argv: list[str] | None = None) -> int:
    """`python -m occult.lm.solve_job IN.npz OUT.npz`, or `--serve` (what `SolverProcess` runs)."""
    argv = argv if argv is not None else sys.argv[1:]
    if argv[:1] != ["--serve"]:
        _solve_file(argv[0], argv[1])
        return 0
    for line in sys.stdin:
        src, dst = line.rstrip("\n").split("\t")
        try:
            _solve_file(src, dst)
        except Exception as exc:  # report it beside the result; keep serving
            write_text_atomic(f"{dst}.err", f"{type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
