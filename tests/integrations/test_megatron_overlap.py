"""occult's dispatcher under Megatron-Core's combined-1F1B EP overlap (`overlap_moe_expert_parallel_comm`).

That schedule (`TransformerModelChunkSchedulePlan.run`) splits each layer into nodes (attention + router +
`dispatch_preprocess`, `token_dispatch`, experts, `token_combine`), detaches every node's inputs and frees the
dispatch node's inputs after its forward. On 2 gloo ranks: a 2-layer GPTModel with occult's dispatcher run as
micro-batch 0 forward, micro-batch 1 forward + micro-batch 0 backward, micro-batch 1 backward gives every
gradient of the plain forward/backward of both micro-batches. CPU has no CUDA events, streams or NVTX: the
ranks replace them with no-ops (the schedule's order is kept, not its concurrency; docs/overlap.md, last section).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is installed by .ci/run (docs/testing.md)")

from occult.distributed import run_ranks  # noqa: E402


class _Event:
    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _no_cuda_schedule() -> None:
    """The schedule's CUDA events, `record_stream` and NVTX ranges as no-ops (this rank only)."""
    import megatron.core.pipeline_parallel.utils as pipeline_utils

    torch.cuda.Event = lambda *a, **k: _Event()  # type: ignore[assignment,misc]
    record_stream = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda self, s: record_stream(self, s) if self.is_cuda else None  # type: ignore[method-assign]
    torch.cuda.nvtx.range_push = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.nvtx.range_pop = lambda *a, **k: None  # type: ignore[assignment]
    pipeline_utils.set_streams()


def _overlap_case(rank: int, world: int) -> list[str]:
    import test_megatron as tm  # (tests/integrations/test_megatron.py)
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan

    tm._megatron(world)
    _no_cuda_schedule()
    torch.manual_seed(0)
    settings = dict(num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    plain = tm._gpt(tm._config(2, **settings), occult=True)
    config = tm._config(2, **settings, overlap_moe_expert_parallel_comm=True, bf16=True)
    config.bf16 = False  # asserted when the config is made; fp32 math keeps the comparison tight
    model = tm._gpt(config, occult=True)
    model.load_state_dict({k: v for k, v in plain.state_dict().items() if torch.is_tensor(v)})
    batches = [tm._tokens(7 + 100 * i, rank) for i in range(2)]
    for ids, pos, causal, labels in batches:
        plain(ids, pos, causal, labels=labels).sum().backward()
    plan0 = model.build_schedule_plan(*batches[0][:3], labels=batches[0][3])
    loss0 = Plan.run(plan0, None)
    plan1 = model.build_schedule_plan(*batches[1][:3], labels=batches[1][3])
    loss1 = Plan.run(plan1, plan0, b_grad=torch.ones_like(loss0))
    Plan.run(None, plan1, b_grad=torch.ones_like(loss1))
    errors: list[str] = []
    reference = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None:
            errors.append(f"{name}: no gradient")
        else:
            tm._close(p.grad, reference[name].grad, f"{name} grad", errors)
    kinds = {type(m.token_dispatcher).__name__ for m in model.modules() if hasattr(m, "token_dispatcher")}
    if kinds != {"OccultTokenDispatcher"}:
        errors.append(f"dispatchers: {kinds}")
    return errors


def test_combined_1f1b_overlap_schedule_matches_plain_steps():
    for errors in run_ranks(_overlap_case, 2):
        assert errors == []
