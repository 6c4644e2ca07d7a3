"""The report of `occult bench`: the table (`HEADER`, `format_row`), what each column means
(`LEGEND`), speed-ups against the standard dispatcher, the layer's forward and backward MFU (`layer_mfu`: issue 52
asks both) and the measured ceilings (`summarize`)."""

from __future__ import annotations

from typing import Any


def format_row(run: dict[str, Any]) -> str:
    """One run as a row of the table under `HEADER`."""
    return (
        f"{run['shape']:<9}{run['routing']:<8}{run['tokens']:>6} {run['variant']:<16}{run['mean_ct']:>6.2f}"
        f"{run['forward_ms']:>9.2f}{run['fwd_bwd_ms']:>10.2f}{run['floor_ms']:>9.2f}{run['expert_ms']:>9.2f}"
        f"{run['all_to_all_ms']:>9.2f}{run['all_to_all_GBps']:>10.1f}{run['expert_tflops']:>9.1f}{run['rel_error']:>9.1e}"
        f"{_syncs(run['host_syncs_fwd_bwd']):>6}{_ms(run.get('host_ms_fwd')):>8} {run.get('transport', ''):<7}"
    )


def layer_mfu(run: dict[str, Any], matmul_tflops: float) -> tuple[float, float] | None:
    """The layer's forward and backward MFU: its expert GEMM FLOPs (the backward: twice the forward's) over its
    forward time and over fwd+bwd less forward (that forward timed without autograd: the backward's MFU a lower
    bound), against the measured bf16 matmul rate; None without the FLOPs or a positive backward time."""
    gflop, fwd_ms, bwd_ms = run.get("expert_gflop_fwd"), run["forward_ms"], run["fwd_bwd_ms"] - run["forward_ms"]
    if not gflop or fwd_ms <= 0 or bwd_ms <= 0 or matmul_tflops <= 0:
        return None
    return gflop / fwd_ms / matmul_tflops, 2 * gflop / bwd_ms / matmul_tflops


def layer_mfu_lines(result: dict[str, Any]) -> list[str]:
    """The report's MFU lines, one a run (where a matmul rate was measured: GPUs)."""
    peak = result.get("ceilings", {}).get("matmul_tflops")
    rows = [(run, layer_mfu(run, peak)) for run in result["runs"]] if peak else []
    if not any(m for _, m in rows):
        return []
    lines = ["layer MFU (expert GEMM FLOPs / the layer's time / measured bf16 matmul rate), forward / backward:"]
    for run, mfu in rows:
        if mfu:
            lines.append(
                f"  {run['shape']:<9}{run['routing']:<8}{run['tokens']:>6} {run['variant']:<16}"
                f"{100 * mfu[0]:>5.1f}% / {100 * mfu[1]:>5.1f}%"
            )
    return lines


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _syncs(n: int | None) -> str:
    return "n/a" if n is None or n < 0 else str(n)


HEADER = (
    f"{'shape':<9}{'routing':<8}{'tokens':>6} {'variant':<16}{'E[C_T]':>6}{'fwd ms':>9}{'fwd+bwd':>10}{'floor':>9}"
    f"{'experts':>9}{'a2a ms':>9}{'a2a GB/s':>10}{'TFLOP/s':>9}{'rel err':>9}{'syncs':>6}{'host ms':>8} {'via':<7}"
)


LEGEND = {
    "E[C_T]": "rows each token sends (standard: top-k)",
    "fwd ms, fwd+bwd": "the layer's median time, forward and forward+backward (the slowest rank's median)",
    "floor": "experts + a2a ms: the expert compute and the all-to-alls alone, nothing else",
    "experts": "the expert MLP alone on the received rows, ms",
    "a2a ms, a2a GB/s": "the dispatch + combine all-to-alls alone, over the variant's transport (device: its "
    "push; counts: all_to_all_single); remote bytes leaving a rank / that time",
    "TFLOP/s": "expert FLOPs / experts time",
    "rel err": "output vs a float32 dense reference (256 tokens)",
    "syncs": "device-to-host synchronisations in one forward+backward (CUDA sync debug mode; n/a on CPU)",
    "host ms": "the host's time to issue one forward on an idle GPU (its waits for the GPU included; n/a on CPU)",
    "via": "the transport: device (counts stay on the GPU, no host wait), counts (the count exchange's host wait) or "
    "sync-free (fixed-capacity all-to-alls, no host wait)",
}


def summarize(result: dict[str, Any], table: bool = True) -> str:
    """The report: the table (unless it was already printed row by row), what every column means,
    speed-ups against standard, and the measured ceilings."""
    lines = [HEADER, "-" * len(HEADER)] + [format_row(run) for run in result["runs"]] if table else []
    base: dict[tuple, dict] = {}
    for run in result["runs"]:
        key = (run["shape"], run["routing"], run["tokens"])
        if run["variant"] == "standard":
            base[key] = run
    lines += ["columns:"] + [f"  {k:<17}{v}" for k, v in LEGEND.items()] + [""]
    lines.append("speedup vs standard (fwd / fwd+bwd), and time over floor (fwd / floor):")
    for run in result["runs"]:
        b = base.get((run["shape"], run["routing"], run["tokens"]))
        if b and run["variant"] != "standard":
            lines.append(
                f"  {run['shape']:<9}{run['routing']:<8}{run['tokens']:>6} {run['variant']:<16}"
                f"{b['forward_ms'] / run['forward_ms']:>6.2f}x {b['fwd_bwd_ms'] / run['fwd_bwd_ms']:>6.2f}x"
                f"   {run['forward_ms'] / run['floor_ms']:>5.2f}x floor"
            )
    if any(run["variant"].startswith("dedup2") for run in result["runs"]):
        lines.append(
            "dedup2: its E[C_T] column counts the rows of both stages per token (over the rail, then inside "
            "the node); its all-to-alls are not timed alone (floor = experts)"
        )
    lines += layer_mfu_lines(result)
    c = result["ceilings"]
    names = {
        "matmul_tflops": "bf16 matmul TFLOP/s",
        "all_to_all_GBps": "all_to_all_single GB/s leaving a rank",
        "all_to_all_MB": "its message MB",
    }
    if c:
        lines.append("ceilings (measured): " + ", ".join(f"{names.get(k, k)} {v:.1f}" for k, v in c.items()))
    return "\n".join(lines)
