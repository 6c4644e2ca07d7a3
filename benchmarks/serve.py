"""Serving benchmark: prefill of random prompts, then decode steps with a static KV cache, through a
whole expert-parallel model; eager and CUDA-graph captured, against the replicated floor (issue 16).

    torchrun --nproc-per-node 2 benchmarks/serve.py --model olmoe --out serve.json
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 benchmarks/serve.py --model olmoe --out serve_nop2p.json
    python benchmarks/serve.py --verify --model olmoe --layers 4       (one GPU: graph == eager generation)

Per batch size B (sequences per GPU, the same on every rank) each rank draws B random prompts of
--prompt-len tokens, prefills them (eager, normal dispatch) into a transformers StaticCache with
`hf.StaticDecoder`, then runs --new-tokens greedy decode steps of [B, 1] tokens (the argmax of
the last logits feeds the next step, on the device). Models are built as in benchmarks/decode.py
(seeded random weights, bf16 on GPUs, fp32 on CPU). Variants:

  native                     the unconverted transformers model (its default experts implementation)
                             through the same StaticDecoder, eager
  native-generate            transformers' own `model.generate`, static cache, eager (disable_compile)
  native-generate+compile    the same auto-compiled (its CUDA-graph path: torch.compile reduce-overhead);
                             compile time reported (CUDA only: generate compiles nothing on CPU)
  generate, generate+graph   occult's `hf.generate` (dedup, sync-free decode), eager / step captured
  generate+compile+graph     the same after `hf.compile_layers` (decoder layers torch.compiled around the
                             MoE blocks; compiled in the check and the first call: compile_s is what the
                             first call adds, the check's share is not counted)
  dedup@device+graph         dedup over the device transport (`transport="device"`: exact rows stored into
                             the peers' memory, counts on the GPU), the decode step captured (StaticDecoder)
  generate@device+graph      occult's `hf.generate` of that model: prefill and decode over the device
                             transport, the step captured (both opt-in; GPUs of one host)
  generate@device+compile+graph  the same after `hf.compile_layers` (opt-in)
  replicated                 all experts on every GPU (a one-rank group): no expert-parallel traffic
  replicated+graph           the same, the decode step sync-free and captured in a CUDA graph: the floor
  replicated+compile+graph   the same after `hf.compile_layers` (capture_s includes compiling the step)
  standard, dedup            occult eager: one host synchronisation per MoE layer
  dedup-syncfree             eager, sync-free dispatch (fixed-capacity all-to-all, no host wait)
  standard-syncfree+graph,   sync-free, the decode step captured once per batch size
  dedup-syncfree+graph       (hf.StaticDecoder.capture: warm-up on a side stream, static buffers)
  hf-ep, hf-ep+graph         transformers' own expert-parallel inference (benchmarks/hf_ep.py):
                             from_pretrained(distributed_config=DistributedConfig(tp_size=N,
                             ep_size=N)), dense layers tensor-parallel, experts sharded, AllReduceEP;
                             all ranks share one batch of N * B rows (every rank's prompts), through
                             the same StaticDecoder (eager / captured); skipped, with the reason,
                             where it cannot load (no accelerate, an older transformers)

Graph variants are skipped on CPU; a capture error is recorded and the run goes on. Before
timing, every (variant, B) is checked against the unconverted model run through the same
static-cache decoder: the logits of the prefill and of --check-steps decode steps fed fixed random
tokens (per-token relative L2 error over the first 8 rows, median and p95, max over ranks); a
median above --tol fails it (not timed; exit 1 at the end), unless, in half precision, its error
against the unconverted model upcast to fp32 is at most 1.25x the half-precision native model's
own plus --tol (near-tied routing scores pick other experts under any change of rounding: benchmarks/e2e.py). Timing:
one untimed run, then --repeats runs of prefill + --new-tokens steps; a step's time is the slowest rank's (CUDA events
recorded around each step on GPUs, the steps not waited on one by one; wall clock on CPU).
Reported: prefill ms p50, per-token latency (decode step) p50/p90/p99, decode tokens/s per GPU
(B / mean step), end-to-end tokens/s per GPU (B * new tokens / (prefill + steps)) and the ratio
of the step p50 to the floor (replicated+graph, else replicated). Rank 0 writes the JSON
atomically after every result and prints a Markdown table last.

The generate variants are whole calls timed from outside (benchmarks/_generate_runs.py), then one more
call with a CUDA event at each token (transformers' generate: from a logits processor; occult's `hf.generate`:
after each step of its kept decoder): the step p50/p90/p99 are those of the times between consecutive
marks, tokens/s from their mean; the whole-call estimate (generate(n) - generate(m)) / (n - m), n =
--new-tokens, m = max(2, n // 2), stays as `step_ms_mean` (whole calls vary by +-10 ms from run to run);
prefill = generate(m) - (m - 1) of those steps (none when that estimate is not positive). Every table row also gives the
speed-up over native (native-generate's step / the row's, and native-generate+compile's; native's StaticDecoder step
where generate was not run), the share of the copy bandwidth measured in the same run that the step's bytes need
(weights the step must read, the experts B tokens select, and the K/V attended: benchmarks/_roofline.py),
and the one-time cost: graph capture (StaticDecoder variants) or compile (first call - a steady one).

--verify (any world size, e.g. one GPU): `hf.generate` with the decode step graph-captured gives
exactly the tokens of the same call run eagerly, greedy and sampled (temperature 0.8, top-k 40,
top-p 0.9, one seed: the draw happens inside the captured step; two eager runs: equal), on a
tiny OLMoE (fp32: also == transformers' own `generate` of the unconverted model) and on --model
(its dtype: agreement with transformers' generate reported, bf16 may differ), 4 left-padded
prompts of 7-24 tokens per rank, the config's eos. Exit 1 if any equality fails on any rank.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_ep  # noqa: E402  (benchmarks/hf_ep.py: transformers' own expert parallelism)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from _generate_runs import generate_fn, per_step_latency, time_generate, with_per_step  # noqa: E402  (benchmarks/_generate_runs.py)
from _roofline import ModelCost, bandwidth, measure_peaks  # noqa: E402  (benchmarks/_roofline.py)
from _timing import (  # noqa: E402  (benchmarks/_timing.py: timing, checks, tables shared with e2e.py, decode.py)
    Stopwatch,
    Truth,
    agree_on_error,
    batch_list,
    checked,
    finish,
    floor_rows,
    fp32_copy_logits,
    free_memory,
    log,
    markdown_table,
    new_report,
    parser,
    quantiles,
    ratio,
    slowest,
    synchronize,
    write_json,
)
from _timing import (
    describe as _describe,
)
from _timing import (
    variant_list as _variant_list,
)
from decode import build_base, model_config  # noqa: E402
from e2e import MODELS, TINY, build_model, random_ids, start_run  # noqa: E402

from occult import ExecConfig, set_sync_free  # noqa: E402
from occult.distributed import finish_distributed  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.moe import symm  # noqa: E402  (the device transport: where it can run)


class Variant(NamedTuple):
    base: str
    sync_free: bool
    graph: bool  # CUDA only (a captured step, or generate's auto-compile)
    generate: str = ""  # a whole-generate variant (_generate_runs.KINDS), else the StaticDecoder loop


VARIANTS: dict[str, Variant] = {
    "native": Variant("native", False, False),
    "native-generate": Variant("native", False, False, "native"),
    "native-generate+compile": Variant("native", False, True, "native+compile"),
    "replicated": Variant("replicated", False, False),
    "replicated+graph": Variant("replicated", True, True),
    "standard": Variant("standard", False, False),
    "dedup": Variant("dedup", False, False),
    "dedup-syncfree": Variant("dedup", True, False),
    "standard-syncfree+graph": Variant("standard", True, True),
    "dedup-syncfree+graph": Variant("dedup", True, True),
    "hf-ep": Variant("hf-ep", False, False),
    "hf-ep+graph": Variant("hf-ep", False, True),
    "generate": Variant("dedup", True, False, "occult"),
    "generate+graph": Variant("dedup", True, True, "occult+graph"),
    "generate+compile+graph": Variant("dedup/compile", True, True, "occult+graph"),
    "replicated+compile+graph": Variant("replicated/compile", True, True),
    "dedup@device+graph": Variant("dedup@device", False, True),
    "generate@device+graph": Variant("dedup@device", False, True, "occult+graph"),
    "generate@device+compile+graph": Variant("dedup@device/compile", False, True, "occult+graph"),
}
CHECK_ROWS = 8
OPT_IN = (
    "hf-ep",
    "hf-ep+graph",
    "generate+compile+graph",
    "replicated+compile+graph",
    "dedup@device+graph",
    "generate@device+graph",
    "generate@device+compile+graph",
)  # not in the default list


variant_list = _variant_list(VARIANTS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--model", default="olmoe", choices=[*MODELS, *TINY], help="model shape (tiny*: CPU smoke runs)")
    p.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    p.add_argument(
        "--variants",
        type=variant_list,
        default=",".join(n for n in VARIANTS if n not in OPT_IN),
        help=f"comma list or 'all' of {', '.join(VARIANTS)} (default: all but {', '.join(OPT_IN)}: the hf-ep "
        "peer needs accelerate, the compiled ones take a while to compile)",
    )
    p.add_argument("--batch", type=batch_list, default="1,8,64,256", help="comma list of sequences per GPU")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps per run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (prefill + decode) per variant and batch size")
    p.add_argument("--check-steps", type=int, default=3, help="decode steps checked against the unconverted model")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: bf16 on GPUs, fp32 on CPU")
    p.add_argument("--router-std", type=float, default=0.05, help="router weight std at hidden 2048")
    p.add_argument(
        "--router-groups", type=int, default=0, help="plant co-activation in this many expert groups (0: off)"
    )
    p.add_argument("--tol", type=float, default=2e-2, help="max median relative logit error of a variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify", action="store_true", help="only check graph-captured generation == eager (see above)")
    p.add_argument("--out", default=None, help="write every number as JSON here (rank 0, atomically)")
    args = p.parse_args(argv)
    if min(args.prompt_len, args.new_tokens, args.repeats, args.check_steps) < 1:
        p.error("--prompt-len, --new-tokens, --repeats and --check-steps must be >= 1")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if args.new_tokens < 3 and any(VARIANTS[n].generate for n in args.variants):
        p.error(
            "the generate variants time a step as (generate(n) - generate(n/2)) / (n - n/2): --new-tokens must be >= 3"
        )
    return args


# ------------------------------------------------------------------ check
@torch.no_grad()
def forced_logits(
    dec: hf.StaticDecoder,
    model: nn.Module,
    prompts_BP: torch.Tensor,
    forced_BK: torch.Tensor,
    sync_free: bool,
    first: int = 0,
    own: int | None = None,
) -> torch.Tensor:
    """Logits [min(own, 8), K + 1, V] of the prefill and K decode steps fed the forced tokens, rows from `first`
    (own: the rows that are this rank's, default all)."""
    rows = slice(first, first + min(CHECK_ROWS, prompts_BP.shape[0] if own is None else own))
    set_sync_free(model, False)
    out = [dec.prefill(prompts_BP, torch.ones_like(prompts_BP))[rows].clone()]
    set_sync_free(model, sync_free)
    for k in range(forced_BK.shape[1]):
        out.append(dec.step(forced_BK[:, k])[rows].clone())
    return torch.stack(out, dim=1)


def fp32_truth(ref: nn.Module, args: argparse.Namespace, ctx: dict) -> dict[int, Truth]:
    """Per batch size, the same forced logits of the unconverted model upcast to fp32 (in place: its
    last use), beside the half-precision ones (`_timing.Truth`)."""

    def logits_of(b: int) -> Callable[[nn.Module], torch.Tensor]:
        def run(model: nn.Module) -> torch.Tensor:
            dec = hf.StaticDecoder(model, b, args.prompt_len + args.check_steps + 1)
            return forced_logits(dec, model, ctx["prompts"][b], ctx["forced"][b], False)

        return run

    truth = {b: Truth(fp32_copy_logits(ref, logits_of(b)), ctx["ref"][b]) for b in args.batch}
    log(
        "unconverted model vs fp32, median relative logit error: "
        + ", ".join(f"B={b} {t.native_err:.2e}" for b, t in truth.items())
    )
    return truth


# ------------------------------------------------------------------ timing
@torch.no_grad()
def serve_run(
    dec: hf.StaticDecoder, model: nn.Module, prompts_BP: torch.Tensor, sync_free: bool, steps: int, device: torch.device
) -> tuple[float, list[float]]:
    """One prefill + `steps` greedy decode steps: (prefill ms, [step ms]) on this rank."""
    set_sync_free(model, False)
    synchronize(device)
    watch = Stopwatch(device)  # marks: prefill start, prefill end, then each step's start and end
    watch.mark()
    logits_BV = dec.prefill(prompts_BP, torch.ones_like(prompts_BP))
    set_sync_free(model, sync_free)
    watch.mark()
    for _ in range(steps):
        watch.mark()
        logits_BV = dec.step(logits_BV.argmax(-1))
        watch.mark()
    return watch.ms(0, 1), [watch.ms(2 + 2 * i, 3 + 2 * i) for i in range(steps)]


def run_one(model: nn.Module, name: str, batch: int, args: argparse.Namespace, ctx: dict) -> dict[str, Any]:
    spec, device = VARIANTS[name], ctx["device"]
    if spec.graph and device.type != "cuda":
        what = (
            "transformers' generate auto-compiles on CUDA only"
            if spec.generate.startswith("native")
            else "CUDA graphs need a GPU"
        )
        return {"skipped": f"{what} (device {device.type})"}
    prompts_BP, forced_BK, first = ctx["prompts"][batch], ctx["forced"][batch], 0
    if spec.base == "hf-ep":  # one batch shared by the group: every rank's rows, this rank's checked
        prompts_BP, forced_BK, first = (
            hf_ep.gather_rows(prompts_BP),
            hf_ep.gather_rows(forced_BK),
            dist.get_rank() * batch,
        )
    dec = hf.StaticDecoder(model, prompts_BP.shape[0], args.prompt_len + max(args.new_tokens, args.check_steps) + 1)
    res: dict[str, Any] = {}
    try:
        if spec.graph and not spec.generate:
            error, t0 = None, time.perf_counter()
            try:
                set_sync_free(model, False)
                dec.prefill(prompts_BP, torch.ones_like(prompts_BP))
                set_sync_free(model, True)
                dec.capture()
            except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
                error = f"{type(exc).__name__}: {exc}"
            error = agree_on_error(error)
            if error:
                return {"error": f"capture failed: {error}"}
            res["capture_s"] = time.perf_counter() - t0  # prefill + capture
        out = forced_logits(dec, model, prompts_BP, forced_BK, spec.sync_free, first, batch)
        res["check"] = checked(out, ctx["ref"][batch], args.tol, ctx["truth"].get(batch))
        if not res["check"]["passed"]:
            return res
        if spec.generate:
            del dec
            free_memory(device)
            return {**res, **generate_run(model, name, batch, prompts_BP, args, ctx)}
        serve_run(dec, model, prompts_BP, spec.sync_free, args.new_tokens, device)  # untimed
        prefill, steps = [], []
        for _ in range(args.repeats):
            p_ms, s_ms = serve_run(dec, model, prompts_BP, spec.sync_free, args.new_tokens, device)
            prefill.append(p_ms)
            steps += s_ms
        prefill, steps = slowest(prefill, device), slowest(steps, device)
        q = quantiles(steps, [0.1, 0.5, 0.9, 0.99])
        mean_step = sum(steps) / len(steps)
        run_ms = sum(prefill) / len(prefill) + mean_step * args.new_tokens
        res.update(
            prefill_ms_p50=quantiles(prefill, [0.5])[0],
            ms_p10=q[0],
            ms_p50=q[1],
            ms_p90=q[2],
            ms_p99=q[3],
            step_ms_mean=mean_step,
            decode_tokens_per_s_per_gpu=batch / (mean_step / 1e3),
            e2e_tokens_per_s_per_gpu=batch * args.new_tokens / (run_ms / 1e3),
            prefill_ms_all=prefill,
            ms_all=steps,
            **step_bandwidth(spec.base, batch, q[1], args, ctx),
        )
        return res
    finally:
        set_sync_free(model, False)
        dec = None
        free_memory(device)


def step_bandwidth(base: str, batch: int, step_ms: float, args: argparse.Namespace, ctx: dict) -> dict[str, Any]:
    """The step's bytes (weights it must read, the K/V it attends at the mean context of the timed steps) as a
    share of the measured copy bandwidth; experts split over the group for expert-parallel variants."""
    if base == "hf-ep":
        return {"hbm_fraction": None}
    world = 1 if base.split("/")[0] in ("native", "replicated") else dist.get_world_size()
    nbytes = ctx["cost"].decode_bytes(batch, args.prompt_len + (args.new_tokens + 1) / 2, world)
    return {"step_bytes": nbytes, **bandwidth(nbytes["total"], step_ms, ctx["peaks"])}


def generate_run(
    model: nn.Module, name: str, batch: int, prompts_BP: torch.Tensor, args: argparse.Namespace, ctx: dict
) -> dict[str, Any]:
    """A whole-generate variant timed (benchmarks/_generate_runs.py); native-generate+compile's tokens
    compared with native-generate's (report only: bf16 kernels differ)."""
    spec = VARIANTS[name]
    gen = generate_fn(spec.generate, model)
    res, ids = time_generate(gen, prompts_BP, args.new_tokens, args.repeats, ctx["device"])
    # per-token latency from the marked steps of one more call: its p50 is the reported step (_generate_runs.py)
    steps = per_step_latency(model, gen, spec.generate, prompts_BP, args.new_tokens, ctx["device"])
    res = with_per_step(res, steps, batch)
    if spec.generate == "native+compile":
        res["auto_compiled"] = hasattr(model, "_compiled_call")  # transformers' compiled forward exists
        eager = ctx.setdefault("native_ids", {}).get(batch)
        if eager is not None:
            res["tokens_equal_native_eager"] = float((ids == eager).float().mean())
    if spec.generate == "native":
        ctx.setdefault("native_ids", {})[batch] = ids
    res.update(step_bandwidth(spec.base, batch, res["ms_p50"], args, ctx))
    return res


def describe(name: str, batch: int, r: dict[str, Any]) -> str:
    return _describe(
        name,
        batch,
        r,
        lambda r: (
            f"prefill {_num(r['prefill_ms_p50'], '{:.1f}')} ms, step {r['ms_p50']:.2f} ms p50 "
            f"(p99 {_num(r['ms_p99'], '{:.2f}')}), "
            f"{r['decode_tokens_per_s_per_gpu']:,.0f} decode tok/s/GPU"
            + (f", compile {r['compile_s']:.1f} s" if "compile_s" in r else "")
        ),
    )


def summary(report: dict[str, Any], names: list[str], batches: list[int]) -> list[dict[str, Any]]:
    """floor_rows, plus each row's speed-up over native eager / compiled, HBM share, capture or compile s."""
    get = lambda n, b: report["variants"].get(n, {}).get(str(b))  # noqa: E731
    rows = floor_rows(
        get,
        names,
        batches,
        ["prefill_ms_p50", "ms_p50", "ms_p99", "decode_tokens_per_s_per_gpu", "e2e_tokens_per_s_per_gpu"],
    )
    for row in rows:
        if "note" in row:
            continue
        r, b = get(row["variant"], row["batch"]), row["batch"]
        eager = next((x["ms_p50"] for n in ("native-generate", "native") if (x := get(n, b)) and x.get("ms_p50")), None)
        compiled = (get("native-generate+compile", b) or {}).get("ms_p50")
        row.update(
            vs_native_eager=eager / row["ms_p50"] if eager else None,
            vs_native_compiled=compiled / row["ms_p50"] if compiled else None,
            hbm_fraction=r.get("hbm_fraction"),
            setup_s=r.get("capture_s", r.get("compile_s")),
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(
        rows,
        [
            ("prefill ms", lambda r: _num(r["prefill_ms_p50"], "{:.1f}")),
            ("step ms p50", lambda r: f"{r['ms_p50']:.2f}"),
            ("step ms p99", lambda r: _num(r["ms_p99"], "{:.2f}")),
            ("decode tok/s/GPU", lambda r: f"{r['decode_tokens_per_s_per_gpu']:,.0f}"),
            ("e2e tok/s/GPU", lambda r: f"{r['e2e_tokens_per_s_per_gpu']:,.0f}"),
            ("x floor", ratio),
            ("native eager/this", lambda r: _num(r.get("vs_native_eager"), "{:.2f}")),
            ("native compiled/this", lambda r: _num(r.get("vs_native_compiled"), "{:.2f}")),
            ("HBM share", lambda r: _num(r.get("hbm_fraction"), "{:.1%}")),
            ("capture/compile s", lambda r: _num(r.get("setup_s"), "{:.1f}")),
        ],
    )


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


# ------------------------------------------------------------------ verify
def verify(args: argparse.Namespace, ctx: dict) -> dict[str, Any]:
    """hf.generate graph-captured == eager (and == transformers' generate in fp32) on tiny and --model."""
    device, out = ctx["device"], {}
    for name, dtype in (("tiny", torch.float32), (args.model, ctx["dtype"])):
        sub = argparse.Namespace(**{**vars(args), "model": name, "layers": None if name in TINY else args.layers})
        cfg = model_config(sub)
        ref = build_model(sub, cfg, device, dtype).eval()
        model = hf.convert(build_model(sub, cfg, device, dtype).eval(), execution=ExecConfig(dispatcher="dedup"))
        gen = torch.Generator().manual_seed(40_000 + args.seed + dist.get_rank())
        ids = random_ids(4, 24, cfg.vocab_size, device, gen)
        mask = torch.ones_like(ids)
        for row, pad in enumerate((0, 5, 11, 17)):
            mask[row, :pad] = 0
        kw = {"attention_mask": mask, "pad_token_id": 0}  # eos: the config's, on every side
        res: dict[str, Any] = {}
        if device.type == "cuda":
            t0 = time.perf_counter()
            graph = hf.generate(model, ids, args.new_tokens, cuda_graph=True, reuse=False, **kw)
            res["graph_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        eager = hf.generate(model, ids, args.new_tokens, cuda_graph=False, reuse=False, **kw)
        res["eager_s"] = time.perf_counter() - t0
        hf_out = ref.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, **kw)
        n = min(eager.shape[1], hf_out.shape[1])
        res["agreement_with_transformers"] = float((eager[:, 24:n] == hf_out[:, 24:n]).float().mean())
        if dtype == torch.float32:
            res["eager_equals_transformers"] = bool(torch.equal(eager, hf_out))
        if device.type == "cuda":
            res["graph_equals_eager"] = bool(torch.equal(graph, eager))
        # sampled (every warper, one seed): the draw inside the captured step == eager, and repeatable
        skw = {**kw, "do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 1234 + dist.get_rank()}
        sampled = hf.generate(model, ids, args.new_tokens, cuda_graph=False, reuse=False, **skw)
        res["sampled_repeat_equals"] = bool(
            torch.equal(sampled, hf.generate(model, ids, args.new_tokens, cuda_graph=False, reuse=False, **skw))
        )
        if device.type == "cuda":
            res["sampled_graph_equals_eager"] = bool(
                torch.equal(sampled, hf.generate(model, ids, args.new_tokens, cuda_graph=True, reuse=False, **skw))
            )
        flags = torch.tensor([int(v) for k, v in res.items() if "equals" in k] or [1], device=device).min().reshape(1)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        res["passed_all_ranks"] = bool(flags.item())
        out[f"{name} ({str(dtype).replace('torch.', '')})"] = res
        del ref, model
        free_memory(device)
    return out


def build_variant_model(base: str, args: argparse.Namespace, cfg: Any, ctx: dict, report: dict) -> nn.Module | None:
    """The converted model of `base`, or transformers' expert-parallel load (None, with the reason in ctx, if
    it cannot)."""
    if "@device" in base:
        reason = symm.unavailable_reason(dist.group.WORLD) if dist.get_world_size() > 1 else "one rank"
        if reason:
            ctx["skip_reason"] = f"the device transport cannot run here: {reason}"
            log(f"{base}: skipped: {ctx['skip_reason']}")
            return None
    if base != "hf-ep":
        return build_base(base, args, cfg, ctx)
    if ctx["hf_ep_skip"]:
        ctx["skip_reason"] = ctx["hf_ep_skip"]
        log(f"hf-ep: skipped: {ctx['hf_ep_skip']}")
        return None
    t0 = time.perf_counter()
    error = None
    try:
        model = hf_ep.load(ctx["hf_ep_dir"], dist.get_world_size(), ctx["dtype"])
    except Exception as exc:  # noqa: BLE001 (recorded on every rank, the run goes on)
        error, model = f"{type(exc).__name__}: {exc}", None
    error = agree_on_error(error)
    hf_ep.remove(ctx["hf_ep_dir"])
    if error:
        ctx["hf_ep_skip"] = ctx["skip_reason"] = f"transformers' expert-parallel load failed: {error}"
        log(f"hf-ep: {ctx['hf_ep_skip']}")
        return None
    report["hf_ep"] = {**hf_ep.describe(model), "load_s": time.perf_counter() - t0}
    log(f"hf-ep: transformers' tensor + expert parallelism, {report['hf_ep']}")
    return model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = start_run(args, "serve.py", model_config)
    if run is None:
        return 2
    rank, world, device, dtype, cfg, self_group = run
    ctx: dict[str, Any] = {"device": device, "dtype": dtype, "self_group": self_group}
    report: dict[str, Any] = {**new_report(args, device, dtype, world, cfg), "table": []}
    if args.verify:
        report["verify"] = verify(args, ctx)
        log(report["verify"])
        if rank == 0 and args.out:
            write_json(args.out, report)
        ok = all(r["passed_all_ranks"] for r in report["verify"].values())
        finish_distributed()
        return 0 if ok else 1
    gen = torch.Generator().manual_seed(50_000 + args.seed + rank)
    ctx["prompts"] = {b: random_ids(b, args.prompt_len, cfg.vocab_size, device, gen) for b in args.batch}
    ctx["forced"] = {b: random_ids(b, args.check_steps, cfg.vocab_size, device, gen) for b in args.batch}
    t0 = time.perf_counter()
    ref = build_model(args, cfg, device, dtype).eval()
    report["env"]["build_s"] = time.perf_counter() - t0
    ctx["ref"] = {}
    for b in args.batch:
        dec = hf.StaticDecoder(ref, b, args.prompt_len + args.check_steps + 1)
        ctx["ref"][b] = forced_logits(dec, ref, ctx["prompts"][b], ctx["forced"][b], False).float()
        del dec
    if any(VARIANTS[n].base == "hf-ep" for n in args.variants):
        ctx["hf_ep_skip"] = hf_ep.unavailable()
        ctx["hf_ep_dir"] = None if ctx["hf_ep_skip"] else hf_ep.save(ref)
    ctx["cost"] = ModelCost.of(ref)
    ctx["truth"] = fp32_truth(ref, args, ctx) if dtype != torch.float32 else {}
    del ref
    free_memory(device)
    report["peaks"] = ctx["peaks"] = measure_peaks(device, dtype)
    report["model_cost"] = ctx["cost"].describe()
    log(
        f"{args.model}: {cfg.num_hidden_layers} layers, {world} ranks, {device.type} {dtype}, batches {args.batch} "
        f"per GPU, prompts {args.prompt_len}, {args.new_tokens} new tokens x {args.repeats} runs, "
        f"NCCL_P2P_DISABLE={report['env']['NCCL_P2P_DISABLE']}, reference built in {report['env']['build_s']:.1f} s"
    )
    for base in dict.fromkeys(VARIANTS[n].base for n in args.variants):
        model = build_variant_model(base, args, cfg, ctx, report)
        names = [n for n in args.variants if VARIANTS[n].base == base]
        for batch in args.batch:
            for n in names:
                r = run_one(model, n, batch, args, ctx) if model is not None else {"skipped": ctx["skip_reason"]}
                report["variants"].setdefault(n, {})[str(batch)] = r
                log(describe(n, batch, r))
                report["table"] = summary(report, args.variants, args.batch)
                if rank == 0 and args.out:
                    write_json(args.out, report)
        del model
        free_memory(device)
    failed = sorted(
        {n for n, v in report["variants"].items() for r in v.values() if not r.get("check", {}).get("passed", True)}
    )
    return finish("serve.py", table(report["table"]), failed, args.tol)


if __name__ == "__main__":
    sys.exit(main())
