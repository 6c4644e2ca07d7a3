"""`occult train / finetune / profile` for the small MoE language model (`occult.lm`; `occult data`: `occult.cli.data`).

The flags are defined in `occult.cli.lm_args` (nothing heavy imported; `occult --help` stays fast) and
checked before any work by `occult.cli.run_checks`; each `run_*` imports `occult.lm` when its command runs.
`occult profile` of an occult checkpoint runs `run_profile` here; of a transformers model
directory, `occult.cli.hf.run_profile` (the command line chooses, in `occult.cli`).

Under torchrun with more than one rank (`torchrun --nproc-per-node N -m occult train ...`),
`train` and `finetune` shard the experts over `--ep-size` ranks (default: all) by
`--ep-placement` and train everything else data parallel (`occult.lm.parallel`; replicated gradients
by torch DDP, `--grad-sync explicit`, or sharded with FSDP2, `--grad-sync fsdp`); rank 0 prints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from occult.cli.inputs import check_checkpoint, input_error, load_token_data
from occult.cli.interrupt import interruptible
from occult.cli.lm_args import (  # noqa: F401  (re-exported: occult.cli and the tests read them here)
    ADAM_EPS,
    AUX_LOSS_COEF,
    BATCH_SIZE,
    DEVICE,
    EVAL_EVERY,
    EVAL_TOKENS,
    EXPERT_BACKEND,
    EXPERT_FFN,
    EXPERTS,
    FINETUNE_LR,
    FINETUNE_WARMUP,
    GRAD_CLIP,
    HEADS,
    HIDDEN,
    LAYERS,
    LR,
    MAX_SEQ_LEN,
    MIN_LR_RATIO,
    PRECISION,
    REPLACE_CHECK,
    REPLACE_MIN_GAIN,
    REPLACE_SAMPLES,
    SAVE_EVERY,
    SEED,
    SEQ_LEN,
    STEPS,
    TOP_K,
    WARMUP,
    WEIGHT_DECAY,
    add_data_arguments,
    add_finetune_arguments,
    add_model_arguments,
    add_profile_arguments,
    add_train_arguments,
)
from occult.cli.lm_ranks import ep_placement_from_args, finish_ranks, load_routing_args, parallel_from_args
from occult.cli.registry import Command, CommandError, check_input, check_output, check_output_dir
from occult.cli.run_checks import (
    allocation_named,
    check_batch,
    check_captured_step,
    check_device,
    check_fsdp_reshard,
    check_layer_graphs,
    check_micro_batch_args,
    check_train_sizes,
    check_two_batch_args,
    run_dir,
    writing_named,
)


# ------------------------------------------------------------------ run the commands
def _check_run_paths(args) -> None:
    """The run directory, the inputs and the device of `occult train` / `occult finetune`, before any work."""
    check_output_dir("--out", args.out)
    check_device(args.device)
    check_input("--corpus-dir", args.corpus_dir, "dir")
    check_input("--tokenizer", args.tokenizer)
    check_input("--ep-placement", args.ep_placement)
    check_fsdp_reshard(args)
    check_layer_graphs(args)
    check_captured_step(args)
    check_two_batch_args(args)
    check_micro_batch_args(args)


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
        "layer_graphs",
        "captured_step",
        "two_batch",
        "micro_batches",
        "pair_micro_batches",
        "distill_weight",
        "distill_temperature",
        "distill_from",
        "train_part",
    )  # finetune's only: the last 4
    return TrainConfig(
        warmup_steps=args.warmup,
        aux_loss_coef=AUX_LOSS_COEF if args.aux_loss_coef is None else args.aux_loss_coef,
        fsdp_reshard=getattr(args, "fsdp_reshard", None) or "after-backward",
        fsdp_units=getattr(args, "fsdp_units", None) or "block",
        **{k: getattr(args, k) for k in same if hasattr(args, k)},
    )


def _report(result, steps: int) -> None:
    from occult.lm.train import BEST, FINAL, PLOT, latest_state

    last = result.last_eval
    if last:  # the step of that evaluation, not where the run stopped
        extra = f", E[C_T] {last['mean_ct']:.3f}" if "mean_ct" in last else ""
        print(
            f"step {last['step']}: val loss {last['val_loss']:.4f}, ppl {last['val_ppl']:.2f}{extra}; "
            f"best {result.best_val_loss:.4f}"
        )
    if result.step < steps and not result.stopped_early:
        print(f"stopped at step {result.step} of {steps}: continue with --resume")
    state = latest_state(result.out_dir)
    plot = f", loss curve: {result.out_dir / PLOT}" if (result.out_dir / PLOT).exists() else ""
    print(
        f"weights: {result.out_dir / FINAL} (best: {result.out_dir / BEST}), "
        f"resume state: {state[1] if state else None}{plot}"
    )


def run_train(args) -> int:
    """occult train: a new `OccultLM` on the corpus (a Ctrl-C: `occult.cli.interrupt`)."""
    return interruptible(_train, args)


def _train(args) -> int:
    import torch

    from occult.lm.model import ModelConfig
    from occult.lm.parallel import full_model, shard_model

    _check_run_paths(args)
    par = parallel_from_args(args)
    main = par is None or par.is_main
    data = load_token_data(args)
    check_train_sizes(args, data.vocab_size)
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
    with allocation_named("--hidden", args.hidden):
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
        result = _run_training(args, lambda: _train_call(args, model, data, cfg, par))
        if main:
            _report(result, cfg.steps)
        ok = True
    finally:
        model = None  # the model (and its DDP) let go before the groups are destroyed
        finish_ranks(par, ok)
    return 0


def _train_call(args, model, data, cfg, par):
    from occult.lm.train import train

    return train(
        model,
        data,
        cfg,
        args.out,
        resume=args.resume,
        stop_after=args.stop_after,
        progress=False if args.no_progress else None,  # None: a bar only when stderr is a terminal
        parallel=par,
    )


def _run_training(args, run: Callable[[], Any]) -> Any:
    """`run()` (a train or finetune call writing --out), its errors named by the flag that caused them: the
    resume state in --out, a learning rate that made the run diverge, a batch that does not fit; a failure
    before anything was written leaves no new --out behind."""
    from occult.lm.checkpoint import CheckpointError
    from occult.lm.train import DivergedError

    with run_dir(args.out), allocation_named("--batch-size", args.batch_size):
        try:
            return run()
        except CheckpointError as exc:  # the resume state in --out
            raise input_error("--out", args.out, exc) from None
        except DivergedError as exc:
            raise CommandError(f"--lr {args.lr:g}: {exc} (give a smaller --lr)") from None


def run_finetune(args) -> int:
    """occult finetune: a checkpoint trained further, optionally with tokens limited to N devices."""
    return interruptible(_finetune, args)


def _finetune(args) -> int:
    mcfg = _check_finetune_inputs(args)
    data = load_token_data(args)
    placement, sims = load_routing_args(args, mcfg.num_experts, mcfg.num_layers)
    cfg = _train_config(args)
    par = parallel_from_args(args)
    ok = False
    try:
        check_batch(args, data.vocab_size, mcfg.hidden_size, mcfg.num_layers, mcfg.top_k * mcfg.expert_ffn_size)
        ep_placement = ep_placement_from_args(args, par, mcfg.num_experts, placement)
        model, result = _run_training(args, lambda: _finetune_call(args, cfg, data, placement, sims, par, ep_placement))
        if par is None or par.is_main:
            print(f"routing: {model.routing.describe()}")
            _report(result, cfg.steps)
        ok = True
    finally:
        model = None  # the model (and its DDP) let go before the groups are destroyed
        finish_ranks(par, ok)
    return 0


def _check_finetune_inputs(args):
    """Every input of `occult finetune --init` before any work; the `ModelConfig` of --init."""
    if getattr(args, "data", None) is not None:
        raise CommandError(
            f"--data {args.data} applies to --hf (a transformers model) only; an --init checkpoint trains on "
            "--corpus-dir (a prepared corpus; default: the cached corpus)"
        )
    if "--save-dtype" in getattr(args, "given_flags", ()):  # recorded by occult.cli.hf_flags.note_when_given
        raise CommandError(
            "--save-dtype applies to --hf (a transformers model) only; an --init run writes occult checkpoints"
        )
    check_input("--init", args.init, "any")
    check_input("--distill-from", getattr(args, "distill_from", None), "any")
    check_input("--placement", args.placement)
    check_input("--similarity", args.similarity)
    _check_run_paths(args)
    mcfg = check_checkpoint("--init", args.init)
    if getattr(args, "distill_from", None):
        teacher = check_checkpoint("--distill-from", args.distill_from)
        if teacher.vocab_size != mcfg.vocab_size:
            raise CommandError(
                f"--distill-from {args.distill_from}: its vocabulary has {teacher.vocab_size} ids, --init's "
                f"{mcfg.vocab_size}: give a checkpoint trained on the same tokenizer"
            )
    return mcfg


def _finetune_call(args, cfg, data, placement, sims, par, ep_placement):
    from occult.lm.train import finetune

    return finetune(
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
        progress=False if args.no_progress else None,  # None: a bar only when stderr is a terminal
        parallel=par,
        dispatcher=args.dispatcher,
        transport=args.transport,
        ep_placement=ep_placement,
    )


def run_profile(args) -> int:
    """occult profile of an occult checkpoint: its routing trace and expert-similarity table."""
    from occult.lm.profile import profile_checkpoint
    from occult.placement.stats import analytic_mean_ct

    if getattr(args, "data", None) is not None:
        raise CommandError(
            f"--data {args.data} applies to transformers models only; an occult checkpoint is profiled on "
            "--corpus-dir (a prepared corpus; default: the cached corpus)"
        )
    check_input("--model", args.model, "any")
    check_output("--out", args.out, "trace.safetensors")
    check_output("--similarity", args.similarity, "similarity.safetensors")
    check_input("--corpus-dir", args.corpus_dir, "dir")
    check_input("--tokenizer", args.tokenizer)
    check_device(args.device)
    check_checkpoint("--model", args.model)
    data = load_token_data(args)
    with writing_named(("--similarity", args.similarity), ("--out", args.out)):
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
        uniform = analytic_mean_ct(trace.num_experts, trace.top_k, 4)
        hint = f" (uniform routing would give E[C_T] = {uniform:.2f} on 4 devices)"
    print(f"next: occult place --trace {args.out} --devices D --out placement.json{hint}")
    return 0


TRAIN = Command("train", "train a small MoE language model (OccultLM)", add_train_arguments, run_train)
FINETUNE = Command(
    "finetune",
    "fine-tune a checkpoint, optionally with tokens limited to N devices",
    add_finetune_arguments,
    run_finetune,
)
