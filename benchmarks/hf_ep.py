"""transformers' own expert-parallel generation as a whole-model peer of benchmarks/serve.py.

What transformers documents for expert-parallel inference: `from_pretrained(path,
distributed_config=DistributedConfig(tp_size=N, ep_size=N))` (transformers >= 5.2x; 5.17:
`DistributedConfig(tp_size=N, enable_expert_parallel=True)`). Attention and the other dense
layers are tensor-parallel over the N ranks (the model's `base_model_tp_plan`), the experts are
sharded by expert (`base_model_ep_plan`: `grouped_gemm` weights, `ep_dispatch_experts`), and all
N ranks hold the same batch: at inference `ep_implementation="auto"` picks `AllReduceEP` (every
rank runs its own experts on the whole batch, routes to other ranks' experts masked, one
all-reduce sums the outputs; no split sizes read back, so the step can be captured in a CUDA
graph). So the peer serves the union of every rank's sequences on every rank: B per GPU in
serve.py means N * B rows in the shared batch, and its tokens/s per GPU is B / step.

`from_pretrained` needs weights on disk: rank 0 saves the benchmark's seeded random model to a
temporary directory (`save`), every rank loads it sharded (`load`), and `remove` deletes it.
Needs `accelerate` (transformers asks for it with a tp plan). Runs on CPU with gloo as well.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


def unavailable() -> str | None:
    """Why transformers' expert parallelism cannot run here, or None."""
    try:
        from transformers.distributed.configuration_utils import DistributedConfig  # noqa: F401
    except ImportError as exc:
        return f"transformers has no DistributedConfig ({exc})"
    if importlib.util.find_spec("accelerate") is None:
        return "transformers' tensor/expert-parallel loading needs `accelerate` (pip install accelerate)"
    return None


def distributed_config(world: int) -> Any:
    """TP of the dense layers and EP of the experts over all `world` ranks (the documented EP inference set-up)."""
    from transformers.distributed.configuration_utils import DistributedConfig

    fields = (
        {f.name for f in dataclasses.fields(DistributedConfig)}
        if dataclasses.is_dataclass(DistributedConfig)
        else set(inspect.signature(DistributedConfig).parameters)
    )
    if "ep_size" in fields:
        return DistributedConfig(tp_size=world, ep_size=world)
    return DistributedConfig(tp_size=world, enable_expert_parallel=True)  # transformers 5.17


def save(model: nn.Module) -> str:
    """Rank 0 writes `model` (identical on every rank) to a new temporary directory; every rank gets its path."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        path = tempfile.mkdtemp(prefix="occult-serve-hf-ep-")
        model.save_pretrained(path)
        box = [path]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def remove(path: str | None) -> None:
    dist.barrier()
    if path and dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def load(path: str, world: int, dtype: torch.dtype) -> nn.Module:
    """The saved model, tensor- and expert-parallel over the world (every rank calls it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=distributed_config(world), dtype=dtype)
    return model.eval()


def describe(model: nn.Module) -> dict[str, Any]:
    """What transformers applied: the experts' class and local expert count, the EP implementation asked for."""
    cfg = getattr(model.config, "distributed_config", None)
    experts = next((m for n, m in model.named_modules() if n.endswith("mlp.experts")), None)
    w = getattr(experts, "gate_up_proj", None)
    local = w.to_local().shape[0] if hasattr(w, "to_local") else (None if w is None else w.shape[0])
    tp, ep = getattr(cfg, "tp_size", None), getattr(cfg, "ep_size", None)
    if ep is None and getattr(cfg, "enable_expert_parallel", False):
        ep = tp  # transformers 5.17: no ep_size; enable_expert_parallel shards the experts over the TP group
    return {
        "tp_size": tp,
        "ep_size": ep,
        "ep_implementation": getattr(cfg, "ep_implementation", None),
        "local_experts": local,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
    }


def gather_rows(x_BS: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, rank-major: [world * B, S] (all ranks hold the same B)."""
    parts = [torch.empty_like(x_BS) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x_BS.contiguous())
    return torch.cat(parts)
