"""`occult bench`: one MoE layer, standard vs dedup vs dedup+placement, on 1-N GPUs.

For each model shape and routing, every rank builds the same experts (bf16), checks every
variant's output against a float32 dense reference on a slice of tokens, then times forward
and forward+backward with CUDA events (warm-up, median, inputs rotated among fresh random
sets). Also measured in the same run: the ceilings (a large all_to_all_single and a large
bf16 matmul), the expert compute alone and the variant's all-to-alls alone, so each time is
reported against its floor. Runs on CPU too (gloo, small shapes) for a smoke test.

Here: the shapes, the routing and its placement, each rank's loop, and the checks made before any
rank starts (`check_variants`: what CPU ranks cannot run, dedup2 without nodes; `memory_need`:
sizes the machine cannot hold, `occult.tools.preflight`). One variant's measurement is
`occult.tools.bench_variant`.
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import numpy as np
import torch

from occult._atomic import write_text_atomic
from occult.distributed import pick_backend, run_ranks
from occult.moe.registry import capabilities
from occult.placement import Placement
from occult.placement.cost import SHAPES as MODEL_SHAPES
from occult.placement.cost import Shape
from occult.tools.bench_report import HEADER, LEGEND, format_row, summarize  # noqa: F401 (the report's names)
from occult.tools.bench_timing import ceilings, make_timer
from occult.tools.bench_variant import (  # noqa: F401 (re-exported: benchmarks/ use them from here)
    PresetRouter,
    bench_variant,
    dense_reference,
    variant_dispatcher,
    variant_graphs,
    variant_sync_free,
    variant_transport,
)
from occult.tools.preflight import MemoryNeed, check_fits, rank_failure
from occult.tools.run_record import run_record

# The model shapes are the cost model's (one table); `tiny` is for CPU smoke runs.
SHAPES: dict[str, Shape] = {
    **{name: MODEL_SHAPES[name] for name in ("olmoe", "qwen3", "deepseek", "mixtral")},
    "tiny": Shape("tiny", 64, 32, 16, 4),
}
VARIANTS = (
    "standard",
    "dedup",
    "dedup+placement",
    "dedup2",
    "standard@device",
    "dedup@device",
    "standard@device/graph",
    "dedup@device/graph",
    "dedup@syncfree/graph",
)


def routing_ids(kind: str, shape: Shape, world: int, tokens: int, seed: int) -> tuple[np.ndarray, Placement]:
    """All ranks' top-k ids [world*tokens, k] and the placement for them (same on every rank)."""
    from occult.placement import synthetic

    total = world * tokens
    if kind == "random":
        trace = synthetic.uniform_trace(total, shape.experts, shape.top_k, seed=seed)
        ids = trace.topk_ids[0]
    elif kind == "planted":
        groups = world if shape.experts // world >= shape.top_k else shape.experts // shape.top_k
        groups = max(groups - groups % world, world)
        planted = synthetic.planted_trace(total, shape.experts, shape.top_k, num_groups=groups, noise=0.2, seed=seed)
        ids = planted.trace.topk_ids[0]
    else:
        raise ValueError(f"unknown routing {kind!r}; use 'random' or 'planted'")
    return np.asarray(ids, dtype=np.int64), solve_placement_for(ids, shape, world)


def solve_placement_for(ids: np.ndarray, shape: Shape, world: int) -> Placement:
    """Place from the routing (hypergraph when Mt-KaHyPar is importable, else greedy)."""
    from occult.placement.solvers import best_method, place
    from occult.placement.trace import Trace

    sample = ids[:: max(1, len(ids) // 65536)]
    trace = Trace(topk_ids=[sample], num_experts=shape.experts, top_k=shape.top_k)
    return place(trace, world, method=best_method()).placement


def variant_placement(variant: str, solved: Placement, shape: Shape, world: int, nodes: int) -> Placement:
    """The placement a variant runs on: the solved one for 'dedup+placement', else contiguous (on
    `nodes` nodes for the two-level dispatch)."""
    if variant == "dedup+placement":
        return solved
    two_level = capabilities(variant_dispatcher(variant)).two_level
    return Placement.contiguous(shape.experts, world, num_nodes=nodes if two_level else 1)


def bench_worker(rank: int, world: int, args: dict) -> dict[str, Any]:
    """One rank of `occult bench`: every shape, token count, routing and variant, checked and timed."""
    device = torch.device("cuda", rank) if args["backend"] == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = make_timer(device)
    warmup, iters = args["warmup"], args["iters"]
    result: dict[str, Any] = {"ceilings": ceilings(device, world, timer), "runs": []}
    for shape_name in args["shapes"]:
        shape = SHAPES[shape_name]
        gen = torch.Generator(device="cpu").manual_seed(1234)
        w1_full = (torch.randn(shape.experts, 2 * shape.ffn, shape.hidden, generator=gen) / shape.hidden**0.5).to(
            device, dtype
        )
        w2_full = (torch.randn(shape.experts, shape.hidden, shape.ffn, generator=gen) / shape.ffn**0.5).to(
            device, dtype
        )
        gate_w = (torch.randn(shape.experts, shape.hidden, generator=gen) / shape.hidden**0.5).to(device, dtype)
        for tokens in args["tokens"]:
            for routing in args["routings"]:
                ids_all, placement = routing_ids(routing, shape, world, tokens * args["input_sets"], seed=7)
                ids_all = torch.as_tensor(ids_all, device=device).view(world, args["input_sets"], tokens, shape.top_k)
                ids_sets = ids_all[:, :, :, :][rank]
                xs = [torch.randn(tokens, shape.hidden, device=device, dtype=dtype) for _ in range(args["input_sets"])]
                gs = [torch.randn(tokens, shape.hidden, device=device, dtype=dtype) for _ in range(args["input_sets"])]
                for variant in args["variants"]:
                    layout = variant_placement(variant, placement, shape, world, args.get("nodes", 1))
                    weights = (w1_full, w2_full, gate_w)
                    run = bench_variant(
                        variant, shape, layout, *weights, xs, gs, ids_sets, timer, warmup, iters, world, device, args
                    )
                    run.update(shape=shape.name, tokens=tokens, routing=routing, variant=variant, world=world)
                    result["runs"].append(run)
                    if rank == 0 and args.get("verbose"):
                        print(format_row(run), flush=True)
                del xs, gs
        del w1_full, w2_full
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def check_variants(variants: list[str], on_gpu: bool, world: int, nodes: int, expert_backend: str) -> None:
    """Refuse (ValueError naming the flag) what the ranks could not run, before any starts:
    Triton or the device transport on CPU ranks, the two-level dispatch without nodes;
    warn about what would be ignored (CUDA graphs on CPU ranks, --nodes without dedup2)."""
    if expert_backend == "triton" and not on_gpu:
        raise ValueError(
            "--expert-backend triton runs the Triton kernels on CUDA GPUs, and these ranks are CPU (gloo): "
            "use --expert-backend torch (or auto)"
        )
    if expert_backend == "triton":
        from occult import kernels

        if not kernels.available():
            raise ValueError("--expert-backend triton: Triton cannot run here (pip install triton): use torch or auto")
    on_device = [v for v in variants if variant_transport(v) == "device"]
    if on_device and not on_gpu:
        raise ValueError(
            f"--variants {on_device[0]}: the device transport needs NCCL ranks on CUDA GPUs of one host, and "
            "these ranks are CPU (gloo): drop the @device variants"
        )
    two_level = [v for v in variants if capabilities(variant_dispatcher(v)).two_level]
    if two_level and world > 1 and nodes == 1:
        raise ValueError(
            f"--variants {two_level[0]} is the two-level dispatch over nodes: give --nodes M (M >= 2 dividing the "
            f"{world} ranks; on one host the nodes are simulated), e.g. --nodes 2"
        )
    if nodes > 1 and not two_level:
        warnings.warn(
            f"--nodes {nodes} is used by the dedup2 variant only: ignored by --variants {','.join(variants)}",
            stacklevel=2,
        )
    graphed = [v for v in variants if variant_graphs(v)]
    if graphed and not on_gpu:
        warnings.warn(
            f"--variants {graphed[0]}: CUDA graphs replay on GPUs only; on CPU ranks the forwards run eagerly",
            stacklevel=2,
        )


RANK_PROCESS_BYTES = 100_000_000  # a spawned rank's own memory (Python and torch), at least


def memory_need(conf: dict[str, Any], world: int, on_gpu: bool, args: argparse.Namespace) -> MemoryNeed:
    """What `occult bench` needs at least, the largest shape and token count: each rank's full
    weights (drawn in float32 on the host), one variant's experts, the input sets, the routing of
    all ranks' tokens, and the standard dispatch's rows."""
    unit, sets, tokens = (2 if on_gpu else 4), conf["input_sets"], max(conf["tokens"])
    device = host = 0
    for name in conf["shapes"]:
        shape = SHAPES[name]
        weights = shape.experts * (3 * shape.ffn * shape.hidden + shape.hidden)
        rows = (2 * sets + shape.top_k) * tokens * shape.hidden + weights // world
        ids = 8 * world * sets * tokens * shape.top_k
        device = max(device, unit * (weights + rows) + ids)
        host = max(host, RANK_PROCESS_BYTES + (4 * weights + ids if on_gpu else device))
    flags = {"--tokens": tokens, "--shapes": ",".join(conf["shapes"]), "--input-sets": sets, "--world-size": world}
    given = tuple(f for f, v in (("--tokens", args.tokens), ("--shapes", args.shapes)) if v)
    return MemoryNeed(world * host, device, flags, given)


def main(args: argparse.Namespace) -> int:
    """`occult bench`: every flag checked, the ranks run, the table and the JSON written; exit status."""
    from occult.distributed import RankFailure

    backend = pick_backend(args.backend)
    on_gpu = backend == "nccl"
    if on_gpu and torch.cuda.device_count() < 1:
        raise ValueError("--backend nccl needs CUDA GPUs and none is visible: use --backend gloo (CPU ranks)")
    world = args.world_size or (torch.cuda.device_count() if on_gpu else 2)
    if on_gpu and world > torch.cuda.device_count():
        raise ValueError(f"--world-size {world} over NCCL needs one GPU per rank, {torch.cuda.device_count()} visible")
    shapes = list(args.shapes or ["olmoe" if on_gpu else "tiny"])
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
        if SHAPES[s].experts % world:
            raise ValueError(f"shape {s} has {SHAPES[s].experts} experts, not divisible by {world} ranks")
    for v in args.variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    if world % args.nodes:
        raise ValueError(f"--nodes {args.nodes} must divide the {world} ranks")
    check_variants(list(args.variants), on_gpu, world, args.nodes, args.expert_backend)
    conf = dict(
        backend=backend,
        shapes=shapes,
        variants=list(args.variants),
        routings=list(args.routing),
        tokens=list(args.tokens or [8192 if on_gpu else 256]),
        warmup=args.warmup,
        iters=args.iters,
        input_sets=args.input_sets,
        expert_backend=args.expert_backend,
        nodes=args.nodes,
        verbose=True,
    )
    need = memory_need(conf, world, on_gpu, args)
    check_fits("occult bench", need, on_gpu, world)
    print(
        f"occult bench: {world} rank(s), backend {backend}, shapes {shapes}, tokens/rank {conf['tokens']}", flush=True
    )
    print(HEADER, flush=True)  # rank 0 prints each row as it is measured
    try:
        results = run_ranks(bench_worker, world, conf, backend=backend, timeout_s=3000)
    except RankFailure as exc:
        return rank_failure("occult bench", need, exc)
    result = results[0]
    result["config"] = {
        **conf,
        "world": world,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        **run_record(world, on_gpu),
    }
    bad = [r for r in result["runs"] if not r["rel_error"] < (2e-2 if on_gpu else 1e-4)]
    print()
    print(summarize(result, table=False))
    if args.out:
        try:
            write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")
        except OSError as exc:
            raise ValueError(f"--out {args.out}: {exc.strerror or exc}") from None
        print(f"wrote {args.out}")
    if bad:
        print(
            f"FAILED: {len(bad)} run(s) differ from the float32 reference: "
            + ", ".join(f"{r['shape']}/{r['variant']} {r['rel_error']:.1e}" for r in bad)
        )
        return 1
    return 0
