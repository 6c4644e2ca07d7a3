"""Whole `generate` calls timed from outside (benchmarks/serve.py's generate variants): transformers' own
`model.generate` with a static cache on the unconverted model, eager (`disable_compile=True`) or
auto-compiled (its CUDA-graph path: torch.compile, mode reduce-overhead), and occult's
`hf.generate` (eager, or the decode step captured in a CUDA graph) on a converted one.

A call's per-step time is not visible from outside, so a decode step is
(median time of generate(n) - median time of generate(1)) / (n - 1), both with every row forced to
its n tokens (no eos), and "prefill" is generate(1): the prompt's forward and the first token. The
first call's wall time (compilation or graph capture included) minus a steady call's is reported
as `compile_s`. Each call's time is the slowest rank's (ranks meet at a barrier before each).
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
Generate = Callable[[torch.Tensor, int, bool], torch.Tensor]  # (prompts [B, P], new tokens, keep state) -> ids


def generate_fn(kind: str, model: nn.Module) -> Generate:
    """generate(prompts, n, keep) of `kind` on `model`, greedy, exactly n new tokens per row (no eos).
    `keep=False` (the one-token calls) leaves occult's kept decoder alone."""
    if kind not in KINDS:
        raise ValueError(f"unknown generate kind {kind!r}; choose from {', '.join(KINDS)}")
    if kind.startswith("native"):
        model.generation_config.eos_token_id = None

        def native(ids_BP: torch.Tensor, n: int, keep: bool = True) -> torch.Tensor:
            return model.generate(ids_BP, attention_mask=torch.ones_like(ids_BP), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, cache_implementation="static", pad_token_id=0,
                                  disable_compile=kind == "native")
        return native
    from occult.integrations import hf

    def occult(ids_BP: torch.Tensor, n: int, keep: bool = True) -> torch.Tensor:
        return hf.generate(model, ids_BP, n, cuda_graph=kind == "occult+graph", eos_token_id=[], reuse=keep)
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
    """(numbers, the ids of the first call): first call, one untimed, then `repeats` x (n tokens, 1 token)."""
    if new_tokens < 2:
        raise ValueError("timing a decode step from whole generate calls needs --new-tokens >= 2")
    first_ms, out = _wall_ms(lambda: gen(prompts_BP, new_tokens, True), device)
    _wall_ms(lambda: gen(prompts_BP, new_tokens, True), device)
    many, one = [], []
    for _ in range(repeats):
        many.append(_wall_ms(lambda: gen(prompts_BP, new_tokens, True), device)[0])
        one.append(_wall_ms(lambda: gen(prompts_BP, 1, False), device)[0])
    many, one = slowest(many, device), slowest(one, device)
    first_ms = slowest([first_ms], device)[0]
    many_ms, one_ms = quantiles(many, [0.5])[0], quantiles(one, [0.5])[0]
    step_ms = max(many_ms - one_ms, 1e-6) / (new_tokens - 1)
    B = prompts_BP.shape[0]
    return {"prefill_ms_p50": one_ms, "ms_p50": step_ms, "ms_p99": None, "step_ms_mean": step_ms,
            "generate_ms_p50": many_ms, "generate_ms_all": many, "one_token_ms_all": one,
            "first_call_s": first_ms / 1e3, "compile_s": max(first_ms - many_ms, 0.0) / 1e3,
            "decode_tokens_per_s_per_gpu": B / (step_ms / 1e3),
            "e2e_tokens_per_s_per_gpu": B * new_tokens / (many_ms / 1e3)}, out
