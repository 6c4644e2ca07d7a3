"""Two-level deduplicated dispatch ("dedup2") vs the single-process DenseMoE, on 4 gloo ranks
simulating 2 nodes x 2 GPUs (and 1 x 4, 4 x 1, which are flat dedup).

Every case draws fresh weights and inputs and compares outputs and gradients (input, router,
both expert weights); row accounting per rank and per link is checked against a literal walk
over every token's nodes and GPUs (rows a rank sends in each of the four exchanges).
All cases (and the error checks) run in one spawn of 4 ranks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dense_reference import dense_backward, layer_errors, rel

from occult.distributed import run_ranks
from occult.moe.counts import RoutingError
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE
from occult.moe.registry import make_dispatcher
from occult.moe.two_level import TwoLevelDispatcher
from occult.placement import Placement

WORLD = 4
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def expected_rows(ids_all, tokens, device_E, G, rank, two_level):
    """Rows `rank` sends (all, inter-node, intra-node; dispatch + combine), by a literal walk.

    Two-level: own tokens once per node (rail), rows received on the rail once per GPU of the node
    (node), results back to the gateway (node) and one per (token, node) back (rail). Flat dedup:
    own tokens once per GPU, one result row back per received row.
    """
    n, h = divmod(rank, G)
    total = inter = intra = 0
    start = 0
    for src, count in enumerate(tokens):
        m, g = divmod(src, G)
        for t in range(start, start + count):
            devs = sorted({int(device_E[e]) for e in ids_all[t]})
            nodes = sorted({d // G for d in devs})
            mine = [d for d in devs if d // G == n]
            if not two_level:
                if src == rank:  # dispatch: one row per GPU
                    total += len(devs)
                    inter += sum(d // G != n for d in devs)
                    intra += sum(d // G == n and d != rank for d in devs)
                if rank in devs:  # combine: one row back to the source
                    total += 1
                    inter += m != n
                    intra += m == n and src != rank
                continue
            if src == rank:  # rail dispatch: one row per node
                total += len(nodes)
                inter += sum(x != n for x in nodes)
            if g == h and mine:  # this rank is the token's gateway on node n
                total += len(mine) + 1  # node dispatch (one per GPU) + rail combine (one row)
                intra += sum(d != rank for d in mine)
                inter += m != n
            if rank in devs:  # node combine: one row back to the gateway (n, g)
                total += 1
                intra += g != h
        start += count
    return total, inter, intra


class _Recording(torch.nn.Module):
    """The layer's router, keeping the ids it chose (so a half-precision case's reference routes alike)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.ids_TK = inner, None

    def forward(self, x_TH):
        weights_TK, self.ids_TK = self.inner(x_TH)
        return weights_TK, self.ids_TK


class _GivenIds(torch.nn.Module):
    """Reference router: softmax of the gate's own logits, taken at given ids (renormalised if asked)."""

    def __init__(self, gate: torch.nn.Linear, ids_TK: torch.Tensor, norm: bool) -> None:
        super().__init__()
        self.gate, self.ids_TK, self.norm = gate, ids_TK, norm

    def forward(self, x_TH):
        weights_TK = torch.softmax(self.gate(x_TH), dim=-1).gather(1, self.ids_TK)
        if self.norm:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return weights_TK, self.ids_TK


def check_case(rank: int, world_size: int, case: dict) -> dict:
    dtype, ref_dtype = case["dtype"], case.get("ref_dtype", case["dtype"])
    torch.manual_seed(case["seed"])
    E, H, F, K = case["experts"], case["hidden"], case["ffn"], case["top_k"]
    dense = DenseMoE(H, F, E, K, norm_topk_prob=case["norm"], dtype=torch.float64)
    with torch.no_grad():
        dense.router.gate.weight.mul_(3.0)
    if case.get("forced_expert") is not None:  # every token's router row picks the same experts
        with torch.no_grad():
            dense.router.gate.weight.zero_()
            dense.router.gate.weight[case["forced_expert"] : case["forced_expert"] + K] = 1.0
    dense = dense.to(ref_dtype)
    tokens = case["tokens"]
    x_all = torch.randn(sum(tokens), H, dtype=torch.float64).to(ref_dtype)
    g_all = torch.randn(sum(tokens), H, dtype=torch.float64).to(ref_dtype)
    if case.get("forced_expert") is not None:
        x_all = x_all.abs()  # positive inputs: the forced rows win
    placement = Placement(np.asarray(case["device_E"])[None], world_size, case["nodes"])
    group = dist.new_group(list(range(world_size))) if case.get("subgroup") else None
    dispatcher = case["dispatcher"]
    if case.get("devices_per_node") is not None:
        dispatcher = TwoLevelDispatcher(group, devices_per_node=case["devices_per_node"])
    layer = OccultMoE.from_dense(
        dense.to(dtype), placement=placement, dispatcher=dispatcher, group=group, sync_free=case.get("sync_free", False)
    )
    dense = dense.to(ref_dtype)

    start = sum(tokens[:rank])
    sl = slice(start, start + tokens[rank])
    half = dtype != ref_dtype
    if half:  # near-ties of bf16/fp16 logits may pick other experts than the reference would: give it the layer's
        layer.router = _Recording(layer.router)
    x = x_all[sl].to(dtype).clone().requires_grad_()
    y = layer(x)
    (y * g_all[sl].to(dtype)).sum().backward()
    if half:
        chosen = [None] * world_size
        dist.all_gather_object(chosen, layer.router.ids_TK)
        dense.router = _GivenIds(dense.router.gate, torch.cat(chosen), case["norm"])
        layer.router = layer.router.inner

    x_ref, y_ref = dense_backward(dense, x_all, g_all)
    router_grad = layer.router.gate.weight.grad.clone().double()
    dist.all_reduce(router_grad)
    errors = layer_errors(layer, dense, x, y, x_ref, y_ref, sl, router_grad)
    with torch.no_grad():
        _, ids_all = layer.router(x_all.to(dtype))
    G = layer.dispatcher.devices_per_node
    two_level = layer.dispatcher.name == "dedup2" and G not in (1, world_size)
    stats = layer.last_comm_stats
    return {
        "errors": errors,
        "expected": expected_rows(ids_all.numpy(), tokens, placement.expert_device(0), G, rank, two_level),
        "stats": stats.as_dict(),
        "row_bytes": H * torch.tensor([], dtype=dtype).element_size(),
        "remote_nodes": sum(
            len({int(placement.expert_device(0)[e]) // G for e in ids_all[t].tolist()} - {rank // G})
            for t in range(sl.start, sl.stop)
        ),
        "name": layer.dispatcher.name,
    }


def error_checks(rank: int, world_size: int) -> dict:
    """Bad set-ups raise clear errors (the same on every rank, no hang); bad input reaches every rank."""
    out = {}
    flat = Placement.contiguous(8, world_size)
    for name, make in {
        "missing": lambda: OccultMoE(8, 4, 8, 2, dispatcher="dedup2", placement=flat),
        "not_dividing": lambda: TwoLevelDispatcher(devices_per_node=3),
        "disagree": lambda: OccultMoE(
            8,
            4,
            8,
            2,
            placement=Placement.contiguous(8, world_size, num_nodes=2),
            dispatcher=TwoLevelDispatcher(devices_per_node=1),
        ),
        "unknown": lambda: make_dispatcher("dedup3"),
    }.items():
        try:
            make()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    layer = OccultMoE(
        8, 4, 8, 2, dispatcher="dedup2", placement=Placement.contiguous(8, world_size, num_nodes=2), dtype=torch.float64
    )
    x = torch.randn(6, 8, dtype=torch.float64)
    if rank == 3:
        x[1, 2] = float("nan")
    try:
        layer(x)
        out["nan"] = "no error"
    except RoutingError as exc:
        out["nan"] = str(exc)
    out["after"] = str(tuple(layer(torch.randn(5, 8, dtype=torch.float64)).shape))
    return out


def run_all(rank: int, world_size: int, cases: list[dict]) -> dict:
    return {"cases": [check_case(rank, world_size, c) for c in cases], "errors": error_checks(rank, world_size)}


def _placements(E: int, rng: np.random.Generator) -> dict[str, list[int]]:
    from occult.placement.solvers import place
    from occult.placement.synthetic import planted_nodes_trace

    trace = planted_nodes_trace(600, E, 2, num_nodes=2, groups_per_node=2, seed=int(rng.integers(1 << 30)))
    hier = place(trace.trace, WORLD, "greedy", num_nodes=2).placement
    return {
        "contiguous": list(np.arange(E) // (E // WORLD)),
        "random": list(rng.permutation(np.arange(E) % WORLD)),
        "hierarchical": list(hier.expert_device(0)),
    }


def _cases() -> list[dict]:
    rng = np.random.default_rng(random.randrange(2**31))
    E = 8
    places = _placements(E, rng)
    uneven = [int(v) for v in rng.integers(5, 30, WORLD)]
    even = [int(rng.integers(5, 20))] * WORLD

    def case(**kw):
        base = dict(
            dtype=torch.float64,
            experts=E,
            hidden=16,
            ffn=12,
            top_k=3,
            norm=False,
            nodes=2,
            dispatcher="dedup2",
            tokens=uneven,
            device_E=places["random"],
        )
        base.update(kw)
        base["seed"] = random.randrange(2**31)
        return base

    cases = [
        case(device_E=places[p], dtype=dt, norm=p == "random") for p in places for dt in (torch.float64, torch.float32)
    ]
    cases += [
        case(tokens=[0] + uneven[1:]),  # a rank with no tokens
        case(tokens=[0, 0] + uneven[2:]),  # a node with no tokens
        case(tokens=[0] * WORLD),  # no tokens anywhere
        case(tokens=[3] * WORLD, top_k=1, experts=4 * E, device_E=list(rng.permutation(np.arange(4 * E) % WORLD))),
        case(top_k=1),  # top-1
        case(top_k=E, norm=True),  # top-k = all experts
        case(forced_expert=0, top_k=2, device_E=places["contiguous"]),  # every token on node 0 only
        case(sync_free=True, tokens=even),
        case(sync_free=True, tokens=even, top_k=1, dtype=torch.float32),
        case(subgroup=True),  # a group other than WORLD
        case(nodes=1, devices_per_node=4),  # 1 node x 4: flat dedup
        case(nodes=1, devices_per_node=1),  # 4 nodes x 1: flat dedup
        case(dispatcher="dedup"),  # flat dedup, rows split by link
        # half precision: against DenseMoE in float32 on the same (rounded) weights and inputs
        case(dtype=torch.bfloat16, ref_dtype=torch.float32, hidden=32, ffn=24),
        case(dtype=torch.float16, ref_dtype=torch.float32, hidden=32, ffn=24, sync_free=True, tokens=even),
    ]
    return cases


def test_two_level_matches_dense_on_2_nodes_x_2_gpus():
    cases = _cases()
    per_rank = run_ranks(run_all, WORLD, cases, timeout_s=300)
    for i, case in enumerate(cases):
        results = [r["cases"][i] for r in per_rank]
        label = {k: v for k, v in case.items() if k not in ("device_E",)}
        tol = TOL[case["dtype"]]
        for rank, res in enumerate(results):
            for name, err in res["errors"].items():
                assert err <= tol, f"{label}, rank {rank}: {name} relative error {err:.3e}"
            s = res["stats"]
            assert s["backward_rows"] == s["forward_rows"] and s["backward_bytes"] == s["forward_bytes"], (label, s)
            assert s["forward_rows"] == s["dispatch_rows"] + s["combine_rows"], (label, s)
            assert s["forward_bytes"] == s["forward_rows"] * res["row_bytes"], (label, s)
            for level in ("internode", "intranode"):
                assert s[f"forward_{level}_bytes"] == s[f"forward_{level}_rows"] * res["row_bytes"], (label, s)
                assert s[f"backward_{level}_rows"] == s[f"forward_{level}_rows"], (label, s)
            assert s["forward_internode_rows"] + s["forward_intranode_rows"] == s["forward_remote_rows"], (label, s)
            if not case.get("sync_free"):
                assert (s["forward_rows"], s["forward_internode_rows"], s["forward_intranode_rows"]) == tuple(
                    res["expected"]
                ), (label, rank, s, res["expected"])
        if case.get("sync_free"):  # fixed capacity: T rows per node, M*T per GPU, both ways
            T, M, G = case["tokens"][0], 2, 2
            for s in (r["stats"] for r in results):
                assert s["forward_rows"] == 2 * (M * T + G * M * T), (label, s)
                assert s["forward_internode_rows"] == 2 * (M - 1) * T, (label, s)
        elif case["dispatcher"] == "dedup2" and case["nodes"] == 2:
            # across nodes: exactly one row per (token, remote node), each way
            remote = sum(r["remote_nodes"] for r in results)
            assert sum(r["stats"]["forward_internode_rows"] for r in results) == 2 * remote, label
            assert all(r["name"] == "dedup2" for r in results)
    for res in per_rank:  # bad set-ups and bad input: clear errors on every rank
        err = res["errors"]
        assert "num_nodes" in err["missing"] and "devices_per_node=G" in err["missing"], err["missing"]
        assert "devices_per_node=3" in err["not_dividing"] and "[1, 2, 4]" in err["not_dividing"], err
        assert "make them agree" in err["disagree"], err
        assert "dedup2" in err["unknown"], err
        assert "rank 3" in err["nan"] and "NaN" in err["nan"], err["nan"]
        assert err["after"] == "(5, 8)"


def test_two_level_single_process():
    dense = DenseMoE(8, 6, 8, 3, dtype=torch.float64)
    layer = OccultMoE.from_dense(dense, dispatcher="dedup2")
    x = torch.randn(7, 8, dtype=torch.float64)
    assert torch.allclose(layer(x), dense(x), rtol=1e-10, atol=1e-12)
    assert layer.dispatcher.devices_per_node == 1


@pytest.mark.parametrize("bad", [0, 3, 2.5, "two"])
def test_devices_per_node_checked(bad):
    from occult.moe.nodes import check_devices_per_node

    with pytest.raises(ValueError, match="devices_per_node"):
        check_devices_per_node(bad, 4)


def subgroup_worker(rank: int, world_size: int, seed: int) -> list:
    """Ranks 1, 2, 4, 5 form an expert-parallel group of 2 nodes x 2; ranks 0 and 3 never enter it."""
    members = [1, 2, 4, 5]
    sub = dist.new_group(members)  # (every rank creates it; its node/rail groups only its members)
    if rank not in members:
        dist.barrier()  # stay up (rank 0 hosts the store) until the members are done
        return None
    torch.manual_seed(seed)
    dense = DenseMoE(8, 6, 8, 3, dtype=torch.float64)
    placement = Placement(np.random.default_rng(seed).permutation(np.arange(8) % 4)[None], 4, 2)
    layer = OccultMoE.from_dense(dense, placement=placement, dispatcher="dedup2", group=sub)
    torch.manual_seed(seed + rank)
    x = torch.randn(5 + rank, 8, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    layer(x).sum().backward()
    dense(x_ref).sum().backward()
    out = [layer.dispatcher.two_level, rel(layer(x), dense(x)), rel(x.grad, x_ref.grad)]
    dist.barrier()
    return out


def test_two_level_inside_a_subgroup_of_the_world():
    results = run_ranks(subgroup_worker, 6, random.randrange(2**31), timeout_s=120)
    assert results[0] is None and results[3] is None
    for rank in (1, 2, 4, 5):
        two_level, err_y, err_dx = results[rank]
        assert two_level and err_y < 1e-12 and err_dx < 1e-12, (rank, results[rank])
