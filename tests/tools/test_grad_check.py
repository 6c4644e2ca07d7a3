"""benchmarks/_grad_check.py: e2e.py's check of a training step's MoE backward: the routers, the norms in front of
the MoE blocks and two experts' weights of each against the unconverted model. A converted model passes against its
unconverted twin; one whose MoE blocks' backward is lost (zero gradients, as compiled all-to-alls gave on NCCL), or
whose expert weight gradients are wrong, fails with an error of ~1. (Expert-parallel layers, whose experts' gradients
sum every rank's tokens: tests/tools/test_e2e_bench.py's tiny run on 2 ranks.)"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from _bench_helpers import ROOT

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "benchmarks"))

from _grad_check import TOL, checked_names, expert_keys, gradient_check, reference_gradients  # noqa: E402

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
    experts = expert_keys(ref)  # the first and last expert's two weights, each block
    count = ref.get_submodule(f"{blocks[0]}.experts").gate_up_proj.shape[0]
    first = [f"{blocks[0]}.experts.{w}[{e}]" for w in ("gate_up_proj", "down_proj") for e in (0, count - 1)]
    assert experts[:4] == first
    assert len(experts) == 4 * len(blocks)
    want = reference_gradients(ref, ids)
    assert sorted(want) == sorted(names + experts) and all(want[n].norm() > 0 for n in names)
    assert want[experts[0]].shape == ref.get_submodule(f"{blocks[0]}.experts").gate_up_proj.shape[1:]
    assert all(p.requires_grad and p.grad is None for p in ref.parameters())  # left as it was
    check = gradient_check(model, ids, want)
    chosen = [k for k in want if want[k].any()]  # (an expert no token chose has nothing to compare)
    assert check["passed"] and check["max_rel_err"] < 1e-4 and check["params"] == len(chosen), check
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


def test_wrong_expert_weight_gradients_fail_the_check():
    ref, model, ids = _twins("olmoe")
    want = reference_gradients(ref, ids)
    for _, block in hf.moe_blocks(model):  # the routers' and norms' gradients stay right
        block.get_submodule("experts").down_proj.register_hook(lambda grad: 2 * grad)
    check = gradient_check(model, ids, want)
    assert not check["passed"] and check["max_rel_err"] == pytest.approx(1.0, rel=1e-4)
    assert check["worst_param"].endswith("]") and ".down_proj[" in check["worst_param"]
