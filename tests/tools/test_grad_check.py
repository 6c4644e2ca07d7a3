"""benchmarks/_grad_check.py: e2e.py's check that a timed training step's MoE backward reaches the routers and
the norms in front of the MoE blocks. A converted model passes against its unconverted twin; one whose MoE
blocks' backward is lost (zero gradients, as compiled all-to-alls gave on NCCL) fails with an error of ~1."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from _bench_helpers import ROOT

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "benchmarks"))

from _grad_check import TOL, checked_names, gradient_check, reference_gradients  # noqa: E402

from occult.integrations import hf  # noqa: E402


def _twins(family: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ref = hf.tiny_random_model(family, seed=seed)
    model = hf.convert(copy.deepcopy(ref))
    ids = torch.randint(0, ref.config.vocab_size, (2, 16))
    return ref, model, ids


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "qwen2_moe"])  # (dense first layers; shared experts)
def test_a_converted_model_has_the_reference_moe_backward(family):
    ref, model, ids = _twins(family)
    names = checked_names(ref)
    blocks = [name for name, _ in hf.moe_blocks(ref)]
    assert len(names) == 2 * len(blocks) and all(n.startswith(tuple(blocks)) or "layernorm" in n for n in names)
    want = reference_gradients(ref, ids)
    assert sorted(want) == sorted(names) and all(g.norm() > 0 for g in want.values())
    assert all(p.requires_grad and p.grad is None for p in ref.parameters())  # left as it was
    check = gradient_check(model, ids, want)
    assert check["passed"] and check["max_rel_err"] < 1e-4 and check["params"] == len(names), check
    assert all(p.grad is None for p in model.parameters())


def test_a_lost_moe_backward_fails_the_check():
    ref, model, ids = _twins("olmoe")
    want = reference_gradients(ref, ids)
    for _, block in hf.moe_blocks(model):  # the forward's values, a zero gradient back (present, not None)
        block.register_forward_hook(lambda module, args, out: out.detach() + 0 * out)
    check = gradient_check(model, ids, want)
    assert not check["passed"] and check["max_rel_err"] == pytest.approx(1.0, abs=1e-6) and check["max_rel_err"] > TOL
    assert check["worst_param"] in want


def test_a_missing_gradient_fails_the_check():
    ref, model, ids = _twins("olmoe")
    want = reference_gradients(ref, ids)
    for _, block in hf.moe_blocks(model):
        block.register_forward_hook(lambda module, args, out: out.detach())
    check = gradient_check(model, ids, want)
    assert not check["passed"] and check["max_rel_err"] > 1e30


def test_a_batch_in_micro_batches_gives_the_whole_batchs_gradients():
    ref, model, _ = _twins("olmoe")
    ids = torch.randint(0, ref.config.vocab_size, (4, 16))
    want = reference_gradients(ref, ids)
    check = gradient_check(model, ids, want, chunks=2)  # (the shape a two-batch or accumulated step compiles for)
    assert check["passed"] and check["max_rel_err"] < 1e-5, check
    entered = []

    class Scope:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    assert gradient_check(model, ids, want, chunks=4, scope=Scope)["max_rel_err"] < 1e-5 and entered == [True]
    with pytest.raises(ValueError, match="do not split into 3 equal micro-batches"):
        gradient_check(model, ids, want, chunks=3)
