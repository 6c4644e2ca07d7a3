"""TorchTitan's `MoE` layer (`torchtitan.models.common.moe`, TorchTitan 0.3.0) with its own expert parallelism.

Built the way TorchTitan's Qwen3 / DeepSeek-V3 models build theirs: `make_moe_config` with a
softmax `TokenChoiceTopKRouter` (top-k, no renormalisation, no node-limited groups), a
`RoutedExperts` of `GroupedExperts` (SwiGLU: `w2 @ (silu(w1 x) * w3 x)`, three `torch._grouped_mm`
calls on the received rows) and the `"standard"` dispatcher `AllToAllTokenDispatcher` (one row per
(token, expert) pair out and back with `all_to_all_single`, split sizes read back once per layer),
no shared experts, `load_balance_coeff=None` (no expert-bias buffer, no load-balancing update).
`set_moe_sharding_config(enable_ep=True, enable_sp=False)` then `moe.parallelize(ParallelDims(
dp_shard=N, ep=N, tp=1))`: the expert weights become `Shard(0)` DTensors over the EP mesh of all
ranks (contiguous blocks of E/N experts), the dispatcher gets the EP mesh. SPMD backend
`"partial_dtensor"` (DTensor for the model-parallel axes only): the default `"spmd_types"` needs
the SPMD mesh context that TorchTitan's trainer sets up around the whole model.

Same weights: `w1_EFD[e]` is the gate half of `w1_full[e]` (rows :F), `w3_EFD[e]` the up half
(rows F:), `w2_EDF[e]` is `w2_full[e]`, the router gate [E, H] is `gate_w`. Same routing: the
router's `forward` is replaced on the instance: its own gate in float32, softmax over all
experts, taken at the preset ids (as `PresetRouter`). TorchTitan's `GroupedExperts` always casts
activations and weights to bfloat16 for the grouped GEMMs, so even on float32 CPU ranks its error
against the float32 reference is bfloat16's (~1e-3).

TorchTitan targets GPUs (its `device_type` falls back to "cuda"); `cpu_shims` (tests only) points
its mesh construction at the CPU. The wheel declares no torch requirement; on torch 2.11 (the GPU
image) its dispatcher calls `torch.compiler._is_non_strict_tracing()`, which 2.11 lacks (later
torch has it: True only inside a non-strict make_fx trace), so `torch_compat` adds a stand-in
that returns False, what it returns in eager code.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from peer_common import Case, Peer

SPMD_BACKEND = "partial_dtensor"


def cpu_shims() -> None:
    """Build TorchTitan's device meshes on the CPU (gloo smoke tests only)."""
    from torchtitan.distributed import parallel_dims

    parallel_dims.device_type = "cpu"
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")


_ADDED: list[str] = []  # every stand-in torch_compat has put in place in this process


def torch_compat() -> list[str]:
    """Stand-ins for the torch APIs TorchTitan 0.3.0 calls that this torch lacks; returns the names of
    all stand-ins in place (this call's and earlier calls')."""
    added = _ADDED
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # torch 2.11: only is_compiling()
        torch.compiler._is_non_strict_tracing = lambda: False  # type: ignore[attr-defined]
        added.append("torch.compiler._is_non_strict_tracing")
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):  # torch 2.11; imported by TorchTitan's FSDP helpers

        class DataParallelMeshDims:  # built only by the "full_dtensor" SPMD backend, which the peers do not use
            def __init__(self, *args, **kwargs) -> None:
                raise NotImplementedError(
                    "this torch has no fsdp.DataParallelMeshDims (TorchTitan's full_dtensor backend)"
                )

        fsdp.DataParallelMeshDims = DataParallelMeshDims  # type: ignore[attr-defined]
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    return list(added)


class TorchTitanPeer(Peer):
    name = "TorchTitan MoE"

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        self.compat = torch_compat()
        if case.device.type == "cpu":
            cpu_shims()
        import spmd_types as spmd
        import torchtitan
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as tt_dist
        from torchtitan.models.common.config_utils import (
            make_moe_config,
            make_routed_experts_config,
            make_router_config,
        )
        from torchtitan.models.common.moe_sharding import set_moe_sharding_config

        s = case.shape
        E, H, Fd, K = s.experts, s.hidden, s.ffn, s.top_k
        tt_dist.set_spmd_backend(SPMD_BACKEND)
        cfg = make_moe_config(
            num_experts=E,
            router=make_router_config(
                dim=H,
                num_experts=E,
                gate_param_init={},
                top_k=K,
                score_func="softmax",
                route_norm=False,
                route_scale=1.0,
            ),
            routed_experts=make_routed_experts_config(
                dim=H, hidden_dim=Fd, num_experts=E, top_k=K, param_init={}, comm_backend="standard"
            ),
            shared_experts=None,
            load_balance_coeff=None,
        )
        set_moe_sharding_config(
            cfg,
            enable_ep=True,
            enable_sp=False,  # the layout TorchTitan's models pass
            expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)},
        )
        with torch.device(case.device):
            moe = cfg.build()
        moe = moe.to(dtype=case.dtype)
        with torch.no_grad():  # full weights first; parallelize() shards them by expert
            ex = moe.routed_experts.inner_experts
            ex.w1_EFD.copy_(case.w1_full[:, :Fd])
            ex.w3_EFD.copy_(case.w1_full[:, Fd:])
            ex.w2_EDF.copy_(case.w2_full)
            moe.router.gate.weight.copy_(case.gate_w)
        dims = ParallelDims(
            dp_replicate=1,
            dp_shard=case.world,
            cp=1,
            tp=1,
            pp=1,
            ep=case.world,
            world_size=case.world,
            spmd_backend=SPMD_BACKEND,
        )
        dims.build_mesh()
        moe.parallelize(dims)
        sl = case.local_slice()
        ex = moe.routed_experts.inner_experts
        for name, full in (
            ("w1_EFD", case.w1_full[sl, :Fd]),
            ("w3_EFD", case.w1_full[sl, Fd:]),
            ("w2_EDF", case.w2_full[sl]),
        ):
            p = getattr(ex, name)
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.shape[0] != case.local_experts or not torch.equal(local, full):
                raise RuntimeError(f"TorchTitan's EP did not give rank {case.rank} its block of experts ({name})")
        dispatcher = moe.routed_experts.token_dispatcher
        self.dispatcher = type(dispatcher).__name__
        self.ep_size = dispatcher.ep_mesh.size() if getattr(dispatcher, "ep_mesh", None) is not None else 1
        if self.ep_size != case.world:
            raise RuntimeError(f"TorchTitan's dispatcher has an EP mesh of {self.ep_size} ranks, not {case.world}")
        self.version = getattr(torchtitan, "__version__", "?")

        # Force the preset routing: the router's own gate (float32), softmax over all experts, at the ids.
        router = moe.router
        self._cur = {"i": 0}

        def preset_forward(x_BLD, expert_bias_E=None):
            with torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32):
                scores_BLE = router.gate(x_BLD)
            scores_BLE = F.softmax(scores_BLE.float(), dim=-1)
            ids_BLK = case.ids[self._cur["i"]].view(*x_BLD.shape[:-1], K)
            return scores_BLE.gather(-1, ids_BLK), ids_BLK, scores_BLE

        router.forward = preset_forward
        moe.train()
        self.moe = moe

    def __call__(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self._cur["i"] = i
        out = self.moe(x.unsqueeze(0))  # [B=1, T, H]
        if hasattr(out, "to_local"):
            out = out.to_local()
        return out.squeeze(0)

    def info(self) -> dict:
        return {
            "torchtitan": self.version,
            "dispatcher": self.dispatcher,
            "ep_size": self.ep_size,
            "spmd_backend": SPMD_BACKEND,
            "experts": "GroupedExperts (torch._grouped_mm, bf16)",
            "torch_stand_ins": self.compat,
        }


def build(case: Case) -> Peer:
    return TorchTitanPeer(case)
