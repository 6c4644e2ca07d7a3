"""The few CUDA driver calls the host transport needs and torch does not expose (`occult.moe.host_wire`).

Host memory registered with CUDA (`register_host`: pinned, mapped into every GPU, usable by every context), copies
by the copy engines between any two addresses of one process's unified address space (`copy_async`), and the stream
memory operations that hand a buffer from one GPU's stream to another's through a 32-bit word in that memory
(`wait_value`, or waits and writes as one operation: `memory_ops`; no kernel, no host in the loop, and CUDA
graphs record them). Bound lazily from `libcuda.so.1` (loaded by torch's CUDA runtime already): importing this
module needs no GPU.
"""

from __future__ import annotations

import ctypes
import functools

_WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ
_OP_WAIT_32, _OP_WRITE_32 = 1, 2  # CU_STREAM_MEM_OP_WAIT_VALUE_32, CU_STREAM_MEM_OP_WRITE_VALUE_32
_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED
_REGISTER_PORTABLE_MAPPED = 1 | 2  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP

_SIGNATURES = {
    "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostUnregister": [ctypes.c_void_p],
    "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint],
    "cuStreamWaitValue32_v2": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint],
    "cuStreamBatchMemOp_v2": [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint],
    "cuMemcpyAsync": [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuThreadExchangeStreamCaptureMode": [ctypes.POINTER(ctypes.c_int)],
}


class _MemoryOp(ctypes.Structure):
    """One entry of `cuStreamBatchMemOp`'s array (`CUstreamBatchMemOpParams`: a 48-byte union; the wait and write
    members share this layout)."""

    _fields_ = [
        ("operation", ctypes.c_uint32),
        ("address", ctypes.c_uint64),
        ("value", ctypes.c_uint64),  # (a union of the 32- and 64-bit values: little-endian, the low word is the 32)
        ("flags", ctypes.c_uint32),
        ("alias", ctypes.c_uint64),
        ("pad", ctypes.c_uint64),
    ]


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise RuntimeError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {exc}") from None
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"CUDA driver call {what} failed: {(name.value or b'?').decode()} ({result})")


def register_host(address: int, nbytes: int) -> int:
    """Pin and map `nbytes` of host memory at `address` for every GPU context; its device address."""
    _check(_driver().cuMemHostRegister_v2(ctypes.c_void_p(address), nbytes, _REGISTER_PORTABLE_MAPPED), "register")
    device_address = ctypes.c_uint64()
    _check(_driver().cuMemHostGetDevicePointer_v2(ctypes.byref(device_address), ctypes.c_void_p(address), 0), "map")
    return device_address.value


def unregister_host(address: int) -> None:
    """Undo `register_host` (no GPU work may still use the memory)."""
    _check(_driver().cuMemHostUnregister(ctypes.c_void_p(address)), "unregister")


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Copy `nbytes` from `src` to `dst` (device or registered host addresses) on `stream`, by a copy engine."""
    _check(_driver().cuMemcpyAsync(dst, src, nbytes, ctypes.c_void_p(stream)), "memcpy")


def wait_value(stream: int, address: int, value: int) -> None:
    """Make `stream` wait until the 32-bit word at `address` equals `value`."""
    _check(_driver().cuStreamWaitValue32_v2(ctypes.c_void_p(stream), address, value, _WAIT_EQ), "wait value")


def memory_ops(stream: int, ops: list[tuple[str, int, int]]) -> None:
    """Queue `ops`, each ("wait", address, value) as `wait_value` or ("write", address, value): the 32-bit value
    written after the stream's earlier work (a memory barrier first), in order on `stream` as one operation (one
    node of a captured graph, where each alone would be one)."""
    table = (_MemoryOp * len(ops))()
    for entry, (kind, address, value) in zip(table, ops):
        if kind not in ("wait", "write"):
            raise ValueError(f"a stream memory operation is 'wait' or 'write', not {kind!r}")
        entry.operation = _OP_WAIT_32 if kind == "wait" else _OP_WRITE_32
        entry.address, entry.value, entry.flags = address, value, _WAIT_EQ if kind == "wait" else 0
    _check(_driver().cuStreamBatchMemOp_v2(ctypes.c_void_p(stream), len(ops), table, 0), "batch memory operations")


def relax_capture_mode() -> None:
    """Let this thread query events while another thread captures a CUDA graph (a capture in the default, global
    mode forbids every thread's "unsafe" calls, an event query among them); for a watchdog thread only."""
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    _check(_driver().cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)), "capture mode")
