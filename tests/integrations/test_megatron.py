"""occult inside Megatron-Core (`occult.integrations.megatron`; 0.16.1 in CI, 0.19.x on the GPU image).

On 2 gloo ranks, in one spawn: Megatron's own `MoELayer` (local spec: `TopKRouter`, `SequentialMLP`)
made by `install` with occult's dispatcher equals the same layer with Megatron's `alltoall`
dispatcher, same weights and inputs: output and every gradient (input, router, each expert's fc1
and fc2) in fp32, for dedup (contiguous and a random placement), standard, top-1, top-k = all
experts and a rank with one token (Megatron's router cannot take a rank with none); rows sent per
layer are sum_t C_T (dedup) and k x tokens (standard); `max_devices` keeps every token on at most
that many EP ranks (1: one row per token) and equals the `alltoall` layer behind the same limited
router (softmax and sigmoid scores). Bad configuration is refused with a clear error, when the
spec is changed or when the layer is built. `cpu_shims` leaves torch.compile off in the ranks.
A GPTModel with occult (placed, and unplaced) trained two steps and saved per rank with torch.save
loads into Megatron's own `alltoall` model (placed: after `model_order_local_experts`; unplaced: as
is) and gives the same per-token losses on a fresh batch; the placed one loaded as is does not.
The same placed model saved with `dist_checkpointing.save` (torch_dist; `cpu_shims` write its files
in the rank) loads into Megatron's model the documented way (into a placed model, then
`model_order_local_experts`) and, saved through `model_order_sharded_state_dict`, as is (and back into a
placed model through it): the same per-token losses; the placed one loaded as is differs.

occult's grouped experts (`use_grouped_experts`: TEGroupedMLP over `GroupedLinear`) under occult's dedup
(random placement, top-3; top-k = all with a one-token rank) and under Megatron's alltoall equal the
SequentialMLP + alltoall layer, output and every gradient. A grouped GPTModel with occult, trained two steps and
saved with `dist_checkpointing.save`, loads into Megatron's SequentialMLP alltoall model and into a grouped one,
and its state dict (after `to_sequential_expert_keys`) into the SequentialMLP one: the same per-token losses;
`model_order_sharded_state_dict` refuses its stacked experts. `RoutingTrace` records a Megatron GPTModel's routing
over two batches per rank and saves one trace with every rank's tokens and the experts its routers chose (a
hook of the test's own reads them); a trace saved before any forward is refused on every rank; a placement
solved from the trace builds occult's model.

Megatron's experts see the same rows in the same order with either dispatcher; only the per-token
sums run in another order (fp32 rounding).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

# Importing Megatron-Core imports Triton: with its CPU interpreter on, as the kernel tests collected
# after this module need it in this process (tests/kernels/_triton_interpreter.py).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is installed by .ci/run (docs/testing.md)")

from occult.distributed import run_ranks  # noqa: E402
from occult.placement import Placement  # noqa: E402

H, F, E = 16, 8, 8  # hidden, expert ffn, experts
RTOL, ATOL = 1e-4, 1e-5


def _random_placement(world: int, seed: int) -> Placement:
    order = np.random.default_rng(seed).permutation(E)
    device_E = np.empty(E, dtype=np.int64)
    device_E[order] = np.arange(E) // (E // world)
    return Placement(device_E[None], world)


def _megatron(world: int) -> None:
    """Megatron on CPU gloo ranks: its CUDA stream calls stubbed, expert parallelism over all ranks."""
    from megatron.core import parallel_state

    from occult.integrations.megatron.cpu import cpu_shims

    warnings.filterwarnings("ignore", message=".*Transformer Engine.*|.*Apex.*")
    cpu_shims()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world, create_gloo_process_groups=False)


def _config(top_k: int, **overrides):
    import torch.nn.functional as nnf
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        ffn_hidden_size=F,
        moe_ffn_hidden_size=F,
        num_moe_experts=E,
        moe_router_topk=top_k,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        gated_linear_unit=True,
        activation_func=nnf.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_permute_fusion=False,
        gradient_accumulation_fusion=False,
        expert_model_parallel_size=torch.distributed.get_world_size(),
        use_cpu_initialization=True,
    )
    return TransformerConfig(**{**settings, **overrides})


def _build(config, grouped=False, **options):
    """Megatron's MoE layer from its local spec; occult's (by `install`) when `options` are given; its experts
    TEGroupedMLP over occult's GroupedLinear when `grouped` (else SequentialMLP)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from occult.integrations.megatron import install, use_grouped_experts

    specs = [get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)]
    if options:
        assert install(specs, **options) == 1
    if grouped:
        assert use_grouped_experts(specs) == 1
    spec = specs[0]
    if isinstance(spec, ModuleSpec):  # 0.16: a ModuleSpec; 0.19: a functools.partial
        return spec.module(config=config, submodules=spec.submodules, layer_number=1, **spec.params)
    return spec(config=config, layer_number=1)


def _load(layer, weights, placement=None):
    """Router rows in model order; local expert j of this rank = the placement's j-th expert here."""
    import torch.distributed as dist

    gate, w1, w2 = weights
    rank, world = dist.get_rank(), dist.get_world_size()
    local = (placement or Placement.contiguous(E, world)).experts_on_device(rank)
    with torch.no_grad():
        layer.router.weight.copy_(gate)
        for j, e in enumerate(local):
            fc1, fc2 = _expert_weights(layer, j)
            fc1.copy_(w1[e])
            fc2.copy_(w2[e])
    return local


def _expert_weights(layer, j):
    """Local expert j's fc1 and fc2 weights [out, in]: SequentialMLP's parameters, or views of GroupedLinear's."""
    experts = layer.experts
    if hasattr(experts, "local_experts"):
        return experts.local_experts[j].linear_fc1.weight, experts.local_experts[j].linear_fc2.weight
    return experts.linear_fc1.weight[j], experts.linear_fc2.weight[j]


def _expert_grads(layer, name):
    """[local experts, out, in] gradients of fc1 or fc2, either expert module."""
    experts = layer.experts
    if hasattr(experts, "local_experts"):
        return torch.stack([getattr(m, name).weight.grad for m in experts.local_experts])
    return getattr(experts, name).weight.grad


def _run(layer, local, x_TH, g_TH):
    """Forward + backward of (out * g).sum() -> out, x grad, router grad, full-model expert grads, ids."""
    import torch.distributed as dist

    seen = {}
    hook = layer.router.register_forward_hook(lambda m, a, out: seen.update(ids=out[1].detach()))
    x = x_TH.clone().requires_grad_(True)
    out, bias = layer(x[:, None])
    assert bias is None
    (out[:, 0] * g_TH).sum().backward()
    hook.remove()
    grads = []
    for name in ("linear_fc1", "linear_fc2"):
        mine = _expert_grads(layer, name)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        order = [torch.empty(len(local), dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(order, torch.as_tensor(local.copy(), dtype=torch.int64))
        full = torch.empty(E, *mine.shape[1:])
        full[torch.cat(order)] = torch.cat(parts)
        grads.append(full)
    ids_TK = seen["ids"].nonzero()[:, 1].view(x_TH.shape[0], -1)
    return out[:, 0].detach(), x.grad, layer.router.weight.grad, grads, ids_TK


def _close(a, b, what, errors):
    if a.shape != b.shape or not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
        diff = (a - b).abs().max().item() if a.shape == b.shape else f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
        errors.append(f"{what}: max abs diff {diff}")


def _case(
    rank, world, seed, top_k, tokens, placement=None, dispatcher="dedup", max_devices=None, settings=None, grouped=()
):
    """occult's layer vs Megatron's alltoall one.
    -> (errors, [dispatch rows, combine rows, sum_t C_T, tokens, largest C_T])"""
    import torch.distributed as dist

    from occult.moe.pruning import devices_per_token

    gen = torch.Generator().manual_seed(seed)
    weights = (torch.randn(E, H, generator=gen), torch.randn(E, 2 * F, H, generator=gen) * 0.3)
    weights += (torch.randn(E, H, F, generator=gen) * 0.3,)
    xs = [torch.randn(tokens[r], H, generator=gen) for r in range(world)]
    gs = [torch.randn(tokens[r], H, generator=gen) for r in range(world)]
    settings = settings or {}
    ref_layer = _build(_config(top_k, **settings))
    if max_devices is not None:  # the reference: Megatron's alltoall behind the same limited router
        ref_layer.router.__class__ = _occult_router()
        ref_layer.router.set_device_limit(max_devices, placement.tensors(0)[0])
    ref = _run(ref_layer, _load(ref_layer, weights), xs[rank], gs[rank])
    if "reference" in grouped:  # Megatron's alltoall over occult's grouped experts, against the same SequentialMLP one
        ref_layer = _build(_config(top_k, **settings), grouped=True)
        grouped_ref = _run(ref_layer, _load(ref_layer, weights), xs[rank], gs[rank])
    options = dict(dispatcher=dispatcher, placement=placement, max_devices=max_devices)
    layer = _build(_config(top_k, **settings), grouped="occult" in grouped, **options)
    got = _run(layer, _load(layer, weights, placement), xs[rank], gs[rank])
    errors = []
    for i, what in enumerate(("output", "input grad", "router grad")):
        _close(got[i], ref[i], what, errors)
    for name, gr, rr in zip(("fc1", "fc2"), got[3], ref[3]):
        _close(gr, rr, f"{name} grads", errors)
    if not torch.equal(got[4], ref[4]):
        errors.append("expert choices differ")
    if "reference" in grouped:
        for i, what in enumerate(("output", "input grad", "router grad")):
            _close(grouped_ref[i], ref[i], f"alltoall grouped {what}", errors)
        for name, gr, rr in zip(("fc1", "fc2"), grouped_ref[3], ref[3]):
            _close(gr, rr, f"alltoall grouped {name} grads", errors)
    if grouped and type(layer.experts).__name__ != "TEGroupedMLP":
        errors.append(f"experts are {type(layer.experts).__name__}, not TEGroupedMLP")
    c_T = devices_per_token(got[4], (placement or Placement.contiguous(E, world)).tensors(0)[0])
    stats = layer.token_dispatcher.last_comm_stats
    sent = torch.tensor([stats.dispatch_rows, stats.combine_rows, int(c_T.sum()), tokens[rank]])
    dist.all_reduce(sent)
    worst = torch.tensor(int(c_T.max()) if c_T.numel() else 0)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return errors, sent.tolist() + [int(worst)]


def _occult_router():
    from occult.integrations.megatron import OccultRouter

    return OccultRouter


def _refused(build) -> str | None:
    try:
        build()
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return None


def _bad_builds(world: int) -> dict[str, str | None]:
    """Settings occult refuses when the layer is built, each with its message (None: not refused)."""
    return {
        "experts": _refused(lambda: _build(_config(2), placement=Placement.contiguous(2 * E, world))),
        "room": _refused(lambda: _build(_config(5), placement=_random_placement(world, 1), max_devices=1)),
        "allgather": _refused(lambda: _build(_config(2, moe_token_dispatcher_type="allgather"), dispatcher="dedup")),
        "capacity": _refused(lambda: _build(_config(2, moe_expert_capacity_factor=1.0), dispatcher="dedup")),
    }


def _gpt(config, placement=None, state=None, occult=None, grouped=False):
    """A 2-layer Megatron GPTModel from its local layer spec (occult's by `install` with a placement, or when
    `occult` is true), fp32; its experts occult's grouped ones when `grouped`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from occult.integrations.megatron import install, use_grouped_experts
    from occult.integrations.megatron.placement import placed_local_experts

    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    if placement is not None or occult:
        assert install(spec, placement=placement) == 1  # one spec object serves both layers
    if grouped:
        assert use_grouped_experts(spec) == 1
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=32, max_sequence_length=8)
    if state is not None:
        model.load_state_dict(placed_local_experts(state, placement) if placement is not None else state)
    return model


def _gpt_case(rank, world, seed):
    """Loss and gradients of a GPTModel step: Megatron's alltoall vs occult with a 2-layer placement."""
    torch.manual_seed(seed)
    config = _config(2, num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    ref = _gpt(config)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items() if torch.is_tensor(v)}
    rows = [_random_placement(world, seed + i).expert_device(0) for i in (0, 1)]
    placement = Placement(np.stack(rows), world)
    got = _gpt(config, placement, state)
    ids = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(seed + rank))
    pos, causal = torch.arange(8)[None], torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), 1)
    out, errors = [], []
    for model in (ref, got):
        loss = model(ids[:, :-1], pos, causal, labels=ids[:, 1:]).mean()
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if "local_experts" not in n}
        out.append((loss.detach(), grads))
    _close(out[1][0], out[0][0], "GPT loss", errors)
    for name, g in out[0][1].items():
        _close(out[1][1][name], g, f"GPT {name} grad", errors)
    used = [type(m.token_dispatcher).__name__ for m in got.modules() if hasattr(m, "token_dispatcher")]
    layers = [m.token_dispatcher.layer_index for m in got.modules() if hasattr(m, "token_dispatcher")]
    return errors, used, layers


def _tokens(seed, rank):
    """A batch of 8 tokens (and their next tokens) for this rank, with its positions and causal mask."""
    ids = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(seed + rank))
    return ids[:, :-1], torch.arange(8)[None], torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), 1), ids[:, 1:]


def _train(model, seed, steps=2):
    """`steps` Adam steps on this rank's batches; non-expert gradients averaged over the ranks (data parallel)."""
    import torch.distributed as dist

    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(steps):
        tokens, pos, causal, labels = _tokens(seed + 100 * step, dist.get_rank())
        model(tokens, pos, causal, labels=labels).mean().backward()
        for name, p in model.named_parameters():
            if "local_experts" not in name:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        optimizer.step()
        optimizer.zero_grad()


def _loss_TS(model, seed):
    tokens, pos, causal, labels = _tokens(seed, torch.distributed.get_rank())
    with torch.no_grad():
        return model(tokens, pos, causal, labels=labels)


def _checkpoint_case(rank, world, seed, folder):
    """occult's GPTModel (placed, and unplaced) trained 2 steps, its per-rank state dict saved with torch.save,
    loaded into Megatron's own alltoall model -> per-token losses on a fresh batch: (occult's, Megatron's loaded
    with `model_order_local_experts`, Megatron's loaded as saved) for the placed model, (occult's, Megatron's
    loaded as saved) for the unplaced one."""
    import os

    from occult.integrations.megatron.placement import model_order_local_experts
    from occult.placement import PlacementError

    torch.manual_seed(seed)
    config = _config(2, num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    interleaved = np.arange(E) % world  # a non-trivial placement in layer 0 whatever the seed
    placement = Placement(np.stack([interleaved, _random_placement(world, seed + 5).expert_device(0)]), world)
    losses = {}
    for name, place in (("placed", placement), ("unplaced", None)):
        occult_model = _gpt(config, place, occult=True)
        _train(occult_model, seed)
        path = os.path.join(folder, f"{name}_ep{rank}.pt")
        torch.save(occult_model.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)
        saved = torch.load(path, weights_only=False)
        torch.manual_seed(seed + 1)  # fresh weights, overwritten by the checkpoint
        loaded = [_gpt(config, state=saved)]
        if place is not None:  # the placement file kept with the checkpoint, as a user would
            placement_path = os.path.join(folder, f"placement_ep{rank}.json")
            place.save(placement_path)
            loaded.insert(0, _gpt(config, state=model_order_local_experts(saved, placement_path)))
            try:  # a placement of another shape is refused, not applied
                model_order_local_experts(saved, Placement.contiguous(2 * E, world))
            except PlacementError as e:
                losses["wrong placement"] = str(e)
        losses[name] = [_loss_TS(m, seed + 7) for m in [occult_model, *loaded]]
        losses[f"{name} dispatchers"] = [
            type(m.token_dispatcher).__name__
            for model in (occult_model, loaded[0])
            for m in model.modules()
            if hasattr(m, "token_dispatcher")
        ]
    return losses


def _dist_checkpoint_case(rank, world, seed, folder):
    """occult's placed GPTModel trained 2 steps, saved with `dist_checkpointing.save` (torch_dist, its
    `sharded_state_dict()`) as is and through `model_order_sharded_state_dict` -> per-token losses on a fresh
    batch of: occult's; Megatron's alltoall model loaded the documented way (the placed checkpoint into a fresh
    placed model, then `model_order_local_experts`); Megatron's loading the model-order checkpoint as is; a fresh
    placed model loading it through `model_order_sharded_state_dict`; Megatron's loading the placed one as is;
    a placed model loading, through it, what Megatron's model (loaded the documented way) saved."""
    from megatron.core import dist_checkpointing

    from occult.integrations.megatron.placement import model_order_local_experts, model_order_sharded_state_dict
    from occult.placement import PlacementError

    torch.manual_seed(seed)
    config = _config(2, num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    interleaved = np.arange(E) % world
    placement = Placement(np.stack([_random_placement(world, seed + 9).expert_device(0), interleaved]), world)
    occult_model = _gpt(config, placement, occult=True)
    _train(occult_model, seed + 3)
    placed_dir, model_dir = (os.path.join(folder, name) for name in ("dist_placed", "dist_model_order"))
    for path in (placed_dir, model_dir):
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(occult_model.sharded_state_dict(), placed_dir)
    dist_checkpointing.save(model_order_sharded_state_dict(occult_model.sharded_state_dict(), placement), model_dir)

    def fresh(placed=False):
        torch.manual_seed(seed + 1)  # fresh weights, overwritten by the checkpoint
        return _gpt(config, placement if placed else None, occult=placed)

    def load(model, path, convert=False):
        sharded = model.sharded_state_dict()
        model.load_state_dict(
            dist_checkpointing.load(model_order_sharded_state_dict(sharded, placement) if convert else sharded, path)
        )
        return model

    resumed = load(fresh(placed=True), placed_dir)
    documented = fresh()
    documented.load_state_dict(model_order_local_experts(resumed.state_dict(), placement))
    models = [occult_model, documented, load(fresh(), model_dir), load(fresh(placed=True), model_dir, convert=True)]
    models.append(load(fresh(), placed_dir))
    megatron_dir = os.path.join(folder, "dist_megatron")  # Megatron's own model's checkpoint -> the placed model
    os.makedirs(megatron_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(documented.sharded_state_dict(), megatron_dir)
    models.append(load(fresh(placed=True), megatron_dir, convert=True))
    dispatchers = [type(m.mlp.token_dispatcher).__name__ for m in (mm.decoder.layers[0] for mm in models)]
    losses = [_loss_TS(m, seed + 11) for m in models]
    try:  # a placement for another EP size is refused, not applied
        model_order_sharded_state_dict(occult_model.sharded_state_dict(), Placement.contiguous(E, 2 * world))
    except PlacementError as e:
        dispatchers.append(str(e))
    return losses, dispatchers, sorted(os.listdir(placed_dir))


def _grouped_checkpoint_case(rank, world, seed, folder):
    """occult's GPTModel with grouped experts trained 2 steps, saved with `dist_checkpointing.save` and as a state
    dict -> per-token losses on a fresh batch of: it; Megatron's alltoall SequentialMLP model loading the distributed
    checkpoint; a grouped alltoall model loading it; the SequentialMLP model loading the state dict after
    `to_sequential_expert_keys` (and the expert module of each)."""
    from megatron.core import dist_checkpointing

    from occult.integrations.megatron import to_sequential_expert_keys

    torch.manual_seed(seed)
    config = _config(2, num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    grouped = _gpt(config, occult=True, grouped=True)
    _train(grouped, seed + 5)
    path = os.path.join(folder, "dist_grouped")
    os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(grouped.sharded_state_dict(), path)

    def loaded(**kind):
        torch.manual_seed(seed + 1)  # fresh weights, overwritten by the checkpoint
        model = _gpt(config, **kind)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))
        return model

    models = [grouped, loaded(), loaded(grouped=True)]
    torch.manual_seed(seed + 1)
    models.append(_gpt(config))
    models[-1].load_state_dict(to_sequential_expert_keys(grouped.state_dict()))
    experts = [type(m.decoder.layers[0].mlp.experts).__name__ for m in models]
    from occult.integrations.megatron.placement import model_order_sharded_state_dict
    from occult.placement import PlacementError

    try:  # a grouped model's sharded state dict has no per-expert entries to move: refused, not passed through
        model_order_sharded_state_dict(grouped.sharded_state_dict(), _random_placement(world, seed))
    except PlacementError as e:
        experts.append(str(e))
    return [_loss_TS(m, seed + 13) for m in models], experts


def _trace_case(rank, world, seed, folder):
    """Megatron's own GPTModel traced by `RoutingTrace` over two batches per rank, saved; -> (this rank's
    routing maps' expert ids per layer, seen by a hook of the test's own; the saved trace's layers, experts, top-k
    and ids; the error of a trace saved before any forward; a placement solved from the trace, built into
    occult's model: its dispatchers)."""
    from occult.integrations.megatron.trace import RoutingTrace
    from occult.placement.solvers import place
    from occult.placement.trace import read_trace

    torch.manual_seed(seed)
    config = _config(2, num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    model = _gpt(config)
    seen = {0: [], 1: []}
    routers = [m.router for m in model.modules() if hasattr(m, "router")]
    hooks = [
        r.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[1].nonzero()[:, 1].view(-1, 2).clone()))
        for i, r in enumerate(routers)
    ]
    path = os.path.join(folder, "megatron_trace.safetensors")
    with RoutingTrace(model) as trace, torch.no_grad():
        for step in range(2):
            tokens, pos, causal, labels = _tokens(seed + 50 * step, rank)
            model(tokens, pos, causal, labels=labels)
    for h in hooks:
        h.remove()
    trace.save(path)
    torch.distributed.barrier()
    saved = read_trace(path)
    try:
        RoutingTrace(model).save(os.path.join(folder, "empty.safetensors"))
        empty = None
    except ValueError as e:
        empty = str(e)
    placement = place(saved, world, "greedy").placement
    occult_model = _gpt(config, placement=placement, state=model.state_dict())
    dispatchers = [type(m.token_dispatcher).__name__ for m in occult_model.modules() if hasattr(m, "token_dispatcher")]
    mine = [torch.cat(seen[i]) for i in (0, 1)]
    return mine, (saved.num_layers, saved.num_experts, saved.top_k, saved.topk_ids), empty, dispatchers


def _graphs_compiled() -> int:
    """Graphs torch.compile hands its backend after `cpu_shims`: 0 when it is off, as it must be (Megatron's
    fused helpers are torch.compile'd; a CPU rank on a GPU machine failed compiling them through the stubs)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
    return len(graphs)


def _ranks(rank, world, seed, folder):
    _megatron(world)
    compiled = _graphs_compiled()
    torch.manual_seed(seed)
    rnd = _random_placement(world, seed)
    cases = {
        "dedup contiguous top2": dict(top_k=2, tokens=[5, 6]),
        "dedup placed top3": dict(top_k=3, tokens=[6, 6], placement=rnd),
        "standard placed top3": dict(top_k=3, tokens=[5, 5], placement=rnd, dispatcher="standard"),
        "one token on a rank": dict(top_k=2, tokens=[1, 7], placement=_random_placement(world, seed + 1)),
        "top1": dict(top_k=1, tokens=[6, 4], settings=dict(moe_router_pre_softmax=True)),  # Megatron's rule
        "top-k = all": dict(top_k=E, tokens=[4, 4]),
        "pruned": dict(top_k=2, tokens=[9, 7], placement=rnd, max_devices=1),
        "pruned sigmoid": dict(
            top_k=3, tokens=[8, 8], placement=rnd, max_devices=1, settings=dict(moe_router_score_function="sigmoid")
        ),
        # occult's GroupedLinear experts (TEGroupedMLP) under occult's dispatcher and under Megatron's alltoall
        "grouped dedup placed top3": dict(top_k=3, tokens=[7, 5], placement=rnd, grouped=("occult", "reference")),
        "grouped top-k = all, one token": dict(top_k=E, tokens=[1, 6], grouped=("occult",)),
    }
    results = {name: _case(rank, world, seed + i, **case) for i, (name, case) in enumerate(cases.items())}
    gpt = _gpt_case(rank, world, seed)
    dist = _dist_checkpoint_case(rank, world, seed, folder)
    grouped = _grouped_checkpoint_case(rank, world, seed, folder)
    checkpoints = (_checkpoint_case(rank, world, seed, folder), dist, grouped)
    return results, _bad_builds(world), gpt, compiled, checkpoints, _trace_case(rank, world, seed, folder)


def _check_checkpoint(rank, losses):
    """The checkpoint round trip: same per-token losses (fp32; terms ~ log(vocab)); wrong without the conversion."""
    occult_d, alltoall_d = "OccultTokenDispatcher", "MoEAlltoAllTokenDispatcher"
    for name in ("placed", "unplaced"):
        assert losses[f"{name} dispatchers"] == [occult_d] * 2 + [alltoall_d] * 2, (rank, losses)
        occult_TS, loaded_TS = losses[name][:2]
        assert torch.allclose(loaded_TS, occult_TS, rtol=1e-5, atol=1e-6), (rank, name, occult_TS, loaded_TS)
    assert "with 8 experts each, but this state dict is one of 2 EP ranks with [4]" in losses.get("wrong placement", "")
    unconverted_TS = losses["placed"][2]  # the placed experts under Megatron's contiguous layout
    assert (unconverted_TS - losses["placed"][0]).abs().max() > 1e-3, (rank, "loads wrong yet equal", losses)


def _check_dist_checkpoint(rank, losses, dispatchers, files):
    """The torch_dist round trip: Megatron's model gives occult's per-token losses loaded the documented way,
    from the model-order checkpoint as is, and the placed model from it and from Megatron's own checkpoint; the
    placed checkpoint as is does not."""
    occult_d, alltoall_d = "OccultTokenDispatcher", "MoEAlltoAllTokenDispatcher"
    assert dispatchers[:6] == [occult_d, alltoall_d, alltoall_d, occult_d, alltoall_d, occult_d], (rank, dispatchers)
    assert "placement is for 4 EP ranks, but the EP group has 2" in dispatchers[6:][0], (rank, dispatchers)
    assert "metadata.json" in files and any(f.endswith(".distcp") for f in files), (rank, files)
    names = ("documented", "model order", "placed from model order", "placed from Megatron's")
    for name, loaded_TS in zip(names, losses[1:4] + losses[5:]):
        assert torch.allclose(loaded_TS, losses[0], rtol=1e-5, atol=1e-6), (rank, name, losses[0], loaded_TS)
    assert (losses[4] - losses[0]).abs().max() > 1e-3, (rank, "placed dist checkpoint loads wrong yet equal", losses)


def _check_trace(results):
    """The saved trace holds every rank's tokens, rank by rank, with the experts each router chose; an empty
    trace is refused on every rank; a placement solved from it builds occult's model."""
    mine = [r[5][0] for r in results]
    num_layers, num_experts, top_k, ids = results[0][5][1]
    assert (num_layers, num_experts, top_k) == (2, E, 2)
    for layer in range(2):
        want = torch.cat([m[layer] for m in mine]).numpy()
        assert ids[layer].shape == want.shape and (ids[layer] == want).all(), layer
    for r, (_, _, _, _, _, (_, _, empty, dispatchers)) in enumerate(results):
        assert empty is not None and "recorded no forward" in empty, (r, empty)
        assert dispatchers == ["OccultTokenDispatcher"] * 2, (r, dispatchers)


@pytest.mark.timeout(240)
def test_layer_matches_megatron_alltoall_on_2_ranks(tmp_path):
    results = run_ranks(_ranks, 2, int(torch.randint(0, 10_000, ())), str(tmp_path))
    cases, _, (gpt_errors, used, layers), _, _, _ = results[0]
    assert not gpt_errors and used == ["OccultTokenDispatcher"] * 2 and layers == [0, 1], (gpt_errors, used, layers)
    for name, (errors, (dispatch_rows, combine_rows, sum_c, tokens, worst)) in cases.items():
        assert not errors, f"{name}: {errors}"
        top_k = {"dedup placed top3": 3, "standard placed top3": 3, "top1": 1, "top-k = all": E, "pruned sigmoid": 3}
        top_k = {**top_k, "grouped dedup placed top3": 3, "grouped top-k = all, one token": E}.get(name, 2)
        expected = tokens * top_k if name.startswith("standard") else sum_c
        assert dispatch_rows == combine_rows == expected, (name, dispatch_rows, combine_rows, expected)
        assert worst <= {"pruned": 1, "pruned sigmoid": 1}.get(name, 2), (name, worst)
    assert cases["top-k = all"][1][0] == cases["top-k = all"][1][3] * 2  # every token to each rank once, not 8 times
    for name in ("pruned", "pruned sigmoid"):  # one rank, one row a token
        assert cases[name][1][4] == 1 and cases[name][1][0] == cases[name][1][3], (name, cases[name])
    assert cases["dedup placed top3"][1][0] < cases["dedup placed top3"][1][3] * 3  # dedup sent fewer rows than k x T
    _check_trace(results)
    for r, (_, rank_bad, _, compiled, (checkpoint_losses, dist_checkpoint, grouped), _) in enumerate(results):
        _check_checkpoint(r, checkpoint_losses)
        _check_dist_checkpoint(r, *dist_checkpoint)
        losses, experts = grouped
        assert experts[:4] == ["TEGroupedMLP", "SequentialMLP", "TEGroupedMLP", "SequentialMLP"], (r, experts)
        assert "are one sharded tensor per layer" in experts[4:][0], (r, experts)
        for name, loaded_TS in zip(
            ("dist -> SequentialMLP", "dist -> grouped", "state dict -> SequentialMLP"), losses[1:]
        ):
            assert torch.allclose(loaded_TS, losses[0], rtol=1e-5, atol=1e-6), (r, name, losses[0], loaded_TS)
        assert compiled == 0, f"rank {r}: torch.compile still on after cpu_shims ({compiled} graph(s))"
        assert "placement is for 16 experts" in rank_bad["experts"], (r, rank_bad)
        assert "max_devices=1 EP ranks hold only 4 experts" in rank_bad["room"], (r, rank_bad)
        assert "keep moe_token_dispatcher_type='alltoall'" in rank_bad["allgather"], (r, rank_bad)
        assert "token dropping" in rank_bad["capacity"], (r, rank_bad)


def test_install_refuses_bad_options(tmp_path):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from occult.integrations.megatron import install
    from occult.placement import PlacementError

    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    with pytest.raises(ValueError, match="dispatcher must be one of"):
        install(spec, dispatcher="fast")
    with pytest.raises(ValueError, match="transport must be one of"):
        install(spec, transport="nvshmem")
    with pytest.raises(ValueError, match="max_devices must be an integer >= 1"):
        install(spec, max_devices=0)
    with pytest.raises(PlacementError):
        install(spec, placement=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="has no MoELayer"):
        install(get_gpt_layer_local_spec())
    assert install(spec, dispatcher="standard", transport="counts") == 1
    # 0.19's MoE spec is a functools.partial of MoELayer: replaced in its container, keywords kept
    from functools import partial

    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    from occult.integrations.megatron import OccultMoELayer

    holder = [partial(MoELayer, submodules=MoESubmodules(experts=None))]  # 0.19: experts has no default
    assert install(holder, max_devices=2) == 1
    assert holder[0].func is OccultMoELayer and isinstance(holder[0].keywords["submodules"], MoESubmodules)
    assert holder[0].keywords["occult"].max_devices == 2


def test_state_dict_orders_and_moe_layer_numbers():
    """to_placed_order / to_model_order on every expert layout Megatron names; moe_layer_freq -> MoE layer index."""
    from types import SimpleNamespace

    from occult.integrations.megatron import to_model_order, to_placed_order
    from occult.integrations.megatron.placement import moe_layer_index

    placement = Placement(
        np.stack([_random_placement(2, 3).expert_device(0), _random_placement(2, 4).expert_device(0)]), 2
    )
    state = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(3, 3)}
    for layer in (0, 2):  # two MoE layers: SequentialMLP's and TEGroupedMLP's names in one, GroupedMLP's in the other
        for e in range(E):
            state[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.full((2, 2), e)
            state[f"decoder.layers.{layer}.mlp.experts.linear_fc2.weight{e}"] = torch.full((2,), e)
        state[f"decoder.layers.{layer}.mlp.experts.weight1"] = torch.arange(E).repeat_interleave(2)[None].float()
    placed = to_placed_order(state, placement)
    for i, layer in enumerate((0, 2)):
        order = placement.placed_order(i)  # placed position p holds expert order[p]
        for p, e in enumerate(order):
            assert int(placed[f"decoder.layers.{layer}.mlp.experts.local_experts.{p}.linear_fc1.weight"][0, 0]) == e
            assert int(placed[f"decoder.layers.{layer}.mlp.experts.linear_fc2.weight{p}"][0]) == e
        assert placed[f"decoder.layers.{layer}.mlp.experts.weight1"][0, ::2].tolist() == [float(e) for e in order]
    back = to_model_order(placed, placement)
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())
    config = SimpleNamespace(moe_layer_freq=[0, 1, 1, 0, 1], num_layers=5)
    assert [moe_layer_index(config, n) for n in (2, 3, 5)] == [0, 1, 2]
    assert [moe_layer_index(SimpleNamespace(moe_layer_freq=2, num_layers=4), n) for n in (1, 3)] == [0, 1]
