"""The training loss alone: transformers' `ForCausalLMLoss` against occult's cross-entropy (`occult.training.loss`).

Both take the same bf16 logits [tokens, vocabulary] (what a model's LM head gives) and labels, and return the loss;
timed is the loss and its backward to the logits' gradient (the LM head's own GEMMs are the same on both sides and
left out), in alternated rounds of CUDA-event medians, with the peak memory each adds beyond its inputs. GB/s count
the bytes the logits pass needs at the least: the logits read twice and their gradient written once (occult's
kernel's traffic), against a measured copy ceiling. Before timing, the loss and gradient of each against an fp32
reference of the same logits.

    python3 benchmarks/bench_loss.py --tokens 8192 --vocab 50304,151936 --out loss.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _timing import cuda_ms, write_json
from transformers.loss.loss_utils import ForCausalLMLoss

from occult.tools.run_record import run_record
from occult.training.loss import causal_lm_loss


def loss_step(loss_fn, logits_BSV: torch.Tensor, labels_BS: torch.Tensor):
    """One loss and backward from the leaf `logits_BSV` (its gradient dropped first)."""

    def step() -> torch.Tensor:
        logits_BSV.grad = None
        loss = loss_fn(logits_BSV, labels_BS, logits_BSV.shape[-1])
        loss.backward()
        return loss

    return step


def extra_peak_gib(step) -> float:
    """Peak memory one step allocates beyond what is allocated before it, GiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def errors(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, fns: dict) -> dict[str, dict[str, float]]:
    """Each side's loss and gradient against an fp32 reference (relative, the gradient's worst element over its
    largest)."""
    ref_x = logits_BSV.detach().float().requires_grad_()
    ref = ForCausalLMLoss(ref_x, labels_BS, ref_x.shape[-1])
    ref.backward()
    out = {}
    for name, fn in fns.items():
        x = logits_BSV.detach().clone().requires_grad_()
        loss = fn(x, labels_BS, x.shape[-1])
        loss.backward()
        scale = ref_x.grad.abs().max().item()
        out[name] = {
            "loss": abs(loss.item() - ref.item()) / abs(ref.item()),
            "grad": (x.grad.float() - ref_x.grad).abs().max().item() / scale,
        }
    return out


def copy_ceiling(device: torch.device) -> float:
    """GB/s (read + write) of a 4 GiB device-to-device copy."""
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / statistics.median(cuda_ms(lambda: dst.copy_(src), 10)) / 1e6


def one_vocabulary(vocab: int, args: argparse.Namespace, device: torch.device, copy_gbs: float) -> dict:
    batch = max(1, args.tokens // args.seq)
    gen = torch.Generator(device).manual_seed(vocab)
    logits = (torch.randn(batch, args.seq, vocab, device=device, generator=gen) * 2).to(torch.bfloat16)
    logits.requires_grad_()
    labels = torch.randint(vocab, (batch, args.seq), device=device, generator=gen)
    fns = {"transformers": ForCausalLMLoss, "occult": causal_lm_loss}
    checks = errors(logits, labels, fns)
    steps = {name: loss_step(fn, logits, labels) for name, fn in fns.items()}
    for step in steps.values():  # warm-up (Triton compiles)
        step()
    peak = {}
    for name, step in steps.items():
        logits.grad = None  # (what the step makes counts: its gradient too)
        peak[name] = extra_peak_gib(step)
    rounds = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            rounds[name].append(statistics.median(cuda_ms(step, args.iters)))
    ms = {name: statistics.median(v) for name, v in rounds.items()}
    least_bytes = 3 * logits.numel() * logits.element_size()
    return {
        "tokens": batch * args.seq,
        "vocab": vocab,
        "ms": ms,
        "rounds": rounds,
        "gb_per_s_least_bytes": {name: least_bytes / t / 1e6 for name, t in ms.items()},
        "of_copy": {name: least_bytes / t / 1e6 / copy_gbs for name, t in ms.items()},
        "extra_peak_gib": peak,
        "errors_vs_fp32": checks,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", default="50304,151936", help="comma list of vocabulary sizes (OLMoE's, Qwen3's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_loss.py times CUDA kernels: run it on a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    copy_gbs = copy_ceiling(device)
    results = [one_vocabulary(int(v), args, device, copy_gbs) for v in args.vocab.split(",")]
    print(f"copy ceiling {copy_gbs:.0f} GB/s")
    print("| tokens x vocab | transformers ms | occult ms | transformers / occult | extra GiB, transformers / occult |")
    print("|---|---|---|---|---|")
    for r in results:
        ms, peak = r["ms"], r["extra_peak_gib"]
        print(
            f"| {r['tokens']} x {r['vocab']} | {ms['transformers']:.2f} | {ms['occult']:.2f} | "
            f"{ms['transformers'] / ms['occult']:.2f}x | {peak['transformers']:.2f} / {peak['occult']:.2f} |"
        )
    if args.out:
        write_json(
            args.out,
            {
                "config": vars(args),
                "copy_gb_per_s": copy_gbs,
                "results": results,
                "env": {"gpu": torch.cuda.get_device_name(), **run_record(1, True)},
            },
        )


if __name__ == "__main__":
    main()
