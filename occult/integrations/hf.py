"""Hugging Face transformers MoE models on `OccultMoE`: profile, convert, save back.

Supported (transformers >= 5.17, < 6; see `SUPPORTED_TRANSFORMERS`): OLMoE, Qwen2-MoE, Qwen3-MoE,
Mixtral and DeepSeek-V3, whose MoE blocks hold a gate returning
`(router_logits, top_k_weights, top_k_index)` and fused SwiGLU experts `experts.gate_up_proj`
[E, 2F, H] (gate rows, then up rows) and `experts.down_proj` [E, H, F] -- the layout
`OccultMoE` uses. GPT-OSS is not supported: its experts carry biases and a clamped, interleaved
SwiGLU that the occult expert kernels do not compute.

    trace = profile(model, batches)                          # routing trace of every MoE layer
    placement = place(trace, num_devices).placement          # occult.placement_solvers / `occult place`
    convert(model, placement=placement)                      # on every rank of the EP group
    out = model.generate(ids, synced_gpus=True)              # all ranks step together
    loss.backward(); sync_gradients(model); opt.step()       # replicated grads averaged
    save_pretrained(model, "out/")                           # standard layout, plain transformers

`convert` replaces each MoE block by an `OccultMoeBlock` with the same attribute names as the
model's block: `gate` (the model's own router module, replicated), `experts` (an `OccultMoE`
holding this rank's E/D experts in local-slot order of the placement), and the shared experts
(`shared_expert` + `shared_expert_gate` for Qwen2-MoE, `shared_experts` for DeepSeek-V3), which
run on every rank's own tokens with no communication. Non-expert parameter names are unchanged.

Every rank of the group must run the same number of forward passes (each MoE layer is a
collective): for generation pass `synced_gpus=True` so ranks whose sequences finished keep
stepping until all are done.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from occult.integrations.hf_routers import HFGateRouter, SigmoidGroupGateRouter, SoftmaxGateRouter
from occult.layer import OccultMoE
from occult.placement import Placement
from occult.trace import Trace, TraceRecorder, write_trace

SUPPORTED_TRANSFORMERS = ">=5.17,<6"
_MIN_VERSION, _MAX_VERSION = (5, 17), (6, 0)


@dataclass(frozen=True)
class Family:
    """How one transformers model type lays out its MoE blocks."""

    model_type: str
    block_class: str                      # class name of the model's MoE block
    router: type[HFGateRouter]            # scoring family (for device-limited routing)
    shared: tuple[str, ...] = ()          # local, replicated submodules kept from the block


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("olmoe", "OlmoeSparseMoeBlock", SoftmaxGateRouter),
        Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", SoftmaxGateRouter, ("shared_expert", "shared_expert_gate")),
        Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", SoftmaxGateRouter),
        Family("mixtral", "MixtralSparseMoeBlock", SoftmaxGateRouter),
        Family("deepseek_v3", "DeepseekV3MoE", SigmoidGroupGateRouter, ("shared_experts",)),
    )
}
_UNSUPPORTED = {
    "gpt_oss": "GPT-OSS experts have biases and a clamped SwiGLU (alpha=1.702, limit 7) on interleaved "
    "gate/up columns; occult's experts compute the plain SwiGLU of the fused [gate; up] layout",
}


class UnsupportedModelError(ValueError):
    """The model is not one whose MoE blocks occult can run expert-parallel."""


# ----------------------------------------------------------------------- checks
def check_transformers_version() -> str:
    """Return transformers' version; raise below 5.0, warn outside the tested range."""
    import transformers
    from packaging.version import Version

    v = Version(transformers.__version__)
    if v.major < 5:
        raise UnsupportedModelError(
            f"occult.integrations.hf needs transformers {SUPPORTED_TRANSFORMERS} (fused 3-D expert tensors and "
            f"routers returning (logits, weights, ids), new in 5.0); found {transformers.__version__}: "
            f"pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
        )
    if not _MIN_VERSION <= (v.major, v.minor) < _MAX_VERSION:
        warnings.warn(
            f"occult.integrations.hf is tested with transformers {SUPPORTED_TRANSFORMERS}, found "
            f"{transformers.__version__}; every MoE block is still checked structurally before use",
            stacklevel=3,
        )
    return transformers.__version__


def model_family(model: nn.Module) -> Family:
    """The `Family` of a transformers model (by `config.model_type`), or a clear error."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    why = _UNSUPPORTED.get(model_type, "not one of the supported model types")
    raise UnsupportedModelError(
        f"model type {model_type!r} is not supported ({why}); supported: {', '.join(sorted(FAMILIES))}"
    )


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, block) of every MoE block in forward order, converted or not.

    The position in this list is the block's MoE layer index (traces and placements count MoE
    layers only: DeepSeek-V3's first dense layers and Qwen's `mlp_only_layers` are skipped).
    """
    family = model_family(model)
    found = [
        (name, m) for name, m in model.named_modules()
        if type(m).__name__ == family.block_class or isinstance(m, OccultMoeBlock)
    ]
    if not found:
        raise UnsupportedModelError(f"no {family.block_class} blocks found in this {family.model_type} model")
    return found


def _check_block(name: str, block: nn.Module, family: Family) -> tuple[int, int, int, int]:
    """Structural check of a model's MoE block; returns (E, k, H, F)."""
    experts, gate = getattr(block, "experts", None), getattr(block, "gate", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3):
        raise UnsupportedModelError(
            f"{name}: expected fused expert tensors experts.gate_up_proj [E, 2F, H] and experts.down_proj "
            f"[E, H, F] (transformers {SUPPORTED_TRANSFORMERS}); found {type(experts).__name__}"
        )
    E, F2, H = gate_up.shape
    if F2 % 2 or tuple(down.shape) != (E, H, F2 // 2):
        raise UnsupportedModelError(f"{name}: expert shapes {list(gate_up.shape)} / {list(down.shape)} do not match")
    if any(n.endswith("bias") for n, _ in experts.named_parameters()):
        raise UnsupportedModelError(f"{name}: experts with biases are not supported")
    act = getattr(experts, "act_fn", None)
    if act is None or (not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLUActivation", "SiLU")):
        raise UnsupportedModelError(f"{name}: expert activation {type(act).__name__} is not SiLU (SwiGLU experts only)")
    if gate is None or not hasattr(gate, "top_k") or int(getattr(gate, "num_experts", E)) != E:
        raise UnsupportedModelError(f"{name}: the block's gate has no top_k or disagrees on the expert count")
    for sub in family.shared:
        if getattr(block, sub, None) is None:
            raise UnsupportedModelError(f"{name}: expected submodule {sub!r} in a {family.model_type} MoE block")
    return E, int(gate.top_k), H, F2 // 2


def _group_size(group: Any) -> tuple[int, int]:
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


# --------------------------------------------------------------- converted block
class OccultMoeBlock(nn.Module):
    """Drop-in for a transformers MoE block: the model's gate, `OccultMoE` experts, shared experts.

    forward(hidden_states [B, S, H]) -> [B, S, H], like every supported block in transformers
    5.x. Routed experts go through `experts` (an `OccultMoE`, a collective over its group);
    `shared_expert` (times `sigmoid(shared_expert_gate(x))`, Qwen2-MoE) and `shared_experts`
    (DeepSeek-V3) run locally. Mixtral's router jitter is applied in training as the model does.
    """

    def __init__(self, block: nn.Module, experts: OccultMoE, family: Family) -> None:
        super().__init__()
        self.gate = block.gate
        self.experts = experts
        for name in ("shared_expert", "shared_expert_gate", "shared_experts"):
            setattr(self, name, getattr(block, name, None) if name in family.shared else None)
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.hf_block_class = type(block)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise
            )
        x_TH = hidden_states.reshape(-1, shape[-1])
        y_TH = self.experts(x_TH)
        if self.shared_expert is not None:
            y_TH = y_TH + F.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)
        if self.shared_experts is not None:
            y_TH = y_TH + self.shared_experts(x_TH)
        return y_TH.reshape(shape)

    def to_hf(self, config: Any, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> nn.Module:
        """The model's own block class holding this block's gate, shared experts and the given full experts."""
        with torch.device("meta"):
            block = self.hf_block_class(config)
        block.gate = self.gate
        for name in ("shared_expert", "shared_expert_gate", "shared_experts"):
            if getattr(self, name) is not None:
                setattr(block, name, getattr(self, name))
        block.experts.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=self.experts.gate_up_proj.requires_grad)
        block.experts.down_proj = nn.Parameter(down_proj, requires_grad=self.experts.down_proj.requires_grad)
        left = [n for n, t in [*block.named_parameters(), *block.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"rebuilding {self.hf_block_class.__name__} left tensors uninitialised: {left}")
        return block


def _is_converted(model: nn.Module) -> bool:
    return any(isinstance(m, OccultMoeBlock) for m in model.modules())


# ---------------------------------------------------------------------- profile
def _batch_kwargs(batch: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch if batch.dim() == 2 else batch.unsqueeze(0)}, None
    if isinstance(batch, Mapping):
        kwargs = dict(batch)
        kwargs.pop("labels", None)
        return kwargs, kwargs.get("attention_mask")
    raise TypeError(f"a batch is a LongTensor of input ids or a dict of model inputs, got {type(batch).__name__}")


@torch.no_grad()
def profile(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    scores: str | None = None,
    max_tokens: int | None = None,
    group: Any = None,
    gather: bool = True,
    path: str | None = None,
    similarity_path: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Trace:
    """Record the routing trace of every MoE layer through the model's own routers.

    `batches` yields input-id tensors [B, S] or dicts of model inputs; tokens where a batch's
    `attention_mask` is 0 are left out. `scores`: None, "topk" (the gate weights, [T, k]) or
    "all" (the gate's per-expert probabilities, softmax or sigmoid, [T, E]; what similarity
    pruning needs). Stops after `max_tokens` tokens. On a converted model the recorded ids are
    the ones actually dispatched (after any device limit). Under torch.distributed with
    `gather=True` every rank of `group` (default: the default group) must call it: each records
    its own batches, and all ranks return the same trace, ranks' tokens concatenated in rank
    order (`gather=False`: this rank's tokens only; a converted model still needs every rank
    to run its forward passes). `path` writes it
    (rank 0 only). `similarity_path` also writes the per-layer expert similarity tables
    (cosine of router-logit columns, `occult.pruning.save_similarity`) that similarity pruning
    (`convert(..., prune_method="similarity")`) reads back with `occult.pruning.load_similarity`.
    Runs in eval mode.
    """
    check_transformers_version()
    if scores not in (None, "topk", "all"):
        raise ValueError(f"scores must be None, 'topk' or 'all', got {scores!r}")
    blocks = moe_blocks(model)
    family = model_family(model)
    num_experts = int(blocks[0][1].gate.num_experts)
    top_k = int(blocks[0][1].gate.top_k)
    rec = TraceRecorder(num_experts, top_k)
    sims = None
    if similarity_path is not None:
        from occult.pruning import SimilarityAccumulator

        sims = [SimilarityAccumulator(num_experts) for _ in blocks]
    state: dict[str, Any] = {"keep": None}
    last_logits: dict[int, torch.Tensor] = {}
    routers = [
        b.experts.router if isinstance(b, OccultMoeBlock) else family.router(b.gate) for _, b in blocks
    ]

    def add(layer: int, logits, weights, ids) -> None:
        keep = state["keep"]
        ids = ids.reshape(-1, top_k)
        sel = slice(None) if keep is None else keep
        s = None
        if scores == "topk":
            s = weights.reshape(-1, top_k)[sel].float()
        elif scores == "all":
            s = routers[layer].scores(logits.reshape(-1, num_experts))[sel]
        rec.add(layer, ids[sel], s)
        if sims is not None:
            sims[layer].add(logits.reshape(-1, num_experts)[sel])

    def gate_hook(layer: int, converted: bool):
        def hook(_mod, _args, out):
            if converted:
                last_logits[layer] = out[0]
            else:
                add(layer, out[0], out[1], out[2])
        return hook

    def router_hook(layer: int):
        def hook(_mod, _args, out):
            add(layer, last_logits.pop(layer, None), out[0], out[1])
        return hook

    handles = []
    for i, (_, block) in enumerate(blocks):
        converted = isinstance(block, OccultMoeBlock)
        handles.append(block.gate.register_forward_hook(gate_hook(i, converted)))
        if converted:
            handles.append(block.experts.router.register_forward_hook(router_hook(i)))
    was_training = model.training
    model.eval()
    seen = 0
    try:
        for batch in batches:
            kwargs, mask = _batch_kwargs(batch)
            state["keep"] = None if mask is None else mask.reshape(-1).bool().to(next(model.parameters()).device)
            model(**kwargs, use_cache=False)
            seen += int(mask.sum()) if mask is not None else int(kwargs["input_ids"].numel())
            if max_tokens is not None and seen >= max_tokens:
                break
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    names = [n for n, _ in blocks]
    meta = {
        "source": "occult.integrations.hf.profile",
        "model_type": family.model_type,
        "model": str(getattr(model.config, "_name_or_path", "") or ""),
        "moe_modules": json.dumps(names),
    }
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    rec.metadata.update(meta)
    trace = rec.to_trace()
    if max_tokens is not None:  # the last batch may overshoot
        trace = Trace(
            [t[:max_tokens] for t in trace.topk_ids], trace.num_experts, trace.top_k,
            [None if s is None else s[:max_tokens] for s in trace.scores], trace.metadata,
        )
    size, rank = _group_size(group) if gather else (1, 0)
    if size > 1:
        trace = _gather_trace(trace, group)
    if path is not None and rank == 0:
        write_trace(path, trace)
    if sims is not None:
        from occult.pruning import save_similarity

        gram = torch.stack([acc.gram_EE for acc in sims])
        if size > 1:  # float64 Gram matrices add up over ranks' tokens (on the model's device for NCCL)
            gram = gram.to(next(model.parameters()).device)
            dist.all_reduce(gram, group=group)
            gram = gram.cpu()
        for acc, g in zip(sims, gram):
            acc.gram_EE, acc.tokens = g, max(acc.tokens, 1)
        if rank == 0:
            save_similarity(similarity_path, [acc.similarity() for acc in sims], {"model_type": family.model_type})
    return trace


def _gather_trace(trace: Trace, group: Any) -> Trace:
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (trace.topk_ids, trace.scores), group=group)
    ids = [np.concatenate([p[0][i] for p in parts]) for i in range(trace.num_layers)]
    scores = [
        None if parts[0][1][i] is None else np.concatenate([p[1][i] for p in parts])
        for i in range(trace.num_layers)
    ]
    return Trace(ids, trace.num_experts, trace.top_k, scores, trace.metadata)


# ---------------------------------------------------------------------- convert
def convert(
    model: nn.Module,
    group: Any = None,
    placement: Placement | str | None = None,
    dispatcher: str = "dedup",
    max_devices: int | None = None,
    *,
    prune_method: str = "score",
    similarity: Sequence[torch.Tensor] | torch.Tensor | None = None,
    expert_backend: str = "auto",
) -> nn.Module:
    """Make `model` expert-parallel over `group` (default: the whole default group), in place.

    Every MoE block becomes an `OccultMoeBlock` whose `experts` hold only this rank's E/D
    experts, chosen and ordered by `placement` (a `Placement` with one layer per MoE layer, or
    its JSON path; default: contiguous). Routing is the model's own; `max_devices=N` limits
    each token to experts on N devices (collaboration pruning, approximate: fine-tune with it
    on), by `prune_method` "score" or "similarity" (then `similarity` holds one [E, E] matrix
    per MoE layer). Call on every rank, with the same full model loaded on each.
    """
    check_transformers_version()
    family = model_family(model)
    if _is_converted(model):
        raise ValueError("the model is already converted")
    blocks = moe_blocks(model)
    num_ranks, _ = _group_size(group)
    shapes = [_check_block(name, b, family) for name, b in blocks]
    E = shapes[0][0]
    if any(s[0] != E for s in shapes):
        raise UnsupportedModelError("MoE layers with different expert counts are not supported")
    if isinstance(placement, (str, bytes)) or hasattr(placement, "__fspath__"):
        placement = Placement.load(placement)
    if placement is None:
        placement = Placement.contiguous(E, num_ranks, len(blocks))
    placement.check_fits(E, num_ranks, len(blocks))
    per_device, top_k = E // num_ranks, shapes[0][1]
    if max_devices is not None and max_devices * per_device < top_k:
        raise ValueError(
            f"max_devices={max_devices} devices hold {max_devices * per_device} experts ({per_device} per device), "
            f"fewer than top_k={top_k}: use max_devices >= {-(-top_k // per_device)}"
        )
    if similarity is not None and len(similarity) != len(blocks):
        raise ValueError(f"similarity holds {len(similarity)} matrices for {len(blocks)} MoE layers")
    for i, ((name, block), (E, k, H, F_)) in enumerate(zip(blocks, shapes)):
        ref = block.experts.gate_up_proj
        router = family.router(
            block.gate, max_devices=max_devices, prune_method=prune_method,
            similarity_EE=None if similarity is None else torch.as_tensor(similarity[i], device=ref.device),
        )
        experts = OccultMoE(
            H, F_, E, k, norm_topk_prob=bool(getattr(block.gate, "norm_topk_prob", True)),
            placement=placement, layer_index=i, dispatcher=dispatcher, group=group, router=router,
            expert_backend=expert_backend, dtype=ref.dtype, device=ref.device,
        )
        with torch.no_grad():
            experts.gate_up_proj.copy_(block.experts.gate_up_proj[experts.local_expert_ids])
            experts.down_proj.copy_(block.experts.down_proj[experts.local_expert_ids])
        model.set_submodule(name, OccultMoeBlock(block, experts, family))
    model.occult_placement = placement
    return model


def _hf_blocks(model: nn.Module) -> list[tuple[str, OccultMoeBlock, nn.Module]]:
    """(name, converted block, rebuilt transformers block with all experts): a collective."""
    out = []
    for name, block in moe_blocks(model):
        if not isinstance(block, OccultMoeBlock):
            raise ValueError(f"{name} is not converted")
        dense = block.experts.to_dense()  # all-gathers every rank's experts, undoes the placement
        out.append((name, block, block.to_hf(model.config, dense.gate_up_proj.data, dense.down_proj.data)))
    return out


def unconvert(model: nn.Module) -> nn.Module:
    """Undo `convert` in place (a collective): the model's own blocks with all experts, id order."""
    for name, _, hf_block in _hf_blocks(model):
        model.set_submodule(name, hf_block)
    if hasattr(model, "occult_placement"):
        del model.occult_placement
    return model


@contextlib.contextmanager
def hf_layout(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily put the model's own blocks (all experts, id order) back; a collective.

    Inside, `model` is a plain transformers model (e.g. for `save_pretrained` or a state dict);
    on exit the converted blocks, the very same parameter objects, return.
    """
    swapped = _hf_blocks(model)
    try:
        for name, _, hf_block in swapped:
            model.set_submodule(name, hf_block)
        yield model
    finally:
        for name, block, _ in swapped:
            model.set_submodule(name, block)


def save_pretrained(model: nn.Module, save_directory: str, *, group: Any = None, **kwargs: Any) -> None:
    """Save a converted model in the standard transformers layout (experts un-permuted).

    A collective: every rank calls it; rank 0 of `group` writes `save_directory` with the
    model's own `save_pretrained(**kwargs)`, loadable by plain `from_pretrained`.
    """
    _, rank = _group_size(group)
    with hf_layout(model):
        if rank == 0:
            model.save_pretrained(save_directory, **kwargs)
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


# -------------------------------------------------------------------- training
def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters (each rank holds different experts)."""
    return [p for b in model.modules() if isinstance(b, OccultMoeBlock) for p in (b.experts.gate_up_proj, b.experts.down_proj)]


@torch.no_grad()
def sync_gradients(model: nn.Module, group: Any = None, average: bool = True) -> None:
    """Make every rank's gradients those of the loss summed (or averaged) over all ranks' tokens.

    Replicated parameters (embeddings, attention, norms, gates, shared experts, head) hold only
    this rank's contribution: they are all-reduced (summed). Expert gradients already hold
    every rank's tokens (the all-to-all carried them). With `average=True` both are divided by
    the group size: with each rank's loss a mean over its own tokens (equal counts per rank),
    the result is the gradient of the mean over all ranks' tokens, as in data parallelism.
    """
    size, _ = _group_size(group)
    if size == 1:
        return
    if group is None:
        group = dist.group.WORLD
    experts = {id(p) for p in expert_parameters(model)}
    replicated = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
    for p in replicated:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in replicated:
        by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for params in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        if average:
            flat /= size
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
    if average:
        for p in expert_parameters(model):
            if p.grad is not None:
                p.grad /= size


# ---------------------------------------------------------------- tiny models
def tiny_config(model_type: str, vocab_size: int = 96, **overrides: Any):
    """A tiny config of a supported family (hidden 32, 2 MoE layers), for tests and smoke runs.

    Qwen2-MoE gets a dense decoder layer between its two MoE layers (`mlp_only_layers=[1]`),
    DeepSeek-V3 a dense first layer and 16 experts in 4 groups (2 allowed per token), so the
    MoE-layer numbering and group-limited routing are exercised.
    """
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=32, num_attention_heads=4, max_position_embeddings=128,
        tie_word_embeddings=False, initializer_range=0.1, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    if model_type == "olmoe":
        cfg = dict(num_hidden_layers=2, num_key_value_heads=2, intermediate_size=16, num_experts=8,
                   num_experts_per_tok=3, norm_topk_prob=False)
        cls = transformers.OlmoeConfig
    elif model_type == "qwen2_moe":
        cfg = dict(num_hidden_layers=3, num_key_value_heads=2, intermediate_size=24, mlp_only_layers=[1],
                   moe_intermediate_size=16, shared_expert_intermediate_size=20, num_experts=8,
                   num_experts_per_tok=3, norm_topk_prob=False)
        cls = transformers.Qwen2MoeConfig
    elif model_type == "qwen3_moe":
        cfg = dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=8, intermediate_size=24,
                   moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)
        cls = transformers.Qwen3MoeConfig
    elif model_type == "mixtral":
        cfg = dict(num_hidden_layers=2, num_key_value_heads=2, intermediate_size=16, num_local_experts=8,
                   num_experts_per_tok=2)
        cls = transformers.MixtralConfig
    elif model_type == "deepseek_v3":
        cfg = dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=24, moe_intermediate_size=16,
                   n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                   first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                   qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5, norm_topk_prob=True)
        cls = transformers.DeepseekV3Config
    else:
        raise UnsupportedModelError(f"no tiny config for {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    return cls(**{**common, **cfg, **overrides})


def tiny_random_model(model_type: str, path: str | None = None, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny random causal LM of `model_type` (saved to `path` if given).

    Router weights are drawn with std 1 (DeepSeek-V3's correction bias with std 0.1) so that
    top-k choices are well separated, not near-ties as with the default 0.02-scale init.
    """
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    with torch.no_grad():
        for _, block in moe_blocks(model):
            nn.init.normal_(block.gate.weight, std=1.0)
            bias = getattr(block.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(0.1 * torch.randn_like(bias))
    if path is not None:
        model.save_pretrained(path)
    return model
