"""`occult finetune --hf` on 1 and 2 GPUs (scripts/two_gpu_training.sh, issue 38):

make DIR [tiny]      a random-weights OLMoE-shape model (4 layers, hidden 1024, 64 experts x 512 top-8,
                     vocabulary 8192) saved with save_pretrained; "tiny": the CLI tests' tiny shape
check ROOT OUT.json  steps/s of ROOT/ft1 (1 GPU) and ROOT/ft2 (2 GPUs) from their metrics.json; the
                     2-GPU model loaded by plain transformers against the same weights converted by
                     occult (one rank): max relative logit error; and the 1- vs 2-GPU fine-tunes' weights
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from occult.tools.run_record import run_record

OLMOE_SMALL = dict(
    num_hidden_layers=4,
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=16,
    intermediate_size=512,
    num_experts=64,
    num_experts_per_tok=8,
    vocab_size=8192,
    max_position_embeddings=2048,
)


def make(path: str, tiny: bool) -> None:
    """Save the random model to `path`."""
    from occult.integrations.hf.tiny import tiny_random_model

    tiny_random_model("olmoe", path, **({"vocab_size": 300} if tiny else OLMOE_SMALL))
    print(f"wrote {path}")


def steps_per_s(run: Path) -> dict[str, Any]:
    m = json.loads((run / "metrics.json").read_text())
    tokens = m["config"]["batch_size"] * m["config"]["seq_len"]
    return {
        "world_size": m["world_size"],
        "tokens_per_s": m["tokens_per_s"],
        "steps_per_s": m["tokens_per_s"] / tokens,
        "losses": m["losses"],
    }


def logit_error(model_dir: Path) -> dict[str, Any]:
    """Plain transformers vs occult's conversion of the same saved weights, on one device, fp32."""
    import transformers

    from occult.integrations import hf

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
    occ = hf.convert(
        transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval(),
        group=None,
        dispatcher="dedup",
    )
    ids_BS = torch.randint(0, plain.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        ref_BSV, got_BSV = plain(ids_BS).logits.float(), occ(ids_BS).logits.float()
    rel_BS = (got_BSV - ref_BSV).norm(dim=-1) / ref_BSV.norm(dim=-1)
    return {
        "logits_max_rel_err": rel_BS.max().item(),
        "logits_median_rel_err": rel_BS.median().item(),
        "tokens": ids_BS.numel(),
        "precision": "fp32",
        "device": str(dev),
    }


def weight_diff(a_dir: Path, b_dir: Path) -> float:
    """Max over tensors of max |a - b| / max |a| between two saved models."""
    from safetensors.torch import load_file

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    a, b = tensors(a_dir), tensors(b_dir)
    if a.keys() != b.keys():
        raise ValueError(f"{a_dir} and {b_dir} hold different tensors")
    return max(
        ((a[k].float() - b[k].float()).abs().max() / a[k].float().abs().max().clamp_min(1e-30)).item() for k in a
    )


def check(root: Path, dest: Path) -> None:
    one, two = steps_per_s(root / "ft1"), steps_per_s(root / "ft2")
    doc = {
        "one_gpu": one,
        "two_gpus": two,
        "speedup_steps_per_s": two["steps_per_s"] / one["steps_per_s"],
        "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(two["losses"], one["losses"])),
        "saved_weights_max_rel_diff_1_vs_2": weight_diff(root / "ft1" / "model", root / "ft2" / "model"),
        "plain_transformers_vs_occult": logit_error(root / "ft2" / "model"),
        # where and from what code: run right after the two fine-tunes, on their machine
        "env": {
            "world_size": 2,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            **run_record(2, torch.cuda.is_available()),
        },
    }
    dest.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k not in ("one_gpu", "two_gpus")}, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("make", "check"):
        sys.exit(__doc__)
    if sys.argv[1] == "make":
        make(sys.argv[2], tiny=sys.argv[3:] == ["tiny"])
    else:
        check(Path(sys.argv[2]), Path(sys.argv[3]))
