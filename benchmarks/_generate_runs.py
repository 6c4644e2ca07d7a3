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

Per-token latency of occult's `hf.generate` (`per_step_latency`): one more generate(n) call with each decode step
of the decoder it keeps on the model timed (CUDA events around the step, its graph replay, the steps not
waited on one by one; wall clock on CPU), the slowest rank's per step: p50/p90/p99 of those n - 1 steps.
transformers' generate keeps no such step: its p99 stays None.
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
Generate = Callable[[torch.Tensor, int], torch.Tensor]  # (prompts [B, P], new tokens) -> ids


def generate_fn(kind: str, model: nn.Module) -> Generate:
    """generate(prompts, n) of `kind` on `model`, greedy, exactly n new tokens per row (no eos); occult's
    decoder (cache, graph) is kept on the model for the next call that fits it."""
    if kind not in KINDS:
        raise ValueError(f"unknown generate kind {kind!r}; choose from {', '.join(KINDS)}")
    if kind.startswith("native"):
        model.generation_config.eos_token_id = None

        def native(ids_BP: torch.Tensor, n: int) -> torch.Tensor:
            return model.generate(ids_BP, attention_mask=torch.ones_like(ids_BP), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, cache_implementation="static", pad_token_id=0,
                                  disable_compile=kind == "native")
        return native
    from occult.integrations import hf

    def occult(ids_BP: torch.Tensor, n: int) -> torch.Tensor:
        return hf.generate(model, ids_BP, n, cuda_graph=kind == "occult+graph", eos_token_id=[])
    return occult


def _wall_ms(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    dist.barrier()
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3, out


def time_generate(gen: Generate, prompts_BP: torch.Tensor, new_tokens: int, repeats: int,
                  device: torch.device) -> tuple[dict[str, Any], torch.Tensor]:
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
    return {"prefill_ms_p50": prefill_ms if prefill_ms > 0 else None, "prefill_estimate_ms": prefill_ms,
            "ms_p50": step_ms, "ms_p99": None,
            "step_ms_mean": step_ms, "generate_ms_p50": many_ms, "generate_ms_all": many, "shorter_calls_tokens": half,
            "shorter_ms_all": fewer,
            "first_call_s": first_ms / 1e3, "compile_s": max(first_ms - many_ms, 0.0) / 1e3,
            "decode_tokens_per_s_per_gpu": B / (step_ms / 1e3),
            "e2e_tokens_per_s_per_gpu": B * new_tokens / (many_ms / 1e3)}, out


def per_step_latency(model: nn.Module, gen: Generate, prompts_BP: torch.Tensor, new_tokens: int,
            device: torch.device) -> dict[str, Any]:
    """Per-step latency of one more occult generate(n) call (module docstring): {"ms_p90", "ms_p99",
    "step_events_ms_p50", "step_ms_all"}, or {} where the call kept no decoder on the model (or not the same one
    on every rank)."""
    kept = getattr(model, "_occult_decoder", None)
    dec = kept[1] if kept is not None else None
    times: list[Callable[[], float]] = []
    if dec is not None:
        original = dec.step

        def timed(ids_B: torch.Tensor | None = None) -> torch.Tensor:
            stop = _stopwatch(device)
            logits = original(ids_B)
            times.append(stop())
            return logits

        dec.step = timed  # this instance only, for this call
    try:
        dist.barrier()
        gen(prompts_BP, new_tokens)
    finally:
        if dec is not None:
            del dec.step
    synchronize(device)
    ms = [t() for t in times]
    lengths = torch.tensor([len(ms), -len(ms)], device=device)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX)
    if not ms or int(lengths[0]) != -int(lengths[1]):
        return {}
    ms = slowest(ms, device)
    p50, p90, p99 = quantiles(ms, [0.5, 0.9, 0.99])
    return {"ms_p90": p90, "ms_p99": p99, "step_events_ms_p50": p50, "step_ms_all": ms}


def _stopwatch(device: torch.device) -> Callable[[], Callable[[], float]]:
    """Started now; calling it marks the end and gives a reader of the milliseconds in between (CUDA events on
    GPUs, read after a synchronize; wall clock elsewhere)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()

        def stop_cuda() -> Callable[[], float]:
            end.record()
            return lambda: start.elapsed_time(end)
        return stop_cuda
    t0 = time.perf_counter()

    def stop_wall() -> Callable[[], float]:
        elapsed = (time.perf_counter() - t0) * 1e3
        return lambda: elapsed
    return stop_wall
