"""Collaboration statistics of a routing trace under an expert placement.

Per layer (`topk_ids_TK`, E experts, an expert -> device map over D devices):

- co-activation `coact_EE[a, b]`: tokens that picked both a and b (diagonal: expert load);
- `C_T`: distinct devices among a token's k experts, its mean E[C_T], and its histogram;
- intra- vs inter-collaboration: expert pairs picked by one token that sit on the same device
  (intra) or on different devices (inter);
- per-device load: token-expert assignments each device computes, and the deduplicated rows
  it receives (tokens with at least one expert there);
- bytes moved by a dispatch+combine, standard (k copies per token) and deduplicated (C_T).

Byte convention (docs/design.md): a dispatch+combine moves `2 * rows * H * element_size`
bytes, `rows` counting every row a rank sends, including rows to itself (standard: T*k,
deduplicated: sum_t C_T). A trace does not say where each token lived, so the `remote`
figures assume tokens are spread evenly over devices with a token's own device independent
of its routing: each row then stays local with probability 1/D and the expected remote rows
are `rows * (D - 1) / D`.

Whole-layer and whole-trace reports (`LayerStats`, `trace_stats`, `compare_placements`) are in
`occult.placement.report`. All functions are vectorised (no Python loops over tokens); large inputs are processed in
chunks of tokens to bound memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from occult.placement.layout import Placement, check_divisible

TOKEN_CHUNK = 1 << 17  # tokens per chunk for the dense [chunk, E] / [chunk, D] work arrays

_DTYPE_ALIASES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "fp8": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def element_size(dtype: str | torch.dtype | np.dtype) -> int:
    """Bytes per element of an activation dtype ('bf16', 'fp32', torch.float16, ...)."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if isinstance(dtype, str):
        key = dtype.lower().replace("torch.", "")
        if key not in _DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPE_ALIASES))}")
        return torch.empty((), dtype=_DTYPE_ALIASES[key]).element_size()
    return int(np.dtype(dtype).itemsize)


def as_topk_ids(topk_ids_TK: Any) -> np.ndarray:
    """[T, K] routing ids (a tensor or array-like) as a numpy array; a clear error unless it is 2-D."""
    if isinstance(topk_ids_TK, torch.Tensor):
        topk_ids_TK = topk_ids_TK.detach().cpu().numpy()
    a = np.asarray(topk_ids_TK)
    if a.ndim != 2:
        raise ValueError(f"topk_ids must have shape [tokens, top_k], got {list(a.shape)}")
    return a


def expert_device_map(expert_device: Placement | np.ndarray | Sequence[int], layer: int = 0) -> np.ndarray:
    """[E] expert -> device of one layer, from a `Placement` or an expert -> device sequence."""
    if isinstance(expert_device, Placement):
        return expert_device.expert_device(layer)
    return np.asarray(expert_device, dtype=np.int64)


# ------------------------------------------------------------------ per expert
def expert_load(topk_ids_TK: Any, num_experts: int, weights_T: np.ndarray | None = None) -> np.ndarray:
    """[E] tokens routed to each expert (weighted by `weights_T` when given)."""
    ids = as_topk_ids(topk_ids_TK)
    w = None if weights_T is None else np.repeat(np.asarray(weights_T, np.float64), ids.shape[1])
    out = np.bincount(ids.reshape(-1).astype(np.intp), weights=w, minlength=num_experts)
    return out if w is not None else out.astype(np.int64)


def coactivation(topk_ids_TK: Any, num_experts: int, weights_T: np.ndarray | None = None) -> np.ndarray:
    """[E, E] co-activation counts: tokens that picked both a and b; the diagonal is the load.

    A bincount over every token's k(k-1)/2 expert pairs, in chunks of tokens: exact integer
    counts (float64 when weighted), and no BLAS, whose threads stall on shared cores.
    """
    ids = as_topk_ids(topk_ids_TK).astype(np.intp)
    T, K = ids.shape
    E = int(num_experts)
    w = None if weights_T is None else np.asarray(weights_T, np.float64)
    iu, ju = np.triu_indices(K, 1)
    pairs = np.zeros(E * E, dtype=np.float64 if w is not None else np.int64)
    chunk = max(1, (1 << 21) // max(len(iu), 1))
    for s in range(0, T, chunk):
        blk = ids[s : s + chunk]
        flat = (blk[:, iu] * E + blk[:, ju]).reshape(-1)
        wt = None if w is None else np.repeat(w[s : s + chunk], len(iu))
        pairs += np.bincount(flat, weights=wt, minlength=E * E).astype(pairs.dtype, copy=False)
    C = pairs.reshape(E, E)
    C = C + C.T  # ids in a row are distinct, so every pair landed off the diagonal once
    C[np.arange(E), np.arange(E)] = expert_load(ids, E, w)
    return C


# ------------------------------------------------------------------ per token
def device_presence(topk_ids_TK: Any, expert_device_E: Any, num_devices: int) -> np.ndarray:
    """[T, D] bool: does token t have at least one of its experts on device d."""
    ids = as_topk_ids(topk_ids_TK)
    dev = expert_device_map(expert_device_E)
    dev_TK = dev[ids.astype(np.intp)]
    T = ids.shape[0]
    out = np.zeros((T, num_devices), dtype=bool)
    out[np.arange(T)[:, None], dev_TK] = True
    return out


def busiest_device_share(topk_ids_TK: Any, expert_device_E: Any, num_devices: int) -> float:
    """The share of the tokens that use the device most of them use (0.0 without tokens): the rows a sync-free
    exchange's fixed block for that device must hold, as a fraction of T, so the least
    `ExecConfig.sync_free_capacity` that drops none of these tokens' copies."""
    ids = as_topk_ids(topk_ids_TK)
    dev = expert_device_map(expert_device_E)
    rows_D = np.zeros(num_devices, dtype=np.int64)
    for s in range(0, ids.shape[0], TOKEN_CHUNK):
        rows_D += device_presence(ids[s : s + TOKEN_CHUNK], dev, num_devices).sum(0)
    return float(rows_D.max() / ids.shape[0]) if ids.shape[0] else 0.0


def devices_per_token(topk_ids_TK: Any, expert_device_E: Any, num_devices: int) -> np.ndarray:
    """[T] C_T: number of distinct devices among each token's experts (1 <= C_T <= min(k, D))."""
    ids = as_topk_ids(topk_ids_TK)
    dev = expert_device_map(expert_device_E)
    T = ids.shape[0]
    out = np.empty(T, dtype=np.int64)
    for s in range(0, T, TOKEN_CHUNK):
        out[s : s + TOKEN_CHUNK] = device_presence(ids[s : s + TOKEN_CHUNK], dev, num_devices).sum(1)
    return out


def mean_ct(topk_ids_TK: Any, expert_device_E: Any, num_devices: int, weights_T: np.ndarray | None = None) -> float:
    """E[C_T]: mean number of devices a token is sent to under deduplicated dispatch."""
    ct = devices_per_token(topk_ids_TK, expert_device_E, num_devices)
    if weights_T is None:
        return float(ct.mean())
    w = np.asarray(weights_T, np.float64)
    return float((ct * w).sum() / w.sum())


def analytic_mean_ct(num_experts: int, top_k: int, num_devices: int) -> float:
    """E[C_T] of uniform routing over any balanced placement: D * (1 - C(E - E/D, k) / C(E, k)).

    A device is missed by a token when all k distinct picks fall among the E - E/D experts
    held elsewhere; linearity of expectation over the D devices gives the formula.
    """
    per = check_divisible(num_experts, num_devices)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    miss = math.comb(num_experts - per, top_k) / math.comb(num_experts, top_k)
    return num_devices * (1.0 - miss)


def collaboration(coact_EE: np.ndarray, expert_device_E: Any) -> tuple[float, float]:
    """(intra, inter): co-activated expert pairs (a < b, counted per token) on the same / different devices."""
    dev = expert_device_map(expert_device_E)
    upper = np.triu(np.asarray(coact_EE, dtype=np.float64), k=1)
    same = dev[:, None] == dev[None, :]
    intra = float(upper[same].sum())
    return intra, float(upper.sum() - intra)


def comm_bytes(rows: float, hidden: int, dtype: str | torch.dtype = "bf16") -> float:
    """Activation bytes of a dispatch+combine moving `rows` rows of `hidden` elements: 2*rows*H*size."""
    return 2.0 * float(rows) * int(hidden) * element_size(dtype)
