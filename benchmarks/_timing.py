"""Timing, checking and reporting helpers shared by benchmarks/e2e.py, decode.py and serve.py (and
scripts/profile_model.py: `time_steps`).

Every function that meets the other ranks (`slowest`, `logit_errors`, `checked`, `time_steps`,
`agree_on_error`, `finish`) is a collective: call it on every rank in the same order. Timing on GPUs uses
CUDA events, on CPU the wall clock; a step's time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from occult.distributed import finish_distributed
from occult.tools.run_record import run_record


# ------------------------------------------------------------------ process
def log(*args: Any) -> None:
    """print on rank 0 (or without a process group), flushed."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def write_json(path: str, data: dict) -> None:
    """Write atomically: a temp file beside `path`, then rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def environment(device: torch.device, world: int) -> dict[str, Any]:
    """World size, device, NCCL_P2P_DISABLE, backend, versions, host, GPU name, and the code's commit, the
    date and the link (occult/tools/run_record.py)."""
    import transformers

    env = {
        "world_size": world,
        "device": device.type,
        "NCCL_P2P_DISABLE": os.environ.get("NCCL_P2P_DISABLE"),
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    return {**env, **run_record(world, device.type == "cuda")}


def new_report(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, world: int, cfg: Any, **config: Any
) -> dict[str, Any]:
    """A run's JSON report before any variant: "config" (the arguments but --out, the dtype, `config`,
    the model's config), "env" (`environment`), "variants" {}."""
    return {
        "config": {
            **{k: v for k, v in vars(args).items() if k != "out"},
            "dtype": str(dtype),
            **config,
            "model_config": cfg.to_dict(),
        },
        "env": environment(device, world),
        "variants": {},
    }


def agree_on_error(error: str | None) -> str | None:
    """The first rank's error text (any rank's failure fails all), or None if every rank succeeded."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)


def finish(script: str, table: str, failed: list[str], tol: float, what: str = "variant(s)") -> int:
    """A run's end: the table (rank 0), the process group destroyed (each rank says how long that took);
    the exit status, 1 (rank 0 names the variants, with the checks they failed where the caller says) if any
    failed its check against the unconverted model (or a replay against its eager run), else 0."""
    log("\n" + table)
    rank = dist.get_rank()
    started = time.perf_counter()
    finish_distributed()
    # (a run killed after its table leaves this line out: whether it would have exited is then visible)
    print(
        f"{script}: rank {rank} left the process group in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    if failed:
        if rank == 0:
            print(
                f"{script}: error: {what} {', '.join(failed)} failed their checks against the unconverted model "
                f"or their own eager run (a relative error above --tol {tol}; the MoE backward's above its own)",
                file=sys.stderr,
                flush=True,
            )
        return 1
    return 0


# ------------------------------------------------------------------ arguments
def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser whose help prints `description` as written and every option's default."""

    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    return argparse.ArgumentParser(description=description, formatter_class=Formatter)


def batch_list(text: str) -> list[int]:
    """argparse type: a comma list of batch sizes (tokens per GPU), each >= 1."""
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes must be integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"every batch size must be >= 1, got {text!r}")
    return sorted(set(sizes))


def variant_list(known: Iterable[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma list of the `known` variants ("all": every one in the known order), run in the
    order given (a job cut by a time limit keeps the variants listed first: list the floor first)."""
    known = list(known)

    def parse(text: str) -> list[str]:
        names = known if text == "all" else [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in names if v not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown variant(s) {bad or text!r}; choose from {', '.join(known)}")
        return list(dict.fromkeys(names))

    return parse


# ------------------------------------------------------------------ numbers
def quantiles(ms: list[float], qs: list[float]) -> list[float]:
    return torch.quantile(torch.tensor(ms, dtype=torch.float64), torch.tensor(qs, dtype=torch.float64)).tolist()


def slowest(ms: list[float], device: torch.device) -> list[float]:
    """Element-wise max over ranks."""
    t = torch.tensor(ms, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def logit_errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Per-token relative L2 error of logits [..., V] vs the reference: median and p95 (max over ranks),
    and the share of equal argmaxes (min over ranks)."""
    err = ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).flatten()
    q_2 = torch.quantile(err.double().cpu(), torch.tensor([0.5, 0.95], dtype=torch.float64)).to(out.device)
    dist.all_reduce(q_2, op=dist.ReduceOp.MAX)
    same_1 = (out.argmax(-1) == ref.argmax(-1)).double().mean().reshape(1)
    dist.all_reduce(same_1, op=dist.ReduceOp.MIN)
    return {"median_rel_err": float(q_2[0]), "p95_rel_err": float(q_2[1]), "argmax_agreement": float(same_1)}


class Truth:
    """The fp32 logits of the unconverted model (its half-precision weights, upcast) and how far the
    unconverted model in half precision is from them (`native_err`, median relative error).

    Discrete routing makes half precision a poor exact reference on its own: where router scores
    nearly tie (DeepSeek-V3's sigmoid scores with group top-k, random weights), any change of rounding,
    compiled kernels of transformers' own model included, picks other experts for some tokens, and
    the half-precision model's distance from the fp32 one moves with the batch and the kernels
    (measured: docs/history.md, "The DeepSeek check"). A variant then passes if its distance from the fp32 model is
    within MARGIN of the native model's own, plus the tolerance: an error of the same order as native
    bf16's, where a wrong result (other experts' weights, a lost combine weight) is ~1."""

    MARGIN = 1.25

    def __init__(self, logits: torch.Tensor, native: torch.Tensor) -> None:
        self.logits = logits.float()
        self.native_err = logit_errors(native.float(), self.logits)["median_rel_err"]


def checked(out: torch.Tensor, ref: torch.Tensor, tol: float, truth: Truth | None = None) -> dict[str, Any]:
    """`logit_errors` vs the unconverted model in the same dtype (a collective) and whether the median
    is within `tol` ("passed"); with `truth` (on every rank or none) also the errors vs the fp32 model,
    passing a variant whose distance from it is of the native model's order (see Truth)."""
    res = logit_errors(out, ref)
    passed = res["median_rel_err"] <= tol
    if truth is not None:
        t = logit_errors(out, truth.logits)
        res.update(
            fp32_median_rel_err=t["median_rel_err"],
            fp32_p95_rel_err=t["p95_rel_err"],
            native_fp32_median_rel_err=truth.native_err,
        )
        passed = passed or t["median_rel_err"] <= Truth.MARGIN * truth.native_err + tol
    return {**res, "passed": passed}


def fp32_copy_logits(model: torch.nn.Module, logits_of: Callable[[torch.nn.Module], torch.Tensor]) -> torch.Tensor:
    """`logits_of(model)` with the model upcast to fp32 in place (its weights are the half-precision
    ones, so this is the exact-arithmetic reference of the same model). The model stays fp32: call
    this last, before freeing it."""
    with torch.no_grad():
        return logits_of(model.float().eval()).float()


def fp32_note(check: dict[str, Any]) -> str:
    """' (vs fp32 median X, native Y)' when the check has the fp32 reference, else ''."""
    if "fp32_median_rel_err" not in check:
        return ""
    return f" (vs fp32 median {check['fp32_median_rel_err']:.2e}, native {check['native_fp32_median_rel_err']:.2e})"


def describe(name: str, batch: int, r: dict[str, Any], timing: Callable[[dict[str, Any]], str]) -> str:
    """One log line for a (variant, batch) result: why it was not run, or its check and then, if it
    passed, `timing(r)`."""
    head = f"{name} B={batch}:"
    if "skipped" in r or "error" in r:
        return f"{head} {r.get('skipped') or r['error']}"
    c = r["check"]
    text = f"{head} check median {c['median_rel_err']:.2e} p95 {c['p95_rel_err']:.2e}" + fp32_note(c)
    if not c["passed"]:
        return text + "  FAILED"
    return f"{text}; {timing(r)}"


class Stopwatch:
    """Intervals on this rank without waiting between them: CUDA events on GPUs, else wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def wait(self, mark: int) -> None:
        """Until the GPU has reached mark `mark` (nothing to wait for on CPU)."""
        if self.cuda:
            self.marks[mark].synchronize()

    def ms(self, start: int, end: int) -> float:
        """Milliseconds between marks `start` and `end` (waits for the last mark on GPUs)."""
        a, b = self.marks[start], self.marks[end]
        if self.cuda:
            self.marks[-1].synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def cuda_ms(fn: Callable[[], Any], iters: int) -> list[float]:
    """`iters` CUDA-event times of fn() on the current stream, each after a synchronise (one GPU, no barrier)."""
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def time_steps(
    step: Callable[[Any], Any], inputs: Callable[[], Any], warmup: int, iters: int, device: torch.device
) -> list[float]:
    """`warmup` + `iters` calls of step(inputs()), ranks meeting at a barrier before each; the timed ms
    of each call, the slowest rank's."""
    times = []
    for i in range(warmup + iters):
        x = inputs()
        dist.barrier()
        synchronize(device)
        watch = Stopwatch(device)
        watch.mark()
        step(x)
        watch.mark()
        if i >= warmup:
            times.append(watch.ms(0, 1))
    return slowest(times, device)


def back_to_back(
    step: Callable[[Any], Any], inputs: Callable[[], Any], iters: int, device: torch.device
) -> list[float]:
    """`iters` + 1 calls of step(inputs()) one after another, the GPU never waited for but to keep at most two calls
    in flight (a host far ahead would hold more memory; the inputs drawn first; ranks meet at a barrier once): the
    ms between the events recorded between calls, the first call's (from an idle GPU) left out, the slowest rank's,
    call by call. Where the host issues a step faster than the GPU runs it, each is the GPU's own time a step (its
    host work hidden behind the step before): the pace of a trainer that reads its loss only now and then, beside
    `time_steps`' (every step from an idle GPU)."""
    xs = [inputs() for _ in range(iters + 1)]
    dist.barrier()
    synchronize(device)
    watch = Stopwatch(device)
    watch.mark()
    for j, x in enumerate(xs):
        if j >= 2:
            watch.wait(j - 1)  # (call j - 2 has ended: j - 1 still runs while j is issued)
        step(x)
        watch.mark()
    return slowest([watch.ms(i, i + 1) for i in range(1, iters + 1)], device)


def host_times(step: Callable[[Any], Any], inputs: Callable[[], Any], iters: int, device: torch.device) -> list[float]:
    """`iters` calls of step(inputs()), each from an idle GPU (ranks meeting at a barrier, the device
    synchronised): the host ms from the call to its return, what issuing a step costs the host with nothing
    queued ahead to hide it (its own waits for the GPU and for the other ranks' hosts counted); the slowest
    rank's, call by call."""
    times = []
    for _ in range(iters):
        x = inputs()
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        step(x)
        times.append((time.perf_counter() - t0) * 1e3)
    synchronize(device)
    return slowest(times, device)


def capture_graph(
    fn: Callable[[torch.Tensor], torch.Tensor], static_in: torch.Tensor, warmup: int = 3
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
    """`fn(static_in)` captured in a CUDA graph after `warmup` calls on a side stream (Triton compilation,
    allocator); returns (step, graph): step(x) copies x into `static_in`, replays, returns the static output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_in)

    def step(x: torch.Tensor) -> torch.Tensor:
        static_in.copy_(x)
        graph.replay()
        return static_out

    return step, graph


# ------------------------------------------------------------------ tables
FLOORS = ("replicated+graph", "replicated")


def floor_rows(
    get: Callable[[str, int], dict | None], names: list[str], batches: list[int], fields: list[str]
) -> list[dict[str, Any]]:
    """Rows batch x variant: the `fields` of each timed result and its ratio of ms_p50 to the floor
    (replicated+graph at that batch size, else replicated), or a note saying why it was not timed."""
    rows = []
    for b in batches:
        got = {n: get(n, b) for n in names}
        floor = next((f for f in FLOORS if (got.get(f) or {}).get("ms_p50")), None)
        for n in names:
            r = got[n]
            if r is None:
                continue
            row: dict[str, Any] = {"batch": b, "variant": n}
            if "ms_p50" in r:
                row.update({k: r[k] for k in fields})
                row.update(x_floor=r["ms_p50"] / got[floor]["ms_p50"] if floor else None, floor=floor)
            else:
                row["note"] = r.get("skipped") or r.get("error") or "check FAILED"
            rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, Callable[[dict], str]]]) -> str:
    """| batch | variant | one column per (header, format(row)) |; a row with a note fills the first column."""
    lines = ["| batch | variant | " + " | ".join(h for h, _ in columns) + " |", "|---|---|" + "---|" * len(columns)]
    for r in rows:
        if "note" in r:
            note = r["note"] if len(r["note"]) <= 60 else r["note"][:57] + "..."
            lines.append(f"| {r['batch']} | {r['variant']} | {note.replace('|', '/')} |" + " |" * (len(columns) - 1))
            continue
        lines.append(f"| {r['batch']} | {r['variant']} | " + " | ".join(f(r) for _, f in columns) + " |")
    return "\n".join(lines)


def ratio(r: dict) -> str:
    return "-" if r["x_floor"] is None else f"{r['x_floor']:.2f}"
