"""`hf.compile_layers`: the decoder layers torch.compiled around eager MoE blocks, same logits.

Dynamo's "eager" backend keeps this fast on CPU; it checks what the helper controls (which parts
are traced, the graphs shared between layers, the recompile limit), not Inductor's code
(benchmarks/e2e.py `replicated/compile` and the GPU runs in docs/results/CURRENT.md measure that).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from occult.integrations import hf  # noqa: E402


def test_compiled_layers_give_the_same_logits_and_share_graphs():
    from torch._dynamo.utils import counters

    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    model = hf.tiny_random_model("olmoe", seed=seed % 1000, vocab_size=64, num_hidden_layers=3).eval()
    hf.convert(model, group=None)
    ids = torch.randint(64, (2, random.randrange(3, 12)))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    torch._dynamo.reset()
    counters.clear()
    assert hf.compile_layers(model, backend="eager") == 3
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits  # no cache: no per-layer slot to specialise on
        again = model(input_ids=ids, use_cache=False).logits
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6), seed
    assert torch.equal(out, again)
    # two graphs (before and after the eager MoE block), shared by every layer
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert all(block.occult_eager for _, block in hf.moe_blocks(model))
    assert torch._dynamo.config.recompile_limit >= 32 * 3


def test_compiled_layers_train_like_eager():
    torch.manual_seed(0)
    model = hf.tiny_random_model("olmoe", seed=1, vocab_size=64, num_hidden_layers=2)
    hf.convert(model, group=None)
    ids = torch.randint(64, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    hf.compile_layers(model, backend="aot_eager")
    model(input_ids=ids, labels=ids).loss.backward()
    for name, grad in ref.items():
        got = dict(model.named_parameters())[name].grad
        assert got is not None and torch.allclose(got, grad, rtol=1e-4, atol=1e-6), name


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ValueError, match="no `model.layers`"):
        hf.compile_layers(torch.nn.Linear(2, 2))


def _two_rank_worker(rank: int, world_size: int, seed: int) -> float:
    torch.manual_seed(seed)
    model = hf.tiny_random_model("olmoe", seed=seed % 1000, vocab_size=64, num_hidden_layers=2).eval()
    hf.convert(model)  # experts over both ranks: each MoE layer a collective with a host wait
    ids = torch.randint(64, (2, 7), generator=torch.Generator().manual_seed(seed + rank))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        hf.compile_layers(model, backend="eager")
        out = model(input_ids=ids, use_cache=False).logits
    return float((out - ref).abs().max())


def test_compiled_layers_on_two_ranks():
    """Expert-parallel: the compiled dense parts around the eager, collective MoE blocks give the same logits."""
    from occult.distributed import run_ranks

    for err in run_ranks(_two_rank_worker, 2, random.randrange(2**31), timeout_s=180):
        assert err < 1e-5, err


@pytest.mark.parametrize("layer_graphs", [True, False])
def test_expert_parallel_layers_without_a_host_wait_get_layer_graphs(layer_graphs):
    """`compile_layers` switches on `ExecConfig.graphs` for MoE layers of several ranks that do not wait
    for the GPU (here: sync-free, stood in by setting a layer's rank count) unless `layer_graphs=False`;
    one-rank layers and layers with the count exchange's wait are left as they are."""
    from occult import OccultMoE

    model = hf.tiny_random_model("olmoe", seed=3, vocab_size=64, num_hidden_layers=3).eval()
    hf.convert(model, group=None)
    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    layers[0].num_ranks, layers[0].sync_free = 2, True  # expert parallel, no host wait
    layers[1].num_ranks = 2  # expert parallel over the count exchange (its host wait)
    hf.compile_layers(model, layer_graphs=layer_graphs, backend="eager")
    assert [layer.execution.graphs for layer in layers] == [layer_graphs, False, False]


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_traced_moe_blocks_train_like_eager(family):
    """`trace_moe=True`: one-rank MoE blocks traced with their decoder layer, the same gradients as the eager
    model, shared experts too (DeepSeek-V3: queued as the routed experts' `while_waiting`). (On CPU the reference
    expert loop breaks the graph at its data-dependent splits; on a GPU the Triton path traces whole:
    tests/gpu/test_traced_moe_one_gpu.py.)"""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    model = hf.tiny_random_model(family, seed=seed % 1000, vocab_size=64, num_hidden_layers=2)
    hf.convert(model, group=None)
    ids = torch.randint(64, (4, 128))  # 512 tokens x top-2 or more: past decode size, so traced
    model(input_ids=ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    hf.compile_layers(model, trace_moe=True, backend="aot_eager")
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(getattr(b, "occult_traced", False) for _, b in hf.moe_blocks(model))
    assert not any(getattr(b, "occult_eager", False) for _, b in hf.moe_blocks(model))
    for name, grad in ref.items():
        got = dict(model.named_parameters())[name].grad
        assert got is not None and torch.allclose(got, grad, rtol=1e-4, atol=1e-6), (name, seed)


def test_decode_sized_calls_keep_the_eager_block(monkeypatch):
    """A traced block runs its eager forward (a graph break, as measured for captured decode) for decode-sized
    calls, whose (token, expert) pairs fit the small-batch kernels, and is traced past that."""
    from occult.integrations.hf import compiled
    from occult.kernels.small_batch import MAX_PAIRS

    assert compiled.decode_sized(MAX_PAIRS // 4, 4) and not compiled.decode_sized(MAX_PAIRS // 4 + 1, 4)
    model = hf.tiny_random_model("olmoe", seed=5, vocab_size=64, num_hidden_layers=1)
    hf.convert(model, group=None)
    (_, block), top_k = hf.moe_blocks(model)[0], model.config.num_experts_per_tok
    calls = []
    monkeypatch.setattr(torch.compiler, "disable", lambda f: lambda h: (calls.append(h.shape[1]), f(h))[1])
    block.forward = compiled.traced_forward(block)
    for seq in (MAX_PAIRS // top_k, MAX_PAIRS // top_k + 1):
        block(torch.randn(1, seq, model.config.hidden_size))
    assert calls == [MAX_PAIRS // top_k]  # the eager path for the decode-sized call only


def test_trace_moe_refuses_a_model_compiled_with_eager_blocks():
    model = hf.tiny_random_model("olmoe", seed=3, vocab_size=64, num_hidden_layers=2)
    hf.convert(model, group=None)
    hf.compile_layers(model, backend="eager")
    with pytest.raises(ValueError, match="already compiled with its MoE block eager"):
        hf.compile_layers(model, trace_moe=True, backend="eager")


def _trace_refused_worker(rank: int, world_size: int) -> str:
    model = hf.tiny_random_model("olmoe", seed=4, vocab_size=64, num_hidden_layers=2)
    hf.convert(model)
    try:
        hf.compile_layers(model, trace_moe=True, backend="eager")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_trace_moe_refuses_expert_parallel_layers_that_learn_their_sizes_at_run_time():
    from occult.distributed import run_ranks

    for out in run_ranks(_trace_refused_worker, 2, timeout_s=180):
        assert "traces one-rank and sync-free MoE layers only" in out and "expert parallel over 2 ranks" in out, out
        assert "occult.set_sync_free(model)" in out, out


def _traced_sync_free_worker(rank: int, world_size: int, seed: int, family: str, dispatcher: str) -> dict:
    """One training step of a sync-free expert-parallel model, eager then with its MoE blocks traced."""
    from torch._dynamo.utils import counters

    from occult import OccultMoE, set_sync_free

    torch.manual_seed(seed)
    model = hf.tiny_random_model(family, seed=seed % 1000, vocab_size=64, num_hidden_layers=2)
    hf.convert(model, dispatcher=dispatcher)
    set_sync_free(model)
    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    ids = torch.randint(64, (4, 128), generator=torch.Generator().manual_seed(seed + rank))  # past decode size

    def step() -> tuple[dict, list[dict]]:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return grads, [layer.last_comm_stats.as_dict() for layer in layers]

    ref, ref_stats = step()
    torch._dynamo.reset()
    counters.clear()
    # c10d's in-place all-to-all traced: on GPUs (NCCL, torch 2.11) a compiled backward lost its result (zero MoE
    # gradients, docs/training.md "GPU truth"); gloo here computes it right, so the call itself is what is counted
    in_place, original = [], torch.distributed.all_to_all_single

    def counted(*args, **kwargs):
        if torch.compiler.is_compiling():
            in_place.append(1)
        return original(*args, **kwargs)

    torch.distributed.all_to_all_single = counted
    try:
        hf.compile_layers(model, trace_moe=True, backend="aot_eager")
        got, stats = step()
    finally:
        torch.distributed.all_to_all_single = original
    errors = {n: float((got[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)) for n, g in ref.items() if n in got}
    traced = all(getattr(b, "occult_traced", False) for _, b in hf.moe_blocks(model))
    return {
        "missing": sorted(set(ref) - set(got)),
        "error": max(errors.values()),
        "traced": traced,
        "stats": stats == ref_stats,
        "breaks": [str(reason) for reason in counters["graph_break"]],
        "in_place_traced": len(in_place),
    }


# the reference expert loop's (CPU) data-dependent splits: nonzero, bincount, .item() (experts.expert_mlp_reference)
EXPERT_LOOP_BREAKS = ("Dynamic shape operator", "Data dependent operator")


@pytest.mark.parametrize("family,dispatcher", [("olmoe", "dedup"), ("deepseek_v3", "dedup"), ("olmoe", "standard")])
def test_traced_sync_free_expert_parallel_blocks_train_like_eager(family, dispatcher):
    """`trace_moe=True` on sync-free expert-parallel layers (2 gloo ranks): each MoE block, its all-to-alls
    included, traced with its decoder layer, forward and backward; the same gradients as the eager model, the
    same rows booked (the backward's with the forward), DeepSeek-V3's shared experts too; no in-place all-to-all
    traced (the functional one: c10d's in-place one lost its result in a compiled backward on GPUs); the graph
    breaks only in the CPU reference expert loop (on GPUs the Triton path traces whole:
    tests/gpu/test_collective_traced_moe.py), never at an exchange."""
    from occult.distributed import run_ranks

    for out in run_ranks(_traced_sync_free_worker, 2, random.randrange(2**31), family, dispatcher, timeout_s=400):
        assert out["traced"] and not out["missing"] and out["error"] < 1e-5, out
        assert out["stats"], out
        assert out["in_place_traced"] == 0, out  # the traced exchanges call the functional all-to-all
        assert out["breaks"], "the CPU expert loop's data-dependent splits break the graph: counted"
        others = [b for b in out["breaks"] if not b.startswith(EXPERT_LOOP_BREAKS)]
        assert not others, others
