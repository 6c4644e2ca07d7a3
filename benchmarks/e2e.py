"""Whole-model end-to-end benchmark: transformers MoE models, expert-parallel with occult, against
the no-communication floor (issue 14, item 1).

    torchrun --nproc-per-node 2 benchmarks/e2e.py --model olmoe --out e2e.json
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 benchmarks/e2e.py --model olmoe --out e2e_nop2p.json

Every rank builds the same random model (seeded, then broadcast from rank 0; bf16 on GPUs, fp32
on CPU), with router weights re-drawn wider (std --router-std at hidden 2048, scaled by
sqrt(2048/H)) so that top-k choices are separated as with a trained router; --router-trace gives
them a trained model's co-activation structure (benchmarks/_router_trace.py). Variants:

  native           the unconverted transformers model, its default experts implementation
                   (grouped_mm in transformers 5.x), every rank its own batch (data parallel:
                   its gradients are all-reduced in training); what a user runs without occult
  replicated       every rank holds all experts (converted over a one-rank group: occult's own
                   kernels, no expert-parallel traffic); the floor. Its expert gradients are
                   not all-reduced in training (that would be data-parallel traffic)
  standard         occult, one copy per (token, expert)
  dedup            occult, one copy per (token, device)
  dedup+placement  dedup over a greedy placement solved from the model's own routing
                   (hf.profile on a calibration batch of random ids per rank)
  prunedN          dedup + placement with max_devices=N (approximate: its check is report-only)
  <variant>/compile  any variant, native too, with its decoder layers torch.compiled
                   (occult.integrations.hf.compile_layers: inductor fuses the norms, rotary and residual
                   adds; one-rank MoE blocks traced in, expert-parallel ones eager between the layer's graphs,
                   replayed from their own CUDA graphs where they have no host wait); each phase's compile
                   time is reported apart (its first step less a steady one), e.g. native/compile,replicated/compile
  <variant>@device   an expert-parallel variant over the device transport (ExecConfig(transport="device"):
                   row counts stay on the GPU, rows stored into the peers' memory, no host wait; GPUs of one host
                   only, skipped elsewhere with the reason), e.g. dedup@device, dedup@device/compile
  <variant>@syncfree  an expert-parallel variant with sync-free dispatch (ExecConfig(sync_free=True): fixed-
                   capacity all-to-alls over NCCL, no host wait; every rank the same token count), e.g. for a
                   slow link where the device transport does not apply: dedup@syncfree/layergraphs
  <variant>@host  as @syncfree, the fixed-capacity all-to-alls through shared pinned host memory by the GPUs'
                   copy engines instead of NCCL (ExecConfig(sync_free=True, transport="host"), occult.moe.host_wire:
                   GPUs of one host; for a slow link: no SM taken from the experts), e.g. dedup@host/compile/interleave4
  <variant>/graph  prefill only, its whole forward captured once in a CUDA graph and replayed with fresh
                   ids (occult.integrations.hf.GraphedForward): the host costs one launch a step. For @device,
                   @syncfree variants and replicated (sync-free on its one rank); the replay is checked against the
                   eager forward (its max relative error above --tol fails the variant). GPUs only.
                   After /compile: the compiled layers captured too (e.g. dedup@device/compile/graph,
                   replicated/compile/graph; the compilation runs in the capture's warm-up)
  <variant>/twobatch  as /graph, the batch's two halves interleaved at every MoE layer's exchanges on two
                   streams of the capture (hf.GraphedForward(micro_batches=2), occult.moe.two_batch: one
                   half's all-to-all under the other's compute); @syncfree variants, an even --batch,
                   e.g. dedup@syncfree/compile/twobatch (wins on a slow link, not on NVLink: docs/overlap.md).
                   After /stepgraph it trains too: the recorded step's forward and backward as the two halves
                   interleaved (occult.training.two_batch; with /deferwgrad both halves defer their expert
                   weight gradients), e.g. dedup@syncfree/compile/stepgraph/twobatch
  <variant>/1f1b   train, with --accumulate K >= 2: the step's K micro-batches paired, micro-batch i+1's forward
                   with micro-batch i's backward (combined 1F1B, occult.training.accumulation: each side's
                   all-to-alls under the other's compute); @syncfree variants, not with /twobatch, e.g.
                   dedup@syncfree/compile/stepgraph/1f1b (every other variant accumulates the K in turn)
  <variant>/interleaveK  as /twobatch with K micro-batches (2-16, dividing --batch; prefill only): the turn
                   passes round all K at every exchange (hf.GraphedForward(micro_batches=K)), e.g.
                   dedup@syncfree/compile/interleave4 (/interleave2 is /twobatch)
  <variant>/capN   last: a dedup-based @syncfree variant's blocks for the other ranks bounded to ceil(N/100 x T)
                   rows and a header row (ExecConfig(sync_free_capacity=N/100): what placement and pruning save
                   reaches the wire; a dropped copy raises a RoutingError on every rank and fails the variant), e.g.
                   dedup+placement@syncfree/compile/interleave4/cap80
  <variant>/layergraphs  each MoE layer's forwards replayed from its own CUDA graphs (ExecConfig(graphs=True),
                   occult.moe.graphs: the host costs a copy in, a launch and a copy out per layer call; no
                   capture of the model's other layers); for @device, @syncfree variants and replicated;
                   training runs eagerly, e.g. dedup@device/layergraphs/compile, replicated/layergraphs/compile
  replicated/eagermoe/compile  compile_layers(trace_moe=False): the one-rank MoE blocks eager between their
                   decoder layer's two graphs (replicated/compile traces them into one graph per layer on GPUs,
                   the default since session 18; this was the default before)
  <variant>/tracemoe/compile  @syncfree variants: compile_layers(trace_moe=True), each sync-free MoE block, its
                   all-to-alls included, traced into its decoder layer's graph, forward and backward (one
                   micro-batch; not with /deferwgrad, which a compiled backward does not defer, nor /tilegrid),
                   e.g. dedup@syncfree/tracemoe/compile/stepgraph beside dedup@syncfree/compile/stepgraph
  <variant>/traingraphs/compile  @device and @syncfree variants: hf.compile_layers(train_graphs=True), the
                   MoE layers' training calls replayed too, forward and backward (occult.moe.train_graphs;
                   opt-in), e.g. dedup@device/traingraphs/compile. After its timed train steps, one more step's
                   gradients with the replays are compared with the same step with every MoE layer eager
                   (benchmarks/_replay_check.py): a worst relative error above --tol fails the variant
  <variant>/stepgraph  the training step (forward, backward, gradient sync, AdamW) recorded once as one CUDA
                   graph after 3 eager steps and replayed (occult.training.step_graph, as `occult train
                   --captured-step`); occult's one-rank and @device / @syncfree variants, their MoE layers eager
                   inside the recording (compile_layers(layer_graphs=False)); prefill runs as without it, e.g.
                   replicated/compile/stepgraph, dedup@device/compile/stepgraph
  <variant>/deferwgrad  the expert kernels' weight gradients deferred to a side stream (OCCULT_DEFER_WGRAD=1 for
                   this variant only, occult.kernels.deferred_wgrad: the dispatch's backward all-to-all under
                   them); occult's variants, e.g. dedup@device/compile/stepgraph/deferwgrad (docs/overlap.md)
  <variant>/tilegrid  the expert GEMMs launched one program per tile (OCCULT_KERNEL_GRID=tiles for this variant
                   only, occult.kernels.grouped_gemm: no persistent program left waiting for an SM another
                   stream holds); expert-parallel variants, last (after /deferwgrad), e.g.
                   dedup@syncfree/compile/stepgraph/twobatch/deferwgrad/tilegrid beside the same without it
  hf-ep            (opt-in) transformers' own tensor + expert parallelism (benchmarks/hf_ep.py:
                   from_pretrained with DistributedConfig(tp_size=N, ep_size=N)); every rank holds
                   the shared batch of all ranks' sequences; prefill only (train: not timed)
  torchtitan       (opt-in; --model qwen3 / tiny-qwen3) TorchTitan 0.3.0's own Qwen3-MoE with the same
                   weights, parallelised by its parallelize_qwen3: EP over all ranks, FSDP2 for the
                   rest (benchmarks/tt_model.py); prefill and train, each rank its own batch
  torchtitan+occult  (opt-in) the same TorchTitan model with occult's dedup token dispatcher switched on
                   (occult.integrations.torchtitan.install; contiguous experts, as torchtitan);
                   torchtitan+occult+placement: with the placement dedup+placement solves;
                   torchtitan+occult@device (and +placement@device): over the device transport;
                   torchtitan+occult@syncfree (any of them): fixed-capacity exchanges, no host wait;
                   any TorchTitan variant /compile: each transformer block's forward torch.compiled (as
                   TorchTitan's --compile.enable; its all-to-all breaks the graph, sync-free occult's does not);
                   torchtitan+occult+experts (also @device): occult's fused expert kernels in TorchTitan's
                   MoE too (OccultGroupedExperts: no expert-major expansion); torchtitan+occult+experts@syncfree
                   (/compile)/stepgraph: its forward+backward recorded as one CUDA graph and replayed, as
                   TorchTitan's trainer does by default where no dispatcher reads back to the host (its
                   wrap_with_cuda_graph; the optimizer eager after it); its replay checked against the eager step

Before timing, each variant's logits on a small batch are compared with the unconverted model
(per-token relative L2 error, median and p95, max over ranks); an exact variant whose median is
above --tol makes the run exit 1 (after the others are measured). In half precision the unconverted
model is also run upcast to fp32, and a variant passes too if its error against that fp32 model is
at most 1.25x the half-precision native model's own plus --tol (discrete routing with near-tied scores, as
DeepSeek-V3's on random weights, picks other experts under any change of rounding, compiled kernels
of transformers' own model included). That check sees the forward only; before a variant's train steps its MoE
backward is checked too (benchmarks/_grad_check.py; not TorchTitan's model): the gradients of every router, of
the norm in front of each MoE block and of up to three well-reached experts' weights in each (an expert-parallel
layer's against the sum over its ranks), on one batch of the training shape, against the unconverted model's on
the same batch (relative L2 error, worst over those parameters and ranks; above 0.5 an exact variant fails and is
not timed: a lost MoE backward gives ~1; `grad_check` in the JSON; the batch goes in the micro-batches the step
splits it into, /twobatch's halves or --accumulate's K, so a compiled variant compiles in it what its steps run,
and `compile_s` counts it; the pass's own peak memory is `grad_check.peak_memory_gib`, its cached blocks are
freed after it and the variant's peaks leave it out; in bf16 an exact variant's worst is ~0.3, an expert's
gradient moving with the tokens a near-tied router sends it). Phases: prefill (eval, no_grad, forward with
logits of the last position as `generate` does) and
train (forward, next-token cross-entropy (--loss occult: occult's kernel for occult's variants, transformers'
ForCausalLMLoss for transformers' own, as --optimizer adamw gives each side its user's AdamW), backward inside
`occult.agreed_step` as occult's trainers run them
(OCCULT_AGREEMENT=step: the device transport's ranks agree once a step; the default, call: at every
layer call), hf.sync_gradients (each rank's loss scaled by 1/W, the gradients summed: no pass dividing them),
optimizer step). Each step gets fresh
random ids; ranks meet at a barrier before each step; a step's time is the slowest rank's
(CUDA events on GPUs, wall clock on CPU). After the timed steps, 5 more are timed on the host from an idle GPU
(`host_ms_per_step`: what issuing a step costs the host with nothing queued to hide it, waits for the GPU and for
other ranks' hosts counted; the slowest rank's) and per MoE layer call (`host_ms_per_moe_call`: a training step
makes two a layer, forward and backward; issue 52 asks <= 0.3 ms). Rank 0 writes the JSON after every variant
(atomically) and prints a Markdown table last. NCCL_P2P_DISABLE is only recorded.

Hardware: the same run first measures a bf16 matmul's rate (8192^3 on GPUs) and a device copy's
bandwidth (benchmarks/_roofline.py); every phase reports its model FLOPs (prefill: the forward with
logits of the last position; train: 3x the forward with every position's logits), TFLOP/s and MFU
(of the measured matmul rate), and the table its speed-up over native (native ms / its ms).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _router_trace  # noqa: E402  (benchmarks/_router_trace.py: routers with a trace's co-activation)
import hf_ep  # noqa: E402  (benchmarks/hf_ep.py: transformers' own expert parallelism)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import tt_model  # noqa: E402  (benchmarks/tt_model.py: TorchTitan's own Qwen3-MoE, EP + FSDP2)
from _gathered_embedding import gather_embedding_grads, replicas_equal  # noqa: E402  (benchmarks/_gathered_embedding.py)
from _grad_check import (  # noqa: E402  (benchmarks/_grad_check.py)
    gradient_check,
    reference_gradients,
    truth_gradients,
    worst_native,
)
from _replay_check import replay_check  # noqa: E402  (benchmarks/_replay_check.py: replays vs eager layers)
from _roofline import ModelCost, measure_peaks, rate  # noqa: E402  (benchmarks/_roofline.py: MFU, bandwidth)
from _timing import (  # noqa: E402,F401  (benchmarks/_timing.py; decode.py and serve.py import some from here)
    Truth,
    back_to_back,
    checked,
    finish,
    fp32_copy_logits,
    fp32_note,
    free_memory,
    host_times,
    log,
    new_report,
    parser,
    quantiles,
    synchronize,
    write_json,
)
from _timing import (
    time_steps as _time_steps,
)

from occult import ExecConfig, Placement, RoutingConfig, agreed_step  # noqa: E402
from occult.distributed import finish_distributed, init_distributed  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.integrations.hf.graphed import masks_as_eager  # noqa: E402
from occult.moe import symm  # noqa: E402  (the device transport: where it can run)
from occult.moe.model_layers import set_sync_free  # noqa: E402
from occult.teardown import release_captured  # noqa: E402
from occult.tools.bench import variant_sync_free, variant_transport  # noqa: E402
from occult.training.accumulation import accumulate_backward  # noqa: E402
from occult.training.bucketed_sync import BucketedSync  # noqa: E402
from occult.training.optim import adamw  # noqa: E402
from occult.training.signature import ModelSignature  # noqa: E402
from occult.training.step_graph import CudaRecorder, StepGraph  # noqa: E402
from occult.training.two_batch import interleaved_backward  # noqa: E402

VARIANTS = ("native", "replicated", "standard", "dedup", "dedup+placement", "pruned2", "pruned1")
EXACT = ("native", "replicated", "standard", "dedup", "dedup+placement", "hf-ep", *tt_model.VARIANTS)
PEERS = ("hf-ep", *tt_model.VARIANTS)  # opt-in (not in "all" / the default list)
PHASES = ("prefill", "train")
HOST_STEPS = 5  # steps timed on the host from an idle GPU, after the timed ones (`host_time`)
TINY = {"tiny": "olmoe", "tiny-qwen3": "qwen3_moe", "tiny-deepseek": "deepseek_v3"}
MODELS = {  # name -> (transformers config class, fields); real shapes, fewer layers for Qwen3 / DeepSeek
    "olmoe": (
        "OlmoeConfig",
        dict(  # OLMoE-1B-7B
            vocab_size=50304,
            hidden_size=2048,
            intermediate_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=False,
        ),
    ),
    "qwen3": (
        "Qwen3MoeConfig",
        dict(  # Qwen3-30B-A3B layers, 8 of them
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
    "deepseek": (
        "DeepseekV3Config",
        dict(  # DeepSeek-V2-Lite shape, V3 routing (sigmoid, groups), 8 layers
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=8,
            first_k_dense_replace=1,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        ),
    ),
}


def variant_list(text: str) -> list[str]:
    """argparse type: a comma list of variants ("all" = every default one; prunedN for any N >= 1), each
    optionally over the device transport (`@device`) and compiled (`/compile`) or graph-captured (`/graph`)."""
    names = list(VARIANTS) if text == "all" else [v.strip() for v in text.split(",") if v.strip()]
    bad = [
        v
        for v in names
        if base_variant(v) not in VARIANTS + PEERS and not re.fullmatch(r"pruned[1-9]\d*", base_variant(v))
    ]
    bad += [  # (the peers take no modifier but how torchtitan+occult* exchange, @device or @syncfree, and the
        v  # TorchTitan variants /compile: its blocks compiled as TorchTitan's --compile.enable does)
        for v in names
        if base_variant(v) in PEERS
        and _HOW.sub("", titan_stem(v) if base_variant(v) in tt_model.VARIANTS else v) != base_variant(v)
    ]
    bad += [  # (TorchTitan's step recorded: only with a dispatcher and experts that never read back to the host)
        v
        for v in names
        if base_variant(v) in tt_model.VARIANTS
        and step_graph(v)
        and not (base_variant(v) == "torchtitan+occult+experts" and sync_free(v))
    ]
    bad += [v for v in names if on_device(v) and (base_variant(v) in ("native", "replicated", "hf-ep", "torchtitan"))]
    bad += [v for v in names if sync_free(v) and (base_variant(v) in ("native", "replicated", "hf-ep", "torchtitan"))]
    bad += [
        v
        for v in names
        if (is_graphed(v) or layer_graphs(v)) and not (on_device(v) or sync_free(v) or base_variant(v) == "replicated")
    ]
    bad += [v for v in names if layer_graphs(v) and is_graphed(v)]
    bad += [v for v in names if micro_batches(v) > 1 and not sync_free(v)]
    bad += [  # (/capN: the dedup dispatcher's sync-free blocks, 1 <= N < 100)
        v
        for v in names
        if CAPACITY.search(v)
        and not (sync_free(v) and 0 < sync_free_capacity(v) < 1 and base_variant(v) not in ("standard", *PEERS))
    ]
    bad += [v for v in names if micro_batches(v) > 2 and step_graph(v)]  # (a training step: two halves)
    bad += [v for v in names if paired(v) and not pairable(v)]
    bad += [v for v in names if INTERLEAVE.search(v) and not 2 <= micro_batches(v) <= 16]
    bad += [v for v in names if train_graphs(v) and not (is_compiled(v) and (on_device(v) or sync_free(v)))]
    bad += [v for v in names if eager_moe(v) and not (is_compiled(v) and base_variant(v) == "replicated")]
    bad += [
        v
        for v in names
        if traced_moe(v)  # (sync-free layers trace; one micro-batch; a compiled backward defers nothing)
        and not (is_compiled(v) and sync_free(v) and micro_batches(v) == 1 and not paired(v))
        or traced_moe(v)
        and (train_graphs(v) or deferred_wgrad(v) or tile_grid(v) or eager_moe(v))
    ]
    # (/tilegrid: expert-parallel layers only, which compile_layers never traces: the grid is read at each launch)
    bad += [v for v in names if tile_grid(v) and base_variant(v) in ("native", "replicated", *PEERS)]
    bad += [
        v
        for v in names
        if deferred_wgrad(v)  # (not after a prefill-only /graph or /twobatch: nothing is trained there)
        and (base_variant(v) in ("native", "hf-ep", *PEERS) or is_graphed(v) and not step_graph(v))
    ]
    bad += [
        v
        for v in names
        if step_graph(v)
        and not (base_variant(v) == "replicated" or on_device(v) or sync_free(v))
        or step_graph(v)
        and (layer_graphs(v) or train_graphs(v) or is_graphed(v) and micro_batches(v) == 1)
    ]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown variant(s) {bad or text!r}; choose from {', '.join(VARIANTS)} (prunedN), "
            f"each optionally /compile, the expert-parallel ones @device (the device transport), @syncfree "
            f"(fixed capacity, no host wait) or @host (as @syncfree, through host memory by copy engines; @host "
            f"takes every @syncfree modifier), and replicated, @device or @syncfree ones /graph (prefill in one "
            f"CUDA graph: no host wait) or /layergraphs (each MoE layer's forward replayed from its graphs; not "
            f"with /graph), @syncfree ones /twobatch (two interleaved micro-batches), /interleaveK (K of them, "
            f"prefill) or /1f1b (train: the --accumulate micro-batches paired), @device or @syncfree ones "
            f"/traingraphs/compile (training calls replayed too), replicated/eagermoe/compile (MoE blocks "
            f"eager between their layer's graphs), @syncfree ones /tracemoe/compile (MoE blocks traced, their "
            f"all-to-alls too), replicated, @device or @syncfree ones /stepgraph (the training "
            f"step in one CUDA graph; not with the other graph modifiers), occult's variants /deferwgrad (the "
            f"experts' weight gradients on a side stream), expert-parallel ones /tilegrid (last: the expert GEMMs one "
            f"program per tile), or the peers "
            f"{', '.join(PEERS)} (torchtitan+occult* also @device or @syncfree, torchtitan* /compile, "
            f"torchtitan+occult+experts@syncfree also /stepgraph after it; the overlap "
            f"schedules /cN, /tbo and @chunksN were removed: docs/overlap.md)"
        )
    return names


_HOW = re.compile(r"@(device|syncfree|host)$")  # how an expert-parallel variant exchanges


def titan_stem(variant: str) -> str:
    """'torchtitan+occult+experts@syncfree/compile/stepgraph' -> 'torchtitan+occult+experts@syncfree': a TorchTitan
    variant's modifiers (its blocks compiled, its forward+backward recorded as TorchTitan's trainer records it)."""
    return variant.removesuffix("/stepgraph").removesuffix("/compile")


def _stem(variant: str) -> str:
    """'dedup@syncfree/compile/graph' -> 'dedup@syncfree' (the modifiers after the slash gone)."""
    return _without_capture(variant).removesuffix("/compile")


def base_variant(variant: str) -> str:
    """'dedup@device/compile/graph' -> 'dedup'; a variant without modifiers is its own base."""
    return _HOW.sub("", _stem(variant))


def on_device(variant: str) -> bool:
    """'dedup@device': the device transport (counts on the GPU, rows stored into the peers' memory; no host wait)."""
    return _stem(variant).endswith("@device")


def sync_free(variant: str) -> bool:
    """'dedup@syncfree': sync-free, fixed-capacity dispatch (no host wait; `occult bench`'s reading of the suffix)."""
    return variant_sync_free(_stem(variant))


def is_compiled(variant: str) -> bool:
    """'replicated/compile' (or '.../compile/graph'): the decoder layers torch.compiled around the MoE
    blocks (hf.compile_layers)."""
    return _without_capture(variant).endswith("/compile")


def layer_graphs(variant: str) -> bool:
    """'dedup@device/layergraphs': every MoE layer's forwards replayed from its own CUDA graphs
    (`ExecConfig(graphs=True)`)."""
    return "/layergraphs" in variant


def train_graphs(variant: str) -> bool:
    """'dedup@device/traingraphs/compile': compile_layers(train_graphs=True), training calls replayed too."""
    return "/traingraphs" in variant


def step_graph(variant: str) -> bool:
    """'replicated/compile/stepgraph': the training step recorded as one CUDA graph (occult.training.step_graph)."""
    return "/stepgraph" in variant


def paired(variant: str) -> bool:
    """'dedup@syncfree/compile/stepgraph/1f1b': the train step's --accumulate micro-batches paired (combined 1F1B,
    occult.training.accumulation)."""
    return _unset(variant).endswith("/1f1b")


def pairable(variant: str) -> bool:
    """Whether a '/1f1b' variant's step can pair its micro-batches: sync-free, no graph modifier but /stepgraph
    (the whole step recorded), not split into halves or K parts itself."""
    unpaired = _unset(variant).removesuffix("/1f1b")
    plain = not (is_graphed(unpaired) or layer_graphs(unpaired) or train_graphs(unpaired))
    return sync_free(variant) and plain and micro_batches(unpaired) == 1


# the variant's last modifiers, each an environment setting while it runs (`variant_settings`), in this order
SETTING_MODIFIERS = {"/deferwgrad": ("OCCULT_DEFER_WGRAD", "1"), "/tilegrid": ("OCCULT_KERNEL_GRID", "tiles")}


CAPACITY = re.compile(r"/cap(\d+)$")  # '/capN': ExecConfig(sync_free_capacity=N/100), the variant's last modifier


def sync_free_capacity(variant: str) -> float:
    """'dedup+placement@syncfree/compile/interleave4/cap80': 0.8, each other rank's sync-free block bounded to
    ceil(0.8 T) rows (ExecConfig.sync_free_capacity; a dropped copy fails the variant); 1.0 without it."""
    match = CAPACITY.search(variant)
    return int(match.group(1)) / 100 if match else 1.0


def split_settings(variant: str) -> tuple[str, dict[str, str]]:
    """'dedup@syncfree/compile/stepgraph/deferwgrad/tilegrid' -> ('dedup@syncfree/compile/stepgraph',
    {'OCCULT_DEFER_WGRAD': '1', 'OCCULT_KERNEL_GRID': 'tiles'}): the variant without its setting modifiers (taken
    off the end, last first), and the settings they ask for."""
    env = {}
    variant = CAPACITY.sub("", variant)
    for suffix, (name, value) in reversed(SETTING_MODIFIERS.items()):
        if variant.endswith(suffix):
            variant = variant.removesuffix(suffix)
            env[name] = value
    return variant, env


def _unset(variant: str) -> str:
    """The variant without its setting modifiers (`split_settings`)."""
    return split_settings(variant)[0]


def deferred_wgrad(variant: str) -> bool:
    """'dedup@device/compile/deferwgrad': OCCULT_DEFER_WGRAD=1 while this variant runs (`variant_settings`)."""
    return "OCCULT_DEFER_WGRAD" in split_settings(variant)[1]


def tile_grid(variant: str) -> bool:
    """'dedup@syncfree/compile/tilegrid': OCCULT_KERNEL_GRID=tiles while this variant runs (`variant_settings`)."""
    return "OCCULT_KERNEL_GRID" in split_settings(variant)[1]


@contextlib.contextmanager
def variant_settings(variant: str) -> Iterator[None]:
    """The environment settings a variant asks for (`/deferwgrad`, `/tilegrid`), set while it runs and restored
    after."""
    env = split_settings(variant)[1]
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def traced_moe(variant: str) -> bool:
    """'dedup@syncfree/tracemoe/compile': compile_layers(trace_moe=True), the sync-free expert-parallel MoE blocks
    traced into their decoder layers' graphs, all-to-alls included."""
    return "/tracemoe" in variant


def eager_moe(variant: str) -> bool:
    """'replicated/eagermoe/compile': compile_layers(trace_moe=False), one-rank MoE blocks eager between their
    layer's two graphs."""
    return "/eagermoe" in variant


INTERLEAVE = re.compile(r"/interleave(\d+)$")  # '/interleaveK': K interleaved micro-batches (prefill)


def is_graphed(variant: str) -> bool:
    """'dedup@device/graph': the whole prefill forward captured in one CUDA graph (hf.GraphedForward);
    '/twobatch' and '/interleaveK' too, as two or K interleaved micro-batches."""
    stem = _unset(variant)
    return stem.endswith(("/graph", "/twobatch")) or INTERLEAVE.search(stem) is not None


def micro_batches(variant: str) -> int:
    """'dedup@syncfree/compile/twobatch': 2 (hf.GraphedForward(micro_batches=2); after /stepgraph the train
    step's halves too, occult.training.two_batch); '.../interleaveK': K; 1 otherwise."""
    stem = _unset(variant)
    if stem.endswith("/twobatch"):
        return 2
    match = INTERLEAVE.search(stem)
    return int(match.group(1)) if match else 1


def _without_capture(variant: str) -> str:
    """The variant without its graph and schedule modifiers ('/layergraphs', '/traingraphs', '/eagermoe', '/tracemoe',
    a final '/graph', '/twobatch', '/interleaveK' or '/1f1b')."""
    stem = _unset(variant).removesuffix("/1f1b")
    for modifier in ("/layergraphs", "/traingraphs", "/eagermoe", "/tracemoe", "/stepgraph"):
        stem = stem.replace(modifier, "")
    return INTERLEAVE.sub("", stem.removesuffix("/graph").removesuffix("/twobatch"))


def phase_list(text: str) -> list[str]:
    """argparse type: a comma list of phases."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names or any(p not in PHASES for p in names):
        raise argparse.ArgumentTypeError(f"unknown phase(s) in {text!r}; choose from {', '.join(PHASES)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--model", default="olmoe", choices=[*MODELS, *TINY], help="model shape (tiny*: CPU smoke runs)")
    p.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    p.add_argument(
        "--variants",
        type=variant_list,
        default=list(VARIANTS),
        help=f"comma list (default: {','.join(VARIANTS)}; opt-in: {','.join(PEERS)})",
    )
    p.add_argument("--phases", type=phase_list, default=list(PHASES), help="comma list of prefill,train")
    p.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--tokens", type=int, default=None, help="tokens per GPU per step; sets --batch to tokens/seq")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant and phase")
    p.add_argument("--iters", type=int, default=10, help="timed steps per variant and phase")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "adamw-torch", "sgd"],
        help="adamw: fused on CUDA, occult's kernel for occult's variants and torch's for transformers' own; "
        "adamw-torch: torch's fused AdamW for every variant; sgd: less memory",
    )
    p.add_argument(
        "--loss",
        default="occult",
        choices=["occult", "transformers"],
        help="train: occult: occult's cross-entropy (occult.training.loss: no float copy of the logits) for "
        "occult's variants, transformers' ForCausalLMLoss for transformers' own; transformers: transformers' loss "
        "for every variant (the loss out of the comparison)",
    )
    p.add_argument(
        "--dense-sync",
        default="after",
        choices=["after", "overlap"],
        help="train: the replicated gradients all-reduced after the backward (hf.sync_gradients), or in buckets "
        "during it (occult.training.bucketed_sync, as DDP does, recordable in /stepgraph); every variant alike",
    )
    p.add_argument(
        "--embedding-grads",
        default="all-reduce",
        choices=["all-reduce", "gathered"],
        help="train, several ranks: the input embedding's gradient all-reduced with the other replicated ones, or "
        "gathered: its backward all-gathers every rank's tokens' rows instead (benchmarks/_gathered_embedding.py, an "
        "experiment); occult's variants, the replicated floor's too",
    )
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="train: the step's --batch sequences as this many micro-batches, their gradients accumulated (in turn; "
        "paired for /1f1b variants), the dense ones reduced once a step (--dense-sync overlap: during the last "
        "backward)",
    )
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: bf16 on GPUs, fp32 on CPU")
    p.add_argument("--router-std", type=float, default=0.05, help="router weight std at hidden 2048")
    p.add_argument(
        "--router-groups",
        type=int,
        default=0,
        help="plant co-activation: experts in this many hidden groups share a router direction (0: off)",
    )
    p.add_argument(
        "--router-trace",
        default=None,
        help="routers with the co-activation structure of this routing trace (occult profile of a trained "
        "model with as many experts), layer l from its layer l mod its layers (benchmarks/_router_trace.py)",
    )
    p.add_argument("--check-batch", type=int, default=2, help="sequences per rank in the correctness check")
    p.add_argument("--check-seq", type=int, default=256, help="sequence length of the correctness check")
    p.add_argument("--tol", type=float, default=2e-2, help="max median relative logit error of an exact variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write every number as JSON here (rank 0, atomically)")
    args = p.parse_args(argv)
    if args.tokens is not None:
        if args.tokens % args.seq:
            p.error(f"--tokens {args.tokens} is not a multiple of --seq {args.seq}")
        args.batch = args.tokens // args.seq
    for name in ("batch", "seq", "iters", "check_batch", "check_seq"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    split = [v for v in args.variants if args.batch % micro_batches(v)]
    if split:
        p.error(f"--batch {args.batch} does not split into the micro-batches of {', '.join(split)}")
    if args.accumulate < 1 or args.batch % args.accumulate:
        p.error(f"--accumulate {args.accumulate}: give a count >= 1 that divides --batch {args.batch}")
    if args.accumulate > 1 and any(micro_batches(v) == 2 and step_graph(v) for v in args.variants):
        p.error("--accumulate and /stepgraph/twobatch: choose one way to split the step (or /1f1b to pair the K)")
    if args.accumulate > 1 and any(base_variant(v) in tt_model.VARIANTS for v in args.variants):
        p.error("--accumulate is not passed to TorchTitan's own train step: leave the torchtitan variants out")
    if args.accumulate < 2 and any(paired(v) for v in args.variants):
        p.error("/1f1b pairs the step's micro-batches: give --accumulate 2 or more")
    return args


def model_config(args: argparse.Namespace) -> Any:
    """The transformers config of --model (tiny: hf.tiny_config), --layers applied."""
    import transformers

    extra: dict[str, Any] = {"max_position_embeddings": max(4096, args.seq, args.check_seq)}
    if args.layers is not None:
        extra["num_hidden_layers"] = args.layers
    if args.model in TINY:
        return hf.tiny_config(TINY[args.model], vocab_size=256, **extra)
    cls, fields = MODELS[args.model]
    return getattr(transformers, cls)(**{**fields, "tie_word_embeddings": False, **extra})


def check_setup(args: argparse.Namespace, cfg: Any, world: int) -> str | None:
    """Why this run cannot work (experts vs world size, pruning limits), or None."""
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None) or cfg.num_local_experts
    k = cfg.num_experts_per_tok
    if E % world:
        return f"{args.model} has {E} experts, not divisible by world size {world}: use a world size dividing {E}"
    for v in (base_variant(v) for v in args.variants):
        if v.startswith("pruned") and int(v[6:]) * (E // world) < k:
            return f"{v}: {v[6:]} device(s) hold {int(v[6:]) * (E // world)} experts, fewer than top_k={k}"
    trace_path = getattr(args, "router_trace", None)  # decode.py and serve.py share this check
    if trace_path and (reason := trace_mismatch(trace_path, E)):
        return reason
    if "hf-ep" in args.variants and (reason := hf_ep.unavailable()):
        return f"hf-ep: {reason}"
    if set(tt_model.VARIANTS) & {base_variant(v) for v in args.variants} and (
        reason := tt_model.unavailable(cfg.model_type)
    ):
        return f"torchtitan: {reason}"
    recorded = [v for v in args.variants if base_variant(v) in tt_model.VARIANTS and step_graph(v)]
    if recorded and world == 1:  # (docs/integrations.md, "On two GPUs": what the one-rank replay got wrong)
        return (
            f"{', '.join(recorded)}: on one rank TorchTitan's recorded step fails its replay check, with occult's "
            "dispatcher or TorchTitan's own MoE alike (the loss equal, lm_head.weight's gradient 0.21 off, 1 x H200; "
            "docs/results/history/session35_titan_one_rank): run it on 2 or more ranks"
        )
    return None


def trace_mismatch(path: str, num_experts: int) -> str | None:
    """Why --router-trace cannot shape this model's routers, or None."""
    from occult.placement.trace import TraceError, trace_info

    try:
        found = trace_info(path)["num_experts"]
    except TraceError as exc:
        return f"--router-trace: {exc}"
    if found is None or int(found) != num_experts:
        return (
            f"--router-trace {path}: {found} experts, the model has {num_experts}: profile a model with "
            f"{num_experts} experts (occult profile)"
        )
    return None


def redraw_routers(model: nn.Module, args: argparse.Namespace, world: int) -> dict[str, Any]:
    """Router weights ~ N(0, (std * sqrt(2048/H))^2); with --router-groups, rows share hidden group
    directions; with --router-trace, rows carry that trace's co-activation structure (layer l takes the
    trace's layer l mod its layers: benchmarks/_router_trace.py). Returns what --router-trace fitted."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    trace_path = getattr(args, "router_trace", None)  # decode.py and serve.py build models with their own flags
    factors = trace_factors(trace_path, world, args.seed) if trace_path else None
    with torch.no_grad():
        for i, (_, block) in enumerate(hf.moe_blocks(model)):
            w_EH = block.gate.weight
            E, H = w_EH.shape
            row_norm = args.router_std * math.sqrt(2048 / H) * math.sqrt(H)
            if factors is not None:
                u_EE = factors["u"][i % len(factors["u"])]
                if u_EE.shape[0] != E:
                    raise SystemExit(
                        f"--router-trace {trace_path}: {u_EE.shape[0]} experts, the model has {E}: "
                        f"profile a model with {E} experts (occult profile)"
                    )
                w_EH.copy_(_router_trace.rows_from_factor(u_EE, H, row_norm, gen))
                continue
            rows_EH = torch.randn(E, H, generator=gen)
            if args.router_groups > 0:  # a random (non-contiguous) expert -> group map, unit variance kept
                group_E = torch.randperm(E, generator=gen) % args.router_groups
                rows_EH = 0.8 * torch.randn(args.router_groups, H, generator=gen)[group_E] + 0.6 * rows_EH
            w_EH.copy_(rows_EH * row_norm / math.sqrt(H))
    return {} if factors is None else {"trace": str(trace_path), "per_trace_layer": factors["info"]}


@functools.lru_cache(maxsize=2)
def trace_factors(path: str, world: int, seed: int) -> dict[str, Any]:
    """Per trace layer, the logit factor U of _router_trace.sharpen (calibrated for `world` devices)."""
    from occult.placement.trace import read_trace

    trace = read_trace(path)
    fitted = [
        _router_trace.sharpen(trace.layer(i), trace.num_experts, max(world, 2), seed) for i in range(trace.num_layers)
    ]
    return {"u": [u for u, _ in fitted], "info": [info for _, info in fitted]}


def build_model(args: argparse.Namespace, cfg: Any, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The seeded random model on `device`, identical on every rank (broadcast from rank 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.router_init = redraw_routers(model, args, dist.get_world_size())
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                dist.broadcast(t.data, src=0)
    return model


def random_ids(batch: int, seq: int, vocab: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq] token ids, drawn on the CPU generator (per rank) and moved to `device`."""
    return torch.randint(vocab, (batch, seq), generator=gen).to(device)


def logits_fn(model: nn.Module, **kw: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids [B, S] -> logits."""

    def forward(ids_BS: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids_BS, use_cache=False, **kw).logits

    return forward


@torch.no_grad()
def check_logits(
    model: nn.Module, ids_BS: torch.Tensor, ctx: dict, tol: float, rows: slice = slice(None)
) -> dict[str, Any]:
    """Per-token relative L2 error of the logits (of `rows`) vs the reference: median and p95 (max over
    ranks), and vs the fp32 reference in half precision (`_timing.checked`)."""
    model.eval()
    return checked(logits_fn(model)(ids_BS)[rows].float(), ctx["ref_logits"], tol, ctx["truth"])


def busiest_share(trace: Any, placement: Placement, world: int) -> list[float]:
    """Per layer, the share of the trace's tokens that use the device most of them use under `placement`: the
    rows a sync-free block for that device must hold, as a fraction of T (`ExecConfig.sync_free_capacity`)."""
    from occult.placement.stats import busiest_device_share

    return [busiest_device_share(trace.layer(i), placement.expert_device(i), world) for i in range(trace.num_layers)]


def solve_placement(
    model: nn.Module, args: argparse.Namespace, device: torch.device, world: int
) -> tuple[Placement, dict]:
    """Profile the model's routing (one calibration batch per rank), solve a greedy placement on rank 0."""
    from occult.placement.solvers import place
    from occult.placement.stats import mean_ct

    gen = torch.Generator().manual_seed(10_000 + args.seed + dist.get_rank())
    t0 = time.perf_counter()
    trace = hf.profile(model, [random_ids(args.batch, args.seq, model.config.vocab_size, device, gen)])
    box: list[Any] = [None]
    if dist.get_rank() == 0:  # per layer, greedy unless contiguous is better (e.g. DeepSeek's expert groups)
        L = trace.num_layers
        candidates = [Placement.contiguous(trace.num_experts, world, L), place(trace, world, method="greedy").placement]
        ct = [[mean_ct(trace.layer(i), p.expert_device(i), world) for i in range(L)] for p in candidates]
        pick = [int(ct[1][i] < ct[0][i]) for i in range(L)]
        placement = Placement.from_lists([candidates[pick[i]].expert_device(i).tolist() for i in range(L)], world)
        placed = [ct[pick[i]][i] for i in range(L)]
        box = [
            (
                placement,
                {
                    "method": "greedy, or contiguous where better",
                    "greedy_layers": sum(pick),
                    "calibration_tokens_per_layer": int(trace.num_tokens[0]),
                    "mean_ct_contiguous": sum(ct[0]) / L,
                    "mean_ct_greedy": sum(ct[1]) / L,
                    "mean_ct_placed": sum(placed) / L,
                    "mean_ct_contiguous_per_layer": ct[0],
                    "mean_ct_placed_per_layer": placed,
                    # the share of tokens that use the busiest device: the least sync_free_capacity that drops nothing
                    "busiest_device_share_contiguous_per_layer": busiest_share(trace, candidates[0], world),
                    "busiest_device_share_placed_per_layer": busiest_share(trace, placement, world),
                },
            )
        ]
    dist.broadcast_object_list(box, src=0)
    placement, info = box[0]
    info["seconds"] = time.perf_counter() - t0
    log(
        f"placement: E[C_T] contiguous {info['mean_ct_contiguous']:.3f}, greedy {info['mean_ct_greedy']:.3f}, "
        f"placed {info['mean_ct_placed']:.3f} (greedy on {info['greedy_layers']} of {trace.num_layers} layers; "
        f"top-{trace.top_k}, {world} devices, {info['calibration_tokens_per_layer']} calibration tokens); the busiest "
        f"device's share of tokens, contiguous {max(info['busiest_device_share_contiguous_per_layer']):.3f}, placed "
        f"{max(info['busiest_device_share_placed_per_layer']):.3f} (worst layer; the least /capN that drops nothing)"
    )
    return placement, info


def convert_variant(model: nn.Module, variant: str, placement: Placement | None, self_group: Any) -> nn.Module:
    """Convert `model` in place as `variant` (module docstring)."""
    base = base_variant(variant)
    if is_compiled(variant):  # before `native`: native/compile is transformers' model compiled
        model = convert_variant(model, variant.replace("/compile", ""), placement, self_group)
        trace = False if eager_moe(variant) else True if traced_moe(variant) else None  # None: one-rank, on a GPU
        hf.compile_layers(
            model, layer_graphs=not step_graph(variant), train_graphs=train_graphs(variant), trace_moe=trace
        )
        return model
    if base == "native":
        return model
    if base == "replicated":  # /graph: sync-free on its one rank (T rows, nothing padded), no host wait
        model = hf.convert(
            model, group=self_group, execution=ExecConfig(dispatcher="dedup", graphs=layer_graphs(variant))
        )
        set_sync_free(model, is_graphed(variant))
        return model
    execution = ExecConfig(
        dispatcher="standard" if base == "standard" else "dedup",
        transport=variant_transport(_stem(variant)),
        graphs=layer_graphs(variant),
        sync_free=sync_free(variant),
        sync_free_capacity=sync_free_capacity(variant),
    )
    if base in ("standard", "dedup"):
        return hf.convert(model, execution=execution)
    if base == "dedup+placement":
        return hf.convert(model, placement=placement, execution=execution)
    return hf.convert(
        model, placement=placement, execution=execution, routing=RoutingConfig(max_devices=int(base[len("pruned") :]))
    )


def comm_stats(model: nn.Module, device: torch.device, calls_per_step: int = 1) -> dict[str, float]:
    """Rows and bytes sent in the last step, summed over MoE layers, mean over ranks ({} if not exposed). A layer
    keeps its last call's counts: where a step calls each layer `calls_per_step` times (two interleaved halves),
    the step's are estimated as that many times the last call's (`calls_per_step` is then in the result)."""
    per_layer = [getattr(getattr(b, "experts", None), "last_comm_stats", None) for _, b in hf.moe_blocks(model)]
    if not per_layer or any(s is None for s in per_layer):
        return {}
    keys = sorted(k for k, v in vars(per_layer[0]).items() if isinstance(v, int))
    sums_K = torch.tensor(
        [sum(int(getattr(s, k)) for s in per_layer) for k in keys], dtype=torch.float64, device=device
    )
    dist.all_reduce(sums_K)
    out = {k: float(v) * calls_per_step / dist.get_world_size() for k, v in zip(keys, sums_K.tolist())}
    return out if calls_per_step == 1 else {**out, "calls_per_step": calls_per_step}


def make_step(
    model: nn.Module,
    phase: str,
    optimizer: torch.optim.Optimizer | None,
    captured: bool = False,
    micro_batches: int = 1,
    dense_sync: str = "after",
    accumulate: int = 1,
    pair: bool = False,
    gathered_embedding: bool = False,
) -> Callable[[torch.Tensor], None]:
    """One prefill or train step on ids [B, S]; `captured`: the train step recorded as one CUDA graph;
    `micro_batches=2`: its forward and backward as the batch's two halves interleaved (occult.training.two_batch);
    `accumulate=K`: the train step as K micro-batches, their gradients accumulated, in turn or, `pair`, paired
    (occult.training.accumulation);
    `dense_sync="overlap"`: the replicated gradients all-reduced in buckets during the backward
    (occult.training.bucketed_sync) instead of after it (`hf.sync_gradients`); `gathered_embedding`: the input
    embedding's gradient gathered in its backward and left out of both (benchmarks/_gathered_embedding.py)."""
    if phase == "prefill":
        model.eval()
        forward = logits_fn(model, logits_to_keep=1)

        def prefill(ids_BS: torch.Tensor) -> None:
            with torch.no_grad():
                forward(ids_BS)

        return prefill
    model.train()

    # the syncs sum (gradient_sync): each rank's loss its share of the global-batch mean
    scale = 1.0 / dist.get_world_size() if dist.is_initialized() else 1.0

    def loss_of(ids_BS: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids_BS, labels=ids_BS, use_cache=False).loss
        return loss if scale == 1.0 else loss * scale

    gathered = gather_embedding_grads(model) if gathered_embedding else None
    if gathered is not None:
        log("  train: the input embedding's gradient gathered in its backward, left out of the dense sync")
    sync = gradient_sync(model, dense_sync, complete=() if gathered is None else (gathered,))

    def train(ids_BS: torch.Tensor) -> tuple[torch.Tensor]:
        optimizer.zero_grad(set_to_none=True)
        with agreed_step(model, ids_BS.numel()):  # as occult's trainers run a step (OCCULT_AGREEMENT=step: agreed once)
            if micro_batches == 2:
                loss = interleaved_backward(model, loss_of, ids_BS.chunk(2))
            elif accumulate > 1:
                loss = accumulate_backward(model, loss_of, ids_BS.chunk(accumulate), pair, sync.unsynced)
            else:
                loss = loss_of(ids_BS)
                loss.backward()
        sync.finish()
        optimizer.step()
        return (loss.detach(),)

    if not captured:
        return train
    device = next(model.parameters()).device
    graph = StepGraph(optimizer, ModelSignature(model), CudaRecorder(device), capture_scope=masks_as_eager)
    return lambda ids_BS: graph.run(train, ids_BS)


_DENSE_GROUP: list = []  # every rank, a communicator apart from the MoE layers' (made at the first "overlap" step)


class GradientSync(NamedTuple):
    """`finish()` after a step's backward(s); `unsynced()`: the context an accumulated step's earlier backwards run
    in (the buckets held: the last backward reduces the sum once)."""

    finish: Callable[[], None]
    unsynced: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def gradient_sync(model: nn.Module, dense_sync: str, complete: tuple[nn.Parameter, ...] = ()) -> GradientSync:
    """How a train step sums its gradients over the ranks, each rank's loss scaled by 1/W before its backward (so
    the sums are the global-batch mean's gradients with no pass dividing them: occult.training.grads):
    `hf.sync_gradients(average=False)` after the backward ("after"), or ("overlap") the replicated gradients
    all-reduced in buckets while the (last) backward runs, on a group apart from the MoE layers' all-to-alls (every
    rank makes it at its first such step, in the same order); the expert gradients hold every rank's share already,
    and so do the `complete` ones (a gathered embedding's)."""
    if dense_sync == "after" or dist.get_world_size() == 1:
        return GradientSync(lambda: hf.sync_gradients(model, average=False, complete=complete))
    world = dist.get_world_size()
    if not _DENSE_GROUP:
        _DENSE_GROUP.append(dist.new_group(list(range(world))))
    bucketed = BucketedSync(hf.replicated_parameters(model, complete), _DENSE_GROUP[0], 1)
    return GradientSync(bucketed.finish, bucketed.held)


def fresh_ids(
    args: argparse.Namespace, vocab: int, device: torch.device, shared: bool, seed: int
) -> Callable[[], torch.Tensor]:
    """A source of fresh random ids [B, S] for this rank, drawn from `seed` (shared: every rank's ids gathered)."""
    gen = torch.Generator().manual_seed(seed + args.seed + dist.get_rank())

    def inputs() -> torch.Tensor:
        ids_BS = random_ids(args.batch, args.seq, vocab, device, gen)
        return hf_ep.gather_rows(ids_BS) if shared else ids_BS

    return inputs


def time_steps(
    step: Callable[[torch.Tensor], None],
    args: argparse.Namespace,
    vocab: int,
    device: torch.device,
    shared: bool = False,
) -> dict:
    """Median, p10, p90 of the step time in ms (each step: the slowest rank), tokens/s per GPU (shared: every
    rank steps on all ranks' ids, gathered before the clock starts)."""
    inputs = fresh_ids(args, vocab, device, shared, 20_000)
    ms = _time_steps(step, inputs, args.warmup, args.iters, device)
    q = quantiles(ms, [0.5, 0.1, 0.9])
    return {
        "ms_median": q[0],
        "ms_p10": q[1],
        "ms_p90": q[2],
        "ms_all": ms,
        "tokens_per_s_per_gpu": args.batch * args.seq / (q[0] / 1e3),
    }


def host_time(
    step: Callable[[torch.Tensor], None],
    args: argparse.Namespace,
    vocab: int,
    device: torch.device,
    shared: bool,
    cost: ModelCost,
    phase: str,
    passes: int = 1,
) -> dict:
    """Host ms to issue one step from an idle GPU (median of `HOST_STEPS`, the slowest rank's each), and per MoE
    layer call (issue 52: a training step makes two a layer, forward and backward; a prefill one; `passes`: the
    step's passes through the model, e.g. --accumulate's micro-batches)."""
    inputs = fresh_ids(args, vocab, device, shared, 50_000)
    ms = quantiles(host_times(step, inputs, HOST_STEPS, device), [0.5])[0]
    calls = len(cost.moe_layers) * (2 if phase == "train" else 1) * passes
    return {"host_ms_per_step": ms, "host_ms_per_moe_call": ms / calls if calls else None}


def back_to_back_time(
    step: Callable[[torch.Tensor], None], args: argparse.Namespace, vocab: int, device: torch.device, shared: bool
) -> dict:
    """Median, p10, p90 ms a step over --iters steps issued back to back (`_timing.back_to_back`): where the host
    keeps ahead, the GPU's own time a step (a trainer that reads its loss only now and then), beside
    `time_steps`' steps from an idle GPU, which also pay the host's issue before the GPU's first kernel."""
    inputs = fresh_ids(args, vocab, device, shared, 70_000)
    q = quantiles(back_to_back(step, inputs, args.iters, device), [0.5, 0.1, 0.9])
    return {"ms_back_to_back_median": q[0], "ms_back_to_back_p10": q[1], "ms_back_to_back_p90": q[2]}


def first_step_s(
    step: Callable[[torch.Tensor], None], args: argparse.Namespace, vocab: int, device: torch.device
) -> float:
    """Wall seconds of one untimed step (the first of a phase: what compiling it costs, plus a step)."""
    ids_BS = random_ids(args.batch, args.seq, vocab, device, torch.Generator().manual_seed(30_000 + args.seed))
    synchronize(device)
    t0 = time.perf_counter()
    step(ids_BS)
    synchronize(device)
    return time.perf_counter() - t0


def train_replay_check(model: nn.Module, args: argparse.Namespace, vocab: int, device: torch.device) -> dict | None:
    """One training step's gradients with the MoE layers' training calls replayed against the same step with
    the layers eager, on a fresh batch, no update (benchmarks/_replay_check.py); None where nothing replays."""
    gen = torch.Generator().manual_seed(60_000 + args.seed + dist.get_rank())
    ids_BS = random_ids(args.batch, args.seq, vocab, device, gen)

    def step() -> None:
        model(input_ids=ids_BS, labels=ids_BS, use_cache=False).loss.backward()

    return replay_check(model, step, args.tol)


def moe_backward_check(model: nn.Module, ctx: dict, res: dict, device: torch.device, chunks: int) -> float:
    """Before the timed train steps (the weights still the unconverted model's): the MoE blocks' backward
    against the unconverted model's (benchmarks/_grad_check.py), in `res["grad_check"]`, the batch in `chunks`
    micro-batches as the step splits it (the shapes it compiles for); an exact variant that fails it fails its
    check. Returns the pass's seconds (a compiled variant compiles in it)."""
    t0 = time.perf_counter()
    ids = ctx["grad_ids"]

    def scope() -> contextlib.AbstractContextManager:
        return agreed_step(model, ids.numel())

    check = gradient_check(model, ids, ctx["ref_grads"], chunks, scope, ctx.get("grad_truth"))
    if device.type == "cuda":  # the pass's own peak; then its cached blocks go, so the timed steps' peaks are theirs
        torch.cuda.synchronize(device)
        check["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        forget_peaks(device)
    check["seconds"] = time.perf_counter() - t0
    res["grad_check"] = check
    res["check"]["passed"] = res["check"]["passed"] and (check["passed"] or not res["exact"])
    log(
        f"  train: router, pre-MoE norm and sampled expert gradients vs the unconverted model, worst relative error "
        f"{check['max_rel_err']:.2e} over {check['params']} on this rank"
        + (
            f", {len(check['unchecked'])} left out (rounding moves them as far as a lost gradient: "
            f"{', '.join(check['unchecked'][:2])})"
            if check["unchecked"]
            else ""
        )
        + ("" if check["passed"] else f" ({check['worst_param']} on this rank)")
        + ("" if check["passed"] else "  FAILED" if res["exact"] else " (approximate: report only)")
    )
    return check["seconds"]


def unavailable(variant: str, device: torch.device) -> str | None:
    """Why `variant` cannot run here (a CPU run of a GPU-only variant), or None."""
    if (is_graphed(variant) or step_graph(variant)) and device.type != "cuda":
        return "CUDA graphs need a GPU"
    if on_device(variant) and (reason := symm.unavailable_reason(dist.group.WORLD)) is not None:
        return f"the device transport cannot run here: {reason}"
    return None


def graphed_step(
    model: nn.Module, args: argparse.Namespace, vocab: int, device: torch.device, micro: int = 1
) -> tuple[Callable[[torch.Tensor], None], dict[str, float]]:
    """The prefill step replayed from one CUDA graph (`micro` micro-batches), and the graph's logits
    against the eager forward's on one fresh batch (relative L2 per row: max and median)."""
    model.eval()
    t0 = time.perf_counter()
    graphed = hf.GraphedForward(model, args.batch, args.seq, micro_batches=micro)
    capture_s = time.perf_counter() - t0
    ids_BS = random_ids(args.batch, args.seq, vocab, device, torch.Generator().manual_seed(50_000 + dist.get_rank()))
    with torch.no_grad():
        eager_BV = model(input_ids=ids_BS, use_cache=False, logits_to_keep=1).logits[:, -1].float()
        err_B = (graphed(ids_BS).float() - eager_BV).norm(dim=-1) / eager_BV.norm(dim=-1).clamp_min(1e-30)
    log(f"  graph: captured in {capture_s:.1f} s; replay vs eager: max relative error {err_B.max().item():.2e}")
    return (lambda ids: graphed(ids)), {
        "capture_s": capture_s,
        "vs_eager_max_rel_err": err_B.max().item(),
        "vs_eager_median_rel_err": err_B.median().item(),
    }


def train_optimizer(model: nn.Module, variant: str, args: argparse.Namespace, device: torch.device) -> Any:
    """The train phase's optimizer (TorchTitan's variants build their own): SGD, or AdamW fused on CUDA, under
    --optimizer adamw what each side's user runs: occult's AdamW (`occult.training.optim.adamw`, its one-pass
    kernel) for occult's variants, torch's for transformers' own (`native`, `hf-ep`); torch's everywhere under
    --optimizer adamw-torch (the optimizer out of the comparison)."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    if args.optimizer == "adamw" and base_variant(variant) not in ("native", "hf-ep"):
        return adamw([{"params": list(model.parameters())}], lr=args.lr)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")


def train_loss(model: nn.Module, variant: str, args: argparse.Namespace) -> str:
    """The train phase's loss, as with the optimizer what each side's user runs: under --loss occult, occult's
    cross-entropy for occult's variants (`hf.use_occult_loss`), transformers' own for `native` and `hf-ep`;
    transformers' everywhere under --loss transformers. Returns its name for the result file."""
    if args.loss == "occult" and base_variant(variant) not in ("native", "hf-ep"):
        hf.use_occult_loss(model)
        return "occult cross_entropy"
    return "transformers ForCausalLMLoss"


def build_titan(
    variant: str, args: argparse.Namespace, cfg: Any, device: torch.device, dtype: torch.dtype, placement: Any
) -> tt_model.TitanLM:
    """A `torchtitan*` variant: the same seeded transformers model's weights in TorchTitan's model and
    parallelisation, with occult's dispatcher (and placement, fused experts) as the variant names."""
    hf_model = build_model(args, cfg, device, dtype)
    model = tt_model.TitanLM(
        hf_model,
        dist.get_world_size(),
        device,
        dtype,
        max(args.seq, args.check_seq),
        occult=base_variant(variant) != "torchtitan",
        placement=placement if base_variant(variant).endswith("+placement") else None,
        transport=variant_transport(_stem(variant)),
        fused_experts=base_variant(variant).endswith("+experts"),
        sync_free=sync_free(variant),
        compile_blocks=is_compiled(variant),
    )
    del hf_model
    free_memory(device)
    return model


@dataclass
class BuiltVariant:
    """One variant's model as `run_variant` runs it: what checks it (this rank's check ids and the rows of the logits
    that are its own), and which kind it is (TorchTitan's model; transformers' own EP, which shares one batch)."""

    model: Any
    check_ids: torch.Tensor
    rows: slice
    titan: bool
    shared: bool


def run_variant(variant: str, args: argparse.Namespace, cfg: Any, ctx: dict) -> dict:
    """Build, convert, check, then time every phase of one variant; frees its model."""
    device = ctx["device"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if (reason := unavailable(variant, device)) is not None:
        log(f"{variant}: skipped ({reason})")
        return {
            "exact": base_variant(variant) in EXACT,
            "skipped": reason,
            "phases": {},
            "check": {"passed": True, "median_rel_err": float("nan"), "p95_rel_err": float("nan")},
        }
    t0 = time.perf_counter()
    built = build_variant(variant, args, cfg, ctx)
    res: dict[str, Any] = {"exact": base_variant(variant) in EXACT, "setup_s": time.perf_counter() - t0, "phases": {}}
    check_variant(variant, built, args, ctx, res)
    peaks_before = (0, 0)  # (allocated, reserved) bytes before the backward check's pass (moe_backward_check)
    for phase in args.phases if res["check"]["passed"] else ():
        if (built.shared or is_graphed(variant) and not step_graph(variant)) and phase == "train":
            log(f"  {phase}: not timed for {variant} ({'inference peer' if built.shared else 'prefill only'})")
            continue
        go_on, peaks = run_phase(phase, variant, built, args, cfg, ctx, res)
        peaks_before = peaks or peaks_before
        if not go_on:
            break
    if device.type == "cuda":  # (the backward check's pass apart: its own peak is in grad_check)
        allocated, reserved = peaks_before
        res["peak_memory_gib"] = max(allocated, torch.cuda.max_memory_allocated(device)) / 2**30
        # what the card must hold: allocated tensors and every cached block, a graph pool's free ones too
        res["peak_reserved_gib"] = max(reserved, torch.cuda.max_memory_reserved(device)) / 2**30
        log(f"  peak memory: {res['peak_memory_gib']:.1f} GiB allocated, {res['peak_reserved_gib']:.1f} GiB reserved")
    release_captured()  # a graphed prefill's graph (with its collectives) goes with its model
    del built
    free_memory(device)
    return res


def peaks_now(device: torch.device) -> tuple[int, int] | None:
    """(allocated, reserved) peak bytes so far on a GPU, None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def forget_peaks(device: torch.device) -> None:
    """After a check's pass (kept apart from the variant's peaks): its cached blocks go, the peaks start again."""
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def build_variant(variant: str, args: argparse.Namespace, cfg: Any, ctx: dict) -> BuiltVariant:
    """The variant's model: TorchTitan's, transformers' own EP (every rank the shared batch of all ranks' check
    sequences, this rank's rows checked) or the seeded transformers model converted as the variant names."""
    device, check_ids, rows = ctx["device"], ctx["check_ids"], slice(None)
    titan, shared = base_variant(variant) in tt_model.VARIANTS, variant == "hf-ep"
    if titan:
        model = build_titan(variant, args, cfg, device, ctx["dtype"], ctx["placement"])
    elif shared:
        model = hf_ep.load(ctx["hf_ep_dir"], dist.get_world_size(), ctx["dtype"])
        hf_ep.remove(ctx["hf_ep_dir"])
        check_ids = hf_ep.gather_rows(check_ids)
        rows = slice(dist.get_rank() * args.check_batch, (dist.get_rank() + 1) * args.check_batch)
    else:
        model = convert_variant(
            build_model(args, cfg, device, ctx["dtype"]), variant, ctx["placement"], ctx["self_group"]
        )
    return BuiltVariant(model, check_ids, rows, titan, shared)


def check_variant(variant: str, built: BuiltVariant, args: argparse.Namespace, ctx: dict, res: dict) -> None:
    """The variant's logits on the check batch against the unconverted model's, into `res["check"]` (an
    approximate variant's reported only), with what the model is (`hf_ep`, `torchtitan`)."""
    model = built.model
    if built.shared:
        res["hf_ep"] = hf_ep.describe(model)
    if built.titan:
        res["torchtitan"] = model.describe()
        with torch.no_grad():
            model.eval()
            res["check"] = checked(model.logits(built.check_ids).float(), ctx["ref_logits"], args.tol, ctx["truth"])
    else:
        res["check"] = check_logits(model, built.check_ids, ctx, args.tol, built.rows)
    res["check"]["logits_passed"] = res["check"]["passed"]  # (the step checks below fail "passed" too)
    res["check"]["passed"] = res["check"]["passed"] or not res["exact"]
    log(
        f"{variant}: check median {res['check']['median_rel_err']:.2e} p95 {res['check']['p95_rel_err']:.2e}"
        + fp32_note(res["check"])
        + ("" if res["exact"] else " (approximate: report only)")
        + ("" if res["check"]["passed"] else "  FAILED")
    )


def run_phase(
    phase: str, variant: str, built: BuiltVariant, args: argparse.Namespace, cfg: Any, ctx: dict, res: dict
) -> tuple[bool, tuple[int, int] | None]:
    """Check (a train step's MoE backward first), time and record one phase into `res["phases"]`; (whether the
    variant goes on to its next phase, the peaks before the backward check's pass or None)."""
    model, device, titan = built.model, ctx["device"], built.titan
    check_s, peaks = None, None  # (the MoE backward's check, before any update: the unconverted model's weights)
    if phase == "train" and not titan:
        chunks = 2 if micro_batches(variant) == 2 else max(1, args.accumulate)
        peaks = peaks_now(device)  # the build's and earlier phases' peaks, past the check's reset
        check_s = moe_backward_check(model, ctx, res, device, chunks)
        if not res["check"]["passed"]:
            return False, peaks
    optimizer = None
    if phase == "train":
        optimizer = model.optimizer(args.optimizer, args.lr) if titan else train_optimizer(model, variant, args, device)
        if not titan:  # (after the backward check, which compares with transformers' own loss)
            res["loss"] = train_loss(model, variant, args)
    if is_graphed(variant) and phase == "prefill":
        step, res["graph"] = graphed_step(model, args, cfg.vocab_size, device, micro_batches(variant))
        res["graph"]["passed"] = res["graph"]["vs_eager_max_rel_err"] <= args.tol  # the replay: the eager forward
        if not res["graph"]["passed"]:
            res["check"]["passed"] = False
            log("  graph: replay differs from the eager forward  FAILED")
            return False, peaks
    elif titan:
        step = tt_model.make_step(model, phase, optimizer, step_graph(variant))
    else:
        step = make_step(
            model,
            phase,
            optimizer,
            step_graph(variant),
            micro_batches(variant),
            args.dense_sync,
            args.accumulate,
            paired(variant),
            args.embedding_grads == "gathered" and base_variant(variant) not in ("native", "hf-ep"),
        )
    res["phases"][phase] = out = time_phase(phase, variant, step, optimizer, built, args, cfg, ctx, check_s)
    if phase == "train" and not titan and args.embedding_grads == "gathered" and dist.get_world_size() > 1:
        out["embedding_replicas_equal"] = replicas_equal(model.get_input_embeddings().weight)  # (after the steps)
        if not out["embedding_replicas_equal"]:
            log("  train: the ranks' input embeddings differ after the steps  FAILED")
            res["check"]["passed"] = False
    if phase == "train" and titan and step_graph(variant):  # (needs the recording: before it goes)
        peaks = peaks_now(device)  # the recorded step's; the check's eager pass beside the recording is not training
        gen = torch.Generator().manual_seed(60_000 + args.seed + dist.get_rank())
        out["replay_check"] = step.check_recording(
            random_ids(args.batch, args.seq, cfg.vocab_size, device, gen), args.tol
        )
        step.release()  # (TorchTitan keeps a recording until its teardown)
        forget_peaks(device)
        passed_or_log(res, out["replay_check"], "recorded fwd+bwd against eager, worst relative error")
    del step, optimizer  # (the train step holds the optimizer: its state goes before the check)
    model.zero_grad(set_to_none=True)
    if phase == "train" and not titan and (replay := train_replay_check(model, args, cfg.vocab_size, device)):
        out["replay_check"] = replay
        passed_or_log(res, replay, "replays against eager layers, worst gradient relative error")
    return True, peaks


def time_phase(
    phase: str,
    variant: str,
    step: Callable[[torch.Tensor], Any],
    optimizer: torch.optim.Optimizer | None,
    built: BuiltVariant,
    args: argparse.Namespace,
    cfg: Any,
    ctx: dict,
    check_s: float | None,
) -> dict:
    """One phase's numbers: step times (and a compiled variant's compile time), host time, rows and bytes sent,
    the optimizer, FLOP rate and MFU; logged."""
    device, shared = ctx["device"], built.shared
    first_s = (
        first_step_s(step, args, cfg.vocab_size, device)
        if is_compiled(variant) and not (is_graphed(variant) and phase == "prefill")
        else None
    )  # (graphs compile in the capture)
    out = time_steps(step, args, cfg.vocab_size, device, shared)
    if first_s is not None:  # the phase's compilation: its first step less a steady one
        out["compile_s"] = first_s - out["ms_median"] / 1e3
        if check_s is not None:  # (plus the check's pass, which compiled the forward and backward)
            out["compile_s"] += max(0.0, check_s - out["ms_median"] / 1e3)
    passes = args.accumulate if phase == "train" else 1  # (two halves: still counted as one pass)
    out.update(host_time(step, args, cfg.vocab_size, device, shared, ctx["cost"], phase, passes))
    out.update(back_to_back_time(step, args, cfg.vocab_size, device, shared))
    # each layer's calls a step, as comm_stats counts them (a captured prefill's: its eager check, one whole batch)
    calls = (1 if phase == "prefill" and is_graphed(variant) else micro_batches(variant)) * passes
    out["comm"] = built.model.comm_stats() if built.titan else comm_stats(built.model, device, calls)
    if optimizer is not None:  # e.g. "occult AdamW", "torch AdamW" (what --optimizer adamw gave this side)
        out["optimizer"] = f"{type(optimizer).__module__.split('.')[0]} {type(optimizer).__name__}"
    flops = (
        ctx["cost"].forward_flops(args.batch, args.seq, args.batch)
        if phase == "prefill"
        else ctx["cost"].train_flops(args.batch, args.seq)
    )
    out.update(rate(flops, out["ms_median"], ctx["peaks"]))
    log(
        f"  {phase}: {out['ms_median']:.2f} ms (p10 {out['ms_p10']:.2f}, p90 {out['ms_p90']:.2f}), "
        f"{out['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {out['tflops_per_s']:.1f} TFLOP/s, MFU "
        f"{out['mfu']:.1%}; host {out['host_ms_per_step']:.2f} ms a step from an idle GPU; back to back "
        f"{out['ms_back_to_back_median']:.2f} ms a step"
        + (f", {out['host_ms_per_moe_call']:.3f} per MoE call" if out["host_ms_per_moe_call"] else "")
    )
    return out


def passed_or_log(res: dict, check: dict, what: str) -> None:
    """A step check's verdict into the variant's (`res["check"]["passed"]`), logged with its worst error."""
    res["check"]["passed"] = res["check"]["passed"] and check["passed"]
    log(
        f"  train: {what} {check['max_rel_err']:.2e}"
        + ("" if check["passed"] else f" ({check['worst_param']} on this rank)  FAILED")
    )


def fastest_floor(results: dict[str, dict], phase: str) -> float | None:
    """The median ms of the fastest replicated variant (the floor, however it runs) timed in `phase`, or None."""
    timed = [
        r["phases"][phase]["ms_median"]
        for v, r in results.items()
        if base_variant(v) == "replicated" and "skipped" not in r and phase in r.get("phases", {})
    ]
    return min(timed) if timed else None


def back_to_back_ms(t: dict) -> str:
    """A phase's back-to-back median for the table ("-" in files from before it was measured)."""
    return f"{t['ms_back_to_back_median']:.2f}" if "ms_back_to_back_median" in t else "-"


def table(results: dict[str, dict], phases: list[str]) -> str:
    """Markdown: variant x phase -> ms (p10-p90), back-to-back ms, tokens/s/GPU, speed-up over native (native ms /
    ms), MFU, ratio to the job's floor (its fastest replicated variant in that phase, e.g.
    replicated/compile/stepgraph), rows sent."""
    lines = [
        "| variant | phase | ms median (p10-p90) | back to back | tokens/s/GPU | native/this | MFU | x floor | "
        "rows sent/step/GPU (remote) | check median / p95 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, r in results.items():
        if "skipped" in r:
            lines.append(f"| {v} | - | skipped: {r['skipped']} | | | | | | | |")
            continue
        chk = f"{r['check']['median_rel_err']:.1e} / {r['check']['p95_rel_err']:.1e}" + (
            "" if r["check"]["passed"] else " FAILED"
        )
        for ph in phases:
            t = r["phases"].get(ph)
            if t is None:
                lines.append(f"| {v} | {ph} | not timed | | | | | | | {chk} |")
                continue
            floor = fastest_floor(results, ph)
            ratio = f"{t['ms_median'] / floor:.3f}" if floor else "-"
            native = results.get("native", {}).get("phases", {}).get(ph)
            speedup = f"{native['ms_median'] / t['ms_median']:.2f}" if native else "-"
            mfu = f"{t['mfu']:.1%}" if "mfu" in t else "-"
            c = t["comm"]
            rows = (
                (
                    f"{c.get('forward_rows', 0) + c.get('backward_rows', 0):,.0f} "
                    f"({c.get('forward_remote_rows', 0) + c.get('backward_remote_rows', 0):,.0f})"
                )
                if c
                else "-"
            )
            lines.append(
                f"| {v} | {ph} | {t['ms_median']:.2f} ({t['ms_p10']:.2f}-{t['ms_p90']:.2f}) | {back_to_back_ms(t)} | "
                f"{t['tokens_per_s_per_gpu']:,.0f} | {speedup} | {mfu} | {ratio} | {rows} | {chk} |"
            )
    return "\n".join(lines)


def start_run(args: argparse.Namespace, script: str, config_of: Callable[[argparse.Namespace], Any]) -> tuple | None:
    """The start every benchmark (e2e, decode, serve) shares: process group, device, dtype (bf16 on
    GPUs, fp32 on CPU, unless --dtype), model config, the setup check (rank 0 prints the problem and
    None is returned: exit 2), and a one-rank group per rank for the replicated floor (every rank
    creates every group). Returns (rank, world, device, dtype, cfg, self_group)."""
    rank, world = init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    cfg = config_of(args)
    problem = check_setup(args, cfg, world)
    if problem:
        if rank == 0:
            print(f"{script}: error: {problem}", file=sys.stderr, flush=True)
        finish_distributed(ok=False)
        return None
    self_groups = [dist.new_group([r]) for r in range(world)]
    return rank, world, device, dtype, cfg, self_groups[rank]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = start_run(args, "e2e.py", model_config)
    if run is None:
        return 2
    rank, world, device, dtype, cfg, self_group = run
    report = new_report(args, device, dtype, world, cfg, tokens_per_gpu=args.batch * args.seq)

    # reference logits (and the placement) from the unconverted model, which is then freed
    t0 = time.perf_counter()
    ref = build_model(args, cfg, device, dtype)
    report["env"]["build_s"] = time.perf_counter() - t0
    report["router_init"] = ref.router_init
    log(
        f"{args.model}: {len(hf.moe_blocks(ref))} MoE layers, {world} ranks, {device.type} {dtype}, "
        f"{args.batch}x{args.seq} tokens/GPU, NCCL_P2P_DISABLE={report['env']['NCCL_P2P_DISABLE']}, "
        f"built in {report['env']['build_s']:.1f} s"
    )
    gen = torch.Generator().manual_seed(30_000 + args.seed + rank)
    check_ids = random_ids(args.check_batch, args.check_seq, cfg.vocab_size, device, gen)
    with torch.no_grad():
        ref_logits = ref.eval()(input_ids=check_ids, use_cache=False).logits.float()
    grad_ids, ref_grads = None, None
    if "train" in args.phases:  # the MoE backward's check (benchmarks/_grad_check.py), at the training shape
        grad_ids = random_ids(args.batch, args.seq, cfg.vocab_size, device, gen)
        ref_grads = reference_gradients(ref, grad_ids)
    placement = None
    if any(v.endswith("+placement") or v.startswith("pruned") for v in (base_variant(v) for v in args.variants)):
        placement, report["placement"] = solve_placement(ref, args, device, world)
    hf_ep_dir = hf_ep.save(ref) if "hf-ep" in args.variants else None
    cost = ModelCost.of(ref)  # of the unconverted model: all experts, whatever the world size
    truth = None
    if dtype != torch.float32:  # last use of ref: upcast in place
        truth = Truth(fp32_copy_logits(ref, lambda m: m(input_ids=check_ids, use_cache=False).logits), ref_logits)
        log(f"{args.model}: unconverted model in {dtype} vs fp32: median relative logit error {truth.native_err:.2e}")
    grad_truth = None
    if truth is not None and ref_grads is not None:  # (ref is fp32 now) the checked parameters' fp32 gradients
        grad_truth = truth_gradients(ref, grad_ids, list(ref_grads), chunks=args.batch)
        worst, err = worst_native(ref_grads, grad_truth)
        log(f"{args.model}: its {dtype} gradients vs fp32, worst relative error {err:.2e} ({worst} on this rank)")
    del ref
    free_memory(device)
    report["peaks"] = measure_peaks(device, dtype)
    report["model_cost"] = cost.describe()
    log(
        f"measured: {report['peaks']['matmul_tflops']:.0f} TFLOP/s ({report['peaks']['matmul_n']}^3 "
        f"{report['peaks']['matmul_dtype']} matmul), {report['peaks']['copy_gb_s']:.0f} GB/s (device copy)"
    )
    ctx = dict(
        device=device,
        dtype=dtype,
        placement=placement,
        self_group=self_group,
        check_ids=check_ids,
        ref_logits=ref_logits,
        truth=truth,
        grad_ids=grad_ids,
        ref_grads=ref_grads,
        grad_truth=grad_truth,
        hf_ep_dir=hf_ep_dir,
        cost=cost,
        peaks=report["peaks"],
    )
    for variant in args.variants:
        with variant_settings(variant):
            report["variants"][variant] = run_variant(variant, args, cfg, ctx)
        if rank == 0 and args.out:
            write_json(args.out, report)
    failed = [f"{v} ({', '.join(failed_checks(r))})" for v, r in report["variants"].items() if not r["check"]["passed"]]
    return finish("e2e.py", table(report["variants"], args.phases), failed, args.tol, what="exact variant(s)")


def failed_checks(res: dict) -> list[str]:
    """Which of a failed variant's checks failed: its logits, its MoE backward, a recorded prefill's or step's
    replay against its eager run (a run's error names them: the logits can pass while a replay does not)."""
    why = [] if res["check"].get("logits_passed", True) else ["logits"]
    if not res.get("grad_check", {}).get("passed", True):
        why.append("MoE backward")
    if not res.get("graph", {}).get("passed", True):
        why.append("prefill replay")
    why += [
        f"{phase} replay" for phase, out in res["phases"].items() if not out.get("replay_check", {}).get("passed", True)
    ]
    return why or ["logits"]


if __name__ == "__main__":
    sys.exit(main())
