"""Decode-step benchmark: one new token per sequence through a whole expert-parallel model, eager
and CUDA-graph captured, against the replicated floor (issue 16).

    torchrun --nproc-per-node 2 benchmarks/decode.py --model olmoe --out decode.json
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 benchmarks/decode.py --model olmoe --out decode_nop2p.json

Serving with a KV cache (prefill + decode steps, `hf.generate`'s decoder): benchmarks/serve.py.

A decode step is one forward of the model on input ids [B, 1] with use_cache=False (no KV
cache), giving the logits of that token; B is the number of sequences (tokens) per GPU, the
same on every rank. The model is built as in benchmarks/e2e.py: seeded random weights (bf16 on
GPUs, fp32 on CPU) broadcast from rank 0, router weights re-drawn wider (--router-std). Variants:

  replicated                 all experts on every GPU (converted over a one-rank group: occult's
                             kernels, no expert-parallel traffic); the floor
  standard, dedup            occult eager: one host synchronisation per MoE layer (split sizes)
  standard-syncfree,         eager with occult.set_sync_free: fixed-capacity all-to-all, no host
  dedup-syncfree             synchronisation (more rows sent: unused capacity)
  replicated+graph,          the step captured in a torch.cuda.CUDAGraph (sync-free dispatch;
  standard-syncfree+graph,   3 warm-up steps on a side stream, then capture; each step copies
  dedup-syncfree+graph       fresh ids into the static input buffer and replays). CUDA only: on
                             CPU they are reported as skipped. A capture error is recorded for
                             that variant and batch size, and the run goes on.

Each converted model is built once (replicated, standard, dedup) and serves all its variants at
every batch size; graphs are captured per batch size. Before timing, each (variant, batch) is
checked on a fixed batch against the unconverted model (per-token relative L2 error of the
logits, median and p95, max over ranks; graph variants on their replay output): a median above
--tol marks it failed (not timed) and the run exits 1 at the end. Timing: --warmup untimed steps,
then --iters steps with fresh random ids, ranks meeting at a barrier before each; a step's time
is the slowest rank's (CUDA events on GPUs, wall clock on CPU). Reported: ms per step p50 (the
median), p10, p90, p99, tokens/s per GPU, and the ratio to the floor (replicated+graph at that
batch size, else replicated eager). Rank 0 writes the JSON (atomically) after every variant and
batch size and prints a Markdown table last. NCCL_P2P_DISABLE is only recorded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from _timing import (  # noqa: E402  (benchmarks/_timing.py: timing, checks, tables shared with e2e.py, serve.py)
    agree_on_error,
    batch_list,
    capture_graph,
    checked,
    finish,
    floor_rows,
    free_memory,
    log,
    markdown_table,
    new_report,
    parser,
    quantiles,
    ratio,
    write_json,
)
from _timing import (
    describe as _describe,
)
from _timing import (
    time_steps as _time_steps,
)
from _timing import (
    variant_list as _variant_list,
)
from e2e import MODELS, TINY, build_model, comm_stats, random_ids, start_run  # noqa: E402  (model building)

from occult import ExecConfig, set_sync_free  # noqa: E402
from occult.integrations import hf  # noqa: E402


class Variant(NamedTuple):
    base: str  # the converted model it runs on: replicated, standard or dedup
    sync_free: bool
    graph: bool


VARIANTS: dict[str, Variant] = {
    "replicated": Variant("replicated", False, False),
    "standard": Variant("standard", False, False),
    "dedup": Variant("dedup", False, False),
    "standard-syncfree": Variant("standard", True, False),
    "dedup-syncfree": Variant("dedup", True, False),
    "replicated+graph": Variant("replicated", True, True),
    "standard-syncfree+graph": Variant("standard", True, True),
    "dedup-syncfree+graph": Variant("dedup", True, True),
}
Step = Callable[[torch.Tensor], torch.Tensor]  # ids [B, 1] -> logits [B, 1, V]


variant_list = _variant_list(VARIANTS)  # argparse type: a comma list of variants ("all": every one)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument(
        "--model",
        default="olmoe",
        choices=[*MODELS, *TINY],
        help="model shape (olmoe: OLMoE-1B-7B; tiny*: CPU smoke runs)",
    )
    p.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    p.add_argument("--variants", type=variant_list, default="all", help=f"comma list or 'all' of {', '.join(VARIANTS)}")
    p.add_argument(
        "--batch", type=batch_list, default="1,8,64,256", help="comma list of sequences (= tokens) per GPU per step"
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant and batch size")
    p.add_argument("--iters", type=int, default=50, help="timed steps per variant and batch size")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: bf16 on GPUs, fp32 on CPU")
    p.add_argument("--router-std", type=float, default=0.05, help="router weight std at hidden 2048")
    p.add_argument(
        "--router-groups", type=int, default=0, help="plant co-activation in this many expert groups (0: off)"
    )
    p.add_argument("--tol", type=float, default=2e-2, help="max median relative logit error of a variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write every number as JSON here (rank 0, atomically)")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    return args


def model_config(args: argparse.Namespace) -> Any:
    """The transformers config of --model (tiny*: hf.tiny_config), --layers applied."""
    import transformers

    extra: dict[str, Any] = {} if args.layers is None else {"num_hidden_layers": args.layers}
    if args.model in TINY:
        return hf.tiny_config(TINY[args.model], vocab_size=256, **extra)
    cls, fields = MODELS[args.model]
    return getattr(transformers, cls)(**{**fields, "tie_word_embeddings": False, **extra})


def build_base(base: str, args: argparse.Namespace, cfg: Any, ctx: dict) -> nn.Module:
    """The random model converted as `base`: replicated (one-rank group), standard or dedup (all ranks;
    `dedup@device`: over the device transport); native: not converted (serve.py's transformers
    baseline); `<base>/compile`: then `hf.compile_layers`."""
    if base.endswith("/compile"):  # the decoder layers torch.compiled around the MoE blocks
        model = build_base(base[: -len("/compile")], args, cfg, ctx)
        hf.compile_layers(model)
        return model
    model = build_model(args, cfg, ctx["device"], ctx["dtype"]).eval()
    if base == "native":
        return model
    if base == "replicated":
        return hf.convert(model, group=ctx["self_group"], execution=ExecConfig(dispatcher="dedup"))
    dispatcher, _, transport = base.partition("@")
    return hf.convert(model, execution=ExecConfig(dispatcher=dispatcher, transport=transport or "auto"))


def eager_step(model: nn.Module) -> Step:
    """One decode forward: ids [B, 1] -> logits [B, 1, V]."""

    def step(ids_B1: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids_B1, use_cache=False).logits

    return step


def graph_step(model: nn.Module, ids_B1: torch.Tensor) -> tuple[Step, torch.cuda.CUDAGraph]:
    """Capture one decode forward at ids_B1's shape; the step copies ids into the static buffer and replays."""
    return capture_graph(eager_step(model), ids_B1.clone())


def check(step: Step, ids_B1: torch.Tensor, ref_B1V: torch.Tensor, tol: float) -> dict[str, Any]:
    """Per-token relative L2 error of the step's logits vs the unconverted model (max over ranks)."""
    return checked(step(ids_B1).float(), ref_B1V, tol)


def time_steps(step: Step, batch: int, args: argparse.Namespace, vocab: int, device: torch.device) -> dict[str, Any]:
    """Per-step ms (slowest rank) over --iters steps with fresh ids: p10/p50/p90/p99, tokens/s/GPU."""
    gen = torch.Generator().manual_seed(20_000 + args.seed + dist.get_rank())
    ms = _time_steps(step, lambda: random_ids(batch, 1, vocab, device, gen), args.warmup, args.iters, device)
    q = quantiles(ms, [0.1, 0.5, 0.9, 0.99])
    return {
        "ms_p10": q[0],
        "ms_p50": q[1],
        "ms_median": q[1],
        "ms_p90": q[2],
        "ms_p99": q[3],
        "ms_all": ms,
        "tokens_per_s_per_gpu": batch / (q[1] / 1e3),
    }


def run_one(model: nn.Module, name: str, batch: int, args: argparse.Namespace, ctx: dict) -> dict[str, Any]:
    """Check, then time one variant at one batch size on its (already converted) model."""
    spec, device = VARIANTS[name], ctx["device"]
    set_sync_free(model, spec.sync_free)
    ids_B1, ref_B1V = ctx["check_ids"][:batch], ctx["ref_logits"][:batch]
    if spec.graph and device.type != "cuda":
        return {"skipped": f"CUDA graphs need a GPU (device {device.type})"}
    graph = None
    if spec.graph:
        error = None
        try:
            step, graph = graph_step(model, ids_B1)
        except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
            error = f"{type(exc).__name__}: {exc}"
        error = agree_on_error(error)
        if error:
            free_memory(device)
            return {"error": f"capture failed: {error}"}
    else:
        step = eager_step(model)
    res: dict[str, Any] = {"check": check(step, ids_B1, ref_B1V, args.tol)}
    res["comm"] = comm_stats(model, device)
    if res["check"]["passed"]:
        res.update(time_steps(step, batch, args, ctx["vocab"], device))
    del step, graph
    free_memory(device)
    return res


def describe(name: str, batch: int, r: dict[str, Any]) -> str:
    """One log line for a (variant, batch) result."""
    return _describe(
        name,
        batch,
        r,
        lambda r: (
            f"{r['ms_p50']:.2f} ms p50 (p10 {r['ms_p10']:.2f}, p99 {r['ms_p99']:.2f}), "
            f"{r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"
        ),
    )


def summary(report: dict[str, Any], names: list[str], batches: list[int]) -> list[dict[str, Any]]:
    """Rows batch x variant: p50, p99, tokens/s/GPU, ratio to the floor, or why not timed."""
    return floor_rows(
        lambda n, b: report["variants"].get(n, {}).get("batches", {}).get(str(b)),
        names,
        batches,
        ["ms_p50", "ms_p99", "tokens_per_s_per_gpu"],
    )


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: batch x variant -> ms p50, ms p99, tokens/s/GPU, x floor."""
    return markdown_table(
        rows,
        [
            ("ms p50", lambda r: f"{r['ms_p50']:.2f}"),
            ("ms p99", lambda r: f"{r['ms_p99']:.2f}"),
            ("tok/s/GPU", lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}"),
            ("x floor", ratio),
        ],
    )


def reference_logits(args: argparse.Namespace, cfg: Any, ctx: dict) -> float:
    """Check ids [max B, 1] per rank and the unconverted model's logits on them (ctx); returns build seconds."""
    t0 = time.perf_counter()
    ref = build_model(args, cfg, ctx["device"], ctx["dtype"]).eval()
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(30_000 + args.seed + dist.get_rank())
    ctx["check_ids"] = random_ids(max(args.batch), 1, cfg.vocab_size, ctx["device"], gen)
    with torch.no_grad():
        ctx["ref_logits"] = ref(input_ids=ctx["check_ids"], use_cache=False).logits.float()
    del ref
    free_memory(ctx["device"])
    return build_s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = start_run(args, "decode.py", model_config)
    if run is None:
        return 2
    rank, world, device, dtype, cfg, self_group = run
    ctx: dict[str, Any] = {"device": device, "dtype": dtype, "self_group": self_group, "vocab": cfg.vocab_size}
    report: dict[str, Any] = {
        **new_report(args, device, dtype, world, cfg, decode="input ids [B, 1], use_cache=False, logits of that token"),
        "table": [],
    }
    report["env"]["build_s"] = reference_logits(args, cfg, ctx)
    log(
        f"{args.model}: {cfg.num_hidden_layers} layers, {world} ranks, "
        f"{device.type} {dtype}, batches {args.batch} per GPU, NCCL_P2P_DISABLE={report['env']['NCCL_P2P_DISABLE']}, "
        f"reference built in {report['env']['build_s']:.1f} s"
    )
    if device.type != "cuda" and any(VARIANTS[n].graph for n in args.variants):
        log("note: CUDA-graph variants are skipped on CPU")
    for base in dict.fromkeys(VARIANTS[n].base for n in args.variants):  # each converted model built once
        t0 = time.perf_counter()
        model = build_base(base, args, cfg, ctx)
        names = [n for n in args.variants if VARIANTS[n].base == base]
        for n in names:
            report["variants"][n] = {**VARIANTS[n]._asdict(), "setup_s": time.perf_counter() - t0, "batches": {}}
        for batch in args.batch:
            for n in names:
                r = run_one(model, n, batch, args, ctx)
                report["variants"][n]["batches"][str(batch)] = r
                log(describe(n, batch, r))
                report["table"] = summary(report, args.variants, args.batch)
                if rank == 0 and args.out:
                    write_json(args.out, report)
        del model
        free_memory(device)
    failed = sorted(
        {
            n
            for n, v in report["variants"].items()
            for r in v["batches"].values()
            if not r.get("check", {}).get("passed", True)
        }
    )
    errors = sorted({n for n, v in report["variants"].items() for r in v["batches"].values() if "error" in r})
    if errors:
        log(f"warning: CUDA-graph capture failed for {', '.join(errors)} (error text above and in the JSON)")
    return finish("decode.py", table(report["table"]), failed, args.tol)


if __name__ == "__main__":
    sys.exit(main())
