"""Train a Megatron-Core GPTModel MoE with Megatron's `alltoall` dispatcher and with occult's (issue 54).

    torchrun --nproc-per-node 4 benchmarks/megatron_train.py --model olmoe --layers 4 --steps 100 --out r.json
    torchrun --nproc-per-node 2 benchmarks/megatron_train.py --model olmoe --layers 4 --micro-batches 4 \
        --variants alltoall,alltoall+overlap,occult,occult+overlap --out overlap.json

Megatron's own pieces throughout: `GPTModel` from its layer spec (Transformer Engine's with
`TEGroupedMLP` experts where TE imports, else the local spec with `SequentialMLP`: without TE
Megatron-Core has no grouped GEMM; the JSON says which ran), its `DistributedDataParallel`, its
optimizer (`get_megatron_optimizer`, Adam), expert parallelism over all ranks (data parallelism
over all ranks for the dense weights), bf16 on GPUs (every weight, norms too, as Megatron's
`Float16Module` makes them; fp32 on CPU). occult is switched on by
`occult.integrations.megatron.install(spec, ...)`, the one line a user adds.

Variants (`--variants`): `alltoall` (Megatron's), `occult` (dedup: one row per token and EP rank),
`occult-standard`, `occult+placement` (dedup with `--placement`, a JSON from `occult place`; the
expert weights moved to their placed ranks by `placed_local_experts`); each also with `+grouped`
(`alltoall+grouped`, `occult+grouped`: the experts Megatron's `TEGroupedMLP` over occult's `GroupedLinear`,
`occult.integrations.megatron.use_grouped_experts`: one grouped GEMM per fc1 and fc2 instead of
`SequentialMLP`'s GEMM per expert; the weights renamed between the two layouts), and then with `+overlap`
(`alltoall+overlap`, `occult+grouped+overlap`, ...): Megatron-Core's combined-1F1B expert-parallel overlap
(`overlap_moe_expert_parallel_comm`: one micro-batch's forward paired with another's backward, the
all-to-alls on a side stream), which needs `--micro-batches` >= 2 (the first forward and the last
backward run unpaired: 4 or more advised) and 2 or more ranks. Every variant starts from the same
weights (the first variant's, copied) and sees the same random tokens (fixed seed per rank, step and
micro-batch): their losses should agree to rounding. With `--micro-batches N` > 1 a step is Megatron's own schedule
(`get_forward_backward_func()`) over N micro-batches, then the optimizer's update; a step's loss is
the mean over its micro-batches (N = 1: one forward and backward per step, no schedule). A step's
time is the slowest rank's (CUDA events are not needed: the step ends with the optimizer's update,
then a device sync); tokens/s per GPU is micro-batch x micro-batches x sequence / the median step
time after `--warmup` steps.

Rank 0 writes the JSON (losses per step per variant, step times, tokens/s per GPU, occult's rows sent, the expert
module, micro-batches and overlap per variant, the fullest rank's peak GPU memory, the environment and run record)
atomically after every variant and prints a table last.
Shapes: OLMoE-1B-7B (hidden 2048, 64 experts, ffn 1024, top-8, 16 heads, vocab 50304), Qwen3-30B-A3B
(hidden 2048, 128 experts, ffn 768, top-8, 32 heads of 128 with 4 KV groups, vocab 151936), tiny
(a CPU smoke test). `--layers` cuts depth. On CPU ranks (gloo) Megatron's CUDA stream calls are
stubbed (occult.integrations.megatron.cpu), the overlap's schedule runs in order on one stream, and
`+overlap` variants are fp32 (Megatron refuses the overlap for fp32 models: on CPU the config passes
its check as bf16, then computes in fp32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _timing import environment, free_memory, log, slowest, synchronize, write_json  # noqa: E402  (benchmarks/_timing.py)

from occult.distributed import finish_distributed, init_distributed  # noqa: E402

SHAPES = {
    "olmoe": dict(hidden=2048, experts=64, ffn=1024, top_k=8, heads=16, kv_groups=16, head_dim=128, vocab=50304),
    "qwen3": dict(hidden=2048, experts=128, ffn=768, top_k=8, heads=32, kv_groups=4, head_dim=128, vocab=151936),
    "tiny": dict(hidden=32, experts=8, ffn=16, top_k=2, heads=4, kv_groups=4, head_dim=8, vocab=128),
}
BASE_VARIANTS = ("alltoall", "occult", "occult-standard", "occult+placement")
GROUPED = "+grouped"  # a variant's suffix: the experts TEGroupedMLP over occult's GroupedLinear (no TE needed)
OVERLAP = "+overlap"  # a variant's suffix: the same dispatcher under Megatron-Core's combined-1F1B EP overlap
VARIANTS = tuple(b + g + o for b in BASE_VARIANTS for g in ("", GROUPED) for o in ("", OVERLAP))


def split_variant(variant: str) -> tuple[str, bool]:
    """`occult+grouped+overlap` -> ("occult+grouped", True): the variant without the overlap, and whether it is on."""
    return variant.removesuffix(OVERLAP), variant.endswith(OVERLAP)


def dispatcher_variant(variant: str) -> str:
    """`occult+grouped+overlap` -> "occult": the dispatcher variant alone."""
    return split_variant(variant)[0].removesuffix(GROUPED)


def grouped_experts(variant: str) -> bool:
    """Whether `variant`'s experts are occult's grouped ones (`+grouped`)."""
    return split_variant(variant)[0].endswith(GROUPED)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="olmoe", help="layer shape (default olmoe)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers, all MoE (default 2)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per variant (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (default 5)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank and micro-batch (default 1)")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches per optimizer step, run by Megatron's get_forward_backward_func() when > 1\n"
        "(default 1: one forward and backward per step; +overlap variants need >= 2, 4 or more advised)",
    )
    p.add_argument(
        "--variants",
        default="alltoall,occult",
        help=f"comma list of {', '.join(BASE_VARIANTS)}, each also with {GROUPED}, then {OVERLAP}\n"
        f"(e.g. occult{GROUPED}: occult's grouped experts; alltoall{OVERLAP}: Megatron-Core's\n"
        "overlap_moe_expert_parallel_comm; default alltoall,occult)",
    )
    p.add_argument("--placement", default=None, help="placement JSON (occult place) for occult+placement")
    p.add_argument("--transport", default="auto", choices=("auto", "device", "counts"), help="occult's transport")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="write every number as JSON here (rank 0, atomically)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace, world: int) -> str | None:
    """The first problem with the flags, as one line naming the flag (None: all good)."""
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if not variants or unknown:
        return (
            f"--variants: unknown {unknown or 'empty list'}; choose from {', '.join(BASE_VARIANTS)}, "
            f"each also with {GROUPED}, then {OVERLAP}"
        )
    shape = SHAPES[args.model]
    for flag, value, low in (
        ("--layers", args.layers, 1),
        ("--steps", args.steps, 1),
        ("--seq", args.seq, 2),
        ("--micro-batches", args.micro_batches, 1),
    ):
        if value < low:
            return f"{flag} must be >= {low}, got {value}"
    if args.micro_batch < 1 or not 0 <= args.warmup < args.steps:
        return f"--micro-batch must be >= 1 and 0 <= --warmup < --steps (got {args.micro_batch}, {args.warmup})"
    if shape["experts"] % world:
        return (
            f"{args.model}'s {shape['experts']} experts do not split over {world} ranks: use a world size dividing it"
        )
    if any(dispatcher_variant(v) == "occult+placement" for v in variants) != (args.placement is not None):
        return "--placement is needed by the occult+placement variants, and only by them"
    if args.placement is not None:
        from occult.placement import Placement, PlacementError

        try:
            placement = Placement.load(args.placement)
        except (OSError, PlacementError) as e:
            return f"--placement: {e}"
        if (placement.num_experts, placement.num_devices) != (shape["experts"], world):
            return (
                f"--placement is for {placement.num_experts} experts on {placement.num_devices} devices; this run has "
                f"{shape['experts']} on {world}: occult place --devices {world} on a trace of this model"
            )
        if placement.num_layers not in (1, args.layers):
            return f"--placement has {placement.num_layers} layers; give 1 or --layers ({args.layers})"
    overlapped = [v for v in variants if split_variant(v)[1]]
    if overlapped:
        problem = overlap_problem(args, world)
        if problem:
            return f"--variants {overlapped[0]}: {problem}"
    return None


def overlap_problem(args: argparse.Namespace, world: int) -> str | None:
    """Why Megatron-Core would refuse its combined-1F1B EP overlap for this run, naming the fix (None: it runs).
    The settings this script could get wrong are checked by name; anything else Megatron's own config check
    refuses (its assertion message) is reported as it says."""
    if args.micro_batches < 2:
        return (
            "the overlap pairs one micro-batch's forward with another's backward: give --micro-batches >= 2 "
            f"(4 or more advised), got {args.micro_batches}"
        )
    if world < 2:
        return "Megatron-Core's overlap_moe_expert_parallel_comm needs expert parallelism > 1: run on 2 or more ranks"
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
        return f"Megatron-Core's overlap_moe_expert_parallel_comm needs torch >= 2.6: got {torch.__version__}"
    on_gpu = torch.cuda.is_available()
    try:
        model_config(args, world, torch.bfloat16 if on_gpu else torch.float32, not on_gpu, overlap=True)
    except (AssertionError, ValueError) as e:
        return f"Megatron-Core refuses overlap_moe_expert_parallel_comm here: {' '.join(str(e).split())}"
    return None


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def model_config(args: argparse.Namespace, world: int, dtype: torch.dtype, on_cpu: bool, overlap: bool = False) -> Any:
    """Megatron's TransformerConfig for one variant (`overlap`: Megatron-Core's combined-1F1B EP overlap on)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = SHAPES[args.model]
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=s["hidden"],
        num_attention_heads=s["heads"],
        num_query_groups=s["kv_groups"],
        kv_channels=s["head_dim"],
        ffn_hidden_size=s["ffn"],
        moe_ffn_hidden_size=s["ffn"],
        num_moe_experts=s["experts"],
        moe_router_topk=s["top_k"],
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=have_te(),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
        moe_router_dtype="fp32",
        moe_permute_fusion=False,
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        expert_model_parallel_size=world,
        bf16=dtype == torch.bfloat16 or overlap,  # fp32 CPU runs: Megatron's overlap check wants bf16 or fp16
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=on_cpu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        overlap_moe_expert_parallel_comm=overlap,
    )
    config.bf16 = dtype == torch.bfloat16  # checked when made: fp32 math again for the CPU smoke runs
    return config


def layer_spec(args: argparse.Namespace, variant: str) -> tuple[Any, str]:
    """Megatron's layer spec (TE's where it imports, else local; local with occult's grouped experts for `+grouped`),
    occult's dispatcher installed for occult variants."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = SHAPES[args.model]["experts"]
    if grouped_experts(variant):
        from occult.integrations.megatron import use_grouped_experts

        spec = specs.get_gpt_layer_local_spec(experts, moe_grouped_gemm=False, qk_layernorm=True)
        use_grouped_experts(spec)
        module = "TEGroupedMLP(GroupedLinear)"
    elif have_te():
        spec, module = (
            specs.get_gpt_layer_with_transformer_engine_spec(experts, moe_grouped_gemm=True, qk_layernorm=True),
            "TEGroupedMLP",
        )
    else:
        spec, module = (
            specs.get_gpt_layer_local_spec(experts, moe_grouped_gemm=False, qk_layernorm=True),
            "SequentialMLP",
        )
    base = dispatcher_variant(variant)
    if base.startswith("occult"):
        from occult.integrations.megatron import install

        dispatcher = "standard" if base == "occult-standard" else "dedup"
        placement = args.placement if base == "occult+placement" else None
        install(spec, dispatcher=dispatcher, placement=placement, transport=args.transport)
    return spec, module


def build(
    args: argparse.Namespace, variant: str, config: Any, device: torch.device, state: dict | None
) -> tuple[Any, Any, str]:
    """(Megatron DDP model, Megatron optimizer, expert module name) for one variant, from `state` when given
    (the first variant's weights; placed for occult+placement) before the optimizer copies them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    spec, module = layer_spec(args, variant)
    s = SHAPES[args.model]
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=s["vocab"],
        max_sequence_length=args.seq,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).to(device=device, dtype=config.params_dtype)  # every weight in it, as Megatron's Float16Module casts them:
    # without Apex or TE its norms are torch's, made in fp32, and bf16 inputs then missed the fused RMSNorm on GPUs
    if state is not None:
        from occult.integrations.megatron import to_grouped_expert_keys, to_sequential_expert_keys

        grouped = grouped_experts(variant) or have_te()  # TEGroupedMLP's keys, else SequentialMLP's
        state = to_grouped_expert_keys(state) if grouped else to_sequential_expert_keys(state)
        if dispatcher_variant(variant) == "occult+placement":
            from occult.integrations.megatron.placement import placed_local_experts
            from occult.placement import Placement

            state = placed_local_experts(state, Placement.load(args.placement))
        model.load_state_dict(state, strict=True)
    ddp = DistributedDataParallel(
        config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
    )
    if device.type != "cuda":  # Megatron's optimizer puts its loss scale on "cuda": torch's Adam on CPU smoke runs
        return ddp, MainGradAdam(ddp, args.lr), module
    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, bf16=config.bf16, params_dtype=config.params_dtype, clip_grad=1.0
    )
    return ddp, get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False), module


class MainGradAdam:
    """CPU stand-in for Megatron's optimizer: torch's Adam on the gradients Megatron's DDP reduced (`main_grad`)."""

    def __init__(self, model: Any, lr: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.adam = torch.optim.Adam(self.params, lr=lr)

    def zero_grad(self) -> None:
        self.adam.zero_grad(set_to_none=True)

    def step(self) -> None:
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)  # per rank: a smoke test, not Megatron's global norm
        self.adam.step()


def expert_types(model: Any) -> str:
    """The MoE layers' expert modules, with their grouped linear layers' class where they have them:
    "SequentialMLP", "TEGroupedMLP(GroupedLinear)" (occult's), "TEGroupedMLP(TEColumnParallelGroupedLinear)"."""
    experts = [m.experts for m in model.modules() if hasattr(m, "token_dispatcher")]
    linear = [f"({type(e.linear_fc1).__name__})" if hasattr(e, "linear_fc1") else "" for e in experts]
    names = {type(e).__name__ + fc1 for e, fc1 in zip(experts, linear)}
    return ",".join(sorted(names))


def batch(args: argparse.Namespace, index: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's random tokens and labels of micro-batch `index` (step x micro-batches + micro-batch: the step
    itself with one micro-batch per step), the same for every variant."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + dist.get_rank() * 10_007 + index)
    ids = torch.randint(0, SHAPES[args.model]["vocab"], (args.micro_batch, args.seq + 1), generator=gen)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's loss function protocol: the micro-batch's mean token loss (the schedule divides it by the number
    of micro-batches before backward) and what is reported (a copy: the schedule scales the loss in place)."""
    loss = per_token.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def step_function(args: argparse.Namespace, device: torch.device) -> Any:
    """Megatron's `forward_step_func` for this run's micro-batches: (data iterator, model) -> (per-token loss,
    loss function); under the overlap the schedule asks for the model's schedule plan instead of its output."""
    S = args.seq
    position_ids = torch.arange(S, device=device)[None].expand(args.micro_batch, S)
    # GPUs: Megatron's own causal mask (TE's and the local attention's); CPU: its default mask is made on "cuda"
    causal = None if device.type == "cuda" else torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), diagonal=1)

    def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> tuple[Any, Any]:
        ids, labels = next(data_iterator)
        if return_schedule_plan:  # the combined-1F1B schedule: `model` is the unwrapped GPTModel
            return model.build_schedule_plan(ids, position_ids, causal, labels=labels), loss_func
        return model(ids, position_ids, causal, labels=labels), loss_func

    return forward_step


def train(args: argparse.Namespace, model: Any, optimizer: Any, device: torch.device) -> tuple[list, list]:
    """`--steps` Megatron training steps -> (mean loss per step over all ranks and its micro-batches, slowest
    rank's step seconds). One micro-batch: forward, backward, grad sync, update; more: Megatron's
    forward-backward function over them (its no-sync and grad-finalising hooks, set in `run_variant`), update."""
    forward_step = step_function(args, device)
    forward_backward = None
    if args.micro_batches > 1:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_backward = get_forward_backward_func()
    N = args.micro_batches
    losses, seconds = [], []
    model.train()
    for step in range(args.steps):
        micro = [batch(args, step * N + i, device) for i in range(N)]
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        if forward_backward is None:
            output, _ = forward_step(iter(micro), model)
            loss, _ = loss_func(output)
            loss.backward()
            model.finish_grad_sync()
        else:
            reported = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[model],
                num_microbatches=N,
                seq_length=args.seq,
                micro_batch_size=args.micro_batch,
                forward_only=False,
            )
            loss = torch.stack([r["lm loss"] for r in reported]).mean()
        optimizer.step()
        synchronize(device)
        # every collective here reduces tensors on `device`: an NCCL group has no CPU backend
        seconds.extend(slowest([time.perf_counter() - t0], device))
        total = loss.detach().reshape(1).to(torch.float64)
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses, seconds


def table(results: dict[str, Any]) -> str:
    """Markdown: per variant, median step ms, tokens/s per GPU, speed-up over the first, last loss, loss gap."""
    names = list(results)
    first = results[names[0]]
    lines = [
        "| variant | experts | step ms (median) | tokens/s per GPU | speed-up | last loss | max rel. loss diff "
        "| peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        r = results[name]
        gap = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], first["losses"]))
        peak = "-" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.1f}"
        lines.append(
            f"| {name} | {r['expert_module']} | {r['step_ms_median']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | "
            f"{first['step_ms_median'] / r['step_ms_median']:.2f}x | {r['losses'][-1]:.4f} | {gap:.1e} | {peak} |"
        )
    return "\n".join(lines)


def release(model: Any) -> None:
    """Let `model` (and its optimizer) be freed once dropped. Megatron's DDP hooks every parameter's gradient
    accumulator, a C++ autograd node, with a closure over itself; the nodes stay alive through `grad_accs` and
    through any tensor kept with its graph (a dispatcher keeps its router's probs), so the model, its buffers and
    its optimizer formed a cycle the garbage collector cannot see: every variant of a run stayed in memory."""
    model.grad_accs.clear()
    helpers = [v for m in model.modules() for v in vars(m).values() if hasattr(v, "__dict__") and not callable(v)]
    for holder in [*model.modules(), *helpers]:  # the modules and what they hold (a token dispatcher is no module)
        for name, value in list(vars(holder).items()):
            if torch.is_tensor(value) and value.grad_fn is not None:
                setattr(holder, name, None)


def run_variant(args: argparse.Namespace, variant: str, device: torch.device, state: dict | None):
    """Build, train and time one variant -> (its results, its initial weights on this rank)."""
    from megatron.core import tensor_parallel

    world = dist.get_world_size()
    overlap = split_variant(variant)[1]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(args, world, dtype, device.type != "cuda", overlap)  # one per variant: hooks go on it
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, optimizer, module = build(args, variant, config, device, state)
    if args.micro_batches > 1:  # what Megatron's training loop gives its schedule: grads reduced once per step
        from megatron.core.distributed import finalize_model_grads

        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
    initial = (
        state
        if state is not None
        else {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items() if torch.is_tensor(v)}
    )
    losses, seconds = train(args, model, optimizer, device)
    median_s = statistics.median(seconds[args.warmup :])
    rows = sum(
        m.token_dispatcher.last_comm_stats.dispatch_rows
        for m in model.modules()
        if getattr(getattr(m, "token_dispatcher", None), "last_comm_stats", None) is not None
    )
    rows = torch.tensor([rows], dtype=torch.int64, device=device)  # on the device: NCCL reduces no CPU tensors
    dist.all_reduce(rows)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the fullest rank's: what must fit on the card
    result = {
        "expert_module": expert_types(model) or module,
        "optimizer": type(optimizer).__name__,
        "dispatcher": type(
            next(m for m in model.modules() if hasattr(m, "token_dispatcher")).token_dispatcher
        ).__name__,
        "losses": losses,
        "step_s": seconds,
        "step_ms_median": 1e3 * median_s,
        "tokens_per_s_per_gpu": args.micro_batch * args.micro_batches * args.seq / median_s,
        "micro_batches": args.micro_batches,
        "overlap": overlap,  # Megatron-Core's overlap_moe_expert_parallel_comm
        # occult's rows sent in the last forward (the last step's last micro-batch), all layers and ranks (alltoall:
        # k x tokens x layers, one micro-batch's tokens)
        "dispatch_rows_last_step": int(rows) if variant.startswith("occult") else None,
        "grouped_experts": grouped_experts(variant),
        "peak_memory_gib": int(peak) / 2**30 if device.type == "cuda" else None,  # model, optimizer and steps
        "tokens_x_topk_x_layers": args.micro_batch
        * args.seq
        * dist.get_world_size()
        * SHAPES[args.model]["top_k"]
        * args.layers,
    }
    release(model)
    del model, optimizer
    free_memory(device)
    return result, initial


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = init_distributed()
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*|.*Apex.*")  # Megatron's, as it imports
    problem = check_args(args, world)
    if problem:
        if rank == 0:
            print(f"megatron_train.py: error: {problem}", file=sys.stderr, flush=True)
        finish_distributed(ok=False)
        return 2
    run(args, world)
    finish_distributed(ok=True)
    return 0


def run(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """Every variant of checked `args` in this rank of `world` -> the report (rank 0 also writes `--out`)."""
    rank = dist.get_rank()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    from megatron.core import parallel_state

    from occult.integrations.megatron.cpu import cpu_shims, without_transformer_engine

    cpu_shims() if not on_gpu else without_transformer_engine()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world, create_gloo_process_groups=False)
    import megatron.core

    env = {**environment(device, world), "megatron_core": megatron.core.__version__, "transformer_engine": have_te()}
    report: dict[str, Any] = {"args": vars(args), "env": env, "variants": {}}
    state = None
    for variant in args.variants.split(","):
        log(f"{variant}: {args.steps} steps of {args.model} x {args.layers} layers on {world} ranks ...")
        report["variants"][variant], state = run_variant(args, variant, device, state)
        if rank == 0 and args.out:
            write_json(args.out, report)
    log(table(report["variants"]))
    return report


if __name__ == "__main__":
    sys.exit(main())
