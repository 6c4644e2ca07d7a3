"""Synthetic routing traces with known structure, to test placement solvers against an optimum.

- `uniform_trace`: every token picks k distinct experts uniformly at random (or, with `skew`,
  in proportion to a Zipf-like expert popularity). Placement cannot help much here; the
  analytic E[C_T] (`occult.placement.stats.analytic_mean_ct`) is the reference.
- `planted_trace`: experts fall into hidden equal-size groups (randomly scattered over expert
  ids); a token picks one group and takes each of its k experts from inside it, except that
  each pick independently, with probability `noise`, comes from outside the group. Placing
  each group on one device is (near) optimal; `PlantedTrace.placement(D)` returns it.
- `planted_nodes_trace`: two levels, for hierarchical placement: G groups per node; a pick
  leaves the token's group with probability `noise_group` (staying in its node) and its node
  with probability `noise_node`. `placement(D, num_nodes=M)` puts each node's groups on a node.

Sampling k distinct experts with probabilities p is done for all tokens at once with the
Gumbel-top-k trick (keys log p + Gumbel noise; the k largest keys), chunked over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from occult.placement.layout import Placement, PlacementError, check_divisible
from occult.placement.trace import Trace, ids_dtype

_CHUNK = 1 << 16  # tokens per sampling chunk: bounds memory at CHUNK * E floats


def _rng(seed: int | np.random.Generator | None) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def expert_popularity(num_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """[E] probabilities ~ 1 / rank^skew over a random ranking of experts (skew 0 = uniform)."""
    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    ranks = rng.permutation(num_experts) + 1.0
    p = ranks ** (-float(skew))
    return p / p.sum()


def _check_shape(num_tokens: int, num_experts: int, top_k: int, num_layers: int) -> None:
    if num_tokens < 1 or num_layers < 1:
        raise ValueError(f"need num_tokens >= 1 and num_layers >= 1, got {num_tokens} and {num_layers}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def _gumbel_keys(rng: np.random.Generator, n: int, logp_E: np.ndarray) -> np.ndarray:
    # float32 keys: ties have probability ~0 and halve the memory traffic.
    u = rng.random((n, logp_E.shape[0]), dtype=np.float32)
    return logp_E.astype(np.float32)[None, :] - np.log(-np.log(np.maximum(u, np.float32(1e-30))))


def _topk_desc(keys_TE: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest keys per row, in descending key order."""
    part = np.argpartition(-keys_TE, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(keys_TE, part, axis=1)
    return np.take_along_axis(part, np.argsort(-vals, axis=1), axis=1)


def uniform_trace(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    num_layers: int = 1,
    skew: float = 0.0,
    seed: int | np.random.Generator | None = None,
) -> Trace:
    """Tokens pick k distinct experts at random: uniformly, or by Zipf popularity when `skew` > 0."""
    _check_shape(num_tokens, num_experts, top_k, num_layers)
    rng = _rng(seed)
    dt = ids_dtype(num_experts)
    layers = []
    for _ in range(num_layers):
        logp = np.log(expert_popularity(num_experts, skew, rng))
        out = np.empty((num_tokens, top_k), dtype=dt)
        for s in range(0, num_tokens, _CHUNK):
            n = min(_CHUNK, num_tokens - s)
            out[s : s + n] = _topk_desc(_gumbel_keys(rng, n, logp), top_k)
        layers.append(out)
    meta = {"generator": "uniform", "skew": repr(float(skew))}
    return Trace(layers, num_experts, top_k, metadata=meta)


@dataclass(frozen=True)
class PlantedTrace:
    """A planted trace and its ground truth: `groups_LE[l, e]` is expert e's hidden group."""

    trace: Trace
    groups_LE: np.ndarray
    num_groups: int
    noise: float
    skew: float

    def placement(self, num_devices: int, num_nodes: int = 1) -> Placement:
        """The planted placement: whole groups on devices (group g on device g // (G / D)).

        Groups are numbered node-major in `planted_nodes_trace`, so with `num_nodes` = its node
        count the devices of node n hold exactly the planted node's experts."""
        check_divisible(self.trace.num_experts, num_devices)
        if self.num_groups % num_devices:
            raise PlacementError(
                f"{self.num_groups} planted groups cannot be spread evenly over {num_devices} devices; "
                f"generate the trace with num_groups a multiple of {num_devices}"
            )
        return Placement(self.groups_LE // (self.num_groups // num_devices), num_devices, num_nodes)


def planted_trace(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    num_groups: int,
    num_layers: int = 1,
    noise: float = 0.1,
    skew: float = 0.0,
    seed: int | np.random.Generator | None = None,
) -> PlantedTrace:
    """Tokens pick within hidden expert groups; each pick leaves the group with probability `noise`.

    Per layer: experts are shuffled into `num_groups` groups of E/G experts. A token chooses a
    group (with probability proportional to the group's total popularity), draws
    m ~ k - Binomial(k, noise) experts from it and k - m from the other experts, each draw
    without replacement and proportional to popularity (`skew` > 0 makes it Zipf-skewed).
    """
    _check_shape(num_tokens, num_experts, top_k, num_layers)
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups must divide num_experts={num_experts}, got {num_groups}")
    group_size = num_experts // num_groups
    if group_size < top_k:
        raise ValueError(
            f"groups of {group_size} experts cannot hold a token's {top_k} picks: "
            f"use num_groups <= {num_experts // top_k}"
        )
    rng = _rng(seed)
    dt = ids_dtype(num_experts)
    outside = num_experts - group_size
    layers, groups = [], []
    for _ in range(num_layers):
        pop_E = expert_popularity(num_experts, skew, rng)
        group_E = rng.permutation(np.arange(num_experts) // group_size)
        group_pop_G = np.bincount(group_E, weights=pop_E, minlength=num_groups)
        logp = np.log(pop_E)
        out = np.empty((num_tokens, top_k), dtype=dt)
        for s in range(0, num_tokens, _CHUNK):
            n = min(_CHUNK, num_tokens - s)
            g_T = rng.choice(num_groups, size=n, p=group_pop_G / group_pop_G.sum())
            n_out_T = np.minimum(rng.binomial(top_k, noise, size=n), outside)
            keys = _gumbel_keys(rng, n, logp)
            inside_TE = group_E[None, :] == g_T[:, None]
            neg = np.float32(-np.inf)
            # The k best experts inside the token's group and the k best outside it (key order);
            # the token takes the first m of the former and the first k - m of the latter.
            in_TK = _topk_desc(np.where(inside_TE, keys, neg), top_k)
            out_TK = _topk_desc(np.where(inside_TE, neg, keys), min(top_k, outside)) if outside else in_TK
            j = np.arange(top_k)[None, :]
            m_T = (top_k - n_out_T)[:, None]
            from_out = np.take_along_axis(out_TK, np.clip(j - m_T, 0, out_TK.shape[1] - 1), axis=1)
            out[s : s + n] = np.where(j < m_T, in_TK, from_out)
        layers.append(out)
        groups.append(group_E)
    meta = {
        "generator": "planted",
        "num_groups": str(num_groups),
        "noise": repr(float(noise)),
        "skew": repr(float(skew)),
    }
    trace = Trace(layers, num_experts, top_k, metadata=meta)
    return PlantedTrace(trace, np.stack(groups).astype(np.int64), num_groups, float(noise), float(skew))


def _take(keys_TE: np.ndarray, mask_TE: np.ndarray, k: int) -> np.ndarray:
    width = max(1, min(k, int(mask_TE[0].sum())))
    return _topk_desc(np.where(mask_TE, keys_TE, np.float32(-np.inf)), width)


def planted_nodes_trace(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    num_nodes: int,
    groups_per_node: int,
    num_layers: int = 1,
    noise_group: float = 0.3,
    noise_node: float = 0.05,
    seed: int | np.random.Generator | None = None,
) -> PlantedTrace:
    """A two-level planted trace: nodes of `groups_per_node` groups (module docstring).

    Group ids are node-major (group g lies in node g // groups_per_node). A token picks a group
    uniformly, then splits its k picks by a multinomial over (own group, rest of its node, other
    nodes) with probabilities (1 - noise_group - noise_node, noise_group, noise_node), each part
    drawn uniformly without replacement (clipped to the experts there).
    """
    _check_shape(num_tokens, num_experts, top_k, num_layers)
    G = num_nodes * groups_per_node
    if num_nodes < 1 or groups_per_node < 1 or num_experts % G:
        raise ValueError(f"num_nodes * groups_per_node = {G} must divide num_experts={num_experts}")
    if min(noise_group, noise_node) < 0 or noise_group + noise_node > 1:
        raise ValueError(f"need noise_group, noise_node >= 0 with sum <= 1, got {noise_group}, {noise_node}")
    gs, ns = num_experts // G, num_experts // num_nodes
    if gs < top_k:
        raise ValueError(f"groups of {gs} experts cannot hold a token's {top_k} picks")
    rng = _rng(seed)
    dt = ids_dtype(num_experts)
    probs = np.array([1.0 - noise_group - noise_node, noise_group, noise_node])
    sizes = np.array([gs, ns - gs, num_experts - ns])
    layers, groups = [], []
    for _ in range(num_layers):
        group_E = rng.permutation(np.arange(num_experts) // gs)
        node_E = group_E // groups_per_node
        out = np.empty((num_tokens, top_k), dtype=dt)
        for s in range(0, num_tokens, _CHUNK):
            n = min(_CHUNK, num_tokens - s)
            g_T = rng.integers(0, G, size=n)
            cnt = rng.multinomial(top_k, probs, size=n)
            cnt[:, 1] = np.minimum(cnt[:, 1], sizes[1])
            cnt[:, 2] = np.minimum(cnt[:, 2], sizes[2])
            cnt[:, 0] = top_k - cnt[:, 1] - cnt[:, 2]
            keys = _gumbel_keys(rng, n, np.zeros(num_experts))
            in_g = group_E[None, :] == g_T[:, None]
            in_n = node_E[None, :] == (g_T // groups_per_node)[:, None]
            parts = [_take(keys, in_g, top_k), _take(keys, in_n & ~in_g, top_k), _take(keys, ~in_n, top_k)]
            j = np.arange(top_k)[None, :]
            c0, c1 = cnt[:, :1], cnt[:, :1] + cnt[:, 1:2]
            pick = lambda p, off: np.take_along_axis(p, np.clip(j - off, 0, p.shape[1] - 1), axis=1)  # noqa: E731
            out[s : s + n] = np.where(j < c0, parts[0], np.where(j < c1, pick(parts[1], c0), pick(parts[2], c1)))
        layers.append(out)
        groups.append(group_E)
    meta = {
        "generator": "planted_nodes",
        "num_nodes": str(num_nodes),
        "groups_per_node": str(groups_per_node),
        "noise_group": repr(float(noise_group)),
        "noise_node": repr(float(noise_node)),
    }
    trace = Trace(layers, num_experts, top_k, metadata=meta)
    return PlantedTrace(trace, np.stack(groups).astype(np.int64), G, float(noise_group + noise_node), 0.0)
