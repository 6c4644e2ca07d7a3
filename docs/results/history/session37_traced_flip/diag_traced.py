"""Session 37's diagnosis: the traced sync-free DeepSeek-V3 case's gradients per parameter, over several seeds.

torchrun --nproc-per-node 2 diag_traced.py SEED [SEED ...]   (from the repository root, on 2 GPUs)
Runs tests/gpu/test_collective_traced_moe.py's model and step (its seed + 303) in fp16 and bf16 and prints, per
rank, how many parameters are off by more than 0.05 and the five worst: traced against eager in the same dtype,
eager against fp32, traced against fp32.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.getcwd(), "tests", "gpu"))
import test_collective_traced_moe as t  # noqa: E402

from occult.integrations import hf  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def one_case(rank: int, dev: torch.device, seed: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(seed + rank)
    ids = torch.randint(3, t.VOCAB, (4, 64), generator=gen).to(dev)
    exact, _ = t._step(t._model("deepseek_v3", seed, torch.float32, dev), ids)
    model = t._model("deepseek_v3", seed, dtype, dev)
    ref, _ = t._step(model, ids)
    torch._dynamo.reset()
    hf.compile_layers(model, trace_moe=True)
    got, _ = t._step(model, ids)
    errs = sorted(((rel(got[n], ref[n]), n, rel(ref[n], exact[n]), rel(got[n], exact[n])) for n in ref), reverse=True)
    over = sum(e > 0.05 for e, *_ in errs)
    median = sorted(e for e, *_ in errs)[len(errs) // 2]
    print(f"rank{rank} {dtype} seed {seed - 303}: params {len(errs)}, over 0.05: {over}, median {median:.5f}")
    for traced_eager, name, eager_fp32, traced_fp32 in errs[:5]:
        print(f"   {traced_eager:.4f} {name} {eager_fp32:.4f} {traced_fp32:.4f}", flush=True)


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    for seed in sys.argv[1:]:
        for dtype in (torch.float16, torch.bfloat16):
            one_case(rank, torch.device("cuda", rank), int(seed) + 303, dtype)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
