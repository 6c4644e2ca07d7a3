"""The training core under `occult.lm` and `occult.integrations`: one step loop, one gradient
path, one checkpoint format family, one place for hooks.

    parallel.py   `Parallel` (EP groups x data-parallel replicas), `setup_parallel`, `global_mean`
    grads.py      gradients of the global-batch loss: DDP wrapping, expert all-reduce, global-norm clipping
    dtensor.py    FSDP2 DTensor helpers (`is_sharded`, `full_tensor`, `local_tensor`, `like_param`)
    schedule.py   `CosineSchedule`: warm-up, cosine decay, extension when a resumed run gets more steps
    optim.py      `adamw`, `AdamW`: the trainers' AdamW, fused for GPU parameters (FSDP2 shards too), large tensors
                  through occult's one-pass kernel (occult.kernels.adamw)
    loop.py       `TrainLoop`: the step loop (forward, loss, backward, sync, clip, optimizer, metrics,
                  progress) over a model's `StepParts`
    hooks.py      `StepHook`: what runs after every step (re-placement, evaluation, checkpoints)
    layer_graphs.py  the MoE layers replayed from CUDA graphs for a run (`--layer-graphs`): checks, switch
    step_graph.py the whole step recorded once as one CUDA graph and replayed (`--captured-step`)
    two_batch.py  a step's forward and backward as two interleaved micro-batches (`interleaved_backward`)
    dcp.py        sharded checkpoints with torch.distributed.checkpoint: atomic write, hash check,
                  resume on any number of ranks

`occult train` / `occult finetune` (`occult.lm.train`) and `occult finetune --hf`
(`occult.integrations.hf.finetune`) are adapters over it: each says how a batch becomes a
loss, which parameters train, how gradients sync, and what its checkpoint's document holds.
"""

from occult.training.dcp import find_checkpoint, load_checkpoint, read_checkpoint_doc, save_checkpoint, state_tensors
from occult.training.grads import clip_grad_norm, sync_gradients, wrap_ddp
from occult.training.hooks import StepHook
from occult.training.loop import LoopSettings, StepLoss, StepParts, TrainClock, TrainLoop
from occult.training.parallel import Parallel, global_mean, setup_parallel
from occult.training.schedule import CosineSchedule

__all__ = [
    "Parallel",
    "setup_parallel",
    "global_mean",
    "sync_gradients",
    "clip_grad_norm",
    "wrap_ddp",
    "CosineSchedule",
    "TrainLoop",
    "StepParts",
    "StepLoss",
    "LoopSettings",
    "TrainClock",
    "StepHook",
    "save_checkpoint",
    "find_checkpoint",
    "read_checkpoint_doc",
    "load_checkpoint",
    "state_tensors",
]
