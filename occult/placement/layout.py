"""Expert placement: which device holds which expert, per MoE layer.

A `Placement` maps every expert of every layer to a device, with exactly E/D experts per
device. On a device, experts sit in *local slots* in ascending global-id order. The
"placed order" of a layer lists device 0's experts, then device 1's, ...; permuting expert
weights into placed order and sharding contiguously gives every rank its experts.

File format (JSON; README.md, section Files):
    {"num_devices": D, "num_experts": E, "layers": [[device of expert 0, ...], ...]}
plus, for a hierarchical placement, `"num_nodes": M`: devices are numbered node-major (node n
holds devices [n*D/M, (n+1)*D/M)); readers that do not know the key see a flat placement.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from occult._atomic import write_text_atomic


class PlacementError(ValueError):
    """A placement that is malformed or does not fit the model it is used with."""


def check_divisible(num_experts: int, num_devices: int) -> int:
    """Return E/D, or raise a clear error when experts cannot be split evenly over devices."""
    if num_devices < 1:
        raise PlacementError(f"num_devices must be >= 1, got {num_devices}")
    if num_experts < 1:
        raise PlacementError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts % num_devices:
        raise PlacementError(
            f"{num_experts} experts cannot be split evenly over {num_devices} devices: "
            f"expert parallelism needs num_experts divisible by the number of devices "
            f"(try {', '.join(str(d) for d in range(1, num_experts + 1) if num_experts % d == 0)})"
        )
    return num_experts // num_devices


def _json_count(doc: dict[str, Any], key: str, source: str) -> int:
    """`doc[key]` of a placement file: a positive integer (not a bool, float or string)."""
    value = doc[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise PlacementError(f"{source}: {key!r} must be a positive integer, got {shown}")
    return value


@dataclass(frozen=True)
class Placement:
    """Per-layer expert -> device map with equal experts per device.

    `expert_device_LE[l, e]` is the device of expert `e` in layer `l`. `num_nodes` groups the
    devices into nodes of D/M consecutive ids (node of device d: d // (D/M)); 1 is flat.
    """

    expert_device_LE: np.ndarray
    num_devices: int
    num_nodes: int = 1
    _slot_LE: np.ndarray = field(init=False, repr=False, compare=False)
    _order_LE: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        arr = np.asarray(self.expert_device_LE)
        if arr.ndim == 1:
            arr = arr[None, :]
        if arr.ndim != 2 or arr.shape[0] < 1:
            raise PlacementError(f"a placement needs one row of expert devices per layer, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            if np.issubdtype(arr.dtype, np.floating) and np.all(np.mod(arr, 1) == 0):
                arr = arr.astype(np.int64)
            else:
                raise PlacementError(f"expert devices must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
        num_layers, num_experts = arr.shape
        per_device = check_divisible(num_experts, int(self.num_devices))
        if arr.min() < 0 or arr.max() >= self.num_devices:
            bad = np.argwhere((arr < 0) | (arr >= self.num_devices))[0]
            raise PlacementError(
                f"layer {bad[0]}, expert {bad[1]}: device {arr[bad[0], bad[1]]} is out of range [0, {self.num_devices})"
            )
        counts_LD = np.stack([np.bincount(row, minlength=self.num_devices) for row in arr])
        unbalanced = np.argwhere(counts_LD != per_device)
        if len(unbalanced):
            l, d = unbalanced[0]
            raise PlacementError(
                f"layer {l}: device {d} holds {counts_LD[l, d]} experts, but every device must "
                f"hold exactly {num_experts} / {self.num_devices} = {per_device}"
            )
        if int(self.num_nodes) < 1 or self.num_devices % int(self.num_nodes):
            raise PlacementError(
                f"num_nodes={self.num_nodes} must be >= 1 and divide num_devices={self.num_devices} "
                "(every node holds the same number of devices)"
            )
        arr.setflags(write=False)
        object.__setattr__(self, "expert_device_LE", arr)
        object.__setattr__(self, "num_devices", int(self.num_devices))
        object.__setattr__(self, "num_nodes", int(self.num_nodes))
        # Placed order: sort by (device, expert id); stable argsort keeps ids ascending.
        order = np.argsort(arr, axis=1, kind="stable")
        slot = np.empty_like(arr)
        rows = np.arange(num_layers)[:, None]
        slot[rows, order] = np.arange(num_experts)[None, :] % per_device
        order.setflags(write=False)
        slot.setflags(write=False)
        object.__setattr__(self, "_order_LE", order)
        object.__setattr__(self, "_slot_LE", slot)

    # ------------------------------------------------------------------ shape
    @property
    def num_layers(self) -> int:
        return int(self.expert_device_LE.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.expert_device_LE.shape[1])

    @property
    def experts_per_device(self) -> int:
        return self.num_experts // self.num_devices

    @property
    def devices_per_node(self) -> int:
        return self.num_devices // self.num_nodes

    def expert_node(self, layer: int = 0) -> np.ndarray:
        """[E] node of each expert (device // devices_per_node)."""
        return self.expert_device(layer) // self.devices_per_node

    # ----------------------------------------------------------- constructors
    @classmethod
    def contiguous(cls, num_experts: int, num_devices: int, num_layers: int = 1, num_nodes: int = 1) -> Placement:
        """The layout every framework uses: experts [d*E/D, (d+1)*E/D) on device d."""
        per_device = check_divisible(num_experts, num_devices)
        row = np.arange(num_experts) // per_device
        return cls(np.tile(row, (num_layers, 1)), num_devices, num_nodes)

    @classmethod
    def from_lists(cls, layers: Sequence[Sequence[int]], num_devices: int) -> Placement:
        return cls(np.asarray(layers, dtype=np.int64), num_devices)

    # ------------------------------------------------------------- per layer
    def _check_layer(self, layer: int) -> int:
        if not -self.num_layers <= layer < self.num_layers:
            raise PlacementError(f"layer {layer} is out of range: this placement has {self.num_layers} layer(s)")
        return layer % self.num_layers

    def layer(self, layer: int) -> Placement:
        """A one-layer placement holding only `layer`."""
        return Placement(self.expert_device_LE[self._check_layer(layer)][None], self.num_devices, self.num_nodes)

    def for_layers(self, num_layers: int) -> Placement:
        """This placement with one row per layer of a model with `num_layers` MoE layers: itself, or a
        one-layer placement repeated (it serves every layer); any other layer count is an error."""
        if self.num_layers == num_layers:
            return self
        if self.num_layers == 1:
            return Placement(np.repeat(self.expert_device_LE, num_layers, axis=0), self.num_devices, self.num_nodes)
        raise PlacementError(
            f"the placement has {self.num_layers} layer(s), but the model has {num_layers} MoE layers: "
            "give one row per MoE layer, or one row for all of them"
        )

    def expert_device(self, layer: int = 0) -> np.ndarray:
        """[E] device of each expert."""
        return self.expert_device_LE[self._check_layer(layer)]

    def expert_slot(self, layer: int = 0) -> np.ndarray:
        """[E] local slot of each expert on its device."""
        return self._slot_LE[self._check_layer(layer)]

    def placed_order(self, layer: int = 0) -> np.ndarray:
        """[E] global expert ids in placed order (device 0's slots, then device 1's, ...)."""
        return self._order_LE[self._check_layer(layer)]

    def experts_on_device(self, device: int, layer: int = 0) -> np.ndarray:
        """[E/D] global ids of the experts on `device`, in local-slot order."""
        if not 0 <= device < self.num_devices:
            raise PlacementError(f"device {device} out of range [0, {self.num_devices})")
        n = self.experts_per_device
        return self.placed_order(layer)[device * n : (device + 1) * n]

    def tensors(self, layer: int = 0, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert_device_E, expert_slot_E) as int64 tensors, for use inside a layer."""
        dev = torch.as_tensor(self.expert_device(layer).copy(), dtype=torch.int64, device=device)
        slot = torch.as_tensor(self.expert_slot(layer).copy(), dtype=torch.int64, device=device)
        return dev, slot

    def check_fits(self, num_experts: int, num_devices: int, num_layers: int | None = None) -> None:
        """Raise a clear error if this placement was made for another model or device count."""
        if self.num_experts != num_experts:
            raise PlacementError(
                f"the placement is for {self.num_experts} experts, but the model has {num_experts}: "
                f"make a placement from a trace of this model (occult place)"
            )
        if self.num_devices != num_devices:
            raise PlacementError(
                f"the placement is for {self.num_devices} devices, but the process group has "
                f"{num_devices} ranks: make one with `occult place --devices {num_devices}`"
            )
        if num_layers is not None and self.num_layers != num_layers:
            raise PlacementError(
                f"the placement has {self.num_layers} layer(s), but the model has {num_layers} MoE layers"
            )

    # ------------------------------------------------------ apply / invert
    def apply(self, weights_E: torch.Tensor, layer: int = 0, dim: int = 0) -> torch.Tensor:
        """Reorder a per-expert tensor (weights, router rows) from expert-id order to placed order."""
        order = torch.as_tensor(self.placed_order(layer).copy(), device=weights_E.device)
        self._check_dim(weights_E, dim)
        return weights_E.index_select(dim, order)

    def invert(self, weights_placed: torch.Tensor, layer: int = 0, dim: int = 0) -> torch.Tensor:
        """Inverse of `apply`: from placed order back to expert-id order."""
        order = self.placed_order(layer)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        self._check_dim(weights_placed, dim)
        return weights_placed.index_select(dim, torch.as_tensor(inverse, device=weights_placed.device))

    def shard(self, weights_E: torch.Tensor, device: int, layer: int = 0, dim: int = 0) -> torch.Tensor:
        """The slice of a per-expert tensor that `device` holds, in local-slot order."""
        self._check_dim(weights_E, dim)
        ids = torch.as_tensor(self.experts_on_device(device, layer).copy(), device=weights_E.device)
        return weights_E.index_select(dim, ids)

    def placed_index(self, layer: int = 0) -> np.ndarray:
        """[E] position of each expert in placed order (device * E/D + slot): the inverse of `placed_order`."""
        return self.expert_device(layer) * self.experts_per_device + self.expert_slot(layer)

    def remap_ids(self, topk_ids: torch.Tensor | np.ndarray, layer: int = 0) -> torch.Tensor | np.ndarray:
        """Map expert ids to placed-order ids (`placed_index`): the ids a router whose rows were
        permuted with `apply` produces for the same tokens. Same type and shape as the input."""
        index = self.placed_index(layer)
        if isinstance(topk_ids, torch.Tensor):
            lut = torch.as_tensor(index, dtype=topk_ids.dtype, device=topk_ids.device)
            return lut[topk_ids.long()]
        ids = np.asarray(topk_ids)
        return index.astype(ids.dtype, copy=False)[ids]

    def apply_all(self, tensors: dict[str, torch.Tensor], layer: int = 0, dim: int = 0) -> dict[str, torch.Tensor]:
        """`apply` to every per-expert tensor of a mapping (e.g. one layer's expert weights and router rows)."""
        return {name: self.apply(t, layer, dim) for name, t in tensors.items()}

    def invert_all(self, tensors: dict[str, torch.Tensor], layer: int = 0, dim: int = 0) -> dict[str, torch.Tensor]:
        """`invert` for every tensor of a mapping."""
        return {name: self.invert(t, layer, dim) for name, t in tensors.items()}

    def _check_dim(self, t: torch.Tensor, dim: int) -> None:
        if t.shape[dim] != self.num_experts:
            raise PlacementError(
                f"tensor has {t.shape[dim]} entries along dim {dim}, but the placement has {self.num_experts} experts"
            )

    # ------------------------------------------------------------------- I/O
    def to_json_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "num_devices": self.num_devices,
            "num_experts": self.num_experts,
            "layers": self.expert_device_LE.tolist(),
        }
        if self.num_nodes > 1:
            doc["num_nodes"] = self.num_nodes
        return doc

    def save(self, path: str | os.PathLike, extra: dict[str, Any] | None = None) -> None:
        """Write the JSON file atomically (temporary file, then rename)."""
        doc = self.to_json_dict()
        if extra:
            doc.update({k: v for k, v in extra.items() if k not in doc})
        write_text_atomic(path, json.dumps(doc, indent=None, separators=(",", ":")) + "\n")

    @classmethod
    def from_json_dict(cls, doc: Any, source: str = "placement") -> Placement:
        if not isinstance(doc, dict):
            raise PlacementError(f"{source}: expected a JSON object, got {type(doc).__name__}")
        missing = [k for k in ("num_devices", "num_experts", "layers") if k not in doc]
        if missing:
            raise PlacementError(
                f"{source}: missing key(s) {missing}; expected {{'num_devices', 'num_experts', 'layers'}}"
            )
        num_devices, num_experts = (_json_count(doc, k, source) for k in ("num_devices", "num_experts"))
        nodes = _json_count(doc, "num_nodes", source) if "num_nodes" in doc else 1
        layers = doc["layers"]
        if not isinstance(layers, list) or not layers or not all(isinstance(r, list) for r in layers):
            raise PlacementError(f"{source}: 'layers' must be a non-empty list of lists of device ids")
        for i, row in enumerate(layers):
            if len(row) != num_experts:
                raise PlacementError(f"{source}: layer {i} lists {len(row)} experts, but num_experts is {num_experts}")
            bad = next(
                (v for v in row if not isinstance(v, int) or isinstance(v, bool) or not -(2**63) <= v < 2**63), None
            )
            if bad is not None:  # an int64 here; the range check proper is Placement's
                raise PlacementError(
                    f"{source}: layer {i} holds device id {bad!r:.40}, not an integer in [0, {num_devices})"
                )
        try:
            return cls(np.asarray(layers, dtype=np.int64), num_devices, nodes)
        except PlacementError as exc:
            raise PlacementError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Placement:
        """Read and validate a placement JSON file."""
        try:
            text = open(path).read()
        except FileNotFoundError:
            raise PlacementError(f"placement file {path} does not exist") from None
        except UnicodeDecodeError:
            raise PlacementError(f"{path} is not a placement JSON file (binary, not text); is it a trace?") from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlacementError(f"{path} is not valid JSON ({exc}); is the file truncated or corrupted?") from None
        except RecursionError:
            raise PlacementError(f"{path} is not a placement JSON file (nested too deeply)") from None
        return cls.from_json_dict(doc, source=str(path))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Placement)
            and self.num_devices == other.num_devices
            and self.num_nodes == other.num_nodes
            and np.array_equal(self.expert_device_LE, other.expert_device_LE)
        )

    def __hash__(self) -> int:
        return hash((self.num_devices, self.num_nodes, self.expert_device_LE.tobytes()))
