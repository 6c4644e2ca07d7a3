"""Device-limited routing by gate mass (`method="mass"`) against a literal per-token reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from occult.moe.pruning import PruningError, device_limited_topk, devices_per_token, limit_routers
from occult.moe.routing import TopKRouter
from occult.placement import Placement

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def ref_mass(scores: np.ndarray, k: int, dev: np.ndarray, n: int) -> list[int]:
    """The definition literally: plain top-k; if it spans more than N devices, keep the N devices
    with the largest sum of its top-k scores, then the top-k among all experts on those devices."""
    order = [int(e) for e in np.argsort(-scores, kind="stable")]
    plain = order[:k]
    if len({int(dev[e]) for e in plain}) <= n:
        return plain
    mass: dict[int, float] = {}
    for e in plain:
        mass[int(dev[e])] = mass.get(int(dev[e]), 0.0) + float(scores[e])
    devices = sorted(mass, key=lambda d: -mass[d])[:n]
    return [e for e in order if int(dev[e]) in devices][:k]


CASES = [(8, 2, 2), (8, 4, 2), (12, 3, 3), (16, 4, 4), (16, 2, 1), (32, 4, 8), (64, 4, 8)]


@pytest.mark.parametrize("num_experts,num_devices,top_k", CASES)
def test_mass_matches_reference_on_random_placements(num_experts, num_devices, top_k):
    rng = np.random.default_rng(num_experts * 100 + num_devices * 10 + top_k)
    per = num_experts // num_devices
    T = 200
    scores = torch.softmax(torch.as_tensor(rng.normal(size=(T, num_experts)) * 2), dim=-1)
    for norm in (False, True):
        dev = rng.permutation(np.arange(num_experts) % num_devices)
        dev_t = torch.as_tensor(dev)
        for n in range(1, num_devices + 1):
            if n * per < top_k:
                with pytest.raises(PruningError, match="fewer than top_k"):
                    device_limited_topk(scores, top_k, dev_t, n, method="mass")
                continue
            w, ids = device_limited_topk(scores, top_k, dev_t, n, method="mass", norm_topk_prob=norm)
            for t in range(T):
                assert ids[t].tolist() == ref_mass(scores[t].numpy(), top_k, dev, n), (t, n)
            want_w = scores.gather(1, ids)
            assert torch.equal(w, want_w / want_w.sum(1, keepdim=True) if norm else want_w)
            # exact about what it sends: every token's experts lie on at most N devices
            assert int(devices_per_token(ids, dev_t).max()) <= n
            assert (ids.sort(1).values.diff(dim=1) > 0).all()


def test_mass_differs_from_score_where_the_best_expert_is_alone():
    """One strong expert alone on device 0, three medium ones together on device 1: score keeps
    device 0 (its best expert scores highest), mass keeps device 1 (more of the top-k weight)."""
    dev = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 1, 0, 2, 3])
    scores = torch.tensor([[0.30, 0.0, 0.2, 0.2, 0.01, 0.0, 0.01, 0.0, 0.2, 0.0, 0.04, 0.04]])
    _, by_score = device_limited_topk(scores, 3, dev, 1, method="score")
    _, by_mass = device_limited_topk(scores, 3, dev, 1, method="mass")
    assert set(dev[by_score[0]].tolist()) == {0} and set(dev[by_mass[0]].tolist()) == {1}
    assert float(scores[0, by_mass[0]].sum()) > float(scores[0, by_score[0]].sum())


def test_mass_with_node_limit_stays_within_both_limits():
    rng = np.random.default_rng(3)
    E, D, M, k = 32, 8, 4, 6
    dev = torch.as_tensor(rng.permutation(np.arange(E) % D))
    node = dev // (D // M)
    scores = torch.softmax(torch.randn(300, E, generator=torch.Generator().manual_seed(0)) * 2, -1)
    for n_node, n_dev in ((1, 2), (2, 3), (2, 4), (3, 3)):
        _, ids = device_limited_topk(scores, k, dev, n_dev, method="mass", max_nodes=n_node, expert_node_E=node)
        assert int(devices_per_token(ids, node).max()) <= n_node
        assert int(devices_per_token(ids, dev).max()) <= n_dev


def test_router_with_mass_through_limit_routers():
    torch.manual_seed(0)
    E, D, k = 16, 4, 4
    placement = Placement(np.random.default_rng(1).permutation(np.arange(E) % D), D)
    dev = torch.as_tensor(placement.expert_device(0).copy())
    router = TopKRouter(32, E, k)
    limit_routers([router], placement, 2, "mass")
    x = torch.randn(100, 32)
    w, ids = router(x)
    scores = torch.softmax(router.gate(x), -1)
    want_w, want_ids = device_limited_topk(scores, k, dev, 2, method="mass")
    assert torch.equal(ids, want_ids) and torch.allclose(w, want_w)
    assert int(devices_per_token(ids, dev).max()) <= 2
    w.sum().backward()
    assert router.gate.weight.grad is not None
