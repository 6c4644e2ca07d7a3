"""Host time of a training step with the GPU idle when it starts (issue 52's host time per layer call).

Runs `occult train ARGS...` with every step timed on the host from an idle GPU (`torch.cuda.synchronize()` just
before it) to the moment the loop has issued it: what the host needs to issue a step, with nothing queued ahead
to hide it and no full launch queue to wait on (a profile of a GPU-bound run counts those waits as host time).
An eager step's own waits for the GPU inside it (routing statuses read on the host) are counted. Prints and
writes the median over the steps after the first 10, and per MoE layer call (2 x layers calls a step: forward and
backward; every host operation of the step is counted against them):

    python scripts/step_host_time.py OUT.json -- --corpus-dir .gpudata --hidden 1024 --layers 4 ... [--captured-step]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    import torch

    from occult import cli
    from occult.training.loop import TrainLoop

    out, argv = Path(sys.argv[1]), sys.argv[3:]
    times: list[float] = []
    one_step = TrainLoop._one_step

    def timed(self: TrainLoop):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = one_step(self)
        times.append(time.perf_counter() - t0)
        return result

    TrainLoop._one_step = timed
    code = cli.main(["train", *argv])
    if code:
        return code
    layers = int(argv[argv.index("--layers") + 1])
    steady = times[10:]
    median_ms = statistics.median(steady) * 1e3
    doc = {
        "args": argv,
        "steps_timed": len(steady),
        "host_ms_per_step_median": median_ms,
        "host_ms_per_moe_call": median_ms / (2 * layers),
        "host_ms_all": [t * 1e3 for t in times],
        "gpu": torch.cuda.get_device_name(),
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"host ms per step (median of {len(steady)}): {median_ms:.3f}; per MoE call: {median_ms / (2 * layers):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
