"""The device transport's data flow on CPU gloo ranks (`occult.moe.device_exchange`).

The real transport stores into peers' memory (GPUs of one host; the GPU suite runs it, and
tests/kernels/test_push_kernel.py its kernel); here a stand-in transport moves the same byte rows
with gloo into the same region-per-source layout, so everything else is checked on the CPU: the
row layout (activations, gates and slots side by side), the masking of each region's tail, the
capacity agreement between ranks with different token counts, backward through both all-to-alls,
the statuses raised on every rank, and the counts read lazily into `CommStats`. Outputs and
gradients must equal the count-exchange path's and the single-process `DenseMoE`'s.
"""

from __future__ import annotations

import random

import pytest
import torch
from _gloo_transport import GlooTransport  # (tests/moe)

from occult import DenseMoE, OccultMoE, Placement, RoutingError, check_routing
from occult.distributed import run_ranks
from occult.moe import transport_buffers


def _layers(dense: DenseMoE, placement: Placement, dispatcher: str):
    device = OccultMoE.from_dense(dense, placement, dispatcher=dispatcher)
    device.dispatcher.transport = GlooTransport(device.dispatcher.group)
    counts = OccultMoE.from_dense(dense, placement, dispatcher=dispatcher, transport="counts")
    return device, counts


def exactness_worker(rank: int, world: int, seed: int, dispatcher: str, dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(seed)
    E, H, k = 8, 16, 3
    dense = DenseMoE(H, 8, E, k, dtype=dtype)
    placement = Placement(torch.randperm(E).remainder(world).numpy()[None], world)
    device, counts = _layers(dense, placement, dispatcher)
    assert device.dispatcher.transport_name == "device" and counts.dispatcher.transport_name == "counts"
    out = {"worst": 0.0}
    for call, tokens in enumerate(([5, 0], [3, 40], [300, 1])):  # uneven, an empty rank, then growth
        x = torch.randn(tokens[rank], H, dtype=dtype, generator=torch.Generator().manual_seed(seed + 10 * call + rank))
        g = torch.randn_like(x)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [layer(xi) for layer, xi in zip((device, counts), xs)]
        for y in ys:
            (y * g).sum().backward()
        ref = DenseMoE(H, 8, E, k, dtype=dtype)
        ref.load_state_dict(dense.state_dict())
        x_ref = x.clone().requires_grad_()
        y_ref = ref(x_ref)
        pairs = [(ys[0], ys[1]), (xs[0].grad, xs[1].grad), (ys[0], y_ref)]
        out["worst"] = max([out["worst"]] + [float((a - b).abs().max()) if a.numel() else 0.0 for a, b in pairs])
        for name in ("forward_rows", "backward_rows", "forward_bytes", "dispatch_rows", "combine_rows"):
            assert getattr(device.last_comm_stats, name) == getattr(counts.last_comm_stats, name), name
    for p_dev, p_cnt in zip(device.parameters(), counts.parameters()):
        out["worst"] = max(out["worst"], float((p_dev.grad - p_cnt.grad).abs().max()))
    out["grown"] = device.dispatcher.transport.grown
    from occult.moe.device_exchange import packable
    from occult.moe.plan import routed_plan

    out["packed"] = packable(x, torch.zeros(1, k, dtype=dtype))
    out["routed"] = (
        routed_plan(
            torch.zeros(4, k, dtype=torch.int64),
            torch.ones(4, k, dtype=dtype),
            device.expert_device_E,
            device.expert_slot_E,
            world,
            True,
        )
        is not None
    )
    return out


@pytest.mark.parametrize("dispatcher", ["dedup", "standard"])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_device_path_equals_count_exchange_and_reference(dispatcher, dtype_name):
    results = run_ranks(exactness_worker, 2, random.randrange(2**31), dispatcher, dtype_name, timeout_s=120)
    tol = 1e-12 if dtype_name == "float64" else 1e-5
    for out in results:
        assert out["worst"] < tol, out
        assert out["grown"] == 2  # 256-token bucket, then 512 for the 300-token call


@pytest.mark.parametrize("dispatcher", ["dedup", "standard"])
def test_kernels_equal_the_torch_path(dispatcher, monkeypatch):
    """float32 ranks under Triton's CPU interpreter take the GPU's kernels: the pack/unpack of the device
    transport (`occult.kernels.pack`) and, with OCCULT_PLAN=triton, the decode-sized batches' plan and routing
    check in one launch (`occult.moe.plan.routed_plan`): outputs, gradients and counts equal the count
    exchange's and the reference, calls of 5, 0, 3, 40, 300 and 1 tokens."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks start with it
    monkeypatch.setenv("OCCULT_PLAN", "triton")
    results = run_ranks(exactness_worker, 2, random.randrange(2**31), dispatcher, "float32", timeout_s=300)
    for out in results:
        assert out["packed"] and out["routed"] and out["worst"] < 1e-5, out


def routed_status_worker(rank: int, world: int, seed: int) -> dict:
    """NaN gates on rank 1 found by the one-launch plan: reported on every rank, over both transports."""
    torch.manual_seed(seed)
    dense = DenseMoE(8, 4, 4, 2, dtype=torch.float32)
    device, counts = _layers(dense, Placement.contiguous(4, world), "dedup")
    out = {}
    x = torch.randn(6, 8)
    bad = x.clone()
    if rank == 1:
        bad[2, 3] = float("nan")
    for name, layer in (("device", device), ("counts", counts)):
        try:
            layer(bad)
            check_routing()  # the device path raises it one call later or here
            out[name] = "no error"
        except RoutingError as exc:
            out[name] = str(exc)
        out[name + " after"] = tuple(layer(x).shape)
    return out


def test_one_launch_routing_status_reaches_every_rank(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OCCULT_PLAN", "triton")
    for out in run_ranks(routed_status_worker, 2, random.randrange(2**31), timeout_s=300):
        for name in ("device", "counts"):
            assert "rank 1: router produced NaN" in out[name], out
            assert out[name + " after"] == (6, 8), out


def bad_input_worker(rank: int, world: int, seed: int) -> dict:
    torch.manual_seed(seed)
    dense = DenseMoE(8, 4, 4, 2, dtype=torch.float64)
    device, _ = _layers(dense, Placement.contiguous(4, world), "dedup")
    out = {}
    x = torch.randn(6, 8, dtype=torch.float64)
    if rank == 1:
        x[2, 3] = float("nan")
    for name, inp in (("nan", x), ("hidden", torch.randn(6, 8 if rank == 0 else 7, dtype=torch.float64))):
        try:
            device(inp)
            out[name] = "no error"
        except (RoutingError, ValueError) as exc:
            out[name] = str(exc)
    out["after"] = tuple(device(torch.randn(5, 8, dtype=torch.float64)).shape)
    return out


def test_device_path_reports_bad_input_on_every_rank():
    results = run_ranks(bad_input_worker, 2, random.randrange(2**31), timeout_s=120)
    for rank, out in enumerate(results):
        assert "rank 1: router produced NaN" in out["nan"], out
        assert ("hidden size 7" if rank == 1 else "rank 1: input hidden size") in out["hidden"], out
        assert out["after"] == (5, 8)


def test_row_layout_pads_rows_to_whole_blocks():
    from occult.moe.device_exchange import RowLayout

    for hidden, dtype, k in ((7, torch.bfloat16, 1), (2048, torch.bfloat16, 8), (5, torch.float64, 3)):
        layout = RowLayout(hidden, dtype, k, dtype)
        assert layout.width % transport_buffers.ROW_ALIGN == 0 and layout.back_width % transport_buffers.ROW_ALIGN == 0
        assert layout.width >= layout.x_bytes + layout.gate_bytes + 4 * k
        buf = torch.zeros((3, layout.width), dtype=torch.uint8)
        x, g, s = torch.randn(3, hidden).to(dtype), torch.rand(3, k).to(layout.carrier), torch.randint(-1, 9, (3, k))
        layout.write(buf, x, g, s.to(torch.int32))
        assert torch.equal(layout.read_x(buf, 3), x)
        assert torch.equal(layout.read_gates(buf, 3), g.to(dtype)) and torch.equal(layout.read_slots(buf, 3), s)
    bucket = transport_buffers.token_bucket
    assert bucket(0) == bucket(256) == 256 and bucket(257) == 512


def refusal_worker(rank: int, world: int) -> str:
    try:
        OccultMoE(8, 4, 4, 2, transport="device")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_device_transport_is_refused_clearly_where_it_cannot_run():
    for message in run_ranks(refusal_worker, 2, timeout_s=60):
        assert "device transport cannot run here" in message and "transport='counts'" in message, message
    with pytest.raises(ValueError, match="transport must be one of"):
        OccultMoE(8, 4, 4, 2, transport="nvshmem")
    assert "transport=counts" in repr(OccultMoE(8, 4, 4, 2))
