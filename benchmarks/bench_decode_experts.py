"""Decode-sized expert MLP on one GPU: `occult.kernels.small_batch` vs the grouped-GEMM Triton path
and the torch path, against the HBM bandwidth floor.

Problem: OLMoE-1B-7B's layer on one GPU (H=2048, F=1024, 64 local experts, top-8), R rows
(tokens), random top-8 routing of distinct experts, softmax gates (fp32), bf16 activations and
weights. Bytes = the gate/up/down weights of the distinct experts a call selects (what it must
read at least); GB/s = bytes / time; "copy" = a measured 1 GiB device-to-device copy (read +
write bytes). The floor of a call is bytes / copy bandwidth.

1. Checks in bf16 (and fp16/fp32 at R=8) against a float32 reference (`expert_mlp_reference` on
   upcast inputs, TF32 off), relative Frobenius error, for R in --check-rows; slot -1 padding
   with a row of padding only; R=0; no host sync (`torch.cuda.set_sync_debug_mode("error")`).
2. Optionally (--sweep) times a few tile configs of the two small-batch kernels.
3. Times each variant per R: inside a CUDA graph (16 calls on 16 different routings per replay,
   so the weights are not served from L2; median over replays / 16), and eagerly (the same 16
   calls from Python). Variants: `small` (3 launches), `small_row` (down as a per-row GEMV, 2
   launches), `grouped` (the grouped-GEMM Triton path: pair sort + 2 GEMMs + combine, i.e.
   `small_batch.MAX_PAIRS = 0`), `torch` (eager only: it reads counts to the host), and
   `gate_up` (stage 1 of `small` alone, bytes = gate/up weights).

    PYTHONPATH=. python3 benchmarks/bench_decode_experts.py --out $OUT/decode_experts.json
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_decode_experts.py --tiny   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from occult import kernels
from occult.kernels import config as kcfg
from occult.kernels import small_batch
from occult.moe.experts import expert_mlp_reference
from occult.tools.run_record import run_record

T = kcfg.TileConfig
SWEEP = {
    "small_gate_up": [
        T(16, 32, 128, 1, 4, 4),
        T(16, 64, 128, 1, 4, 3),
        T(16, 32, 256, 1, 4, 3),
        T(16, 16, 256, 1, 4, 3),
    ],
    "small_down": [T(16, 64, 128, 1, 4, 4), T(16, 32, 128, 1, 4, 4), T(16, 128, 64, 1, 4, 4), T(16, 64, 256, 1, 8, 3)],
}
NSETS = 16


def make_weights(hidden, experts, ffn, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    w1 = (torch.randn(experts, 2 * ffn, hidden, generator=g, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, ffn, generator=g, device=device) * ffn**-0.5).to(dtype)
    return w1, w2


def make_inputs(rows, hidden, experts, top_k, device, dtype, g):
    x = torch.randn(rows, hidden, generator=g, device=device).to(dtype)
    logits = torch.randn(rows, experts, generator=g, device=device)
    vals, slots = logits.topk(top_k, dim=1)
    return x, slots, torch.softmax(vals, dim=1)


def rel(a, b):
    a, b = a.double(), b.double()
    d = b.norm().item()
    return (a - b).norm().item() / d if d > 0 else (a - b).norm().item()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def variants(w1, w2):
    def grouped(x, s, g):
        old, small_batch.MAX_PAIRS = small_batch.MAX_PAIRS, 0
        try:
            return kernels.expert_mlp(x, s, g, w1, w2)
        finally:
            small_batch.MAX_PAIRS = old

    return {
        "small": lambda x, s, g: small_batch.expert_mlp_small_batch(x, s, g, w1, w2, down_by_row=False),
        "small_row": lambda x, s, g: small_batch.expert_mlp_small_batch(x, s, g, w1, w2, down_by_row=True),
        "grouped": grouped,
        "torch": lambda x, s, g: expert_mlp_reference(x, s, g, w1, w2),
        "gate_up": lambda x, s, g: small_batch.swiglu_small_batch(x, s, w1),
    }


def check(w1, w2, args, device, log):
    out = {}
    hidden, experts, _ffn = w1.shape[2], w1.shape[0], w2.shape[2]
    g = torch.Generator(device=device).manual_seed(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    w1f, w2f = w1.float(), w2.float()
    cases = [(r, torch.bfloat16, False) for r in args.check_rows] + [(8, torch.bfloat16, True)]
    cases += [(8, torch.float16, False), (8, torch.float32, False)]
    for rows, dtype, pad in cases:
        x, s, gt = make_inputs(rows, hidden, experts, args.top_k, device, dtype, g)
        if pad:  # sync-free layout: unused capacity, half the slots -1, one row of padding only
            s = torch.where(torch.rand(s.shape, generator=g, device=device) < 0.5, s, -1)
            s[rows // 2] = -1
        ref = expert_mlp_reference(x.float(), s, gt, w1f, w2f)
        a, b = w1.to(dtype), w2.to(dtype)
        res = {}
        for name, fn in variants(a, b).items():
            if name != "gate_up":
                with torch.no_grad():
                    res[name] = rel(fn(x, s, gt), ref)
        key = f"R={rows} {str(dtype).split('.')[-1]}" + (" padded" if pad else "")
        out[key] = res
        log(f"check {key}: " + ", ".join(f"{k} {v:.2e}" for k, v in res.items()))
    x, s, gt = make_inputs(8, hidden, experts, args.top_k, device, torch.bfloat16, g)
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            small_batch.expert_mlp_small_batch(x, s, gt, w1, w2)
            kernels.expert_mlp(x, s, gt, w1, w2)
        out["no_host_sync"] = True
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    y0 = small_batch.expert_mlp_small_batch(x[:0], s[:0], gt[:0], w1, w2)
    out["zero_rows_ok"] = tuple(y0.shape) == (0, hidden)
    log(f"no host sync: {out['no_host_sync']}, R=0 ok: {out['zero_rows_ok']}")
    return out


def time_graph(fn, sets, device, reps):
    """Median ms per call: a graph of NSETS calls (one per input set), replayed `reps` times."""
    with torch.no_grad():
        for x, s, g in sets:  # warm-up / compile outside the capture
            fn(x, s, g)
        sync(device)
        graph = torch.cuda.CUDAGraph()
        keep = []
        with torch.cuda.graph(graph):
            for x, s, g in sets:
                keep.append(fn(x, s, g))
        graph.replay()
        sync(device)
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / len(sets))
    del graph, keep
    return statistics.median(times)


def time_eager(fn, sets, device, reps):
    with torch.no_grad():
        for x, s, g in sets:
            fn(x, s, g)
        sync(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            for x, s, g in sets:
                fn(x, s, g)
            if device.type == "cuda":
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / len(sets))
            else:
                times.append((time.perf_counter() - t0) * 1e3 / len(sets))
    return statistics.median(times)


def copy_gbps(device, log):
    n = 1 << 29  # 1 GiB of bf16
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    ev = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ev.append(s.elapsed_time(e))
    ms = statistics.median(ev)
    gbps = 2 * a.numel() * a.element_size() / ms / 1e6
    log(f"copy: {gbps:.0f} GB/s (1 GiB read + 1 GiB written, {ms:.3f} ms)")
    return gbps


def input_sets(rows, hidden, experts, top_k, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return [make_inputs(rows, hidden, experts, top_k, device, torch.bfloat16, g) for _ in range(NSETS)]


def distinct_experts(sets):
    return statistics.mean(len(torch.unique(s[s >= 0])) for _, s, _ in sets)


def sweep(w1, w2, args, device, log):
    hidden, experts = w1.shape[2], w1.shape[0]
    fns = variants(w1, w2)
    out = {}
    for kernel, configs in SWEEP.items():
        fn = fns["gate_up" if kernel == "small_gate_up" else "small"]
        best = None
        for cfg in configs:
            kcfg.override(kernel, cfg)
            ms = {}
            for rows in args.sweep_rows:
                ms[rows] = time_graph(
                    fn, input_sets(rows, hidden, experts, args.top_k, device, rows), device, args.reps
                )
            total = sum(ms.values())
            log(f"sweep {kernel} {cfg}: " + ", ".join(f"R={r} {v * 1e3:.1f} us" for r, v in ms.items()))
            out.setdefault(kernel, []).append({"config": cfg.__dict__, "ms": ms})
            if best is None or total < best[0]:
                best = (total, cfg)
        kcfg.override(kernel, best[1])
        log(f"sweep {kernel}: kept {best[1]}")
        out[kernel + "_kept"] = best[1].__dict__
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write JSON details here")
    ap.add_argument("--rows", default="1,4,8,16,32,64,128", help="R values to time")
    ap.add_argument("--check-rows", default="1,8,64", help="R values to check against fp32")
    ap.add_argument("--sweep", action="store_true", help="time a few tile configs first, keep the fastest")
    ap.add_argument("--sweep-rows", default="1,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    args.check_rows = [int(r) for r in args.check_rows.split(",")]
    args.sweep_rows = [int(r) for r in args.sweep_rows.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hidden, experts, ffn = (64, 16, 32) if args.tiny else (2048, 64, 1024)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        **run_record(1, device.type == "cuda"),
        "shape": {"H": hidden, "E": experts, "F": ffn, "K": args.top_k},
    }
    log(f"device {result['device']}, torch {torch.__version__}, H={hidden} E={experts} F={ffn} K={args.top_k}")
    w1, w2 = make_weights(hidden, experts, ffn, device, torch.bfloat16, 0)
    result["check"] = check(w1, w2, args, device, log)
    if device.type != "cuda":
        return 0
    result["copy_GBps"] = copy = copy_gbps(device, log)
    if args.sweep:
        result["sweep"] = sweep(w1, w2, args, device, log)
    expert_bytes = 3 * hidden * ffn * w1.element_size()
    rows_out = {}
    for rows in args.rows:
        sets = input_sets(rows, hidden, experts, args.top_k, device, 100 + rows)
        n_exp = distinct_experts(sets)
        cell = {"distinct_experts": n_exp, "bytes": n_exp * expert_bytes}
        for name, fn in variants(w1, w2).items():
            nbytes = n_exp * expert_bytes * (2 / 3 if name == "gate_up" else 1)
            try:
                g_ms = None if name == "torch" else time_graph(fn, sets, device, args.reps)
                e_ms = time_eager(fn, sets, device, max(5, args.reps // 2))
            except Exception as exc:  # noqa: BLE001 - report and go on
                log(f"R={rows} {name}: failed: {exc!r}")
                continue
            cell[name] = {
                "graph_us": g_ms and g_ms * 1e3,
                "eager_us": e_ms * 1e3,
                "graph_GBps": g_ms and nbytes / g_ms / 1e6,
                "floor_us": nbytes / copy / 1e3,
            }
            log(f"R={rows} {name}: graph {cell[name]['graph_us'] or float('nan'):.1f} us, eager {e_ms * 1e3:.1f} us")
        rows_out[rows] = cell
    result["rows"] = rows_out
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    log("")
    log(f"{result['device']}, copy {copy:.0f} GB/s; per call (one layer), us; GB/s = expert bytes / graph time")
    log(
        "| R | experts | MB | floor | small graph (GB/s, % copy) | small_row graph | grouped graph | gate_up alone "
        "(GB/s) | eager: small / grouped / torch |"
    )
    log("|---|---|---|---|---|---|---|---|---|")
    for rows, c in rows_out.items():

        def g(name, key="graph_us"):
            return c.get(name, {}).get(key) or float("nan")

        log(
            f"| {rows} | {c['distinct_experts']:.1f} | {c['bytes'] / 1e6:.0f} | {c['bytes'] / copy / 1e3:.1f} | "
            f"{g('small'):.1f} ({g('small', 'graph_GBps'):.0f}, {100 * g('small', 'graph_GBps') / copy:.0f}%) | "
            f"{g('small_row'):.1f} | {g('grouped'):.1f} | {g('gate_up'):.1f} ({g('gate_up', 'graph_GBps'):.0f}) | "
            f"{g('small', 'eager_us'):.0f} / {g('grouped', 'eager_us'):.0f} / {g('torch', 'eager_us'):.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
