"""`GroupedLinear`: all of a rank's experts' fc1 (or fc2) as one grouped GEMM, for Megatron-Core's `TEGroupedMLP`
without Transformer Engine.

Megatron-Core runs grouped experts only through Transformer Engine (`TEGroupedMLP` over TE's
`GroupedLinear`); without TE its local spec has `SequentialMLP`, one GEMM per expert and a host
loop over them, which dominated a Megatron training step on H200 (docs/integrations.md).
`TEGroupedMLP` itself (its activation, probs and bias handling) needs TE only for fp8/fp4: its
`linear_fc1` / `linear_fc2` are builders (0.19: the `GroupedLinearFc1Builder` / `Fc2Builder`
protocols; 0.16: the modules of a `ModuleSpec`) called as
`(num_local_experts, input_size, output_size, *, config, init_method, bias, skip_bias_add, is_expert,
tp_comm_buffer_name, pg_collection)` and run as `forward(rows, tokens_per_expert) -> (out, None)`.
`GroupedLinear` is such a builder: one weight `[local experts, output, input]`, the product through
`torch._grouped_mm` (CUTLASS grouped GEMM on Hopper in bf16; torch's own loop elsewhere), one
matmul per expert where the row widths are not 16-byte aligned.

The weight is an expert-parallel parameter as Megatron marks them (`allreduce = False`: reduced over the
expert data-parallel group by Megatron's DDP, never over the dense one); its distributed-checkpoint entry is
the global `[experts, output, input]` tensor sharded over EP ranks on the expert axis, the global tensor
`SequentialMLP` and `TEGroupedMLP` save under the same key (they in other pieces: one per expert, fc1's gate and up
halves apart), so a `torch_dist` checkpoint loads across the three. Its `state_dict()` has TE's per-expert keys
(`weight0`, `weight1`, ...), and `load_state_dict` takes those or the stacked `weight`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def grouped_offsets(tokens_per_expert: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows per expert -> [E] int32 end offsets on `device` (what `torch._grouped_mm` takes as `offs`)."""
    counts_E = torch.as_tensor(tokens_per_expert, dtype=torch.int64)
    return torch.cumsum(counts_E, 0).to(device=device, dtype=torch.int32, non_blocking=True)


def grouped_matmul(x_NI: torch.Tensor, weight_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """[N, I] rows, expert-major, rows offsets_E[e-1]:offsets_E[e] belonging to expert e -> [N, O], each row
    times its expert's weight transposed. `torch._grouped_mm` where the row widths allow it, else a loop."""
    aligned = x_NI.dtype.itemsize * x_NI.shape[1] % 16 == 0 and x_NI.dtype.itemsize * weight_EOI.shape[1] % 16 == 0
    if aligned and hasattr(torch, "_grouped_mm") and x_NI.shape[0] > 0:
        return ContiguousGrad.apply(torch._grouped_mm(x_NI, weight_EOI.transpose(-2, -1), offs=offsets_E))
    bounds = [0, *offsets_E.tolist()]
    parts = [x_NI[a:b] @ weight_EOI[e].T for e, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return torch.cat(parts) if parts else x_NI.new_zeros(0, weight_EOI.shape[1])


class ContiguousGrad(torch.autograd.Function):
    """Identity on `torch._grouped_mm`'s output whose backward hands it a contiguous gradient: it refuses an
    expanded one (a `.sum()` of its output gives zero strides)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GroupedLinear(torch.nn.Module):
    """A rank's local experts' linear layer as one grouped GEMM (module docstring): Megatron's grouped
    linear builder protocol, with no bias and no tensor parallelism inside an expert."""

    def __init__(
        self,
        num_local_experts: int,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable[[torch.Tensor], None],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        pg_collection: Any = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        problem = unsupported(config, bias, is_expert, pg_collection)
        if problem is not None:
            raise NotImplementedError(f"occult's GroupedLinear does not support {problem}")
        self.num_local_experts, self.input_size, self.output_size = num_local_experts, input_size, output_size
        self.ep_group = pg_collection.ep if pg_collection is not None else None
        self.expt_dp_group = getattr(pg_collection, "expt_dp", None)
        on_cpu = config.use_cpu_initialization or not torch.cuda.is_available()
        device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        self.weight = torch.nn.Parameter(
            torch.empty(num_local_experts, output_size, input_size, dtype=config.params_dtype, device=device)
        )
        init_expert_weights(self.weight, init_method, on_cpu)
        self.weight.allreduce = False  # Megatron's mark of an expert-parallel parameter
        self.weight.tensor_model_parallel, self.weight.partition_dim, self.weight.partition_stride = False, 0, 1
        self.register_state_dict_post_hook(per_expert_state)
        self.register_load_state_dict_pre_hook(stacked_state)

    def forward(self, x_NI: torch.Tensor, tokens_per_expert: list[int] | torch.Tensor) -> tuple[torch.Tensor, None]:
        """[N, I] expert-major rows, rows per local expert (a list, as TEGroupedMLP passes them) -> ([N, O], None)."""
        if len(tokens_per_expert) != self.num_local_experts:
            raise ValueError(
                f"GroupedLinear has {self.num_local_experts} local experts, got counts for {len(tokens_per_expert)}"
            )
        offsets_E = grouped_offsets(tokens_per_expert, x_NI.device)
        return grouped_matmul(x_NI, self.weight, offsets_E), None

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook: nothing is delayed here (`delay_wgrad_compute` is refused)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The weight as its share of the global `[experts, output, input]` tensor (module docstring), and an empty
        `_extra_state` per expert where Megatron's linear layers keep theirs (so either loads the other's)."""
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

        if (metadata or {}).get("singleton_local_shards", False):
            raise NotImplementedError(
                "occult's GroupedLinear saves its experts as one sharded tensor: checkpoint without "
                "singleton_local_shards (Megatron's default)"
            )
        ep_rank, ep_size = (self.ep_group.rank(), self.ep_group.size()) if self.ep_group is not None else (0, 1)
        replica = (0, 0, self.expt_dp_group.rank() if self.expt_dp_group is not None else 0)
        axis, first, experts = len(sharded_offsets), ep_rank * self.num_local_experts, ep_size * self.num_local_experts
        key = f"{prefix}weight"
        out = {
            key: ShardedTensor.from_rank_offsets(
                key, self.weight, *sharded_offsets, (axis, ep_rank, ep_size), replica_id=replica, prepend_axis_num=axis
            )
        }
        for e in range(self.num_local_experts):
            offsets = (*sharded_offsets, (axis, first + e, experts))
            out[f"{prefix}_extra_state{e}"] = make_sharded_object_for_checkpoint(
                None, f"{prefix}_extra_state", offsets, replica
            )
        return out


def per_expert_state(module: GroupedLinear, state: dict, prefix: str, local_metadata: Any) -> None:
    """`state_dict()` as Transformer Engine's `GroupedLinear` keys it: `weight{e}` [O, I] per local expert (views),
    so Megatron's and occult's state-dict tools (`to_placed_order`, `placed_local_experts`) read it as TE's."""
    weight = state.pop(f"{prefix}weight")
    for e in range(weight.shape[0]):
        state[f"{prefix}weight{e}"] = weight[e]


def stacked_state(module: GroupedLinear, state: dict, prefix: str, *args: Any) -> None:
    """`load_state_dict` of TE's per-expert keys (`weight0`, ... as `state_dict()` gives them) or of the stacked
    `weight` (what a distributed checkpoint loads): the per-expert ones stacked in place of the stacked one."""
    for e in range(module.num_local_experts):  # what `sharded_state_dict` gives Megatron's layers: nothing here
        state.pop(f"{prefix}_extra_state{e}", None)
    keys = [f"{prefix}weight{e}" for e in range(module.num_local_experts)]
    if f"{prefix}weight" not in state and all(k in state for k in keys):
        state[f"{prefix}weight"] = torch.stack([state.pop(k) for k in keys])


def unsupported(config: Any, bias: bool, is_expert: bool, pg_collection: Any) -> str | None:
    """What of a Megatron configuration `GroupedLinear` does not run (None: all of it)."""
    if bias:
        return "expert biases (add_bias_linear=True): set add_bias_linear=False"
    if not is_expert:
        return "a dense layer: it holds experts only"
    tp = getattr(pg_collection, "expt_tp", None)
    if tp is not None and tp.size() > 1:
        return f"expert tensor parallelism (expert_tensor_parallel_size={tp.size()}): use 1"
    if getattr(config, "delay_wgrad_compute", False):
        return "delay_wgrad_compute: set it False"
    if config.fp8 or getattr(config, "fp4", None):
        return "fp8 / fp4 (Transformer Engine's): use bf16"
    return None


def init_expert_weights(weight_EOI: torch.Tensor, init_method: Callable[[torch.Tensor], None], on_cpu: bool) -> None:
    """Each local expert's [O, I] weight from Megatron's `init_method`, as its linear layers draw them: on GPUs
    under the expert-parallel RNG stream (each EP rank its own experts), on CPU from torch's generator in fp32."""
    with torch.no_grad():
        if on_cpu:
            for e in range(weight_EOI.shape[0]):
                master = torch.empty(weight_EOI.shape[1:], dtype=torch.float32)
                init_method(master)
                weight_EOI[e].copy_(master)
            return
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            for e in range(weight_EOI.shape[0]):
                init_method(weight_EOI[e])
