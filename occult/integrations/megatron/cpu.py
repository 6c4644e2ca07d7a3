"""Megatron-Core on CPU gloo ranks (tests and smoke runs only): stand-ins for the CUDA calls its MoE layer makes.

Megatron-Core is built for GPUs: `MoEAlltoAllTokenDispatcher` makes a `torch.cuda.Stream` for its
host copies, buffers are placed on `torch.cuda.current_device()`, and its split sizes become numpy
arrays only when they come from a GPU, and its attention forks CUDA RNG states. `cpu_shims()` replaces
those few calls (process-wide, once)
so that Megatron's own `alltoall` dispatcher, the reference occult is tested against, runs on CPU; it
also turns torch.compile off in the process (Megatron's fused helpers run eagerly), which the stubs
would break where CUDA is visible.
`cpu_shims` also lets `dist_checkpointing.save` (format `torch_dist`) run in a CPU rank: Megatron
writes each rank's files through worker processes (0.16: forked writers; both versions: a `multiprocessing`
Manager queue for the results, 0.19's writers being threads) and stages them with `torch.cuda.synchronize()`;
a daemonic rank (occult's `run_ranks`) may not have children, and a CPU-only torch has no CUDA to synchronize.
The shims put the results in a plain queue and, for 0.16, write the same files with Megatron's own
`write_preloaded_data`, in the rank, one bucket after another; both are staged with blocking copies.
For Megatron's combined-1F1B EP overlap (`overlap_moe_expert_parallel_comm`: its schedule,
`forward_backward_no_pipelining`, and `ScheduleNode`) the shims also make `torch.cuda.Event` the
stand-in event, `record_stream` of a CPU tensor and the NVTX ranges no-ops, and the schedule's token
counter (made on "cuda") a CPU tensor: the schedule's order is kept, not its concurrency (one stream).
occult's dispatcher needs none of it. `without_transformer_engine()` is needed on GPUs too:
Megatron-Core 0.16.1's router gating reads `te_general_gemm`, a name it defines only when Transformer
Engine imports (0.19 sets it to None).
"""

from __future__ import annotations

import contextlib
import queue

import torch


class CpuEvent:
    """`torch.cuda.Event` on CPU: already complete (recording and waiting on it do nothing)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuStream:
    """`torch.cuda.Stream` on CPU: one stream, nothing to wait for."""

    def wait_stream(self, other: object) -> None:
        pass

    def record_event(self, event: object = None) -> CpuEvent:
        return CpuEvent()


CPU_STREAM = CpuStream()


class CpuStreamClass(CpuStream):
    """`torch.cuda.Stream()` on CPU: the one stand-in stream (a class: type hints like `Stream | None` work)."""

    def __new__(cls, *args, **kwargs):
        return CPU_STREAM


def without_transformer_engine() -> None:
    """Megatron-Core 0.16's MoE utilities without Transformer Engine: its missing TE names set to None, as 0.19 does."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not getattr(moe_utils, "HAVE_TE", True) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def in_process_checkpoint_writes() -> None:
    """Megatron's `torch_dist` save strategy writing its files in this process (no Manager, no forked writers),
    staging with blocking copies (no `torch.cuda.synchronize()`), psutil optional (it only logs memory).
    Megatron's classes are patched, torch.cuda is not. CPU tests only."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    writer = fsa.FileSystemWriterAsync
    if getattr(writer, "occult_cpu_shim", False):
        return
    results: queue.Queue = queue.Queue()
    if hasattr(fsa, "get_write_results_queue"):  # 0.19: its writers are threads; only this queue is a process
        fsa.get_write_results_queue = lambda mp_mode="spawn": results  # (a Manager().Queue(): a spawned server)
    else:
        fsa._get_write_results_queue = lambda: results  # 0.16: the same Manager queue

    def write_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue):
        """`write_preloaded_data_multiproc` without processes: the same writer per bucket, same results."""
        out: dict | Exception = {}
        for i, bucket in enumerate(write_buckets):
            local, count = queue.Queue(), queue.Queue()
            count.put(i)
            writer.write_preloaded_data(transform_list, i, bucket, local, count, True, use_msc=use_msc)
            index, written = local.get()
            if isinstance(written, Exception):
                out = written
                break
            out[index] = written
        global_results_queue.put(out)

    if hasattr(writer, "write_preloaded_data_multiproc"):  # 0.16: forked writer processes
        writer.write_preloaded_data_multiproc = staticmethod(write_in_process)
    writer.occult_cpu_shim = True
    if not getattr(fsa, "HAVE_PSUTIL", True):
        fsa._process_memory = lambda: 0
    stage = writer.preload_tensors  # copies to host, then `torch.cuda.synchronize()` when non-blocking

    def preload_blocking(write_buckets, non_blocking=True):
        return stage(write_buckets, False)  # CPU tensors: blocking copies, nothing to synchronize

    writer.preload_tensors = staticmethod(preload_blocking)


def cpu_shims() -> None:
    """Stand-ins for the CUDA stream calls the alltoall dispatcher makes, torch.compile off (CPU smoke tests only)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    moe_utils.te_general_gemm = None  # the router's gating in torch: TE's GEMM (where TE imports) wants CUDA tensors
    torch.cuda.Stream = CpuStreamClass  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: CPU_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # used as `device=` for buffers
    # Megatron's fused helpers (`megatron.core.jit.jit_fuser`: torch.compile, applied as its modules import, e.g. the
    # router's `_apply_expert_bias`) run eagerly: where CUDA is visible (a CPU rank on a GPU machine) torch.compile
    # probes the GPU through `torch.cuda.current_device()`, and dynamo failed indexing its device list with the "cpu"
    # above. Eager or compiled, the same math; occult's dispatcher compiles nothing here.
    torch.compiler.set_stance("force_eager")
    import megatron.core.transformer.moe.token_dispatcher as td

    if not getattr(td, "occult_cpu_shim", False):
        to_cpu = td.maybe_move_tensor_to_cpu

        def move(tensor, as_numpy=False, record_stream=False):  # on GPUs split sizes become numpy here
            if torch.is_tensor(tensor) and as_numpy and not tensor.is_cuda:
                return tensor.numpy()
            return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

        td.maybe_move_tensor_to_cpu = move
        td.occult_cpu_shim = True
    from megatron.core.tensor_parallel import random as megatron_random

    # dropout regions fork Megatron's CUDA RNG states: on CPU, the process's one generator
    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    in_process_checkpoint_writes()
    overlap_schedule_on_cpu()


class TorchWithCpuCounters:
    """`torch` as Megatron's pipeline schedules module sees it on CPU ranks: its token counter, which it makes
    with `torch.zeros(..., device="cuda")`, is made on the CPU; everything else is torch's."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: object, device: object = None, **kwargs: object) -> torch.Tensor:
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)  # type: ignore[call-overload]


def overlap_schedule_on_cpu() -> None:
    """Megatron's forward-backward schedules and its combined-1F1B EP overlap on CPU ranks (once per process):
    `torch.cuda.Event` the stand-in event, `record_stream` of a CPU tensor and NVTX ranges no-ops, the schedules'
    token counter on the CPU. CUDA tensors keep torch's `record_stream`."""
    if getattr(torch.cuda, "occult_cpu_overlap_shim", False):
        return
    torch.cuda.Event = CpuEvent  # type: ignore[assignment,misc]
    record_stream = torch.Tensor.record_stream

    def record_stream_on_cuda(self: torch.Tensor, stream: object) -> None:
        if self.is_cuda:
            record_stream(self, stream)  # type: ignore[arg-type]

    torch.Tensor.record_stream = record_stream_on_cuda  # type: ignore[method-assign,assignment]
    torch.cuda.nvtx.range_push = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.nvtx.range_pop = lambda *a, **k: None  # type: ignore[assignment]
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = TorchWithCpuCounters()  # type: ignore[assignment]
    torch.cuda.occult_cpu_overlap_shim = True  # type: ignore[attr-defined]
