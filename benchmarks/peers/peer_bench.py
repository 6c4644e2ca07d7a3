"""The per-rank worker: every implementation in one process group, on one case, checked then timed.

Peers run one after another in the same processes. Every step that could fail on one rank and
not another ends in an all-reduce of a status flag, so a peer that fails (not installed, an API
change, out of memory) is recorded with its error on every rank and the run goes on to the next.
Time limits: a peer is skipped when the run's deadline is near, and its iteration counts shrink
when one step is slow (`per_peer_s`).
"""

from __future__ import annotations

import gc
import importlib
import json
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from peer_common import Peer, make_case, reference, rel_error

from occult.tools.bench_timing import make_timer

# name -> (module, builder). Order matters only as the default run order.
PEERS: dict[str, tuple[str, str]] = {
    "occult-dedup": ("peer_occult", "build_dedup"),
    "occult-standard": ("peer_occult", "build_standard"),
    "megatron": ("peer_megatron", "build"),
    "hf-olmoe": ("peer_hf", "build_olmoe"),
    "hf-qwen3": ("peer_hf", "build_qwen3_moe"),
    "deepspeed": ("peer_deepspeed", "build"),
    "torchtitan": ("peer_torchtitan", "build"),
}


def _agree(ok: bool, device: torch.device) -> bool:
    """True on every rank iff `ok` on every rank."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:600]


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _guarded(step: str, fn: Callable[[], Any], device: torch.device, rec: dict) -> tuple[bool, Any]:
    """Run fn; agree across ranks whether it worked; record the first error (this rank's or a peer rank's)."""
    out, err = None, None
    try:
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - a peer may fail in any way; the run goes on
        err = _short(exc)
        rec.setdefault("traceback", traceback.format_exc()[-3000:])
    ok = _agree(err is None, device)
    if not ok:
        rec["status"] = "failed"
        rec["error"] = f"{step}: {err}" if err else f"{step}: failed on another rank"
    return ok, out


def shape_key(case) -> str:
    return case.shape.name


def run_peer(name: str, case, timer, conf: dict, device: torch.device) -> dict[str, Any]:
    rec: dict[str, Any] = {"peer": name, "status": "ok"}
    module_name, builder = PEERS[name]
    t0 = time.monotonic()

    def build() -> Peer:
        return getattr(importlib.import_module(module_name), builder)(case)

    ok, peer = _guarded("build", build, device, rec)
    if not ok:
        return rec
    rec["name"] = peer.name
    rec["routing_forced"] = peer.routing_forced
    rec["renormalized"] = peer.renormalized
    rec["build_s"] = round(time.monotonic() - t0, 2)
    try:
        # 1. correctness first, on the first check_tokens tokens of input set 0
        ref = reference(case, renormalize=peer.renormalized)
        ok, y = _guarded("check", lambda: peer.forward(0), device, rec)
        if not ok:
            return rec
        n = ref.shape[0]
        rec["rel_error"] = _max_over_ranks(rel_error(y.reshape(-1, case.shape.hidden)[:n], ref), device)
        rec["info"] = peer.info()
        del y
        if not rec["rel_error"] < conf["tolerance"]:
            rec["status"] = "wrong"
            rec["error"] = f"output differs from the float32 reference: rel err {rec['rel_error']:.2e}"
            if not conf.get("time_wrong"):
                return rec
        # one untimed step with backward: backward works, and dL/dx agrees with the first
        # implementation of the run that has the same gate function (occult dedup by default)
        ok, x = _guarded("backward", lambda: peer.forward_backward(0), device, rec)
        if not ok:
            return rec
        key = f"dx_{shape_key(case)}_{peer.renormalized}"
        if key in case.extra:
            rec["dx_rel_diff"] = _max_over_ranks(rel_error(x.grad, case.extra[key][1]), device)
            rec["dx_vs"] = case.extra[key][0]
        else:
            case.extra[key] = (peer.name, x.grad.detach().float())
        del x
        t1 = time.monotonic()
        peer.forward_backward(1 % len(case.xs))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s = _max_over_ranks(time.monotonic() - t1, device)
        warmup, iters = conf["warmup"], conf["iters"]
        budget = conf["per_peer_s"]
        if step_s * 2 * (warmup + iters) > budget:  # forward and forward+backward
            iters = max(2, int(budget / (2 * step_s)) - 1)
            warmup = 1
            rec["iters_reduced"] = True
        rec["warmup"], rec["iters"] = warmup, iters

        # 2. time: forward (no grad) and forward+backward, rotating input sets
        state = {"i": 0}

        def nxt() -> int:
            state["i"] = (state["i"] + 1) % len(case.xs)
            return state["i"]

        ok, fwd = _guarded("forward timing", lambda: timer(lambda: peer.forward(nxt()), warmup, iters), device, rec)
        if not ok:
            return rec
        rec["forward_ms"] = fwd
        ok, step = _guarded(
            "fwd+bwd timing", lambda: timer(lambda: peer.forward_backward(nxt()), warmup, iters), device, rec
        )
        if not ok:
            return rec
        rec["fwd_bwd_ms"] = step
        if device.type == "cuda":
            rec["peak_mem_GB"] = round(_max_over_ranks(torch.cuda.max_memory_allocated(device) / 1e9, device), 2)
    finally:
        try:
            peer.close()
        except Exception:  # noqa: BLE001
            pass
        peer = None  # drop the layer before the next peer is built
        _cleanup(device)
        rec["wall_s"] = round(time.monotonic() - t0, 2)
    return rec


def worker(rank: int, world: int, conf: dict) -> dict[str, Any]:
    start = time.monotonic()
    device = torch.device("cuda", rank) if conf["backend"] == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = make_timer(device)
    result: dict[str, Any] = {"world": world, "runs": []}
    for shape in conf["shapes"]:
        case = make_case(shape, rank, world, device, dtype, conf["tokens"], conf["input_sets"])
        for name in conf["peers"]:
            elapsed = _max_over_ranks(time.monotonic() - start, device)
            if elapsed > conf["deadline_s"]:
                rec = {"peer": name, "status": "skipped", "error": f"run deadline ({conf['deadline_s']:.0f} s) reached"}
            else:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                rec = run_peer(name, case, timer, conf, device)
            rec.update(shape=shape, tokens=conf["tokens"], world=world)
            if rank != 0:
                rec.pop("traceback", None)
            result["runs"].append(rec)
            if rank == 0 and conf.get("verbose", True):
                print(format_row(rec), flush=True)
            if rank == 0 and conf.get("partial_path"):  # kept if a later peer hangs and the ranks are killed
                with open(conf["partial_path"], "w") as f:
                    json.dump(result, f)
        del case
        _cleanup(device)
    result["worker_s"] = round(time.monotonic() - start, 1)
    return result


HEADER = (
    f"{'GPUs':>4} {'shape':<7}{'implementation':<28}{'fwd ms':>8}{'fwd+bwd':>9}{'rel err':>9}{'dx diff':>9}  status"
)


def format_row(rec: dict) -> str:
    def ms(key: str) -> str:
        return f"{rec[key]:.2f}" if key in rec else "-"

    err = f"{rec['rel_error']:.1e}" if "rel_error" in rec else "-"
    dx = f"{rec['dx_rel_diff']:.1e}" if "dx_rel_diff" in rec else "-"
    status = rec.get("status", "?")
    if rec.get("error"):
        status += ": " + rec["error"].splitlines()[0][:160]
    return (
        f"{rec.get('world', ''):>4} {rec.get('shape', ''):<7}{rec.get('name', rec['peer']):<28}"
        f"{ms('forward_ms'):>8}{ms('fwd_bwd_ms'):>9}{err:>9}{dx:>9}  {status}"
    )
