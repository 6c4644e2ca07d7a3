"""Benchmark of the Triton expert-MLP kernels (`occult.kernels.expert_mlp`).

For each MoE shape (rank 0 of 4 expert-parallel ranks, 8192 tokens per rank, uniform random
routing, dedup layout: one received row per (token, rank) with its local slots, K = top_k):

1. checks the kernels against a float32 reference (`expert_mlp_reference` on upcast inputs,
   TF32 off): output and the four gradients, relative Frobenius error; and that a forward +
   backward makes no host synchronisation (`torch.cuda.set_sync_debug_mode("error")`);
2. times (CUDA events, warm-up, median) in bf16: the kernels' forward (inference, full op),
   GEMM 1 and GEMM 2 alone, forward+backward (all four gradients), the atomic-scatter variant;
   the torch reference; `torch._grouped_mm` (the two GEMMs alone, and a straightforward
   pipeline around it, forward and forward+backward); dense cuBLAS matmuls of the same shapes
   and FLOPs (forward: [P,H]x[H,2F] and [P,F]x[F,H]; backward: the four matching products);
   the training forward and forward+backward with GEMM 1 fused and through `_grouped_mm`
   (setting gemm1, forced both ways on this padded layout), in alternating rounds.

FLOPs: forward 6*P*H*F, backward 12*P*H*F (P = valid (row, expert) pairs). Prints a short
table last; `--out` writes all numbers as JSON. `--sweep` first times a few tile configs of
each kernel on the OLMoE shape and keeps the fastest for the rest of the run. `--energy` also reads
each path's energy per call from NVML (the card at its power cap pays energy, not time: a table of
the expert products' pJ per FLOP beside their dense twins'; `--devices 1` for a one-GPU layer).

    PYTHONPATH=. python3 benchmarks/bench_kernels.py --out /tmp/kernels.json [--sweep]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_kernels.py --tiny   # CPU dry run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

from occult import kernels
from occult.kernels import config as kcfg
from occult.moe.experts import expert_mlp_reference
from occult.tools.run_record import run_record

ENERGY_S = 1.0  # seconds of back-to-back calls an energy reading spans (--energy)

SHAPES = {
    # name: (hidden, experts in total, ffn, top_k)
    "olmoe": (2048, 64, 1024, 8),
    "qwen3moe": (2048, 128, 768, 8),
    "deepseekmoe": (2048, 64, 1408, 6),
    "mixtral": (4096, 8, 14336, 2),
}

T = kcfg.TileConfig
SWEEP = {  # (block_m, block_n, block_k, group_m, num_warps, num_stages, flatten, ctas_per_sm, split)
    "gemm1": [
        T(128, 128, 64, 8, 8, 3),
        T(128, 128, 64, 16, 8, 3),
    ],
    "gemm2": [
        T(128, 256, 64, 8, 8, 3, True),
        T(128, 256, 64, 8, 8, 4, True),
        T(128, 128, 64, 8, 8, 4, True),
    ],
    "dgrad1": [  # the last field: epilogue in 2 column slices or 1
        T(128, 128, 64, 8, 8, 4, split=2),
        T(128, 128, 64, 8, 8, 3, split=2),
        T(128, 128, 64, 16, 8, 4, split=2),
        T(64, 128, 64, 8, 4, 4, False, 2, split=2),
        T(128, 128, 64, 8, 8, 4, split=1),
    ],
    "wgrad": [  # the Triton path (on Hopper/bf16 the op uses torch._grouped_mm instead)
        T(128, 128, 64, 1, 8, 3),
        T(128, 128, 64, 1, 8, 4),
        T(128, 256, 64, 1, 8, 4),
        T(256, 128, 64, 1, 8, 3),
    ],
    "swiglu_rows": [  # the elementwise pass of the _grouped_mm dgrad1 (memory-bound): rows x columns, warps, CTAs/SM
        T(8, 512, 1, 1, 4, 1, ctas_per_sm=16),
        T(16, 512, 1, 1, 8, 1, ctas_per_sm=8),
        T(4, 1024, 1, 1, 4, 1, ctas_per_sm=16),
        T(8, 1024, 1, 1, 8, 1, ctas_per_sm=8),
        T(32, 256, 1, 1, 8, 1, ctas_per_sm=8),
        T(8, 256, 1, 1, 4, 1, ctas_per_sm=32),
        T(16, 256, 1, 1, 4, 1, ctas_per_sm=16),
    ],
    "gather": [  # gather_pair_rows (memory-bound)
        T(8, 1024, 1, 1, 4, 1, ctas_per_sm=4),
        T(16, 1024, 1, 1, 8, 1, ctas_per_sm=4),
        T(4, 2048, 1, 1, 4, 1, ctas_per_sm=8),
        T(8, 2048, 1, 1, 8, 1, ctas_per_sm=4),
        T(32, 512, 1, 1, 8, 1, ctas_per_sm=4),
        T(8, 1024, 1, 1, 4, 1, ctas_per_sm=8),
    ],
}


# ----------------------------------------------------------------------------- problem


def make_problem(hidden, num_experts, ffn, top_k, *, tokens, devices, device, dtype, seed):
    """Rank 0's received rows under uniform routing, dedup layout, local slots packed first."""
    g = torch.Generator(device=device).manual_seed(seed)
    total = tokens * devices
    ids = torch.rand(total, num_experts, generator=g, device=device).topk(top_k, dim=1).indices
    weights = torch.rand(total, top_k, generator=g, device=device)
    weights = weights / weights.sum(1, keepdim=True)
    local = num_experts // devices
    is_local = ids < local  # rank 0 holds experts [0, local)
    keep = is_local.any(1)
    ids, weights, is_local = ids[keep], weights[keep], is_local[keep]
    order = (~is_local).to(torch.int8).argsort(dim=1, stable=True)
    slots = torch.where(is_local, ids, -1).gather(1, order)
    gates = torch.where(is_local, weights, 0.0).gather(1, order)
    rows = slots.shape[0]
    x = torch.randn(rows, hidden, generator=g, device=device).to(dtype)
    w1 = (torch.randn(local, 2 * ffn, hidden, generator=g, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(local, hidden, ffn, generator=g, device=device) * ffn**-0.5).to(dtype)
    dy = torch.randn(rows, hidden, generator=g, device=device).to(dtype)
    pairs = int(is_local.sum())
    return dict(x=x, slots=slots, gates=gates.float(), w1=w1, w2=w2, dy=dy, P=pairs, R=rows, K=top_k, E=local)


# ----------------------------------------------------------------------------- timing


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device, target_ms=150.0, min_reps=5, max_reps=40):
    """Median milliseconds of `fn()` (CUDA events per call on GPU, after warm-up)."""
    fn()
    sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, []
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    sync(device)
    est = max(s.elapsed_time(e), 1e-3)
    reps = int(min(max_reps, max(min_reps, target_ms / est)))
    for _ in range(min(reps, 5)):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    sync(device)
    ms = [s.elapsed_time(e) for s, e in events]
    return statistics.median(ms), ms


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else float("nan")


def energy_meter(device, seconds=ENERGY_S):
    """A callable `joules(fn, ms)`: the GPU's energy per call of `fn` (J) and the wall ms per call meanwhile, from
    NVML's energy counter read around `seconds` of back-to-back calls (`ms`: one call's time, to size them), the
    device synchronised at both ends (the calls there run at the clock the power cap leaves, slower than a median
    timed in short bursts).
    The card's power cap holds over such a run as it does over a training step, so energy per FLOP, not time, is
    what a power-capped step pays (docs/kernels.md)."""
    import pynvml
    from _nvml import nvml_handle  # (benchmarks/_nvml.py: the card by its PCI bus id)

    handle = nvml_handle(device)

    def joules(fn, ms):
        reps = max(5, math.ceil(seconds * 1e3 / max(ms, 1e-3)))
        sync(device)
        t0, start = time.perf_counter(), pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        for _ in range(reps):
            fn()
        sync(device)
        end, t1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter()
        return (end - start) / 1e3 / reps, (t1 - t0) * 1e3 / reps

    return joules


# ----------------------------------------------------------------------------- variants


def grads_of(fn, prob, inputs):
    x, gates, w1, w2 = inputs
    y = fn(x, prob["slots"], gates, w1, w2)
    return y, torch.autograd.grad(y, (x, gates, w1, w2), prob["dy"].to(y.dtype))


def leaf_inputs(prob, dtype=None):
    return [
        (t if dtype is None else t.to(dtype)).detach().requires_grad_()
        for t in (prob["x"], prob["gates"], prob["w1"], prob["w2"])
    ]


def rel(a, b):
    a, b = a.double(), b.double()
    n = b.norm().item()
    return (a - b).norm().item() / n if n > 0 else (a - b).norm().item()


def check(prob, device):
    """Relative errors of kernels (bf16) and torch reference (bf16) vs a float32 reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    yr, gr = grads_of(expert_mlp_reference, prob, leaf_inputs(prob, ref_dtype))
    out = {}
    for name, fn in (
        ("kernels", kernels.expert_mlp),
        ("kernels_atomic", lambda *a: kernels.expert_mlp(*a, atomic=True)),
        ("torch_bf16", expert_mlp_reference),
    ):
        y, g = grads_of(fn, prob, leaf_inputs(prob))
        errs = {"y": rel(y, yr)}
        errs.update({n: rel(a, b) for n, a, b in zip(("dx", "dgates", "dgate_up", "ddown"), g, gr)})
        errs["finite"] = bool(torch.isfinite(y).all()) and all(bool(torch.isfinite(t).all()) for t in g)
        out[name] = errs
        del y, g
    del yr, gr
    # no host synchronisation inside forward + backward
    if device.type == "cuda":
        inputs = leaf_inputs(prob)
        grads_of(kernels.expert_mlp, prob, inputs)  # compiled already
        sync(device)
        try:
            torch.cuda.set_sync_debug_mode("error")
            grads_of(kernels.expert_mlp, prob, inputs)
            out["host_sync_free"] = True
        except RuntimeError as err:
            out["host_sync_free"] = f"no: {err}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        sync(device)
    return out


def gemm_parts(prob):
    """Pre-built pair lists and buffers to time each kernel alone."""
    from occult.kernels.combine import combine_rows
    from occult.kernels.grouped_gemm import gather_gemm_swiglu, gemm_scatter
    from occult.kernels.grouped_gemm_backward import swiglu_dgrad, weight_grad
    from occult.kernels.grouped_mm import (
        gather_pair_rows,
        gemm1_grouped,
        grouped_weight_grad,
        swiglu_backward_rows,
        swiglu_dgrad_grouped,
        use_grouped_mm,
    )
    from occult.kernels.pairs import build_pairs, build_pairs_torch

    x, slots, gates, w1, w2, dy, K = (prob[k] for k in ("x", "slots", "gates", "w1", "w2", "dy", "K"))
    g = gates.view(-1)
    pair, offsets = build_pairs(slots, w1.shape[0])
    h, ab = gather_gemm_swiglu(x, pair, offsets, *w1.chunk(2, 1), g, K, save_ab=True)
    o = x.new_empty((slots.numel(), x.shape[1]))
    dab, _ = swiglu_dgrad(dy, pair, offsets, w2, ab, g, K)
    dxp = x.new_empty((slots.numel(), x.shape[1]))
    rows = x.new_empty((slots.numel(), x.shape[1]))
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    H, F = x.shape[1], w2.shape[2]
    parts = {
        "dgrad1_triton": lambda: swiglu_dgrad(dy, pair, offsets, w2, ab, g, K),
        "wgrad_gate_up_triton": lambda: weight_grad(dab, x, pair, offsets, K, dw1, a_gather=False, b_gather=True),
        "wgrad_down_triton": lambda: weight_grad(dy, h, pair, offsets, K, dw2, a_gather=True, b_gather=False),
        "gather_rows": lambda: gather_pair_rows(x, pair, offsets, K, out=rows),
    }
    # what the op runs (kernels.op, kernels.grouped_mm): on Hopper/bf16 the weight gradients are a
    # gather + torch._grouped_mm; with OCCULT_DGRAD1 the SwiGLU dgrad too, whose dy gather is then
    # shared with the down-projection weight gradient (counted in dgrad1, not again in wgrad_down)
    wgrad_gmm = use_grouped_mm(x, H, F)
    dgrad_gmm = use_grouped_mm(x, H, F, which="dgrad1")
    if wgrad_gmm or dgrad_gmm:
        dy_rows = gather_pair_rows(dy, pair, offsets, K)
        u = torch._grouped_mm(dy_rows, w2, offs=offsets[1:])
        parts.update(
            {
                "u_grouped_mm": lambda: torch._grouped_mm(dy_rows, w2, offs=offsets[1:]),  # dgrad1's GEMM alone
                "swiglu_rows": lambda: swiglu_backward_rows(u, ab, pair, offsets, g),  # dgrad1's elementwise pass
                "dgrad1_grouped_mm": lambda: swiglu_dgrad_grouped(
                    gather_pair_rows(dy, pair, offsets, K, out=rows), pair, offsets, w2, ab, g
                ),
                "wgrad_gate_up_grouped_mm": lambda: grouped_weight_grad(
                    dab, gather_pair_rows(x, pair, offsets, K, out=rows), offsets
                ),
                "wgrad_down_grouped_mm": lambda: grouped_weight_grad(
                    gather_pair_rows(dy, pair, offsets, K, out=rows), h, offsets
                ),
                "wgrad_down_grouped_mm_gathered": lambda: grouped_weight_grad(dy_rows, h, offsets),
            }
        )
    parts["dgrad1"] = parts["dgrad1_grouped_mm" if dgrad_gmm else "dgrad1_triton"]
    parts["wgrad_gate_up"] = parts["wgrad_gate_up_grouped_mm" if wgrad_gmm else "wgrad_gate_up_triton"]
    parts["wgrad_down"] = parts[
        ("wgrad_down_grouped_mm_gathered" if dgrad_gmm else "wgrad_down_grouped_mm")
        if wgrad_gmm
        else "wgrad_down_triton"
    ]
    return {
        "pairs": lambda: build_pairs(slots, w1.shape[0]),
        "pairs_torch_sort": lambda: build_pairs_torch(slots, w1.shape[0]),
        "gemm1": lambda: gather_gemm_swiglu(x, pair, offsets, *w1.chunk(2, 1), g, K, save_ab=False),
        "gemm1_save": lambda: gather_gemm_swiglu(x, pair, offsets, *w1.chunk(2, 1), g, K, save_ab=True),
        # the training forward's GEMM 1 through gather + torch._grouped_mm + SwiGLU pass (setting gemm1)
        "gemm1_grouped_mm": lambda: gemm1_grouped(x, pair, offsets, w1, g, K),
        "gemm2": lambda: gemm_scatter(h, pair, offsets, w2.transpose(1, 2), K, o),
        "combine": lambda: combine_rows(o, slots, w1.shape[0], x.dtype),
        "dgrad2": lambda: gemm_scatter(dab, pair, offsets, w1, K, dxp, config_name="dgrad2"),
        **parts,
    }


def part_flops(prob):
    P, H, F = prob["P"], prob["x"].shape[1], prob["w2"].shape[2]
    return {
        "gemm1": 4 * P * H * F,
        "gemm1_save": 4 * P * H * F,
        "gemm2": 2 * P * H * F,
        "dgrad1": 2 * P * H * F,
        "dgrad2": 4 * P * H * F,
        "wgrad_gate_up": 4 * P * H * F,
        "wgrad_down": 2 * P * H * F,
        "wgrad_gate_up_triton": 4 * P * H * F,
        "wgrad_down_triton": 2 * P * H * F,
        "dgrad1_triton": 2 * P * H * F,
        "dgrad1_grouped_mm": 2 * P * H * F,
        "u_grouped_mm": 2 * P * H * F,
        "wgrad_gate_up_grouped_mm": 4 * P * H * F,
        "wgrad_down_grouped_mm": 2 * P * H * F,
        "wgrad_down_grouped_mm_gathered": 2 * P * H * F,
    }


def grouped_mm_variants(prob):
    """torch._grouped_mm: the GEMMs alone, and a straightforward pipeline (gather, GEMM, SwiGLU,
    GEMM, gate, fp32 index_add) with one host sync for P."""
    if not hasattr(torch, "_grouped_mm"):
        return {}
    x, slots, gates, w1, w2, K = (prob[k] for k in ("x", "slots", "gates", "w1", "w2", "K"))
    E, F = w1.shape[0], w2.shape[2]
    from occult.kernels.pairs import build_pairs

    pair, offsets = build_pairs(slots, E)
    P = prob["P"]
    rows = (pair[:P] // K).long()
    offs = offsets[1:].contiguous()
    xs = x[rows]
    hs = torch.randn(P, F, device=x.device).to(x.dtype)
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)

    def pipeline(x, gates, w1, w2):
        pair, offsets = build_pairs(slots, E)
        P = int(offsets[-1])  # host sync
        idx = pair[:P].long()
        rows = idx // K
        offs = offsets[1:]
        ab = torch._grouped_mm(x[rows], w1.transpose(1, 2), offs=offs)
        h = torch.nn.functional.silu(ab[:, :F]) * ab[:, F:]
        o = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
        y = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
        y = y.index_add(0, rows, o.float() * gates.reshape(-1)[idx, None])
        return y.to(x.dtype)

    return {
        "gemm1": lambda: torch._grouped_mm(xs, w1t, offs=offs),
        "gemm2": lambda: torch._grouped_mm(hs, w2t, offs=offs),
        "pipeline": pipeline,
    }


def dense_variants(prob):
    P, H, F = prob["P"], prob["x"].shape[1], prob["w2"].shape[2]
    dev, dt = prob["x"].device, prob["x"].dtype
    r = lambda *s: torch.randn(*s, device=dev).to(dt)  # noqa: E731
    X, W1, Hh, W2, dY, dAB = r(P, H), r(2 * F, H), r(P, F), r(H, F), r(P, H), r(P, 2 * F)

    def fwd():
        torch.mm(X, W1.t())
        torch.mm(Hh, W2.t())

    def bwd():
        torch.mm(dY, W2)
        torch.mm(dAB, W1)
        torch.mm(dAB.t(), X)
        torch.mm(dY.t(), Hh)

    return {
        "gemm1": lambda: torch.mm(X, W1.t()),
        "gemm2": lambda: torch.mm(Hh, W2.t()),
        "fwd": fwd,
        "bwd": bwd,
        "dgrad1": lambda: torch.mm(dY, W2),
        "dgrad2": lambda: torch.mm(dAB, W1),
        "wgrad_gate_up": lambda: torch.mm(dAB.t(), X),
        "wgrad_down": lambda: torch.mm(dY.t(), Hh),
    }


# the expert products whose energy --energy tabulates: (label, key, the part_flops key giving its FLOPs)
ENERGY_ROWS = (
    ("GEMM 1, fused gather Triton", "kernels.gemm1", "gemm1"),
    ("GEMM 1, copy + _grouped_mm + SwiGLU", "kernels.gemm1_grouped_mm", "gemm1"),
    ("GEMM 1, _grouped_mm alone", "grouped_mm.gemm1", "gemm1"),
    ("GEMM 1, dense mm", "dense.gemm1", "gemm1"),
    ("GEMM 2, Triton gemm_scatter", "kernels.gemm2", "gemm2"),
    ("GEMM 2, _grouped_mm alone", "grouped_mm.gemm2", "gemm2"),
    ("GEMM 2, dense mm", "dense.gemm2", "gemm2"),
    ("dgrad of GEMM 2 (u), as the op runs it", "kernels.dgrad1", "dgrad1"),
    ("dgrad of GEMM 2, dense mm", "dense.dgrad1", "dgrad1"),
    ("dgrad of GEMM 1, Triton gemm_scatter", "kernels.dgrad2", "dgrad2"),
    ("dgrad of GEMM 1, dense mm", "dense.dgrad2", "dgrad2"),
    ("wgrad gate_up, as the op runs it", "kernels.wgrad_gate_up", "wgrad_gate_up"),
    ("wgrad gate_up, dense mm", "dense.wgrad_gate_up", "wgrad_gate_up"),
    ("wgrad down, as the op runs it", "kernels.wgrad_down", "wgrad_down"),
    ("wgrad down, dense mm", "dense.wgrad_down", "wgrad_down"),
)


def energy_table(report, log):
    """Energy per call (J), per FLOP (pJ) and mean power (W) of each expert product and its dense twin."""
    nan = float("nan")
    log("energy (NVML's counter over ~1 s of back-to-back calls): J per call, pJ per FLOP, mean W over those calls")
    for name, e in report["shapes"].items():
        flops = e.get("part_flops", {})
        log(f"{name}")
        for label, key, part in ENERGY_ROWS:
            j, ms = e["joules"].get(key, nan), e["energy_ms"].get(key, nan)
            pj = 1e12 * j / flops[part] if part in flops else nan
            log(f"  {label:40s} {j:8.4f} J {pj:6.2f} pJ/FLOP {j / (ms * 1e-3) if ms else nan:5.0f} W")


# ----------------------------------------------------------------------------- main


def sweep(prob, device, log, only=None):
    parts = gemm_parts(prob)
    flops = part_flops(prob)
    results = {}
    for name, configs in SWEEP.items():
        if only and name not in only:
            continue
        keys = {
            "gemm1": ["gemm1"],
            "gemm2": ["gemm2"],
            "dgrad1": ["dgrad1_triton"],
            "wgrad": ["wgrad_gate_up_triton", "wgrad_down_triton"],
            "swiglu_rows": ["swiglu_rows"],
            "gather": ["gather_rows"],
        }[name]
        if any(k not in parts for k in keys):
            continue
        best = None
        results[name] = []
        for cfg in configs:
            kcfg.override(name, cfg)
            try:
                ms = sum(timeit(parts[k], device)[0] for k in keys)
                tf = tflops(sum(flops.get(k, 0) for k in keys), ms)
            except Exception as err:  # e.g. out of shared memory
                ms, tf = float("nan"), float("nan")
                log(f"  sweep {name} {tuple(cfg.__dict__.values())}: failed: {str(err).splitlines()[0][:200]}")
            results[name].append({"config": cfg.__dict__, "ms": ms, "tflops": tf})
            log(f"  sweep {name} {tuple(cfg.__dict__.values())}: {ms:.3f} ms {tf:.0f} TFLOP/s")
            if not math.isnan(ms) and (best is None or ms < best[0]):
                best = (ms, cfg)
        if best is not None:
            kcfg.override(name, best[1])
            if name == "gemm2":
                kcfg.override("dgrad2", best[1])
    return results


GEMM1_ROUNDS = 5


@contextlib.contextmanager
def gemm1_setting(mode: str):
    """OCCULT_GEMM1=mode inside the block (occult.settings reads the environment at each call)."""
    old = os.environ.get("OCCULT_GEMM1")
    os.environ["OCCULT_GEMM1"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OCCULT_GEMM1", None)
        else:
            os.environ["OCCULT_GEMM1"] = old


def run_shape(name, prob, device, log, skip_reference=False, joules=None):
    H, F = prob["x"].shape[1], prob["w2"].shape[2]
    P = prob["P"]
    fl_f, fl_b = 6 * P * H * F, 12 * P * H * F
    res = {
        "P": P,
        "R": prob["R"],
        "K": prob["K"],
        "E_local": prob["E"],
        "H": H,
        "F": F,
        "flops_fwd": fl_f,
        "flops_bwd": fl_b,
        "ms": {},
        "samples": {},
        "joules": {},
        "energy_ms": {},  # wall ms per call during the energy reading (the capped clock)
        "errors": {},
    }

    def t(key, fn):
        try:
            ms, samples = timeit(fn, device)
            res["ms"][key] = ms
            res["samples"][key] = samples
            if joules is not None:
                res["joules"][key], res["energy_ms"][key] = joules(fn, ms)
            energy = f"  {res['joules'][key]:8.4f} J" if key in res["joules"] else ""
            log(f"  {key:28s} {ms:9.3f} ms{energy}")
        except Exception as err:
            res["errors"][key] = "".join(traceback.format_exception_only(type(err), err))[-500:]
            log(f"  {key:28s} FAILED {res['errors'][key].strip()[:200]}")

    ins_nograd = [prob[k] for k in ("x", "slots", "gates", "w1", "w2")]
    with torch.no_grad():
        t("kernels.fwd", lambda: kernels.expert_mlp(*ins_nograd))
        t("kernels_atomic.fwd", lambda: kernels.expert_mlp(*ins_nograd, atomic=True))
    leaves = leaf_inputs(prob)
    t("kernels.fwd_train", lambda: kernels.expert_mlp(prob["x"], prob["slots"], *leaves[1:]))
    t("kernels.fwdbwd", lambda: grads_of(kernels.expert_mlp, prob, leaves))
    t("kernels_atomic.fwdbwd", lambda: grads_of(lambda *a: kernels.expert_mlp(*a, atomic=True), prob, leaves))
    for key, fn in gemm_parts(prob).items():
        t(f"kernels.{key}", fn)
    # the training forward's GEMM 1 both ways (setting gemm1), same run, in alternating rounds (the median of
    # the rounds' medians: a difference of a few percent is below the drift between two timings a minute apart)
    runs = {
        "fwd_train": lambda: kernels.expert_mlp(prob["x"], prob["slots"], *leaves[1:]),
        "fwdbwd": lambda: grads_of(kernels.expert_mlp, prob, leaves),
    }
    rounds: dict[str, list[float]] = {}
    for _ in range(GEMM1_ROUNDS):
        for mode in ("triton", "grouped_mm"):
            with gemm1_setting(mode):
                for key, fn in runs.items():
                    rounds.setdefault(f"kernels.{key}_gemm1_{mode}", []).append(timeit(fn, device)[0])
    for key, values in rounds.items():
        res["ms"][key] = statistics.median(values)
        res["samples"][key] = values
        log(f"  {key:28s} {res['ms'][key]:9.3f} ms (median of {len(values)} alternating rounds)")
    if not skip_reference:
        with torch.no_grad():
            t("torch_ref.fwd", lambda: expert_mlp_reference(*ins_nograd))
        t("torch_ref.fwdbwd", lambda: grads_of(expert_mlp_reference, prob, leaves))
    gmm = {}
    try:
        gmm = grouped_mm_variants(prob)
    except Exception as err:
        res["errors"]["grouped_mm"] = str(err)[-500:]
    for key, fn in gmm.items():
        if key == "pipeline":
            with torch.no_grad():
                t("grouped_mm.pipeline_fwd", lambda: fn(*[prob[k] for k in ("x", "gates", "w1", "w2")]))
            t("grouped_mm.pipeline_fwdbwd", lambda: grads_of(lambda x, s, g, a, b: fn(x, g, a, b), prob, leaves))
        else:
            t(f"grouped_mm.{key}", fn)
    for key, fn in dense_variants(prob).items():
        t(f"dense.{key}", fn)
    ms = res["ms"]
    get = lambda k: ms.get(k, float("nan"))  # noqa: E731
    bwd = get("kernels.fwdbwd") - get("kernels.fwd_train")
    res["summary"] = {
        "fwd_ms": get("kernels.fwd"),
        "fwd_tflops": tflops(fl_f, get("kernels.fwd")),
        "bwd_ms": bwd,
        "bwd_tflops": tflops(fl_b, bwd),
        "fwdbwd_ms": get("kernels.fwdbwd"),
        "fwdbwd_tflops": tflops(fl_f + fl_b, get("kernels.fwdbwd")),
        "gemms_fwd_tflops": tflops(fl_f, get("kernels.gemm1") + get("kernels.gemm2")),
        "gemms_bwd_tflops": tflops(
            fl_b, sum(get(f"kernels.{k}") for k in ("dgrad1", "dgrad2", "wgrad_gate_up", "wgrad_down"))
        ),
        # the faster of: both products in one timed call, or each timed alone and summed
        "dense_fwd_tflops": tflops(fl_f, min(get("dense.fwd"), get("dense.gemm1") + get("dense.gemm2"))),
        "dense_bwd_tflops": tflops(fl_b, get("dense.bwd")),
        "grouped_mm_fwd_tflops": tflops(fl_f, get("grouped_mm.gemm1") + get("grouped_mm.gemm2")),
        "gemm1_tflops": tflops(4 * P * H * F, get("kernels.gemm1")),
        "gemm2_tflops": tflops(2 * P * H * F, get("kernels.gemm2")),
        "dense_gemm1_tflops": tflops(4 * P * H * F, get("dense.gemm1")),
        "dense_gemm2_tflops": tflops(2 * P * H * F, get("dense.gemm2")),
        "grouped_mm_gemm1_tflops": tflops(4 * P * H * F, get("grouped_mm.gemm1")),
        "grouped_mm_gemm2_tflops": tflops(2 * P * H * F, get("grouped_mm.gemm2")),
    }
    # backward kernels one by one: TF/s, and % of the dense cuBLAS product of the same shape
    fl_parts = part_flops(prob)
    res["part_flops"] = fl_parts
    for k in (
        "dgrad1",
        "dgrad2",
        "wgrad_gate_up",
        "wgrad_down",
        "wgrad_gate_up_triton",
        "wgrad_down_triton",
        "dgrad1_triton",
        "dgrad1_grouped_mm",
        "wgrad_gate_up_grouped_mm",
        "wgrad_down_grouped_mm",
        "wgrad_down_grouped_mm_gathered",
    ):
        res["summary"][f"{k}_tflops"] = tflops(fl_parts[k], get(f"kernels.{k}"))
        dense_k = k.replace("_triton", "").replace("_grouped_mm", "").replace("_gathered", "")
        res["summary"][f"{k}_pct_dense"] = 100 * get(f"dense.{dense_k}") / get(f"kernels.{k}")
    # the backward GEMMs' TF/s for each choice of dgrad1 (the weight gradients as the op runs them)
    wd_alone = "kernels.wgrad_down_grouped_mm" if "kernels.wgrad_down_grouped_mm" in ms else "kernels.wgrad_down"
    rest = get("kernels.dgrad2") + get("kernels.wgrad_gate_up")
    res["summary"]["gemms_bwd_tflops_dgrad1_triton"] = tflops(fl_b, get("kernels.dgrad1_triton") + get(wd_alone) + rest)
    res["summary"]["gemms_bwd_tflops_dgrad1_grouped_mm"] = tflops(
        fl_b, get("kernels.dgrad1_grouped_mm") + get("kernels.wgrad_down_grouped_mm_gathered") + rest
    )
    # the memory-bound passes: GB/s moved (bf16 u, [a; b] read, d[a; b] written; rows read and written)
    res["summary"]["swiglu_rows_gbs"] = P * 10 * F / get("kernels.swiglu_rows") / 1e6
    res["summary"]["gather_rows_gbs"] = P * 4 * H / get("kernels.gather_rows") / 1e6
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write JSON details here")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    ap.add_argument("--devices", type=int, default=4, help="expert-parallel ranks (rank 0 is simulated)")
    ap.add_argument(
        "--sweep",
        nargs="?",
        const="all",
        default=None,
        metavar="KERNELS",
        help="time a few tile configs first (of every kernel, or of the comma-separated KERNELS: "
        + ",".join(SWEEP)
        + "), keep the fastest",
    )
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--skip-reference", action="store_true", help="do not time the torch reference")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run under TRITON_INTERPRET=1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--energy",
        action="store_true",
        help=f"also each timed path's energy per call (NVML's energy counter over ~{ENERGY_S:g} s of calls; a GPU "
        "and nvidia-ml-py), and a table of the expert products' energy per FLOP",
    )
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not kernels.available(device):
        print("occult.kernels not available on", device, "(needs triton and CUDA, or TRITON_INTERPRET=1)")
        return 2
    shapes = dict(SHAPES)
    if args.tiny:
        shapes = {k: (64, max(4, e // 4), 48, k_) for k, (h, e, f, k_) in SHAPES.items()}
        args.tokens = 16
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    import triton

    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
        **run_record(1, device.type == "cuda"),
        "argv": sys.argv,
        "tokens_per_rank": args.tokens,
        "devices": args.devices,
    }
    from occult.kernels.grouped_mm import use_grouped_mm

    probe = torch.empty((1, 8), device=device, dtype=torch.bfloat16)
    info["wgrad_grouped_mm"] = use_grouped_mm(probe, 8)
    log(f"# {info}")
    report = {"info": info, "shapes": {}, "sweep": None}
    if device.type == "cuda":
        a = torch.randn(8192, 8192, device=device).bfloat16()
        b = torch.randn(8192, 8192, device=device).bfloat16()
        ms, _ = timeit(lambda: torch.mm(a, b), device)
        info["dense_8192_tflops"] = tflops(2 * 8192**3, ms)
        log(f"# dense bf16 8192^3: {info['dense_8192_tflops']:.0f} TFLOP/s")
        del a, b

    names = [s for s in args.shapes.split(",") if s]
    for i, name in enumerate(names):
        hidden, experts, ffn, top_k = shapes[name]
        prob = make_problem(
            hidden,
            experts,
            ffn,
            top_k,
            tokens=args.tokens,
            devices=args.devices,
            device=device,
            dtype=torch.bfloat16,
            seed=args.seed + i,
        )
        log(
            f"## {name}: H={hidden} E={experts} (local {prob['E']}) F={ffn} top{top_k}: R={prob['R']} rows, "
            f"P={prob['P']} pairs, K={prob['K']}"
        )
        entry = {}
        if not args.no_check:
            try:
                entry["check"] = check(prob, device)
                log(f"  check: {json.dumps(entry['check'])}")
            except Exception:
                entry["check"] = {"error": traceback.format_exc()[-2000:]}
                log("  check FAILED:\n" + entry["check"]["error"])
        if args.sweep and i == 0:
            report["sweep"] = sweep(prob, device, log, None if args.sweep == "all" else set(args.sweep.split(",")))
        joules = energy_meter(device) if args.energy and device.type == "cuda" else None
        entry.update(run_shape(name, prob, device, log, skip_reference=args.skip_reference, joules=joules))
        entry["configs"] = {k: kcfg.get(k).__dict__ for k in kcfg.GPU_DEFAULTS}
        report["shapes"][name] = entry
        del prob
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1, default=str)

    # short tables last
    nan = float("nan")
    log("")
    log("forward (bf16; TF/s = 6PHF / time; %dense = kernels' GEMMs vs dense cuBLAS of the same shapes)")
    log(
        f"{'shape':12s} {'P':>6s} {'op ms':>7s} {'TF/s':>5s} {'gemms':>6s} {'dense':>6s} {'%dns':>5s} "
        f"{'gmm':>5s} {'atomic':>7s} {'ref ms':>7s} {'gmmpipe':>7s}"
    )
    for name, e in report["shapes"].items():
        s_, ms = e["summary"], e["ms"]
        log(
            f"{name:12s} {e['P']:6d} {s_['fwd_ms']:7.3f} {s_['fwd_tflops']:5.0f} {s_['gemms_fwd_tflops']:6.0f} "
            f"{s_['dense_fwd_tflops']:6.0f} {100 * s_['gemms_fwd_tflops'] / s_['dense_fwd_tflops']:5.0f} "
            f"{s_['grouped_mm_fwd_tflops']:5.0f} {ms.get('kernels_atomic.fwd', nan):7.3f} "
            f"{ms.get('torch_ref.fwd', nan):7.3f} {ms.get('grouped_mm.pipeline_fwd', nan):7.3f}"
        )
    log("backward (bwd = fwd+bwd - training fwd; TF/s = 12PHF / time)")
    log(
        f"{'shape':12s} {'bwd ms':>7s} {'TF/s':>5s} {'gemms':>6s} {'dense':>6s} {'%dns':>5s} "
        f"{'f+b ms':>7s} {'atomic':>7s} {'ref f+b':>7s} {'gmmpipe':>7s}"
    )
    for name, e in report["shapes"].items():
        s_, ms = e["summary"], e["ms"]
        log(
            f"{name:12s} {s_['bwd_ms']:7.3f} {s_['bwd_tflops']:5.0f} {s_['gemms_bwd_tflops']:6.0f} "
            f"{s_['dense_bwd_tflops']:6.0f} {100 * s_['gemms_bwd_tflops'] / s_['dense_bwd_tflops']:5.0f} "
            f"{s_['fwdbwd_ms']:7.3f} {ms.get('kernels_atomic.fwdbwd', nan):7.3f} "
            f"{ms.get('torch_ref.fwdbwd', nan):7.3f} {ms.get('grouped_mm.pipeline_fwdbwd', nan):7.3f}"
        )
    log(
        "backward kernels: ms, TF/s (% of the dense cuBLAS product of the same shape); wgrad = what the op runs "
        f"({'gather + torch._grouped_mm' if info.get('wgrad_grouped_mm') else 'Triton'}), tri = the Triton weight_grad"
    )
    log(
        f"{'shape':12s} {'dgrad1':>17s} {'dgrad2':>17s} {'wgrad gate_up':>17s} {'wgrad down':>17s} "
        f"{'tri gate_up':>12s} {'tri down':>12s} {'gather':>7s}"
    )
    for name, e in report["shapes"].items():
        s_, ms = e["summary"], e["ms"]
        cell = lambda k: f"{ms.get('kernels.' + k, nan):.3f} {s_[k + '_tflops']:4.0f} ({s_[k + '_pct_dense']:3.0f}%)"  # noqa: E731
        log(
            f"{name:12s} {cell('dgrad1'):>17s} {cell('dgrad2'):>17s} {cell('wgrad_gate_up'):>17s} "
            f"{cell('wgrad_down'):>17s} {s_['wgrad_gate_up_triton_tflops']:5.0f} "
            f"({s_['wgrad_gate_up_triton_pct_dense']:3.0f}%) {s_['wgrad_down_triton_tflops']:5.0f} "
            f"({s_['wgrad_down_triton_pct_dense']:3.0f}%) {ms.get('kernels.gather_rows', nan):7.3f}"
        )
    log(
        "backward GEMMs TF/s (% of dense), dgrad1 = fused Triton / = gather + _grouped_mm + SwiGLU pass; dgrad1 ms both"
    )
    for name, e in report["shapes"].items():
        s_ = e["summary"]
        a, b, d = s_["gemms_bwd_tflops_dgrad1_triton"], s_["gemms_bwd_tflops_dgrad1_grouped_mm"], s_["dense_bwd_tflops"]
        log(
            f"{name:12s} {a:5.0f} ({100 * a / d:3.0f}%) / {b:5.0f} ({100 * b / d:3.0f}%)   "
            f"{e['ms'].get('kernels.dgrad1_triton', nan):.3f} / {e['ms'].get('kernels.dgrad1_grouped_mm', nan):.3f}"
        )
    log(
        "dgrad1 via _grouped_mm, its parts: ms of the u GEMM (TF/s, % of dense) + the SwiGLU pass (GB/s) + dy gather "
        "(GB/s)"
    )
    for name, e in report["shapes"].items():
        s_, ms = e["summary"], e["ms"]
        u_ms = ms.get("kernels.u_grouped_mm", nan)
        log(
            f"{name:12s} {u_ms:.3f} ({e['flops_bwd'] / 6 / u_ms / 1e9:4.0f}, "
            f"{100 * ms.get('dense.dgrad1', nan) / u_ms:3.0f}%) + {ms.get('kernels.swiglu_rows', nan):.3f} "
            f"({s_.get('swiglu_rows_gbs', nan):5.0f}) + {ms.get('kernels.gather_rows', nan):.3f} "
            f"({s_.get('gather_rows_gbs', nan):5.0f})"
        )
    log(
        "training GEMM 1 (setting gemm1), fused Triton / gather + _grouped_mm + SwiGLU pass: GEMM 1 alone ms "
        "(with [a; b] saved); training forward ms; forward+backward ms"
    )
    for name, e in report["shapes"].items():
        ms = e["ms"]
        pair = lambda a, b: f"{ms.get(a, nan):.3f} / {ms.get(b, nan):.3f}"  # noqa: E731
        log(
            f"{name:12s} {pair('kernels.gemm1_save', 'kernels.gemm1_grouped_mm'):>15s}   "
            f"{pair('kernels.fwd_train_gemm1_triton', 'kernels.fwd_train_gemm1_grouped_mm'):>15s}   "
            f"{pair('kernels.fwdbwd_gemm1_triton', 'kernels.fwdbwd_gemm1_grouped_mm'):>15s}"
        )
    if any(e.get("joules") for e in report["shapes"].values()):
        energy_table(report, log)
    log("check vs fp32 reference (relative error y/dx/dgates/dgate_up/ddown; torch bf16 path for scale)")
    for name, e in report["shapes"].items():
        c = e.get("check", {})
        fmt = lambda d: "/".join(f"{d.get(k, nan):.1e}" for k in ("y", "dx", "dgates", "dgate_up", "ddown"))  # noqa: E731
        log(
            f"{name:12s} kernels {fmt(c.get('kernels', {}))}  torch {fmt(c.get('torch_bf16', {}))}  "
            f"no-host-sync={c.get('host_sync_free')}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
