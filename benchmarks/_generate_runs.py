"""Whole `generate` calls timed from outside (benchmarks/serve.py's generate variants): transformers' own
`model.generate` with a static cache on the unconverted model, eager (`disable_compile=True`) or
auto-compiled (its CUDA-graph path: torch.compile, mode reduce-overhead), and occult's
`hf.generate` (eager, or the decode step captured in a CUDA graph) on a converted one.

A call's per-step time is not visible from outside, so a decode step is
(median time of generate(n) - median time of generate(m)) / (n - m), m = max(2, n // 2), every row
forced to its n (m) tokens (no eos): both calls run the same decode path on the same kept cache
(compiled forward, captured graph), so their fixed costs cancel; a one-token call would not (it
skips the decode path, and a shorter occult call with a new decoder pays for its cache). "Prefill"
(time to the first token) is generate(m) - (m - 1) steps, reported only when positive: noise, or later
steps slower than earlier ones, can make the estimate negative, and then `prefill_ms_p50` is None (the
raw number stays in `prefill_estimate_ms`). The first call's wall time (compilation
or graph capture included) minus a steady call's is reported as `compile_s`. Each call's time is
the slowest rank's (ranks meet at a barrier before each).

Per-token latency (`per_step_latency`): one more generate(n) call with a mark at each token, a CUDA event
recorded on the stream (wall clock on CPU), nothing waited on: transformers' generate marks from a logits
processor (called once per token, after its forward, on the host: no sync), occult's `hf.generate` after
each step of the decoder it keeps on the model. A step is the time between consecutive marks (the GPU's
work and any wait for the host in between), the slowest rank's; p50/p90/p99 over the call's steps. This
p50 becomes the reported `ms_p50` (and tokens/s come from the steps' mean): whole calls vary by +-10 ms
from run to run (host work outside the decode loop), which at B=1 moved the whole-call estimate by up to
40 % (a slow-link job gave 1.72 ms there against steady 2.77 ms steps); that estimate stays as
`step_ms_mean`, with `per_step_over_whole_call` their ratio.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from _timing import quantiles, slowest, synchronize  # benchmarks/_timing.py

KINDS = ("native", "native+compile", "occult", "occult+graph")
Generate = Callable[..., torch.Tensor]  # (prompts [B, P], new tokens, on_token=None) -> ids


def generate_fn(kind: str, model: nn.Module) -> Generate:
    """generate(prompts, n, on_token=None) of `kind` on `model`, greedy, exactly n new tokens per row (no eos);
    occult's decoder (cache, graph) is kept on the model for the next call that fits it. `on_token` (transformers'
    generate only): called once per token, from a logits processor."""
    if kind not in KINDS:
        raise ValueError(f"unknown generate kind {kind!r}; choose from {', '.join(KINDS)}")
    if kind.startswith("native"):
        from transformers import LogitsProcessor, LogitsProcessorList

        model.generation_config.eos_token_id = None

        class OnToken(LogitsProcessor):
            def __init__(self, fn: Callable[[], None]) -> None:
                self.fn = fn

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                self.fn()
                return scores

        def native(ids_BP: torch.Tensor, n: int, on_token: Callable[[], None] | None = None) -> torch.Tensor:
            extra = {"logits_processor": LogitsProcessorList([OnToken(on_token)])} if on_token else {}
            return model.generate(
                ids_BP,
                attention_mask=torch.ones_like(ids_BP),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                cache_implementation="static",
                pad_token_id=0,
                disable_compile=kind == "native",
                **extra,
            )

        return native
    from occult.integrations import hf

    def occult(ids_BP: torch.Tensor, n: int, on_token: Callable[[], None] | None = None) -> torch.Tensor:
        if on_token is not None:
            raise ValueError("occult's generate is marked at its kept decoder's steps (per_step_latency)")
        return hf.generate(model, ids_BP, n, cuda_graph=kind == "occult+graph", eos_token_id=[])

    return occult


def _wall_ms(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    dist.barrier()
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3, out


def time_generate(
    gen: Generate, prompts_BP: torch.Tensor, new_tokens: int, repeats: int, device: torch.device
) -> tuple[dict[str, Any], torch.Tensor]:
    """(numbers, the ids of the first call): first call, one untimed, then `repeats` x (n tokens, m tokens)."""
    half = max(2, new_tokens // 2)
    if new_tokens <= half:
        raise ValueError("timing a decode step from whole generate calls needs --new-tokens >= 3")
    first_ms, out = _wall_ms(lambda: gen(prompts_BP, new_tokens), device)
    _wall_ms(lambda: gen(prompts_BP, new_tokens), device)
    many, fewer = [], []
    for _ in range(repeats):
        many.append(_wall_ms(lambda: gen(prompts_BP, new_tokens), device)[0])
        fewer.append(_wall_ms(lambda: gen(prompts_BP, half), device)[0])
    many, fewer = slowest(many, device), slowest(fewer, device)
    first_ms = slowest([first_ms], device)[0]
    many_ms, fewer_ms = quantiles(many, [0.5])[0], quantiles(fewer, [0.5])[0]
    step_ms = max(many_ms - fewer_ms, 1e-6) / (new_tokens - half)
    B = prompts_BP.shape[0]
    # (the n-token call = prefill + (n - 1) steps; the same as fewer_ms - (half - 1) * step_ms unless
    # noise made the longer call the faster one and step_ms was clipped)
    prefill_ms = many_ms - (new_tokens - 1) * step_ms
    return {
        "prefill_ms_p50": prefill_ms if prefill_ms > 0 else None,
        "prefill_estimate_ms": prefill_ms,
        "ms_p50": step_ms,
        "ms_p99": None,
        "step_ms_mean": step_ms,
        "generate_ms_p50": many_ms,
        "generate_ms_all": many,
        "shorter_calls_tokens": half,
        "shorter_ms_all": fewer,
        "first_call_s": first_ms / 1e3,
        "compile_s": max(first_ms - many_ms, 0.0) / 1e3,
        "decode_tokens_per_s_per_gpu": B / (step_ms / 1e3),
        "e2e_tokens_per_s_per_gpu": B * new_tokens / (many_ms / 1e3),
    }, out


def per_step_latency(
    model: nn.Module, gen: Generate, kind: str, prompts_BP: torch.Tensor, new_tokens: int, device: torch.device
) -> dict[str, Any]:
    """Per-step latency of one more generate(n) call (module docstring): {"step_events_ms_p50", "ms_p90",
    "ms_p99", "step_ms_all", "step_events_mean_ms"}, or {} where no steps were marked (occult: no decoder kept on
    the model) or not as many on every rank."""
    marks: list[Any] = []

    def mark() -> None:
        marks.append(_mark(device))

    dec = None
    if kind.startswith("occult"):
        kept = getattr(model, "_occult_decoder", None)
        dec = kept[1] if kept is not None else None
        if dec is not None:
            original = dec.step

            def marked(ids_B: torch.Tensor | None = None) -> torch.Tensor:
                logits = original(ids_B)
                mark()
                return logits

            dec.step = marked  # this instance only, for this call
    try:
        dist.barrier()
        if dec is not None:  # occult: marked by its decoder's steps
            gen(prompts_BP, new_tokens)
        elif not kind.startswith("occult"):  # transformers: marked by a logits processor
            gen(prompts_BP, new_tokens, on_token=mark)
    finally:
        if dec is not None:
            del dec.step
    synchronize(device)
    ms = [_between(a, b) for a, b in zip(marks, marks[1:])]
    lengths = torch.tensor([len(ms), -len(ms)], device=device)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX)
    if not ms or int(lengths[0]) != -int(lengths[1]):
        return {}
    ms = slowest(ms, device)
    p50, p90, p99 = quantiles(ms, [0.5, 0.9, 0.99])
    return {
        "step_events_ms_p50": p50,
        "ms_p90": p90,
        "ms_p99": p99,
        "step_ms_all": ms,
        "step_events_mean_ms": sum(ms) / len(ms),
    }


def with_per_step(res: dict[str, Any], steps: dict[str, Any], batch: int) -> dict[str, Any]:
    """`time_generate`'s numbers with the per-step ones in: the steps' median as `ms_p50`, tokens/s from their
    mean; the whole-call estimate stays as `step_ms_mean` (module docstring). Unchanged where `steps` is {}."""
    if not steps:
        return res
    return dict(
        res,
        **steps,
        ms_p50=steps["step_events_ms_p50"],
        decode_tokens_per_s_per_gpu=batch / (steps["step_events_mean_ms"] / 1e3),
        per_step_over_whole_call=steps["step_events_ms_p50"] / res["step_ms_mean"],
    )


def _mark(device: torch.device) -> Any:
    """A mark now: a CUDA event recorded on the current stream (nothing waits for it), else the wall clock in ms."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter() * 1e3


def _between(a: Any, b: Any) -> float:
    """Milliseconds from mark `a` to mark `b` (events: read after a synchronize)."""
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else b - a
