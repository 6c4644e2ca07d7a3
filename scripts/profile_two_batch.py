"""Where does two-batch overlap spend its time on one GPU (no traffic to hide, so pure overhead)?

    python scripts/profile_two_batch.py [--layers 8] [--tokens 8192] [--out DIR]

One process, an OLMoE-1B-7B-shape transformers model (random bf16 weights, --layers decoder
layers) converted with `hf.convert` (dedup, one rank: exchanges are local copies). Times the
prefill forward (median of --iters, CUDA events) whole and with `two_batch_overlap`, with fresh
threads per call and with the persistent workers; measures one baton hand-over; profiles one
two-batch prefill with torch.profiler (top host ops by self CPU time, GPU busy time) and writes
the Chrome trace to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import torch  # noqa: E402

import occult.moe.two_batch as tb  # noqa: E402
from occult.integrations import hf  # noqa: E402


def median_ms(step, iters: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def handover_us(n: int = 500) -> float:
    def fn(x):
        pause = tb.pause_point()
        for _ in range(n):
            pause()
        return x
    t0 = time.perf_counter()
    tb.two_batch_overlap(fn, torch.zeros(2, 1))
    return (time.perf_counter() - t0) / (2 * n) * 1e6


def main() -> None:
    import transformers
    from e2e import MODELS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cls, fields = MODELS["olmoe"]
    cfg = getattr(transformers, cls)(**{**fields, "num_hidden_layers": args.layers, "tie_word_embeddings": False})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.convert(model, dispatcher="dedup")
    model.eval()
    ids = torch.randint(cfg.vocab_size, (args.tokens // args.seq, args.seq), device="cuda")

    def whole():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    def halves():
        with torch.no_grad():
            tb.two_batch_overlap(lambda x: model(input_ids=x, use_cache=False, logits_to_keep=1).logits, ids)

    rows = {"whole": median_ms(whole, args.iters)}
    tb._FRESH_THREADS = True
    rows["two-batch, fresh threads"] = median_ms(halves, args.iters)
    rows["handover us, fresh"] = handover_us()
    tb._FRESH_THREADS = False
    rows["two-batch, persistent workers"] = median_ms(halves, args.iters)
    rows["handover us, persistent"] = handover_us()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        halves()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0)
    rows["profiled two-batch: GPU busy ms"] = gpu_us / 1e3
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.out, "two_batch_trace.json"))
    print(f"OLMoE shape, {args.layers} layers, {args.tokens} tokens, 1 GPU ({torch.cuda.get_device_name()})")
    print("| measure | value |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")


if __name__ == "__main__":
    main()
