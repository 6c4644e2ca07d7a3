"""`ExecConfig(graphs=True)` on CPU: the setting, the layer running eagerly where graphs do not
apply, and `GraphCache`'s bookkeeping (when a signature is captured, replayed, evicted, dropped)
with the capture stood in by a recording of the forward (CUDA graphs themselves are tested in
tests/gpu/test_collective_layer_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from occult import CommStats, DenseMoE, ExecConfig, OccultMoE, set_graphs
from occult.moe.comm import DeviceCommStats
from occult.moe.graphs import GraphCache, settings_key


class StoodIn:
    """What `_capture` returns in these tests: replays call the forward recorded at capture."""

    def __init__(self, forward, info) -> None:
        self.forward, self.info, self.replays = forward, info, 0

    def busy(self) -> bool:
        return False

    def replay(self, x_TH):
        self.replays += 1
        return self.forward(x_TH), self.info.snapshot()


class StoodInCache(GraphCache):
    def _capture(self, x_TH, forward, info):
        self.captures = getattr(self, "captures", 0) + 1
        return StoodIn(forward, info())


def test_exec_config_graphs_is_checked_and_off_by_default():
    assert ExecConfig().graphs is False
    with pytest.raises(ValueError, match="graphs must be True or False"):
        ExecConfig(graphs="yes")


def test_a_signature_runs_eagerly_then_is_captured_once_and_replayed():
    cache = StoodInCache(eager_calls=2, max_graphs=8)
    calls = []

    def forward(x):
        calls.append(x.shape[0])
        return x * 2

    x = torch.randn(3, 4)
    outs = [cache.run(("a",), 0, x, forward, CommStats)[0] for _ in range(5)]
    assert all(torch.equal(o, x * 2) for o in outs)
    assert cache.captures == 1 and len(cache) == 1
    assert cache._graphs[("a",)].replays == 3  # calls 3 (the capture's own replay), 4 and 5


def test_graphs_are_evicted_least_recently_used_and_dropped_on_a_new_generation():
    cache = StoodInCache(eager_calls=0, max_graphs=2)
    x = torch.randn(2, 2)
    for key in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" arrives
        cache.run(key, 0, x, lambda t: t, CommStats)
    assert set(cache._graphs) == {"a", "c"}
    cache.run("a", 1, x, lambda t: t, CommStats)  # the transport's buffers were replaced
    assert set(cache._graphs) == {"a"} and cache.captures == 4


def test_a_new_generation_drops_the_graphs_but_not_the_calls_counted():
    """A growth (here: inside the first call, as a fresh layer's first call grows the shared transport)
    drops the graphs; signatures already seen are captured again at once, the others at their usual call."""
    cache = StoodInCache(eager_calls=2, max_graphs=8)
    x = torch.randn(2, 2)
    generations = [0, 1, 1, 1, 2, 2]  # the first call grew the buffers; call 5 found them grown again
    held = []
    for generation in generations:
        cache.run("a", generation, x, lambda t: t, CommStats)
        held.append(len(cache))
    assert held == [0, 0, 1, 1, 1, 1] and cache.captures == 2  # captured at its third call, again at call 5
    cache.run("b", 2, x, lambda t: t, CommStats)
    assert "b" not in cache._graphs  # a new signature still runs eagerly first


def test_device_comm_stats_snapshot_copies_the_counts():
    stats = DeviceCommStats(rank=0, levels=None)
    counts_D = torch.tensor([3, 5])
    stats.add(counts_D, 8, 4, False, "dispatch")
    snap = stats.snapshot()
    counts_D.fill_(0)  # a later replay rewrites the counts the graph reads
    assert snap.dispatch_rows == 8 and snap.forward_remote_rows == 5
    assert stats.dispatch_rows == 0
    plain = CommStats(forward_rows=2)
    assert plain.snapshot() == plain and plain.snapshot() is not plain


def test_layer_with_graphs_runs_eagerly_on_cpu_and_set_graphs_switches_every_layer():
    torch.manual_seed(0)
    dense = DenseMoE(16, 8, 4, 2)
    layer = OccultMoE.from_dense(dense, graphs=True)
    x = torch.randn(7, 16)
    with torch.no_grad():
        assert not layer.replays(x)
        torch.testing.assert_close(layer(x), dense(x), rtol=1e-5, atol=1e-6)
    assert len(layer.graphs) == 0 and "graphs=True" in repr(layer)
    model = torch.nn.Sequential(layer, OccultMoE.from_dense(dense))
    assert set_graphs(model, False) == 2 and not layer.execution.graphs and "graphs" not in repr(layer)
    assert set_graphs(model) == 2 and all(m.execution.graphs for m in model)


def test_a_copied_or_pickled_layer_starts_without_graphs():
    import copy
    import pickle

    cache = StoodInCache(eager_calls=0)
    cache.run("a", 0, torch.randn(2, 2), lambda t: t, CommStats)
    assert len(cache) == 1
    for fresh in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert len(fresh) == 0 and fresh.eager_calls == 0 and isinstance(fresh, GraphCache)
    layer = OccultMoE(16, 8, 4, 2, graphs=True)
    assert len(copy.deepcopy(layer).graphs) == 0


def test_a_routers_setting_switched_in_place_changes_the_graph_key():
    """A replay records the routing code its router's settings chose: switching a device limit in place (a
    distillation teacher's unlimited routing) must not replay the limited graph. Same settings, same key."""
    from occult.moe.pruning import limit_routers
    from occult.placement import Placement

    layer = OccultMoE(16, 8, 8, 2)
    x_TH = torch.randn(5, 16)
    limit_routers([layer.router], Placement.contiguous(8, 4), 2)
    limited = layer.graph_key(x_TH, None, None)
    assert layer.graph_key(x_TH, None, None) == limited
    layer.router.max_devices = None  # the switch a teacher's forward makes (occult.training.distill.unlimited)
    unlimited = layer.graph_key(x_TH, None, None)
    assert unlimited != limited and unlimited[:-2] == limited[:-2] and unlimited[-1] == limited[-1]
    layer.router.max_devices = 2
    assert layer.graph_key(x_TH, None, None) == limited
    assert settings_key(layer.router) != () and all(
        isinstance(value, (int, float, str, bool, type(None))) for _, value in settings_key(layer.router)
    )


def test_recordings_run_with_autocasts_weight_cache_off_and_the_region_keeps_its_own():
    """A recording must make its own weight casts, not read copies cached before it that its region frees
    (occult.moe.capture_stream): inside `autocast_uncached` autocast stands as it was, its cache off; after it
    the region's cache is on again; outside autocast it changes nothing."""
    from occult.moe.capture_stream import autocast_uncached

    with torch.autocast("cpu", torch.bfloat16):
        assert torch.is_autocast_cache_enabled()
        with autocast_uncached("cpu"):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert not torch.is_autocast_cache_enabled()
        assert torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled()
    with autocast_uncached("cpu"):
        assert not torch.is_autocast_enabled("cpu")
