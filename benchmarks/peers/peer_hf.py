"""transformers' built-in expert parallelism (all-to-all) on an OLMoE or a Qwen3-MoE MoE block.

`DistributedConfig(ep_size=N, ep_implementation="all_to_all")` makes `from_pretrained` apply the
model's `base_model_ep_plan` with `apply_expert_parallelism`: the experts' `gate_up_proj` and
`down_proj` are sharded by expert (`grouped_gemm` style: `Shard(0)` DTensors, contiguous blocks
of E/N experts) and the experts module gets `AllToAllEP` (`ep_dispatch_experts` style): one
(token, expert) row per top-k choice out and back, the split sizes read back once per layer, the
experts run by transformers' `grouped_mm` experts implementation on the received rows. We apply
that same function with that same plan (relative to the block) to one MoE block, because
`from_pretrained` needs `fsdp_size * tp_size` to be a multiple of `ep_size` and then wraps every
layer in FSDP2, whose weight all-gathers are not part of the dispatcher (and whose pre-forward
hooks belong to the decoder layer, not the block we time).

Needs transformers >= 5.23 (where `ep_implementation` exists).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from peer_common import Case, Peer

BLOCKS = ("olmoe", "qwen3_moe")


def _block(model: str, case: Case):
    s = case.shape
    common = dict(
        hidden_size=s.hidden,
        num_experts=s.experts,
        num_experts_per_tok=s.top_k,
        norm_topk_prob=False,
        num_hidden_layers=1,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=128,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    if model == "olmoe":
        from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

        config = OlmoeConfig(intermediate_size=s.ffn, **common)
        cls = OlmoeSparseMoeBlock
    elif model == "qwen3_moe":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(moe_intermediate_size=s.ffn, intermediate_size=s.ffn, **common)
        cls = Qwen3MoeSparseMoeBlock
    else:
        raise ValueError(f"unknown transformers block {model!r}; choose from {BLOCKS}")
    # What from_pretrained picks on a GPU: transformers' grouped_mm experts (torch._grouped_mm).
    config._experts_implementation = os.environ.get("PEERS_HF_EXPERTS") or (
        "grouped_mm" if case.device.type == "cuda" else "eager"
    )
    with torch.device(case.device):
        block = cls(config).to(case.dtype)
    return block


class HFExpertParallelPeer(Peer):
    def __init__(self, case: Case, model: str) -> None:
        super().__init__(case)
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.expert_parallel import AllToAllEP, apply_expert_parallelism

        self.name = f"transformers EP ({model})"
        block = _block(model, case)
        with torch.no_grad():
            block.gate.weight.copy_(case.gate_w)
            block.experts.gate_up_proj.copy_(case.w1_full)
            block.experts.down_proj.copy_(case.w2_full)
        # The meshes from_pretrained builds for DistributedConfig(ep_size=N): EP over all ranks, TP of 1.
        mesh = init_device_mesh(case.device.type, (case.world, 1), mesh_dim_names=("ep", "tp"))
        plan = {  # the models' base_model_ep_plan, relative to the block: parameters first, then the module
            "experts.gate_up_proj": "grouped_gemm",
            "experts.down_proj": "grouped_gemm",
            "experts": "ep_dispatch_experts",
        }
        apply_expert_parallelism(block, mesh["ep"], mesh["tp"], plan, ep_implementation="all_to_all")
        local = block.experts.gate_up_proj.to_local()
        if local.shape[0] != case.local_experts or not torch.equal(local, case.w1_full[case.local_slice()]):
            raise RuntimeError("transformers EP did not keep this rank's contiguous block of experts")
        self.implementation = AllToAllEP.__name__
        self.experts_implementation = block.experts.config._experts_implementation

        # Force the preset routing: the router's own logits, softmax over all experts, taken at the ids.
        gate = block.gate
        self._ids = {"i": 0}

        def preset_forward(hidden_states):
            hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
            logits = F.linear(hidden_states, gate.weight)
            ids = case.ids[self._ids["i"]]
            probs = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
            return logits, probs.to(logits.dtype), ids

        gate.forward = preset_forward
        self.block = block

    def __call__(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self._ids["i"] = i
        return self.block(x.unsqueeze(0)).squeeze(0)

    def info(self) -> dict:
        return {
            "ep_implementation": "all_to_all",
            "class": self.implementation,
            "experts_implementation": self.experts_implementation,
        }


def build_olmoe(case: Case) -> Peer:
    return HFExpertParallelPeer(case, "olmoe")


def build_qwen3_moe(case: Case) -> Peer:
    return HFExpertParallelPeer(case, "qwen3_moe")
