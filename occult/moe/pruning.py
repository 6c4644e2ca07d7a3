"""Collaboration pruning: limit every token to experts on at most N devices.

Three variants (the paper's two and a third), all for any placement (any expert -> device map with equal
experts per device, not only contiguous groups):

- **router-score** (`method="score"`): walk the token's experts by descending score and collect
  their devices until N distinct ones are found; take the top-k among all experts on those
  devices. (The first N distinct devices in score order are the N devices with the highest
  best-expert score, which is how it is computed: one `scatter_reduce` and two `topk`s.)
- **similarity** (`method="similarity"`): start from the plain top-k; the allowed devices are the
  first N distinct devices in score order; replace every chosen expert outside them, in score
  order, by the most similar not-yet-chosen expert on an allowed device. Similarity is the
  cosine of the experts' router-logit columns measured on profiling data
  (`expert_similarity`, `SimilarityAccumulator`, `occult profile`).
- **gate mass** (`method="mass"`): the allowed devices are the N devices holding the most of the
  token's plain top-k gate weight (the sum of its top-k scores on each device); then the top-k
  among all experts on those devices, as for `score`. It keeps the devices that carry most of the
  token's output rather than the one best expert's. (Meant for probabilities: scores >= 0.)

**Gate weights** after pruning are the router's probabilities (`scores_TE`, e.g. the softmax
over all E experts) of the experts finally chosen, *not* re-softmaxed over the allowed set.
They are renormalised to sum 1 only when `norm_topk_prob=True`, i.e. only where the model
renormalises its plain top-k (Qwen-MoE style); a model that does not (OLMoE, Mixtral's
`norm_topk_prob=False` configs) keeps un-normalised weights after pruning too.

A token whose plain top-k already spans at most N devices keeps exactly its plain top-k ids and
weights (same order, bit for bit). Everything is vectorised over tokens (loops only over k).
Device ids only need to be < E, so no host sync is needed to learn the device count; the
capacity check (N devices must hold >= k experts) is done once per `expert_device_E` tensor.

**Node-limited** routing (`max_nodes=N`, DeepSeek-V3 style: a token's experts on at most N
nodes; `expert_node_E` maps experts to nodes) follows the same two variants with nodes in place
of devices. Both limits together: the allowed nodes are the first `max_nodes` nodes in score
order, then the allowed devices are the first `max_devices` devices in score order *on those
nodes* (the same as walking experts by score and collecting devices, skipping any device that
would open a node beyond the limit).

`limit_routers` turns device-limited routing on for every `TopKRouter` of a model with a
placement of any device count, e.g. a 4-device *virtual* placement on one GPU (the layer's
own `expert_device_E` stays the world-size one, so single-rank dispatch is unchanged).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

from occult.moe.similarity import (  # noqa: F401 - re-exported: the similarity tables are pruning's input
    PruningError,
    SimilarityAccumulator,
    expert_similarity,
    load_similarity,
    save_similarity,
    similarity_path,
)

METHODS = ("score", "similarity", "mass")


def _experts_per_device(expert_device_E: torch.Tensor) -> int:
    """Fewest experts any used device holds; computed once per tensor (one host sync), then cached."""
    cached = getattr(expert_device_E, "_occult_min_per_device", None)
    version = expert_device_E._version
    if cached is not None and cached[0] == version:
        return cached[1]
    counts = torch.bincount(expert_device_E.reshape(-1).to(torch.int64))
    value = int(counts[counts > 0].min().item())
    try:
        expert_device_E._occult_min_per_device = (version, value)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # pragma: no cover - tensors accept attributes
        pass
    return value


def _check_device_map(expert_device_E: torch.Tensor, num_experts: int) -> torch.Tensor:
    if expert_device_E.dim() != 1 or expert_device_E.shape[0] != num_experts:
        raise PruningError(
            f"expert_device_E must have shape [{num_experts}] (one device per expert), "
            f"got {list(expert_device_E.shape)}"
        )
    return expert_device_E.to(torch.int64)


def devices_per_token(ids_TK: torch.Tensor, expert_device_E: torch.Tensor) -> torch.Tensor:
    """[T] C_T: distinct devices among each token's experts (torch, on the ids' device)."""
    dev_TK = expert_device_E.to(ids_TK.device, torch.int64)[ids_TK]
    num_bins = int(expert_device_E.shape[0])  # device ids are < E for any balanced placement
    used_TD = torch.zeros(ids_TK.shape[0], num_bins, dtype=torch.bool, device=ids_TK.device)
    used_TD.scatter_(1, dev_TK, True)
    return used_TD.sum(1)


def allowed_devices(scores_TE: torch.Tensor, expert_device_E: torch.Tensor, max_devices: int) -> torch.Tensor:
    """[T, E] bool mask of the experts on each token's first `max_devices` devices in score order.

    The first N distinct devices met when walking experts by descending score are the N devices
    whose best expert scores highest.
    """
    T, E = scores_TE.shape
    dev_TE = expert_device_E.to(scores_TE.device, torch.int64).expand(T, E)
    best_TD = torch.full((T, E), float("-inf"), dtype=scores_TE.dtype, device=scores_TE.device)
    best_TD = best_TD.scatter_reduce(1, dev_TE, scores_TE, reduce="amax", include_self=True)
    top_TN = best_TD.topk(min(max_devices, E), dim=1).indices
    allowed_TD = torch.zeros((T, E), dtype=torch.bool, device=scores_TE.device).scatter_(1, top_TN, True)
    return allowed_TD.gather(1, dev_TE)


def allowed_by_mass(
    scores_TE: torch.Tensor, expert_device_E: torch.Tensor, max_devices: int, top_k: int
) -> torch.Tensor:
    """[T, E] bool mask of the experts on each token's `max_devices` devices of largest top-k gate mass.

    A device's mass is the sum of the token's top-k scores (of `scores_TE`, -inf = not allowed)
    on it; devices without any of them have mass 0 (-inf where no expert may be chosen).
    """
    T, E = scores_TE.shape
    dev_TE = expert_device_E.to(scores_TE.device, torch.int64).expand(T, E)
    top_w, top_ids = scores_TE.topk(top_k, dim=1)
    mass_TD = torch.full((T, E), float("-inf"), dtype=scores_TE.dtype, device=scores_TE.device)
    mass_TD = mass_TD.scatter_reduce(1, dev_TE, scores_TE.clamp(max=0.0), reduce="amax", include_self=True)
    mass_TD = mass_TD.scatter_add(1, dev_TE.gather(1, top_ids), top_w)
    top_TN = mass_TD.topk(min(max_devices, E), dim=1).indices
    allowed_TD = torch.zeros((T, E), dtype=torch.bool, device=scores_TE.device).scatter_(1, top_TN, True)
    return allowed_TD.gather(1, dev_TE)


# ------------------------------------------------------------------ routing
def device_limited_topk(
    scores_TE: torch.Tensor,
    top_k: int,
    expert_device_E: torch.Tensor,
    max_devices: int | None,
    method: str = "score",
    similarity_EE: torch.Tensor | None = None,
    norm_topk_prob: bool = False,
    *,
    max_nodes: int | None = None,
    expert_node_E: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts limited to `max_devices` devices (and/or `max_nodes` nodes) per token: `(weights_TK, ids_TK)`.

    `scores_TE` are the router's probabilities (any float scores work; higher = preferred),
    `expert_device_E[e]` the device of expert `e` under the placement to limit against. Weights
    are `scores_TE` at the chosen ids, renormalised only if `norm_topk_prob`; they carry the
    gradient of `scores_TE`. Ids come in descending weight order. `max_devices=None` is plain
    top-k. Tokens already within the limit keep their plain top-k exactly. `max_nodes` needs
    `expert_node_E[e]`, the node of expert `e` (module docstring for both limits together);
    `expert_device_E` may be None when only `max_nodes` is given.
    """
    if scores_TE.dim() != 2:
        raise PruningError(f"scores must have shape [tokens, experts], got {list(scores_TE.shape)}")
    T, E = scores_TE.shape
    if not 1 <= top_k <= E:
        raise PruningError(f"top_k must be in [1, num_experts={E}], got {top_k}")
    if method not in METHODS:
        raise PruningError(f"prune method must be one of {METHODS}, got {method!r}")
    plain_w, plain_ids = torch.topk(scores_TE, top_k, dim=-1)
    if max_devices is None and max_nodes is None:
        return _finish(plain_w, plain_ids, norm_topk_prob)
    limits = _checked_limits(
        scores_TE, top_k, expert_device_E, max_devices, method, similarity_EE, max_nodes, expert_node_E
    )
    if T == 0:
        return _finish(plain_w, plain_ids, norm_topk_prob)
    with torch.no_grad():
        ids_TK = _limited_ids(scores_TE.detach(), plain_ids, top_k, limits, method, similarity_EE)
    weights_TK = scores_TE.gather(1, ids_TK)
    return _finish(weights_TK, ids_TK, norm_topk_prob)


def _checked_limits(
    scores_TE: torch.Tensor,
    top_k: int,
    expert_device_E: torch.Tensor | None,
    max_devices: int | None,
    method: str,
    similarity_EE: torch.Tensor | None,
    max_nodes: int | None,
    expert_node_E: torch.Tensor | None,
) -> list[tuple[torch.Tensor, int, int]]:
    """`device_limited_topk`'s limits as (map_E, limit, experts per unit), in the order they narrow
    the allowed set (nodes, then devices); a `PruningError` for limits that leave fewer than top_k
    experts or a similarity variant without its table."""
    E = scores_TE.shape[1]
    limits = []
    if max_nodes is not None:
        if expert_node_E is None:
            raise PruningError("max_nodes needs expert_node_E (the node of every expert)")
        limits.append(_limit(expert_node_E, max_nodes, "max_nodes", "nodes", scores_TE.device, E, top_k))
    if max_devices is not None:
        if expert_device_E is None:
            raise PruningError("max_devices needs expert_device_E (the device of every expert)")
        limits.append(_limit(expert_device_E, max_devices, "max_devices", "devices", scores_TE.device, E, top_k))
    if len(limits) == 2:
        (node_E, n_lim, per_node), (dev_E, d_lim, per_dev) = limits
        room = min(d_lim * per_dev, n_lim * per_node)
        if room < top_k:
            raise PruningError(
                f"max_devices={d_lim} devices on max_nodes={n_lim} nodes hold only {room} experts, "
                f"fewer than top_k={top_k}"
            )
    if method == "similarity":
        if similarity_EE is None:
            raise PruningError(
                "the similarity variant needs similarity_EE: profile the model (occult profile) and "
                "load the table with occult.moe.pruning.load_similarity"
            )
        if tuple(similarity_EE.shape) != (E, E):
            raise PruningError(f"similarity_EE must have shape [{E}, {E}], got {list(similarity_EE.shape)}")
    return limits


def _limited_ids(
    sel_TE: torch.Tensor,
    plain_ids: torch.Tensor,
    top_k: int,
    limits: list[tuple[torch.Tensor, int, int]],
    method: str,
    similarity_EE: torch.Tensor | None,
) -> torch.Tensor:
    """The ids [T, K] within every limit (no gradient): plain top-k for tokens already within them."""
    allowed_TE = within_T = None
    for map_E, lim, _ in limits:
        masked = sel_TE if allowed_TE is None else sel_TE.masked_fill(~allowed_TE, float("-inf"))
        now_TE = allowed_by_mass(masked, map_E, lim, top_k) if method == "mass" else allowed_devices(masked, map_E, lim)
        allowed_TE = now_TE if allowed_TE is None else allowed_TE & now_TE
        ok_T = devices_per_token(plain_ids, map_E) <= lim
        within_T = ok_T if within_T is None else within_T & ok_T
    if method in ("score", "mass"):
        ids_TK = sel_TE.masked_fill(~allowed_TE, float("-inf")).topk(top_k, dim=-1).indices
    else:
        ids_TK = _similarity_replace(plain_ids, allowed_TE, similarity_EE.to(sel_TE.device))
        # Canonical order: descending score (kept experts outrank their replacements).
        order = sel_TE.gather(1, ids_TK).sort(dim=1, descending=True, stable=True).indices
        ids_TK = ids_TK.gather(1, order)
    return torch.where(within_T[:, None], plain_ids, ids_TK)


def _limit(
    map_E: torch.Tensor, limit: int, name: str, unit: str, device: torch.device, E: int, top_k: int
) -> tuple[torch.Tensor, int, int]:
    """(checked map, limit, fewest experts per unit) of one limit; raises when N units cannot hold k experts."""
    if int(limit) < 1:
        raise PruningError(f"{name} must be >= 1 or None, got {limit}")
    limit = int(limit)
    map_E = _check_device_map(map_E.to(device), E)
    per = _experts_per_device(map_E)
    if limit * per < top_k:
        raise PruningError(
            f"{name}={limit} {unit} hold only {limit * per} experts ({per} per {unit[:-1]}), fewer than "
            f"top_k={top_k}: raise {name} to at least {-(-top_k // per)}"
        )
    return map_E, limit, per


def _finish(weights_TK, ids_TK, norm_topk_prob):
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK, ids_TK


def _similarity_replace(plain_ids: torch.Tensor, allowed_TE: torch.Tensor, sim_EE: torch.Tensor) -> torch.Tensor:
    """Replace out-of-set experts (in score order) by their most similar free allowed expert."""
    T, K = plain_ids.shape
    E = allowed_TE.shape[1]
    keep_TK = allowed_TE.gather(1, plain_ids)
    chosen_TE = torch.zeros((T, E), dtype=torch.bool, device=plain_ids.device)
    chosen_TE.scatter_(1, plain_ids, keep_TK)  # kept experts are taken first
    sim_EE = torch.nan_to_num(sim_EE.to(torch.float32), nan=-2.0)
    rows = torch.arange(T, device=plain_ids.device)
    ids = plain_ids.clone()
    for j in range(K):
        replace_T = ~keep_TK[:, j]
        cand_TE = sim_EE[plain_ids[:, j]].masked_fill(~allowed_TE | chosen_TE, float("-inf"))
        new_T = cand_TE.argmax(dim=1)
        ids[:, j] = torch.where(replace_T, new_T, plain_ids[:, j])
        chosen_TE[rows, new_T] |= replace_T
    return ids


# ------------------------------------------------------ applying to routers
def limit_routers(
    routers: Iterable[nn.Module],
    placement: Any,
    max_devices: int | None,
    method: str = "score",
    similarity: Sequence[torch.Tensor] | None = None,
    max_nodes: int | None = None,
) -> None:
    """Turn device-limited routing on (or off with `max_devices=None`) for a list of `TopKRouter`s.
    `max_nodes` limits nodes too (nodes: `placement.num_nodes`, node-major device ids).

    Router i is limited against layer i of `placement` (an `occult.Placement` of any device
    count: it need not match the world size, so one process can simulate D devices). A one-layer
    placement is used for every router.
    """
    routers = list(routers)
    if method not in METHODS:
        raise PruningError(f"prune method must be one of {METHODS}, got {method!r}")
    if max_devices is not None and int(max_devices) < 1:
        raise PruningError(f"max_devices must be >= 1 or None, got {max_devices}")
    if (max_devices is not None or max_nodes is not None) and placement is None:
        raise PruningError("device-limited routing needs a placement (which device holds each expert)")
    if max_nodes is not None and int(max_nodes) < 1:
        raise PruningError(f"max_nodes must be >= 1 or None, got {max_nodes}")
    if max_devices is not None and method == "similarity":
        if similarity is None:
            raise PruningError("prune method 'similarity' needs similarity tables (occult profile --similarity)")
        if len(similarity) not in (1, len(routers)):
            raise PruningError(f"{len(similarity)} similarity tables for {len(routers)} MoE layers")
    if placement is not None and placement.num_layers not in (1, len(routers)):
        raise PruningError(
            f"the placement has {placement.num_layers} layers, but the model has {len(routers)} MoE layers"
        )
    for i, router in enumerate(routers):
        if not hasattr(router, "set_expert_device"):
            raise PruningError(f"router {i} ({type(router).__name__}) has no set_expert_device: cannot limit it")
        num_experts = getattr(router, "num_experts", None)
        if placement is not None:
            if num_experts is not None and placement.num_experts != num_experts:
                raise PruningError(
                    f"the placement is for {placement.num_experts} experts, but router {i} has {num_experts}"
                )
            layer = i if placement.num_layers > 1 else 0
            dev = torch.as_tensor(placement.expert_device(layer).copy(), dtype=torch.int64)
            router.set_expert_device(dev)
        if max_nodes is not None and not hasattr(router, "max_nodes"):
            raise PruningError(f"router {i} ({type(router).__name__}) has no node limit (max_nodes)")
        if hasattr(router, "max_nodes"):
            router.max_nodes = None if max_nodes is None else int(max_nodes)
            router.devices_per_node = None if placement is None else placement.devices_per_node
        router.max_devices = None if max_devices is None else int(max_devices)
        router.prune_method = method
        sim = None
        if similarity is not None:
            sim = similarity[i if len(similarity) > 1 else 0]
            if num_experts is not None and tuple(sim.shape) != (num_experts, num_experts):
                raise PruningError(
                    f"similarity table {i} has shape {list(sim.shape)}, expected [{num_experts}, {num_experts}]"
                )
            sim = sim.to(router.gate.weight.device, torch.float32) if hasattr(router, "gate") else sim
        router.similarity_EE = sim
        if max_devices is not None and num_experts is not None:
            # Fail now, not in the middle of training, when N devices cannot hold top_k experts.
            per = _experts_per_device(router.expert_device_E)
            if int(max_devices) * per < router.top_k:
                raise PruningError(
                    f"max_devices={max_devices} devices hold only {int(max_devices) * per} experts, "
                    f"fewer than top_k={router.top_k}"
                )


__all__ = [
    "PruningError",
    "METHODS",
    "device_limited_topk",
    "allowed_devices",
    "allowed_by_mass",
    "devices_per_token",
    "expert_similarity",
    "SimilarityAccumulator",
    "save_similarity",
    "load_similarity",
    "similarity_path",
    "limit_routers",
]
