"""The flags of how a training step executes (`occult train`, `occult finetune`, also with --hf): MoE layers
replayed from CUDA graphs, the whole step recorded, two interleaved micro-batches, accumulated micro-batches (in
turn or paired), a profile of some steps.

Imports nothing heavy (`occult --help` stays fast); the checks are `occult.cli.run_checks`'.
"""

from __future__ import annotations

from typing import Any


def add_step_arguments(g: Any) -> None:
    """How each step executes (on argument group `g`): MoE layers from CUDA graphs, the whole step recorded, two
    interleaved halves, accumulated micro-batches, a profile."""
    g.add_argument(
        "--layer-graphs",
        action="store_true",
        help="replay every MoE layer's training calls (forward and backward) and evaluation forwards from "
        "CUDA graphs, recorded at the third call of each shape: a call costs the host a copy in, one launch "
        "and a copy out each way (also with --hf; needs a CUDA device; several ranks: --transport device and "
        "--grad-sync ddp or explicit; the same losses as the eager layers; on one GPU 1.03-1.15x the eager steps' "
        "tokens/s, less than --captured-step: docs/training.md) (default: eager layers)",
    )
    g.add_argument(
        "--captured-step",
        action="store_true",
        help="record the whole training step (forward, backward, gradient sync, clipping, AdamW) once as one CUDA "
        "graph, after 3 eager steps, and replay it: a step costs the host a batch copy and one launch (also with "
        "--hf; needs a CUDA device and fixed shapes; not with --layer-graphs or re-placement; several ranks: "
        "--transport device and --grad-sync explicit, overlap or fsdp; docs/training.md) (default: eager steps)",
    )
    g.add_argument(
        "--two-batch",
        action="store_true",
        help="run each step's forward and backward as two interleaved micro-batches, one half's all-to-alls under "
        "the other's compute, for slow links (also with --hf; sync-free expert-parallel layers; with "
        "--captured-step to pay; several ranks: --grad-sync explicit or overlap, --hf syncs its routers after the "
        "backward; an even batch per rank; not with --layer-graphs, re-placement or distillation; the gradients of "
        "two accumulated micro-batches, so the load-balancing loss is over each half; docs/training.md) "
        "(default: one batch)",
    )
    g.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        metavar="K",
        help="run each step as K micro-batches of each rank's rows, their gradients accumulated, then one "
        "gradient sync and optimizer step, the data-parallel reduction once a step whatever --grad-sync (also with "
        "--hf; not with --two-batch; K dividing the rows per rank; docs/training.md) (default: 1, one batch)",
    )
    g.add_argument(
        "--pair-micro-batches",
        action="store_true",
        help="with --micro-batches K >= 2 (also with --hf): run micro-batch i+1's forward beside micro-batch i's "
        "backward (combined 1F1B), one's all-to-alls under the other's compute (sync-free expert-parallel layers; "
        "with --captured-step to pay; several ranks: --grad-sync explicit or overlap, --hf syncs its routers after the "
        "backward; not with --layer-graphs, re-placement or distillation; docs/overlap.md) (default: in turn)",
    )
    g.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="profile steps A..B (torch.profiler): wall vs "
        "GPU busy ms per step, top host ops and kernels, in OUT/step_profile_rank{r}.json, and the\n"
        "window's timeline in OUT/step_trace_rank{r}.json.gz (Chrome trace; default: off)",
    )


__all__ = ["add_step_arguments"]
