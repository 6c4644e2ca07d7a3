"""benchmarks/_grad_check.py: e2e.py's check of a training step's MoE backward: the routers, the norms in front of
the MoE blocks and up to three well-reached experts' weights of each against the unconverted model. A converted model
passes against its unconverted twin; one whose MoE blocks' backward is lost (zero gradients, as compiled all-to-alls
gave on NCCL), or whose expert weight gradients are wrong, fails with an error of ~1. (Expert-parallel layers, whose
experts' gradients sum every rank's tokens: tests/tools/test_e2e_bench.py's tiny run on 2 ranks.)"""

from __future__ import annotations

import copy
import random
import sys

import pytest
import torch
from _bench_helpers import ROOT

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "benchmarks"))

from _grad_check import (  # noqa: E402
    FEW_TOKENS,
    LOST,
    MARGIN,
    TOL,
    checked_names,
    expert_weights,
    gradient_check,
    reference_gradients,
    sampled_experts,
    truth_gradients,
)

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
    weights = expert_weights(ref)
    assert weights[:2] == [f"{blocks[0]}.experts.gate_up_proj", f"{blocks[0]}.experts.down_proj"]
    assert len(weights) == 2 * len(blocks)
    want = reference_gradients(ref, ids)
    experts = [k for k in want if k not in names]
    assert sorted(want) == sorted(names + experts) and all(want[n].norm() > 0 for n in names)
    assert {k.split("[")[0] for k in experts} == set(weights)  # (each weight's best reached expert at least)
    assert want[experts[0]].shape == ref.get_submodule(f"{blocks[0]}.experts").gate_up_proj.shape[1:]
    assert all(p.requires_grad and p.grad is None for p in ref.parameters())  # left as it was
    check = gradient_check(model, ids, want)
    assert check["passed"] and check["max_rel_err"] < 1e-4 and check["params"] == len(want), check
    assert all(p.grad is None for p in model.parameters())


def _gradient(norms_E: torch.Tensor) -> torch.Tensor:
    """A fused expert weight's gradient [E, 3, 5] whose experts' norms are `norms_E`, in random directions."""
    directions = torch.nn.functional.normalize(torch.randn(len(norms_E), 15), dim=1)
    return (norms_E[:, None] * directions).view(len(norms_E), 3, 5)


def test_the_sampled_experts_are_the_first_last_and_best_reached_with_enough_tokens():
    count = random.randint(4, 64)
    busiest = random.randrange(1, count - 1)
    norms_E = torch.rand(count) + 1.0  # (every expert well reached)
    norms_E[busiest] = 5.0
    grad_EX = _gradient(norms_E)
    assert sampled_experts(grad_EX) == [0, busiest, count - 1]
    grad_EX[0] *= FEW_TOKENS / 2  # few tokens (below the share of the median, >= 1): left out
    grad_EX[count - 1] = 0  # none
    assert sampled_experts(grad_EX) == [busiest]


def _sample_on_gloo(rank: int, world: int, count: int, few: int) -> list[int]:
    norms_E = torch.ones(count)
    norms_E[few] = FEW_TOKENS / 2 if rank == 1 else 3.0  # well reached on rank 0, barely on rank 1
    return sampled_experts(_gradient(norms_E))


def test_every_rank_samples_the_same_experts_each_well_reached_on_each():
    from occult.distributed import run_ranks

    count = random.randint(4, 16)
    few = random.choice([0, count - 1])  # (rank 0 alone would sample it: its best reached)
    want = [e for e in (0, count - 1) if e != few]
    got = run_ranks(_sample_on_gloo, 2, count, few, timeout_s=120)
    assert got[0] == got[1] and set(want) <= set(got[0]) and few not in got[0], (got, few)


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


def _moved(want: torch.Tensor, share: float) -> torch.Tensor:
    """A random direction of norm `share` x ||want||."""
    return share * float(want.norm()) * torch.nn.functional.normalize(torch.randn(want.numel()), dim=0).view_as(want)


def test_the_fp32_truth_passes_a_gradient_near_it_and_leaves_out_one_rounding_cannot_check():
    """A router whose fp32 gradient is 0.3 of its norm from the half-precision reference's (moderate): a variant
    0.6 from the reference but near the fp32 gradient passes, one far from both fails, and without the truth both
    fail. A router whose reference is as far from the fp32 gradient as a lost one would be is left out (named);
    a lost MoE backward still fails through the norms in front of the blocks."""
    ref, model, ids = _twins("olmoe")
    want = reference_gradients(ref, ids)
    router = checked_names(ref)[0]
    assert router.endswith(".gate.weight")
    step = _moved(want[router], 0.3)
    truth = {router: want[router] + step}
    assert LOST > MARGIN * float(step.norm() / truth[router].norm()) + TOL > TOL
    gate = model.get_submodule(router.removesuffix(".weight")).weight
    for shift, passes in ((2.0, True), (-3.0, False)):
        handle = gate.register_hook(lambda grad, shift=shift: grad + shift * step)
        with_truth, alone = gradient_check(model, ids, want, truth=truth), gradient_check(model, ids, want)
        handle.remove()
        assert with_truth["max_rel_err"] > TOL and with_truth["passed"] == passes and not alone["passed"], shift
        assert with_truth["unchecked"] == [] and with_truth["params"] == len(want)
    far = {router: want[router] + _moved(want[router], 1.0)}
    handle = gate.register_hook(lambda grad: 0 * grad)  # (its error is 1: left out, not failed)
    check = gradient_check(model, ids, want, truth=far)
    handle.remove()
    assert check["passed"] and check["unchecked"] == [router] and check["params"] == len(want) - 1, check
    for _, block in hf.moe_blocks(model):
        block.register_forward_hook(lambda module, args, out: out.detach() + 0 * out)
    lost = gradient_check(model, ids, want, truth=far)
    assert not lost["passed"] and "post_attention_layernorm" in lost["worst_param"], lost


def test_the_truth_gradients_are_every_checked_key_in_bounded_passes():
    """Every key of the reference (routers, norms, experts' slices), the same gradients whatever the passes (one, or
    one parameter a pass: `pass_bytes` below any weight's), the model left as it was."""
    ref, _, ids = _twins("deepseek_v3")
    want = reference_gradients(ref, ids)
    passes = []
    backward = ref.forward

    def counted(*args, **kwargs):
        passes.append(1)
        return backward(*args, **kwargs)

    ref.forward = counted
    whole = truth_gradients(ref, ids, list(want), chunks=2)  # (fp32 here: the reference's, the batch in halves)
    one_pass = len(passes)
    split = truth_gradients(ref, ids, list(want), pass_bytes=1)
    del ref.forward
    assert sorted(whole) == sorted(split) == sorted(want) and one_pass == 2  # (2 chunks)
    assert len(passes) - one_pass == len({k.split("[")[0] for k in want}) > 2
    for k in want:
        assert float((whole[k] - want[k]).norm()) <= 1e-4 * float(want[k].norm()), k
        assert float((split[k] - want[k]).norm()) <= 1e-5 * float(want[k].norm()), k
    assert all(p.requires_grad and p.grad is None for p in ref.parameters())
