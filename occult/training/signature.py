"""What a recorded training step depends on besides its inputs (`model_signature`), and `ModelSignature`: the same
value for a step to ask every time, at the cost of an identity check while nothing changed.

A replayed step (`occult.training.step_graph`) reads the memory of every tensor the model held when it was
recorded and takes the code paths its modules' settings chose then, so before each replay the step compares the
model's signature with the recording's. Computed in full, that walks every module and reads each setting and
each tensor's address: ~0.6 ms of host time on a 2-core CPU and ~1.5 ms on an H200 host for the 231 modules of a
16-layer OLMoE, which the GPU waits for whenever the step starts from an idle GPU (docs/training.md). Between
steps nothing is normally changed, so `ModelSignature` keeps what every module's attribute, child, parameter and
buffer dictionaries held at its last full computation and first checks, in C loops, that the attributes are equal,
the children, parameters and buffers the same objects and each tensor still at its address; only where one is not
does it compute the signature again. Captured forwards check it too (`hf.GraphedForward` before every replay,
`hf.generate`'s kept decoder once a call): a changed model is captured again.
"""

from __future__ import annotations

import operator
from itertools import chain

import torch
import torch.nn as nn

from occult.moe.graphs import settings_key, submodules, tensors_key
from occult.moe.layer import OccultMoE


def model_signature(model: nn.Module) -> tuple:
    """What a recorded step depends on besides its inputs: the tensors `model` holds (addresses), its
    modules' plain settings (a router's device limit, train/eval) and its device transports' buffer
    generations."""
    modules = submodules(model)
    generations = tuple(transport_generation(m) for m in modules if isinstance(m, OccultMoE))
    return tensors_key(model), settings_key(*modules), generations


def transport_generation(layer: OccultMoE) -> int | None:
    """The layer's device transport's buffer generation (it grows when a call needs larger buffers: a recording
    made before then reads freed ones), None where the layer exchanges through no such buffers."""
    if layer.num_ranks == 1 or layer.sync_free:
        return None
    return getattr(layer.dispatcher.transport, "generation", None)


class ModelSignature:
    """`model_signature(model)`, recomputed only when it may have changed (module docstring): a step's
    `signature` callable (`StepParts.signature`, `StepGraph`).

    Sound because everything `model_signature` reads is reached through what it keeps: each module's attributes
    (a copy of its `__dict__`, compared by value as `model_signature` compares settings: a setting switched, added,
    removed or renamed, or another children, parameter or buffer dictionary, shows), each module's children,
    parameters and buffers (the same objects, in order), those tensors' addresses (`.data = ...` moves one), and
    the transports' generations, read afresh on every call. A comparison that raises (an attribute whose `==` has
    no single truth value, e.g. a tensor replaced by another) counts as a change."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._value: tuple | None = None
        self._layers: list[OccultMoE] = []
        self._attrs: list[dict] = []
        self._attr_copies: list[dict] = []
        self._holders: list[dict] = []
        self._held: tuple = ()
        self._tensors: list[torch.Tensor] = []
        self._addresses: list[int] = []

    def __call__(self) -> tuple:
        if self._value is None or not self._unchanged():
            self._refresh()
        tensors, settings, _ = self._value
        return tensors, settings, tuple(transport_generation(m) for m in self._layers)

    def _unchanged(self) -> bool:
        """Whether every module's attributes equal their copies, its children, parameters and buffers are the same
        objects, and every tensor sits where it did (C loops: ~0.1 ms for 231 modules)."""
        held = tuple(chain.from_iterable(map(dict.values, self._holders)))
        try:
            same_attrs = self._attrs == self._attr_copies
        except Exception:  # an attribute's `==` without a truth value: changed
            return False
        return (
            same_attrs
            and len(held) == len(self._held)
            and all(map(operator.is_, held, self._held))
            and list(map(torch.Tensor.data_ptr, self._tensors)) == self._addresses
        )

    def _refresh(self) -> None:
        modules = submodules(self.model)
        self._value = model_signature(self.model)
        self._layers = [m for m in modules if isinstance(m, OccultMoE)]
        self._attrs = [vars(m) for m in modules]
        self._attr_copies = [dict(d) for d in self._attrs]
        self._holders = [d for m in modules for d in (m._modules, m._parameters, m._buffers)]
        self._held = tuple(chain.from_iterable(map(dict.values, self._holders)))
        self._tensors = [t for t in self._held if isinstance(t, torch.Tensor)]
        self._addresses = list(map(torch.Tensor.data_ptr, self._tensors))


__all__ = ["model_signature", "transport_generation", "ModelSignature"]
