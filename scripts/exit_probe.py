"""Does a 2-rank run end after compile_layers + graph-captured decode? (issue 37's hang at exit)

    torchrun --nproc-per-node 2 scripts/exit_probe.py [--layers 4] [--no-compile] [--no-graph] [--before NAME]
        [--transport auto|device|counts]

Each rank converts an OLMoE-shape model (random weights), compiles its decoder layers, generates
with the decode step captured in a CUDA graph at B=1 and B=8, then leaves the process group.
Found with it: the decode graph kept on the model for the next call holds captured NCCL
collectives, and destroy_process_group waited for it forever (`--before release` ended at once;
occult.teardown now does that release inside destroy_process_group). Every
phase is printed with its time; a rank still running 25 s after its last phase dumps every
thread's stack (faulthandler) to stderr, so a hang names where it waits.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch
import torch.distributed as dist


def say(rank: int, t0: float, what: str) -> None:
    print(f"[rank {rank} {time.perf_counter() - t0:7.1f} s] {what}", flush=True)


def _release_decoder(model: torch.nn.Module) -> None:
    if hasattr(model, "_occult_decoder"):
        model._occult_decoder[1].release()
        del model._occult_decoder
    import gc

    gc.collect()
    torch.cuda.synchronize()


def _dynamo_reset(model: torch.nn.Module) -> None:
    torch._dynamo.reset()


def _workers_shutdown(model: torch.nn.Module) -> None:
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()


BEFORE = {
    "nothing": lambda model: None,
    "release": _release_decoder,
    "dynamo-reset": _dynamo_reset,
    "workers-shutdown": _workers_shutdown,
    "all": lambda model: (_release_decoder(model), _dynamo_reset(model), _workers_shutdown(model)),
}


def main() -> None:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from occult import ExecConfig
    from occult.distributed import finish_distributed, init_distributed
    from occult.integrations import hf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-graph", action="store_true", help="generate eagerly (cuda_graph=False)")
    parser.add_argument(
        "--teardown",
        choices=["destroy", "finish"],
        default="destroy",
        help="dist.destroy_process_group() as the issue's run, or occult's finish_distributed",
    )
    parser.add_argument(
        "--before",
        choices=sorted(BEFORE),
        default="nothing",
        help="what runs just before the teardown (which one lets it end names the cause)",
    )
    parser.add_argument(
        "--transport",
        choices=["auto", "device", "counts"],
        default="auto",
        help="the layers' transport: 'counts' decodes sync-free over NCCL, so the decode graph "
        "holds captured NCCL collectives (the hang's configuration; 'auto' is the device "
        "transport on NVLink, whose graph holds none)",
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    rank, _ = init_distributed()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = OlmoeConfig(
        hidden_size=1024,
        intermediate_size=512,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_experts=64,
        num_experts_per_tok=8,
        vocab_size=32000,
        max_position_embeddings=1024,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(dev):
        model = OlmoeForCausalLM(cfg).to(torch.bfloat16).eval()
    hf.convert(model, execution=ExecConfig(dispatcher="dedup", transport=args.transport))
    if not args.no_compile:
        hf.compile_layers(model)
    say(rank, t0, "converted" + ("" if args.no_compile else " + compile_layers"))
    gen = torch.Generator(device=dev).manual_seed(rank)
    for batch in (1, 8):
        prompt = torch.randint(1, cfg.vocab_size, (batch, 64), device=dev, generator=gen)
        for _ in range(2):
            out = hf.generate(model, prompt, 16, cuda_graph=not args.no_graph, eos_token_id=[])
        say(rank, t0, f"generated B={batch}: {tuple(out.shape)}")
    faulthandler.dump_traceback_later(25, exit=True, file=sys.stderr)
    BEFORE[args.before](model)
    say(rank, t0, f"before teardown: {args.before}")
    if args.teardown == "destroy":
        torch.cuda.synchronize()
        dist.destroy_process_group()
    else:
        del model, out
        finish_distributed(True)
    say(rank, t0, f"left the process group ({args.teardown})")
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
