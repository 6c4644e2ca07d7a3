"""AdamW's step alone, on a model's parameters: torch's fused kernel against occult's (`occult.training.optim.AdamW`).

The step reads and writes every parameter and both moments once (14 bytes per bf16 parameter): on one GPU about a
fifth of a training step at OLMoE's shape (docs/training.md, "The optimizer step"). On the e2e.py model (random
weights, --layers), with random gradients, one optimizer of each kind over the same parameters (each with its own
moments), in alternated rounds of CUDA-event medians; GB/s against a measured copy ceiling (one large
device-to-device copy, read + write). Before timing, both optimizers step fp32 copies of every tensor shape from one
start with the same gradients (agreement to fp32 rounding), and bf16 ones against an fp32 run (error of each).
Also the host time of one step from an idle GPU.

    python3 benchmarks/bench_adamw.py --layers 16 --out adamw.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import e2e  # benchmarks/e2e.py: the model
import torch
from _timing import cuda_ms, write_json

from occult.tools.run_record import run_record
from occult.training.optim import AdamW

HYPER = {"lr": 1e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}


def host_ms(fn, iters: int) -> float:
    """Median host ms of fn() from an idle GPU."""
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return statistics.median(out)


def agreement(shapes: list[torch.Size], device: torch.device) -> dict[str, float]:
    """Both optimizers on fresh tensors of `shapes` (the largest at most 4M elements, so this stays small), 3 steps
    from one start with the same gradients: max |difference| / max |value| in fp32, and in bf16 each one's error
    against the fp32 run of the same optimizer type (torch)."""
    gen = torch.Generator(device).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    shapes = sorted({(min(s.numel() // s[-1], 2048), s[-1]) for s in shapes})
    starts = [torch.randn(s, generator=gen, device=device) for s in shapes]
    grads = [[torch.randn(t.shape, generator=gen, device=device) for t in starts] for _ in range(3)]

    def run(kind, dtype):
        params = [t.to(dtype).clone().requires_grad_() for t in starts]
        opt = (AdamW if kind == "occult" else torch.optim.AdamW)(params, fused=True, **HYPER)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.to(dtype)
            opt.step()
        return [p.detach().float() for p in params]

    def rel(a, b):
        return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))

    ref = run("torch", torch.float32)
    return {
        "fp32_occult_vs_torch": rel(run("occult", torch.float32), ref),
        "bf16_torch_vs_fp32": rel(run("torch", torch.bfloat16), ref),
        "bf16_occult_vs_fp32": rel(run("occult", torch.bfloat16), ref),
    }


def block_sweep(optimizer: AdamW, iters: int) -> dict[str, float]:
    """occult's step (median ms) at other block sizes and warp counts of its kernel (`kernels.config`'s "adamw")."""
    from occult.kernels import config

    out = {}
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)):
        config.override("adamw", block_m=block, num_warps=warps)
        optimizer.step()  # compiles
        out[f"{block}x{warps}"] = statistics.median(cuda_ms(optimizer.step, iters))
        print(f"  block {block}, {warps} warps: {out[f'{block}x{warps}']:.2f} ms", flush=True)
    config.override("adamw")
    return out


def model_shapes(args: argparse.Namespace) -> list[torch.Size]:
    """The parameter shapes of the e2e.py model (built on the meta device: no memory, no distributed group)."""
    from transformers import AutoModelForCausalLM

    eargs = e2e.parse_args(["--model", args.model, "--layers", str(args.layers)])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(e2e.model_config(eargs), dtype=torch.bfloat16)
    return [p.shape for p in model.parameters()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="olmoe", choices=sorted(e2e.MODELS))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time occult's step at other kernel block sizes and warps")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_adamw.py times CUDA kernels: run it on a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    params = [torch.randn(s, dtype=torch.bfloat16, device=device).requires_grad_() for s in model_shapes(args)]
    checks = agreement([p.shape for p in params], device)
    print("agreement:", {k: f"{v:.2e}" for k, v in checks.items()}, flush=True)
    for q in params:
        q.grad = torch.randn_like(q)
    numel = sum(q.numel() for q in params)
    optimizers = {"torch": torch.optim.AdamW(params, fused=True, **HYPER), "occult": AdamW(params, fused=True, **HYPER)}
    for opt in optimizers.values():  # state made, kernels compiled
        opt.step()
    size = 1 << 31  # a 4 GiB bf16 copy: the ceiling
    src, dst = (
        torch.empty(size, dtype=torch.bfloat16, device=device),
        torch.empty(size, dtype=torch.bfloat16, device=device),
    )
    rounds = {name: [] for name in (*optimizers, "copy")}
    for _ in range(args.rounds):  # alternated: drift hits every measurement
        for name, opt in optimizers.items():
            rounds[name].append(statistics.median(cuda_ms(opt.step, args.iters)))
        rounds["copy"].append(statistics.median(cuda_ms(lambda: dst.copy_(src), args.iters)))
    ms = {name: statistics.median(v) for name, v in rounds.items()}
    bytes_step = numel * params[0].element_size() * 7  # parameter, gradient, 2 moments read; 3 written
    copy_gbs = 2 * size * 2 / ms["copy"] / 1e6
    rates = {name: bytes_step / ms[name] / 1e6 for name in optimizers}
    hosts = {name: host_ms(opt.step, 5) for name, opt in optimizers.items()}
    sweep = block_sweep(optimizers["occult"], args.iters) if args.sweep else {}
    print(
        f"{args.model}, {args.layers} layers, {numel / 1e9:.2f} B parameters, {len(params)} tensors, "
        f"{bytes_step / 1e9:.1f} GB a step; copy ceiling {copy_gbs:.0f} GB/s",
        flush=True,
    )
    print("| AdamW step | ms | GB/s | of copy | host ms |\n|---|---|---|---|---|")
    for name in optimizers:
        print(
            f"| {name} | {ms[name]:.2f} | {rates[name]:.0f} | {100 * rates[name] / copy_gbs:.0f}% | {hosts[name]:.2f} |"
        )
    print(f"torch / occult: {ms['torch'] / ms['occult']:.3f}x", flush=True)
    if args.out:
        write_json(
            args.out,
            {
                "config": vars(args),
                "parameters": numel,
                "tensors": len(params),
                "bytes_per_step": bytes_step,
                "ms": ms,
                "rounds": rounds,
                "gb_per_s": rates,
                "copy_gb_per_s": copy_gbs,
                "host_ms": hosts,
                "agreement": checks,
                "sweep_ms": sweep,
                "env": {"gpu": torch.cuda.get_device_name(), **run_record(1, True)},
            },
        )


if __name__ == "__main__":
    main()
