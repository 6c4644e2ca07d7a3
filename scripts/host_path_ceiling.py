"""The ceiling of the path a "slow link" takes: each GPU's copies to and from pinned host memory.

With peer-to-peer off (`NCCL_P2P_DISABLE=1`, or a PCIe machine without it) NCCL moves a rank's rows through host
memory: the sender's GPU writes them there, the receiver's reads them. So no all-to-all between the GPUs of one host
can go faster than the GPUs' own copies to and from the host, measured here on one process: per GPU, device ->
pinned host and pinned host -> device alone and both at once (two streams), then every GPU copying both ways at
once (what an all-to-all asks of the host's PCIe links together). GB/s per copy: medians by the host clock,
each copy waited for on its device. Compare `scripts/exchange_latency.py --transports nccl`
under `NCCL_P2P_DISABLE=1` (docs/overlap.md, "The slow link's ceiling").

    python scripts/host_path_ceiling.py --out host_path.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from occult.tools.run_record import run_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64, help="MiB per copy (default 64: an OLMoE layer's rows a direction)")
    p.add_argument("--iters", type=int, default=20, help="timed copies (default 20)")
    p.add_argument("--out", default=None, help="JSON file for every number")
    args = p.parse_args(argv)
    if args.mib < 1 or args.iters < 1:
        p.error(f"--mib and --iters must be >= 1, got {args.mib} and {args.iters}")
    return args


def median_s(run: Callable[[], None], iters: int, sync: Callable[[], None]) -> float:
    """Median seconds of `run()` (host clock, `sync` after each), after three warm-up calls."""
    for _ in range(3):
        run()
        sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


WAYS = {"to_host_gb_s": (True, False), "to_device_gb_s": (False, True), "both_each_gb_s": (True, True)}


class HostCopies:
    """One GPU's buffers for copies both ways through pinned host memory, on two streams of its own."""

    def __init__(self, device: int, nbytes: int) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.gpu_out = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
            self.gpu_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            self.streams = (torch.cuda.Stream(), torch.cuda.Stream())
        self.host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host_in = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)

    def issue(self, to_host: bool, to_device: bool) -> None:
        with torch.cuda.device(self.device):
            if to_host:
                with torch.cuda.stream(self.streams[0]):
                    self.host_out.copy_(self.gpu_out, non_blocking=True)
            if to_device:
                with torch.cuda.stream(self.streams[1]):
                    self.gpu_in.copy_(self.host_in, non_blocking=True)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


def measure(args: argparse.Namespace) -> dict:
    nbytes = args.mib << 20
    gpus = [HostCopies(d, nbytes) for d in range(torch.cuda.device_count())]
    per_gpu = {}
    for g in gpus:
        per_gpu[f"cuda:{g.device}"] = {
            name: nbytes / median_s(lambda: g.issue(*ways), args.iters, g.sync) / 1e9 for name, ways in WAYS.items()
        }

    def every_gpu_both_ways() -> None:
        for g in gpus:
            g.issue(True, True)

    def sync_all() -> None:
        for g in gpus:
            g.sync()

    together = nbytes / median_s(every_gpu_both_ways, args.iters, sync_all) / 1e9
    return {"per_gpu": per_gpu, "every_gpu_both_ways_each_gb_s": together}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("host_path_ceiling.py: needs CUDA GPUs", file=sys.stderr)
        return 2
    result = measure(args)
    print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, {args.mib} MiB a copy, GB/s per copy:")
    for dev, row in result["per_gpu"].items():
        print(f"  {dev}: " + ", ".join(f"{k[:-5]} {v:.1f}" for k, v in row.items()))
    print(f"  every GPU both ways at once: {result['every_gpu_both_ways_each_gb_s']:.1f}")
    if args.out:
        doc = {
            "device": torch.cuda.get_device_name(0),
            "gpus": torch.cuda.device_count(),
            **run_record(torch.cuda.device_count(), True),
            "args": vars(args),
            **result,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
