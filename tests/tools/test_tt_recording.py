"""benchmarks/tt_model.py's `TrainStep.check_recording`, which e2e.py runs on a TorchTitan step recorded as a CUDA graph
(`torchtitan+occult+experts@syncfree/stepgraph`): the replayed forward+backward's loss and gradients against the eager
one's, no update. A faithful forward+backward passes on every rank (the two runs compute the same step); one whose
gradients are twice the step's fails with relative error 1 (CPU gloo ranks: recording itself needs a GPU). Two steps
of one shape get the same attention masks: TorchTitan's recording refuses a BlockMask whose mask function changed.
The step zeroes its gradients in place a parameter group at a time (torch's foreach zero_grad refuses DTensors beside
plain tensors, as TorchTitan's model has them on one rank)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _bench_helpers import ROOT, torchrun  # tests/tools/_bench_helpers.py

pytest.importorskip("transformers")


def test_the_recording_check_passes_a_faithful_step_and_fails_a_wrong_one():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import tt_model
    finally:
        sys.path.pop(0)
    if (reason := tt_model.unavailable("qwen3_moe")) is not None:
        pytest.skip(reason)
    res = torchrun(Path(__file__).with_name("_tt_recording_ranks.py"), 2, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    faithful, wrong = report["faithful"], report["wrong"]
    assert faithful["passed"] and faithful["max_rel_err"] <= 1e-6, faithful
    assert not wrong["passed"] and abs(wrong["max_rel_err"] - 1.0) < 1e-3, wrong
    assert wrong["worst_param"] != "loss", wrong
    assert report["same_masks"], "a recorded step needs the same BlockMask every step (made once a shape)"
    # one rank's optimizer: FSDP2's DTensors and plain expert tensors, which torch's foreach zero_grad refuses together
    assert report["torch_refuses"] and report["zeroed"], report
