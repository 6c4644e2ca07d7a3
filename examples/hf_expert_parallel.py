"""A transformers MoE model, expert-parallel with occult: profile -> place -> convert -> generate -> fine-tune.

Run one process per device with torchrun (CPU ranks use gloo, GPUs NCCL, one GPU per rank):

    # offline smoke run on a tiny random model (olmoe, qwen2_moe, qwen3_moe, mixtral, deepseek_v3)
    torchrun --nproc-per-node 4 examples/hf_expert_parallel.py --tiny olmoe

    # a real model: every rank loads the full model, then keeps only its experts
    torchrun --nproc-per-node 4 examples/hf_expert_parallel.py --model /models/OLMoE-1B-7B-0924 \\
        --data calib.txt --prompt-data calib.txt --tokens 65536 --method hypergraph --save out/

Its files (the tiny model, trace.safetensors, placement.json, the similarity table) go to
`--workdir DIR`, by default a fresh temporary directory that is removed at the end (the
repository stays clean); `--save DIR` keeps the fine-tuned model.

What it does, on every rank:
 1. load the model (bf16 on GPUs, fp32 on CPU);
 2. profile: each rank runs its share of the calibration windows through the model's own
    routers; the routing trace (all ranks' tokens) is written to WORKDIR/trace.safetensors;
 3. place: rank 0 solves a placement from the trace (`occult.placement.solvers.place`, like
    `occult place`) and shares it; E[C_T] under the contiguous layout and the placement is
    printed;
 4. convert: each MoE block keeps only this rank's experts (weights permuted by the placement);
    `--max-devices N` turns on collaboration pruning;
 5. generate greedily on each rank's own prompts (`synced_gpus=True`: ranks step together);
    with `--check`, the tokens are compared with the unconverted model's;
 6. a short fine-tune (AdamW, `--steps` on one batch per rank): (loss / world).backward(),
    `hf.sync_gradients(average=False)` (replicated gradients summed), optimizer step; with pruning on,
    only MoE blocks train (as in the paper);
 7. `--save DIR`: the standard transformers layout (experts un-permuted), loadable with plain
    `AutoModelForCausalLM.from_pretrained(DIR)`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from occult.distributed import finish_distributed, init_distributed  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.integrations.hf import calibration_windows, token_stream  # noqa: E402
from occult.placement import Placement  # noqa: E402
from occult.placement.stats import mean_ct  # noqa: E402


def log(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a transformers model directory")
    src.add_argument("--tiny", choices=sorted(hf.FAMILIES), help="build a tiny random model of this family")
    p.add_argument("--data", default="random", help="calibration data (.txt/.jsonl/.safetensors/.npy/.pt or 'random')")
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens in all")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument(
        "--method",
        default="hypergraph",
        choices=["contiguous", "greedy", "hypergraph"],
        help="placement solver (hypergraph keeps the best of itself, greedy and contiguous)",
    )
    p.add_argument("--dispatcher", default="dedup", choices=["dedup", "standard"])
    p.add_argument("--max-devices", type=int, default=None, help="collaboration pruning: at most N devices per token")
    p.add_argument("--prune-method", default="score", choices=["score", "similarity"])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="fine-tune steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--check", action="store_true", help="compare generation with the unconverted model")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: bf16 on GPUs, fp32 on CPU")
    p.add_argument(
        "--workdir",
        default=None,
        help="keep the tiny model, trace, placement and similarity table here (default: a temporary "
        "directory on rank 0's host, removed at the end; give a shared path for several hosts)",
    )
    p.add_argument("--save", default=None, help="save the fine-tuned model here (standard layout)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rank, world = init_distributed()
    own_workdir = args.workdir is None
    if own_workdir:  # one temporary directory, named by rank 0, shared by every rank of this host
        box = [tempfile.mkdtemp(prefix="occult-hf-ep-") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        args.workdir = box[0]
    try:
        run(args, rank, world)
        dist.barrier()  # every rank is done with the work directory
    finally:
        if own_workdir and rank == 0:
            shutil.rmtree(args.workdir, ignore_errors=True)
    finish_distributed()


def run(args: argparse.Namespace, rank: int, world: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    os.makedirs(args.workdir, exist_ok=True)
    from transformers import AutoModelForCausalLM

    # 1. load
    model_dir = args.model
    if args.tiny:
        model_dir = os.path.join(args.workdir, f"tiny-{args.tiny}")
        if rank == 0:
            hf.tiny_random_model(args.tiny, model_dir)
        dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    family = hf.model_family(model)
    log(f"{family.model_type}: {len(hf.moe_blocks(model))} MoE layers, {world} ranks, {device.type}, {dtype}")

    # 2. profile (each rank a share of the windows; the trace holds all of them)
    windows = calibration_windows(
        token_stream(args.data, model_dir, int(model.config.vocab_size)), args.seq_len, args.tokens
    )
    if len(windows) < world:
        raise SystemExit(f"{len(windows)} calibration windows for {world} ranks: give more --tokens or data")
    mine = windows[rank::world]
    trace_path = os.path.join(args.workdir, "trace.safetensors")
    sim_path = os.path.join(args.workdir, "placement.similarity.safetensors")
    t0 = time.perf_counter()
    trace = hf.profile(
        model,
        (b.to(device) for b in mine.split(args.batch_size)),
        path=trace_path,
        similarity_path=sim_path,
    )
    log(f"profile: {trace.num_tokens[0]:,} tokens per layer in {time.perf_counter() - t0:.1f} s -> {trace_path}")

    # 3. place (rank 0 solves and reads the similarity table; every rank gets both)
    box = [None, None]
    if rank == 0:
        from occult.placement.solvers import place

        placement = place(trace, world, method=args.method).placement
        placement.save(os.path.join(args.workdir, "placement.json"))
        contiguous = Placement.contiguous(trace.num_experts, world, trace.num_layers)
        for i in range(trace.num_layers):
            before = mean_ct(trace.layer(i), contiguous.expert_device(i), world)
            after = mean_ct(trace.layer(i), placement.expert_device(i), world)
            log(f"  MoE layer {i}: E[C_T] contiguous {before:.3f} -> {args.method} {after:.3f} (top-{trace.top_k})")
        similarity = None
        if args.max_devices is not None and args.prune_method == "similarity":
            from occult.moe.pruning import load_similarity

            similarity = load_similarity(sim_path, trace.num_experts, trace.num_layers)
        box = [placement, similarity]
    dist.broadcast_object_list(box, src=0)
    placement, similarity = box

    # 4. convert
    hf.convert(
        model,
        placement=placement,
        dispatcher=args.dispatcher,
        max_devices=args.max_devices,
        prune_method=args.prune_method,
        similarity=similarity,
    )
    log(f"converted: {hf.moe_blocks(model)[0][1].experts}")

    # 5. generate on this rank's prompts (ranks may finish at different times: synced_gpus)
    prompt = windows[-(rank + 1)][None, : max(4, args.seq_len // 4)].to(device)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=args.new_tokens,
            do_sample=False,
            synced_gpus=True,
            pad_token_id=model.config.pad_token_id or 0,
        )
    new = out[0, prompt.shape[1] :].tolist()
    stats = hf.moe_blocks(model)[0][1].experts.last_comm_stats
    print(f"rank {rank}: generated {new}  (last step, MoE layer 0: {stats.forward_rows} rows sent)", flush=True)
    if args.check:
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        with torch.no_grad():
            ref = plain.generate(
                prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=model.config.pad_token_id or 0
            )
            a, b = model(out).logits.float(), plain(out).logits.float()
        same = torch.equal(ref, out)
        err = ((a - b).abs().max() / b.abs().max()).item()
        print(f"rank {rank}: same tokens as the unconverted model: {same}; logits max rel. diff {err:.1e}", flush=True)
        del plain
        if not same and args.max_devices is None and dtype == torch.float32:  # bf16 sums may flip a near-tie
            raise SystemExit(f"rank {rank}: generation differs from the unconverted model")

    # 6. fine-tune a few steps on one batch per rank (its loss should fall), replicated
    #    gradients all-reduced
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if args.max_devices is not None:  # the paper fine-tunes the MoE blocks only
        moe = {id(p) for _, b in hf.moe_blocks(model) for p in b.parameters()}
        params = [p for p in params if id(p) in moe]
    opt = torch.optim.AdamW(params, lr=args.lr)
    batch = mine[: args.batch_size].to(device)
    for step in range(args.steps):
        loss = model(batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        (loss / world).backward()  # each rank's share of the global mean: the sync then only sums
        hf.sync_gradients(model, average=False)  # (average=True after an unscaled backward: a pass more)
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        log(f"fine-tune step {step}: loss {mean_loss.item() / world:.4f}")

    # 7. save in the standard layout
    if args.save:
        hf.save_pretrained(model, args.save)
        log(f"saved to {args.save} (plain transformers can load it)")


if __name__ == "__main__":
    main()
