"""Session 37 diagnosis: the traced sync-free fp16 case's gradient distance, per parameter, over several seeds.
torchrun --nproc-per-node 2 diag_traced.py SEED [SEED ...]"""
import os, sys
import torch, torch.distributed as dist
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "gpu"))
import test_collective_traced_moe as t
from occult.integrations import hf
import occult

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)

def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()

def routing(model, ids):
    """Each MoE layer's top-k expert ids, eager, by hooking the router modules' outputs."""
    got = []
    hooks = [m.register_forward_hook(lambda mod, i, o: got.append(o[0] if isinstance(o, tuple) else o))
             for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return got

for fam in ["deepseek_v3"]:
    for seed_s in sys.argv[1:]:
        seed = int(seed_s) + 303
        for dtype in (torch.float16, torch.bfloat16):
            gen = torch.Generator().manual_seed(seed + rank)
            ids = torch.randint(3, t.VOCAB, (4, 64), generator=gen).to(dev)
            exact, _ = t._step(t._model(fam, seed, torch.float32, dev), ids)
            model = t._model(fam, seed, dtype, dev)
            ref, _ = t._step(model, ids)
            torch._dynamo.reset()
            hf.compile_layers(model, trace_moe=True)
            got, _ = t._step(model, ids)
            errs = sorted(((rel(got[n], ref[n]), n, rel(ref[n], exact[n]), rel(got[n], exact[n])) for n in ref), reverse=True)
            over = sum(e > 0.05 for e, *_ in errs)
            print(f"rank{rank} {fam} {dtype} seed {seed_s}: params {len(errs)}, over 0.05: {over}; worst 5 (got-vs-eager, name, eager-vs-fp32, got-vs-fp32):", flush=True)
            for e in errs[:5]:
                print(f"   {e[0]:.4f} {e[1]} {e[2]:.4f} {e[3]:.4f}", flush=True)
            med = sorted(e for e, *_ in errs)[len(errs) // 2]
            print(f"   median {med:.5f}", flush=True)
dist.destroy_process_group()
