"""Every environment variable occult reads, parsed in one place into a frozen `Settings`.

Code asks `current()` (`current().dgrad1`, ...), never `os.environ`; a value that is not
allowed raises `SettingsError` naming the variable, the bad value and the allowed ones.
docs/settings.md lists each variable, its default and its effect.

`current()` re-parses only when one of the variables changed (it compares the raw values: fourteen
dictionary reads, well under a microsecond), so a test that sets one (`monkeypatch.setenv`) is seen at the next call
and hot paths (every expert-MLP call reads it) pay no parsing. `reload()` drops the cache.
This module imports neither torch nor Triton: Triton reads `TRITON_INTERPRET` itself on import,
and `import occult` must leave it unimported (tests/test_layering.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Settings", "SettingsError", "VARIABLES", "current", "reload"]

GEMM_BACKENDS = ("auto", "triton", "grouped_mm")
SCATTER_MODES = ("deterministic", "atomic")
PLAN_BACKENDS = ("auto", "torch", "triton")
RANK_STARTS = ("spawn", "forkserver")
AGREEMENTS = ("call", "step")
KERNEL_GRIDS = ("persistent", "tiles")
_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("", "0", "false", "no", "off", "n")


class SettingsError(ValueError):
    """An environment variable holds a value occult cannot use."""


@dataclass(frozen=True)
class Settings:
    """What the environment asks for (docs/settings.md); the defaults are those with nothing set."""

    wgrad: str = "auto"  # OCCULT_WGRAD: weight gradients via torch._grouped_mm ("auto": Hopper/bf16)
    dgrad1: str = "auto"  # OCCULT_DGRAD1: the SwiGLU dgrad via torch._grouped_mm ("auto": Hopper/bf16)
    gemm1: str = "auto"  # OCCULT_GEMM1: the training forward's GEMM 1 via gather + torch._grouped_mm
    scatter: str = "deterministic"  # OCCULT_SCATTER: the kernels' row combine, or fp32 atomics ("atomic")
    plan: str = "auto"  # OCCULT_PLAN: dispatch plans by Triton on CUDA ("auto"), torch ops ("torch"), or Triton
    # wherever it runs, its CPU interpreter too ("triton": for tests)
    cache: Path | None = None  # OCCULT_CACHE: where downloaded corpora are kept (None: the XDG cache)
    debug: bool = False  # OCCULT_DEBUG: the command line adds the traceback to a one-line error
    triton_interpret: bool = False  # TRITON_INTERPRET: Triton runs kernels in its CPU interpreter
    nccl_p2p_disable: bool = (
        False  # NCCL_P2P_DISABLE (NCCL's own): peer-to-peer off, so transport="auto" takes the count exchange
    )
    rank_start: str = (
        "spawn"  # OCCULT_RANK_START: how run_ranks starts CPU ranks ("forkserver": torch loaded once; the tests)
    )
    agreement: str = "call"  # OCCULT_AGREEMENT: the device transport agrees per layer call, or once per training step
    commit: str | None = None  # OCCULT_COMMIT: the commit result files record (`HASH` or `HASH-dirty`; None: ask git)
    defer_wgrad: bool = False  # OCCULT_DEFER_WGRAD: experts' weight gradients on a side stream, under the all-to-all
    kernel_grid: str = "persistent"  # OCCULT_KERNEL_GRID: the expert GEMMs' programs, one per SM or one per tile

    @classmethod
    def from_env(cls, env: dict[str, str | None]) -> Settings:
        """Parse `{variable: raw value or None}` (missing or empty: the default)."""
        return cls(
            wgrad=_choice(env, "OCCULT_WGRAD", GEMM_BACKENDS),
            dgrad1=_choice(env, "OCCULT_DGRAD1", GEMM_BACKENDS),
            gemm1=_choice(env, "OCCULT_GEMM1", GEMM_BACKENDS),
            scatter=_choice(env, "OCCULT_SCATTER", SCATTER_MODES),
            plan=_choice(env, "OCCULT_PLAN", PLAN_BACKENDS),
            cache=Path(env["OCCULT_CACHE"]) if env.get("OCCULT_CACHE") else None,
            debug=_flag(env, "OCCULT_DEBUG"),
            triton_interpret=_flag(env, "TRITON_INTERPRET"),
            nccl_p2p_disable=(env.get("NCCL_P2P_DISABLE") or "").strip().lower() not in _FALSE,
            rank_start=_choice(env, "OCCULT_RANK_START", RANK_STARTS),
            agreement=_choice(env, "OCCULT_AGREEMENT", AGREEMENTS),
            commit=(env.get("OCCULT_COMMIT") or "").strip() or None,
            defer_wgrad=_flag(env, "OCCULT_DEFER_WGRAD"),
            kernel_grid=_choice(env, "OCCULT_KERNEL_GRID", KERNEL_GRIDS),
        )


# variable -> the Settings field it sets; every name occult reads from the environment
VARIABLES: dict[str, str] = {
    "OCCULT_WGRAD": "wgrad",
    "OCCULT_DGRAD1": "dgrad1",
    "OCCULT_GEMM1": "gemm1",
    "OCCULT_SCATTER": "scatter",
    "OCCULT_PLAN": "plan",
    "OCCULT_CACHE": "cache",
    "OCCULT_DEBUG": "debug",
    "TRITON_INTERPRET": "triton_interpret",
    "NCCL_P2P_DISABLE": "nccl_p2p_disable",
    "OCCULT_RANK_START": "rank_start",
    "OCCULT_AGREEMENT": "agreement",
    "OCCULT_COMMIT": "commit",
    "OCCULT_DEFER_WGRAD": "defer_wgrad",
    "OCCULT_KERNEL_GRID": "kernel_grid",
}


def _choice(env: dict[str, str | None], name: str, allowed: tuple[str, ...]) -> str:
    raw = env.get(name) or ""
    value = raw.strip().lower() or allowed[0]
    if value not in allowed:
        raise SettingsError(
            f"{name}={raw!r} is not one of {', '.join(allowed)} (default {allowed[0]}): "
            f"set one of those or unset it (docs/settings.md)"
        )
    return value


def _flag(env: dict[str, str | None], name: str) -> bool:
    raw = env.get(name) or ""
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise SettingsError(f"{name}={raw!r} is not a yes/no value: use 1 or 0 (or unset it) (docs/settings.md)")
    return value in _TRUE


_NAMES = tuple(VARIABLES)
# The raw values are compared on every call, and kernels ask at every launch: reading the encoded
# mapping that os.environ keeps in step with every change made through it (setenv, monkeypatch)
# costs a fifth of `os.environ.get`, which encodes each key first. Elsewhere: os.environ itself.
_RAW = getattr(os.environ, "_data", None)
_KEYS = tuple(map(os.environ.encodekey, _NAMES)) if _RAW is not None and hasattr(os.environ, "encodekey") else None
if _KEYS is None:
    _RAW, _KEYS = os.environ, _NAMES
_cached: tuple[tuple[object, ...], Settings] | None = None


def current() -> Settings:
    """The settings of the environment as it is now (parsed again only when a variable changed)."""
    global _cached
    raw = tuple(map(_RAW.get, _KEYS))
    cached = _cached
    if cached is not None and cached[0] == raw:
        return cached[1]
    settings = Settings.from_env({name: os.environ.get(name) for name in _NAMES})
    _cached = (raw, settings)
    return settings


def reload() -> Settings:
    """Parse the environment again now (`current()` already does when a variable changed)."""
    global _cached
    _cached = None
    return current()
