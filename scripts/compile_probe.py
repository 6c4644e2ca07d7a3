"""Does torch.compile cut the host time of one MoE layer? Eager vs compiled plan vs compiled layer.

One GPU, OLMoE shape, bf16: median forward and forward+backward (CUDA events) of `OccultMoE`
(standard and dedup) with (a) everything eager, (b) the dispatch plan compiled
(`torch.compile(dynamic=True)`), (c) the whole layer compiled (graph breaks at the host sync,
the all-to-alls and the Triton op). Outputs are checked against eager first.

    python scripts/compile_probe.py [--tokens 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import occult.moe.dispatch as dispatch_module
from occult.moe.layer import OccultMoE
from occult.moe.plan import dedup_plan, standard_plan
from occult.placement.cost import SHAPES


def timed(fn, iters: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--shape", default="olmoe")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    dev = torch.device("cuda")
    xs = [torch.randn(args.tokens, shape.hidden, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    g = torch.randn(args.tokens, shape.hidden, device=dev, dtype=torch.bfloat16)
    rows = []
    for dispatcher in ("standard", "dedup"):
        torch.manual_seed(0)
        layer = OccultMoE(
            shape.hidden, shape.ffn, shape.experts, shape.top_k, dispatcher=dispatcher, dtype=torch.bfloat16, device=dev
        )
        with torch.no_grad():
            ref = layer(xs[0])
        state = {"i": 0}

        def fwd(model):
            def run():
                state["i"] += 1
                with torch.no_grad():
                    model(xs[state["i"] % 3])

            return run

        def step(model):
            def run():
                state["i"] += 1
                model(xs[state["i"] % 3].requires_grad_(False)).backward(g)

            return run

        for mode in ("eager", "plan compiled", "layer compiled"):
            dispatch_module.standard_plan, dispatch_module.dedup_plan = standard_plan, dedup_plan
            model = layer
            t0 = time.perf_counter()
            if mode == "plan compiled":
                dispatch_module.standard_plan = torch.compile(standard_plan, dynamic=True)
                dispatch_module.dedup_plan = torch.compile(dedup_plan, dynamic=True)
            elif mode == "layer compiled":
                model = torch.compile(layer, dynamic=True)
            try:
                with torch.no_grad():
                    out = model(xs[0])
                model(xs[1]).backward(g)
                compile_s = time.perf_counter() - t0
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                f, s = timed(fwd(model)), timed(step(model))
                rows.append((dispatcher, mode, f, s, err, compile_s))
            except Exception as exc:  # report, go on
                rows.append((dispatcher, mode, float("nan"), float("nan"), float("nan"), 0.0))
                print(f"{dispatcher} {mode}: {type(exc).__name__}: {str(exc)[:300]}")
            layer.zero_grad(set_to_none=True)
    dispatch_module.standard_plan, dispatch_module.dedup_plan = standard_plan, dedup_plan
    print(f"{'dispatcher':<10}{'mode':<16}{'fwd ms':>8}{'fwd+bwd':>9}{'rel err':>9}{'first s':>9}")
    for d, m, f, s, e, c in rows:
        print(f"{d:<10}{m:<16}{f:>8.3f}{s:>9.3f}{e:>9.1e}{c:>9.1f}")


if __name__ == "__main__":
    main()
