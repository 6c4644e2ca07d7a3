# One expert-parallel MoE layer on every rank (README.md, "Using the layer"). One process per device:
#   occult place --trace occult/data/example_trace.safetensors --devices 2 --out placement.json
#   torchrun --nproc-per-node 2 examples/using_the_layer.py --placement placement.json
# CPU ranks use gloo (fp32), GPUs NCCL (bf16, one GPU per rank); tests/test_readme_examples.py runs it.
import argparse

import torch

from occult import ExecConfig, MoEConfig, OccultMoE, Placement, RoutingConfig
from occult.distributed import finish_distributed, init_distributed

p = argparse.ArgumentParser(description="one expert-parallel MoE layer on every torchrun rank")
p.add_argument("--hidden", type=int, default=2048)
p.add_argument("--ffn", type=int, default=1024)
p.add_argument("--experts", type=int, default=64)
p.add_argument("--top-k", type=int, default=8)
p.add_argument("--tokens", type=int, default=4096, help="tokens on this rank: any number, even 0")
p.add_argument("--placement", help="a placement for as many devices as ranks (default: contiguous)")
args = p.parse_args()

rank, world = init_distributed()  # torchrun's environment; NCCL on GPUs, gloo on CPU; bounded timeouts
cuda = torch.cuda.is_available()
device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
dtype = torch.bfloat16 if cuda else torch.float32
placement = Placement.load(args.placement) if args.placement else None  # None: contiguous
torch.manual_seed(0)  # the router is replicated: the same weights on every rank
moe = OccultMoE(
    MoEConfig(hidden_size=args.hidden, ffn_size=args.ffn, num_experts=args.experts, top_k=args.top_k, dtype=dtype),
    routing=RoutingConfig(norm_topk_prob=False),  # max_devices=N: collaboration pruning
    execution=ExecConfig(dispatcher="dedup"),  # sync_free, expert_backend, transport, graphs
    placement=placement,
    layer_index=0,
    device=device,
)
torch.manual_seed(1 + rank)  # each rank its own tokens
x_TH = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
y_TH = moe(x_TH)  # this rank's tokens, each its top-k experts' gate-weighted sum, wherever they live
y_TH.float().square().mean().backward()  # gradients reach x, the router and this rank's experts
sent = moe.last_comm_stats  # rows and bytes this rank sent in forward and backward
print(f"rank {rank} of {world}: y {tuple(y_TH.shape)}, {sent.dispatch_rows} rows dispatched")
finish_distributed()
