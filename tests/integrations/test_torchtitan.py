"""occult inside TorchTitan 0.3.0 (`occult.integrations.torchtitan`).

On 2 and 4 gloo ranks: TorchTitan's own Qwen3-MoE block (`MoE`, built as its Qwen3-MoE model
builds it) with `OccultTokenDispatcher` equals the same block with TorchTitan's
`AllToAllTokenDispatcher`: outputs and every gradient (input, router, the three expert weights)
in fp32, for a contiguous and a random placement, a rank with no tokens and top-k = all experts;
rows sent per layer equal sum_t C_T (E[C_T] x tokens; standard: k x tokens); pruning
(`max_devices`) equals occult's own `TopKRouter(max_devices=...)`; the block also runs under TorchTitan's
default `spmd_types` backend inside its trainer's SPMD mesh context. A TorchTitan training step of
a tiny Qwen3-MoE model (EP + FSDP2 by `parallelize_qwen3`, the dispatcher switched on through
TorchTitan's override mechanism, TorchTitan's loss and optimizer) matches the default
dispatcher's losses.

TorchTitan's `GroupedExperts` computes in bfloat16 even for fp32 models; the occult dispatcher
hands it the same rows in the same order, so only the sums' order differs (fp32 rounding).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("torchtitan", reason="TorchTitan 0.3.0 is installed by .ci/run (docs/testing.md)")

from occult.distributed import run_ranks  # noqa: E402
from occult.placement import Placement  # noqa: E402

H, F, E = 16, 8, 8  # hidden, expert ffn, experts
RTOL, ATOL = 1e-4, 1e-5


def _cpu_torchtitan() -> None:
    """TorchTitan on CPU gloo ranks: meshes on the CPU, the DTensor-only-for-model-parallel backend."""
    from torchtitan.distributed import parallel_dims
    from torchtitan.distributed import utils as tt_dist

    parallel_dims.device_type = "cpu"
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    tt_dist.set_spmd_backend("partial_dtensor")
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # torch < 2.12 (the GPU image's 2.11)
        torch.compiler._is_non_strict_tracing = lambda: False


def _dims(world: int):
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(
        dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world, world_size=world, spmd_backend="partial_dtensor"
    )
    dims.build_mesh()
    return dims


def _moe_config(top_k: int):
    """The MoE block of TorchTitan's Qwen3-MoE builder (softmax router, route_norm, GroupedExperts)."""
    import spmd_types as spmd
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers

    layer = _build_qwen3_moe_layers(
        n_layers=1,
        dim=H,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        moe_hidden_dim=F,
        num_experts=E,
        top_k=top_k,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=8, max_seq_len=64, theta=1e4),
    )[0]
    moe = layer.moe
    moe.load_balance_coeff = None
    set_moe_sharding_config(
        moe,
        enable_ep=True,
        enable_sp=False,
        expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)},
    )
    return moe


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _build_block(
    world,
    top_k,
    weights,
    placement=None,
    dispatcher=None,
    max_devices=None,
    occult_router=True,
    dims=None,
    fused=False,
    sync_free=False,
):
    """TorchTitan's MoE block with full weights (model order), EP over all ranks; occult's when `dispatcher`
    (`fused`: with occult's fused experts; `sync_free`: fixed-capacity exchanges); `world` None: no EP, TorchTitan's
    local block."""
    from torchtitan.config.override import derive

    from occult.integrations.torchtitan import OccultGroupedExperts, OccultRouter, OccultTokenDispatcher

    cfg = _moe_config(top_k)
    if dispatcher is not None:
        td = cfg.routed_experts.token_dispatcher
        cfg.routed_experts.token_dispatcher = OccultTokenDispatcher.Config(
            num_experts=E,
            top_k=top_k,
            dispatcher=dispatcher,
            placement=placement,
            max_devices=max_devices,
            fused_experts=fused,
            sync_free=sync_free,
        )
        if fused:
            cfg.routed_experts.inner_experts = derive(cfg.routed_experts.inner_experts, OccultGroupedExperts.Config)
        if occult_router:
            cfg.router = derive(cfg.router, OccultRouter.Config, max_devices=max_devices, placement=placement)
        assert td.num_experts == E
    moe = cfg.build()
    gate, w1, w2, w3 = weights
    if placement is not None:  # experts in placed order; the router's columns stay in model order
        w1, w2, w3 = (placement.apply(w) for w in (w1, w2, w3))
    with torch.no_grad():
        moe.router.gate.weight.copy_(gate)
        ex = moe.routed_experts.inner_experts
        ex.w1_EFD.copy_(w1), ex.w2_EDF.copy_(w2), ex.w3_EFD.copy_(w3)
    if world is not None:
        moe.parallelize(dims if dims is not None else _dims(world))
    return moe


def _fp32_experts(moe):
    """TorchTitan's own grouped experts computed in fp32 (its `GroupedExperts` casts to bf16): the reference of
    occult's fused experts, which compute in their weights' dtype."""
    import torch.nn.functional as F_

    ex = moe.routed_experts.inner_experts

    def forward(x_RD, counts_E):
        w1, w2, w3 = (_local(w) for w in (ex.w1_EFD, ex.w2_EDF, ex.w3_EFD))
        parts = torch.split(x_RD, counts_E.tolist())
        outs = [(F_.silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T for e, x in enumerate(parts)]
        return torch.cat(outs)

    ex.forward = forward
    return moe


def _run_block(moe, x_TH, g_TH):
    """Forward + backward of (out * g).sum(); returns out, x grad, router grad, local expert grads, ids."""
    seen = {}

    def keep_ids(module, args, out):
        seen["ids"] = _local(out[1]).detach()

    hook = moe.router.register_forward_hook(keep_ids)
    x = x_TH.clone().requires_grad_(True)
    out = _local(moe(x[None]))[0]
    (out * g_TH).sum().backward()
    hook.remove()
    ex = moe.routed_experts.inner_experts
    grads = [_local(p.grad) for p in (ex.w1_EFD, ex.w2_EDF, ex.w3_EFD)]
    return out.detach(), x.grad, _local(moe.router.gate.weight.grad), grads, seen["ids"].reshape(-1, moe.router.top_k)


def _gather(t):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _close(a, b, what, errors, rtol=RTOL, atol=ATOL):
    if a.shape != b.shape or not torch.allclose(a, b, rtol=rtol, atol=atol):
        diff = (a - b).abs().max().item() if a.shape == b.shape else f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
        errors.append(f"{what}: max abs diff {diff}")


def _weights(gen):
    """Router gate [E, H] and the three expert weights w1 [E, F, H], w2 [E, H, F], w3 [E, F, H], in model order."""
    return (
        torch.randn(E, H, generator=gen),
        torch.randn(E, F, H, generator=gen) * 0.3,
        torch.randn(E, H, F, generator=gen) * 0.3,
        torch.randn(E, F, H, generator=gen) * 0.3,
    )


def _block_case(rank, world, seed, top_k, placement, tokens, dispatcher="dedup", fused=False, sync_free=False):
    """One comparison; returns (errors, rows sent by this rank, sum_t C_T of this rank's tokens, T). `fused`:
    occult's fused experts (`OccultGroupedExperts`) against TorchTitan's all-to-all with its experts in fp32."""
    import torch.distributed as dist

    from occult.integrations.torchtitan import OccultGroupedExperts
    from occult.moe.pruning import devices_per_token

    gen = torch.Generator().manual_seed(seed)
    weights = _weights(gen)
    per_rank = [torch.randn(tokens[r], H, generator=gen) for r in range(world)]
    g_per_rank = [torch.randn(tokens[r], H, generator=gen) for r in range(world)]
    x, g = per_rank[rank], g_per_rank[rank]
    reference = _build_block(world, top_k, weights)
    ref = _run_block(_fp32_experts(reference) if fused else reference, x, g)
    moe = _build_block(
        world, top_k, weights, placement=placement, dispatcher=dispatcher, fused=fused, sync_free=sync_free
    )
    got = _run_block(moe, x, g)
    errors = [] if isinstance(moe.routed_experts.inner_experts, OccultGroupedExperts) == fused else ["experts"]
    for i, what in enumerate(("output", "input grad", "router grad")):
        _close(got[i], ref[i], what, errors)
    for name, gr, rr in zip(("w1", "w2", "w3"), got[3], ref[3]):
        full = _gather(gr)
        if placement is not None:
            full = placement.invert(full)
        _close(full, _gather(rr), f"{name} grad", errors)
    if not torch.equal(torch.sort(got[4], 1).values, torch.sort(ref[4], 1).values):
        errors.append("expert choices differ")
    placed = placement if placement is not None else Placement.contiguous(E, world)
    c_T = devices_per_token(got[4], placed.tensors(0)[0])
    stats = moe.routed_experts.token_dispatcher.last_comm_stats
    sent = torch.tensor([stats.dispatch_rows, stats.combine_rows, int(c_T.sum()), x.shape[0]])
    dist.all_reduce(sent)
    return errors, sent.tolist()


def _fused_blocks(rank, world, seed):
    cases = {
        "fused contiguous top2": (2, None, [5 + r for r in range(world)]),
        "fused random top3": (3, _random_placement(world, seed), [6] * world),
        "fused empty rank": (2, _random_placement(world, seed + 1), [0] + [7] * (world - 1)),
        "fused top-k = all": (E, None, [4] * world),
    }
    return {
        name: _block_case(rank, world, seed + 10 + i, *case, fused=True) for i, (name, case) in enumerate(cases.items())
    }


def _sync_free_blocks(rank, world, seed):
    """`sync_free=True`: fixed-capacity exchanges (every rank the same token count), TorchTitan's experts and occult's
    fused ones, against TorchTitan's all-to-all."""
    cases = {
        "sync-free random top3": (3, _random_placement(world, seed), [6] * world, False),
        "sync-free fused contiguous top2": (2, None, [5] * world, True),
    }
    return {
        name: _block_case(rank, world, seed + 20 + i, top_k, placement, tokens, fused=fused, sync_free=True)
        for i, (name, (top_k, placement, tokens, fused)) in enumerate(cases.items())
    }


def _random_placement(world: int, seed: int) -> Placement:
    order = np.random.default_rng(seed).permutation(E)
    device_E = np.empty(E, dtype=np.int64)
    device_E[order] = np.arange(E) // (E // world)
    return Placement(device_E[None], world)


def _blocks(rank, world, seed):
    """Every block case of one world size in one spawn (TorchTitan's import costs seconds per process)."""
    _cpu_torchtitan()
    torch.manual_seed(seed)
    cases = {
        "contiguous top2": (2, None, [5 + r for r in range(world)], "dedup"),
        "random top3": (3, _random_placement(world, seed), [6] * world, "dedup"),
        "empty rank": (2, _random_placement(world, seed + 1), [0] + [7] * (world - 1), "dedup"),
        "top-k = all": (E, None, [4] * world, "dedup"),
        "standard random": (3, _random_placement(world, seed + 2), [5] * world, "standard"),
    }
    return {name: _block_case(rank, world, seed + i, *case) for i, (name, case) in enumerate(cases.items())}


def _check_blocks(blocks, world):
    for name, (errors, sent) in blocks.items():
        assert not errors, f"{world} ranks, {name}: {errors}"
        dispatch_rows, combine_rows, sum_c, tokens = sent
        top_k = {"contiguous top2": 2, "random top3": 3, "empty rank": 2, "top-k = all": E, "standard random": 3}[name]
        expected = tokens * top_k if name.startswith("standard") else sum_c
        assert dispatch_rows == combine_rows == expected, (name, sent)
        if name == "top-k = all":
            assert dispatch_rows == tokens * world  # every token to every rank once, not k times


@pytest.mark.timeout(240)
def test_block_matches_torchtitan_alltoall_on_4_ranks():
    _check_blocks(run_ranks(_blocks, 4, int(torch.randint(0, 10_000, ())))[0], 4)


def _cpu_attention() -> None:
    """FlexAttention has no CPU backward: causal SDPA in its place (exact here: one document per row)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    def causal_sdpa(
        q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None, kernel_options=None
    ):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
        ), None

    attention.FlexAttention._compiled_flex_attn = causal_sdpa
    attention._compiled_create_block_mask = create_block_mask


def _tiny_qwen3_spec():
    """A tiny Qwen3-MoE `ModelSpec` (2 layers, 8 experts, top-2) as TorchTitan's registry builds one."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
        parallelize_qwen3,
    )
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
    from torchtitan.protocols.model_spec import ModelSpec

    V = 64
    cfg = Qwen3Model.Config(
        vocab_size=V,
        dim=H,
        norm=_qwen3_norm(H),
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=H, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=H, out_features=V, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=2,
            dim=H,
            n_heads=2,
            n_kv_heads=1,
            head_dim=8,
            moe_hidden_dim=F,
            num_experts=E,
            top_k=2,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=8, max_seq_len=64, theta=1e4),
        ),
    )
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=True)  # what update_from_config does for EP > 1
    return ModelSpec(
        name="qwen3",
        flavor="tiny",
        model=cfg,
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )


def _train_steps(spec, dims, state_dict, ids_BS, steps=2):
    """TorchTitan's pieces: model from the spec, its parallelize (EP + FSDP2), loss, optimizer; losses."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    model = spec.model.build()
    model.init_states(buffer_device=torch.device("cpu"))
    model.load_state_dict(state_dict)
    model = spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=False),
        ac_config=None,
        dump_folder="/tmp",
    )
    for m in model.modules():
        if isinstance(m, FSDPModule):  # gloo has no PREMUL_SUM
            m.set_force_sum_reduction_for_comms(True)
    loss_fn = CrossEntropyLoss.Config().build()
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
    opt = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(model_parts=[model])
    B, S = ids_BS.shape
    pos_BS = torch.arange(S - 1).expand(B, S - 1).contiguous()
    tokens = torch.tensor(float(B * (S - 1) * dist.get_world_size()))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = _local(
            model(ids_BS[:, :-1], positions=pos_BS, attention_masks=model.get_attention_masks(positions=pos_BS))
        )
        loss, _ = loss_fn(logits, ids_BS[:, 1:], tokens)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses, model


def _training(rank, world, seed, placement_path):
    """Default dispatcher vs occult's, switched on by TorchTitan's override mechanism with a placement."""
    from torchtitan.config.override import OverrideConfig, apply_overrides

    from occult.integrations.torchtitan import OccultGroupedExperts, OccultTokenDispatcher, to_placed_order

    _cpu_attention()
    dims = _dims(world)
    torch.manual_seed(seed)  # the same initial weights on every rank
    ref_spec, occ_spec = _tiny_qwen3_spec(), _tiny_qwen3_spec()
    init = ref_spec.model.build()
    init.init_states(buffer_device=torch.device("cpu"))
    state = {k: v.detach().clone() for k, v in init.state_dict().items()}
    ids_BS = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(seed + rank))
    ref_losses, _ = _train_steps(ref_spec, dims, state, ids_BS)
    target = "occult.integrations.torchtitan.occult_moe"
    lines = apply_overrides(
        OverrideConfig(imports=[(target, {"dispatcher": "dedup", "placement": placement_path})]), occ_spec
    )
    occ_losses, model = _train_steps(occ_spec, dims, to_placed_order(state, placement_path), ids_BS)
    used = [type(b.moe.routed_experts.token_dispatcher) is OccultTokenDispatcher for b in model.layers.values()]
    fused_spec = _tiny_qwen3_spec()  # occult's fused experts too, under TorchTitan's EP + FSDP2 (parallelize_qwen3)
    options = {"dispatcher": "dedup", "placement": placement_path, "fused_experts": True}
    apply_overrides(OverrideConfig(imports=[(target, options)]), fused_spec)
    fused_losses, model = _train_steps(fused_spec, dims, to_placed_order(state, placement_path), ids_BS)
    used += [type(b.moe.routed_experts.inner_experts) is OccultGroupedExperts for b in model.layers.values()]
    return ref_losses, occ_losses, used, lines, fused_losses


def _two_ranks(rank, world, seed, placement_path):
    _cpu_torchtitan()
    torch.manual_seed(seed)
    blocks = _blocks(rank, world, seed)
    blocks["pruned"] = _pruned_block(rank, world, seed)
    blocks.update(_fused_blocks(rank, world, seed))
    blocks.update(_sync_free_blocks(rank, world, seed))
    training = _training(rank, world, seed, placement_path)
    limit_error = _limit_without_router(rank, world, seed)
    blocks["spmd_types"] = _spmd_types_block(rank, world, seed)  # last: it switches TorchTitan's SPMD backend
    return blocks, training, limit_error


def _spmd_types_block(rank, world, seed):
    """Under TorchTitan's default SPMD backend, inside the SPMD mesh context its trainer sets up, against
    TorchTitan's all-to-all under partial_dtensor (its own under spmd_types needs equal all-to-all sizes on gloo)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (TorchTitan's meshes use a "fake" backend)
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as tt_dist

    gen = torch.Generator().manual_seed(seed)
    weights = _weights(gen)
    x = torch.randn(5 + rank, H, generator=torch.Generator().manual_seed(seed + rank))
    ref = _run_block(_build_block(world, 3, weights), x, torch.ones_like(x))
    tt_dist.set_spmd_backend("spmd_types")
    dims = ParallelDims(
        dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world, world_size=world, spmd_backend="spmd_types"
    )
    dims.build_mesh()
    placement = _random_placement(world, seed)
    with tt_dist.get_spmd_context(parallel_dims=dims)():
        moe = _build_block(world, 3, weights, placement=placement, dispatcher="dedup", dims=dims)
        got = _run_block(moe, x, torch.ones_like(x))
    tt_dist.set_spmd_backend("partial_dtensor")
    errors = []
    for i, what in enumerate(("output", "input grad", "router grad")):
        _close(got[i], ref[i], what, errors)
    for name, gr, rr in zip(("w1", "w2", "w3"), got[3], ref[3]):
        _close(placement.invert(_gather(gr)), _gather(rr), f"{name} grad", errors)
    stats = moe.routed_experts.token_dispatcher.last_comm_stats
    sent = torch.tensor([stats.dispatch_rows, stats.combine_rows])
    torch.distributed.all_reduce(sent)  # every row sent out comes back once
    return errors, sent.tolist() + [0, 0]


def _limit_without_router(rank, world, seed):
    """max_devices on the dispatcher behind TorchTitan's own (unlimited) router: an error on every rank."""
    gen = torch.Generator().manual_seed(seed)
    weights = _weights(gen)  # (any weights: the error comes first)
    moe = _build_block(world, E, weights, dispatcher="dedup", max_devices=1, occult_router=False)
    try:
        _run_block(moe, torch.randn(3, H), torch.ones(3, H))
    except ValueError as e:
        return str(e)
    return None


def _pruned_block(rank, world, seed):
    """max_devices=1 through occult's dispatcher vs TorchTitan's all-to-all behind the same pruned router."""
    from torchtitan.config.override import derive

    from occult.integrations.torchtitan import OccultRouter

    gen = torch.Generator().manual_seed(seed)
    weights = _weights(gen)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(seed + rank))
    placement = _random_placement(world, seed)
    cfg = _moe_config(3)
    cfg.router = derive(cfg.router, OccultRouter.Config, max_devices=1, placement=placement)
    ref_moe = cfg.build()
    with torch.no_grad():  # the reference holds model-order experts behind TorchTitan's own all-to-all
        ref_moe.router.gate.weight.copy_(weights[0])
        ex = ref_moe.routed_experts.inner_experts
        ex.w1_EFD.copy_(weights[1]), ex.w2_EDF.copy_(weights[2]), ex.w3_EFD.copy_(weights[3])
    ref_moe.parallelize(_dims(world))
    ref = _run_block(ref_moe, x, torch.ones_like(x))
    moe = _build_block(world, 3, weights, placement=placement, dispatcher="dedup", max_devices=1)
    got = _run_block(moe, x, torch.ones_like(x))
    errors = []
    _close(got[0], ref[0], "output", errors)
    _close(got[1], ref[1], "input grad", errors)
    stats = moe.routed_experts.token_dispatcher.last_comm_stats
    return errors, [stats.dispatch_rows, x.shape[0]]


@pytest.mark.timeout(240)
def test_block_and_training_step_on_2_ranks(tmp_path):
    path = tmp_path / "placement.json"
    placement = _random_placement(2, 7)
    placement = Placement(np.stack([placement.expert_device(0), _random_placement(2, 8).expert_device(0)]), 2)
    placement.save(path)
    results = run_ranks(_two_ranks, 2, int(torch.randint(0, 10_000, ())), str(path))
    blocks, (ref_losses, occ_losses, used, lines, fused_losses), _ = results[0]
    for r, (_, _, limit_error) in enumerate(results):
        assert limit_error is not None and "max_devices=1" in limit_error and "install" in limit_error, (r, limit_error)
    errors, (rows, tokens) = blocks.pop("pruned")
    assert not errors and rows == tokens, (errors, rows, tokens)  # max_devices=1: one row per token
    errors, (rows, back, _, _) = blocks.pop("spmd_types")
    assert not errors and 0 < rows == back, (errors, rows, back)
    for name in [n for n in blocks if n.startswith("fused")]:  # occult's fused experts: the same rows sent
        errors, (rows, back, sum_c, _) = blocks.pop(name)
        assert not errors and rows == back == sum_c, (name, errors, rows, back, sum_c)
    for name in [n for n in blocks if n.startswith("sync-free")]:  # fixed capacity: every token to every rank
        errors, (rows, back, _, tokens) = blocks.pop(name)
        assert not errors and rows == back == 2 * tokens, (name, errors, rows, back, tokens)
    _check_blocks(blocks, 2)
    assert all(used) and len(used) == 4 and len(lines) == 1, (used, lines)
    assert np.allclose(occ_losses, ref_losses, rtol=2e-6, atol=0), (occ_losses, ref_losses)  # same rows, same order
    # fused experts compute in fp32 where TorchTitan's GroupedExperts rounds to bf16: the same losses to bf16's step
    assert np.allclose(fused_losses, ref_losses, rtol=1e-2, atol=0), (fused_losses, ref_losses)
    assert fused_losses[1] != fused_losses[0]
    assert occ_losses[1] != occ_losses[0]  # the optimizer step changed the model


def _router_config(top_k, max_devices, placement):
    from torchtitan.config.override import derive

    from occult.integrations.torchtitan import OccultRouter

    return derive(_moe_config(top_k).router, OccultRouter.Config, max_devices=max_devices, placement=placement)


@pytest.mark.parametrize("max_devices", [None, 1, 2])
def test_pruning_equals_occult_max_devices_routing(max_devices):
    """OccultRouter (TorchTitan's Qwen3 router + max_devices) chooses what occult's TopKRouter chooses."""
    from occult.moe.routing import TopKRouter

    _cpu_torchtitan()
    placement, top_k = _random_placement(4, int(torch.randint(0, 1000, ()))), 2
    router = _router_config(top_k, max_devices, placement).build()
    ours = TopKRouter(H, E, top_k, norm_topk_prob=True, max_devices=max_devices)
    ours.set_expert_device(placement.tensors(0)[0])
    with torch.no_grad():
        ours.gate.weight.copy_(torch.randn(E, H))
        router.gate.weight.copy_(ours.gate.weight)
    x = torch.randn(64, H)
    scores, ids, _ = router(x[None])
    want_w, want_ids = ours(x)
    order, want_order = ids[0].sort(1), want_ids.sort(1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(scores[0].gather(1, order.indices), want_w.gather(1, want_order.indices))
    if max_devices is not None:
        from occult.moe.pruning import devices_per_token

        spread = devices_per_token(ids[0], placement.tensors(0)[0])
        assert int(spread.max()) <= max_devices and int(spread.min()) >= 1


def test_install_and_override_on_qwen3_and_deepseek_v3_specs(tmp_path):
    """Every MoE block of TorchTitan's registry specs gets occult's dispatcher and router (layer i: placement layer
    i); the model's own router settings stay; bad input is refused when installing."""
    from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports
    from torchtitan.models.common.moe import MoE
    from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3
    from torchtitan.models.qwen3 import model_registry as qwen3

    from occult.integrations.torchtitan import OccultGroupedExperts, OccultRouter, OccultTokenDispatcher, install
    from occult.placement import PlacementError

    spec = deepseek_v3("debugmodel")
    before = [cfg.router for _, cfg, _, _ in spec.model.traverse(MoE.Config)]
    # the command line of docs/integrations.md: --override.imports 'occult.integrations.torchtitan.occult_moe={...}'
    imports = parse_cli_imports(['occult.integrations.torchtitan.occult_moe={"dispatcher": "dedup", "max_devices": 2}'])
    assert len(apply_overrides(OverrideConfig(imports=imports), spec)) == 1
    moes = [cfg for _, cfg, _, _ in spec.model.traverse(MoE.Config)]
    assert len(moes) == 5
    for i, moe in enumerate(moes):
        td, router = moe.routed_experts.token_dispatcher, moe.router
        assert isinstance(td, OccultTokenDispatcher.Config) and td.layer_index == i and td.max_devices == 2
        assert isinstance(router, OccultRouter.Config) and router.max_devices == 2 and td.num_experts == moe.num_experts
        for name in ("score_func", "route_norm", "route_scale", "num_expert_groups", "num_limited_groups", "top_k"):
            assert getattr(router, name) == getattr(before[i], name), name
    model_cfg = qwen3("debugmodel_moe").model
    with pytest.raises(ValueError, match="dispatcher must be one of"):
        install(model_cfg, dispatcher="fast")
    Placement.contiguous(64, 4, num_layers=3).save(tmp_path / "p.json")
    with pytest.raises(PlacementError, match="3 layers, but the model has 8 MoE blocks"):
        install(model_cfg, placement=str(tmp_path / "p.json"))
    with pytest.raises(ValueError, match="has no MoE blocks"):
        install(qwen3("debugmodel").model)
    assert install(model_cfg, dispatcher="standard") == 8
    with pytest.raises(ValueError, match="transport must be one of"):
        install(model_cfg, transport="nvshmem")
    model_cfg = qwen3("debugmodel_moe").model
    assert install(model_cfg, transport="device") == 8  # checked where the EP group is built (NCCL, one host)
    assert {cfg.routed_experts.token_dispatcher.transport for _, cfg, _, _ in model_cfg.traverse(MoE.Config)} == {
        "device"
    }
    plain = [cfg.routed_experts.inner_experts for _, cfg, _, _ in model_cfg.traverse(MoE.Config)]
    assert not any(isinstance(c, OccultGroupedExperts.Config) for c in plain)  # occult's experts only when asked
    with pytest.raises(ValueError, match="fused_experts must be True or False"):
        install(qwen3("debugmodel_moe").model, fused_experts="yes")
    with pytest.raises(ValueError, match="sync_free must be True or False"):
        install(qwen3("debugmodel_moe").model, sync_free=1)
    model_cfg = qwen3("debugmodel_moe").model
    assert install(model_cfg, sync_free=True) == 8
    assert {cfg.routed_experts.token_dispatcher.sync_free for _, cfg, _, _ in model_cfg.traverse(MoE.Config)} == {True}
    spec = qwen3("debugmodel_moe")
    imports = parse_cli_imports(['occult.integrations.torchtitan.occult_moe={"fused_experts": true}'])
    assert len(apply_overrides(OverrideConfig(imports=imports), spec)) == 1
    moes = [cfg for _, cfg, _, _ in spec.model.traverse(MoE.Config)]
    assert len(moes) == 8 and all(m.routed_experts.token_dispatcher.fused_experts for m in moes)
    for moe, old in zip(moes, plain):  # the same experts' sizes, occult's kernels
        ex = moe.routed_experts.inner_experts
        assert isinstance(ex, OccultGroupedExperts.Config)
        assert (ex.dim, ex.hidden_dim, ex.num_experts) == (old.dim, old.hidden_dim, old.num_experts)


def test_router_refuses_tensor_parallelism_and_state_dicts_reorder():
    from types import SimpleNamespace

    from occult.integrations.torchtitan import to_model_order, to_placed_order

    _cpu_torchtitan()
    router = _router_config(2, 1, None).build()
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        router.parallelize(SimpleNamespace(tp=2, ep=2))
    with pytest.raises(ValueError, match="max_devices=1 EP ranks hold only 2 experts"):
        _router_config(3, 1, _random_placement(4, 1)).build()
    placement = _random_placement(4, 3)
    state = {
        f"layers.{i}.moe.routed_experts.inner_experts.{n}": torch.randn(E, 3)
        for i in (0, 1)
        for n in ("w1_EFD", "w2_EDF", "w3_EFD")
    }
    state["layers.0.attention.wo.weight"] = torch.randn(2, 2)
    placed = to_placed_order(state, placement)
    for r in range(4):  # TorchTitan's EP gives rank r the r-th block of E/4 rows: the placement's experts of rank r
        block = placed["layers.1.moe.routed_experts.inner_experts.w2_EDF"][r * 2 : (r + 1) * 2]
        assert torch.equal(
            block, state["layers.1.moe.routed_experts.inner_experts.w2_EDF"][placement.experts_on_device(r).copy()]
        )
    back = to_model_order(placed, placement)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_one_rank_without_expert_parallelism_uses_the_placed_order():
    """EP = 1 (no EP mesh): TorchTitan's local reordering, experts in placed order; the same block function."""
    from torchtitan.config.override import derive

    from occult.integrations.torchtitan import OccultRouter, OccultTokenDispatcher

    _cpu_torchtitan()
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    gate, w1, w2, w3 = _weights(gen)
    placement, outs = _random_placement(4, 5), []
    for occult in (False, True):
        cfg = _moe_config(3)
        if occult:
            cfg.routed_experts.token_dispatcher = OccultTokenDispatcher.Config(
                num_experts=E, top_k=3, placement=placement
            )
            cfg.router = derive(cfg.router, OccultRouter.Config, placement=placement)
        moe = cfg.build()
        weights = [placement.apply(w) if occult else w for w in (w1, w2, w3)]
        with torch.no_grad():
            moe.router.gate.weight.copy_(gate)
            ex = moe.routed_experts.inner_experts
            ex.w1_EFD.copy_(weights[0]), ex.w2_EDF.copy_(weights[1]), ex.w3_EFD.copy_(weights[2])
        x = torch.randn(11, H, generator=torch.Generator().manual_seed(1))
        out, x_grad, router_grad, grads, _ = _run_block(moe, x, torch.ones_like(x))
        outs.append((out, x_grad, router_grad, *[placement.invert(g) if occult else g for g in grads]))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_one_rank_fused_experts_equal_torchtitan_in_fp32():
    """EP = 1 with occult's fused experts (`fused_experts=True`): the tokens are the rows, their placed positions
    the slots; outputs and every gradient equal TorchTitan's local block with its experts in fp32."""
    _cpu_torchtitan()
    seed = int(torch.randint(0, 10_000, ()))
    gen = torch.Generator().manual_seed(seed)
    weights = _weights(gen)
    placement = _random_placement(4, seed)
    x, g = torch.randn(13, H, generator=gen), torch.randn(13, H, generator=gen)
    want = _run_block(_fp32_experts(_build_block(None, 3, weights)), x, g)
    got = _run_block(_build_block(None, 3, weights, placement=placement, dispatcher="dedup", fused=True), x, g)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    for a, b in zip(got[3], want[3]):
        torch.testing.assert_close(placement.invert(a), b, rtol=RTOL, atol=ATOL)


def test_fused_experts_under_torch_compile():
    """TorchTitan compiles its blocks (`--compile.enable`): the MoE block with occult's fused experts, compiled, gives
    what it gives eagerly, outputs and every gradient (EP = 1; on CPU the reference expert loop breaks the graph)."""
    _cpu_torchtitan()
    seed = int(torch.randint(0, 10_000, ()))
    gen = torch.Generator().manual_seed(seed)
    weights, placement = _weights(gen), _random_placement(4, seed)
    x, g = torch.randn(13, H, generator=gen), torch.randn(13, H, generator=gen)

    def block():
        return _build_block(None, 3, weights, placement=placement, dispatcher="dedup", fused=True)

    want = _run_block(block(), x, g)
    torch._dynamo.reset()
    compiled = block()
    compiled.compile(backend="aot_eager")
    got = _run_block(compiled, x, g)
    for a, b in zip([*got[:3], *got[3]], [*want[:3], *want[3]]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _compiled_sync_free_block(rank, world, seed):
    """The expert-parallel MoE block, occult's fused experts and sync-free exchanges, eager then compiled
    (`aot_eager`): outputs and gradients, and the reasons of every graph break."""
    from torch._dynamo.utils import counters

    _cpu_torchtitan()
    gen = torch.Generator().manual_seed(seed)
    weights, placement = _weights(gen), _random_placement(world, seed)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(seed + rank))
    g = torch.randn(7, H, generator=torch.Generator().manual_seed(seed + 100 + rank))

    def block():
        return _build_block(world, 3, weights, placement=placement, dispatcher="dedup", fused=True, sync_free=True)

    want = _run_block(block(), x, g)
    torch._dynamo.reset()
    counters.clear()
    compiled = block()
    compiled.compile(backend="aot_eager")
    got = _run_block(compiled, x, g)
    errors = []
    for a, b, what in zip(
        [*got[:3], *got[3]], [*want[:3], *want[3]], ("out", "x grad", "router grad", "w1", "w2", "w3")
    ):
        _close(a, b, what, errors, rtol=1e-6, atol=1e-7)
    return errors, [str(reason).split("\n")[0] for reason in counters["graph_break"]]


@pytest.mark.timeout(240)
def test_expert_parallel_sync_free_block_under_torch_compile():
    """TorchTitan compiles its blocks (`--compile.enable`): expert parallel over 2 ranks with occult's fused experts
    and sync-free exchanges, the compiled block gives the eager outputs and gradients; its graph breaks are the CPU
    reference expert loop's only, none at the all-to-alls (whose backward books its rows with the forward)."""
    for errors, breaks in run_ranks(_compiled_sync_free_block, 2, int(torch.randint(0, 10_000, ()))):
        assert not errors, errors
        others = [b for b in breaks if not b.startswith(("Dynamic shape operator", "Data dependent operator"))]
        assert breaks and not others, breaks
