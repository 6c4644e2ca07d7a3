"""How much of AdamW's step would hide under a training forward on one GPU (a probe, not a feature).

AdamW's fused kernel reads and writes every parameter and both moments once a step: at OLMoE's shape about a fifth
of a one-GPU training step, on transformers' side and occult's alike (docs/training.md, "`--captured-step`").
It is memory-bound where the forward's GEMMs are compute-bound, so an update deferred into the next step's
forward (each block's parameters updated on a side stream just before that block runs) could hide part of it.
Before building that, this measures the bound: on the e2e.py model (OLMoE shape, `--layers`), after a few real
steps (AdamW's state made), CUDA-event medians of

    forward      a training forward + loss (autograd graph kept, then dropped)
    update       `optimizer.step()` (AdamW, bf16 parameters and moments: occult's; torch's fused: --optimizer torch)
    both         the forward on the current stream and the update on a side stream, launched together

and `hidden = (forward + update - both) / update`. In `both` the forward reads parameters the update is writing:
its numbers are not used, only its time.

    python -m torch.distributed.run --standalone --nproc-per-node 1 scripts/optimizer_overlap_probe.py \
        --layers 4 --variant replicated/compile --out probe.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import e2e  # noqa: E402  (benchmarks/e2e.py: the model and its conversion)
from _timing import time_steps, write_json  # noqa: E402

from occult.distributed import init_distributed  # noqa: E402
from occult.tools.run_record import run_record  # noqa: E402
from occult.training.optim import adamw  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="olmoe", choices=sorted(e2e.MODELS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--variant", default="replicated/compile", help="native/compile or an e2e.py one-rank variant")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--optimizer", default="occult", choices=["occult", "torch"], help="occult's AdamW or torch's fused one"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    init_distributed()
    if torch.distributed.get_world_size() != 1:
        raise SystemExit("optimizer_overlap_probe.py runs on one GPU: --nproc-per-node 1")
    device = torch.device("cuda", torch.cuda.current_device())
    eargs = e2e.parse_args(["--model", args.model, "--layers", str(args.layers)])
    model = e2e.build_model(eargs, e2e.model_config(eargs), device, torch.bfloat16)
    model = e2e.convert_variant(model, args.variant, None, torch.distributed.group.WORLD)
    optimizer = (
        adamw([{"params": list(model.parameters())}], lr=1e-6)
        if args.optimizer == "occult"
        else torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    )
    train = e2e.make_step(model, "train", optimizer)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size

    def ids() -> torch.Tensor:
        return e2e.random_ids(eargs.batch, eargs.seq, vocab, device, gen)

    for _ in range(3):  # compiled, AdamW's state made
        train(ids())
    batch = ids()
    side = torch.cuda.Stream(device)

    def forward() -> None:
        model(input_ids=batch, labels=batch, use_cache=False).loss.detach()

    def update() -> None:
        optimizer.step()

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            optimizer.step()
        forward()
        torch.cuda.current_stream(device).wait_stream(side)

    rounds = {name: [] for name in ("forward", "update", "both")}
    for _ in range(3):  # alternated: drift hits every measurement
        for name, fn in (("forward", forward), ("update", update), ("both", both)):
            rounds[name].append(statistics.median(time_steps(lambda _: fn(), lambda: None, 1, args.iters, device)))
    ms = {name: statistics.median(v) for name, v in rounds.items()}
    hidden = (ms["forward"] + ms["update"] - ms["both"]) / ms["update"]
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.model}, {args.layers} layers, {args.variant}, {args.optimizer} AdamW, {params / 1e9:.2f} B parameters: "
        "forward "
        f"{ms['forward']:.2f} ms, update {ms['update']:.2f} ms, both at once {ms['both']:.2f} ms -> "
        f"{100 * hidden:.0f}% of the update hidden",
        flush=True,
    )
    if args.out:
        write_json(
            args.out,
            {
                "config": vars(args),
                "parameters": params,
                "ms": ms,
                "rounds": rounds,
                "hidden_fraction": hidden,
                "env": {"gpu": torch.cuda.get_device_name(), **run_record(1, True)},
            },
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
