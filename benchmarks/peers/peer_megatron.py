"""Megatron-Core's `MoELayer` with the `alltoall` token dispatcher, local spec (no Transformer Engine).

`get_moe_module_spec(use_te=False, moe_grouped_gemm=False)`: the router is `TopKRouter`, the
experts a `SequentialMLP` (one `MLP` per local expert, run one after another: without Transformer
Engine Megatron-Core has no grouped GEMM), the dispatcher `MoEAlltoAllTokenDispatcher` (one row
per (token, expert) pair out and back, split sizes copied to the host once per layer).

Same weights: expert e's `linear_fc1.weight` [2F, H] is `w1_full[e]` (gate rows first: Megatron's
`gated_linear_unit` chunks fc1's output in two and applies `activation_func` (silu) to the first
half, times the second), `linear_fc2.weight` [H, F] is `w2_full[e]`, the router weight [E, H] is
`gate_w`. Same routing: `TopKRouter.routing` is replaced on the instance: the router's own fp32
logits (`moe_router_dtype="fp32"`), softmax over all experts, taken at the preset ids, returned as
Megatron's dense `probs` [T, E] and `routing_map` [T, E]. No aux loss, no capacity (dropless).

Megatron-Core is built for GPUs; `cpu_shims` (occult.integrations.megatron.cpu, tests only) lets it run on
gloo CPU ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peer_common import Case, Peer

from occult.integrations.megatron.cpu import cpu_shims


class MegatronPeer(Peer):
    name = "Megatron-Core MoELayer"

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        on_cpu = case.device.type == "cpu"
        if on_cpu:
            cpu_shims()
        from megatron.core import parallel_state
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        s = case.shape
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1,
                expert_model_parallel_size=case.world,
                create_gloo_process_groups=False,
            )
        bf16 = case.dtype == torch.bfloat16
        config = TransformerConfig(
            num_layers=1,
            hidden_size=s.hidden,
            num_attention_heads=16,
            ffn_hidden_size=s.ffn,
            moe_ffn_hidden_size=s.ffn,
            num_moe_experts=s.experts,
            moe_router_topk=s.top_k,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            bias_activation_fusion=False,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32",
            moe_permute_fusion=False,
            gradient_accumulation_fusion=False,
            tensor_model_parallel_size=1,
            expert_model_parallel_size=case.world,
            sequence_parallel=False,
            bf16=bf16,
            params_dtype=case.dtype,
            pipeline_dtype=case.dtype,
            perform_initialization=False,
            use_cpu_initialization=on_cpu,
        )
        spec = get_moe_module_spec(use_te=False, num_experts=s.experts, moe_grouped_gemm=False)
        layer = spec(config=config, layer_number=1)
        layer = layer.to(device=case.device)
        local = list(layer.local_expert_indices)
        if local != list(range(case.local_slice().start, case.local_slice().stop)):
            raise RuntimeError(
                f"Megatron placed experts {local} on rank {case.rank}, not a contiguous block in rank order"
            )
        with torch.no_grad():
            layer.router.weight.copy_(case.gate_w.to(layer.router.weight.dtype))
            for j, e in enumerate(local):
                mlp = layer.experts.local_experts[j]
                mlp.linear_fc1.weight.copy_(case.w1_full[e])
                mlp.linear_fc2.weight.copy_(case.w2_full[e])
        self.dispatcher = type(layer.token_dispatcher).__name__
        self.experts = type(layer.experts).__name__

        # Force the preset routing (same probs as occult's PresetRouter: no top-k renormalisation).
        router = layer.router
        if on_cpu:  # Router.gating moves a CPU weight to the GPU; on CPU, the same op without the move
            from megatron.core.transformer.moe.moe_utils import router_gating_linear

            router.gating = lambda inp: router_gating_linear(inp, router.weight, None, torch.float32)
        self._cur = {"i": 0}
        num_experts = s.experts

        def preset_routing(logits, padding_mask=None):
            logits = logits.view(-1, num_experts)
            ids = case.ids[self._cur["i"]]
            probs = torch.softmax(logits.float(), dim=-1)
            probs = torch.zeros_like(probs).scatter(1, ids, probs.gather(1, ids))
            routing_map = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device).scatter(1, ids, True)
            return probs, routing_map

        router.routing = preset_routing
        layer.train()
        self.layer = layer

    def __call__(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self._cur["i"] = i
        out, bias = self.layer(x.unsqueeze(1))  # [S, B=1, H]
        assert bias is None
        return out.squeeze(1)

    def info(self) -> dict:
        return {"dispatcher": self.dispatcher, "experts": self.experts, "spec": "get_moe_module_spec(use_te=False)"}

    def close(self) -> None:
        # The model-parallel groups stay for the run (a later peer of the same run may not need them).
        pass


def build(case: Case) -> Peer:
    return MegatronPeer(case)
