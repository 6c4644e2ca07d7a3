"""A layer's forward replayed from CUDA graphs (`ExecConfig(graphs=True)`).

An eager expert-parallel forward costs milliseconds of host time (route, plan, pack, all-to-alls,
experts, combine: ~100 launches and their Python), more than its GPU work at prefill sizes. Where
the layer does not wait for the GPU (the device transport, the sync-free schedule, a group of one
rank), a call of a given signature can be recorded once and replayed: the host then costs a copy
in, one graph launch and a copy out.

Under autograd a call is recorded forward and backward (`occult.moe.train_graphs`), the recordings of
one training step in a memory pool of their own (shared in the order they replay).

A graph serves one signature (`GraphCache.run`'s key: this rank's token count, the token count
the ranks agreed on, dtype, autocast and inference mode, the transport's buffer generation, which
router and tensors the layer holds and the router's plain settings: replacing a parameter or the
router, or switching its device limit, means a new graph; updating a tensor in place does not). The
first `EAGER_CALLS` calls of a signature run eagerly (kernels compile, buffers grow), the next one
captures and replays. Every rank agrees with the others once per call on the host whatever it runs
(`occult.moe.layer`), so ranks that replay and ranks that run eagerly stay in step: a capture
records the transport's kernels without running them, and its first replay meets the peers' eager
call.

What a replay leaves behind is copied right after it, on the stream: the output, the routing
statuses (queued, so bad routing is still raised on every rank by a later call or
`check_routing()`) and the row counts of `last_comm_stats`. That makes one memory pool per device
safe for every layer's graphs (none runs while another's outputs are still read). A graph that
captured NCCL collectives (sync-free) is released before any process group is destroyed
(`occult.teardown`).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from occult.moe import status as pending
from occult.moe.capture_stream import autocast_uncached, capture_stream
from occult.moe.train_graphs import TrainingCall, TrainingCapture, capture_training
from occult.teardown import hold_collectives

EAGER_CALLS = 2  # eager calls of a signature before it is captured (compilation, buffer growth)
MAX_GRAPHS = 8  # graphs kept per layer (the least recently used go first)
MAX_TRAINING = 2  # of which training recordings (each holds its saved activations in a training pool)
MAX_SEEN = 1024  # signatures counted towards a capture per layer (forgotten all at once beyond)

_LIVE: dict[int, weakref.WeakSet[torch.cuda.CUDAGraph]] = {}  # device index -> graphs alive there


@dataclass
class Captured:
    """One recorded call: the graph, its input and output tensors, the routing statuses it writes,
    and what its call left for the caller (e.g. `last_comm_stats`)."""

    graph: torch.cuda.CUDAGraph
    x_TH: torch.Tensor
    y_TH: torch.Tensor
    statuses: list[torch.Tensor]
    info: Any  # has `snapshot()`: a copy apart from later replays (`CommStats.snapshot`)

    def busy(self) -> bool:
        """Never: a forward-only replay's output is a copy (`TrainingCapture.busy`)."""
        return False

    def replay(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.x_TH.copy_(x_TH)
        self.graph.replay()
        for status_D in self.statuses:
            pending.queue(status_D)
        return self.y_TH.clone(), self.info.snapshot()


def pool(device: torch.device) -> Any:
    """The memory pool every layer's graphs on `device` share: a live graph's (None when none is
    alive: the capture then makes a new one; a pool goes when its last graph does)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    for graph in _LIVE.get(index, ()):
        return graph.pool()
    return None


def track(graph: torch.cuda.CUDAGraph, device: torch.device) -> None:
    """Count `graph` among the live graphs of `device` (kept weakly)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    _LIVE.setdefault(index, weakref.WeakSet()).add(graph)


class GraphCache:
    """The captured calls of one layer, by signature; `run` replays, or runs eagerly and captures."""

    def __init__(self, eager_calls: int = EAGER_CALLS, max_graphs: int = MAX_GRAPHS) -> None:
        self.eager_calls, self.max_graphs = eager_calls, max_graphs
        self._graphs: OrderedDict[Hashable, Captured | TrainingCapture] = OrderedDict()
        self._seen: dict[Hashable, int] = {}
        self._generation: Hashable = None

    def __len__(self) -> int:
        return len(self._graphs)

    def recordings(self) -> list[Captured | TrainingCapture]:
        """The recorded calls held now, least recently used first."""
        return list(self._graphs.values())

    def __deepcopy__(self, memo: dict) -> GraphCache:
        """A copied layer (`copy.deepcopy(model)`) starts with no graphs: they hold the original's tensors."""
        return GraphCache(self.eager_calls, self.max_graphs)

    def __getstate__(self) -> dict:
        """Pickled (`torch.save(model)`) without its graphs, which cannot be."""
        return {"eager_calls": self.eager_calls, "max_graphs": self.max_graphs}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["eager_calls"], state["max_graphs"])

    def run(
        self,
        key: Hashable,
        generation: Hashable,
        x_TH: torch.Tensor,
        forward: Callable[[torch.Tensor], torch.Tensor],
        info: Callable[[], Any],
        training: TrainingCall | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """`forward(x_TH)` and `info()` after it: replayed where `key` was captured, else eager (and
        captured once `key` has run eagerly `eager_calls` times). With `training` (a training call: the
        parameters that train) the backward is recorded too (`occult.moe.train_graphs`); a recorded
        training call whose last output still waits for its backward runs eagerly. A new `generation` (the transport's
        buffers were replaced) drops every graph, not the calls counted: a signature already seen is
        captured again at once (it needs no growth: buffers only grow), and a new layer whose first
        call grew the buffers is captured as early as one whose buffers were there already."""
        if generation != self._generation:
            self._graphs.clear()
            self._generation = generation
        captured = self._graphs.get(key)
        if captured is not None and captured.busy():  # its last output still waits for its backward
            return forward(x_TH), info()
        if captured is None:
            if len(self._seen) >= MAX_SEEN:
                self._seen.clear()
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            if seen <= self.eager_calls:
                return forward(x_TH), info()
            if training is None:
                captured = self._capture(x_TH, forward, info)
            else:
                captured = self._capture_training(x_TH, training, forward, info)
            if torch.distributed.is_initialized():
                hold_collectives(self)
            self._graphs[key] = captured
            self._evict(training is not None)
        else:
            self._graphs.move_to_end(key)
        return captured.replay(x_TH)

    def _capture(
        self, x_TH: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor], info: Callable[[], Any]
    ) -> Captured:
        static_x = x_TH.clone()
        graph = torch.cuda.CUDAGraph()
        stream, shared = capture_stream(x_TH.device), pool(x_TH.device)
        with pending.recording() as statuses, autocast_uncached(), torch.cuda.graph(graph, pool=shared, stream=stream):
            static_y = forward(static_x)
        track(graph, x_TH.device)
        return Captured(graph, static_x, static_y, statuses, info())

    def _evict(self, training: bool) -> None:
        """Drop the least recently used recordings beyond `max_graphs`, and training ones beyond
        `MAX_TRAINING` (one whose backward is still due lives on in its autograd node until then)."""
        if training:
            keys = [k for k, c in self._graphs.items() if isinstance(c, TrainingCapture)]
            for key in keys[: max(0, len(keys) - MAX_TRAINING)]:
                del self._graphs[key]
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)

    def _capture_training(
        self, x_TH: torch.Tensor, training: TrainingCall, forward: Callable[[torch.Tensor], torch.Tensor], info
    ) -> TrainingCapture:
        return capture_training(x_TH, training, forward, info)

    def release(self) -> None:
        """Free every graph (they are captured again on later calls)."""
        self._graphs.clear()
        self._seen.clear()


def call_key(
    x_TH: torch.Tensor,
    agreed: int | None,
    trains: Hashable,
    schedule: Hashable,
    router: torch.nn.Module,
    modules: tuple[torch.nn.Module, ...],
) -> tuple:
    """The signature a recorded layer call serves: token counts (this rank's, the agreed one), whether and
    what it trains (`trains`), dtype, autocast and inference mode, the schedule (`schedule`: sync-free, its
    capacity), which router, the router's
    settings (its device limit switched in place, e.g. a distillation teacher's unlimited routing, needs a
    graph of its own) and which tensors `modules` hold."""
    device_type = x_TH.device.type
    return (
        x_TH.shape[0],
        agreed,
        trains,
        x_TH.dtype,
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_inference_mode_enabled(),
        schedule,
        id(router),
        settings_key(router),
        tensors_key(*modules),
    )


def submodules(*modules: torch.nn.Module) -> list[torch.nn.Module]:
    """`modules` and every module inside them, each once (`Module.modules()` without its name strings: this
    runs several times a replayed call)."""
    found: dict[int, torch.nn.Module] = {}
    todo = list(modules)
    while todo:
        m = todo.pop()
        if id(m) not in found:
            found[id(m)] = m
            todo.extend(child for child in m._modules.values() if child is not None)
    return list(found.values())


def tensors_key(*modules: torch.nn.Module) -> tuple:
    """Which tensors modules hold (the addresses of their parameters and buffers): a graph recorded
    them, so a replaced one needs another graph."""
    return tuple(
        t.data_ptr()
        for m in submodules(*modules)
        for t in (*m._parameters.values(), *m._buffers.values())
        if t is not None
    )


def settings_key(*modules: torch.nn.Module) -> tuple:
    """The plain settings modules hold (their int, float, str, bool and None attributes, e.g. a router's
    `max_devices`): a graph recorded the code path they chose, so a setting changed in place needs another
    graph."""
    return tuple((name, value) for m in modules for name, value in vars(m).items() if type(value) in _PLAIN)


_PLAIN = frozenset((int, float, str, bool, type(None)))


def has_hooks(*modules: torch.nn.Module, recorded: Callable[[torch.nn.Module, Callable], bool] | None = None) -> bool:
    """Whether any of `modules` or any module inside them has forward hooks or pre-hooks, or any global
    module hook is set: a replayed call would not run them. Hooks marked `replay_safe` (a function attribute:
    what they do, a replay does too, e.g. reading the routing statuses it queues) do not count, nor those
    `recorded(module, hook)` accepts (the caller knows a recording holds all they do)."""
    from torch.nn.modules import module as nn_module

    hooks = [*nn_module._global_forward_hooks.values(), *nn_module._global_forward_pre_hooks.values()]
    for m in submodules(*modules):
        for hook in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]:
            if recorded is None or not recorded(m, hook):
                hooks.append(hook)
    return any(not getattr(hook, "replay_safe", False) for hook in hooks)
