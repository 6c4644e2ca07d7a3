"""Run by tests/tools/test_tt_recording.py under torchrun (2 gloo ranks): TorchTitan's Qwen3-MoE with occult's
sync-free dispatcher and fused experts (benchmarks/tt_model.py), one train step, then `TrainStep.check_recording`
against a faithful forward+backward and against one whose gradients are wrong. Rank 0 prints one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torchtitan.distributed.cudagraph import CUDAGraphInputSpec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import e2e  # noqa: E402
import tt_model  # noqa: E402


def main() -> None:
    variant = "torchtitan+occult+experts@syncfree"
    args = e2e.parse_args(["--model", "tiny-qwen3", "--variants", variant, "--batch", "2", "--seq", "32"])
    run = e2e.start_run(args, "tt_recording", e2e.model_config)
    rank, _, device, dtype, cfg, _ = run
    model = e2e.build_titan(variant, args, cfg, device, dtype, None)
    step = tt_model.make_step(model, "train", model.optimizer("adamw", 1e-4), recorded=False)
    gen = torch.Generator().manual_seed(7 + rank)
    ids = lambda: e2e.random_ids(args.batch, args.seq, cfg.vocab_size, device, gen)  # noqa: E731
    step(ids())  # a step: the gradients exist, as after a recording's warm-up
    extras = [step.peer.step_inputs(ids())[3] for _ in range(2)]  # two steps' masks, as a recording's replays get them
    CUDAGraphInputSpec(extras[0]).flatten(extras[1])  # TorchTitan's own check between steps (raises if they differ)
    same_masks = extras[0]["attention_masks"] is extras[1]["attention_masks"]  # 2.11: mask_mod by identity
    faithful = step.check_recording(ids(), tol=1e-6)
    eager = step.forward_backward

    def twice(*inputs: object) -> torch.Tensor:  # a "replay" that accumulates the gradients twice, same loss
        eager(*inputs)
        return eager(*inputs)

    step.forward_backward = twice
    wrong = step.check_recording(ids(), tol=1e-6)
    # recorded on CPU: TorchTitan's wrapper runs the step eagerly; its release (the teardown) leaves a working step
    recorded = tt_model.make_step(model, "train", model.optimizer("adamw", 1e-4), recorded=True)
    recorded(ids())
    recorded.release()
    recorded(ids())
    zeroed, torch_refuses = mixed_groups_zeroed()
    dist.barrier()
    if rank == 0:
        report = {"faithful": faithful, "wrong": wrong, "same_masks": same_masks}
        print(json.dumps(report | {"zeroed": zeroed, "torch_refuses": torch_refuses}), flush=True)
    e2e.finish_distributed(ok=True)


def mixed_groups_zeroed() -> tuple[bool, bool]:
    """tt_model.zero_grads on an optimizer with a group of DTensors beside a group of plain tensors (TorchTitan's
    model on one rank): (every gradient zeroed in place, whether torch's own foreach zero_grad refused them)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shared = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Replicate()]))
    plain = torch.nn.Parameter(torch.randn(5))
    optimizer = torch.optim.AdamW([{"params": [shared]}, {"params": [plain]}], lr=1e-3, foreach=True)
    shared.grad, plain.grad = torch.ones_like(shared), torch.ones_like(plain)
    try:
        optimizer.zero_grad(set_to_none=False)
        refused = False
    except RuntimeError:
        refused = True
    shared.grad, plain.grad = torch.ones_like(shared), torch.ones_like(plain)
    local = [shared.grad.to_local(), plain.grad]
    where = [g.data_ptr() for g in local]
    tt_model.zero_grads(optimizer, set_to_none=False)
    local = [shared.grad.to_local(), plain.grad]
    return all(bool((g == 0).all()) for g in local) and [g.data_ptr() for g in local] == where, refused


if __name__ == "__main__":
    main()
