"""Routing traces: which experts every token picked, per MoE layer (safetensors on disk).

File format (README.md, section Files):
    tensors   `layers.{i}.topk_ids`  integer [tokens, top_k], expert ids in [0, num_experts)
              `layers.{i}.scores`    optional float [tokens, num_experts] or [tokens, top_k]
    metadata  `num_experts` and `top_k` (strings); anything else is kept as free-form metadata.

Layers are numbered 0..L-1 without gaps. Ids are written as int16 when they fit (int32
otherwise) to keep calibration traces small; any integer dtype is accepted on read. Every
token's k experts must be distinct. `read_trace` validates everything and raises a
`TraceError` that says what is wrong and how to fix it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from occult._atomic import atomic_path

TOPK_KEY = "layers.{}.topk_ids"
SCORES_KEY = "layers.{}.scores"
_KEY_RE = re.compile(r"^layers\.(0|[1-9]\d*)\.(topk_ids|scores)$")  # no leading zeros: "layers.00" is not layer 0
_RESERVED_META = ("num_experts", "top_k", "num_layers", "format")
FORMAT_TAG = "occult-trace-v1"


class TraceError(ValueError):
    """A routing trace that is missing, malformed or inconsistent."""


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def ids_dtype(num_experts: int) -> np.dtype:
    """The compact on-disk dtype for expert ids: int16 when E fits, else int32."""
    return np.dtype(np.int16) if num_experts <= np.iinfo(np.int16).max else np.dtype(np.int32)


@dataclass
class Trace:
    """Per-layer top-k expert ids (and optional router scores) of a set of tokens.

    `topk_ids[l]` is `topk_ids_TK` of layer `l`; layers may hold different token counts.
    Construction validates (see `validate`); pass numpy arrays or torch tensors.
    """

    topk_ids: list[np.ndarray]
    num_experts: int
    top_k: int | None = None
    scores: list[np.ndarray | None] | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.topk_ids, (np.ndarray, torch.Tensor)) and np.ndim(self.topk_ids) == 2:
            self.topk_ids = [self.topk_ids]  # a single layer
        self.topk_ids = [_as_numpy(t) for t in self.topk_ids]
        if self.scores is None:
            self.scores = [None] * len(self.topk_ids)
        else:
            self.scores = [None if s is None else _as_numpy(s) for s in self.scores]
        try:
            self.num_experts = int(self.num_experts)
        except (TypeError, ValueError):
            raise TraceError(f"num_experts must be an integer, got {self.num_experts!r}") from None
        if self.top_k is None and self.topk_ids and self.topk_ids[0].ndim == 2:
            self.top_k = int(self.topk_ids[0].shape[1])
        self.metadata = {str(k): str(v) for k, v in dict(self.metadata).items()}
        self.validate()

    # ------------------------------------------------------------------ shape
    @property
    def num_layers(self) -> int:
        return len(self.topk_ids)

    @property
    def num_tokens(self) -> list[int]:
        """Tokens per layer."""
        return [int(t.shape[0]) for t in self.topk_ids]

    def layer(self, i: int) -> np.ndarray:
        """`topk_ids_TK` of layer `i`."""
        if not -self.num_layers <= i < self.num_layers:
            raise TraceError(f"layer {i} is out of range: the trace has {self.num_layers} layer(s)")
        return self.topk_ids[i]

    def select_layers(self, layers: Sequence[int]) -> Trace:
        """A trace holding only the given layers (renumbered 0..)."""
        return Trace(
            [self.layer(i) for i in layers],
            self.num_experts,
            self.top_k,
            [self.scores[i] for i in layers],
            dict(self.metadata),
        )

    # ------------------------------------------------------------- validate
    def validate(self, source: str = "trace") -> None:
        """Check shapes, dtypes, id ranges and distinct ids per token; raise `TraceError`."""
        E, K = self.num_experts, self.top_k
        if E < 1:
            raise TraceError(f"{source}: num_experts must be >= 1, got {E}")
        if not self.topk_ids:
            raise TraceError(
                f"{source}: no layers; a trace needs tensors named 'layers.0.topk_ids', 'layers.1.topk_ids', ..."
            )
        if K is None or not 1 <= int(K) <= E:
            raise TraceError(f"{source}: top_k must be in [1, num_experts={E}], got {K}")
        self.top_k = K = int(K)
        if len(self.scores) != len(self.topk_ids):
            raise TraceError(
                f"{source}: {len(self.scores)} score entries for {len(self.topk_ids)} layers "
                "(use None for layers without scores)"
            )
        for i, ids in enumerate(self.topk_ids):
            name = f"{source}: layer {i} ({TOPK_KEY.format(i)})"
            if ids.ndim != 2:
                raise TraceError(f"{name} must have shape [tokens, top_k], got shape {list(ids.shape)}")
            if ids.shape[1] != K:
                raise TraceError(
                    f"{name} has {ids.shape[1]} ids per token, but top_k is {K}: every layer must "
                    "hold exactly top_k expert ids per token"
                )
            if ids.shape[0] == 0:
                raise TraceError(f"{name} holds no tokens; record at least one batch per layer")
            if not np.issubdtype(ids.dtype, np.integer):
                raise TraceError(
                    f"{name} has dtype {ids.dtype}, expected an integer dtype (int16/int32/int64 expert ids)"
                )
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= E:
                bad = int(np.argmax((ids < 0).any(1) | (ids >= E).any(1)))
                raise TraceError(
                    f"{name}: expert id {lo if lo < 0 else hi} is out of range [0, {E}) (first at token "
                    f"{bad}: {ids[bad].tolist()}); is num_experts in the metadata right, or were ids "
                    "recorded after a placement permutation?"
                )
            if K > 1:
                srt = np.sort(ids, axis=1)
                dup = (srt[:, 1:] == srt[:, :-1]).any(1)
                if dup.any():
                    t = int(np.argmax(dup))
                    raise TraceError(
                        f"{name}: token {t} picks an expert more than once ({ids[t].tolist()}); "
                        "top-k ids of a token must be distinct"
                    )
            s = self.scores[i]
            if s is None:
                continue
            sname = f"{source}: layer {i} ({SCORES_KEY.format(i)})"
            if not np.issubdtype(s.dtype, np.floating):
                raise TraceError(f"{sname} has dtype {s.dtype}, expected a float dtype")
            if s.ndim != 2 or s.shape[0] != ids.shape[0] or s.shape[1] not in (E, K):
                raise TraceError(
                    f"{sname} has shape {list(s.shape)}, expected [{ids.shape[0]}, {E}] (all experts) "
                    f"or [{ids.shape[0]}, {K}] (chosen experts)"
                )

    # ------------------------------------------------------------------- I/O
    def save(self, path: str | os.PathLike) -> None:
        """Write the trace as safetensors, atomically."""
        write_trace(path, self)

    @classmethod
    def load(cls, path: str | os.PathLike, layers: Sequence[int] | None = None) -> Trace:
        return read_trace(path, layers=layers)


def write_trace(path: str | os.PathLike, trace: Trace) -> None:
    """Write `trace` to `path` (safetensors, ids in the compact dtype, metadata as strings)."""
    import safetensors.numpy

    trace.validate()
    dt = ids_dtype(trace.num_experts)
    tensors: dict[str, np.ndarray] = {}
    for i, ids in enumerate(trace.topk_ids):
        tensors[TOPK_KEY.format(i)] = np.ascontiguousarray(ids, dtype=dt)
        s = trace.scores[i]
        if s is not None:
            if s.dtype not in (np.float16, np.float32, np.float64):
                s = s.astype(np.float32)
            tensors[SCORES_KEY.format(i)] = np.ascontiguousarray(s)
    meta = {k: v for k, v in trace.metadata.items() if k not in _RESERVED_META}
    meta.update(
        num_experts=str(trace.num_experts),
        top_k=str(trace.top_k),
        num_layers=str(trace.num_layers),
        format=FORMAT_TAG,
    )
    with atomic_path(path) as tmp:
        safetensors.numpy.save_file(tensors, str(tmp), metadata=meta)


def _parse_int_meta(meta: Mapping[str, str], key: str, path: str) -> int | None:
    if key not in meta:
        return None
    try:
        v = int(str(meta[key]).strip())
    except ValueError:
        raise TraceError(f"{path}: metadata {key!r} is {meta[key]!r}, expected an integer") from None
    return v


def _missing_layers(found: Mapping[int, set[str]], n: int, most: int = 8) -> list[int]:
    """The first `most` layers of 0..n-1 without a topk_ids tensor (n may be huge: a corrupt key)."""
    missing: list[int] = []
    i = 0
    while i < n and len(missing) < most:
        if "topk_ids" not in found.get(i, ()):
            missing.append(i)
        i += 1
    return missing


def read_trace(path: str | os.PathLike, layers: Sequence[int] | None = None) -> Trace:
    """Read and validate a trace file; `layers` loads only those layer indices (renumbered 0..)."""
    from safetensors import safe_open

    p = str(path)
    if not os.path.exists(p):
        raise TraceError(f"trace file {p} does not exist")
    if os.path.isdir(p):
        raise TraceError(f"{p} is a directory, expected a .safetensors trace file")
    try:
        f = safe_open(p, framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError)
        raise TraceError(
            f"{p} is not a readable safetensors file ({exc}); is it truncated or corrupted? "
            "Re-record the trace or regenerate it"
        ) from None
    with f:
        meta = dict(f.metadata() or {})
        keys = list(f.keys())
        if "num_experts" not in meta:
            raise TraceError(
                f"{p}: metadata has no 'num_experts' (found {sorted(meta) or 'no metadata'}); write traces "
                "with occult.placement.trace.write_trace, or add metadata={'num_experts': str(E), 'top_k': str(k)} "
                "when saving"
            )
        num_experts = _parse_int_meta(meta, "num_experts", p)
        top_k = _parse_int_meta(meta, "top_k", p)
        found: dict[int, set[str]] = {}
        for k in keys:
            m = _KEY_RE.match(k)
            if m:
                found.setdefault(int(m.group(1)), set()).add(m.group(2))
        if not found:
            raise TraceError(
                f"{p}: no tensors named 'layers.<i>.topk_ids' (found {keys[:5]}{'...' if len(keys) > 5 else ''})"
            )
        n = max(found) + 1
        missing = _missing_layers(found, n)
        if missing:
            raise TraceError(
                f"{p}: layer(s) {missing} missing: expected tensors 'layers.0.topk_ids' ... "
                f"'layers.{n - 1}.topk_ids' without gaps; is the file from an interrupted recording?"
            )
        meta_layers = _parse_int_meta(meta, "num_layers", p)
        if meta_layers is not None and meta_layers != n:
            raise TraceError(
                f"{p}: metadata says num_layers={meta_layers}, but the file holds {n} layer(s); "
                "the file is incomplete or was edited"
            )
        wanted = list(range(n)) if layers is None else [int(i) for i in layers]
        for i in wanted:
            if not 0 <= i < n:
                raise TraceError(f"{p}: layer {i} requested, but the trace has layers 0..{n - 1}")
        ids, scores = [], []
        for i in wanted:
            t = f.get_tensor(TOPK_KEY.format(i))
            ids.append(t.numpy() if t.dtype != torch.bfloat16 else t.float().numpy())
            if "scores" in found[i]:
                s = f.get_tensor(SCORES_KEY.format(i))
                scores.append((s.float() if s.dtype == torch.bfloat16 else s).numpy())
            else:
                scores.append(None)
    extra = {k: v for k, v in meta.items() if k not in _RESERVED_META}
    try:
        return Trace(ids, num_experts, top_k, scores, extra)
    except TraceError as exc:
        msg = str(exc)
        raise TraceError(msg.replace("trace:", f"{p}:", 1) if msg.startswith("trace:") else f"{p}: {msg}") from None


def trace_info(path: str | os.PathLike) -> dict[str, Any]:
    """Header facts of a trace file (layers, tokens, E, k) without validating the ids."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:
        raise TraceError(f"{path} is not a readable safetensors file ({exc})") from None
    layers = sorted(int(m.group(1)) for k in shapes if (m := _KEY_RE.match(k)) and m.group(2) == "topk_ids")
    flat = [TOPK_KEY.format(i) for i in layers if len(shapes[TOPK_KEY.format(i)]) != 2]
    if flat:
        raise TraceError(f"{path}: {flat[0]} has shape {shapes[flat[0]]}, expected [tokens, top_k]")
    return {
        "num_experts": meta.get("num_experts"),
        "top_k": meta.get("top_k"),
        "num_layers": len(layers),
        "tokens": [shapes[TOPK_KEY.format(i)][0] for i in layers],
        "metadata": meta,
    }


class TraceRecorder:
    """Collects top-k ids batch by batch (e.g. from a router hook) and writes one trace.

    rec = TraceRecorder(num_experts=64, top_k=8)
    rec.add(layer=0, topk_ids_TK=ids)   # any number of times, any layer order
    rec.save("trace.safetensors")
    """

    def __init__(self, num_experts: int, top_k: int, metadata: Mapping[str, Any] | None = None) -> None:
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.metadata = {str(k): str(v) for k, v in (metadata or {}).items()}
        self._ids: dict[int, list[np.ndarray]] = {}
        self._scores: dict[int, list[np.ndarray | None]] = {}

    def add(self, layer: int, topk_ids_TK: Any, scores: Any | None = None) -> None:
        """Append one batch of a layer's top-k ids (flattened to [tokens, top_k])."""
        ids = _as_numpy(topk_ids_TK).reshape(-1, self.top_k).astype(ids_dtype(self.num_experts), copy=True)
        self._ids.setdefault(int(layer), []).append(ids)
        self._scores.setdefault(int(layer), []).append(
            None if scores is None else _as_numpy(scores).reshape(ids.shape[0], -1).astype(np.float32)
        )

    def to_trace(self) -> Trace:
        if not self._ids:
            raise TraceError("nothing recorded: call add() for at least one layer")
        n = max(self._ids) + 1
        missing = [i for i in range(n) if i not in self._ids]
        if missing:
            raise TraceError(f"no batches recorded for layer(s) {missing} (layers must be 0..{n - 1})")
        ids = [np.concatenate(self._ids[i]) for i in range(n)]
        scores: list[np.ndarray | None] = []
        for i in range(n):
            parts = self._scores[i]
            if all(s is None for s in parts):
                scores.append(None)
            elif any(s is None for s in parts):
                raise TraceError(f"layer {i}: scores were given for some batches but not others")
            else:
                scores.append(np.concatenate(parts))  # type: ignore[arg-type]
        return Trace(ids, self.num_experts, self.top_k, scores, dict(self.metadata))

    def save(self, path: str | os.PathLike) -> None:
        write_trace(path, self.to_trace())


def example_trace_path() -> Path:
    """Path of the small planted example trace bundled with the package (4 layers, 64 experts, top-8)."""
    return Path(__file__).resolve().parent.parent / "data" / "example_trace.safetensors"


def load_example_trace() -> Trace:
    return read_trace(example_trace_path())


def metadata_json(trace: Trace, key: str) -> Any:
    """Decode a JSON-valued metadata entry (e.g. 'planted_groups' in the example trace)."""
    if key not in trace.metadata:
        raise TraceError(f"the trace metadata has no {key!r}")
    return json.loads(trace.metadata[key])


__all__ = [
    "Trace",
    "TraceError",
    "TraceRecorder",
    "read_trace",
    "write_trace",
    "trace_info",
    "ids_dtype",
    "example_trace_path",
    "load_example_trace",
    "metadata_json",
]
