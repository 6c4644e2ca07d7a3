"""An OLMoE-1B-7B-shape transformers model in bf16, converted on every GPU over NCCL (issue 13's crash).

16 layers, hidden 2048, 64 experts of 1024, top-8, vocab 50304, random bf16 weights (routers drawn
wider than the default init so routing is separated, as a trained router's is), 2048 tokens per
GPU. Both dispatchers, forward and backward, against the unconverted bf16 model holding the same
weights. The reference runs in bf16 too (an fp32 copy would need 28 GB more per GPU), so errors are
those of two bf16 computations; logits are judged per token (see test_collective_hf.py).
With `OCCULT_GPU_SUITE_ON_CPU=1` the same checks run at a small shape.

Each layer keeps the OLMoE-1B-7B shape, but the number of layers is sized to the GPU memory free
per rank (`fitting_layers`: ranks sharing one GPU, as two gloo ranks on one 80 GB H100 do, split
it): all 16 on an H200 or with one rank per H100, fewer where they would not fit (the result
records `layers`), and a skip saying why where not even 2 fit.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'occult[hf]')")

from occult.integrations import hf  # noqa: E402

ON_CPU = os.environ.get("OCCULT_GPU_SUITE_ON_CPU", "0") == "1"

OLMOE_1B_7B = dict(
    vocab_size=50304,
    hidden_size=2048,
    intermediate_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_experts=64,
    num_experts_per_tok=8,
)
SMALL = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=16,
    num_experts_per_tok=4,
)
BATCH, SEQ = (2, 64) if ON_CPU else (2, 1024)
MEDIAN, P95, LOSS, GRAD = 2e-2, 1e-1, 1e-2, 8e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


GB = 1e9
FIXED_GB = 6.0  # CUDA context and allocator slack, embeddings + lm_head of both models, float32 logits and grads
ACTIVATIONS_GB_PER_LAYER = 0.8  # both models' saved activations of one layer at 2048 tokens (generous)


def layer_bytes(shape: dict, world_size: int) -> float:
    """One decoder layer's bytes on one rank: bf16 weights + grads of the reference (every expert)
    and of the converted model (E/D experts), plus activations."""
    h, f, e = shape["hidden_size"], shape["intermediate_size"], shape["num_experts"]
    dense = 4 * h * h + e * h  # attention + router
    params = (e * 3 * h * f + dense) + (e // world_size * 3 * h * f + dense)
    return 2 * 2 * params + ACTIVATIONS_GB_PER_LAYER * GB


def fitting_layers(free_bytes: float, ranks_on_gpu: int, shape: dict, world_size: int) -> int:
    """Decoder layers (at most the model's) that fit in 90% of this rank's share of the free memory."""
    share = 0.9 * free_bytes / max(1, ranks_on_gpu) - FIXED_GB * GB
    return max(0, min(shape["num_hidden_layers"], int(share // layer_bytes(shape, world_size))))


def _sized_shape(ranks) -> dict:
    """OLMOE_1B_7B with as many layers as every rank's share of its GPU holds (the same on every rank)."""
    torch.cuda.empty_cache()
    dist.barrier()
    on_gpu = torch.zeros(torch.cuda.device_count(), dtype=torch.float64, device=ranks.device)
    on_gpu[ranks.device.index or 0] = 1.0
    dist.all_reduce(on_gpu)  # ranks per GPU (all_reduce: what the suite's other checks use, NCCL and gloo)
    sharing = int(on_gpu[ranks.device.index or 0].item())
    free, _ = torch.cuda.mem_get_info(ranks.device)
    layers = torch.tensor([fitting_layers(free, sharing, OLMOE_1B_7B, ranks.world_size)], device=ranks.device)
    dist.all_reduce(layers, op=dist.ReduceOp.MIN)
    n = int(layers.item())
    if n < 2:
        need = (FIXED_GB * GB + 2 * layer_bytes(OLMOE_1B_7B, ranks.world_size)) / GB / 0.9
        pytest.skip(
            f"OLMoE-1B-7B shape: 2 layers need ~{need:.0f} GB per rank, this rank has {free / GB:.0f} GB free "
            f"on a GPU shared by {sharing} rank(s)"
        )
    return dict(OLMOE_1B_7B, num_hidden_layers=n)


def _build(ranks) -> torch.nn.Module:
    shape = SMALL if ON_CPU else _sized_shape(ranks)
    if ranks.rank == 0 and not ON_CPU:
        print(
            f"\n[olmoe-1b-7b shape] {shape['num_hidden_layers']} of {OLMOE_1B_7B['num_hidden_layers']} layers "
            "(sized to the free GPU memory per rank)"
        )
    cfg = transformers.OlmoeConfig(
        **shape, norm_topk_prob=False, max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0
    )
    torch.manual_seed(ranks.seed)
    with torch.device(ranks.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for _, block in hf.moe_blocks(model):
            torch.nn.init.normal_(block.gate.weight, std=0.05 * (2048 / cfg.hidden_size) ** 0.5)
        for p in model.parameters():  # one model on every rank, whatever each GPU's generator did
            dist.broadcast(p, src=0)
    return model


@pytest.fixture(scope="module")
def reference(ranks):
    return _build(ranks)


@pytest.mark.parametrize("dispatcher", ["dedup", "standard"])
def test_olmoe_1b_7b_shape_bf16_forward_backward(ranks, reference, dispatcher):
    D, rank, dev = ranks.world_size, ranks.rank, ranks.device
    model = hf.convert(copy.deepcopy(reference), dispatcher=dispatcher)
    gen = torch.Generator().manual_seed(ranks.seed + 1 + rank)
    ids = torch.randint(3, reference.config.vocab_size, (BATCH, SEQ), generator=gen).to(dev)

    def loss_of(m):
        logits = m(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        return logits.detach(), loss.detach()

    reference.zero_grad(set_to_none=True)
    logits, loss = loss_of(model)
    logits_ref, loss_ref = loss_of(reference)
    hf.sync_gradients(model)

    a, b = logits.double().flatten(0, 1), logits_ref.double().flatten(0, 1)
    token_err = (a - b).norm(dim=-1) / b.norm(dim=-1)
    first, last = hf.moe_blocks(model)[0][1], hf.moe_blocks(model)[-1][1]
    first_ref, last_ref = hf.moe_blocks(reference)[0][1], hf.moe_blocks(reference)[-1][1]
    pairs = {
        "layer0.gate_up_proj": (
            first.experts.gate_up_proj,
            first_ref.experts.gate_up_proj,
            first.experts.local_expert_ids,
        ),
        "layerN.down_proj": (last.experts.down_proj, last_ref.experts.down_proj, last.experts.local_expert_ids),
        "layer0.router": (first.gate.weight, first_ref.gate.weight, None),
        "embed_tokens": (model.get_input_embeddings().weight, reference.get_input_embeddings().weight, None),
        "lm_head": (model.lm_head.weight, reference.lm_head.weight, None),
    }
    grads = {}
    for name, (p, p_ref, local) in pairs.items():
        g_ref = p_ref.grad.float()
        dist.all_reduce(g_ref)
        g_ref /= D
        grads[name] = _rel(p.grad.float(), g_ref if local is None else g_ref[local])
    losses = torch.stack([loss, loss_ref]).double()
    dist.all_reduce(losses)
    result = {
        "dispatcher": dispatcher,
        "ranks": D,
        "tokens_per_rank": BATCH * SEQ,
        "layers": reference.config.num_hidden_layers,
        "median_token": ranks.all_max(token_err.median().item()),
        "p95_token": ranks.all_max(token_err.quantile(0.95).item()),
        "loss": abs(losses[0] - losses[1]).item() / abs(losses[1]).item(),
        **{f"grad_{k}": ranks.all_max(v) for k, v in grads.items()},
        "finite": bool(ranks.all_max(0.0 if torch.isfinite(logits).all() else 1.0) == 0.0),
    }
    out = os.environ.get("OCCULT_GPU_SUITE_OUT")
    if out and rank == 0:
        with open(os.path.join(out, f"olmoe_scale_{dispatcher}.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n[olmoe-1b-7b shape] {result}")
    assert result["finite"], result
    assert result["median_token"] < MEDIAN and result["p95_token"] < P95, result
    assert result["loss"] < LOSS, result
    assert max(v for k, v in result.items() if k.startswith("grad_")) < GRAD, result
    del model
    reference.zero_grad(set_to_none=True)
