"""DeepSpeed-MoE's `deepspeed.moe.layer.MoE` (GShard-style capacity buffers, dropless here).

`MoE(hidden, expert, num_experts=E, ep_size=N, k=K, drop_tokens=False)`: the `TopKGate` (k > 2:
`topkgating`) puts every (token, expert) pair into an [E, C, H] buffer whose capacity C is the
largest per-expert count over the EP group (no token dropped), one all-to-all of that buffer out
and one back, the E/N local experts run one after another (`Experts` holds copies of the expert
module), then each token gathers its k results weighted by the gate.

Same weights: the expert module is a bias-free SwiGLU MLP whose `fc1.weight` [2F, H] is
`w1_full[e]` (gate rows first) and `fc2.weight` [H, F] is `w2_full[e]`; the gate's `wg.weight`
is `gate_w`. Routing: DeepSpeed's top-k gate always renormalises the k gate values, so its
function is softmax over the k chosen experts, not over all E; it is checked against that
(renormalised) reference. The preset ids are forced by adding a constant (1000) to the chosen
logits before DeepSpeed's own `topkgating` (float32): its top-k then picks exactly the preset
experts, and its softmax over the shifted logits equals the renormalised softmax at the ids
(the other experts' terms underflow to 0); gradients reach the gate unchanged.

Installed from a wheel built without compiled ops (`DS_BUILD_OPS=0`): the MoE layer needs none.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from peer_common import Case, Peer

_SHIFT = 1000.0


class SwiGLUExpert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(g) * u)


class DeepSpeedPeer(Peer):
    name = "DeepSpeed-MoE"
    renormalized = True

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.moe import sharded_moe
        from deepspeed.moe.layer import MoE

        s = case.shape
        ds_dist.init_distributed(
            dist_backend="nccl" if case.device.type == "cuda" else "gloo", auto_mpi_discovery=False, verbose=False
        )
        self._cur = {"i": 0}
        if not getattr(sharded_moe, "_occult_wrapped", False):
            original = sharded_moe.topkgating

            def topkgating(logits, k, *args, **kwargs):
                preset = getattr(sharded_moe, "_occult_preset", None)
                if preset is not None:
                    ids = preset()
                    logits = logits + torch.zeros_like(logits).scatter(1, ids, _SHIFT)
                return original(logits, k, *args, **kwargs)

            sharded_moe.topkgating = topkgating
            sharded_moe._occult_wrapped = True
        sharded_moe._occult_preset = lambda: case.ids[self._cur["i"]]
        self._sharded_moe = sharded_moe

        expert = SwiGLUExpert(s.hidden, s.ffn)
        moe = MoE(
            hidden_size=s.hidden,
            expert=expert,
            num_experts=s.experts,
            ep_size=case.world,
            k=s.top_k,
            capacity_factor=1.0,
            eval_capacity_factor=1.0,
            min_capacity=0,
            drop_tokens=False,
            use_rts=False,
        )
        moe.set_deepspeed_parallelism()
        moe = moe.to(device=case.device, dtype=case.dtype)
        group = moe.deepspeed_moe.ep_group
        ep_rank = torch.distributed.get_rank(group=group) if case.world > 1 else 0
        n = case.local_experts
        local = list(range(ep_rank * n, (ep_rank + 1) * n))
        if local != list(range(case.local_slice().start, case.local_slice().stop)):
            raise RuntimeError(f"DeepSpeed's EP rank {ep_rank} differs from global rank {case.rank}")
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight.copy_(case.gate_w)
            for j, e in enumerate(local):
                ex = moe.deepspeed_moe.experts.deepspeed_experts[j]
                ex.fc1.weight.copy_(case.w1_full[e])
                ex.fc2.weight.copy_(case.w2_full[e])
        moe.train()
        self.moe = moe
        self.version = deepspeed.__version__

    def __call__(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self._cur["i"] = i
        out, _l_aux, _counts = self.moe(x)
        return out

    def info(self) -> dict:
        return {"deepspeed": self.version, "gate": "topkgating (k > 2), drop_tokens=False", "renormalized": True}

    def close(self) -> None:
        self._sharded_moe._occult_preset = None


def build(case: Case) -> Peer:
    return DeepSpeedPeer(case)
