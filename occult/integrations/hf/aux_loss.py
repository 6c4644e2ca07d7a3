"""The load-balancing (auxiliary) loss of a converted transformers model over the global batch
(`finetune` with `FinetuneConfig.aux_loss_coef > 0`).

`RouterTaps(model)` taps every MoE block (`OccultMoeBlock.routing_tap`: the router logits [T, E], with their
graph, and the expert ids actually routed to, after any pruning, made beside the experts so that a replayed
experts call serves them too; no hooks) and keeps them per forward, apart per thread (the two halves of a
two-batch step, `occult.training.two_batch`, each tap their own forward on a thread of their own);
`taps.loss(group)` turns one forward's taps into the loss, with one all-reduce over `group` of
each layer's assignment counts [E], probability sums [E] and row count. Two formulas:

    "transformers"  the family's own `load_balancing_loss_func` (OLMoE, Qwen2-MoE, Qwen3-MoE,
                    Mixtral: what the model adds to its loss with `output_router_logits=True`):
                    every layer pooled, counts of the top-k of softmax(logits) (as transformers
                    computes them, i.e. before pruning), E * sum_e (counts_e / rows) * (probs_e / rows)
    "switch"        the Switch Transformer loss, for a family without one (DeepSeek-V3, whose
                    balance comes from its score-correction bias): per layer, the fraction of the
                    routed assignments each expert got (the ids used) times its mean normalised
                    score (the router's scores divided by their sum per token), E * sum_e, mean
                    over layers

The value is the loss of the global batch on every rank; its gradient is W (the group size)
times this rank's share, so gradients averaged over the W ranks (DDP) are those of the global
loss, as in OccultLM (`occult.lm.model.global_aux_loss`).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from occult.integrations.hf.block import OccultMoeBlock

FORMULAS = ("transformers", "switch")


def aux_formula(model: nn.Module) -> str:
    """ "transformers" when the model's modeling module has `load_balancing_loss_func`, else "switch"."""
    module = sys.modules.get(type(model).__module__)
    return "transformers" if hasattr(module, "load_balancing_loss_func") else "switch"


class RouterTaps:
    """Router logits and routed expert ids of every MoE block, per forward (the blocks' taps; `close` removes
    them)."""

    def __init__(self, model: nn.Module, formula: str | None = None) -> None:
        self.blocks = [b for b in model.modules() if isinstance(b, OccultMoeBlock)]
        if not self.blocks:
            raise ValueError("the model has no converted MoE blocks")
        self.formula = formula or aux_formula(model)
        if self.formula not in FORMULAS:
            raise ValueError(f"aux-loss formula must be one of {FORMULAS}, got {self.formula!r}")
        self._kept = threading.local()  # this thread's forward: its logits and ids
        for b in self.blocks:
            if b.routing_tap is not None:
                raise ValueError("the model's MoE blocks are tapped already: close the other RouterTaps first")
            b.routing_tap = self._keep

    @property
    def logits(self) -> list[torch.Tensor]:
        """The router logits this thread's forward tapped so far, a block at a time."""
        return self._lists()[0]

    @property
    def ids(self) -> list[torch.Tensor]:
        """The expert ids this thread's forward routed to so far, a block at a time."""
        return self._lists()[1]

    def _lists(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not hasattr(self._kept, "logits"):
            self._kept.logits, self._kept.ids = [], []
        return self._kept.logits, self._kept.ids

    def _keep(self, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> None:
        self.logits.append(logits_TE)
        self.ids.append(ids_TK)

    def close(self) -> None:
        for b in self.blocks:
            if b.routing_tap == self._keep:
                b.routing_tap = None

    def clear(self) -> None:
        self.logits.clear()
        self.ids.clear()

    def loss(self, group: Any = None) -> torch.Tensor:
        """The load-balancing loss of the last forward, over every rank of `group` (None: this rank)."""
        L = len(self.blocks)
        if len(self.logits) != L or len(self.ids) != L:
            raise RuntimeError(
                f"expected one router call per MoE layer ({L}), got {len(self.logits)} logits, {len(self.ids)} ids"
            )
        E, k = int(self.blocks[0].experts.num_experts), int(self.blocks[0].experts.top_k)
        counts, psums, rows = [], [], []
        for block, logits_TE, ids_TK in zip(self.blocks, self.logits, self.ids):
            if self.formula == "transformers":
                probs_TE = torch.softmax(logits_TE.float(), dim=-1)
                chosen = torch.topk(probs_TE, k, dim=-1).indices
            else:
                scores_TE = block.experts.router.scores(logits_TE)
                probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)
                chosen = ids_TK
            flat = chosen.reshape(-1)
            counts.append(
                torch.zeros(E, dtype=torch.float32, device=flat.device).scatter_add_(
                    0, flat, torch.ones_like(flat, dtype=torch.float32)
                )
            )
            psums.append(probs_TE.sum(0))
            rows.append(probs_TE.new_full((), float(probs_TE.shape[0])))  # made on the device: no copy (CUDA graphs)
        self.clear()
        C_LE, P_LE, R_L = torch.stack(counts), torch.stack(psums), torch.stack(rows)
        W = 1
        Cg, Pg, Rg = C_LE, P_LE.detach(), R_L
        if group is not None and dist.get_world_size(group) > 1:
            W = dist.get_world_size(group)
            buf = torch.cat([C_LE.reshape(-1), P_LE.detach().reshape(-1), R_L])
            dist.all_reduce(buf, group=group)
            Cg, Pg, Rg = buf[: L * E].view(L, E), buf[L * E : 2 * L * E].view(L, E), buf[2 * L * E :]

        def formula(P: torch.Tensor) -> torch.Tensor:  # linear in the probability sums P
            if self.formula == "transformers":
                total = Rg.sum().clamp_min(1.0)
                return E * ((Cg.sum(0) / total) * (P.sum(0) / total)).sum()
            per_row = Rg.clamp_min(1.0)[:, None]
            return (E * ((Cg / (per_row * k)) * (P / per_row)).sum(-1)).mean()

        value, mine = formula(Pg), formula(P_LE) * W
        return mine + (value - mine).detach()


__all__ = ["FORMULAS", "RouterTaps", "aux_formula"]
