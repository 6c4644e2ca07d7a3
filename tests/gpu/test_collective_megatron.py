"""occult inside Megatron-Core (issue 54) on every GPU over NCCL: Megatron's own `MoELayer` made by
`occult.integrations.megatron.install` gives what the same layer gives with Megatron's `alltoall` dispatcher.

Megatron's layer from its local spec (`TopKRouter` gating in fp32, `SequentialMLP`), expert parallelism over
every rank, the same weights, each rank its own tokens (96 + 13 x rank: uneven). occult's `dedup` and
`standard` dispatchers, with Megatron's contiguous experts and with a random placement, over the count
exchange and the device transport (where `occult.moe.symm.unavailable_reason` allows it), in fp32, bf16 and
fp16: the output and the gradients of the input, the router weight and every expert's fc1 / fc2 equal the
`alltoall` layer's to relative L2 1e-5 / 2e-2 / 4e-3 (test_collective_train_graphs' TOL). Expert gradients
are compared in the model's order: the placed layer's weights come from the reference's by
`placed_local_experts`, its gradients go back by `model_order_local_experts`. Both layers run the same
router on the same inputs, so they choose the same experts and their experts see the same rows in the
same order; only where the experts' outputs are summed differs. `max_devices=1` (collaboration pruning,
a random placement) runs, stays finite and sends one row per token.

occult's grouped experts (`use_grouped_experts`: Megatron's `TEGroupedMLP` over occult's `GroupedLinear`, one
`torch._grouped_mm` per fc1 and fc2), under Megatron's `alltoall` dispatcher and under occult's dedup (contiguous
and random placement), equal the `SequentialMLP` + `alltoall` layer to the same tolerances, in every dtype: the
weights go in by TEGroupedMLP's state-dict keys (`to_grouped_expert_keys`, placed by `placed_local_experts`),
the gradients come back by them.

Megatron's parallel state (EP = world size, on the suite's group) is made for this module and destroyed
after it. On CPU gloo ranks (`OCCULT_GPU_SUITE_ON_CPU=1`) the fp32 cases run with Megatron's CUDA calls
stubbed (`occult.integrations.megatron.cpu.cpu_shims`, undone after the module); half precision and the
device transport are skipped there.
"""

from __future__ import annotations

import os

import pytest
import torch

# Megatron imports Triton: with its CPU interpreter on where there is no GPU, as the CPU suite's kernel
# tests (collected after this module, in the same process) need it (tests/kernels/_triton_interpreter.py).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip(
    "megatron.core",
    reason="megatron-core is not installed (scripts/fetch_peer_wheels.sh megatron; carry .whl: run.sh installs it)",
)

from test_collective_layer import DTYPES, _placement, _rel  # noqa: E402
from test_collective_train_graphs import TOL  # noqa: E402

from occult.integrations.megatron.placement import model_order_local_experts, placed_local_experts  # noqa: E402

HIDDEN, FFN, TOP_K, EXPERTS_PER_RANK = 256, 128, 4, 4
GPT_MOE_KEY = "decoder.layers.0.mlp."  # a GPTModel's MoE layer: the state-dict keys placement.py's helpers read
CPU_STUBBED = ("Stream", "current_stream", "stream", "current_device")  # what cpu_shims replaces in torch.cuda


@pytest.fixture(scope="module")
def ep_group(ranks):
    """Megatron's parallel state, expert parallelism over every rank; -> its EP group. Destroyed after the module."""
    from megatron.core import parallel_state

    from occult.integrations.megatron.cpu import cpu_shims, without_transformer_engine

    on_cpu = ranks.device.type == "cpu"
    cuda_calls = {name: getattr(torch.cuda, name) for name in CPU_STUBBED}
    cpu_shims() if on_cpu else without_transformer_engine()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            expert_model_parallel_size=ranks.world_size, create_gloo_process_groups=False
        )
    yield parallel_state.get_expert_model_parallel_group()
    parallel_state.destroy_model_parallel()
    if on_cpu:  # the later cases of this process get torch.cuda and torch.compile back
        for name, call in cuda_calls.items():
            setattr(torch.cuda, name, call)
        torch.compiler.set_stance("default")


def _dtype_here(ranks, dtype_name: str) -> torch.dtype:
    """The case's dtype; skipped on CPU gloo ranks but for fp32 (Megatron's half precision is a GPU path)."""
    if ranks.device.type != "cuda" and dtype_name != "fp32":
        pytest.skip(f"Megatron-Core in {dtype_name} runs on CUDA GPUs only (these ranks are on {ranks.device.type})")
    return DTYPES[dtype_name]


def _skip_without_transport(group, transport: str) -> None:
    """The device transport only where it runs on Megatron's EP group (NCCL GPUs of one host)."""
    from occult.moe.symm import unavailable_reason

    reason = unavailable_reason(group) if transport == "device" else None
    if reason:
        pytest.skip(f"device transport: {reason}")


def _config(world: int, dtype: torch.dtype):
    """A one-layer MoE config Megatron's local spec builds: SwiGLU experts, no bias, no aux loss, fp32 gating."""
    import torch.nn.functional as nnf
    from megatron.core.transformer.transformer_config import TransformerConfig

    sizes = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN)
    moe = dict(num_moe_experts=EXPERTS_PER_RANK * world, moe_router_topk=TOP_K, expert_model_parallel_size=world)
    moe.update(moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", moe_router_load_balancing_type="none")
    mlp = dict(gated_linear_unit=True, activation_func=nnf.silu, add_bias_linear=False, moe_aux_loss_coeff=0.0)
    unfused = dict(moe_grouped_gemm=False, moe_permute_fusion=False, bias_activation_fusion=False)
    unfused.update(gradient_accumulation_fusion=False, use_cpu_initialization=True)
    precision = dict(params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    return TransformerConfig(**sizes, **moe, **mlp, **unfused, **precision)


def _build(config, device: torch.device, grouped: bool = False, **occult_options):
    """Megatron's MoE layer (occult's, by `install`, when options are given; with occult's grouped experts when
    `grouped`), moved to `device` as Megatron's `get_model` moves a model."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from occult.integrations.megatron import install, use_grouped_experts

    specs = [get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)]
    if occult_options:
        assert install(specs, **occult_options) == 1
    if grouped:
        assert use_grouped_experts(specs) == 1
    spec = specs[0]
    if isinstance(spec, ModuleSpec):  # 0.16.1; 0.19.2's is a functools.partial
        return spec.module(config=config, submodules=spec.submodules, layer_number=1, **spec.params).to(device)
    return spec(config=config, layer_number=1).to(device)


def _expert_tensors(layer, grads: bool = False) -> dict[str, torch.Tensor]:
    """This rank's expert weights (or their gradients) under a GPTModel's keys."""
    found = {}
    for name, p in layer.named_parameters():
        if ".local_experts." in name:
            found[GPT_MOE_KEY + name] = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p.detach()
    return found


def _reference(ranks, config):
    """Megatron's alltoall layer with SequentialMLP experts, the same random weights on every rank (rank r holds
    experts r*L .. r*L+L-1)."""
    rank, device, experts = ranks.rank, ranks.device, config.num_moe_experts
    reference = _build(config, device)
    gen = torch.Generator(device=device).manual_seed(ranks.seed + 54)  # the same weights on every rank
    gate_EH = torch.randn(experts, HIDDEN, generator=gen, device=device) * 3 / HIDDEN**0.5
    fc1_E = torch.randn(experts, 2 * FFN, HIDDEN, generator=gen, device=device) / HIDDEN**0.5
    fc2_E = torch.randn(experts, HIDDEN, FFN, generator=gen, device=device) / FFN**0.5
    with torch.no_grad():
        reference.router.weight.copy_(gate_EH)
        for j, expert in enumerate(reference.experts.local_experts):
            expert.linear_fc1.weight.copy_(fc1_E[rank * EXPERTS_PER_RANK + j])
            expert.linear_fc2.weight.copy_(fc2_E[rank * EXPERTS_PER_RANK + j])
    return reference


def _layers(ranks, group, dtype, dispatcher: str, placement_kind: str, transport: str, max_devices=None):
    """(occult's layer, Megatron's alltoall layer, the placement): the same weights, in placed and model order."""
    world, device = ranks.world_size, ranks.device
    config = _config(world, dtype)
    placement = _placement(placement_kind, config.num_moe_experts, world, ranks.seed + 54)
    reference = _reference(ranks, config)
    placed = None if placement_kind == "contiguous" else placement
    layer = _build(
        config, device, dispatcher=dispatcher, placement=placed, max_devices=max_devices, transport=transport
    )
    params = dict(layer.named_parameters())
    with torch.no_grad():  # local expert j of rank r <- the placement's j-th expert on r (placed_local_experts)
        layer.router.weight.copy_(reference.router.weight)
        for key, value in placed_local_experts(_expert_tensors(reference), placement, group).items():
            params[key.removeprefix(GPT_MOE_KEY)].copy_(value)
    assert type(layer.token_dispatcher).__name__ == "OccultTokenDispatcher"
    assert type(reference.token_dispatcher).__name__ == "MoEAlltoAllTokenDispatcher"
    return layer, reference, placement


def _tokens(ranks, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's 96 + 13 x rank tokens (in `dtype`) and the output weights of its loss (fp32)."""
    tokens = 96 + 13 * ranks.rank
    gen = torch.Generator(device=ranks.device).manual_seed(ranks.seed * 54 + ranks.rank)
    x_TH = torch.randn(tokens, HIDDEN, generator=gen, device=ranks.device).to(dtype)
    return x_TH, torch.randn(tokens, HIDDEN, generator=gen, device=ranks.device)


def _step(layer, x_TH: torch.Tensor, g_TH: torch.Tensor):
    """Forward and backward of sum(out * g) -> (output, input grad, router weight grad, expert grads by key)."""
    x = x_TH.clone().requires_grad_(True)
    out, bias = layer(x[:, None])  # Megatron's [S, B, H]
    assert bias is None
    (out[:, 0].float() * g_TH).sum().backward()
    return out[:, 0].detach(), x.grad, layer.router.weight.grad, _expert_tensors(layer, grads=True)


@pytest.mark.parametrize("transport", ["counts", "device"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("placement", ["contiguous", "random"])
@pytest.mark.parametrize("dispatcher", ["standard", "dedup"])
def test_megatron_layer_matches_megatron_alltoall(ranks, ep_group, dispatcher, placement, dtype_name, transport):
    dtype = _dtype_here(ranks, dtype_name)
    _skip_without_transport(ep_group, transport)
    layer, reference, placed = _layers(ranks, ep_group, dtype, dispatcher, placement, transport)
    x_TH, g_TH = _tokens(ranks, dtype)
    y, dx, d_router, d_experts = _step(layer, x_TH, g_TH)
    y_ref, dx_ref, d_router_ref, d_experts_ref = _step(reference, x_TH, g_TH)
    used = layer.token_dispatcher.exchange.dispatcher.transport_name  # "device" or "counts"
    d_experts = model_order_local_experts(d_experts, placed, ep_group)  # rank r: experts r*L .. r*L+L-1
    errors = {"y": _rel(y, y_ref), "dx": _rel(dx, dx_ref), "d_router": _rel(d_router, d_router_ref)}
    for fc in ("linear_fc1", "linear_fc2"):
        keys = sorted(k for k in d_experts_ref if f".{fc}." in k)
        got, want = (torch.cat([grads[k].flatten() for k in keys]) for grads in (d_experts, d_experts_ref))
        errors[f"d_{fc}"] = _rel(got, want)
    worst = {name: ranks.all_max(error) for name, error in errors.items()}
    where = f"{dispatcher}/{placement}/{dtype_name}/{transport} seed {ranks.seed}"
    assert used == transport, (where, f"rows went over the {used} transport")
    assert max(worst.values()) <= TOL[dtype], (where, f"tolerance {TOL[dtype]:g}", worst)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_pruned_megatron_layer_runs_finite(ranks, ep_group, dtype_name):
    """`max_devices=1` with a random placement: finite output and gradients, one row per token (dedup)."""
    dtype = _dtype_here(ranks, dtype_name)
    layer, _, _ = _layers(ranks, ep_group, dtype, "dedup", "random", "auto", max_devices=1)
    x_TH, g_TH = _tokens(ranks, dtype)
    y, dx, d_router, d_experts = _step(layer, x_TH, g_TH)
    finite = all(bool(torch.isfinite(t).all()) for t in (y, dx, d_router, *d_experts.values()))
    stats = layer.token_dispatcher.last_comm_stats
    extra_rows = abs(stats.dispatch_rows - x_TH.shape[0])
    assert ranks.all_max(0.0 if finite else 1.0) == 0.0, f"non-finite output or gradient, seed {ranks.seed}"
    assert ranks.all_max(extra_rows) == 0.0, f"max_devices=1 sent {stats.dispatch_rows} rows for {x_TH.shape[0]} tokens"


def _grouped_expert_grads(layer) -> dict[str, torch.Tensor]:
    """This rank's grouped expert gradients under a GPTModel's TEGroupedMLP keys (`...linear_fc1.weight{j}`)."""
    found = {}
    for fc in ("linear_fc1", "linear_fc2"):
        weight = getattr(layer.experts, fc).weight
        grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        found.update({f"{GPT_MOE_KEY}experts.{fc}.weight{j}": grad[j] for j in range(grad.shape[0])})
    return found


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("variant", ["alltoall/contiguous", "dedup/contiguous", "dedup/random"])
def test_grouped_experts_match_sequential_mlp(ranks, ep_group, variant, dtype_name):
    from occult.integrations.megatron import to_grouped_expert_keys, to_sequential_expert_keys

    dtype = _dtype_here(ranks, dtype_name)
    dispatcher, placement_kind = variant.split("/")
    world, device = ranks.world_size, ranks.device
    config = _config(world, dtype)
    placement = _placement(placement_kind, config.num_moe_experts, world, ranks.seed + 55)
    reference = _reference(ranks, config)
    options = {} if dispatcher == "alltoall" else dict(placement=None if placement_kind == "contiguous" else placement)
    layer = _build(config, device, grouped=True, **options)
    assert type(layer.experts).__name__ == "TEGroupedMLP", type(layer.experts)
    weights = placed_local_experts(to_grouped_expert_keys(_expert_tensors(reference)), placement, ep_group)
    weights = {k.removeprefix(GPT_MOE_KEY): v for k, v in weights.items()}
    with torch.no_grad():
        layer.router.weight.copy_(reference.router.weight)
    missing, unexpected = layer.load_state_dict(weights, strict=False)
    assert not unexpected and not [k for k in missing if ".experts." in k], (missing, unexpected)
    x_TH, g_TH = _tokens(ranks, dtype)
    y, dx, d_router, _ = _step(layer, x_TH, g_TH)
    y_ref, dx_ref, d_router_ref, d_experts_ref = _step(reference, x_TH, g_TH)
    grads = model_order_local_experts(_grouped_expert_grads(layer), placement, ep_group)
    d_experts = to_sequential_expert_keys(grads)
    errors = {"y": _rel(y, y_ref), "dx": _rel(dx, dx_ref), "d_router": _rel(d_router, d_router_ref)}
    for fc in ("linear_fc1", "linear_fc2"):
        keys = sorted(k for k in d_experts_ref if f".{fc}." in k)
        assert sorted(k for k in d_experts if f".{fc}." in k) == keys
        got, want = (torch.cat([g[k].flatten() for k in keys]) for g in (d_experts, d_experts_ref))
        errors[f"d_{fc}"] = _rel(got, want)
    worst = {name: ranks.all_max(error) for name, error in errors.items()}
    assert max(worst.values()) <= TOL[dtype], (f"{variant}/{dtype_name} seed {ranks.seed}", TOL[dtype], worst)
