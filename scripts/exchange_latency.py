"""One all-to-all's latency at decode sizes: the device transport's exchange against NCCL's.

Run under torchrun, one rank per GPU of one host. For each row count (rows each rank sends to each
rank) it checks the device transport's exchange (every region holds its source's rows), then times
`--exchanges` back-to-back exchanges captured in one CUDA graph and issued eagerly, for the device
transport (`occult.moe.symm.DeviceTransport.exchange`: the push kernel, the group barrier, the count
copies) and for NCCL's `all_to_all_single` of the same bytes. Rank 0 prints microseconds per exchange
(median over `--iters` replays, CUDA events) and the bytes leaving a rank per second (GB/s; at prefill
counts such as `--rows 4096,8192 --exchanges 4` this is the transport's bandwidth against NCCL's) and
writes every number to --out. A decode step makes
two exchanges per MoE layer, so this is the cost that separates the expert-parallel step from the
replicated one at small batches (docs/history.md, "Serving on 2 GPUs").

    torchrun --nproc-per-node 2 scripts/exchange_latency.py --rows 1,8,64 --out exchange.json

Keep NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from occult.distributed import finish_distributed, init_distributed
from occult.moe import symm
from occult.tools.run_record import run_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,64", help="rows each rank sends to each rank, comma list (default 1,8,64)")
    p.add_argument("--hidden", type=int, default=2048, help="bf16 values per row (default 2048, OLMoE)")
    p.add_argument(
        "--exchanges",
        type=int,
        default=32,
        help="exchanges per timed batch; even (default 32: a decode step of 16 MoE layers)",
    )
    p.add_argument("--iters", type=int, default=50, help="timed batches (default 50)")
    p.add_argument(
        "--transports",
        default="device,nccl",
        help="comma list of device, nccl (default both; nccl alone measures a link the device transport does not "
        "use, e.g. NCCL_P2P_DISABLE=1's path through host memory)",
    )
    p.add_argument("--out", default=None, help="JSON file for every number (rank 0)")
    args = p.parse_args(argv)
    args.transports = [t for t in args.transports.split(",") if t]
    if not args.transports or set(args.transports) - {"device", "nccl"}:
        p.error(f"--transports must be a comma list of device, nccl; got {','.join(args.transports)!r}")
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows must be a comma list of integers, got {args.rows!r}")
    if min(args.rows) < 1 or args.hidden < 1 or args.iters < 1 or args.exchanges < 2 or args.exchanges % 2:
        p.error(
            "--rows, --hidden and --iters must be >= 1, --exchanges an even number >= 2 (the transport's two "
            "buffer sets alternate)"
        )
    return args


def timed_us(run: Callable[[], None], iters: int) -> float:
    """Median microseconds of `run()` over `iters` calls (CUDA events), after two warm-up calls."""
    for _ in range(2):
        run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def captured(run: Callable[[], None]) -> Callable[[], None]:
    """`run` captured once in a CUDA graph (warmed up on a side stream first); the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    torch.cuda.synchronize()
    return graph.replay


def check_device(transport: symm.DeviceTransport, src_NW: torch.Tensor, counts_D: torch.Tensor, rows: int) -> bool:
    """One exchange: region s of what arrives holds rank s's rows for this rank, and its count."""
    D, rank = transport.num_ranks, transport.rank
    recv, recv_counts_D, _ = transport.exchange(src_NW, counts_D, rows)
    if src_NW.is_cuda:
        torch.cuda.synchronize()
    ok = bool((recv_counts_D == rows).all())
    for s in range(D):  # rank s filled its rows for rank d with the byte (s * D + d) % 251
        ok &= bool((recv[s * rows : (s + 1) * rows] == (s * D + rank) % 251).all())
    flag = torch.tensor([int(ok)], device=src_NW.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def send_rows(
    num_ranks: int, rank: int, rows: int, hidden: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(byte rows [D * rows, W]: the block for rank d filled with (rank * D + d) % 251, counts [D])."""
    width = symm.row_bytes(2 * hidden)
    src_NW = torch.empty((num_ranks * rows, width), dtype=torch.uint8, device=device)
    for d in range(num_ranks):
        src_NW[d * rows : (d + 1) * rows] = (rank * num_ranks + d) % 251
    return src_NW, torch.full((num_ranks,), rows, dtype=torch.int64, device=device)


def measure(rows: int, args: argparse.Namespace, transport: symm.DeviceTransport | None) -> dict:
    """One row count's numbers: the device transport's (when `transport` is given) and NCCL's (when asked)."""
    D, rank, device = dist.get_world_size(), dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    src_NW, counts_D = send_rows(D, rank, rows, args.hidden, device)
    width = src_NW.shape[1]
    row = {"rows_per_rank": rows, "bytes_per_rank": D * rows * width, "remote_bytes_per_rank": (D - 1) * rows * width}
    if transport is not None:
        transport.reserve(D * rows * width)
        row["checked"] = check_device(transport, src_NW, counts_D, rows)
    n = args.exchanges

    def device_batch() -> None:
        for _ in range(n):
            transport.exchange(src_NW, counts_D, rows)

    send, recv = src_NW.reshape(-1), torch.empty_like(src_NW).reshape(-1)

    def nccl_batch() -> None:
        for _ in range(n):
            dist.all_to_all_single(recv, send)

    if "nccl" in args.transports:
        nccl_batch()
        torch.cuda.synchronize()
        expected = torch.cat([torch.full((rows, width), (s * D + rank) % 251, dtype=torch.uint8) for s in range(D)])
        flag = torch.tensor([int(torch.equal(recv.reshape(-1, width).cpu(), expected))], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        row["nccl_checked"] = bool(flag.item())
    batches = {"device": device_batch, "nccl": nccl_batch}
    for name in args.transports:
        batch = batches[name]
        row[f"{name}_eager_us"] = timed_us(batch, args.iters) / n
        try:
            row[f"{name}_graph_us"] = timed_us(captured(batch), args.iters) / n
        except Exception as exc:  # noqa: BLE001 (recorded; the other numbers stand)
            row[f"{name}_graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    for key in [k for k in row if k.endswith("_us")]:  # bytes leaving a rank per second (bandwidth at big counts)
        row[key[:-3] + "_gb_s"] = row["remote_bytes_per_rank"] / row[key] / 1e3
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("exchange_latency.py: needs CUDA GPUs of one host under torchrun (one rank per GPU)", file=sys.stderr)
        return 2
    rank, world = init_distributed("nccl")
    ok = False
    try:
        reason = symm.unavailable_reason(dist.group.WORLD) if world > 1 else "one rank (run under torchrun on 2+ GPUs)"
        if reason and (world < 2 or "device" in args.transports):
            if rank == 0:
                print(f"exchange_latency.py: the device transport cannot run here: {reason}", file=sys.stderr)
            return 2
        transport = symm.choose_transport("device", dist.group.WORLD) if "device" in args.transports else None
        rows = [measure(r, args, transport) for r in args.rows]
        if rank == 0:
            print(
                f"\n{world} x {torch.cuda.get_device_name(0)}, {args.hidden} bf16 per row, {args.exchanges} exchanges "
                "per batch; us per exchange (median)\n"
            )
            print(
                "| rows per rank pair | bytes per rank | checked (device/NCCL) | device graph | device eager "
                "| NCCL graph | NCCL eager | device graph GB/s | NCCL graph GB/s |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                cells = [
                    f"{r[k]:.1f}" if k in r else "-"
                    for k in (
                        "device_graph_us",
                        "device_eager_us",
                        "nccl_graph_us",
                        "nccl_eager_us",
                        "device_graph_gb_s",
                        "nccl_graph_gb_s",
                    )
                ]
                checked = f"{r.get('checked', '-')}/{r.get('nccl_checked', '-')}"
                print(f"| {r['rows_per_rank']} | {r['bytes_per_rank']:,} | {checked} | " + " | ".join(cells) + " |")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(
                        {
                            "world": world,
                            "device": torch.cuda.get_device_name(0),
                            **run_record(world, True),
                            "args": vars(args),
                            "rows": rows,
                        },
                        f,
                        indent=1,
                    )
        ok = all(r.get("checked", True) and r.get("nccl_checked", True) for r in rows)
        return 0 if ok else 1
    finally:
        finish_distributed(ok)


if __name__ == "__main__":
    sys.exit(main())
