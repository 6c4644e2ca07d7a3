"""occult's `OccultMoE`: `standard` (one row per (token, expert)) and `dedup` (one row per (token, device))."""

from __future__ import annotations

import torch
from peer_common import Case, Peer

from occult.moe.layer import OccultMoE
from occult.placement import Placement
from occult.tools.bench import PresetRouter


class OccultPeer(Peer):
    def __init__(self, case: Case, dispatcher: str, expert_backend: str = "auto") -> None:
        super().__init__(case)
        self.name = f"occult {dispatcher}"
        s = case.shape
        layer = OccultMoE(
            s.hidden,
            s.ffn,
            s.experts,
            s.top_k,
            placement=Placement.contiguous(s.experts, case.world),
            dispatcher=dispatcher,
            expert_backend=expert_backend,
            dtype=case.dtype,
            device=case.device,
        )
        with torch.no_grad():
            layer.gate_up_proj.copy_(case.w1_full[layer.local_expert_ids])
            layer.down_proj.copy_(case.w2_full[layer.local_expert_ids])
            layer.router.gate.weight.copy_(case.gate_w)
        self.routers = [PresetRouter(layer.router.gate, ids) for ids in case.ids]
        self.layer = layer

    def __call__(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self.layer.router = self.routers[i]
        return self.layer(x)

    def info(self) -> dict:
        st = self.layer.last_comm_stats
        return {
            "forward_rows_sent": int(st.dispatch_rows),
            "tokens": self.case.tokens,
            "rows_per_token": st.dispatch_rows / max(1, self.case.tokens),
        }


def build_standard(case: Case) -> Peer:
    return OccultPeer(case, "standard")


def build_dedup(case: Case) -> Peer:
    return OccultPeer(case, "dedup")
