"""`occult demo`: standard vs dedup vs dedup+placement on one MoE layer, side by side.

Spawns ranks (gloo on CPU, or NCCL with one GPU each), builds a layer whose router has a
planted co-activation structure (experts fall into hidden groups that tokens mostly pick
within), profiles its routing, places it, then runs the three variants on the same tokens,
checks that they agree with the dense reference, and prints E[C_T], rows, bytes and times (each
time the median over the timed rounds of the slowest rank's; the speed line says both the ratio of
those medians and the median of the per-round ratios). Sizes that cannot be allocated are refused
before any rank starts (`occult.tools.preflight`).
Rank 0 draws a progress bar of the timed rounds on stderr when it is a terminal (not with `-q`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from occult.distributed import pick_backend, run_ranks
from occult.moe.config import ExecConfig
from occult.moe.dense import DenseMoE
from occult.moe.layer import OccultMoE
from occult.placement import Placement
from occult.tools.preflight import MemoryNeed, check_fits, rank_failure


@dataclass
class DemoConfig:
    world_size: int
    tokens: int
    steps: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    noise: float
    seed: int
    backend: str
    dtype: str
    progress: bool = False  # rank 0's bar of the rounds (stderr)


def build_planted_dense(cfg: DemoConfig, device: str) -> tuple[DenseMoE, torch.Tensor, torch.Tensor]:
    """A dense layer whose router prefers hidden expert groups, plus the group centroids.

    Returns (layer, centroids_GH, group_of_expert_E). Groups are random sets of E/D experts, so
    the contiguous layout splits them and a placement built from profiling can recover them.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    num_groups = cfg.world_size
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    dense = DenseMoE(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k, dtype=torch.float32)
    group_E = torch.randperm(cfg.experts, generator=gen) % num_groups
    centroids_GH = torch.randn(num_groups, cfg.hidden, generator=gen)
    centroids_GH /= centroids_GH.norm(dim=1, keepdim=True)
    w_EH = 4.0 * centroids_GH[group_E] + torch.randn(cfg.experts, cfg.hidden, generator=gen) / cfg.hidden**0.5
    with torch.no_grad():
        dense.router.gate.weight.copy_(w_EH)
    return dense.to(device=device, dtype=dtype), centroids_GH.to(device), group_E


def planted_tokens(num_tokens: int, centroids_GH: torch.Tensor, noise: float, seed: int) -> torch.Tensor:
    """Tokens near one group centroid each; `noise` scales the random part."""
    gen = torch.Generator().manual_seed(seed)
    group_T = torch.randint(centroids_GH.shape[0], (num_tokens,), generator=gen)
    x = centroids_GH.cpu()[group_T] + noise * torch.randn(num_tokens, centroids_GH.shape[1], generator=gen)
    return x.to(centroids_GH.device)


def place_from_profile(cfg: DemoConfig) -> tuple[Placement, np.ndarray]:
    """Profile the router on calibration tokens and solve a placement (hypergraph, or greedy
    where Mt-KaHyPar is not installed)."""
    from occult.placement.solvers import best_method, place
    from occult.placement.trace import Trace

    dense, centroids, _ = build_planted_dense(cfg, "cpu")
    x = planted_tokens(8 * cfg.tokens, centroids, cfg.noise, cfg.seed + 1).to(dense.gate_up_proj.dtype)
    with torch.no_grad():
        _, ids_TK = dense.router(x)
    trace = Trace(topk_ids=[ids_TK.numpy()], num_experts=cfg.experts, top_k=cfg.top_k)
    return place(trace, cfg.world_size, method=best_method()).placement, ids_TK.numpy()


def _time_step(
    layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, device: str
) -> tuple[float, float, torch.Tensor]:
    """One forward and one forward+backward, in ms (synchronised across ranks)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    dist.barrier()
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        y = layer(x)
    sync()
    t1 = time.perf_counter()
    xg = x.detach().requires_grad_()
    out = layer(xg)
    (out * grad).sum().backward()
    sync()
    t2 = time.perf_counter()
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1), y


def _cpu_threads(world_size: int) -> int:
    """Threads per CPU rank: the cores this process may use, shared out (oversubscribed cores make
    every timing a scheduling lottery)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


Times = dict[str, list[float]]  # variant -> ms per timed round


def _timed_rounds(
    variants: dict[str, torch.nn.Module], x: torch.Tensor, grad: torch.Tensor, device: str, cfg: DemoConfig, show: bool
) -> tuple[Times, Times, dict[str, torch.Tensor]]:
    """Forward and fwd+bwd times (ms) of every variant over `cfg.steps` rounds after a warm-up
    round, and each variant's last output; `show`: a tqdm bar of the rounds on stderr."""
    from tqdm.auto import tqdm

    fwd: Times = {name: [] for name in variants}
    step: Times = {name: [] for name in variants}
    last: dict[str, torch.Tensor] = {}
    # Interleaved: every round times each variant once, so a burst of other load on the
    # machine hits all variants alike instead of one variant's whole series.
    with tqdm(
        total=cfg.steps + 1, desc="demo rounds", unit="round", disable=not show, file=sys.stderr, dynamic_ncols=True
    ) as bar:
        for i in range(cfg.steps + 1):  # round 0 warms up
            for name, layer in variants.items():
                f, s, last[name] = _time_step(layer, x, grad, device)
                if i:
                    fwd[name].append(f)
                    step[name].append(s)
            bar.update(1)
    return fwd, step, last


def demo_worker(rank: int, world_size: int, cfg: DemoConfig, placement: Placement) -> dict[str, Any]:
    device = f"cuda:{rank}" if cfg.backend == "nccl" else "cpu"
    if cfg.backend == "gloo":
        torch.set_num_threads(_cpu_threads(world_size))
    dense, centroids, _ = build_planted_dense(cfg, device)
    x = planted_tokens(cfg.tokens, centroids, cfg.noise, cfg.seed + 100 + rank).to(dense.gate_up_proj.dtype)
    grad = torch.randn_like(x)
    with torch.no_grad():
        reference = dense(x).float()
    variants = {
        "standard": OccultMoE.from_dense(dense, execution=ExecConfig(dispatcher="standard")),
        "dedup": OccultMoE.from_dense(dense, execution=ExecConfig(dispatcher="dedup")),
        "dedup+placement": OccultMoE.from_dense(dense, placement=placement, execution=ExecConfig(dispatcher="dedup")),
    }
    del dense
    fwd, step, last = _timed_rounds(variants, x, grad, device, cfg, show=cfg.progress and rank == 0)
    out: dict[str, Any] = {}
    for name, layer in variants.items():
        stats = layer.last_comm_stats
        err = ((last[name].float() - reference).norm() / reference.norm()).item()
        out[name] = {
            "forward_ms": statistics.median(fwd[name]),
            "step_ms": statistics.median(step[name]),
            "step_ms_all": step[name],
            "forward_ms_all": fwd[name],
            "forward_rows": stats.forward_rows,
            "forward_remote_rows": stats.forward_remote_rows,
            "forward_bytes": stats.forward_bytes,
            "backward_bytes": stats.backward_bytes,
            "dispatch_rows": stats.dispatch_rows,
            "rel_error": err,
        }
    return out


def demo_config(args: argparse.Namespace, backend: str) -> DemoConfig:
    """The demo's configuration: the flags given, the defaults of the backend (GPU or CPU ranks) for the rest."""
    on_gpu = backend == "nccl"
    world = args.world_size or (torch.cuda.device_count() if on_gpu else 4)
    return DemoConfig(
        world_size=world,
        tokens=args.tokens or (8192 if on_gpu else 1024),
        steps=args.steps,
        hidden=args.hidden or (2048 if on_gpu else 256),
        ffn=args.ffn or (1024 if on_gpu else 128),
        experts=args.experts or 64,
        top_k=args.top_k or 8,
        noise=args.noise,
        seed=args.seed,
        backend=backend,
        dtype="bfloat16" if on_gpu else "float32",
        progress=not getattr(args, "quiet", False) and sys.stderr.isatty(),
    )


def round_times(results: list[dict[str, Any]], variant: str, key: str) -> list[float]:
    """A variant's time in each timed round (`key`: "step_ms_all" or "forward_ms_all"): the slowest
    rank's, as a collective step ends when its last rank does."""
    rounds = len(results[0][variant][key])
    return [max(r[variant][key][i] for r in results) for i in range(rounds)]


def format_table(cfg: DemoConfig, results: list[dict[str, Any]], ct_by_variant: dict[str, float]) -> str:
    """Rows, bytes and times of each variant; the times are medians over rounds of the slowest rank's."""
    unit = 2 if cfg.dtype == "bfloat16" else 4
    header = (
        f"{'variant':<17}{'E[C_T]':>8}{'rows sent':>12}{'MB sent':>10}{'remote MB':>11}{'fwd ms':>9}"
        f"{'fwd+bwd ms':>12}{'rel err':>10}"
    )
    rows = [header, "-" * len(header)]
    for name in results[0]:
        per = [r[name] for r in results]
        total_rows = sum(p["forward_rows"] for p in per)
        mb = sum(p["forward_bytes"] for p in per) / 1e6
        remote_mb = sum(p["forward_remote_rows"] for p in per) * cfg.hidden * unit / 1e6
        fwd = statistics.median(round_times(results, name, "forward_ms_all"))
        step = statistics.median(round_times(results, name, "step_ms_all"))
        err = max(p["rel_error"] for p in per)
        rows.append(
            f"{name:<17}{ct_by_variant[name]:>8.2f}{total_rows:>12d}{mb:>10.2f}{remote_mb:>11.2f}{fwd:>9.1f}"
            f"{step:>12.1f}{err:>10.1e}"
        )
    return "\n".join(rows)


def check_config(cfg: DemoConfig) -> None:
    """Refuse a configuration the ranks could not run, before any rank starts (ValueError)."""
    if cfg.backend == "nccl":
        gpus = torch.cuda.device_count()
        if gpus < 1:
            raise ValueError("--backend nccl needs CUDA GPUs and none is visible: use --backend gloo (CPU ranks)")
        if cfg.world_size > gpus:
            raise ValueError(
                f"--world-size {cfg.world_size} over NCCL needs one GPU per rank, {gpus} visible: "
                f"use --world-size {gpus} or fewer, or --backend gloo"
            )
    if cfg.experts % cfg.world_size:
        raise ValueError(
            f"{cfg.experts} experts cannot be split over {cfg.world_size} ranks: "
            "choose --experts a multiple of --world-size"
        )
    if cfg.top_k > cfg.experts:
        raise ValueError(f"--top-k {cfg.top_k} is more than the {cfg.experts} experts")


def speed_line(results: list[dict[str, Any]], noisy: bool, variant: str = "dedup+placement") -> str:
    """fwd+bwd of `variant` vs standard, two ways from the same rounds (each round's time is its
    slowest rank's): the ratio of the table's median times, and the median of the per-round
    ratios with their range; `noisy` (CPU ranks on shared cores) says so."""
    standard = round_times(results, "standard", "step_ms_all")
    other = round_times(results, variant, "step_ms_all")
    ratios = sorted(s / o for s, o in zip(standard, other))
    table = statistics.median(standard) / statistics.median(other)
    how = f"median of {len(ratios)} interleaved round(s)' ratios"
    if len(ratios) > 1:
        how += f", range {ratios[0]:.2f}-{ratios[-1]:.2f}x"
    if noisy:
        how += "; noisy CPU timing"
    return (
        f"fwd+bwd of {variant} vs standard: {table:.2f}x by the table's median times, "
        f"{statistics.median(ratios):.2f}x per round ({how})"
    )


RANK_PROCESS_BYTES = 100_000_000  # a spawned rank's own memory (Python and torch), at least


def memory_need(cfg: DemoConfig, args: argparse.Namespace) -> MemoryNeed:
    """What the demo needs at least: each rank's full dense layer (built in float32 on the host,
    then cast), its three variants' experts, one batch's tokens and the standard dispatch's rows;
    the parent's calibration (8x the tokens, float32) before the ranks start."""
    unit = 2 if cfg.dtype == "bfloat16" else 4
    E, H, F, T, k, D = cfg.experts, cfg.hidden, cfg.ffn, cfg.tokens, cfg.top_k, cfg.world_size
    weights = E * (3 * F * H + H)
    per_rank_device = unit * (weights + 3 * weights // D + T * H * (2 + k) + 2 * T * k * F) + 4 * T * H
    calibration = 4 * (weights + 8 * T * (H + E)) + 8 * 8 * T * k
    per_rank_host = RANK_PROCESS_BYTES + 4 * weights + (0 if cfg.backend == "nccl" else per_rank_device)
    flags = {"--tokens": T, "--hidden": H, "--ffn": F, "--experts": E, "--top-k": k, "--world-size": D}
    given = tuple(f for f in flags if getattr(args, f[2:].replace("-", "_"), None) is not None)
    return MemoryNeed(max(calibration, D * per_rank_host), per_rank_device, flags, given)


def worst_error(errors: list[float]) -> float:
    """The largest relative error, or NaN if any is (an overflowed --noise must fail the check:
    `max` of a list holding NaN depends on its order)."""
    return next((e for e in errors if e != e), max(errors))


def main(args: argparse.Namespace) -> int:
    backend = pick_backend(getattr(args, "backend", "auto"))
    cfg = demo_config(args, backend)
    check_config(cfg)
    need = memory_need(cfg, args)
    check_fits("occult demo", need, on_gpu=backend == "nccl", ranks=cfg.world_size)
    from occult.distributed import RankFailure
    from occult.placement.stats import mean_ct

    print(
        f"occult demo: {cfg.world_size} rank(s), backend {backend}, {cfg.tokens} tokens/rank, "
        f"hidden {cfg.hidden}, {cfg.experts} experts x ffn {cfg.ffn}, top-{cfg.top_k}, {cfg.dtype}",
        flush=True,
    )
    t0 = time.perf_counter()
    placement, calib_ids = place_from_profile(cfg)
    contiguous = Placement.contiguous(cfg.experts, cfg.world_size)
    ct = {
        "standard": float(cfg.top_k),
        "dedup": mean_ct(calib_ids, contiguous.expert_device(0), cfg.world_size),
        "dedup+placement": mean_ct(calib_ids, placement.expert_device(0), cfg.world_size),
    }
    print(
        f"profiled {len(calib_ids)} calibration tokens and placed experts in {time.perf_counter() - t0:.1f} s "
        f"(E[C_T] on calibration data: contiguous {ct['dedup']:.2f} -> placed {ct['dedup+placement']:.2f})",
        flush=True,
    )
    try:
        results = run_ranks(demo_worker, cfg.world_size, cfg, placement, backend=backend, timeout_s=900)
    except RankFailure as exc:
        return rank_failure("occult demo", need, exc)
    except KeyboardInterrupt:
        if cfg.progress:  # rank 0's bar may end the terminal's last line
            print(file=sys.stderr)
        raise
    # E[C_T] measured on the timed tokens: forward rows are dispatch + combine = 2 * sum C_T.
    total_tokens = cfg.tokens * cfg.world_size
    for name in ("dedup", "dedup+placement"):
        ct[name] = sum(r[name]["dispatch_rows"] for r in results) / total_tokens
    print()
    print(format_table(cfg, results, ct))
    errors = [r[n]["rel_error"] for r in results for n in r]
    tol = 2e-2 if cfg.dtype == "bfloat16" else 1e-4
    worst = worst_error(errors)
    if not worst <= tol:
        print(f"\nFAILED: a variant differs from the dense reference by {worst:.2e} (> {tol:.0e})")
        return 1
    print(
        f"\nAll variants match the dense reference (rel err <= {tol:.0e}). "
        f"Rows sent: dedup+placement {sum(r['dedup+placement']['forward_rows'] for r in results)} vs standard "
        f"{sum(r['standard']['forward_rows'] for r in results)}; {speed_line(results, backend == 'gloo')}."
    )
    if backend == "gloo":
        print(
            f"(CPU ranks, {_cpu_threads(cfg.world_size)} thread(s) each on this machine's shared cores: times are "
            "noisy and measure CPU compute and gloo, not GPU speed; rows and bytes are exact. See `occult bench` "
            "on GPUs.)"
        )
    return 0
