"""Time one expert migration (`occult.lm.migrate.migrate`: weights + AdamW state, one all-to-all)
on N ranks for a given MoE shape: random new placements, bytes each rank sends, seconds.

    python benchmarks/migrate_time.py --ranks 4 --experts 64 --top-k 8 --hidden 256 --ffn 256 --layers 2
    torchrun --nproc-per-node 4 benchmarks/migrate_time.py --backend nccl --experts 64 --top-k 8 \\
        --hidden 2048 --ffn 1024 --layers 16        # OLMoE shape on 4 GPUs (not run here: no GPUs lent)

The model is an `OccultLM` of that MoE shape (2 attention heads, a small vocabulary: only the
experts matter); AdamW state is materialised by one step with zero gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from occult.tools.run_record import run_record


def worker(rank: int, world: int, a: dict) -> dict:
    from occult.lm.migrate import migrate
    from occult.lm.model import ModelConfig
    from occult.lm.parallel import full_model, setup_parallel, shard_model
    from occult.lm.state import TrainConfig, make_optimizer, trainable_names
    from occult.placement import Placement

    par = setup_parallel()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if a["backend"] == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=a["hidden"],
        num_layers=a["layers"],
        num_heads=2,
        num_experts=a["experts"],
        top_k=a["top_k"],
        expert_ffn_size=a["ffn"],
        max_seq_len=16,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = shard_model(full_model(cfg, par), par)
    opt = make_optimizer(model, trainable_names(model, False), TrainConfig())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    rng = np.random.default_rng(1)
    per = cfg.num_experts // par.ep_size
    out = []
    for _ in range(a["repeats"]):
        new = Placement(
            np.stack([rng.permutation(np.arange(cfg.num_experts) // per) for _ in range(cfg.num_layers)]), par.ep_size
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        par.barrier()
        t0 = time.perf_counter()
        stats = migrate(model, opt, new, par)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append({"seconds": time.perf_counter() - t0, "bytes_sent": stats.bytes_sent, "moved": stats.experts_moved})
    return {"rank": rank, "runs": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    a = vars(p.parse_args())
    if "RANK" in os.environ:  # under torchrun
        from occult.distributed import init_distributed

        init_distributed(backend=a["backend"])
        import torch.distributed as dist

        res = worker(dist.get_rank(), dist.get_world_size(), a)
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, res)
        if dist.get_rank():
            return 0
    else:
        from occult.distributed import run_ranks

        results = run_ranks(worker, a["ranks"], a, timeout_s=600)
    expert_bytes = 3 * a["hidden"] * a["ffn"] * 4 * 3  # gate+up+down, fp32, weights + 2 AdamW moments
    print(
        f"{a['experts']} experts x {a['layers']} layers, H={a['hidden']} F={a['ffn']}: {expert_bytes / 1e6:.2f} MB per "
        "expert (weights + AdamW moments, fp32)"
    )
    for i in range(a["repeats"]):
        secs = max(r["runs"][i]["seconds"] for r in results)
        sent = max(r["runs"][i]["bytes_sent"] for r in results)
        print(
            f"  migration {i}: {results[0]['runs'][i]['moved']} experts moved, max {sent / 1e6:.1f} MB sent per rank, "
            f"{secs * 1e3:.1f} ms (slowest rank)"
        )
    if a["out"]:
        with open(a["out"], "w") as f:
            json.dump(
                {"settings": a, "env": run_record(a["ranks"], a["backend"] == "nccl"), "results": results}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
