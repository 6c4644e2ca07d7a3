"""`hf.save_finetuned` on N ranks: each layer's experts written by one rank, never the whole model on one.

One spawn of 2 gloo ranks loads each of the five families expert-parallel (`load_sharded`, a
non-contiguous placement, experts perturbed so a save of the source weights cannot pass), saves
it in the model's dtype and in bf16, and reports what it wrote. The parent reloads every directory
with plain transformers and compares it, tensor by tensor, with the checkpoint the model's own
`save_pretrained` writes for the same weights in one process: the same keys, the same values
(bit for bit; bf16 = the fp32 weights rounded, but for what transformers keeps in fp32).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from occult.distributed import run_ranks  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.placement import Placement  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

FAMILIES = ["olmoe", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"]


def _placement(num_experts: int, layers: int, seed: int) -> Placement:
    g = np.random.default_rng(seed)
    rows = [g.permutation(np.repeat([0, 1], num_experts // 2)) for _ in range(layers)]
    return Placement(np.array(rows), 2)


def _shape(model) -> tuple[int, int]:
    """(experts per layer, MoE layers) of a transformers model."""
    blocks = hf.moe_blocks(model)
    return int(blocks[0][1].experts.gate_up_proj.shape[0]), len(blocks)


def _perturb(model) -> None:
    """Change every expert and router weight (deterministically per expert id, so every rank agrees)."""
    with torch.no_grad():
        for _, block in hf.moe_blocks(model):
            ids = block.experts.local_expert_ids.to(torch.float32)
            block.experts.gate_up_proj.add_(0.01 * (1 + ids)[:, None, None])
            block.experts.down_proj.mul_(-1.0)
            block.gate.weight.add_(0.5)


def save_all(rank: int, world_size: int, dirs: dict, shapes: dict, root: str) -> dict:
    res = {}
    for family in FAMILIES:
        model = hf.load_sharded(dirs[family], placement=_placement(*shapes[family], 5))
        _perturb(model)
        for tag, dtype in (("same", None), ("bf16", torch.bfloat16)):
            hf.save_finetuned(model, os.path.join(root, f"{family}_{tag}"), source=dirs[family], dtype=dtype)
        res[family] = sorted(os.listdir(os.path.join(root, f"{family}_same")))
    # hf.save_pretrained: the same writer, replacing an existing directory; with extra arguments
    # for the model's own save_pretrained, the gathering path (rank 0 writes)
    hf.save_pretrained(model, os.path.join(root, "pre"))
    _perturb(model)
    hf.save_pretrained(model, os.path.join(root, "pre"))  # replaced, not merged
    hf.save_pretrained(model, os.path.join(root, "pre_kw"), max_shard_size="20KB")
    # a layer that rank 1 cannot write (e.g. no shared filesystem): every rank raises, nothing is left
    from occult.integrations.hf import save as save_module

    real = save_module._write_layer
    if rank == 1:

        def fail(*args):
            raise FileNotFoundError("simulated: the temporary directory is not visible on this rank")

        save_module._write_layer = fail
    try:
        hf.save_finetuned(model, os.path.join(root, "failed"))
        res["failed"] = "no error"
    except OSError as exc:
        res["failed"] = str(exc)
    finally:
        save_module._write_layer = real
    return res


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_save")
    dirs, shapes = {}, {}
    for i, family in enumerate(FAMILIES):
        dirs[family] = str(root / f"src_{family}")
        shapes[family] = _shape(hf.tiny_random_model(family, dirs[family], seed=10 + i, vocab_size=64))
    listing = run_ranks(save_all, 2, dirs, shapes, str(root), timeout_s=600, collective_timeout_s=120)
    return {"root": str(root), "dirs": dirs, "shapes": shapes, "listing": listing}


def _reference(src: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The same perturbed weights in one process (all experts local; the perturbation depends on
    expert ids only), the model's own blocks put back."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.convert(model)
    _perturb(model)
    hf.unconvert(model)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _files(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_save_equals_save_pretrained(saved, family, tmp_path):
    root, src = saved["root"], saved["dirs"][family]
    model, want = _reference(src)
    model.save_pretrained(str(tmp_path / "ref"))
    ref_files = _files(str(tmp_path / "ref"))
    got_files = _files(os.path.join(root, f"{family}_same"))
    assert got_files.keys() == ref_files.keys()  # the checkpoint names transformers writes
    for key, t in ref_files.items():
        assert got_files[key].dtype == t.dtype and torch.equal(got_files[key], t), key
    for rank_listing in saved["listing"]:  # every rank saw the same directory
        assert rank_listing[family] == saved["listing"][0][family]
    moe_layers = saved["shapes"][family][1]
    assert sum(n.endswith(".safetensors") for n in saved["listing"][0][family]) == 1 + moe_layers
    # reloads with plain transformers, in the saved dtype
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(root, f"{family}_same"), dtype=torch.float32
    )
    for key, t in reloaded.state_dict().items():
        assert torch.equal(t, want[key]), key
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, f"{family}_bf16"))
    assert json.loads(open(os.path.join(root, f"{family}_bf16", "config.json")).read())["dtype"] == "bfloat16"
    for key, t in bf16.state_dict().items():
        if t.is_floating_point():
            assert t.dtype in (torch.bfloat16, torch.float32), key
            assert torch.equal(t, want[key].to(t.dtype)), key
    assert "tokenizer.json" not in os.listdir(os.path.join(root, f"{family}_same"))  # tiny models ship none


def test_save_pretrained_replaces_and_takes_save_pretrained_arguments(saved):
    root = saved["root"]
    pre, kw = _files(os.path.join(root, "pre")), _files(os.path.join(root, "pre_kw"))
    assert pre.keys() == kw.keys() and all(torch.equal(pre[k], kw[k]) for k in pre)  # two writers, one model
    first = _files(os.path.join(root, "deepseek_v3_same"))  # the same model before its second perturbation
    assert any(not torch.equal(pre[k], first[k]) for k in pre)  # the second save replaced the first
    assert sum(n.endswith(".safetensors") for n in os.listdir(os.path.join(root, "pre_kw"))) > 2  # its own sharding
    assert not [n for n in os.listdir(root) if n.startswith(".pre.")]  # nothing left beside it


def test_a_failed_part_is_an_error_on_every_rank(saved):
    for res in saved["listing"]:
        assert "rank 1: FileNotFoundError: simulated" in res["failed"], res["failed"]
    assert not [n for n in os.listdir(saved["root"]) if n == "failed" or n.startswith(".failed.")]


def test_bad_output_is_an_error_on_one_process(tmp_path, saved):
    model = hf.load_sharded(saved["dirs"]["olmoe"])
    (tmp_path / "taken").mkdir()
    with pytest.raises(OSError, match="FileExistsError: .*already exists"):
        hf.save_finetuned(model, tmp_path / "taken")
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no temporary directory left
    hf.save_finetuned(model, tmp_path / "new")
    assert (tmp_path / "new" / "model.safetensors.index.json").is_file()
