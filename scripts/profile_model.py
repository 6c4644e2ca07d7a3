"""Where a whole transformers MoE model's step goes (one GPU, or expert parallel): kernel families, idle, overlap.

Builds the random OLMoE-1B-7B-shape model of `benchmarks/e2e.py` (fewer layers with --layers),
then, per variant (`native`: unconverted; `occult`: converted over a one-rank group, dedup) and
phase (`prefill`: 4 x 2048 tokens, logits of the last position; `train`: forward + backward;
`decode`: one B-row step of `hf.StaticDecoder`, graph-captured for occult with sync-free dispatch,
eager for native; an e2e.py `/graph`, `/twobatch` or `/interleaveK` variant's prefill replayed from its CUDA
graph as e2e.py times it, and no train phase; a `/stepgraph` variant's training step replayed from its CUDA
graph, two interleaved halves for `/stepgraph/twobatch`; a `torchtitan*` variant's prefill and train step as e2e.py
runs TorchTitan's model), profiles a
few steps under torch.profiler and prints (per step): the
exchanges' kernels busy (NCCL's, the device transport's push and barrier), every other kernel busy, and both at
once (the part of the all-to-alls hidden under compute), then: wall ms per step (CUDA
events), GPU busy ms (union of kernel intervals), idle = wall - busy (the host-bound share),
kernels per step, and time per kernel family (matmul, attention, occult Triton, elementwise).
The top kernels go to --out as JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 1 scripts/profile_model.py \
        --layers 4 --phases prefill,train,decode --out prof/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import e2e  # noqa: E402  (benchmarks/e2e.py: the model and its conversion)
import tt_model  # noqa: E402  (benchmarks/tt_model.py: TorchTitan's model, e2e.py's torchtitan* variants)
from _timing import time_steps  # noqa: E402  (benchmarks/_timing.py: CUDA-event step times)

from occult import set_sync_free  # noqa: E402
from occult.distributed import init_distributed  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.integrations.hf.block import is_converted  # noqa: E402
from occult.tools.run_record import run_record  # noqa: E402
from occult.training.step_graph import WARMUP_STEPS  # noqa: E402
from occult.training.step_profile import device_work, is_exchange, overlap_ms, union_ms  # noqa: E402

FAMILIES = (  # (family, substrings of kernel names), first match wins; occult's Triton kernels are `_name_kernel`
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "grouped_mm")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("copy/index", ("copy", "memcpy", "fill", "memset", "cat", "index", "scatter", "gather")),
    ("elementwise/reduce", ("elementwise", "reduce", "softmax", "topk", "sort", "scan")),
)


def family_of(name: str) -> str:
    if name.startswith("_") and not name.startswith("_Z"):
        return "occult triton"
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def profile_steps(step, steps: int, trace_path: str | None = None) -> dict:
    """Time `steps` calls with CUDA events, then profile as many; kernel statistics per step (and the
    profiler's timeline, gzipped JSON for chrome://tracing or Perfetto, at `trace_path`)."""
    from torch.profiler import ProfilerActivity, profile

    times = time_steps(lambda _: step(), lambda: None, 3, steps, torch.device("cuda", torch.cuda.current_device()))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if trace_path:
        import gzip

        prof.export_chrome_trace(trace_path)
        with open(trace_path, "rb") as src, gzip.open(trace_path + ".gz", "wb") as dst:
            dst.write(src.read())
        os.remove(trace_path)
    kernels = device_work(prof.events())  # (not the device's copies of host ranges: they span idle gaps)
    busy = union_ms([(e.time_range.start, e.time_range.end) for e in kernels]) / steps  # us intervals -> ms
    spans = {True: [], False: []}  # the exchanges' kernels, every other kernel
    for e in kernels:
        spans[is_exchange(e.name)].append((e.time_range.start, e.time_range.end))
    per_kernel: dict[str, list[float]] = {}
    for e in kernels:
        entry = per_kernel.setdefault(e.name, [0.0, 0])
        entry[0] += e.time_range.elapsed_us() / steps
        entry[1] += 1 / steps
    fams: dict[str, list[float]] = {}
    for name, (us, n) in per_kernel.items():
        f = fams.setdefault(family_of(name), [0.0, 0])
        f[0] += us
        f[1] += n
    wall = statistics.median(times)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:40]
    return {
        "wall_ms": wall,
        "busy_ms": busy,
        "idle_ms": wall - busy,
        "kernels": len(kernels) / steps,
        "exchange_ms": union_ms(spans[True]) / steps,  # all-to-all kernels busy
        "compute_ms": union_ms(spans[False]) / steps,  # every other kernel busy
        "exchange_under_compute_ms": overlap_ms(spans[True], spans[False]) / steps,  # both at once
        "families": {k: {"ms": v[0] / 1e3, "count": v[1]} for k, v in fams.items()},
        "top": [{"name": n[:160], "us": v[0], "count": v[1]} for n, v in top],
    }


def phase_step(model, phase: str, args, eargs, device, variant: str = "occult"):
    """One step of `phase` as benchmarks/e2e.py times it for `variant` (a train step with the optimizer and loss
    e2e.py gives that variant: `e2e.train_optimizer`, `e2e.train_loss`): a `/graph`, `/twobatch` or `/interleaveK`
    prefill replayed from its CUDA graph (`hf.GraphedForward`, K interleaved micro-batches for `/interleaveK`), other
    steps eager."""
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    if phase == "prefill" and e2e.is_graphed(variant):
        graphed, _ = e2e.graphed_step(model, args, vocab, device, e2e.micro_batches(variant))
        return lambda: graphed(e2e.random_ids(args.batch, args.seq, vocab, device, gen))
    if phase in ("prefill", "train"):
        optimizer = None
        if phase == "train":
            optimizer = e2e.train_optimizer(model, variant, eargs, device)
            e2e.train_loss(model, variant, eargs)
        captured = phase == "train" and e2e.step_graph(variant)
        halves = e2e.micro_batches(variant) if captured else 1  # `/stepgraph/twobatch`: the step's two halves
        accumulate = args.accumulate if phase == "train" else 1  # (a `/1f1b` variant pairs them)
        full = e2e.make_step(
            model, phase, optimizer, captured, halves, args.dense_sync, accumulate, e2e.paired(variant)
        )
        for _ in range(WARMUP_STEPS + 1 if captured else 0):  # a `/stepgraph` step's warm-ups and recording
            full(e2e.random_ids(args.batch, args.seq, vocab, device, gen))
        return lambda: full(e2e.random_ids(args.batch, args.seq, vocab, device, gen))
    model.eval()
    B = args.decode_batch
    decoder = hf.StaticDecoder(model, B, args.prompt + 64)
    ids = e2e.random_ids(B, args.prompt, vocab, device, gen)
    decoder.prefill(ids, torch.ones_like(ids))
    if args.graph and is_converted(model):
        decoder.capture()
    next_B = ids[:, -1].clone()

    def step():
        if decoder.free_slots < 2:
            decoder.prefill(ids, torch.ones_like(ids))
        decoder.step(next_B)

    return step


def is_titan(variant: str) -> bool:
    """Whether `variant` is one of e2e.py's TorchTitan models (its own, or with occult's dispatcher inside)."""
    return e2e.base_variant(variant) in tt_model.VARIANTS


def titan_step(model, phase: str, args, eargs, vocab: int, device, variant: str):
    """One prefill or train step of a TorchTitan variant as e2e.py times it (its optimizer, its loss; `/stepgraph`:
    the forward+backward recorded, on its third call and after)."""
    optimizer = model.optimizer(eargs.optimizer, eargs.lr) if phase == "train" else None
    step = tt_model.make_step(model, phase, optimizer, e2e.step_graph(variant))
    gen = torch.Generator().manual_seed(1)
    return lambda: step(e2e.random_ids(args.batch, args.seq, vocab, device, gen))


def profile_variant(
    variant: str,
    args: argparse.Namespace,
    eargs: argparse.Namespace,
    cfg: Any,
    device: torch.device,
    self_group: Any,
    results: dict,
) -> None:
    """Profile every phase of one variant into `results` (rank 0 prints each)."""
    rank = torch.distributed.get_rank()
    titan = is_titan(variant)
    if titan:
        model = e2e.build_titan(variant, eargs, cfg, device, torch.bfloat16, None)
    else:
        model = e2e.build_model(eargs, cfg, device, torch.bfloat16)
        model = e2e.convert_variant(model, "replicated" if variant == "occult" else variant, None, self_group)
    for phase in args.phases.split(","):
        if variant == "occult":
            set_sync_free(model, phase == "decode")
        trace = None
        if args.out and args.traces:
            os.makedirs(args.out, exist_ok=True)
            trace = os.path.join(args.out, trace_name(variant, phase, rank))
        if phase == "train" and e2e.is_graphed(variant) and not e2e.step_graph(variant):
            continue  # a captured prefill only, as e2e.py times it
        if titan and phase == "decode":
            continue  # (TorchTitan's model has no decoder: e2e.py times its prefill and train only)
        if titan:
            step = titan_step(model, phase, args, eargs, cfg.vocab_size, device, variant)
        else:
            step = phase_step(model, phase, args, eargs, device, variant)
        results[f"{variant}/{phase}"] = r = profile_steps(step, args.steps, trace)
        if titan and e2e.step_graph(variant):
            tt_model.release_recordings()  # (TorchTitan keeps a recording, and its memory, until its teardown)
        if rank:
            continue
        print(
            f"{variant}/{phase}: wall {r['wall_ms']:.2f} ms, busy {r['busy_ms']:.2f}, idle {r['idle_ms']:.2f}, "
            f"kernels {r['kernels']:.0f}; exchanges {r['exchange_ms']:.2f} ms, compute {r['compute_ms']:.2f}, "
            f"both at once {r['exchange_under_compute_ms']:.2f}",
            flush=True,
        )
        for t in r["top"][:12]:
            print(f"   {t['us']:9.1f} us {t['count']:6.0f}x  {t['name'][:100]}")


def titan_unavailable(args: argparse.Namespace, titans: list[str], model_type: str) -> str | None:
    """Why these TorchTitan variants cannot be profiled as asked (of a `model_type` model), or None."""
    if any(e2e.base_variant(v).endswith("+placement") for v in titans):
        return "torchtitan+occult+placement: profile_model.py solves no placement; profile it with benchmarks/e2e.py"
    if args.accumulate > 1:
        return "--accumulate is not passed to TorchTitan's own train step: leave the torchtitan variants out"
    return tt_model.unavailable(model_type)


def trace_name(variant: str, phase: str, rank: int) -> str:
    """A run's timeline file name: the variant's '/' and '@' as '-' and '+' (names a copy tool keeps)."""
    return f"trace_{variant}_{phase}_rank{rank}.json".replace("/", "-").replace("@", "+")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="olmoe", choices=sorted(e2e.MODELS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--variants",
        default="native,occult",
        help="native, occult (converted over a one-rank group) or any benchmarks/e2e.py variant "
        "(e.g. replicated/compile, dedup@device/compile: expert parallel over every rank; torchtitan, "
        "torchtitan+occult+experts@syncfree/compile: TorchTitan's Qwen3-MoE, its prefill and train)",
    )
    p.add_argument("--phases", default="prefill,train,decode")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--decode-batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--no-graph", dest="graph", action="store_false", help="occult decode eager (sync-free still)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--dense-sync",
        choices=("after", "overlap"),
        default="after",
        help="a train step's replicated gradients all-reduced after the backward or during it (as e2e.py's flag)",
    )
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="a train step's --batch as this many micro-batches, in turn (paired for e2e.py's /1f1b variants)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--traces", action="store_true", help="also write each run's timeline under --out, per rank")
    args = p.parse_args()
    if args.accumulate < 1 or args.batch % args.accumulate:
        p.error(f"--accumulate {args.accumulate}: give a count >= 1 that divides --batch {args.batch}")
    if args.accumulate < 2 and any(e2e.paired(v) for v in args.variants.split(",")):
        p.error("/1f1b pairs a step's micro-batches: give --accumulate 2 or more")
    eargs = e2e.parse_args(
        ["--model", args.model, "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq)]
    )
    cfg = e2e.model_config(eargs)
    titans = [v for v in args.variants.split(",") if is_titan(v)]
    if titans and (reason := titan_unavailable(args, titans, cfg.model_type)):
        p.error(reason)
    if not torch.cuda.is_available():
        p.error("it profiles CUDA kernels and CUDA finds no GPU here: run it on a GPU machine")
    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device())
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    self_group = [torch.distributed.new_group([r]) for r in range(world)][rank]
    results = {}
    for variant in args.variants.split(","):
        with e2e.variant_settings(variant):  # (/deferwgrad: OCCULT_DEFER_WGRAD=1 while it is built and runs)
            profile_variant(variant, args, eargs, cfg, device, self_group, results)
        torch.cuda.empty_cache()
    if rank:
        return
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "world_size": world}
        with open(os.path.join(args.out, "profile_model.json"), "w") as f:  # the runs, and what ran them
            json.dump({**results, "env": {**env, **run_record(world, True)}}, f, indent=1)
    print(f"\n{args.model} shape, {args.layers} layers; per step (ms) and kernel families (ms / launches)")
    fams = sorted({f for r in results.values() for f in r["families"]})
    print(f"{'run':<18}{'wall':>8}{'busy':>8}{'idle':>8}{'kernels':>8}  " + "  ".join(f"{f:>22}" for f in fams))
    for name, r in results.items():
        cells = [
            f"{r['families'].get(f, {}).get('ms', 0):8.2f}/{r['families'].get(f, {}).get('count', 0):<6.0f}"
            for f in fams
        ]
        print(
            f"{name:<18}{r['wall_ms']:>8.2f}{r['busy_ms']:>8.2f}{r['idle_ms']:>8.2f}{r['kernels']:>8.0f}  "
            + "  ".join(f"{c:>22}" for c in cells)
        )


if __name__ == "__main__":
    main()
