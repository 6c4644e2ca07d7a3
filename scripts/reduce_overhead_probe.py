"""Does a sync-free `OccultMoE` layer (the decode path) run under torch.compile, mode="reduce-overhead"?

    python scripts/reduce_overhead_probe.py [--tokens 64] [--model-layers 2] [--out probe.json]
    torchrun --nproc-per-node 2 scripts/reduce_overhead_probe.py     # expert parallel over NCCL

One rank per GPU. With one rank there is no process group and the exchange is a local copy, so
that checks the layer's own tracing and graph capture; under torchrun the experts are sharded
over the ranks and the all-to-alls are traced too (every rank draws its own tokens, the same
count; rank 0 prints). OLMoE-1B-7B layer shape, bf16, Triton expert path.
For eager, torch.compile (default), torch.compile(mode="reduce-overhead") and a hand-captured
CUDA graph: whether it runs, graph breaks (torch._dynamo.explain), the largest relative error
against eager on fresh inputs, and the median time per forward (CUDA events). Then the same for
a decode step (one new token per sequence, no KV cache) of a converted transformers OLMoE-shape
model with --model-layers layers (`hf.convert`, `set_sync_free`). Prints two tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

from occult import OccultMoE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _timing import capture_graph  # noqa: E402  (benchmarks/_timing.py)


def median_ms(fn, x_list: list[torch.Tensor], warmup: int = 5) -> float:
    for x in x_list[:warmup]:
        fn(x)
    torch.cuda.synchronize()
    times = []
    for x in x_list:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def graphed(layer: torch.nn.Module, static_x: torch.Tensor):
    """A hand-captured CUDA graph of the forward: copy the input in, replay, read the output."""
    return capture_graph(layer, static_x)[0]


def probe(module, xs: list[torch.Tensor], static_x: torch.Tensor) -> dict:
    """Eager, compile, compile reduce-overhead and a hand-captured graph of `module` on `xs`."""
    rows = {}
    with torch.no_grad():
        ref = [module(x).clone() for x in xs[:4]]
        rows["eager"] = {"runs": True, "max_rel_err": 0.0, "ms": median_ms(module, xs)}
        for name, make in (
            ("compile", lambda: torch.compile(module)),
            ("compile reduce-overhead", lambda: torch.compile(module, mode="reduce-overhead")),
            ("cuda graph (by hand)", lambda: graphed(module, static_x)),
        ):
            row: dict = {"runs": False}
            try:
                torch._dynamo.reset()
                if name.startswith("compile"):
                    ex = torch._dynamo.explain(module)(xs[0])
                    row["graph_breaks"] = ex.graph_break_count
                    row["break_reasons"] = [str(r.reason)[:300] for r in ex.break_reasons][:5]
                    torch._dynamo.reset()
                fn = make()
                outs = [fn(x).clone() for x in xs[:4]]
                row["max_rel_err"] = max(rel(o, r) for o, r in zip(outs, ref))
                row["ms"] = median_ms(fn, xs)
                row["runs"] = True
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                row["traceback"] = traceback.format_exc()[-2000:]
            rows[name] = row
    return rows


def print_table(title: str, rows: dict) -> None:
    print(title)
    print("| mode | runs | graph breaks | max rel err vs eager | ms median |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['runs']} | {r.get('graph_breaks', '-')} | {r.get('max_rel_err', float('nan')):.1e} | "
            f"{r.get('ms', float('nan')):.3f} |" + (f" {r['error'][:120]}" if "error" in r else "")
        )


def model_step(layers: int, tokens: int, iters: int) -> tuple:
    """A converted, sync-free OLMoE-shape model; its decode step as a module of ids [B, 1] -> logits."""
    import os

    import transformers

    from occult import set_sync_free
    from occult.integrations import hf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from e2e import MODELS  # benchmarks/ is on sys.path (above)

    cls, fields = MODELS["olmoe"]
    cfg = getattr(transformers, cls)(**{**fields, "num_hidden_layers": layers, "tie_word_embeddings": False})
    with torch.device("cuda", torch.cuda.current_device()):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.convert(model, dispatcher="dedup")
    set_sync_free(model)
    model.eval()

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids_B1: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids_B1, use_cache=False).logits

    xs = [torch.randint(cfg.vocab_size, (tokens, 1), device=torch.cuda.current_device()) for _ in range(iters)]
    return Step(), xs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--model-layers", type=int, default=2, help="decoder layers of the model probe (0: skip it)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from occult.distributed import init_distributed

        init_distributed()  # NCCL, one GPU per rank; OccultMoE and hf.convert shard over the world
    dev = torch.device("cuda", torch.cuda.current_device())
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.manual_seed(0)  # the same weights on every rank; the tokens differ per rank below
    layer = OccultMoE(2048, 1024, 64, 8, sync_free=True, dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        layer.router.gate.weight.normal_(0, 0.05)
    torch.manual_seed(1 + rank)
    xs = [torch.randn(args.tokens, 2048, dtype=torch.bfloat16, device=dev) for _ in range(args.iters)]
    report = {"layer": probe(layer, xs, xs[0].clone())}
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    head = f"{args.tokens} tokens per GPU, {world} GPU(s) ({torch.cuda.get_device_name()}), torch {torch.__version__}"
    if rank == 0:
        print_table(f"sync-free OccultMoE, OLMoE layer shape, bf16, {head}", report["layer"])
    if args.model_layers > 0:
        step, ids = model_step(args.model_layers, args.tokens, args.iters)
        report["model"] = probe(step, ids, ids[0].clone())
        if rank == 0:
            print_table(
                f"decode step of a converted OLMoE-shape model, {args.model_layers} layers, sync-free, {head}",
                report["model"],
            )
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
