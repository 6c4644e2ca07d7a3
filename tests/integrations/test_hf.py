"""transformers MoE models converted to expert parallelism vs the unconverted model.

Tiny random OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral and DeepSeek-V3 models (`hf.tiny_random_model`:
hidden 32, 2 MoE layers, 8-16 experts, vocab 96) are built offline, saved
with `save_pretrained` and loaded back from disk (the real loading path, including transformers'
checkpoint conversion of per-expert weights into fused tensors). Each is converted on 2 and 4
gloo ranks with a random (non-contiguous) placement, and compared in float32 with the same model
unconverted, run in every rank's process on the concatenation of all ranks' batches.

The gradient scheme: rank r feeds its own batch B_r (same shape on every rank) and takes the
model's own mean loss over it, L_r. The reference takes the mean loss over the concatenation of
all B_r, which is (1/D) sum_r L_r because every rank has the same token count. After
`sync_gradients(average=True)` a replicated parameter's gradient is (1/D) sum_r dL_r/dp (an
all-reduce: each rank saw only its own tokens), and an expert's gradient, which the all-to-all
already accumulated over every rank's tokens, is divided by D: both must equal the reference's
gradient. Expert gradients are compared on the rank that holds the expert. The losses scaled by
1/D and `sync_gradients(average=False)` must give the same gradients bit for bit (D = 2, 4).

One spawn per world size runs every family (imports dominate the run time on CPU).
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import transformers
except ImportError:
    pytest.skip("transformers is not installed (pip install 'occult[hf]')", allow_module_level=True)

from occult.distributed import RankFailure, run_ranks  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.placement import Placement  # noqa: E402

TOL = 1e-5
FAMILIES = ["olmoe", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"]
VOCAB, SEQ, BATCH = 96, 12, 2


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    dirs = {}
    for i, family in enumerate(FAMILIES):
        dirs[family] = str(root / family)
        hf.tiny_random_model(family, dirs[family], seed=i, vocab_size=VOCAB)
    return dirs


# ---------------------------------------------------------------- rank side
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.detach().abs().max().item()
    return (a.detach() - b.detach()).abs().max().item() / (denom if denom > 0 else 1.0)


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _random_placement(num_experts: int, num_layers: int, world_size: int, seed: int) -> Placement:
    rng = np.random.default_rng(seed)
    rows = [rng.permutation(np.arange(num_experts) % world_size) for _ in range(num_layers)]
    return Placement(np.stack(rows), world_size)


def _file_keys(directory: str) -> list[str]:
    from safetensors import safe_open

    keys = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                keys += list(f.keys())
    return sorted(keys)


def _load(path: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = True
    return model


def check_family(rank: int, world_size: int, family: str, path: str, out_dir: str, seed: int) -> dict:
    """All checks of one model on this rank; returns the metrics the test process asserts on."""
    import torch.distributed as dist

    res: dict = {}
    ref, model = _load(path), _load(path)
    blocks = hf.moe_blocks(ref)
    E = int(blocks[0][1].gate.num_experts)
    placement = _random_placement(E, len(blocks), world_size, seed)
    hf.convert(model, placement=placement, dispatcher="dedup")
    res["moe_layers"] = len(blocks)

    g = torch.Generator().manual_seed(seed)
    all_ids = torch.randint(3, VOCAB, (world_size * BATCH, SEQ), generator=g)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    ids = all_ids[mine]

    # 1. trace: profiling the converted model (gathered over ranks) == profiling the reference
    trace_ref = hf.profile(ref, [all_ids], scores="all", gather=False)
    trace = hf.profile(model, [ids], scores="all")
    res["trace_equal"] = all(np.array_equal(a, b) for a, b in zip(trace.topk_ids, trace_ref.topk_ids))
    res["trace_scores"] = max(float(np.abs(a - b).max()) for a, b in zip(trace.scores, trace_ref.scores))

    # 2. greedy generation, ranks with different prompt lengths (synced_gpus keeps them in step)
    prompt = all_ids[mine, : 4 + rank]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    res["generate_equal"] = bool(
        torch.equal(model.generate(prompt, synced_gpus=True, **kw), ref.generate(prompt, **kw))
    )

    # 3. logits, router logits (the model's own output recording still sees the gate), loss, gradients
    model.train(), ref.train()
    out = model(ids, output_router_logits=True)
    out_ref = ref(all_ids, output_router_logits=True)
    res["logits"] = _rel(out.logits, out_ref.logits[mine])
    rl, rl_ref = getattr(out, "router_logits", None), getattr(out_ref, "router_logits", None)
    if rl_ref is not None:
        tokens = slice(rank * BATCH * SEQ, (rank + 1) * BATCH * SEQ)
        res["router_logits"] = max(_rel(a, b[tokens]) for a, b in zip(rl, rl_ref)) if len(rl) == len(rl_ref) else 1.0
    # next-token cross-entropy, mean over this rank's tokens (the reference: over all ranks' tokens)
    loss, loss_ref = _lm_loss(out.logits, ids), _lm_loss(out_ref.logits, all_ids)
    loss.backward()
    loss_ref.backward()
    hf.sync_gradients(model)
    losses = [torch.zeros(()) for _ in range(world_size)]
    dist.all_gather(losses, loss.detach())
    res["loss"] = _rel(torch.stack(losses).mean(), loss_ref)
    ref_params = dict(ref.named_parameters())
    grads, missing = {}, []
    for name, p in model.named_parameters():
        if name not in ref_params:
            missing.append(name)
            continue
        g_ref = ref_params[name].grad
        if p.shape != ref_params[name].shape:  # this rank's experts, in local-slot order
            block = model.get_submodule(name.rsplit(".", 2)[0])
            g_ref = g_ref[block.experts.local_expert_ids]
        grads[name] = _rel(p.grad, g_ref)
    res["params_compared"], res["params_missing"] = len(grads), missing
    res["params_reference"] = len(ref_params)
    res["grad_worst"] = max(grads.items(), key=lambda kv: kv[1])
    # the same step with the loss scaled by 1/D and the gradients only summed: the same bits (D a power of two)
    averaged = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    (_lm_loss(model(ids).logits, ids) / world_size).backward()
    hf.sync_gradients(model, average=False)
    summed = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    res["scaled_sum_equal"] = sorted(summed) == sorted(averaged)
    res["scaled_sum_equal"] &= all(torch.equal(g, averaged[name]) for name, g in summed.items())

    # 4. one SGD step on both, save the converted model in the standard layout, reload it plainly
    with torch.no_grad():
        for p in (*model.parameters(), *ref.parameters()):
            if p.grad is not None:
                p -= 0.5 * p.grad
    save_dir = os.path.join(out_dir, family)
    hf.save_pretrained(model, save_dir)
    if rank == 0:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float32)
        sd, sd_ref = reloaded.state_dict(), ref.state_dict()
        res["saved_keys_equal"] = sorted(sd) == sorted(sd_ref)
        res["saved_file_keys_equal"] = _file_keys(save_dir) == _file_keys(path)  # the on-disk layout too
        res["saved_weights"] = max(_rel(sd[k], sd_ref[k]) for k in sd_ref)
        res["saved_type"] = type(reloaded.get_submodule(blocks[0][0])).__name__
        res["reference_type"] = type(blocks[0][1]).__name__
        with torch.no_grad():
            res["saved_logits"] = _rel(reloaded(all_ids).logits, ref(all_ids).logits)

    # 5. the standard (k copies) dispatcher computes the same function
    std = hf.convert(_load(path), placement=placement, dispatcher="standard")
    with torch.no_grad():
        res["standard_logits"] = _rel(std(ids).logits, _load(path)(all_ids).logits[mine])

    # 6. collaboration pruning, both variants: every token's experts on as few devices as can
    #    hold top_k of them (the limit binds: unpruned, some tokens span more devices)
    from occult.moe.pruning import devices_per_token, load_similarity

    def most_devices(t) -> int:
        return max(
            int(
                devices_per_token(
                    torch.as_tensor(ids_TK, dtype=torch.int64), torch.as_tensor(placement.expert_device(i).copy())
                ).max()
            )
            for i, ids_TK in enumerate(t.topk_ids)
        )

    top_k = int(blocks[0][1].gate.top_k)
    res["max_devices"] = -(-top_k // (E // world_size))
    res["unpruned_max_devices"] = most_devices(trace)
    sim_path = os.path.join(out_dir, f"{family}.similarity.safetensors")
    hf.profile(_load(path), [ids], similarity_path=sim_path)  # all ranks' tokens; rank 0 writes
    dist.barrier()
    similarity = load_similarity(sim_path, num_experts=E, num_layers=len(blocks))
    for method in ("score", "similarity"):
        pruned = hf.convert(
            _load(path), placement=placement, max_devices=res["max_devices"], prune_method=method, similarity=similarity
        )
        res[f"pruned_max_devices_{method}"] = most_devices(hf.profile(pruned, [ids]))
    return res


def check_all(rank: int, world_size: int, dirs: dict, out_dir: str, seed: int) -> dict:
    return {f: check_family(rank, world_size, f, dirs[f], out_dir, seed + i) for i, f in enumerate(FAMILIES)}


_RESULTS: dict[int, object] = {}


def _results(world_size: int, dirs: dict, tmp_root) -> list[dict]:
    if world_size not in _RESULTS:
        out_dir = str(tmp_root / f"saved_{world_size}")
        try:
            _RESULTS[world_size] = run_ranks(check_all, world_size, dirs, out_dir, 1234, timeout_s=600)
        except RankFailure as exc:
            _RESULTS[world_size] = exc
    got = _RESULTS[world_size]
    if isinstance(got, Exception):
        raise got
    return got  # type: ignore[return-value]


# ---------------------------------------------------------------- the tests
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world_size", [2, 4])
def test_converted_model_matches_transformers(family, world_size, model_dirs, tmp_path_factory):
    per_rank = [r[family] for r in _results(world_size, model_dirs, tmp_path_factory.getbasetemp())]
    for rank, r in enumerate(per_rank):
        where = f"{family}, rank {rank} of {world_size}"
        assert r["trace_equal"] and r["trace_scores"] < TOL, where
        assert r["generate_equal"], where
        assert r["logits"] < TOL, (where, r["logits"])
        assert r.get("router_logits", 0.0) < TOL, (where, r.get("router_logits"))
        assert r["loss"] < TOL, (where, r["loss"])
        assert not r["params_missing"] and r["params_compared"] == r["params_reference"], (where, r["params_missing"])
        assert r["grad_worst"][1] < TOL, (where, r["grad_worst"])
        assert r["scaled_sum_equal"], where
        assert r["standard_logits"] < TOL, (where, r["standard_logits"])
        assert r["max_devices"] < r["unpruned_max_devices"], where
        assert r["pruned_max_devices_score"] <= r["max_devices"], where
        assert r["pruned_max_devices_similarity"] <= r["max_devices"], where
    saved = per_rank[0]
    assert saved["saved_keys_equal"] and saved["saved_file_keys_equal"], saved
    assert saved["saved_type"] == saved["reference_type"], saved
    assert saved["saved_weights"] < TOL and saved["saved_logits"] < TOL, saved


def test_unsupported_models_raise_clear_errors():

    class Fake(torch.nn.Module):
        def __init__(self, model_type):
            super().__init__()
            self.config = type("C", (), {"model_type": model_type})()

    with pytest.raises(hf.UnsupportedModelError, match="GPT-OSS"):
        hf.model_family(Fake("gpt_oss"))
    with pytest.raises(hf.UnsupportedModelError, match="supported: deepseek_v3"):
        hf.model_family(Fake("llama"))


def test_single_process_profile_masks_padding_and_routers_match_gates(model_dirs):
    """In one process: the trace skips padded tokens, and device-limited routing with a limit
    that never binds (N = D) reproduces every family's own gate exactly."""

    for family in FAMILIES:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[family], dtype=torch.float32)
        ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, 7:] = 0
        trace = hf.profile(model, [{"input_ids": ids, "attention_mask": mask}], scores="topk")
        assert trace.num_tokens == [2 * SEQ - 5] * len(hf.moe_blocks(model)), family
        x = torch.randn(40, model.config.hidden_size)
        for _, block in hf.moe_blocks(model):
            router = hf.FAMILIES[family].router(block.gate, max_devices=4)
            E = router.num_experts
            router.set_expert_device(torch.arange(E) % 4)
            _, w_ref, ids_ref = block.gate(x)
            w, got = router(x)
            order, order_ref = got.sort(dim=1).indices, ids_ref.sort(dim=1).indices
            assert torch.equal(got.gather(1, order), ids_ref.gather(1, order_ref)), family
            assert torch.allclose(w.gather(1, order), w_ref.gather(1, order_ref), rtol=1e-6, atol=0), family


def test_cli_profile_then_place(model_dirs, tmp_path):
    """`occult profile --model HF_DIR --data ...` writes a trace and similarity table that
    `occult place` and `convert(prune_method="similarity")` accept."""
    from occult.cli import main
    from occult.moe.pruning import load_similarity
    from occult.placement.trace import read_trace

    ids = np.random.default_rng(0).integers(3, VOCAB, size=(40, 16))
    np.save(tmp_path / "ids.npy", ids)
    trace_path, placement_path = tmp_path / "trace.safetensors", tmp_path / "placement.json"
    args = [
        "profile",
        "--model",
        model_dirs["qwen2_moe"],
        "--data",
        str(tmp_path / "ids.npy"),
        "--tokens",
        "500",
        "--seq-len",
        "16",
        "--out",
        str(trace_path),
        "--scores",
    ]
    assert main(args) == 0
    trace = read_trace(trace_path)
    assert trace.num_layers == 2 and trace.num_tokens == [500, 500] and trace.scores[0].shape == (500, 8)
    assert trace.metadata["model_type"] == "qwen2_moe"
    assert len(load_similarity(tmp_path / "trace.similarity.safetensors", num_experts=8, num_layers=2)) == 2
    assert (
        main(
            [
                "place",
                "--trace",
                str(trace_path),
                "--devices",
                "2",
                "--method",
                "greedy",
                "--out",
                str(placement_path),
                "--json",
            ]
        )
        == 0
    )
    placement = Placement.load(placement_path)
    assert placement.num_layers == 2 and placement.num_devices == 2
    assert main(["profile", "--model", model_dirs["qwen2_moe"], "--out", str(trace_path)]) == 2  # no --data


@pytest.mark.parametrize("top_k", [0, -1, 9])
def test_a_gate_top_k_outside_the_experts_is_refused_by_profile_and_convert(top_k):
    """A config whose experts per token is not 1..E (the fuzzer's find: -1 reached torch.topk as a
    raw RuntimeError) is refused clearly before any forward, by profile and by convert."""
    model = hf.tiny_random_model("olmoe", seed=0, vocab_size=VOCAB)
    for _, block in hf.moe_blocks(model):
        block.gate.top_k = top_k
    ids = torch.randint(3, VOCAB, (1, 8))
    with pytest.raises(hf.UnsupportedModelError, match=f"top_k={top_k} of 8 experts.*num_experts_per_tok"):
        hf.profile(model, [ids], gather=False)
    with pytest.raises(hf.UnsupportedModelError, match=r"\(num_experts_per_tok\) must be 1\.\.8"):
        hf.convert(model)


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_replicated_parameters_are_all_but_the_experts_and_the_complete_ones(family):
    """What a gradient sync all-reduces (`hf.sync_gradients`, e2e.py's bucketed sync): every trained parameter but the
    experts and those named complete, in the model's order; a frozen one is left out."""
    model = hf.tiny_random_model(family, seed=random.randrange(1000), vocab_size=64, num_hidden_layers=2)
    hf.convert(model, group=None)
    embed = model.get_input_embeddings().weight
    frozen = model.model.norm.weight
    frozen.requires_grad_(False)
    experts = {id(p) for p in hf.expert_parameters(model)}
    assert len(experts) == 2 * len(hf.moe_blocks(model))
    expected = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
    got = hf.replicated_parameters(model)
    assert [id(p) for p in got] == [id(p) for p in expected]
    assert id(embed) in {id(p) for p in got} and id(frozen) not in {id(p) for p in got}
    with_complete = hf.replicated_parameters(model, complete=[embed])
    assert [id(p) for p in with_complete] == [id(p) for p in expected if p is not embed]
