"""Where an expert-parallel MoE layer call's time goes on 2+ GPUs: host time, GPU busy, host ops.

Run under torchrun, one rank per GPU. For each transport (the device transport and the count
exchange) and token count, rank 0 prints: the wall time of a forward (GPU-bound or host-bound),
the host's time to issue it on an idle GPU, the GPU busy time (union of kernel intervals) per
forward, and the host ops that cost the most CPU time (torch.profiler's self CPU time), so the
host share of a layer call can be read off directly. JSON with every row to --out.

    torchrun --nproc-per-node 2 scripts/profile_ep_layer.py --tokens 512,8192 --out prof.json
    torchrun --nproc-per-node 2 scripts/profile_ep_layer.py --train --transports device,device+graphs

`--train` times training calls instead: the host's time to issue a forward and a backward, each on an
idle GPU, the wall time of back-to-back calls and the GPU busy time (`+graphs`: with `train_graphs`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from occult.distributed import finish_distributed, init_distributed
from occult.moe.layer import OccultMoE
from occult.placement.cost import SHAPES
from occult.tools.bench_timing import host_ms
from occult.tools.run_record import run_record
from occult.training.step_profile import device_work, union_ms


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (us): the library's `union_ms` in us."""
    return union_ms(intervals) * 1e3


def wall_ms(fn, iters: int) -> float:
    """Back-to-back calls: the time per call once the host and GPU are both busy."""
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


def profile_row(layer: OccultMoE, x: torch.Tensor, iters: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():

        def fn():
            layer(x)

        for _ in range(3):
            fn()
        row = {"host_ms": host_ms(fn, x.device, iters), "wall_ms": wall_ms(fn, iters)}
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end) for e in device_work(prof.events())]
    row["gpu_busy_ms"] = union_us(kernels) / 1e3 / iters
    ops = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:12]
    row["top_host_ops"] = [(a.key, round(a.self_cpu_time_total / 1e3 / iters, 3), a.count // iters) for a in ops]
    gpu = sorted(prof.key_averages(), key=lambda a: getattr(a, "self_device_time_total", 0), reverse=True)[:8]
    row["top_kernels"] = [
        (a.key[:90], round(getattr(a, "self_device_time_total", 0) / 1e3 / iters, 3), a.count // iters) for a in gpu
    ]
    return row


def train_row(layer: OccultMoE, x: torch.Tensor, iters: int) -> dict:
    """A training call (forward, then backward of a fixed random output gradient): the host's time to
    issue each on an idle GPU (medians, every rank starting together), the wall time of back-to-back
    calls and the GPU busy time per call."""
    from torch.profiler import ProfilerActivity, profile

    x = x.detach().requires_grad_(True)
    grad_y = torch.randn_like(x)

    def call():
        layer(x).backward(grad_y)

    for _ in range(4):  # eager calls, then the capture where graphs are on (occult.moe.graphs.EAGER_CALLS)
        call()
    forward, backward = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        y = layer(x)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        dist.barrier()
        t2 = time.perf_counter()
        y.backward(grad_y)
        forward.append((t1 - t0) * 1e3)
        backward.append((time.perf_counter() - t2) * 1e3)
    row = {
        "host_forward_ms": statistics.median(forward),
        "host_backward_ms": statistics.median(backward),
        "wall_ms": wall_ms(call, iters),
        "graphs_held": len(layer.graphs),
    }
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end) for e in device_work(prof.events())]
    row["gpu_busy_ms"] = union_us(kernels) / 1e3 / iters
    # a fresh leaf: the profiled calls above left their backward-range hooks on `x` (occult.moe.host_time)
    row["host_functions"] = host_functions(layer, x.detach().requires_grad_(True), grad_y, iters)
    return row


def host_functions(layer: OccultMoE, x: torch.Tensor, grad_y: torch.Tensor, iters: int) -> dict:
    """Where a training call's host time goes, forward and backward apart: the Python functions with the
    most own time per call (cProfile, each call issued on an idle GPU), as [name, us per call, calls per call]."""
    import cProfile
    import pstats

    profilers = {"forward": cProfile.Profile(), "backward": cProfile.Profile()}
    for _ in range(iters):  # each call a replay where graphs are on (the previous output's backward done)
        torch.cuda.synchronize()
        profilers["forward"].enable()
        y = layer(x)
        profilers["forward"].disable()
        torch.cuda.synchronize()
        profilers["backward"].enable()
        y.backward(grad_y)
        profilers["backward"].disable()
        del y
    found = {}
    for phase, profiler in profilers.items():
        stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, _)
        top = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:25]
        found[phase] = [
            [f"{key[2]} ({key[0].rsplit('/', 2)[-1]}:{key[1]})", round(v[2] / iters * 1e6, 1), round(v[0] / iters, 2)]
            for key, v in top
        ]
    torch.cuda.synchronize()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="olmoe", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="512,8192", help="comma list of tokens per rank (default 512,8192)")
    parser.add_argument(
        "--transports",
        default="device,counts",
        help="comma list of device, counts, device+graphs (the device transport with "
        "ExecConfig(graphs=True): forwards replayed from the layer's CUDA graphs) (default device,counts)",
    )
    parser.add_argument("--dispatcher", default="dedup", help="standard or dedup (default dedup)")
    parser.add_argument(
        "--train",
        action="store_true",
        help="time training calls (forward + backward): host time of each, wall, GPU busy (no op table)",
    )
    parser.add_argument("--iters", type=int, default=20, help="calls per measurement (default 20)")
    parser.add_argument("--out", default=None, help="JSON file for every row (default: none)")
    args = parser.parse_args()
    rank, world = init_distributed()
    shape = SHAPES[args.shape]
    rows = []
    ok = False
    try:
        for choice in args.transports.split(","):
            transport, _, graphs = choice.partition("+")
            torch.manual_seed(0)
            layer = OccultMoE(
                shape.hidden,
                shape.ffn,
                shape.experts,
                shape.top_k,
                dtype=torch.bfloat16,
                dispatcher=args.dispatcher,
                transport=transport,
                graphs=graphs == "graphs",
                train_graphs=args.train and graphs == "graphs",  # --train: training calls replayed too
                device="cuda",
            )
            for tokens in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(tokens, shape.hidden, dtype=torch.bfloat16, device="cuda")
                if args.train:
                    row = {"transport": choice, "tokens": tokens, **train_row(layer, x, args.iters)}
                    rows.append(row)
                    if rank == 0:
                        print(
                            f"{choice:<14}{tokens:>6}  train: wall {row['wall_ms']:.2f} ms  host forward "
                            f"{row['host_forward_ms']:.3f} ms  host backward {row['host_backward_ms']:.3f} ms  "
                            f"gpu busy {row['gpu_busy_ms']:.2f} ms  graphs {row['graphs_held']}",
                            flush=True,
                        )
                        for phase, top in row["host_functions"].items():
                            for name, us, calls in top[:12]:
                                print(f"      {phase:<8} {us:8.1f} us  x{calls:<5} {name}", flush=True)
                    continue
                row = {"transport": choice, "tokens": tokens, **profile_row(layer, x, args.iters)}
                rows.append(row)
                if rank == 0:
                    print(
                        f"{row['transport']:<14}{tokens:>6}  wall {row['wall_ms']:.2f} ms  host {row['host_ms']:.2f} "
                        f"ms  gpu busy {row['gpu_busy_ms']:.2f} ms",
                        flush=True,
                    )
                    for key, ms, count in row["top_host_ops"]:
                        print(f"      host {ms:8.3f} ms  x{count:<4} {key}", flush=True)
                    for key, ms, count in row["top_kernels"]:
                        print(f"      gpu  {ms:8.3f} ms  x{count:<4} {key}", flush=True)
        if rank == 0 and args.out:
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "world": world,
                        "shape": args.shape,
                        "device": torch.cuda.get_device_name(0),
                        **run_record(world, True),
                        "rows": rows,
                    },
                    f,
                    indent=1,
                )
        ok = True
    finally:
        finish_distributed(ok)


if __name__ == "__main__":
    main()
