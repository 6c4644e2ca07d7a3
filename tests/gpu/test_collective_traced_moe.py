"""`hf.compile_layers(trace_moe=True)` on sync-free expert-parallel layers over NCCL: each MoE block, its
all-to-alls included, traced with its decoder layer (Inductor, the Triton expert path), forward and backward,
trains like the eager model in fp32, bf16 and fp16, with no graph break; every rank its own batch. Over NCCL's
all-to-all and over the host transport's (`occult::host_all_to_all`, the wire called at run time). Collective GPU
tests (tests/gpu/run.sh's first stage; the CPU twins on gloo ranks: tests/integrations/test_compile_layers.py,
tests/moe/test_host_wire_traced.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'occult[hf]')")

from gradient_judge import gradients_off  # noqa: E402  (tests/gpu/gradient_judge.py)

import occult  # noqa: E402
from occult.integrations import hf  # noqa: E402
from occult.moe.comm import CommStats  # noqa: E402

VOCAB = 96
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model(family: str, seed: int, dtype: torch.dtype, device: torch.device, link: str) -> torch.nn.Module:
    """The tiny random `family` model of `seed`, its experts over every rank, sync-free, on this rank's GPU in
    `dtype`, its all-to-alls over `link` (NCCL's or the host transport)."""
    model = hf.tiny_random_model(family, seed=seed, vocab_size=VOCAB, num_hidden_layers=2).to(device, dtype)
    if link == "host":
        return hf.convert(model, execution=occult.ExecConfig(sync_free=True, transport="host"))
    model = hf.convert(model)
    occult.set_sync_free(model)
    return model


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """One forward and backward: every gradient (float32 copies) and each MoE layer's rows booked."""
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    stats = [m.last_comm_stats.as_dict() for m in model.modules() if isinstance(m, occult.OccultMoE)]
    return grads, stats


@pytest.mark.parametrize("link", ["nccl", "host"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])  # (DeepSeek-V3: shared experts beside the routed)
def test_traced_sync_free_layers_train_like_eager(ranks, family, dtype_name, link):
    from torch._dynamo.utils import counters

    if ranks.device.type != "cuda":
        pytest.skip("the traced Triton expert path needs a GPU")
    dtype, seed = DTYPES[dtype_name], ranks.seed + 303
    gen = torch.Generator().manual_seed(seed + ranks.rank)
    ids = torch.randint(3, VOCAB, (4, 64), generator=gen).to(ranks.device)  # 256 tokens: past decode size
    exact, _ = _step(_model(family, seed, torch.float32, ranks.device, link), ids)  # the same model in fp32, eager
    model = _model(family, seed, dtype, ranks.device, link)
    ref, ref_stats = _step(model, ids)
    torch._dynamo.reset()
    counters.clear()
    hf.compile_layers(model, trace_moe=True)
    assert all(getattr(b, "occult_traced", False) for _, b in hf.moe_blocks(model))
    got, stats = _step(model, ids)
    again, _ = _step(model, ids)
    breaks = {str(k): v for k, v in counters["graph_break"].items()}
    assert ranks.all_max(float(bool(breaks))) == 0.0, breaks  # each layer whole: the all-to-alls in its graphs
    assert ranks.all_max(float(stats != ref_stats)) == 0.0, (stats, ref_stats)  # the backward's booked with the forward
    # compiled against eager in the same precision: exact in fp32, no gross error in half precision (routing
    # flips: gradient_judge.py)
    off = gradients_off(got, ref, exact, dtype)
    assert ranks.all_max(float(len(off))) == 0.0, (seed, off)
    assert ranks.all_max(float(not all(torch.equal(got[n], again[n]) for n in got))) == 0.0


def _exchanged(rows: torch.Tensor, gates: torch.Tensor | None, ranks, state, link) -> torch.Tensor:
    """Rows (with gates, when given) out to every rank in equal parts over `link` (a group or a `HostWire`) and
    back as one tensor to differentiate."""
    from occult.moe.comm import exchange

    splits = [rows.shape[0] // ranks.world_size] * ranks.world_size
    slots = None if gates is None else torch.zeros(gates.shape, dtype=torch.int64, device=rows.device)
    got, got_gates, _ = exchange(rows, gates, slots, splits, splits, link, state)
    return got if got_gates is None else got * got_gates.sum(dim=1, keepdim=True)


@pytest.mark.parametrize("link_name", ["nccl", "host"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("with_gates", [False, True])
def test_a_compiled_exchange_sends_the_gradients_back(ranks, with_gates, backend, link_name):
    """One exchange under torch.compile, forward and backward: eager's values and gradients (torch 2.11's
    in-place all-to-all on NCCL came back zero in a compiled backward; the rows-only exchange, the combine's,
    lost every MoE gradient in front of it)."""
    if backend == "inductor" and ranks.device.type != "cuda":
        pytest.skip("Inductor's collectives: a GPU (the CPU twin runs aot_eager)")
    link = torch.distributed.group.WORLD
    if link_name == "host":
        if ranks.device.type != "cuda" or ranks.backend != "nccl":
            pytest.skip("the host transport serves NCCL ranks on CUDA GPUs")
        from occult.moe.host_wire import HostWire

        link = HostWire.for_group(link)
    gen = torch.Generator().manual_seed(ranks.seed + 17 + ranks.rank)
    rows = torch.randn(8 * ranks.world_size, 32, generator=gen).to(ranks.device).requires_grad_()
    gates = torch.rand(rows.shape[0], 2, generator=gen).to(ranks.device).requires_grad_() if with_gates else None
    weight = torch.randn(rows.shape, generator=gen).to(ranks.device)
    inputs = [t for t in (rows, gates) if t is not None]
    state = SimpleNamespace(stats=CommStats(), rank=ranks.rank)  # (what the exchange books its rows in)

    def loss(*xs) -> torch.Tensor:
        return (_exchanged(xs[0], xs[1] if with_gates else None, ranks, state, link) * weight).sum()

    want = torch.autograd.grad(loss(*inputs), inputs)
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, backend=backend, fullgraph=True)(*inputs), inputs)
    worst = max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))
    assert ranks.all_max(worst) < 1e-5, worst
