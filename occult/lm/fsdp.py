"""Dense parameters of `OccultLM` sharded with torch's FSDP2 (`--grad-sync fsdp`).

`wrap_fsdp(model, parallel)` applies `torch.distributed.fsdp.fully_shard` to every decoder block and then to
the model (the root unit: embeddings, the tied lm head, the final norm; with `units="model"` the root's unit alone,
holding every dense parameter: `--fsdp-units model`) over a 1-D `DeviceMesh` of
`Parallel.dense_group` (every rank, a communicator of its own), each unit prefetching its neighbour explicitly
(`prefetch_neighbours`). A block keeps its gathered weights from its forward to its backward
(`reshard_after_forward=False`, ZeRO-2 for the dense weights): in a MoE model they are a small part of the
weights (the experts are not FSDP's), so holding them costs little memory, and the backward gathers nothing
again (half the all-gathers, and none of the backward's gather hooks on the host's time: eager FSDP2 is
host-bound). Every unit frees them when its backward ends, so a step leaves the same state as before (what
`--captured-step` needs, `occult.training.step_graph`). The expert weights are `ignored_params`:
expert parallelism already shards them, and after the backward `sync_gradients(model, parallel,
replicated=False)` all-reduces them over the replica groups as with DDP. Every other parameter (attention,
norms, routers, embeddings) becomes a DTensor sharded on dim 0 over the ranks; FSDP all-gathers it before each
block's forward and backward and reduce-scatters (averages over the W ranks, the factor DDP and the explicit
sync use) its gradient, so each rank holds 1/W of the dense weights, gradients and AdamW state. Parameter
names are unchanged (checkpoints, weights files). After a forward without backward (evaluation) call
`reshard(model)`: FSDP2 leaves every unit's weights unsharded then.

With bf16 autocast (`--precision bf16`, or auto on CUDA) the blocks also get FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: bf16 all-gathers and compute
copies, fp32 gradient reduction and fp32 sharded master weights; autocast stays on for the
experts (plain fp32 parameters).

The helpers that make the rest of the code indifferent to whether a parameter is sharded
(`full_tensor`, `local_tensor`, `like_param`, `is_sharded`) live in `occult.training.dtensor`
and are re-exported here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from occult.lm.model import OccultLM
from occult.training.dtensor import full_tensor, is_sharded, like_param, local_tensor  # noqa: F401  (re-exported)


def is_fsdp(model: OccultLM) -> bool:
    """Whether `wrap_fsdp` has sharded `model`'s dense parameters."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def reshard(model: OccultLM) -> None:
    """Free the unsharded dense weights (after a forward without backward, e.g. evaluation, FSDP2 keeps those
    of every unit, so `named_parameters` would name full tensors, not the optimizer's
    shards)."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


@contextlib.contextmanager
def gradient_sync_off(model: OccultLM) -> Iterator[None]:
    """While entered, FSDP2 keeps the gradients of `model`'s units unsharded and unreduced (a micro-batch of an
    accumulated step before the last: the last one's backward reduce-scatters their sum once); on again after."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def wrap_fsdp(
    model: OccultLM,
    parallel,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = False,
    units: str = "block",
) -> OccultLM:
    """Shard `model`'s dense parameters over every rank with FSDP2 (in place; returns `model`).

    `parallel`: an `occult.lm.parallel.Parallel`. `param_dtype=torch.bfloat16`: FSDP2 mixed
    precision (bf16 compute copies, fp32 reduction). `reshard_after_forward`: every block but the last frees its
    gathered weights after its forward and gathers them again for its backward (less memory, twice the
    all-gathers; TorchTitan's default), instead of keeping them (module docstring). `units`: "block", a unit per
    decoder block and the root's (its all-gathers prefetched beside the previous block's compute, its gradients
    reduce-scattered as its backward ends), or "model", the root's unit alone holding every dense parameter: one
    all-gather before the forward and one reduce-scatter after the backward, FSDP2's hooks run once a step instead
    of once a block (where a small model's eager step waits on the host, that is what FSDP2 costs over DDP); its
    weights stay gathered until the backward ends, as "block" keeps them by default. Call it before building the
    optimizer (the dense parameters become new DTensor parameters). A second call does nothing.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if units not in ("block", "model"):
        raise ValueError(f"units must be 'block' or 'model', got {units!r}")
    if units == "model" and reshard_after_forward:
        raise ValueError("reshard_after_forward frees a block's weights after its forward: it needs units='block'")
    if is_fsdp(model):
        return model
    device = next(model.parameters()).device
    group = parallel.dense_group if parallel.dense_group is not None else parallel.world_group
    mesh = DeviceMesh.from_group(group, device.type)
    experts = {p for p, _ in model.expert_parameters().values()}
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None)
    if units == "block":
        last = len(model.blocks) - 1
        for i, block in enumerate(model.blocks):  # the last block's backward comes next: it keeps them either way
            free = reshard_after_forward and i < last
            fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=experts, reshard_after_forward=free)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=experts)
    if units == "block":
        prefetch_neighbours(model, list(model.blocks))
    return model


def prefetch_neighbours(root, blocks: list) -> None:
    """Each FSDP unit starts its neighbour's all-gather when it starts: the next block's in the forward
    (the root's: the first block's), the previous block's in the backward. FSDP2's implicit prefetch
    issues an all-gather only when the host reaches that unit, which is late wherever the host is slower
    than the GPU (an eager MoE layer's ~100 launches a call) or waits for it (the count exchange)."""
    if not blocks:
        return
    root.set_modules_to_forward_prefetch([blocks[0]])
    for current, following in zip(blocks, blocks[1:]):
        current.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([current])


__all__ = [
    "wrap_fsdp",
    "prefetch_neighbours",
    "reshard",
    "is_fsdp",
    "is_sharded",
    "full_tensor",
    "local_tensor",
    "like_param",
]
