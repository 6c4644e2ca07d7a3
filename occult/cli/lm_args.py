"""The flags of `occult train / finetune / profile` for occult checkpoints (`occult.cli.lm` runs them).

They import nothing heavy (`occult --help` stays fast). The defaults mirror `occult.lm.model.ModelConfig`,
`occult.lm.train.TrainConfig` and `occult.lm.data`; tests/lm/test_train.py checks they agree.
"""

from __future__ import annotations

import argparse

from occult.cli.registry import (
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    positive_int_at_most,
)
from occult.cli.step_args import add_step_arguments

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
MAX_LR = 1.0  # an AdamW step moves a weight by about lr: far above this every run diverges at once


def learning_rate(text: str) -> float:
    """argparse type: a finite learning rate in (0, MAX_LR]."""
    lr = positive_float(text)
    if lr > MAX_LR:
        raise argparse.ArgumentTypeError(f"expected a learning rate of at most {MAX_LR:g} (e.g. 1e-3), got {text!r}")
    return lr


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
        help="expert MLP: the torch reference, the Triton kernels, or auto (Triton on a CUDA GPU, else torch) "
        f"(default {EXPERT_BACKEND})",
    )


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """--corpus-dir and --tokenizer (train, finetune, profile)."""
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
    """The flags of `occult train` (`finetune=True`: those `occult finetune` shares, without the model's shape)."""
    if not finetune:
        add_model_arguments(p)
    add_data_arguments(p)
    add_optimisation_arguments(p, finetune)
    add_run_arguments(p)
    add_ranks_arguments(p)
    add_replace_arguments(p)


def add_optimisation_arguments(p: argparse.ArgumentParser, finetune: bool = False) -> None:
    """--out, the steps, batch, learning-rate schedule and optimizer."""
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
    g.add_argument(
        "--lr", type=learning_rate, default=lr, help=f"peak learning rate, at most {MAX_LR:g} (default {lr:g})"
    )
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


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Precision, device, evaluation, checkpoints, resume and progress of a run."""
    g = p.add_argument_group("the run")
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
        help="steps between resume checkpoints (0: none between); the last step always writes one "
        f"(default {SAVE_EVERY})",
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
    add_step_arguments(g)


def add_ranks_arguments(p: argparse.ArgumentParser) -> None:
    """How the experts and the dense parameters are spread over several ranks (torchrun)."""
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
        choices=["auto", "counts", "device", "host"],
        help="how the all-to-alls run: counts (the row counts read on the host once per layer call), device "
        "(counts kept on the GPU, rows stored straight into the peers' memory, no host wait: NCCL ranks of one "
        "host), host (as counts, the rows through shared pinned host memory by the GPUs' copy engines: NCCL ranks "
        "of one host without peer-to-peer, a slow link), auto: device for dedup where it runs (default auto)",
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
        choices=["ddp", "explicit", "overlap", "fsdp"],
        help="dense (non-expert) parameters: replicated, gradients by torch DDP, all-reduced in buckets "
        "during the backward (default), or by one explicit all-reduce after it, or overlap: explicit all-reduces "
        "in buckets during the backward, with no host state (recorded with --captured-step); or fsdp: sharded over "
        "the ranks with torch FSDP2 fully_shard (weights, gradients and AdamW state 1/N per rank; "
        "bf16 precision as FSDP2 mixed precision); expert gradients are all-reduced over the "
        "replicas after the backward in every mode",
    )
    g.add_argument(
        "--fsdp-reshard",
        default=None,
        choices=["after-backward", "after-forward"],
        help="with --grad-sync fsdp: when a block frees its gathered dense weights: after its backward (default: "
        "kept from its forward, no second all-gather) or after its forward (gathered again for the backward: "
        "less memory, twice the all-gathers)",
    )
    g.add_argument(
        "--fsdp-units",
        default=None,
        choices=["block", "model"],
        help="with --grad-sync fsdp: what one FSDP2 unit holds: one decoder block's dense weights (default: each "
        "block's all-gather and reduce-scatter beside the compute) or the whole model's (one all-gather before the "
        "forward, one reduce-scatter after the backward: the least host work a step, for small models whose eager "
        "step waits on the host; docs/training.md)",
    )


def add_replace_arguments(p: argparse.ArgumentParser) -> None:
    """Re-placing experts while training (occult.lm.replace)."""
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
        help="also re-solve when the measured E[C_T] rises this fraction above its level after the last "
        "decision (0 = off)",
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
    add_data_arguments(p)
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
