#!/usr/bin/env python3
"""occult against real peers, side by side: same shapes, weights, routing, process group, run.

    python3 benchmarks/peers/run.py --world-size 4,2 --out docs/results/peers_H200.json

spawns one rank per GPU (NCCL; gloo ranks on CPU for a smoke test) with
`occult.distributed.run_ranks`, and on each world size runs occult (standard and dedup) and every
peer that is installed: Megatron-Core's `MoELayer` (alltoall dispatcher, local spec),
transformers' expert parallelism (`all_to_all`) on an OLMoE and a Qwen3-MoE block, and
DeepSpeed-MoE's `MoE` layer, and TorchTitan's `MoE` (grouped-GEMM experts, all-to-all EP).
Each is checked against a float32 reference before it is timed; a peer that fails is reported
with its error and the run goes on. Peers are not dependencies of occult: install them from
benchmarks/requirements-peers.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for p in (str(HERE), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import peer_bench  # noqa: E402
import torch  # noqa: E402

from occult.tools.bench import SHAPES  # noqa: E402
from occult.tools.run_record import run_record  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks/peers/run.py", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--world-size", default=None, help="ranks, or a comma list run one after another (default: all GPUs, else 2)"
    )
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    ap.add_argument(
        "--shapes", default=None, help=f"comma list of {','.join(SHAPES)} (default: olmoe on GPU, tiny on CPU)"
    )
    ap.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 8192 on GPU, 64 on CPU)")
    ap.add_argument("--peers", default=",".join(peer_bench.PEERS), help="comma list of " + ", ".join(peer_bench.PEERS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--input-sets", type=int, default=3, help="fresh random input sets rotated between timed calls")
    ap.add_argument(
        "--per-peer-s", type=float, default=40.0, help="iterations shrink so one peer's timing fits in this"
    )
    ap.add_argument(
        "--timeout-s",
        default="600",
        help="kill the ranks of a world size after this many seconds "
        "(one number, or a comma list matching --world-size); the remaining peers are skipped after 75%% of it",
    )
    ap.add_argument(
        "--tolerance", type=float, default=None, help="max rel err vs float32 (default 2e-2 on GPU, 1e-4 on CPU)"
    )
    ap.add_argument("--time-wrong", action="store_true", help="time a peer even when its output check fails")
    ap.add_argument("--out", default=None, help="write all numbers as JSON here")
    args = ap.parse_args(argv)
    return args


def resolve(args: argparse.Namespace) -> tuple[list[int], dict]:
    """World sizes and the worker's configuration; raises SystemExit on a bad argument."""
    from occult.distributed import pick_backend

    backend = pick_backend(args.backend)
    on_gpu = backend == "nccl"
    if args.world_size:
        try:
            worlds = [int(w) for w in str(args.world_size).split(",")]
        except ValueError:
            raise SystemExit(f"run.py: error: --world-size must be integers, got {args.world_size!r}") from None
    else:
        worlds = [torch.cuda.device_count() if on_gpu else 2]
    if any(w < 1 for w in worlds):
        raise SystemExit("run.py: error: --world-size must be >= 1")
    if on_gpu and max(worlds) > torch.cuda.device_count():
        raise SystemExit(f"run.py: error: {max(worlds)} ranks but {torch.cuda.device_count()} GPUs")
    shapes = (args.shapes or ("olmoe" if on_gpu else "tiny")).split(",")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"run.py: error: unknown shape {s!r}; choose from {', '.join(SHAPES)}")
        for w in worlds:
            if SHAPES[s].experts % w:
                raise SystemExit(
                    f"run.py: error: shape {s} has {SHAPES[s].experts} experts, not divisible by {w} ranks"
                )
    peers = [p for p in args.peers.split(",") if p]
    for p in peers:
        if p not in peer_bench.PEERS:
            raise SystemExit(f"run.py: error: unknown peer {p!r}; choose from {', '.join(peer_bench.PEERS)}")
    try:
        timeouts = [float(t) for t in str(args.timeout_s).split(",")]
    except ValueError:
        raise SystemExit(f"run.py: error: --timeout-s must be numbers, got {args.timeout_s!r}") from None
    if len(timeouts) == 1:
        timeouts = timeouts * len(worlds)
    if len(timeouts) != len(worlds) or min(timeouts) <= 0:
        raise SystemExit("run.py: error: --timeout-s needs one positive number or one per world size")
    conf = dict(
        backend=backend,
        shapes=shapes,
        peers=peers,
        tokens=args.tokens or (8192 if on_gpu else 64),
        warmup=args.warmup,
        iters=args.iters,
        input_sets=max(2, args.input_sets),
        per_peer_s=args.per_peer_s,
        timeouts=dict(zip(worlds, timeouts)),
        tolerance=args.tolerance if args.tolerance is not None else (2e-2 if on_gpu else 1e-4),
        time_wrong=args.time_wrong,
    )
    return worlds, conf


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for dist_name in ("transformers", "megatron-core", "deepspeed", "torchtitan", "accelerate", "triton"):
        try:
            out[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            out[dist_name] = "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    from occult.distributed import RankFailure, run_ranks

    args = parse_args(argv)
    worlds, conf = resolve(args)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    result = {
        "config": {
            **conf,
            "worlds": worlds,
            "versions": versions(),
            "device": torch.cuda.get_device_name(0) if conf["backend"] == "nccl" else "cpu",
            **run_record(max(worlds), conf["backend"] == "nccl"),  # the link of the largest world
        },
        "runs": [],
        "failures": [],
    }
    print(
        f"peers: world sizes {worlds}, backend {conf['backend']}, shapes {conf['shapes']}, "
        f"{conf['tokens']} tokens/rank, peers {conf['peers']}",
        flush=True,
    )
    print(json.dumps(result["config"]["versions"]), flush=True)
    print(peer_bench.HEADER, flush=True)
    for world in worlds:
        t0 = time.monotonic()
        timeout = conf["timeouts"][world]
        partial = Path(tempfile.gettempdir()) / f"occult_peers_{os.getpid()}_{world}.json"
        partial.unlink(missing_ok=True)
        try:
            outs = run_ranks(
                peer_bench.worker,
                world,
                {**conf, "deadline_s": 0.75 * timeout, "partial_path": str(partial)},
                backend=conf["backend"],
                timeout_s=timeout,
                collective_timeout_s=min(120.0, timeout),
            )
            result["runs"].extend(outs[0]["runs"])
        except RankFailure as exc:
            msg = str(exc)
            print(f"world {world}: ranks failed:\n{msg[-4000:]}", flush=True)
            result["failures"].append({"world": world, "error": msg[-8000:]})
            if partial.exists():  # what rank 0 finished before the failure
                try:
                    result["runs"].extend(json.loads(partial.read_text())["runs"])
                except (OSError, ValueError, KeyError):
                    pass
        partial.unlink(missing_ok=True)
        print(f"world {world}: {time.monotonic() - t0:.0f} s", flush=True)
        if args.out:  # after every world size, so a later failure keeps what was measured
            write_json(args.out, result)
    print()
    print(summary(result))
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


def write_json(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def summary(result: dict) -> str:
    lines = [peer_bench.HEADER, "-" * len(peer_bench.HEADER)]
    lines += [peer_bench.format_row(r) for r in result["runs"]]
    # ours against the fastest peer that ran and agreed with the reference
    for world in sorted({r["world"] for r in result["runs"]}, reverse=True):
        for shape in sorted({r["shape"] for r in result["runs"] if r["world"] == world}):
            rows = [r for r in result["runs"] if r["world"] == world and r["shape"] == shape and "fwd_bwd_ms" in r]
            ours = next((r for r in rows if r["peer"] == "occult-dedup" and r["status"] == "ok"), None)
            peers = [r for r in rows if not r["peer"].startswith("occult") and r["status"] == "ok"]
            if ours and peers:
                best_f = min(peers, key=lambda r: r["forward_ms"])
                best_s = min(peers, key=lambda r: r["fwd_bwd_ms"])
                lines.append(
                    f"{world} ranks {shape}: occult dedup vs fastest peer: forward "
                    f"{best_f['forward_ms'] / ours['forward_ms']:.2f}x ({best_f['name']}), forward+backward "
                    f"{best_s['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}x ({best_s['name']})"
                )
    for f in result.get("failures", []):
        lines.append(f"world {f['world']}: FAILED ({f['error'].splitlines()[0][:200]})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
