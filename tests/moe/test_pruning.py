"""Device-limited routing (collaboration pruning) against a literal per-token reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from occult.distributed import run_ranks
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE
from occult.moe.pruning import (
    PruningError,
    SimilarityAccumulator,
    device_limited_topk,
    devices_per_token,
    expert_similarity,
    limit_routers,
    load_similarity,
    save_similarity,
    similarity_path,
)
from occult.moe.routing import TopKRouter, softmax_topk
from occult.placement import Placement

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# ------------------------------------------------------------ reference
def ref_score(scores: np.ndarray, k: int, dev: np.ndarray, n: int) -> list[int]:
    """The definition literally: walk experts by score, collect N devices, top-k inside them."""
    devices: list[int] = []
    for e in np.argsort(-scores, kind="stable"):
        if dev[e] not in devices:
            devices.append(int(dev[e]))
            if len(devices) == n:
                break
    allowed = [e for e in np.argsort(-scores, kind="stable") if dev[e] in devices]
    return [int(e) for e in allowed[:k]]


def ref_similarity(scores: np.ndarray, k: int, dev: np.ndarray, n: int, sim: np.ndarray) -> list[int]:
    """Plain top-k; allowed = first N devices in score order; replace out-of-set experts in score
    order by the most similar unselected expert on an allowed device."""
    order = list(np.argsort(-scores, kind="stable"))
    plain = order[:k]
    devices: list[int] = []
    for e in order:
        if dev[e] not in devices:
            devices.append(int(dev[e]))
            if len(devices) == n:
                break
    chosen = [int(e) for e in plain if dev[e] in devices]
    for e in plain:
        if dev[e] in devices:
            continue
        cands = [c for c in range(len(scores)) if dev[c] in devices and c not in chosen]
        best = max(cands, key=lambda c: (sim[e, c], -c))
        chosen.append(int(best))
    return sorted(chosen, key=lambda e: -scores[e])


def random_placement(rng: np.random.Generator, num_experts: int, num_devices: int) -> np.ndarray:
    return rng.permutation(np.arange(num_experts) % num_devices)


def random_similarity(rng: np.random.Generator, num_experts: int) -> torch.Tensor:
    logits = torch.as_tensor(rng.normal(size=(256, num_experts)))
    return expert_similarity(logits)


CASES = [  # (E, D, k)
    (8, 2, 2),
    (8, 4, 2),
    (12, 3, 3),
    (16, 4, 4),
    (16, 2, 1),
    (32, 4, 8),
    (24, 6, 3),
]


@pytest.mark.parametrize("num_experts,num_devices,top_k", CASES)
@pytest.mark.parametrize("method", ["score", "similarity"])
def test_matches_reference_on_random_placements(num_experts, num_devices, top_k, method):
    rng = np.random.default_rng(num_experts * 100 + num_devices * 10 + top_k)
    per = num_experts // num_devices
    T = 300
    scores = torch.softmax(torch.as_tensor(rng.normal(size=(T, num_experts)) * 2), dim=-1)
    sim = random_similarity(rng, num_experts)
    for trial in range(2):
        dev = random_placement(rng, num_experts, num_devices)
        dev_t = torch.as_tensor(dev)
        for n in range(1, num_devices + 1):
            if n * per < top_k:
                with pytest.raises(PruningError, match="fewer than top_k"):
                    device_limited_topk(scores, top_k, dev_t, n, method=method, similarity_EE=sim)
                continue
            w, ids = device_limited_topk(scores, top_k, dev_t, n, method=method, similarity_EE=sim)
            assert ids.shape == (T, top_k) and w.shape == (T, top_k)
            for t in range(T):
                if method == "score":
                    want = ref_score(scores[t].numpy(), top_k, dev, n)
                else:
                    want = ref_similarity(scores[t].numpy(), top_k, dev, n, sim.numpy())
                assert ids[t].tolist() == want, (t, n, trial)
            assert torch.equal(w, scores.gather(1, ids))
            assert int(devices_per_token(ids, dev_t).max()) <= n
            assert (ids.sort(1).values.diff(dim=1) > 0).all()  # distinct ids


@pytest.mark.parametrize("method", ["score", "similarity"])
@pytest.mark.parametrize("norm", [False, True])
def test_unchanged_when_limit_not_binding(method, norm):
    rng = np.random.default_rng(7)
    E, D, k = 16, 4, 4
    logits = torch.as_tensor(rng.normal(size=(500, E)), dtype=torch.float32) * 3
    # Plant some ties to make sure ties do not break the "unchanged" guarantee.
    logits[:50, 1] = logits[:50, 0]
    scores = torch.softmax(logits, -1)
    dev = torch.as_tensor(random_placement(rng, E, D))
    sim = random_similarity(rng, E)
    plain_w, plain_ids = softmax_topk(logits, k, norm)
    ct = devices_per_token(plain_ids, dev)
    for n in range(1, D + 1):
        w, ids = device_limited_topk(scores, k, dev, n, method=method, similarity_EE=sim, norm_topk_prob=norm)
        within = ct <= n
        assert torch.equal(ids[within], plain_ids[within])
        assert torch.equal(w[within], plain_w[within])
        if n < D:
            assert not torch.equal(ids[~within], plain_ids[~within])
    w, ids = device_limited_topk(scores, k, dev, D, method=method, similarity_EE=sim, norm_topk_prob=norm)
    assert torch.equal(ids, plain_ids) and torch.equal(w, plain_w)
    w, ids = device_limited_topk(scores, k, dev, None, norm_topk_prob=norm)
    assert torch.equal(ids, plain_ids) and torch.equal(w, plain_w)


def test_gate_weights_renormalised_only_when_asked():
    rng = np.random.default_rng(3)
    scores = torch.softmax(torch.as_tensor(rng.normal(size=(64, 16))), -1)
    dev = torch.as_tensor(random_placement(rng, 16, 4))
    w, ids = device_limited_topk(scores, 4, dev, 1)
    assert torch.allclose(w, scores.gather(1, ids))
    assert (w.sum(1) < 1).all()
    wn, idsn = device_limited_topk(scores, 4, dev, 1, norm_topk_prob=True)
    assert torch.equal(ids, idsn)
    assert torch.allclose(wn.sum(1), torch.ones(64, dtype=wn.dtype))
    assert torch.allclose(wn, w / w.sum(1, keepdim=True))


def test_gradient_reaches_router_through_pruned_weights():
    torch.manual_seed(0)
    router = TopKRouter(8, 16, 4, max_devices=2, dtype=torch.float64)
    router.set_expert_device(torch.as_tensor(random_placement(np.random.default_rng(0), 16, 4)))
    x = torch.randn(32, 8, dtype=torch.float64, requires_grad=True)
    w, ids = router(x)
    assert int(devices_per_token(ids, router.expert_device_E).max()) <= 2
    (w * torch.randn_like(w)).sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_bad_arguments_raise_clear_errors():
    scores = torch.softmax(torch.randn(4, 8), -1)
    dev = torch.arange(8) // 2  # 4 devices, 2 experts each
    with pytest.raises(PruningError, match="fewer than top_k"):
        device_limited_topk(scores, 4, dev, 1)
    with pytest.raises(PruningError, match="needs similarity_EE"):
        device_limited_topk(scores, 2, dev, 1, method="similarity")
    with pytest.raises(PruningError, match="shape"):
        device_limited_topk(scores, 2, dev, 1, method="similarity", similarity_EE=torch.eye(4))
    with pytest.raises(PruningError, match="method"):
        device_limited_topk(scores, 2, dev, 1, method="nearest")
    with pytest.raises(PruningError, match="max_devices"):
        device_limited_topk(scores, 2, dev, 0)
    with pytest.raises(PruningError, match=r"shape \[8\]"):
        device_limited_topk(scores, 2, dev[:4], 1)
    # Capacity is rechecked when the same tensor is modified in place.
    dev2 = torch.arange(8) // 4
    device_limited_topk(scores, 4, dev2, 1)
    dev2.copy_(torch.arange(8) // 2)
    with pytest.raises(PruningError, match="fewer than top_k"):
        device_limited_topk(scores, 4, dev2, 1)


def test_empty_batch():
    w, ids = device_limited_topk(torch.zeros(0, 8), 2, torch.arange(8) // 2, 1)
    assert w.shape == (0, 2) and ids.shape == (0, 2)


# ------------------------------------------------------------ similarity
def test_similarity_is_cosine_of_logit_columns_and_streams():
    rng = np.random.default_rng(1)
    logits = torch.as_tensor(rng.normal(size=(300, 6)))
    logits[:, 5] = 0  # an expert never scored: similarity 0, not NaN
    sim = expert_similarity(logits)
    cols = logits.T
    for a in range(5):
        for b in range(5):
            want = torch.nn.functional.cosine_similarity(cols[a], cols[b], dim=0)
            assert abs(float(sim[a, b]) - float(want)) < 1e-5
    assert torch.all(sim[5] == 0) and torch.isfinite(sim).all()
    acc = SimilarityAccumulator(6)
    for chunk in logits.split(77):
        acc.add(chunk)
    assert torch.allclose(acc.similarity(), sim, atol=1e-6)
    with pytest.raises(PruningError, match="no router logits"):
        SimilarityAccumulator(6).similarity()


def test_similarity_file_round_trip_and_errors(tmp_path):
    tables = [expert_similarity(torch.randn(50, 8)) for _ in range(3)]
    placement = tmp_path / "placement.json"
    path = similarity_path(placement)
    assert path.name == "placement.similarity.safetensors" and path.parent == tmp_path
    save_similarity(path, tables, {"source": "test"})
    back = load_similarity(path, num_experts=8, num_layers=3)
    assert all(torch.equal(a, b) for a, b in zip(tables, back))
    with pytest.raises(PruningError, match="3 layer"):
        load_similarity(path, num_layers=2)
    with pytest.raises(PruningError, match="for 8 experts"):
        load_similarity(path, num_experts=16)
    with pytest.raises(PruningError, match="does not exist"):
        load_similarity(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(path.read_bytes()[:40])
    with pytest.raises(PruningError, match="truncated or corrupted"):
        load_similarity(bad)


# ----------------------------------------------------------- in a layer
def test_virtual_placement_on_one_rank_matches_dense_reference():
    """OccultMoE at world size 1 limited against a 4-device placement (limit_routers)."""
    torch.manual_seed(0)
    E, D, k, H = 16, 4, 4, 12
    dense = DenseMoE(H, 8, E, k, dtype=torch.float64)
    layer = OccultMoE.from_dense(dense, dispatcher="dedup")
    virtual = Placement(random_placement(np.random.default_rng(5), E, D)[None], D)
    sim = [random_similarity(np.random.default_rng(6), E)]
    x = torch.randn(64, H, dtype=torch.float64)
    for method in ("score", "similarity"):
        for n in (1, 2):
            limit_routers([layer.router, dense.router], virtual, n, method, sim)
            assert layer.expert_device_E.max() == 0  # dispatch still on the one real rank
            w, ids = layer.router(x)
            dev = torch.as_tensor(virtual.expert_device(0).copy())
            assert int(devices_per_token(ids, dev).max()) <= n
            assert torch.allclose(layer(x), dense(x), atol=1e-10)
    limit_routers([layer.router], virtual, None)
    w, ids = layer.router(x)
    pw, pids = softmax_topk(layer.router.gate(x), k)
    assert torch.equal(ids, pids)


def test_limit_routers_validates():
    router = TopKRouter(4, 8, 4)
    placement = Placement.contiguous(8, 4)
    with pytest.raises(PruningError, match="fewer than top_k"):
        limit_routers([router], placement, 1)
    with pytest.raises(PruningError, match="needs a placement"):
        limit_routers([router], None, 2)
    with pytest.raises(PruningError, match="similarity tables"):
        limit_routers([router], placement, 2, "similarity")
    with pytest.raises(PruningError, match="16 experts"):
        limit_routers([router], Placement.contiguous(16, 4), 2)


def _two_rank_limited(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    layer = OccultMoE(8, 8, 8, 4, max_devices=1, dtype=torch.float64)
    torch.manual_seed(rank + 1)
    x = torch.randn(40, 8, dtype=torch.float64)
    y = layer(x)
    w, ids = layer.router(x)
    ct = devices_per_token(ids, layer.expert_device_E)
    return {
        "rows": layer.last_comm_stats.dispatch_rows,
        "tokens": 40,
        "ct_max": int(ct.max()),
        "finite": bool(torch.isfinite(y).all()),
    }


def test_max_devices_on_two_real_ranks_sends_one_row_per_token():
    out = run_ranks(_two_rank_limited, 2)
    for r in out:
        assert r["ct_max"] == 1 and r["finite"]
        assert r["rows"] == r["tokens"]


# ------------------------------------------------------------ node-limited routing (max_nodes)
def ref_allowed(scores: np.ndarray, dev: np.ndarray, node: np.ndarray, n_dev: int | None, n_node: int) -> set[int]:
    """The definition literally: walk experts by score, collecting devices; a device that would
    open a node beyond `n_node` is skipped; stop at `n_dev` devices (None: no device limit)."""
    devices: list[int] = []
    nodes: list[int] = []
    for e in np.argsort(-scores, kind="stable"):
        d, m = int(dev[e]), int(node[e])
        if d in devices:
            continue
        if m not in nodes:
            if len(nodes) == n_node:
                continue
            nodes.append(m)
        devices.append(d)
        if n_dev is not None and len(devices) == n_dev:
            break
    return {int(e) for e in range(len(scores)) if dev[e] in devices}


def ref_limited(scores, k, dev, node, n_dev, n_node, sim=None) -> list[int]:
    allowed = ref_allowed(scores, dev, node, n_dev, n_node)
    order = [int(e) for e in np.argsort(-scores, kind="stable")]
    if sim is None:
        return [e for e in order if e in allowed][:k]
    chosen = [e for e in order[:k] if e in allowed]
    for e in order[:k]:
        if e not in allowed:
            cands = [c for c in range(len(scores)) if c in allowed and c not in chosen]
            chosen.append(max(cands, key=lambda c: (sim[e, c], -c)))
    return sorted(chosen, key=lambda e: -scores[e])


NODE_CASES = [  # (E, D, M, k)
    (16, 4, 2, 4),
    (32, 8, 4, 6),
    (24, 6, 3, 3),
    (16, 8, 4, 2),
]


@pytest.mark.parametrize("num_experts,num_devices,num_nodes,top_k", NODE_CASES)
@pytest.mark.parametrize("method", ["score", "similarity"])
def test_node_limit_matches_reference(num_experts, num_devices, num_nodes, top_k, method):
    rng = np.random.default_rng(num_experts + 7 * num_devices + top_k)
    T, G, per = 120, num_devices // num_nodes, num_experts // num_devices
    scores = torch.softmax(torch.as_tensor(rng.normal(size=(T, num_experts)) * 2), dim=-1)
    sim = random_similarity(rng, num_experts)
    dev = random_placement(rng, num_experts, num_devices)
    node = dev // G
    dev_t, node_t = torch.as_tensor(dev), torch.as_tensor(node)
    plain_w, plain_ids = torch.topk(scores, top_k, dim=-1)
    for n_node in range(1, num_nodes + 1):
        for n_dev in [None, *range(1, num_devices + 1)]:
            room = n_node * G * per if n_dev is None else min(n_dev * per, n_node * G * per)
            kw = dict(method=method, similarity_EE=sim, max_nodes=n_node, expert_node_E=node_t)
            if room < top_k:
                with pytest.raises(PruningError, match="fewer than top_k"):
                    device_limited_topk(scores, top_k, dev_t, n_dev, **kw)
                continue
            w, ids = device_limited_topk(scores, top_k, dev_t, n_dev, **kw)
            s = sim.numpy() if method == "similarity" else None
            for t in range(T):
                assert ids[t].tolist() == ref_limited(scores[t].numpy(), top_k, dev, node, n_dev, n_node, s), (
                    t,
                    n_node,
                    n_dev,
                )
            # The limits hold for every token; gate weights are the router's scores.
            assert int(devices_per_token(ids, node_t).max()) <= n_node
            if n_dev is not None:
                assert int(devices_per_token(ids, dev_t).max()) <= n_dev
            assert torch.equal(w, scores.gather(1, ids))
            # Tokens already within both limits keep their plain top-k.
            within = devices_per_token(plain_ids, node_t) <= n_node
            if n_dev is not None:
                within &= devices_per_token(plain_ids, dev_t) <= n_dev
            assert torch.equal(ids[within], plain_ids[within])
        # All nodes: the node limit changes nothing (plain top-k; max_devices alone).
        w, ids = device_limited_topk(
            scores, top_k, dev_t, None, method=method, similarity_EE=sim, max_nodes=num_nodes, expert_node_E=node_t
        )
        assert torch.equal(ids, plain_ids) and torch.equal(w, plain_w)
        n_dev = max(1, -(-top_k // per))
        a = device_limited_topk(
            scores, top_k, dev_t, n_dev, method=method, similarity_EE=sim, max_nodes=num_nodes, expert_node_E=node_t
        )
        b = device_limited_topk(scores, top_k, dev_t, n_dev, method=method, similarity_EE=sim)
        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_node_limited_router_and_limit_routers():
    torch.manual_seed(0)
    E, D, M, k = 32, 8, 4, 6
    placement = Placement(np.random.default_rng(1).permutation(np.arange(E) % D), D, num_nodes=M)
    dev = torch.as_tensor(placement.expert_device(0).copy())
    router = TopKRouter(64, E, k, max_nodes=2, devices_per_node=D // M)
    router.set_expert_device(dev)
    x = torch.randn(200, 64)
    w, ids = router(x)
    scores = torch.softmax(router.gate(x), -1)
    want = device_limited_topk(scores, k, dev, None, max_nodes=2, expert_node_E=dev // (D // M))
    assert torch.equal(ids, want[1]) and torch.allclose(w, want[0])
    assert int(devices_per_token(ids, dev // (D // M)).max()) <= 2
    w.sum().backward()
    assert router.gate.weight.grad is not None
    # limit_routers takes the nodes from the placement; both limits at once.
    plain = TopKRouter(64, E, k)
    plain.gate.load_state_dict(router.gate.state_dict())
    limit_routers([plain], placement, 3, max_nodes=2)
    assert plain.max_nodes == 2 and plain.devices_per_node == 2
    _, ids2 = plain(x)
    assert int(devices_per_token(ids2, dev // 2).max()) <= 2 and int(devices_per_token(ids2, dev).max()) <= 3
    limit_routers([plain], placement, None)
    assert plain.max_nodes is None and torch.equal(plain(x)[1], torch.topk(scores, k, -1).indices)
    with pytest.raises(ValueError, match="devices_per_node"):
        TopKRouter(64, E, k, max_nodes=2)
    with pytest.raises(PruningError, match="max_nodes needs expert_node_E"):
        device_limited_topk(scores, k, dev, None, max_nodes=2)
