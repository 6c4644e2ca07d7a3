"""transformers MoE models converted on every GPU over NCCL, in bf16 (and fp32), vs the unconverted model.

Tiny random OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral and DeepSeek-V3 models (`hf.tiny_random_model`)
are converted with a random placement, each rank feeding its own batch. The reference is the
unconverted model holding the same weights, in fp32, run on every rank on all ranks' batches
(gradient scheme: tests/integrations' CPU test; `hf.sync_gradients` averages over ranks).

In fp32 the converted model must match to 1e-4. In bf16 the arithmetic is rounded and routing
may break a near-tie the other way on a few tokens (a legitimate half-precision difference that
moves those tokens' outputs by a lot), so logits are judged per token: the median token's and
the 95th-percentile token's relative errors must stay under fixed bounds or twice what the
unconverted model in bf16 shows against the same fp32 reference, whichever is larger. A wrong
expert, gate or row would put most tokens far off.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'occult[hf]')")

from occult import Placement  # noqa: E402
from occult.integrations import hf  # noqa: E402

FAMILIES = ["olmoe", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"]
VOCAB, SEQ, BATCH = 96, 16, 8
FP32_TOL = 1e-4
# BF16_GRAD: or OWN_FACTOR x the unconverted bf16 model's own error. In bf16 a near-tied router logit
# can pick another expert in the converted model than in the unconverted one (the MoE outputs
# feeding the next layer differ in rounding), which moves sums like a layernorm weight's gradient:
# such flips gave 3.3x and 3.6x (one tensor of ~100, in 2 of 6 suite runs: mixtral, qwen3_moe) and
# 5.06x (olmoe: a layer-1 router and the norm before it, 0.149 against the unconverted model's 0.030);
# a wrong gradient is off by O(1).
BF16_MEDIAN, BF16_P95, BF16_GRAD, OWN_FACTOR = 2e-2, 1e-1, 3e-2, 8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def _token_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.detach().double().flatten(0, -2), b.detach().double().flatten(0, -2)
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
    )


def _random_placement(num_experts: int, num_layers: int, world_size: int, seed: int) -> Placement:
    rng = np.random.default_rng(seed)
    return Placement(
        np.stack([rng.permutation(np.arange(num_experts) % world_size) for _ in range(num_layers)]), world_size
    )


def _shared_tmpdir(ranks) -> str:
    box = [tempfile.mkdtemp(prefix="occult_gpu_hf_") if ranks.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@pytest.fixture(scope="module")
def shared_dir(ranks):
    path = _shared_tmpdir(ranks)
    yield path
    dist.barrier()
    if ranks.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_matches_unconverted(ranks, family, dtype_name, shared_dir):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    D, rank, dev = ranks.world_size, ranks.rank, ranks.device
    seed = ranks.seed + FAMILIES.index(family)
    where = f"{family}/{dtype_name} seed {seed}"

    base = hf.tiny_random_model(family, seed=seed, vocab_size=VOCAB).to(dev, dtype)
    reference = copy.deepcopy(base).float()  # the very weights the converted model holds, in fp32
    same_dtype_reference = copy.deepcopy(base)
    blocks = hf.moe_blocks(base)
    E = int(blocks[0][1].gate.weight.shape[0])
    model = hf.convert(copy.deepcopy(base), placement=_random_placement(E, len(blocks), D, seed), dispatcher="dedup")

    gen = torch.Generator().manual_seed(seed)
    all_ids = torch.randint(3, VOCAB, (D * BATCH, SEQ), generator=gen).to(dev)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    ids = all_ids[mine]

    # logits, loss and every gradient; the unconverted model in the same dtype says how far that
    # dtype alone lands from the fp32 reference (router gradients in bf16 are far off by themselves)
    model.train(), reference.train(), same_dtype_reference.train()
    logits = model(ids).logits
    logits_ref = reference(all_ids).logits
    loss, loss_ref = _lm_loss(logits, ids), _lm_loss(logits_ref, all_ids)
    loss.backward()
    loss_ref.backward()
    logits_same = same_dtype_reference(all_ids).logits
    _lm_loss(logits_same, all_ids).backward()
    hf.sync_gradients(model)
    token_err = _token_errors(logits, logits_ref[mine])
    ref_params, same_params = dict(reference.named_parameters()), dict(same_dtype_reference.named_parameters())
    over, compared, worst = {}, 0, 0.0
    for name, p in model.named_parameters():
        g_ref, g_same = ref_params[name].grad, same_params[name].grad
        if g_ref is None or p.grad is None:
            assert (g_ref is None or not g_ref.any()) and (p.grad is None or not p.grad.any()), (where, name)
            continue
        if p.shape != g_ref.shape:  # this rank's experts, in local-slot order
            local = model.get_submodule(name.rsplit(".", 2)[0]).experts.local_expert_ids
            g_ref, g_same = g_ref[local], g_same[local]
        err, own = _rel(p.grad.float(), g_ref), _rel(g_same.float(), g_ref)
        bound = FP32_TOL if dtype == torch.float32 else max(BF16_GRAD, OWN_FACTOR * own)
        worst = max(worst, err)
        if err > bound:
            over[name] = (err, bound)
        compared += 1
    assert compared == len(ref_params) - sum(p.grad is None for p in reference.parameters()), where
    same_err = _token_errors(logits_same[mine], logits_ref[mine])
    median, p95 = ranks.all_max(token_err.median().item()), ranks.all_max(token_err.quantile(0.95).item())
    median_same, p95_same = ranks.all_max(same_err.median().item()), ranks.all_max(same_err.quantile(0.95).item())
    assert ranks.all_max(float(len(over))) == 0, (where, "gradients off", over)
    if dtype == torch.float32:
        assert ranks.all_max(token_err.max().item()) < FP32_TOL, (where, token_err.max().item())
    else:
        assert median < max(BF16_MEDIAN, 2 * median_same) and p95 < max(BF16_P95, 2 * p95_same), (
            where,
            f"median {median:.3g}, p95 {p95:.3g}; unconverted bf16: median {median_same:.3g}, p95 {p95_same:.3g}",
        )

    # greedy generation with a KV cache, ranks with different prompt lengths, vs the unconverted
    # model in the same dtype: equal, or apart only after a step the reference itself calls a near-tie
    model.eval(), same_dtype_reference.eval()
    prompt = ids[:, : 4 + rank]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(prompt, synced_gpus=True, **kw)
        ref_out = same_dtype_reference.generate(prompt, output_scores=True, return_dict_in_generate=True, **kw)
    if not torch.equal(got, ref_out.sequences):
        differs = (got != ref_out.sequences).any(dim=0).nonzero()
        step = int(differs[0]) - prompt.shape[1]
        scores = ref_out.scores[step].float()
        top2 = scores.topk(2, dim=-1).values
        gap = (top2[:, 0] - top2[:, 1]).min().item()
        assert dtype != torch.float32 and gap < 0.05 * scores.abs().max().item(), (where, "generate differs", step, gap)

    # save in the standard layout; a plain transformers load gives back the same weights
    out_dir = os.path.join(shared_dir, f"{family}_{dtype_name}")
    hf.save_pretrained(model, out_dir)
    if rank == 0:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype).to(dev)
        sd, sd_ref = reloaded.state_dict(), base.state_dict()
        assert sorted(sd) == sorted(sd_ref), where
        # the converted model took no optimizer step: the saved weights are the loaded ones, bit for bit
        assert all(torch.equal(sd[k], sd_ref[k]) for k in sd_ref), where
        assert type(reloaded.get_submodule(blocks[0][0])) is type(blocks[0][1]), where
    # the fine-tuning save: one shard per MoE layer from its owner rank, the same tensors
    hf.save_finetuned(model, out_dir + "_ft")
    if rank == 0:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir + "_ft", dtype=dtype).to(dev)
        sd = reloaded.state_dict()
        assert sorted(sd) == sorted(sd_ref) and all(torch.equal(sd[k], sd_ref[k]) for k in sd_ref), (
            where,
            "save_finetuned",
        )
    dist.barrier()


def test_generate_over_the_device_transport(ranks):
    """`hf.generate` of a model converted with `transport="device"` (prefill and decode over it, the
    decode step captured in a CUDA graph) returns the tokens of the same model over the count
    exchange (decode sync-free), with different prompt lengths and batches per rank."""
    from occult import ExecConfig
    from occult.moe.symm import unavailable_reason

    reason = unavailable_reason(dist.group.WORLD)
    if reason:
        pytest.skip(f"device transport: {reason}")
    D, rank, dev = ranks.world_size, ranks.rank, ranks.device
    seed = ranks.seed + 101
    base = hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB).to(dev, torch.float32).eval()
    E = int(hf.moe_blocks(base)[0][1].gate.weight.shape[0])
    placement = _random_placement(E, len(hf.moe_blocks(base)), D, seed)
    models = {
        t: hf.convert(copy.deepcopy(base), placement=placement, dispatcher="dedup", execution=ExecConfig(transport=t))
        for t in ("device", "counts")
    }
    gen = torch.Generator().manual_seed(seed + rank)
    ids = torch.randint(3, VOCAB, (1 + rank, 5 + 3 * rank), generator=gen).to(dev)
    out = {
        t: hf.generate(m, ids, 6, cuda_graph=(t == "device"), eos_token_id=[], reuse=False) for t, m in models.items()
    }
    eager = hf.generate(models["device"], ids, 6, cuda_graph=False, eos_token_id=[], reuse=False)
    same = float(torch.equal(out["device"], out["counts"]) and torch.equal(eager, out["counts"]))
    assert ranks.all_max(1.0 - same) == 0.0, (out, eager)


def test_graphed_forward_over_the_device_transport(ranks):
    """`hf.GraphedForward` of a model over the device transport: each replay with fresh ids gives the
    eager forward's last-position logits (fp32, the same kernels: within 1e-5), also after an eager
    call of another shape between replays; a wrong shape is a ValueError."""
    from occult import ExecConfig
    from occult.moe.symm import unavailable_reason

    reason = unavailable_reason(dist.group.WORLD)
    if reason:
        pytest.skip(f"device transport: {reason}")
    D, dev = ranks.world_size, ranks.device
    seed = ranks.seed + 202
    base = hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB).to(dev, torch.float32).eval()
    E = int(hf.moe_blocks(base)[0][1].gate.weight.shape[0])
    model = hf.convert(
        base,
        placement=_random_placement(E, len(hf.moe_blocks(base)), D, seed),
        dispatcher="dedup",
        execution=ExecConfig(transport="device"),
    )
    gen = torch.Generator().manual_seed(seed + ranks.rank)
    graphed = hf.GraphedForward(model, 3, 7)
    worst = 0.0
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(3, VOCAB, (3, 7), generator=gen).to(dev)
            got = graphed(ids).clone()
            eager = model(input_ids=ids, use_cache=False).logits[:, -1]
            worst = max(worst, _rel(got, eager))
            model(input_ids=torch.randint(3, VOCAB, (5, 40), generator=gen).to(dev), use_cache=False)
    with pytest.raises(ValueError, match="captured for"):
        graphed(torch.zeros(2, 7, dtype=torch.long, device=dev))
    graphed.release()
    assert ranks.all_max(worst) < 1e-5, worst


@pytest.mark.parametrize("parts", [2, 3])
def test_graphed_forward_as_interleaved_micro_batches(ranks, parts):
    """`hf.GraphedForward(micro_batches=parts)` of a sync-free model whose layers have graphs of their own
    (as `compile_layers` sets them; a micro-batch never records one): the batch's parts interleaved at every
    exchange (`parts` threads, as many streams of one capture) give the eager forward's logits (fp32: within
    1e-5) replay after replay, and no layer recorded a graph; a batch `parts` does not divide is refused. Over
    gloo (ranks sharing a GPU) the capture is refused up front, and the layers still run."""
    from occult import ExecConfig, OccultMoE, set_sync_free

    if ranks.device.type != "cuda":
        pytest.skip("CUDA graphs need GPUs")
    D, dev = ranks.world_size, ranks.device
    seed = ranks.seed + 203
    base = hf.tiny_random_model("olmoe", seed=seed, vocab_size=VOCAB).to(dev, torch.float32).eval()
    E = int(hf.moe_blocks(base)[0][1].gate.weight.shape[0])
    placement = _random_placement(E, len(hf.moe_blocks(base)), D, seed)
    execution = ExecConfig(transport="counts", graphs=True)  # the layers' own graphs: off inside the halves
    model = hf.convert(base, placement=placement, dispatcher="dedup", execution=execution)
    set_sync_free(model, True)
    if ranks.backend != "nccl":  # gloo's collectives run on the host: refused before any capture, CUDA intact
        with pytest.raises(ValueError, match="cannot record"):
            hf.GraphedForward(model, 2 * parts, 9, micro_batches=parts)
        with torch.no_grad():
            assert torch.isfinite(model(input_ids=torch.full((2, 5), 3, device=dev), use_cache=False).logits).all()
        return
    with pytest.raises(ValueError, match="and divide the batch"):
        hf.GraphedForward(model, parts + 1, 7, micro_batches=parts)
    gen = torch.Generator().manual_seed(seed + ranks.rank)
    batch = 2 * parts
    graphed = hf.GraphedForward(model, batch, 9, micro_batches=parts)
    recorded = sum(len(m.graphs) for m in model.modules() if isinstance(m, OccultMoE))  # before any eager call
    worst = 0.0
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(3, VOCAB, (batch, 9), generator=gen).to(dev)
            got = graphed(ids).clone()
            worst = max(worst, _rel(got, model(input_ids=ids, use_cache=False).logits[:, -1]))
    graphed.release()
    assert ranks.all_max(worst) < 1e-5, worst
    assert recorded == 0, recorded
