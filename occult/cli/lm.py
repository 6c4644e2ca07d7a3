"""`occult train / finetune / profile` for the small MoE language model (`occult.lm`; `occult data`: `occult.cli.data`).

The argument definitions import nothing heavy (`occult --help` stays fast); each `run_*`
imports `occult.lm` when its command runs. The defaults mirror `occult.lm.model.ModelConfig`,
`occult.lm.train.TrainConfig` and `occult.lm.data`; tests/lm/test_train.py checks they agree.
`occult profile` of an occult checkpoint runs `run_profile` here; of a transformers model
directory, `occult.cli.hf.run_profile` (the command line chooses, in `occult.cli`).

Under torchrun with more than one rank (`torchrun --nproc-per-node N -m occult train ...`),
`train` and `finetune` shard the experts over `--ep-size` ranks (default: all) by
`--ep-placement` and train everything else data parallel (`occult.lm.parallel`; replicated gradients
by torch DDP, `--grad-sync explicit`, or sharded with FSDP2, `--grad-sync fsdp`); rank 0 prints.
"""

from __future__ import annotations

import argparse

from occult.cli.inputs import check_checkpoint, input_error, load_token_data, reading
from occult.cli.interrupt import interruptible
from occult.cli.registry import (
    Command,
    check_input,
    check_output,
    check_output_dir,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    positive_int_at_most,
)

# ModelConfig defaults
HIDDEN, LAYERS, HEADS, EXPERTS, TOP_K, EXPERT_FFN, EXPERT_BACKEND = 256, 4, 4, 32, 4, 256, "auto"
# TrainConfig defaults
STEPS, BATCH_SIZE, SEQ_LEN, LR, MIN_LR_RATIO, WARMUP = 2000, 32, 256, 1e-3, 0.1, 100
WEIGHT_DECAY, GRAD_CLIP, AUX_LOSS_COEF, SEED, PRECISION, DEVICE = 0.1, 1.0, 0.01, 0, "auto", "auto"
ADAM_EPS = 1e-8
MAX_SEQ_LEN = 1 << 20  # occult.lm.checkpoint.MAX_SEQ_LEN: rotary tables of that many positions
REPLACE_MIN_GAIN, REPLACE_CHECK, REPLACE_SAMPLES = 0.02, 10, 2048
EVAL_EVERY, EVAL_TOKENS, SAVE_EVERY = 200, 131072, 500
FINETUNE_LR, FINETUNE_WARMUP = 3e-4, 20


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--hidden", type=positive_int, default=HIDDEN, help=f"hidden size (default {HIDDEN})")
    g.add_argument(
        "--layers", type=positive_int, default=LAYERS, help=f"decoder blocks, each with an MoE (default {LAYERS})"
    )
    g.add_argument("--heads", type=positive_int, default=HEADS, help=f"attention heads (default {HEADS})")
    g.add_argument("--experts", type=positive_int, default=EXPERTS, help=f"experts per MoE layer (default {EXPERTS})")
    g.add_argument("--top-k", type=positive_int, default=TOP_K, help=f"experts per token (default {TOP_K})")
    g.add_argument(
        "--expert-ffn", type=positive_int, default=EXPERT_FFN, help=f"expert SwiGLU width (default {EXPERT_FFN})"
    )
    g.add_argument(
        "--norm-topk-prob", action="store_true", help="renormalise the top-k gate weights to sum 1 (default: off)"
    )
    g.add_argument(
        "--expert-backend",
        default=EXPERT_BACKEND,
        choices=["auto", "torch", "triton"],
        help=f"expert MLP: the torch reference, the Triton kernels, or auto (Triton on a CUDA GPU, else torch) (default {EXPERT_BACKEND})",
    )


def _add_data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--corpus-dir",
        default=None,
        help="prepared directory (occult data prepare) or a folder of *_gut.txt texts (default: the cached corpus)",
    )
    g.add_argument(
        "--tokenizer", default=None, help="tokenizer.json (default: CORPUS_DIR/tokenizer.json, else trained)"
    )


def add_train_arguments(p: argparse.ArgumentParser, finetune: bool = False) -> None:
    if not finetune:
        add_model_arguments(p)
    _add_data(p)
    g = p.add_argument_group("optimisation")
    g.add_argument("--out", required=True, help="run directory (checkpoints, metrics)")
    g.add_argument(
        "--steps",
        type=positive_int,
        default=STEPS,
        help=f"optimizer steps (default {STEPS}); may grow on --resume: the learning rate "
        "goes on from its value at the resume step along a new cosine to the floor at the new last step",
    )
    g.add_argument(
        "--batch-size",
        type=positive_int,
        default=BATCH_SIZE,
        help=f"sequences per optimizer step, all ranks together (default {BATCH_SIZE})",
    )
    g.add_argument(
        "--seq-len",
        type=positive_int_at_most(MAX_SEQ_LEN),
        default=SEQ_LEN,
        help=f"tokens per training sequence, and the model's max_seq_len (at most {MAX_SEQ_LEN}; default {SEQ_LEN})",
    )
    lr, warm = (FINETUNE_LR, FINETUNE_WARMUP) if finetune else (LR, WARMUP)
    g.add_argument("--lr", type=positive_float, default=lr, help=f"peak learning rate (default {lr:g})")
    g.add_argument(
        "--min-lr-ratio",
        type=nonnegative_float,
        default=MIN_LR_RATIO,
        help=f"cosine floor as a fraction of --lr (default {MIN_LR_RATIO})",
    )
    g.add_argument("--warmup", type=nonnegative_int, default=warm, help=f"linear warm-up steps (default {warm})")
    g.add_argument(
        "--weight-decay",
        type=nonnegative_float,
        default=WEIGHT_DECAY,
        help=f"AdamW weight decay (default {WEIGHT_DECAY})",
    )
    g.add_argument("--adam-eps", type=positive_float, default=ADAM_EPS, help=f"AdamW epsilon (default {ADAM_EPS:g})")
    g.add_argument(
        "--grad-clip",
        type=nonnegative_float,
        default=GRAD_CLIP,
        help=f"gradient-norm clip, 0 = off (default {GRAD_CLIP})",
    )
    g.add_argument(
        "--aux-loss-coef",
        type=nonnegative_float,
        default=AUX_LOSS_COEF,
        help=f"load-balancing loss weight (default {AUX_LOSS_COEF})",
    )
    g.add_argument(
        "--moe-only",
        action=argparse.BooleanOptionalAction,
        default=finetune,
        help=f"update only the MoE blocks (routers and experts) (default {'on' if finetune else 'off'})",
    )
    g.add_argument(
        "--seed", type=int, default=SEED, help=f"seed of the weight init and the batch order (default {SEED})"
    )
    g.add_argument(
        "--precision",
        default=PRECISION,
        choices=["auto", "bf16", "fp32"],
        help=f"auto: bf16 on GPU, fp32 on CPU (default {PRECISION})",
    )
    g.add_argument(
        "--device", default=DEVICE, help=f"auto (cuda if present, else cpu), cpu, cuda, cuda:1, ... (default {DEVICE})"
    )
    g.add_argument(
        "--eval-every",
        type=nonnegative_int,
        default=EVAL_EVERY,
        help=f"steps between validation evaluations, and at the last step; 0 = none (default {EVAL_EVERY})",
    )
    g.add_argument(
        "--eval-tokens",
        type=positive_int,
        default=EVAL_TOKENS,
        help=f"validation tokens per evaluation (default {EVAL_TOKENS})",
    )
    g.add_argument(
        "--save-every",
        type=nonnegative_int,
        default=SAVE_EVERY,
        help=f"steps between resume checkpoints (0: none between); the last step always writes one (default {SAVE_EVERY})",
    )
    g.add_argument(
        "--patience",
        type=positive_int,
        default=None,
        help="stop when val loss has not improved for this many evaluations (default: never)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the checkpoint in --out (same settings; a larger --steps continues the run further)",
    )
    g.add_argument(
        "--stop-after",
        type=positive_int,
        default=None,
        help="return after this many steps (resume later; default: run to --steps)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar (default: one on a terminal)")
    g.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="profile steps A..B (torch.profiler): wall vs "
        "GPU busy ms per step, top host ops and kernels, in OUT/step_profile_rank{r}.json (default: off)",
    )
    g = p.add_argument_group("several ranks (torchrun --nproc-per-node N -m occult ...)")
    g.add_argument(
        "--ep-size",
        type=positive_int,
        default=None,
        help="ranks each MoE layer's experts are sharded over (default: all); the world size / EP size "
        "groups are data-parallel replicas",
    )
    g.add_argument(
        "--ep-placement",
        default=None,
        help="placement JSON (occult place --devices EP_SIZE) of the experts on the ranks (default: "
        "contiguous; for finetune, --placement when it has EP_SIZE devices)",
    )
    g.add_argument(
        "--dispatcher",
        default="dedup",
        choices=["dedup", "standard", "dedup2"],
        help="all-to-all dispatch: one copy per device (dedup) or per expert (standard); dedup2: two "
        "levels, one copy per node over the links between nodes, then one per GPU inside the node "
        "(needs --nodes, or an --ep-placement solved with occult place --nodes) (default dedup)",
    )
    g.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "counts", "device"],
        help="how the all-to-alls learn their sizes: counts (the row counts read on the host once per "
        "layer call), device (counts kept on the GPU, rows stored straight into the peers' memory, "
        "no host wait: NCCL ranks of one host), auto: device for dedup where it runs (default auto)",
    )
    g.add_argument(
        "--nodes",
        type=positive_int,
        default=None,
        help="for --dispatcher dedup2: the EP ranks are this many nodes of EP_SIZE/NODES ranks each, "
        "node-major (rank n*G + g is GPU g of node n)",
    )
    g.add_argument(
        "--grad-sync",
        default="ddp",
        choices=["ddp", "explicit", "fsdp"],
        help="dense (non-expert) parameters: replicated, gradients by torch DDP, all-reduced in buckets "
        "during the backward (default), or by one explicit all-reduce after it; or fsdp: sharded over "
        "the ranks with torch FSDP2 fully_shard (weights, gradients and AdamW state 1/N per rank; "
        "bf16 precision as FSDP2 mixed precision); expert gradients are all-reduced over the "
        "replicas after the backward in every mode (OccultLM only; not --hf)",
    )
    g = p.add_argument_group("re-placing experts while training (several ranks, EP size >= 2; docs/replacement.md)")
    g.add_argument(
        "--replace-every",
        type=nonnegative_int,
        default=0,
        help="solve a new expert placement from the routing seen every M steps and migrate to it (0 = off)",
    )
    g.add_argument(
        "--replace-min-gain",
        type=float,
        default=REPLACE_MIN_GAIN,
        help=f"migrate only if E[C_T] of the recent routing drops by this fraction (default {REPLACE_MIN_GAIN})",
    )
    g.add_argument(
        "--replace-drift",
        type=nonnegative_float,
        default=0.0,
        help="also re-solve when the measured E[C_T] rises this fraction above its level after the last decision (0 = off)",
    )
    g.add_argument(
        "--replace-check-every",
        type=positive_int,
        default=REPLACE_CHECK,
        help=f"steps between E[C_T] measurements and solver polls (default {REPLACE_CHECK})",
    )
    g.add_argument(
        "--replace-samples",
        type=positive_int,
        default=REPLACE_SAMPLES,
        help=f"routed tokens per layer and rank kept for the next solve (default {REPLACE_SAMPLES})",
    )
    g.add_argument(
        "--replace-method",
        default="auto",
        choices=["auto", "greedy", "hypergraph", "contiguous"],
        help="placement solver (auto: hypergraph if Mt-KaHyPar is installed, else greedy) (default auto)",
    )
    g.add_argument(
        "--replace-wait",
        action="store_true",
        help="solve inline, training waits (deterministic), instead of in a background process",
    )


def add_finetune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init", required=True, help="checkpoint to start from (e.g. RUN/best.safetensors of occult train)")
    add_train_arguments(p, finetune=True)
    g = p.add_argument_group("routing (collaboration pruning)")
    g.add_argument("--max-devices", type=positive_int, default=None, help="limit every token to N devices")
    g.add_argument(
        "--placement", default=None, help="placement JSON (occult place); any device count, e.g. 4 virtual devices"
    )
    g.add_argument(
        "--prune-method",
        default="score",
        choices=["score", "similarity", "mass"],
        help="a token's N devices: "
        "those of its best experts (score, default), similarity replacement, or most of its top-k gate weight (mass)",
    )
    g.add_argument(
        "--similarity",
        default=None,
        help="similarity table (default: beside the placement, PLACEMENT.similarity.safetensors)",
    )
    g = p.add_argument_group(
        "pruning-aware fine-tuning (occult.lm.distill; with --hf: occult.integrations.hf.finetune)"
    )
    g.add_argument(
        "--distill-weight",
        type=nonnegative_float,
        default=0.0,
        help="add W * T^2 * KL(teacher || model) of the logits; "
        "the teacher: the same weights with standard routing, no gradient, same step (default 0: off)",
    )
    g.add_argument("--distill-temperature", type=positive_float, default=1.0, help="T of --distill-weight (default 1)")
    g.add_argument(
        "--distill-from",
        default=None,
        metavar="CKPT",
        help="teacher of --distill-weight (e.g. a standard fine-tune's "
        "final.safetensors; with --hf its OUT/model directory; default: the model's own weights, standard routing)",
    )
    g.add_argument(
        "--train",
        dest="train_part",
        choices=["routers", "experts", "both"],
        help="what trains (default: --moe-only's; with --hf: both)",
    )


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint (occult train / finetune output)")
    p.add_argument("--out", required=True, help="trace file to write (.safetensors; '-': stdout, with --similarity)")
    _add_data(p)
    p.add_argument("--split", default="train", choices=["train", "val"], help="corpus split to profile (default train)")
    p.add_argument("--tokens", type=positive_int, default=65536, help="tokens to profile (default 65536)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per forward pass (default 16)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="default: the model's max_seq_len")
    p.add_argument("--scores", action="store_true", help="also store the router probabilities [T, E]")
    p.add_argument("--as-routed", action="store_true", help="record the ids the model's (pruned) routing uses")
    p.add_argument("--similarity", default=None, help="similarity table path (default: OUT.similarity.safetensors)")
    p.add_argument(
        "--device", default="auto", help="auto (cuda if present, else cpu), cpu, cuda, cuda:1, ... (default auto)"
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="auto: bf16 on GPU, fp32 on CPU (default auto)",
    )


# ------------------------------------------------------------------ run the commands
def _check_run_paths(args) -> None:
    """The run directory and the inputs of `occult train` / `occult finetune`, before any work."""
    check_output_dir("--out", args.out)
    check_input("--corpus-dir", args.corpus_dir, "dir")
    check_input("--tokenizer", args.tokenizer)
    check_input("--ep-placement", args.ep_placement)


def _train_config(args):
    from occult.lm.train import TrainConfig

    same = (
        "steps",
        "batch_size",
        "seq_len",
        "lr",
        "min_lr_ratio",
        "weight_decay",
        "grad_clip",
        "adam_eps",
        "moe_only",
        "seed",
        "precision",
        "eval_every",
        "eval_tokens",
        "save_every",
        "patience",
        "device",
        "replace_every",
        "replace_min_gain",
        "replace_drift",
        "replace_check_every",
        "replace_samples",
        "replace_method",
        "replace_wait",
        "grad_sync",
        "profile_steps",
        "distill_weight",
        "distill_temperature",
        "distill_from",
        "train_part",
    )  # finetune's only: the last 4
    return TrainConfig(
        warmup_steps=args.warmup,
        aux_loss_coef=AUX_LOSS_COEF if args.aux_loss_coef is None else args.aux_loss_coef,
        **{k: getattr(args, k) for k in same if hasattr(args, k)},
    )


def _parallel(args):
    """`Parallel` under torchrun with more than one rank (joining the group), else None."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if args.ep_size not in (None, 1):
            raise ValueError(f"--ep-size {args.ep_size} needs that many ranks: run under torchrun --nproc-per-node N")
        return None
    from occult.distributed import init_distributed
    from occult.lm.parallel import setup_parallel

    init_distributed()
    return setup_parallel(args.ep_size)


def ep_placement_from_args(args, par, num_experts: int, fallback=None):
    """The experts' placement on the EP ranks (None: contiguous), with nodes for --dispatcher dedup2."""
    from occult.moe.registry import capabilities
    from occult.placement import Placement

    with reading("--ep-placement", args.ep_placement):
        placement = Placement.load(args.ep_placement) if args.ep_placement else None
    if placement is None and fallback is not None and par is not None and fallback.num_devices == par.ep_size:
        placement = fallback
    nodes = getattr(args, "nodes", None)
    if not capabilities(args.dispatcher).two_level:
        if nodes is not None:
            raise ValueError("--nodes applies to --dispatcher dedup2 only")
        return placement
    if par is None:
        raise ValueError("--dispatcher dedup2 needs several ranks: run under torchrun --nproc-per-node N")
    if getattr(args, "replace_every", 0) or getattr(args, "replace_drift", 0.0):
        raise ValueError(
            "re-placing experts while training (--replace-every / --replace-drift) does not support "
            "--dispatcher dedup2 yet: use dedup, or train without re-placement"
        )
    if placement is not None and placement.num_nodes > 1:
        if nodes is not None and nodes != placement.num_nodes:
            raise ValueError(
                f"--nodes {nodes} but the placement {args.ep_placement or args.placement} has "
                f"{placement.num_nodes} nodes: give one or make them agree"
            )
        return placement
    if nodes is None:
        raise ValueError(
            "--dispatcher dedup2 needs the ranks' nodes: --nodes M (M nodes of EP_SIZE/M ranks, "
            "node-major), or an --ep-placement solved with occult place --nodes M"
        )
    if nodes < 2 or par.ep_size % nodes:
        raise ValueError(f"--nodes {nodes} must be >= 2 and divide the EP size {par.ep_size}")
    if placement is None:
        return Placement.contiguous(num_experts, par.ep_size, num_nodes=nodes)
    return Placement(placement.expert_device_LE, placement.num_devices, nodes)


def _finish(par, ok: bool) -> None:
    """Leave the process groups (`occult.distributed.finish_distributed`) after a run on several ranks."""
    if par is not None:
        from occult.distributed import finish_distributed

        finish_distributed(ok)


def _report(result, steps: int) -> None:
    from occult.lm.train import BEST, FINAL, PLOT, latest_state

    last = result.last_eval
    if last:  # the step of that evaluation, not where the run stopped
        extra = f", E[C_T] {last['mean_ct']:.3f}" if "mean_ct" in last else ""
        print(
            f"step {last['step']}: val loss {last['val_loss']:.4f}, ppl {last['val_ppl']:.2f}{extra}; best {result.best_val_loss:.4f}"
        )
    if result.step < steps and not result.stopped_early:
        print(f"stopped at step {result.step} of {steps}: continue with --resume")
    state = latest_state(result.out_dir)
    plot = f", loss curve: {result.out_dir / PLOT}" if (result.out_dir / PLOT).exists() else ""
    print(
        f"weights: {result.out_dir / FINAL} (best: {result.out_dir / BEST}), resume state: {state[1] if state else None}{plot}"
    )


def run_train(args) -> int:
    """occult train: a new `OccultLM` on the corpus (a Ctrl-C: `occult.cli.interrupt`)."""
    return interruptible(_train, args)


def _train(args) -> int:
    import torch

    from occult.lm.checkpoint import CheckpointError
    from occult.lm.model import ModelConfig
    from occult.lm.parallel import full_model, shard_model
    from occult.lm.train import train

    _check_run_paths(args)
    par = _parallel(args)
    main = par is None or par.is_main
    data = load_token_data(args)
    cfg = _train_config(args)
    mcfg = ModelConfig(
        vocab_size=data.vocab_size,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_experts=args.experts,
        top_k=args.top_k,
        expert_ffn_size=args.expert_ffn,
        norm_topk_prob=args.norm_topk_prob,
        max_seq_len=args.seq_len,
        expert_backend=args.expert_backend,
        transport=args.transport,
    )
    torch.manual_seed(cfg.seed)
    model = full_model(mcfg, par)  # every rank the same weights, as one process would have
    if main:
        print(
            f"model: {model.num_parameters():,} parameters ({model.num_parameters(active=True):,} active per token); "
            f"data: {data.train.numel():,} train / {data.val.numel():,} val tokens"
        )
    if par is not None:
        model = shard_model(model, par, ep_placement_from_args(args, par, mcfg.num_experts), args.dispatcher)
        if main:
            print(
                f"{par.world_size} ranks: experts over {par.ep_size} ({args.dispatcher}), {par.replicas} data-parallel "
                f"replica(s); {cfg.batch_size // par.world_size} of {cfg.batch_size} rows per rank; "
                f"dense parameters: {dict(ddp='DDP', explicit='explicit all-reduce', fsdp='FSDP2')[cfg.grad_sync]}"
            )
    ok = False
    try:
        try:
            result = train(
                model,
                data,
                cfg,
                args.out,
                resume=args.resume,
                stop_after=args.stop_after,
                progress=not args.no_progress,
                parallel=par,
            )
        except CheckpointError as exc:  # the resume state in --out
            raise input_error("--out", args.out, exc) from None
        if main:
            _report(result, cfg.steps)
        ok = True
    finally:
        model = None  # the model (and its DDP) let go before the groups are destroyed
        _finish(par, ok)
    return 0


def load_routing_args(args, num_experts: int, num_layers: int):
    """(placement, similarity) from --placement/--similarity, with the beside-the-placement default."""
    from occult.moe.pruning import PruningError, load_similarity, similarity_path
    from occult.placement import Placement

    with reading("--placement", args.placement):
        placement = Placement.load(args.placement) if args.placement else None
    if args.max_devices is not None and placement is None:
        raise PruningError("--max-devices needs --placement (which device holds each expert)")
    if args.prune_method != "similarity" or args.max_devices is None:
        return placement, None
    path = args.similarity or similarity_path(args.placement)
    with reading("--similarity", path):
        return placement, load_similarity(path, num_experts=num_experts, num_layers=num_layers)


def run_finetune(args) -> int:
    """occult finetune: a checkpoint trained further, optionally with tokens limited to N devices."""
    return interruptible(_finetune, args)


def _finetune(args) -> int:
    from occult.lm.checkpoint import CheckpointError
    from occult.lm.train import finetune

    check_input("--init", args.init, "any")
    check_input("--distill-from", getattr(args, "distill_from", None), "any")
    check_input("--placement", args.placement)
    check_input("--similarity", args.similarity)
    _check_run_paths(args)
    data = load_token_data(args)
    mcfg = check_checkpoint("--init", args.init)
    placement, sims = load_routing_args(args, mcfg.num_experts, mcfg.num_layers)
    cfg = _train_config(args)
    par = _parallel(args)
    ok = False
    try:
        ep_placement = ep_placement_from_args(args, par, mcfg.num_experts, placement)
        try:
            model, result = finetune(
                args.init,
                data,
                cfg,
                args.out,
                max_devices=args.max_devices,
                placement=placement,
                method=args.prune_method,
                similarity=sims,
                resume=args.resume,
                stop_after=args.stop_after,
                progress=not args.no_progress,
                parallel=par,
                dispatcher=args.dispatcher,
                transport=args.transport,
                ep_placement=ep_placement,
            )
        except CheckpointError as exc:  # the resume state in --out
            raise input_error("--out", args.out, exc) from None
        if par is None or par.is_main:
            print(f"routing: {model.routing.describe()}")
            _report(result, cfg.steps)
        ok = True
    finally:
        model = None  # the model (and its DDP) let go before the groups are destroyed
        _finish(par, ok)
    return 0


def run_profile(args) -> int:
    """occult profile of an occult checkpoint: its routing trace and expert-similarity table."""
    from occult.lm.profile import profile_checkpoint
    from occult.placement.stats import analytic_mean_ct

    check_input("--model", args.model, "any")
    check_output("--out", args.out, "trace.safetensors")
    check_output("--similarity", args.similarity, "similarity.safetensors")
    check_input("--corpus-dir", args.corpus_dir, "dir")
    check_input("--tokenizer", args.tokenizer)
    check_checkpoint("--model", args.model)
    data = load_token_data(args)
    trace, sim_path = profile_checkpoint(
        args.model,
        data,
        args.out,
        split=args.split,
        tokens=args.tokens,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        with_scores=args.scores,
        as_routed=args.as_routed,
        similarity_out=args.similarity,
        device=args.device,
        precision=args.precision,
    )
    print(
        f"wrote {args.out}: {trace.num_layers} layers x {trace.num_tokens[0]:,} tokens, "
        f"{trace.num_experts} experts, top-{trace.top_k}; similarity: {sim_path}"
    )
    hint = ""
    if trace.num_experts % 4 == 0:
        hint = f" (uniform routing would give E[C_T] = {analytic_mean_ct(trace.num_experts, trace.top_k, 4):.2f} on 4 devices)"
    print(f"next: occult place --trace {args.out} --devices D --out placement.json{hint}")
    return 0


TRAIN = Command("train", "train a small MoE language model (OccultLM)", add_train_arguments, run_train)
FINETUNE = Command(
    "finetune",
    "fine-tune a checkpoint, optionally with tokens limited to N devices",
    add_finetune_arguments,
    run_finetune,
)
