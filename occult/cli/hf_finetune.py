"""`occult finetune --hf DIR`: a transformers model's routers and experts fine-tuned
(`occult.integrations.hf.finetune`), on one process or under torchrun (each rank loads only its
experts, `hf.load_sharded`). `add_finetune_arguments` adds `--hf`/`--data` to the OccultLM
finetune flags (shared: --steps, --lr, --batch-size, ...; `occult.cli.lm_args`) and `run_finetune` runs it:

    torchrun --nproc-per-node 4 -m occult finetune --hf DIR --out OUT --placement p.json --max-devices 2
    OUT/model/  (transformers layout, tokenizer files copied)   OUT/loss.png   OUT/metrics.json
    OUT/checkpoint/  (every --save-every steps; --resume continues it, --stop-after N stops early)

Every flag is checked before any work (`occult.cli.run_checks`); a run that fails before it wrote anything
leaves no new --out behind. The flags only a run of an occult checkpoint reads (`OCCULT_CHECKPOINT_ONLY`:
--tokenizer, --eval-every, --grad-sync, --replace-*, ...) are refused with --hf when the command line names
them (`note_when_given` records which flags it names: argparse keeps no such record).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from occult.cli.hf_flags import HF_ONLY, OCCULT_CHECKPOINT_ONLY, note_when_given, refuse_occult_checkpoint_flags
from occult.cli.inputs import (
    check_data,
    check_token_ids,
    loading_model,
    read_hf_config,
    read_texts,
    read_token_ids,
    reading,
)
from occult.cli.registry import CommandError, check_input, check_output_dir
from occult.cli.run_checks import (
    allocation_named,
    check_captured_step,
    check_device,
    check_layer_graphs,
    check_max_devices,
    check_micro_batch_args,
    check_two_batch_args,
    diverged_named,
    run_dir,
)


def quiet_unless_terminal() -> None:
    """transformers' progress bars (loading weights) only on a terminal, like occult's own."""
    import sys

    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def add_finetune_arguments(p: Any) -> None:
    """Add `--hf` / `--data` to `occult finetune` (whose OccultLM flags are reused; `--init` becomes optional)."""
    have = getattr(p, "_option_string_actions", {})
    if "--init" in have:
        have["--init"].required = False
        have["--init"].help += " (or --hf DIR)"
    if "--aux-loss-coef" in have:  # off unless asked for with --hf; OccultLM keeps its default (occult.cli.lm)
        have["--aux-loss-coef"].default = None
        have["--aux-loss-coef"].help += (
            "; with --hf default 0 = off (the family's own load_balancing_loss_func, or "
            "the Switch formula for DeepSeek-V3, over the global batch)"
        )
    g = p.add_argument_group("transformers models (--hf)")
    g.add_argument(
        "--hf",
        default=None,
        metavar="DIR",
        help="fine-tune this transformers model directory's routers and experts instead of --init",
    )
    g.add_argument(
        "--save-dtype",
        default="source",
        choices=["source", "fp32", "bf16"],
        help="--hf: dtype of the saved weights (default: the source checkpoint's; training runs in fp32)",
    )
    if "--data" not in have:
        g.add_argument(
            "--data",
            default=None,
            help="--hf: token ids (.safetensors/.npy/.pt), text (.txt/.jsonl) or 'random' (default: the "
            "corpus texts of --corpus-dir or the cached Shakespeare corpus)",
        )
    for flag in OCCULT_CHECKPOINT_ONLY:
        if flag in have and "not with --hf" not in (have[flag].help or ""):
            have[flag].help += " (occult checkpoints only: not with --hf)"
    note_when_given(p, [*OCCULT_CHECKPOINT_ONLY, *HF_ONLY])


def _check_teacher_dir(args: Any) -> None:
    """--distill-from with --hf: a transformers model directory of the same model, and a weight."""
    teacher = getattr(args, "distill_from", None)
    if teacher is None:
        return
    if not (Path(teacher) / "config.json").is_file():
        raise ValueError(
            f"--distill-from {teacher}: with --hf the teacher is a transformers model directory (no "
            "config.json there), e.g. OUT/model of a standard `occult finetune --hf` run"
        )
    if not args.distill_weight > 0:
        raise ValueError("--distill-from needs --distill-weight W > 0 (the weight of the teacher's KL term)")


def _hf_tokens(args: Any, vocab_size: int, log) -> Any:
    """The token stream: --data, else the corpus texts; the model's tokenizer, else UTF-8 bytes."""
    from occult.integrations import hf

    data = getattr(args, "data", None)
    if data is not None and not str(data).lower().endswith((".txt", ".jsonl")):
        return read_token_ids(data, args.hf, vocab_size).reshape(-1)
    if data is not None:
        texts = read_texts(data)
    else:
        from occult.lm.corpus import fetch_corpus
        from occult.lm.corpus import read_texts as corpus_texts

        with reading("--corpus-dir", args.corpus_dir or "(the cached corpus)"):
            texts = [t for _, t in corpus_texts(Path(args.corpus_dir) if args.corpus_dir else fetch_corpus())]
    with reading("--hf", args.hf):  # its tokenizer
        ids, how = hf.tokenize_texts(texts, args.hf, vocab_size)
    log(f"data: {ids.numel():,} tokens ({how})")
    return check_token_ids(ids, data or "(the corpus)", vocab_size)


def _hf_placements(args: Any, ep_size: int):
    """(placement of the experts on the EP ranks, placement for routing only, similarity tables)."""
    from occult.moe.pruning import load_similarity, similarity_path
    from occult.placement import Placement

    with reading("--placement", args.placement):
        placement = Placement.load(args.placement) if args.placement else None
    if args.max_devices is not None and placement is None:
        raise ValueError("--max-devices needs --placement (which device holds each expert)")
    check_max_devices(args.max_devices, placement, args.placement)
    sims = None
    if placement is not None and args.prune_method == "similarity" and args.max_devices is not None:
        path = args.similarity or similarity_path(args.placement)
        with reading("--similarity", path):
            sims = load_similarity(path, num_experts=placement.num_experts, num_layers=placement.num_layers)
    if placement is None or placement.num_devices == ep_size:
        return placement, None, sims
    if args.max_devices is None:
        raise ValueError(
            f"--placement is for {placement.num_devices} devices, the experts are sharded over {ep_size} rank(s): give "
            f"--max-devices N to use it for routing only, or make one with `occult place --devices {ep_size}`"
        )
    return None, placement, sims


def _num_experts(path: str) -> int:
    """Routed experts per MoE layer, from the model directory's config.json (every supported family's key)."""
    cfg = read_hf_config("--hf", path)
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise CommandError(
        f"--hf {path}: config.json names no expert count (a positive num_experts, n_routed_experts or "
        "num_local_experts)"
    )


def _save_dtype(args: Any):
    """--save-dtype as a torch dtype (source: config.json's dtype / torch_dtype; fp32 when absent)."""
    import torch

    name = {"fp32": "float32", "bf16": "bfloat16"}.get(args.save_dtype)
    if name is None:
        cfg = read_hf_config("--hf", args.hf)
        name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _finetune_config(args: Any) -> Any:
    """The `hf.FinetuneConfig` of `occult finetune --hf`'s flags."""
    from occult.integrations import hf

    return hf.FinetuneConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup,
        weight_decay=args.weight_decay,
        adam_eps=args.adam_eps,
        grad_clip=args.grad_clip,
        seed=args.seed,
        precision=args.precision,
        aux_loss_coef=getattr(args, "aux_loss_coef", None) or 0.0,
        distill_weight=args.distill_weight,
        distill_temperature=args.distill_temperature,
        train_part=args.train_part or "both",
        distill_from=getattr(args, "distill_from", None),
        profile_steps=getattr(args, "profile_steps", None),
        layer_graphs=getattr(args, "layer_graphs", False),
        captured_step=getattr(args, "captured_step", False),
        two_batch=getattr(args, "two_batch", False),
        micro_batches=getattr(args, "micro_batches", 1),
        pair_micro_batches=getattr(args, "pair_micro_batches", False),
    )


def _load_models(args: Any, groups: Any, log) -> tuple[Any, Any]:
    """The student (`--hf`, pruned as asked) and the teacher (`--distill-from`, or None), each rank its experts."""
    import torch

    from occult.integrations import hf
    from occult.moe.config import ExecConfig, RoutingConfig
    from occult.moe.pruning import PruningError
    from occult.moe.registry import capabilities
    from occult.placement import PlacementError

    device = args.device
    if device == "auto":
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    placement, routing, sims = _hf_placements(args, groups.ep_size if groups else 1)
    if args.ep_placement or capabilities(args.dispatcher).two_level or getattr(args, "nodes", None) is not None:
        from occult.cli.lm_ranks import (
            ep_placement_from_args,  # --ep-placement, and nodes from --nodes or the placement
        )

        placement = ep_placement_from_args(args, groups, _num_experts(args.hf), placement)
    with loading_model("--hf", args.hf, keep=(PlacementError, PruningError)):
        model = hf.load_sharded(
            args.hf,
            group=groups.ep if groups else None,
            placement=placement,
            device=device,
            routing=RoutingConfig(max_devices=args.max_devices, prune_method=args.prune_method),
            execution=ExecConfig(dispatcher=args.dispatcher, transport=args.transport),
            routing_placement=routing,
            similarity=sims,
        )
    rep = model.occult_load_report
    log(
        f"loaded {args.hf}: {len(rep.experts)} MoE layers, {len(next(iter(rep.experts.values())))} experts per layer "
        f"on this rank ({rep.layout} checkpoint; rank 0 read {rep.expert_bytes:,} bytes of experts)"
    )
    teacher = None
    if args.distill_from:  # the same experts on this rank as the student, its own (standard) routing
        with loading_model("--distill-from", args.distill_from, keep=(PlacementError,)):
            teacher = hf.load_sharded(
                args.distill_from,
                group=groups.ep if groups else None,
                placement=placement,
                device=device,
                execution=ExecConfig(dispatcher=args.dispatcher, transport=args.transport),
            )
        log(f"teacher: {args.distill_from} (standard routing, frozen)")
    return model, teacher


def run_finetune(args: Any) -> int:
    """`occult finetune --hf DIR`: routers and experts of a transformers model, on 1 or N ranks."""
    import os

    from occult.integrations import hf

    refuse_occult_checkpoint_flags(args)
    read_hf_config("--hf", args.hf)
    quiet_unless_terminal()
    out = Path(args.out)
    check_output_dir("--out", args.out)
    if (out / "model").exists():
        raise ValueError(f"{out / 'model'} already exists: choose another --out")
    check_data(getattr(args, "data", None))
    check_input("--corpus-dir", getattr(args, "corpus_dir", None), "dir")
    for flag in ("placement", "similarity", "ep_placement"):
        check_input("--" + flag.replace("_", "-"), getattr(args, flag, None))
    _check_teacher_dir(args)
    check_device(args.device)
    check_layer_graphs(args)
    check_captured_step(args, hf=True)
    check_two_batch_args(args, hf=True)
    check_micro_batch_args(args, hf=True)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if args.ep_size not in (None, 1):
            raise ValueError(f"--ep-size {args.ep_size} needs that many ranks: run under torchrun --nproc-per-node N")
        with run_dir(out):
            return _finetune(args, None, out)
    from occult.distributed import finish_distributed, init_distributed

    init_distributed()
    ok = False
    try:
        with run_dir(out):
            status = _finetune(args, hf.setup_groups(args.ep_size), out)
        ok = True
        return status
    finally:  # after _finetune returned: its model (and DDP) are gone before the groups go
        finish_distributed(ok)


def _finetune(args: Any, groups: Any, out: Path) -> int:
    """The fine-tuning run of `run_finetune` on this rank (`groups` None: one process)."""
    from occult.integrations import hf

    main = groups is None or groups.rank == 0
    log = print if main else (lambda *_: None)
    model, teacher = _load_models(args, groups, log)
    tokens = _hf_tokens(args, int(model.config.vocab_size), log)
    cfg = _finetune_config(args)
    if groups is not None:
        log(
            f"{groups.world_size} ranks: experts over {groups.ep_size} ({args.dispatcher}), {groups.replicas} "
            f"data-parallel replica(s); {cfg.batch_size // groups.world_size} of {cfg.batch_size} rows per rank"
        )
    with allocation_named("--batch-size", args.batch_size), diverged_named(args.lr):
        result = hf.finetune(
            model,
            tokens,
            cfg,
            groups,
            progress=False if args.no_progress else None,
            log=log,
            checkpoint_dir=out,
            save_every=args.save_every,
            resume=args.resume,
            stop_after=args.stop_after,
            teacher=teacher,
        )
    if len(result.losses) < cfg.steps:
        log(
            f"stopped at step {len(result.losses)} of {cfg.steps}: continue with --resume "
            f"(checkpoint in {out / 'checkpoint'})"
        )
        return 0
    hf.save_finetuned(model, out / "model", source=args.hf, dtype=_save_dtype(args))
    if main:
        from occult._atomic import write_text_atomic
        from occult.lm.plot import plot_losses

        write_text_atomic(
            out / "metrics.json",
            json.dumps(
                {
                    "hf": str(args.hf),
                    "config": vars(cfg),
                    "losses": result.losses,
                    "grad_norms": result.grad_norms,
                    "tokens_per_s": result.tokens_per_s,
                    "world_size": groups.world_size if groups else 1,
                },
                indent=1,
            )
            + "\n",
        )
        plot = plot_losses(out / "loss.png", result.losses, [], title=f"{Path(args.hf).name}: routers + experts")
        log(
            f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} over {cfg.steps} steps, "
            f"{result.tokens_per_s:,.0f} tokens/s; loss curve: {plot or 'not drawn (no matplotlib)'}"
        )
        log(f"wrote {out / 'model'} (transformers layout: AutoModelForCausalLM.from_pretrained loads it)")
    return 0
