"""The stream every layer graph of occult is recorded on, one per device, with the BLAS workspaces
of the threads that record on it allocated before any recording.

cuBLAS and cuBLASLt run with a workspace that PyTorch allocates on first use and keeps, one per
(thread's handle, stream), through the caching allocator. A first use inside a CUDA-graph capture
puts it in that capture's private pool, and every later capture on the same stream by the same
thread reuses it. A training recording's backward is recorded by the autograd engine's device
thread, after the forward's saved activations are freed in the recording; that thread's workspace
for the capture stream then lands in memory the recording's forward graph writes and its backward
graph reads. Every later layer's GEMMs on that stream then write their workspace into the first
layer's saved activations between its forward and backward replays (docs/training.md, "The
workspace that moved": gradients went wrong or NaN).

Here both threads' workspaces for the capture stream are allocated outside any capture (main
thread: a GEMM on the stream; engine thread: a backward on the stream that runs GEMMs), so every
recording finds them and allocates none: they live outside every graph's pool, shared by all
graphs as eager kernels share them (graphs replay one at a time).

A recording also runs with autocast's weight cache off (`autocast_uncached`): inside an autocast region
the low-precision copy of a weight is made once and reused, so a recording made after an eager call of
the same region would read that copy, which lives outside the graph and is freed when the region ends;
its replays then read freed memory (an evaluation's replays gave NaN gates). `make_graphed_callables`
refuses the cache for the same reason.

The stream is prepared once per process and device. Code that frees PyTorch's BLAS workspaces
(`torch._C._cuda_clearCublasWorkspaces()`) while graphs are alive leaves every graph recorded over
them, occult's or not, writing into freed memory; later recordings would put new ones in their pools.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """occult's capture stream on `device` (made and prepared on first use, outside any capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("occult's capture stream must be prepared outside a CUDA-graph capture")
        stream = torch.cuda.Stream(torch.device("cuda", index))
        _prepare(stream, torch.device("cuda", index))
        _STREAMS[index] = stream
    return stream


def _prepare(stream: torch.cuda.Stream, device: torch.device) -> None:
    """Allocate this thread's and the autograd engine's BLAS workspaces for `stream`."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.inference_mode(False), torch.enable_grad(), torch.cuda.stream(stream):
        _blas_calls(device)
        seed = torch.zeros(1, device=device, requires_grad=True)
        _BlasInBackward.apply(seed).sum().backward()
    torch.cuda.current_stream(device).wait_stream(stream)
    stream.synchronize()


def _blas_calls(device: torch.device) -> None:
    """A cuBLAS GEMM and a cuBLASLt one (bias epilogue) in each dtype the layers use."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.ones(16, 16, device=device, dtype=dtype)
        torch.mm(a, a)
        torch.addmm(a[0], a, a)


class _BlasInBackward(torch.autograd.Function):
    """Identity whose backward runs `_blas_calls` on the autograd engine's device thread, on the stream
    the forward ran on."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        _blas_calls(grad.device)
        return grad


@contextlib.contextmanager
def autocast_uncached(device_type: str = "cuda") -> Iterator[None]:
    """Autocast as it stands (on or off, its dtype), with its weight cache off inside: every cast a recording
    makes is a kernel of the recording, none a copy made before it (module docstring). The enclosing
    region's cache is kept for the eager calls after."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False):
        yield
