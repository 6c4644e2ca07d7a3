"""`occult demo` and `occult bench`: the flags here, the tools in `occult.tools`.

The flags (with the shared argument types of `occult.cli.registry`: a negative or zero size is an
argparse error before any rank starts) are defined here, so `occult demo --help` imports no
torch; `occult.tools.demo` / `occult.tools.bench` are imported only when their command runs
(`main(args)`). `BENCH_SHAPES` and `BENCH_VARIANTS` mirror `occult.tools.bench.SHAPES` and
`VARIANTS` (tests/cli/test_cli.py checks that they agree).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from occult.cli.registry import (
    Command,
    check_output,
    lazy,
    nonnegative_float,
    nonnegative_int,
    positive_int,
    positive_int_list,
    seed_int,
)

BENCH_SHAPES = ("olmoe", "qwen3", "deepseek", "mixtral", "tiny")
BENCH_VARIANTS = (
    "standard",
    "dedup",
    "dedup+placement",
    "dedup2",
    "standard@device",
    "dedup@device",
    "standard@device/graph",
    "dedup@device/graph",
    "dedup@syncfree/graph",
)
BENCH_ROUTINGS = ("random", "planted")


def choice_list(choices: tuple[str, ...], what: str) -> Callable[[str], list[str]]:
    """argparse type: a comma list of `choices`, e.g. `olmoe,qwen3`."""

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",")]
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {bad[0]!r}; choose from {', '.join(choices)} (comma list)"
            )
        return items

    return parse


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size", type=positive_int, default=None, help="ranks to spawn (default: GPUs present, else 4 CPU ranks)"
    )
    parser.add_argument(
        "--tokens", type=positive_int, default=None, help="tokens per rank (default: 8192 on GPU, 1024 on CPU)"
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=5,
        help="timed rounds after one warm-up round (default 5); each round times every variant once, "
        "interleaved; medians reported",
    )
    parser.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="process-group backend; auto: NCCL when CUDA GPUs are present, else gloo (default auto)",
    )
    parser.add_argument(
        "--hidden", type=positive_int, default=None, help="hidden size (default: 2048 on GPU, 256 on CPU)"
    )
    parser.add_argument(
        "--ffn", type=positive_int, default=None, help="expert ffn size (default: 1024 on GPU, 128 on CPU)"
    )
    parser.add_argument("--experts", type=positive_int, default=None, help="number of experts (default 64)")
    parser.add_argument("--top-k", type=positive_int, default=None, help="experts per token (default 8)")
    parser.add_argument(
        "--noise",
        type=nonnegative_float,
        default=0.8,
        help="spread of tokens around their group centroid (default 0.8)",
    )
    parser.add_argument(
        "--seed", type=seed_int, default=0, help="seed of the layer's weights, expert groups and tokens (default 0)"
    )
    parser.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress bar (it is drawn on stderr only when that is a terminal)",
    )


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size", type=positive_int, default=None, help="ranks (default: all GPUs, else 2 CPU ranks)"
    )
    parser.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="process-group backend; auto: NCCL when CUDA GPUs are present, else gloo (default auto)",
    )
    parser.add_argument(
        "--shapes",
        type=choice_list(BENCH_SHAPES, "shape"),
        default=None,
        help=f"comma list of {','.join(BENCH_SHAPES)} (default: olmoe on GPU, tiny on CPU)",
    )
    parser.add_argument(
        "--tokens",
        type=positive_int_list,
        default=None,
        help="tokens per rank, comma list (default 8192 on GPU, 256 on CPU)",
    )
    parser.add_argument(
        "--routing",
        type=choice_list(BENCH_ROUTINGS, "routing"),
        default=list(BENCH_ROUTINGS),
        help="comma list: random, planted (default both)",
    )
    parser.add_argument(
        "--variants",
        type=choice_list(BENCH_VARIANTS, "variant"),
        default=list(BENCH_VARIANTS[:3]),
        help="comma list of " + ", ".join(BENCH_VARIANTS) + " (default: the first three; "
        "'@device': over the device transport, no host wait; NCCL GPUs of one host only; '@syncfree': "
        "fixed-capacity all-to-alls, no host wait; "
        "'/graph': forwards replayed from the layer's CUDA graphs, ExecConfig(graphs=True))",
    )
    parser.add_argument(
        "--nodes",
        type=positive_int,
        default=1,
        help="nodes the ranks are grouped into for the two-level 'dedup2' variant, which needs it (>= 2, "
        "node-major ranks; on one host: simulated nodes); other variants ignore it (default 1)",
    )
    parser.add_argument(
        "--expert-backend",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="expert MLP: the torch reference, the Triton kernels (CUDA GPUs only), or auto (Triton on a CUDA GPU, "
        "else torch) (default auto)",
    )
    parser.add_argument(
        "--warmup", type=nonnegative_int, default=5, help="untimed calls before each timing (default 5)"
    )
    parser.add_argument(
        "--iters", type=positive_int, default=20, help="timed calls; the median is reported (default 20)"
    )
    parser.add_argument(
        "--input-sets", type=positive_int, default=3, help="fresh random inputs rotated between timed calls (default 3)"
    )
    parser.add_argument(
        "--out", default=None, help="write all numbers as JSON to this file ('-': stdout; default: none)"
    )


def _run_bench(args: argparse.Namespace) -> int | None:
    check_output("--out", args.out, "bench.json")  # before minutes of timing
    return lazy("occult.tools.bench")(args)


DEMO = Command(
    "demo", "run a small expert-parallel MoE on CPU ranks (gloo) or GPUs", add_demo_arguments, lazy("occult.tools.demo")
)
BENCH = Command(
    "bench", "time one MoE layer on 1-N GPUs: standard vs dedup vs dedup+placement", add_bench_arguments, _run_bench
)
