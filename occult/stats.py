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

All functions are vectorised (no Python loops over tokens); large inputs are processed in
chunks of tokens to bound memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch

from occult.placement import Placement, PlacementError, check_divisible
from occult.trace import Trace

_CHUNK = 1 << 17  # tokens per chunk for the dense [chunk, E] / [chunk, D] work arrays

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


def _ids(topk_ids_TK: Any) -> np.ndarray:
    if isinstance(topk_ids_TK, torch.Tensor):
        topk_ids_TK = topk_ids_TK.detach().cpu().numpy()
    a = np.asarray(topk_ids_TK)
    if a.ndim != 2:
        raise ValueError(f"topk_ids must have shape [tokens, top_k], got {list(a.shape)}")
    return a


def _device_map(expert_device: Placement | np.ndarray | Sequence[int], layer: int = 0) -> np.ndarray:
    if isinstance(expert_device, Placement):
        return expert_device.expert_device(layer)
    return np.asarray(expert_device, dtype=np.int64)


# ------------------------------------------------------------------ per expert
def expert_load(topk_ids_TK: Any, num_experts: int, weights_T: np.ndarray | None = None) -> np.ndarray:
    """[E] tokens routed to each expert (weighted by `weights_T` when given)."""
    ids = _ids(topk_ids_TK)
    w = None if weights_T is None else np.repeat(np.asarray(weights_T, np.float64), ids.shape[1])
    out = np.bincount(ids.reshape(-1).astype(np.intp), weights=w, minlength=num_experts)
    return out if w is not None else out.astype(np.int64)


def coactivation(topk_ids_TK: Any, num_experts: int, weights_T: np.ndarray | None = None) -> np.ndarray:
    """[E, E] co-activation counts: tokens that picked both a and b; the diagonal is the load.

    A bincount over every token's k(k-1)/2 expert pairs, in chunks of tokens: exact integer
    counts (float64 when weighted), and no BLAS, whose threads stall on shared cores.
    """
    ids = _ids(topk_ids_TK).astype(np.intp)
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
    ids = _ids(topk_ids_TK)
    dev = _device_map(expert_device_E)
    dev_TK = dev[ids.astype(np.intp)]
    T = ids.shape[0]
    out = np.zeros((T, num_devices), dtype=bool)
    out[np.arange(T)[:, None], dev_TK] = True
    return out


def devices_per_token(topk_ids_TK: Any, expert_device_E: Any, num_devices: int) -> np.ndarray:
    """[T] C_T: number of distinct devices among each token's experts (1 <= C_T <= min(k, D))."""
    ids = _ids(topk_ids_TK)
    dev = _device_map(expert_device_E)
    T = ids.shape[0]
    out = np.empty(T, dtype=np.int64)
    for s in range(0, T, _CHUNK):
        out[s : s + _CHUNK] = device_presence(ids[s : s + _CHUNK], dev, num_devices).sum(1)
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
    dev = _device_map(expert_device_E)
    upper = np.triu(np.asarray(coact_EE, dtype=np.float64), k=1)
    same = dev[:, None] == dev[None, :]
    intra = float(upper[same].sum())
    return intra, float(upper.sum() - intra)


def comm_bytes(rows: float, hidden: int, dtype: str | torch.dtype = "bf16") -> float:
    """Activation bytes of a dispatch+combine moving `rows` rows of `hidden` elements: 2*rows*H*size."""
    return 2.0 * float(rows) * int(hidden) * element_size(dtype)


# ------------------------------------------------------------------ summaries
_SUMMARY_KEYS = (
    "mean_ct",
    "intra_ratio",
    "load_imbalance",
    "rows_standard",
    "rows_dedup",
    "bytes_standard",
    "bytes_dedup",
    "bytes_standard_remote",
    "bytes_dedup_remote",
)


@dataclass
class LayerStats:
    """Collaboration statistics of one layer under one placement (see the module docstring)."""

    num_tokens: int
    top_k: int
    num_experts: int
    num_devices: int
    mean_ct: float
    ct_hist: list[int]  # ct_hist[c - 1] = tokens sent to exactly c devices
    intra: float
    inter: float
    intra_ratio: float  # intra / (intra + inter): share of collaborations kept on one device
    expert_load_E: list[int]
    device_load_D: list[int]  # token-expert assignments computed on each device
    device_rows_D: list[int]  # deduplicated rows each device receives (tokens with >=1 expert there)
    load_imbalance: float  # max / mean of device_load_D
    rows_standard: int
    rows_dedup: int
    hidden: int
    dtype: str
    bytes_standard: int
    bytes_dedup: int
    bytes_standard_remote: float  # expected, see the module docstring
    bytes_dedup_remote: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> dict[str, Any]:
        """The headline figures (no per-expert / per-device lists)."""
        return {k: getattr(self, k) for k in _SUMMARY_KEYS}


def layer_stats(
    topk_ids_TK: Any,
    num_experts: int,
    expert_device_E: Placement | np.ndarray | Sequence[int],
    num_devices: int | None = None,
    hidden: int = 2048,
    dtype: str | torch.dtype = "bf16",
    coact_EE: np.ndarray | None = None,
) -> LayerStats:
    """All statistics of one layer; pass `coact_EE` to reuse a co-activation matrix already computed."""
    ids = _ids(topk_ids_TK)
    if isinstance(expert_device_E, Placement):
        num_devices = expert_device_E.num_devices
    dev = _device_map(expert_device_E)
    if num_devices is None:
        raise ValueError("num_devices is needed when the placement is given as an array")
    if dev.shape != (num_experts,):
        raise PlacementError(f"the placement maps {dev.shape[0]} experts, but the layer has {num_experts}")
    T, K = ids.shape
    if coact_EE is None:
        coact_EE = coactivation(ids, num_experts)
    load_E = np.rint(np.diag(coact_EE)).astype(np.int64)
    rows_D = np.zeros(num_devices, dtype=np.int64)
    hist = np.zeros(min(K, num_devices) + 1, dtype=np.int64)
    for s in range(0, T, _CHUNK):
        pres = device_presence(ids[s : s + _CHUNK], dev, num_devices)
        rows_D += pres.sum(0)
        hist += np.bincount(pres.sum(1), minlength=hist.shape[0])[: hist.shape[0]]
    rows_dedup = int(rows_D.sum())
    intra, inter = collaboration(coact_EE, dev)
    device_load = np.bincount(dev, weights=load_E, minlength=num_devices).astype(np.int64)
    mean_load = device_load.mean()
    remote = (num_devices - 1) / num_devices
    dname = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    return LayerStats(
        num_tokens=int(T),
        top_k=int(K),
        num_experts=int(num_experts),
        num_devices=int(num_devices),
        mean_ct=rows_dedup / T,
        ct_hist=hist[1:].tolist(),
        intra=intra,
        inter=inter,
        intra_ratio=intra / (intra + inter) if intra + inter > 0 else 1.0,
        expert_load_E=load_E.tolist(),
        device_load_D=device_load.tolist(),
        device_rows_D=rows_D.tolist(),
        load_imbalance=float(device_load.max() / mean_load) if mean_load > 0 else 1.0,
        rows_standard=int(T * K),
        rows_dedup=rows_dedup,
        hidden=int(hidden),
        dtype=dname,
        bytes_standard=int(comm_bytes(T * K, hidden, dtype)),
        bytes_dedup=int(comm_bytes(rows_dedup, hidden, dtype)),
        bytes_standard_remote=comm_bytes(T * K * remote, hidden, dtype),
        bytes_dedup_remote=comm_bytes(rows_dedup * remote, hidden, dtype),
    )


@dataclass
class TraceStats:
    """Per-layer `LayerStats` of a trace under a placement, with token-weighted totals."""

    layers: list[LayerStats]

    @property
    def mean_ct(self) -> float:
        """E[C_T] over all layers' tokens (= total dedup rows / total tokens)."""
        return sum(s.rows_dedup for s in self.layers) / sum(s.num_tokens for s in self.layers)

    def total(self, key: str) -> float:
        return float(sum(getattr(s, key) for s in self.layers))

    def summary(self) -> dict[str, Any]:
        """Totals over layers: E[C_T] over all tokens, summed rows and bytes, worst imbalance."""
        pairs = self.total("intra") + self.total("inter")
        return {
            "mean_ct": self.mean_ct,
            "intra_ratio": self.total("intra") / pairs if pairs > 0 else 1.0,
            "load_imbalance": max(s.load_imbalance for s in self.layers),
            "rows_standard": int(self.total("rows_standard")),
            "rows_dedup": int(self.total("rows_dedup")),
            "bytes_standard": int(self.total("bytes_standard")),
            "bytes_dedup": int(self.total("bytes_dedup")),
            "bytes_standard_remote": self.total("bytes_standard_remote"),
            "bytes_dedup_remote": self.total("bytes_dedup_remote"),
        }


def trace_stats(
    trace: Trace,
    placement: Placement,
    hidden: int = 2048,
    dtype: str | torch.dtype = "bf16",
    coacts_LEE: Sequence[np.ndarray] | None = None,
) -> TraceStats:
    """`layer_stats` for every layer of `trace` under `placement` (checked to fit the trace)."""
    check_placement_fits_trace(placement, trace)
    out = []
    for i in range(trace.num_layers):
        out.append(
            layer_stats(
                trace.layer(i),
                trace.num_experts,
                placement.expert_device(i),
                placement.num_devices,
                hidden,
                dtype,
                coact_EE=None if coacts_LEE is None else coacts_LEE[i],
            )
        )
    return TraceStats(out)


def check_placement_fits_trace(placement: Placement, trace: Trace) -> None:
    """Raise a clear `PlacementError` when a placement was made for another trace's model."""
    if placement.num_experts != trace.num_experts:
        raise PlacementError(
            f"the placement is for {placement.num_experts} experts, but the trace has {trace.num_experts}: "
            "make a placement from this trace (occult place --trace ...)"
        )
    if placement.num_layers != trace.num_layers:
        raise PlacementError(
            f"the placement has {placement.num_layers} layer(s), but the trace has {trace.num_layers}: "
            "use the trace the placement was made from, or make a new one with occult place"
        )


def compare_placements(
    trace: Trace,
    placement: Placement,
    baseline: Placement | None = None,
    hidden: int = 2048,
    dtype: str | torch.dtype = "bf16",
    coacts_LEE: Sequence[np.ndarray] | None = None,
) -> dict[str, Any]:
    """JSON-ready comparison of `placement` against `baseline` (default: contiguous), per layer and overall.

    `reduction` is the relative drop of E[C_T] (and so of deduplicated bytes) from the
    baseline; `vs_standard` the relative drop of bytes from standard k-copy dispatch.
    """
    if baseline is None:
        baseline = Placement.contiguous(trace.num_experts, placement.num_devices, trace.num_layers)
    if coacts_LEE is None:
        coacts_LEE = [coactivation(trace.layer(i), trace.num_experts) for i in range(trace.num_layers)]
    base = trace_stats(trace, baseline, hidden, dtype, coacts_LEE)
    new = trace_stats(trace, placement, hidden, dtype, coacts_LEE)

    def rel(a: float, b: float) -> float:
        return 1.0 - b / a if a else 0.0

    layers = []
    for i, (b, n) in enumerate(zip(base.layers, new.layers)):
        layers.append(
            {
                "layer": i,
                "num_tokens": n.num_tokens,
                "baseline": b.summary(),
                "placement": {**n.summary(), "ct_hist": n.ct_hist, "device_load_D": n.device_load_D},
                "reduction": rel(b.mean_ct, n.mean_ct),
                "vs_standard": rel(n.bytes_standard, n.bytes_dedup),
            }
        )
    bs, ns = base.summary(), new.summary()
    return {
        "num_layers": trace.num_layers,
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "num_devices": placement.num_devices,
        "num_tokens": sum(trace.num_tokens),
        "hidden": int(hidden),
        "dtype": dtype if isinstance(dtype, str) else str(dtype).replace("torch.", ""),
        "analytic_uniform_mean_ct": analytic_mean_ct(trace.num_experts, trace.top_k, placement.num_devices),
        "layers": layers,
        "overall": {
            "baseline": bs,
            "placement": ns,
            "reduction": rel(bs["mean_ct"], ns["mean_ct"]),
            "vs_standard": rel(ns["bytes_standard"], ns["bytes_dedup"]),
        },
    }
