"""Hugging Face transformers MoE models on `OccultMoE`: profile, convert, save back.

Supported (transformers >= 5.17, < 6; see `SUPPORTED_TRANSFORMERS`): OLMoE, Qwen2-MoE, Qwen3-MoE,
Mixtral and DeepSeek-V3, whose MoE blocks hold a gate returning
`(router_logits, top_k_weights, top_k_index)` and fused SwiGLU experts `experts.gate_up_proj`
[E, 2F, H] (gate rows, then up rows) and `experts.down_proj` [E, H, F] -- the layout
`OccultMoE` uses. GPT-OSS is not supported: its experts carry biases and a clamped, interleaved
SwiGLU that the occult expert kernels do not compute.

    trace = profile(model, batches)                          # routing trace of every MoE layer
    placement = place(trace, num_devices).placement          # occult.placement.solvers / `occult place`
    convert(model, placement=placement)                      # on every rank of the EP group
    compile_layers(model)                                    # optional: torch.compile the layers (once per shape)
    out = generate(model, ids, max_new_tokens=64)            # static KV cache, graph-captured decode
    graphed = GraphedForward(model, batch, seq); graphed(ids) # a whole forward in one CUDA graph (no host wait)
    out = model.generate(ids, synced_gpus=True)              # or transformers' own: all ranks step together
    loss.backward(); sync_gradients(model); opt.step()       # replicated grads averaged
    save_pretrained(model, "out/")                           # standard layout, plain transformers
    model = load_sharded("DIR", group, placement)            # or: each rank reads only its experts
    finetune(model, ids, FinetuneConfig(), setup_groups())   # routers + experts, N ranks == 1 process

`convert` replaces each MoE block by an `OccultMoeBlock` with the same attribute names as the
model's block: `gate` (the model's own router module, replicated), `experts` (an `OccultMoE`
holding this rank's E/D experts in local-slot order of the placement), and the shared experts
(`shared_expert` + `shared_expert_gate` for Qwen2-MoE, `shared_experts` for DeepSeek-V3), which
run on every rank's own tokens with no communication. Non-expert parameter names are unchanged.

Every rank of the group must run the same number of forward passes (each MoE layer is a
collective): `generate` (static KV cache, decode step with no host wait captured in a CUDA graph on
GPUs) keeps ranks in step by itself; with transformers' own `model.generate` pass
`synced_gpus=True` so ranks whose sequences finished keep stepping until all are done.

One module per job: `families` (supported model types, version and structure checks), `routers` (the model's gate in
front of `OccultMoE`), `block` (`OccultMoeBlock`, `moe_blocks`, `sync_gradients` over `replicated_parameters`),
`profile`, `compiled` (`compile_layers`: torch.compile of the decoder layers, one-rank MoE blocks traced in),
`convert` (`convert`, `unconvert`, `hf_layout`), `generate` (`generate`, `StaticDecoder`), `graphed`
(`GraphedForward`), `calibration` (token ids for profiling), `tiny` (tiny random models for tests), `loading`
(`load_sharded`: each rank reads only its experts), `loss` (`use_occult_loss`: the model's `.loss` on occult's
cross-entropy), `finetune` (routers + experts on 1 or N ranks), `aux_loss` (the load-balancing loss over the global
batch), `checkpoint` (resumable fine-tuning), `save` (`save_finetuned`, `save_pretrained`: one shard per MoE layer,
written by its owner rank). `from occult.integrations import hf; hf.convert(...)` is the public path.
"""

from occult.integrations.hf.block import (
    OccultMoeBlock,
    expert_parameters,
    moe_blocks,
    replicated_parameters,
    sync_gradients,
)
from occult.integrations.hf.calibration import calibration_windows, token_stream
from occult.integrations.hf.compiled import compile_layers, decoder_layers
from occult.integrations.hf.convert import convert, hf_layout, unconvert
from occult.integrations.hf.families import (
    FAMILIES,
    SUPPORTED_TRANSFORMERS,
    Family,
    UnsupportedModelError,
    check_transformers_version,
    model_family,
)
from occult.integrations.hf.finetune import (
    FinetuneConfig,
    FinetuneResult,
    Groups,
    finetune,
    setup_groups,
    standard_routing,
    tokenize_texts,
    trainable_parameters,
)
from occult.integrations.hf.generate import StaticDecoder, generate
from occult.integrations.hf.graphed import GraphedForward
from occult.integrations.hf.loading import LoadReport, load_sharded, set_routing_placement
from occult.integrations.hf.loss import use_occult_loss
from occult.integrations.hf.profile import profile
from occult.integrations.hf.routers import HFGateRouter, SigmoidGroupGateRouter, SoftmaxGateRouter
from occult.integrations.hf.save import save_finetuned, save_pretrained
from occult.integrations.hf.tiny import tiny_config, tiny_random_model

__all__ = [
    "FAMILIES",
    "compile_layers",
    "standard_routing",
    "decoder_layers",
    "FinetuneConfig",
    "FinetuneResult",
    "GraphedForward",
    "Groups",
    "LoadReport",
    "SUPPORTED_TRANSFORMERS",
    "Family",
    "HFGateRouter",
    "OccultMoeBlock",
    "SigmoidGroupGateRouter",
    "SoftmaxGateRouter",
    "StaticDecoder",
    "UnsupportedModelError",
    "calibration_windows",
    "check_transformers_version",
    "convert",
    "expert_parameters",
    "finetune",
    "generate",
    "hf_layout",
    "load_sharded",
    "model_family",
    "moe_blocks",
    "profile",
    "replicated_parameters",
    "save_finetuned",
    "save_pretrained",
    "set_routing_placement",
    "setup_groups",
    "sync_gradients",
    "tiny_config",
    "tiny_random_model",
    "token_stream",
    "tokenize_texts",
    "trainable_parameters",
    "unconvert",
    "use_occult_loss",
]
