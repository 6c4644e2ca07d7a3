"""Evaluation of `OccultLM` and the device / precision choices training and profiling share.

`evaluate(model, tokens, ...)`: mean next-token loss and perplexity on fixed windows of a
token stream, and E[C_T] (devices per token) when a placement is known. `pick_device("auto")`
is CUDA when present, else CPU; `autocast_for(device, precision)` is bf16 autocast on GPU
("auto") or nothing (fp32).
"""

from __future__ import annotations

import contextlib
import math

import torch

from occult.lm.data import eval_batches
from occult.lm.model import OccultLM
from occult.moe.pruning import devices_per_token
from occult.training.loss import cross_entropy


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype of `precision` on `device` (auto: bf16 on CUDA), or None for fp32."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if precision == "bf16" else None


def autocast_for(device: torch.device, precision: str):
    dtype = autocast_dtype(device, precision)
    if dtype is not None:
        return torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(
    model: OccultLM,
    tokens: torch.Tensor,
    batch_size: int,
    seq_len: int,
    max_tokens: int | None = None,
    precision: str = "auto",
    placement=None,
    parallel=None,
) -> dict[str, float]:
    """Mean next-token loss and perplexity on fixed windows of `tokens`; E[C_T] when a placement
    (argument, else the model's routing placement) is known: the mean over tokens and MoE layers
    of the number of devices each token's experts span.

    `parallel` (an `occult.lm.parallel.Parallel`, every rank calling): each rank evaluates its
    part of every batch (possibly none) and the sums are all-reduced."""
    split = parallel is not None and parallel.world_size > 1
    device = next(model.parameters()).device
    placement = placement if placement is not None else model.routing.placement
    devs = None
    if placement is not None:
        devs = [
            torch.as_tensor(placement.expert_device(i if placement.num_layers > 1 else 0).copy(), device=device)
            for i in range(model.config.num_layers)
        ]
    ct_sum = torch.zeros((), dtype=torch.float64, device=device)
    ct_count = 0

    def observe(layer, logits, weights, ids):
        nonlocal ct_sum, ct_count
        ct_sum = ct_sum + devices_per_token(ids, devs[layer]).sum()
        ct_count += ids.shape[0]

    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    ctx = model.observe_routing(observe) if devs is not None else contextlib.nullcontext()
    try:
        with ctx, autocast_for(device, precision):
            for x, y in eval_batches(tokens, batch_size, seq_len, max_tokens):
                if split:
                    x, y = (
                        x.tensor_split(parallel.world_size)[parallel.rank],
                        y.tensor_split(parallel.world_size)[parallel.rank],
                    )
                x, y = x.to(device), y.to(device)
                if split:  # a rank may have no rows: sum the losses, never average an empty batch
                    logits = model(x).logits
                    sum_1 = cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), num_items=1)
                    total += sum_1.double()
                else:
                    out = model(x, y, return_logits=False)
                    total += out.loss.double() * y.numel()
                count += y.numel()
    finally:
        model.train(was_training)
    if split:
        import torch.distributed as dist

        sums = torch.stack(
            [
                total,
                torch.tensor(float(count), dtype=torch.float64, device=device),
                ct_sum.double(),
                torch.tensor(float(ct_count), dtype=torch.float64, device=device),
            ]
        )
        dist.all_reduce(sums, group=parallel.world_group)
        total, count, ct_sum, ct_count = sums[0], int(sums[1]), sums[2], int(sums[3])
    loss = float(total) / count
    result = {"val_loss": loss, "val_ppl": math.exp(min(loss, 80.0)), "val_tokens": count}
    if devs is not None:
        result["mean_ct"] = float(ct_sum) / max(1, ct_count)
    return result
