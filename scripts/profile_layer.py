"""Where one MoE layer's forward time goes on one GPU: kernels vs host gaps, per dispatcher.

Runs `OccultMoE` on one rank under torch.profiler. Since issue 26 a one-rank layer takes the
identity schedule (`occult.moe.local`: routing, the experts, nothing else, no host wait), so this
now profiles that, the same for every dispatcher; the multi-rank path's host share
(plan, gathers, count exchange) needs two or more ranks. Prints, per variant: wall time per forward, GPU busy time, the idle gap
(wall - busy: host-bound time, e.g. launches after the host sync), and the top kernels.
Chrome traces go to --out.

    python scripts/profile_layer.py --tokens 8192 --out prof/      (GPU; bf16, OLMoE shape)
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from occult.moe.layer import OccultMoE
from occult.placement.cost import SHAPES
from occult.training.step_profile import union_ms


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (us): the library's `union_ms` in us."""
    return union_ms(intervals) * 1e3


def profile_variant(name: str, layer: OccultMoE, xs: list[torch.Tensor], iters: int, out: str | None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    def step(i: int) -> None:
        with torch.no_grad():
            layer(xs[i % len(xs)])

    for i in range(5):
        step(i)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            step(i)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / iters
    # the largest idle gaps of the GPU inside one forward (the last profiled), kernel before -> after
    last = sorted(kernels, key=lambda e: e.time_range.start)[-len(kernels) // iters :]
    gaps = sorted(
        ((b.time_range.start - a.time_range.end, a.name, b.name) for a, b in zip(last, last[1:])), reverse=True
    )[:8]
    per_kernel: dict[str, float] = {}
    for e in kernels:
        per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.time_range.elapsed_us() / iters
    if out:
        prof.export_chrome_trace(os.path.join(out, f"trace_{name}.json"))
    wall = statistics.median(times)
    return {
        "variant": name,
        "wall_ms": wall,
        "gpu_busy_ms": busy_us / 1e3,
        "idle_ms": wall - busy_us / 1e3,
        "kernels_per_forward": len(kernels) / iters,
        "top": sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12],
        "gaps": gaps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="olmoe", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None, help="folder for chrome traces")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_layer.py needs a GPU")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    shape = SHAPES[args.shape]
    dev = torch.device("cuda")
    xs = [torch.randn(args.tokens, shape.hidden, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    rows = []
    for dispatcher in ("standard", "dedup"):
        torch.manual_seed(0)
        layer = OccultMoE(
            shape.hidden, shape.ffn, shape.experts, shape.top_k, dispatcher=dispatcher, dtype=torch.bfloat16, device=dev
        )
        rows.append(profile_variant(dispatcher, layer, xs, args.iters, args.out))
        del layer
    for r in rows:
        print(f"\n{r['variant']}: top kernels (us per forward)")
        for k, v in r["top"]:
            print(f"  {v:9.1f}  {k[:110]}")
        print("  largest GPU idle gaps in one forward (us): kernel before -> kernel after")
        for gap, a, b in r["gaps"]:
            print(f"  {gap:9.1f}  {a[:50]} -> {b[:50]}")
    print(f"\n{'variant':<14}{'wall ms':>9}{'GPU busy':>10}{'idle':>8}{'kernels':>9}")
    for r in rows:
        print(
            f"{r['variant']:<14}{r['wall_ms']:>9.3f}{r['gpu_busy_ms']:>10.3f}{r['idle_ms']:>8.3f}{r['kernels_per_forward']:>9.0f}"
        )


if __name__ == "__main__":
    main()
