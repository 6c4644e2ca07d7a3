"""TorchTitan's own Qwen3-MoE model, expert- and data-parallel the way its trainer sets it up: the
whole-model peer of benchmarks/e2e.py (variants `torchtitan`, and `torchtitan+occult`: the same model
with occult's deduplicated token dispatcher installed in its config by
`occult.integrations.torchtitan.install`, contiguous experts; nothing else differs;
`torchtitan+occult+placement`: the same with e2e's solved placement, expert weights in placed order;
`torchtitan+occult+experts`: occult's dispatcher and its fused expert kernels, `OccultGroupedExperts`).

TorchTitan 0.3.0's `Qwen3Model` is built at the shape of the transformers Qwen3-MoE model e2e.py
builds (`_build_qwen3_moe_layers`: fused QKV, per-head q/k RMSNorm, `CosSinRoPE` at the model's
rope theta, softmax top-k router with renormalisation, `GroupedExperts` on `torch._grouped_mm`,
the `"standard"` `AllToAllTokenDispatcher`; FlexAttention, compiled as TorchTitan compiles it),
and the transformers model's weights are copied in (q, k, v rows interleaved per KV head into `wqkv`; each
expert's fused `gate_up_proj` split into `w1_EFD` / `w3_EFD`), so its logits are checked against
the same unconverted model as every occult variant. Then TorchTitan's own `parallelize_qwen3`
(SPMD backend `"partial_dtensor"`): EP over all ranks (contiguous blocks of E/N experts), FSDP2
over all ranks for everything else (`dp_shard=N`, `ep=N`), no activation checkpointing, no
torch.compile of the blocks (TorchTitan's default), unless e2e.py's variant ends in /compile (`compile_blocks`: each
block's forward compiled, FSDP's hooks outside it, as TorchTitan's --compile.enable compiles its blocks: its
`apply_compile` settings, `capture_scalar_outputs` and shapes dynamic where they change, so the all-to-all's
data-dependent sizes do not recompile a block every step).

Precision: the weights are the model's dtype (bf16 on GPUs) with FSDP's param and reduce dtype
the same, like occult's variants (bf16 weights, bf16 gradient all-reduce, AdamW on bf16).
TorchTitan's trainer keeps fp32 master weights and reduces in fp32, which costs it more per
step; this setting is the faster one for the peer. No load-balancing bias update is registered
(the bias stays 0, as occult's variants have no balancing loss either).

A step: prefill = forward in eval mode under no_grad, logits of the last position only (the
final norm's output is taken with `_skip_lm_head` and the head applied to the last token, as
transformers' `logits_to_keep=1`); train = forward, next-token cross-entropy in fp32 (mean over
tokens, as transformers' loss), backward, AdamW step (FSDP reduce-scatters the gradients); `/stepgraph` (occult's
sync-free dispatcher with its fused experts only): the forward+backward recorded by TorchTitan's own
`wrap_with_cuda_graph`, as its trainer records a step by default where its dispatcher allows (`TrainStep`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from peer_torchtitan import SPMD_BACKEND, cpu_shims, torch_compat  # noqa: E402  (benchmarks/peers)

MODEL_TYPES = ("qwen3_moe",)
# TorchTitan's dispatcher / occult's / with a placement / with occult's fused experts too
VARIANTS = ("torchtitan", "torchtitan+occult", "torchtitan+occult+placement", "torchtitan+occult+experts")


def unavailable(model_type: str) -> str | None:
    """Why the TorchTitan peer cannot run here (not installed, another model family), or None."""
    if model_type not in MODEL_TYPES:
        return (
            f"TorchTitan's MoE models include Qwen3-MoE, the family e2e.py maps onto it: use --model qwen3 "
            f"(or tiny-qwen3), not a {model_type} model"
        )
    try:
        torch_compat()  # stand-ins for what TorchTitan 0.3.0 imports and this torch lacks (peer_torchtitan)
        import spmd_types  # noqa: F401
        import torchtitan.models.qwen3  # noqa: F401
    except Exception as e:  # an ImportError, or one of its imports failing on this torch
        return (
            f"torchtitan is not importable ({type(e).__name__}: {e}); install it as "
            "benchmarks/requirements-peers.txt says (pip install --no-deps torchtitan==0.3.0 and its listed wheels)"
        )
    return None


def _attention_compat(device: torch.device) -> list[str]:
    """FlexAttention as TorchTitan 0.3.0 calls it, on this torch and device; returns what was changed.

    - torch 2.11's `create_block_mask` has no `separate_full_blocks` (newer torch: default True,
      what 2.11 always does): TorchTitan's mask builder gets a version that drops it when True.
    - CPU smoke runs only: FlexAttention has no CPU backward and compiling it needs inductor's C++
      toolchain, so its kernel becomes causal SDPA and the masks are built eagerly. Exact here:
      every row is one document from position 0, so TorchTitan's document-causal mask is causal.
    """
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    changed, build = [], create_block_mask
    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:

        def build(*args: Any, separate_full_blocks: bool = True, **kwargs: Any) -> Any:
            if not separate_full_blocks:
                raise NotImplementedError("this torch's create_block_mask always separates full blocks")
            return create_block_mask(*args, **kwargs)

        changed.append("create_block_mask without separate_full_blocks")
    if device.type == "cpu":

        def causal_sdpa(
            q,
            k,
            v,
            *,
            score_mod=None,
            block_mask=None,
            scale=None,
            enable_gqa=False,
            return_aux=None,
            kernel_options=None,
        ):
            if score_mod is not None or (return_aux is not None and return_aux.lse):
                raise NotImplementedError("the CPU attention stand-in computes plain causal attention only")
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
            )
            return out, None

        attention.FlexAttention._compiled_flex_attn = causal_sdpa
        attention._compiled_create_block_mask = build
        changed.append("CPU: causal SDPA for FlexAttention, eager block masks")
    elif build is not create_block_mask:
        attention._compiled_create_block_mask = torch.compile(build)
    return changed


def _titan_config(cfg: Any, max_seq: int) -> Any:
    """TorchTitan's Qwen3Model.Config at the transformers config's shape."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    if not getattr(cfg, "norm_topk_prob", True) or any(getattr(cfg, "mlp_only_layers", []) or []):
        raise ValueError("the TorchTitan peer builds Qwen3-MoE with renormalised top-k and every layer MoE")
    if abs(cfg.rms_norm_eps - 1e-6) > 1e-12:
        raise ValueError(f"TorchTitan's Qwen3 RMSNorm eps is 1e-6; this config has {cfg.rms_norm_eps}")
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    V, H = cfg.vocab_size, cfg.hidden_size
    tcfg = Qwen3Model.Config(
        vocab_size=V,
        dim=H,
        norm=_qwen3_norm(H),
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=H, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=H, out_features=V, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=cfg.num_hidden_layers,
            dim=H,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            moe_hidden_dim=cfg.moe_intermediate_size,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq, theta=theta),
            moe_comm_backend="standard",
        ),
    )
    set_qwen3_sharding_config(tcfg, enable_sp=False, enable_ep=True)  # what update_from_config does for EP > 1
    return tcfg


@torch.no_grad()
def copy_weights(hf_model: nn.Module, titan: nn.Module) -> int:
    """Copy a transformers Qwen3-MoE model's weights into TorchTitan's Qwen3Model; returns tensors copied."""
    src = hf_model.model
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = [
        (titan.tok_embeddings.weight, src.embed_tokens.weight),
        (titan.norm.weight, src.norm.weight),
        (titan.lm_head.weight, hf_model.lm_head.weight),
    ]
    for i, layer in enumerate(src.layers):
        t = titan.layers[str(i)]
        att, moe = layer.self_attn, layer.mlp
        F = moe.experts.gate_up_proj.shape[1] // 2
        pairs += [
            (
                t.attention.qkv_linear.wqkv.weight,
                _fused_qkv(att.q_proj.weight, att.k_proj.weight, att.v_proj.weight, t.attention.qkv_linear.head_dim),
            ),
            (t.attention.wo.weight, att.o_proj.weight),
            (t.attention.q_norm.weight, att.q_norm.weight),
            (t.attention.k_norm.weight, att.k_norm.weight),
            (t.attention_norm.weight, layer.input_layernorm.weight),
            (t.ffn_norm.weight, layer.post_attention_layernorm.weight),
            (t.moe.router.gate.weight, moe.gate.weight),
            (t.moe.routed_experts.inner_experts.w1_EFD, moe.experts.gate_up_proj[:, :F]),
            (t.moe.routed_experts.inner_experts.w3_EFD, moe.experts.gate_up_proj[:, F:]),
            (t.moe.routed_experts.inner_experts.w2_EDF, moe.experts.down_proj),
        ]
    for dst, s in pairs:
        if dst.shape != s.shape:
            raise ValueError(f"TorchTitan peer: weight shape {tuple(dst.shape)} vs transformers {tuple(s.shape)}")
        dst.copy_(s)
    return len(pairs)


def _fused_qkv(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """TorchTitan's fused QKV rows: per KV head, its group's query heads, then its key, then its value."""
    H = wq.shape[1]
    n_kv = wk.shape[0] // head_dim
    per_kv = [w.reshape(n_kv, -1, head_dim, H) for w in (wq, wk, wv)]
    return torch.cat(per_kv, dim=1).reshape(-1, H)


class TitanLM:
    """TorchTitan's Qwen3-MoE, weights from a transformers model, parallelised by TorchTitan (EP + FSDP2)."""

    def __init__(
        self,
        hf_model: nn.Module,
        world: int,
        device: torch.device,
        dtype: torch.dtype,
        max_seq: int,
        occult: bool = False,
        placement: Any = None,
        transport: str = "auto",
        fused_experts: bool = False,
        sync_free: bool = False,
        compile_blocks: bool = False,
    ) -> None:
        import torchtitan
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as tt_dist
        from torchtitan.models.qwen3 import parallelize_qwen3

        self.torch_stand_ins = torch_compat()
        if device.type == "cpu":
            cpu_shims()
        self.torch_stand_ins += _attention_compat(device)
        tt_dist.set_spmd_backend(SPMD_BACKEND)
        tcfg = _titan_config(hf_model.config, max_seq)
        if occult:  # occult's dedup dispatcher (and router, plain without max_devices) in every MoE block
            from occult.integrations.torchtitan import install

            install(
                tcfg,
                dispatcher="dedup",
                placement=placement,
                transport=transport,
                fused_experts=fused_experts,
                sync_free=sync_free,
            )
        with torch.device(device):
            model = tcfg.build()
        model.init_states(buffer_device=device)  # rope cache and MoE buffers; the weights come next
        model = model.to(dtype)
        self.copied = copy_weights(hf_model, model)
        if placement is not None:  # TorchTitan's EP cuts the experts into contiguous blocks: placed order
            from occult.integrations.torchtitan import to_placed_order

            model.load_state_dict(to_placed_order(model.state_dict(), placement))
        dims = ParallelDims(
            dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world, world_size=world, spmd_backend=SPMD_BACKEND
        )
        dims.build_mesh()
        name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
        training = TrainingConfig(mixed_precision_param=name)
        training.mixed_precision_reduce = name  # type: ignore[assignment]  (see the module docstring)
        self.parallelize = "parallelize_qwen3 (EP + FSDP2)"
        if _per_param_fsdp_meshes():
            self.model = parallelize_qwen3(
                model,
                parallel_dims=dims,
                training=training,
                parallelism=ParallelismConfig(spmd_backend=SPMD_BACKEND),
                compile_config=CompileConfig(enable=False),
                ac_config=None,
                dump_folder="/tmp",
            )
        else:  # torch 2.11 (the GPU image): FSDP2 has no per-parameter meshes, which TorchTitan's EP + FSDP uses
            model.parallelize(dims)  # EP, as parallelize_qwen3 does first
            _fsdp_experts_unsharded(model, dims.get_mesh(["fsdp"]), dtype)
            self.model = model
            self.parallelize = (
                "EP by TorchTitan's model.parallelize, FSDP2 per block with the experts left to EP "
                "(this torch has no per-parameter FSDP meshes for parallelize_qwen3)"
            )
        self.world = world
        self.compiled_blocks = compile_blocks
        self.compile_mode = None
        if compile_blocks:  # as TorchTitan's --compile.enable: each block compiled (its forward: FSDP's hooks outside)
            self.compile_mode = compile_blocks_as_titan(list(self.model.layers.values()), _per_param_fsdp_meshes())
        if device.type == "cpu":  # gloo has no PREMUL_SUM, the op of TorchTitan's gradient divide factor
            from torch.distributed.fsdp import FSDPModule

            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        self.version = getattr(torchtitan, "__version__", "?")
        self.device = device
        self._step_consts: dict[tuple[int, ...], tuple[torch.Tensor, dict[str, Any]]] = {}  # step_inputs', per shape

    def _masks(self, ids_BS: torch.Tensor) -> tuple[torch.Tensor, Any]:
        B, S = ids_BS.shape
        pos_BS = torch.arange(S, device=ids_BS.device).expand(B, S).contiguous()
        return pos_BS, self.model.get_attention_masks(positions=pos_BS)

    def logits(self, ids_BS: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """[B, S] ids -> logits [B, S, V] (`last_only`: [B, 1, V], the head on the last position)."""
        pos_BS, masks = self._masks(ids_BS)
        if not last_only:
            return _local(self.model(ids_BS, positions=pos_BS, attention_masks=masks))
        self.model._skip_lm_head = True
        try:
            h_BSH = self.model(ids_BS, positions=pos_BS, attention_masks=masks)
        finally:
            self.model._skip_lm_head = False
        return _local(self.model.lm_head(h_BSH[:, -1:]))

    def step_inputs(self, ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        """`forward_backward`'s inputs for ids [B, S], made outside any recording: inputs, labels (the same ids:
        next-token), the count of predicted tokens, and the positions and masks (TorchTitan's trainer makes its masks
        each step; here once a shape, for every TorchTitan variant alike)."""
        shape = tuple(ids_BS.shape)
        if shape not in self._step_consts:  # made once a shape: a host-to-GPU copy a step would wait for the GPU, and
            # causal masks depend on the shape only (a recording needs one BlockMask: torch 2.11 compares its mask_mod
            # by identity)
            pos_BS, masks = self._masks(ids_BS)
            valid = torch.tensor(ids_BS[:, 1:].numel(), device=ids_BS.device)
            self._step_consts[shape] = (valid, {"positions": pos_BS, "attention_masks": masks})
        valid, extra = self._step_consts[shape]
        return ids_BS, ids_BS, valid, extra

    def forward_backward(
        self, ids_BS: torch.Tensor, labels_BS: torch.Tensor, valid_tokens: torch.Tensor, extra: dict[str, Any]
    ) -> torch.Tensor:
        """TorchTitan's `ForwardBackwardFn`: forward, next-token cross-entropy in fp32 (mean over tokens, as
        transformers' loss; `valid_tokens` is TorchTitan's input, the mean needs none), backward; the loss."""
        logits_BSV = _local(self.model(ids_BS, **extra))
        loss = nn.functional.cross_entropy(logits_BSV[:, :-1].flatten(0, 1).float(), labels_BS[:, 1:].flatten())
        (loss / self.world).backward()  # FSDP sums gradients (division off, as TorchTitan): mean over the global batch
        return loss.detach()

    def parameters(self) -> Any:
        return self.model.parameters()

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def optimizer(self, kind: str, lr: float) -> torch.optim.Optimizer:
        """AdamW (fused on CUDA, one group per device mesh: DTensors of two meshes) or SGD."""
        if kind != "adamw":
            return torch.optim.SGD(self.model.parameters(), lr=lr)
        groups: dict[Any, list] = {}
        for p in self.model.parameters():
            groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
        return torch.optim.AdamW([{"params": g} for g in groups.values()], lr=lr, fused=self.device.type == "cuda")

    def comm_stats(self) -> dict[str, float]:
        """occult's dispatcher: rows and bytes sent in the last step, summed over MoE layers, mean over
        ranks (as e2e.comm_stats); TorchTitan's own dispatcher exposes none: {}."""
        per_layer = [
            getattr(b.moe.routed_experts.token_dispatcher, "last_comm_stats", None) for b in self.model.layers.values()
        ]
        if not per_layer or any(s is None for s in per_layer):
            return {}
        keys = sorted(k for k, v in vars(per_layer[0]).items() if isinstance(v, int))
        sums_K = torch.tensor(
            [sum(int(getattr(s, k)) for s in per_layer) for k in keys], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(sums_K)
        return {k: float(v) / self.world for k, v in zip(keys, sums_K.tolist())}

    def describe(self) -> dict[str, Any]:
        ex = self.model.layers["0"].moe.routed_experts
        w = ex.inner_experts.w1_EFD
        return {
            "torchtitan": self.version,
            "spmd_backend": SPMD_BACKEND,
            "tensors_copied": self.copied,
            "dispatcher": type(ex.token_dispatcher).__name__,
            "experts": type(ex.inner_experts).__name__,
            "parallelize": self.parallelize,
            "compiled_blocks": self.compiled_blocks,
            "compile_mode": self.compile_mode,
            "local_experts": int((w.to_local() if hasattr(w, "to_local") else w).shape[0]),
            "attention": "FlexAttention (compiled by TorchTitan)"
            if self.device.type == "cuda"
            else "causal SDPA (CPU stand-in for FlexAttention)",
            "torch_stand_ins": self.torch_stand_ins,
        }


def compile_blocks_as_titan(blocks: list[nn.Module], traced_splits: bool, backend: Any = "inductor") -> str:
    """Compile each block's forward as TorchTitan's `apply_compile` does where this torch allows; say how.

    `traced_splits`: its settings, the dispatch's split sizes traced as unbacked symbols
    (`capture_scalar_outputs`) and shapes dynamic where they change. Otherwise (torch 2.11, the GPU image: there
    the traced block fails a runtime assert on the splits' sum, `Eq(u0 + u1, 4096)`) the graph breaks at the
    splits' read-back and a size turns dynamic once it changes (`dynamic=None`; `dynamic=True` made FlexAttention's
    lowering fail on a symbolic head layout there). Static shapes are neither: every step's routing gives new
    sizes, a recompile each step, and the benchmark never finished on GPUs."""
    config = torch._dynamo.config  # one code object for every block: room for each block's shapes and modes
    config.recompile_limit = max(config.recompile_limit, 32 * len(blocks) + 8)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * config.recompile_limit)
    if traced_splits:
        config.capture_scalar_outputs = True
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend, dynamic=None)
    if traced_splits:
        return "splits traced (apply_compile's settings)"
    return "graph break at the splits, sizes dynamic once changed"


def _per_param_fsdp_meshes() -> bool:
    """Whether this torch's FSDP2 takes a mesh per parameter (`ShardPlacementResult`; newer than 2.11)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    return hasattr(_fsdp_common, "ShardPlacementResult")


def _fsdp_experts_unsharded(model: nn.Module, mesh: Any, dtype: torch.dtype) -> None:
    """What TorchTitan's `apply_fsdp_to_decoder` does when the experts' FSDP mesh has one rank
    (EP degree = FSDP degree, the setting here), on a torch without per-parameter meshes: the
    same units (embeddings; norm + head, not resharded after forward; each block; the root), the
    expert weights left out of FSDP (EP already gives each rank its own), the same explicit
    prefetching, and no automatic gradient division (TorchTitan scales the loss instead)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    cfg = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, cast_forward_inputs=False),
    }
    fully_shard(model.tok_embeddings, **cfg, reshard_after_forward=True)
    fully_shard([model.norm, model.lm_head], **cfg, reshard_after_forward=False)
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(
            block,
            **cfg,
            reshard_after_forward=True,
            ignored_params=set(block.moe.routed_experts.inner_experts.parameters()),
        )
    fully_shard(model, **cfg)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    model.tok_embeddings.set_modules_to_forward_prefetch([blocks[0]])
    for block, nxt in zip(blocks, blocks[1:] + [None]):
        block.set_modules_to_forward_prefetch([nxt] if nxt is not None else [model.norm, model.lm_head])
    back = blocks[::-1]
    model.lm_head.set_modules_to_backward_prefetch([back[0]])
    for block, prev in zip(back, back[1:] + [None]):
        block.set_modules_to_backward_prefetch([prev] if prev is not None else [model.tok_embeddings])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def make_step(
    peer: TitanLM, phase: str, optimizer: torch.optim.Optimizer | None, recorded: bool = False
) -> Callable[[torch.Tensor], None]:
    """One prefill or train step on ids [B, S] (module docstring); `recorded`: the train step's forward+backward
    recorded as one CUDA graph (`TrainStep`)."""
    if phase == "prefill":
        peer.eval()

        def prefill(ids_BS: torch.Tensor) -> None:
            with torch.no_grad():
                peer.logits(ids_BS, last_only=True)

        return prefill
    peer.train()
    return TrainStep(peer, optimizer, recorded)


class TrainStep:
    """A train step as TorchTitan's trainer runs it: `forward_backward` (loss and gradients), then the optimizer,
    eager. `recorded`: the forward+backward wrapped by TorchTitan's own `wrap_with_cuda_graph`, as its trainer
    wraps it by default (one warm-up call, then recorded once and replayed; the gradients keep their storage,
    zeroed in place, and the attention masks are copied in as graph inputs). Only a dispatcher that never reads
    back to the host can be recorded (e2e.py allows it for occult's sync-free dispatcher with its fused experts)."""

    def __init__(self, peer: TitanLM, optimizer: torch.optim.Optimizer, recorded: bool) -> None:
        self.peer, self.optimizer, self.recorded = peer, optimizer, recorded
        self.forward_backward = peer.forward_backward
        self.calls = 0
        if recorded:
            from torchtitan.distributed.cudagraph import wrap_with_cuda_graph

            self.forward_backward = wrap_with_cuda_graph(peer.forward_backward)

    def release(self) -> None:
        """Drop the recording and its memory pool (TorchTitan keeps every recording until its teardown, so a next
        variant would run beside this one's activations)."""
        if self.recorded:
            release_recordings()
            self.forward_backward = self.peer.forward_backward

    def __call__(self, ids_BS: torch.Tensor) -> None:
        zero_grads(self.optimizer, set_to_none=not self.recorded)
        self.forward_backward(*self.peer.step_inputs(ids_BS))
        self.optimizer.step()
        self.calls += 1
        if self.recorded and self.calls == 1 and self.peer.device.type == "cuda":
            # the warm-up ran eagerly: its cached activations go before the recording takes its own pool (both
            # held would need ~2x a step's activations: 99 GiB reserved at the Qwen3 shape, past an 80 GB card)
            torch.cuda.empty_cache()

    def check_recording(self, ids_BS: torch.Tensor, tol: float) -> dict:
        """After the recording (two calls): the replayed forward+backward's loss and gradients on `ids_BS` against
        the eager one's, no update ({"max_rel_err", "worst_param" and "loss_rel_err" (this rank's), "passed"}; the worst
        over ranks).
        A replay that reads or writes the wrong memory trains on wrong gradients while its timing looks fine."""
        from _replay_check import relative_error

        inputs = self.peer.step_inputs(ids_BS)
        runs = []
        for forward_backward in (self.forward_backward, self.peer.forward_backward):
            zero_grads(self.optimizer, set_to_none=False)
            loss = forward_backward(*inputs).detach().float().clone()
            grads = {
                n: _local(p.grad).detach().clone() for n, p in self.peer.model.named_parameters() if p.grad is not None
            }
            runs.append((loss, grads))
        zero_grads(self.optimizer, set_to_none=False)
        (loss, replayed), (want_loss, eager) = runs
        errors = {name: relative_error(replayed.get(name), want) for name, want in eager.items()}
        errors["loss"] = relative_error(loss, want_loss)
        worst_param = max(errors, key=errors.get)
        worst = torch.tensor([errors[worst_param]], dtype=torch.float64, device=self.peer.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        loss_err = float(errors["loss"])  # (this rank's: the forward's own part of a difference)
        return {
            "max_rel_err": float(worst),
            "worst_param": worst_param,
            "loss_rel_err": loss_err,
            "passed": float(worst) <= tol,
        }


def zero_grads(optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
    """`optimizer.zero_grad`, but in place one parameter group at a time (`set_to_none=False`): a recording keeps
    the gradients' storage. torch's own zeroes every group's gradients of a device and dtype in one foreach call,
    which refuses DTensors beside plain tensors (one rank: the experts plain, the rest FSDP2's DTensors)."""
    if set_to_none:
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:  # (one group per device mesh: TitanLM.optimizer)
        grads = [p.grad for p in group["params"] if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)


def release_recordings() -> None:
    """Drop every TorchTitan recording and its memory pool (`wrap_with_cuda_graph` keeps them until its teardown)."""
    from torchtitan.distributed.cudagraph import cudagraph_teardown

    cudagraph_teardown()
