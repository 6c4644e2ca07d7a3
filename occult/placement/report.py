"""Reports of a placement: every statistic of a layer or a trace, and a placement against a baseline.

`layer_stats` / `trace_stats` gather the per-layer figures of `occult.placement.stats`
(E[C_T] and its histogram, intra/inter collaboration, device loads, rows and bytes of a
dispatch+combine, standard and deduplicated) into `LayerStats` / `TraceStats`;
`compare_placements` is the JSON-ready comparison `occult place` and `occult stats` print.
Byte convention and the expected-remote assumption: see `occult.placement.stats`.

With nodes (`Placement.num_nodes` = M > 1) a layer also gets E[N_T], the mean number of
distinct nodes a token's experts sit on, and expected inter-node bytes (a token's own node
uniform and independent of its routing): `bytes_dedup_internode` = dedup rows * (M-1)/M (the
flat deduplicated dispatch sends one row per device) and `bytes_node_dedup_internode` =
sum_t N_T * (M-1)/M (the two-level dispatch, `dispatcher="dedup2"`, sending one row per node).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from occult.placement.layout import Placement, PlacementError
from occult.placement.stats import (
    TOKEN_CHUNK,
    analytic_mean_ct,
    as_topk_ids,
    coactivation,
    collaboration,
    comm_bytes,
    device_presence,
    expert_device_map,
)
from occult.placement.trace import Trace

_SUMMARY_KEYS = (
    "mean_ct",
    "intra_ratio",
    "load_imbalance",
    "busiest_device_share",
    "rows_standard",
    "rows_dedup",
    "bytes_standard",
    "bytes_dedup",
    "bytes_standard_remote",
    "bytes_dedup_remote",
)
_NODE_KEYS = ("mean_nt", "bytes_dedup_internode", "bytes_node_dedup_internode")


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
    busiest_device_share: float  # max of device_rows_D / T: the least sync_free_capacity that drops no copy
    rows_standard: int
    rows_dedup: int
    hidden: int
    dtype: str
    bytes_standard: int
    bytes_dedup: int
    bytes_standard_remote: float  # expected, see the module docstring
    bytes_dedup_remote: float
    num_nodes: int = 1
    mean_nt: float | None = None  # E[N_T]: distinct nodes per token (None without nodes)
    nt_hist: list[int] | None = None  # nt_hist[n - 1] = tokens on exactly n nodes
    bytes_dedup_internode: float | None = None  # expected, module docstring
    bytes_node_dedup_internode: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> dict[str, Any]:
        """The headline figures (no per-expert / per-device lists)."""
        keys = _SUMMARY_KEYS + (_NODE_KEYS if self.num_nodes > 1 else ())
        return {k: getattr(self, k) for k in keys}


def layer_stats(
    topk_ids_TK: Any,
    num_experts: int,
    expert_device_E: Placement | np.ndarray | Sequence[int],
    num_devices: int | None = None,
    hidden: int = 2048,
    dtype: str | torch.dtype = "bf16",
    coact_EE: np.ndarray | None = None,
    num_nodes: int = 1,
) -> LayerStats:
    """All statistics of one layer; pass `coact_EE` to reuse a co-activation matrix already computed.
    `num_nodes` (taken from a `Placement`) groups devices node-major for E[N_T]."""
    ids = as_topk_ids(topk_ids_TK)
    if isinstance(expert_device_E, Placement):
        num_devices = expert_device_E.num_devices
        num_nodes = expert_device_E.num_nodes
    dev = expert_device_map(expert_device_E)
    if num_devices is None:
        raise ValueError("num_devices is needed when the placement is given as an array")
    if dev.shape != (num_experts,):
        raise PlacementError(f"the placement maps {dev.shape[0]} experts, but the layer has {num_experts}")
    T, K = ids.shape
    if coact_EE is None:
        coact_EE = coactivation(ids, num_experts)
    load_E = np.rint(np.diag(coact_EE)).astype(np.int64)
    if num_nodes < 1 or num_devices % num_nodes:
        raise PlacementError(f"num_nodes={num_nodes} must divide num_devices={num_devices}")
    rows_D = np.zeros(num_devices, dtype=np.int64)
    hist = np.zeros(min(K, num_devices) + 1, dtype=np.int64)
    nhist = np.zeros(min(K, num_nodes) + 1, dtype=np.int64)
    for s in range(0, T, TOKEN_CHUNK):
        pres = device_presence(ids[s : s + TOKEN_CHUNK], dev, num_devices)
        rows_D += pres.sum(0)
        hist += np.bincount(pres.sum(1), minlength=hist.shape[0])[: hist.shape[0]]
        n_T = pres.reshape(pres.shape[0], num_nodes, -1).any(2).sum(1)
        nhist += np.bincount(n_T, minlength=nhist.shape[0])[: nhist.shape[0]]
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
        busiest_device_share=float(rows_D.max() / T) if T else 0.0,
        rows_standard=int(T * K),
        rows_dedup=rows_dedup,
        hidden=int(hidden),
        dtype=dname,
        bytes_standard=int(comm_bytes(T * K, hidden, dtype)),
        bytes_dedup=int(comm_bytes(rows_dedup, hidden, dtype)),
        bytes_standard_remote=comm_bytes(T * K * remote, hidden, dtype),
        bytes_dedup_remote=comm_bytes(rows_dedup * remote, hidden, dtype),
        **_node_fields(num_nodes, nhist, rows_dedup, T, hidden, dtype),
    )


def _node_fields(num_nodes: int, nhist: np.ndarray, rows_dedup: int, T: int, hidden: int, dtype: Any) -> dict[str, Any]:
    if num_nodes == 1:
        return {}
    rows_nodes = int((np.arange(len(nhist)) * nhist).sum())
    off = (num_nodes - 1) / num_nodes
    return {
        "num_nodes": int(num_nodes),
        "mean_nt": rows_nodes / T,
        "nt_hist": nhist[1:].tolist(),
        "bytes_dedup_internode": comm_bytes(rows_dedup * off, hidden, dtype),
        "bytes_node_dedup_internode": comm_bytes(rows_nodes * off, hidden, dtype),
    }


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
        """Totals over layers: E[C_T] over all tokens, summed rows and bytes, worst imbalance and busiest share."""
        pairs = self.total("intra") + self.total("inter")
        nodes = {}
        if self.layers[0].num_nodes > 1:
            tokens = sum(s.num_tokens for s in self.layers)
            nodes = {
                "mean_nt": sum(s.mean_nt * s.num_tokens for s in self.layers) / tokens,
                "bytes_dedup_internode": self.total("bytes_dedup_internode"),
                "bytes_node_dedup_internode": self.total("bytes_node_dedup_internode"),
            }
        return {
            **nodes,
            "mean_ct": self.mean_ct,
            "intra_ratio": self.total("intra") / pairs if pairs > 0 else 1.0,
            "load_imbalance": max(s.load_imbalance for s in self.layers),
            # one ExecConfig serves every layer: the capacity that holds for all of them
            "busiest_device_share": max(s.busiest_device_share for s in self.layers),
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
                num_nodes=placement.num_nodes,
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
        baseline = Placement.contiguous(trace.num_experts, placement.num_devices, trace.num_layers, placement.num_nodes)
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
        "num_nodes": placement.num_nodes,
        "analytic_uniform_mean_nt": analytic_mean_ct(trace.num_experts, trace.top_k, placement.num_nodes),
        "layers": layers,
        "overall": {
            "baseline": bs,
            "placement": ns,
            "reduction": rel(bs["mean_ct"], ns["mean_ct"]),
            "vs_standard": rel(ns["bytes_standard"], ns["bytes_dedup"]),
        },
    }
