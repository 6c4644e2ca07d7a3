"""`occult place` and `occult stats`: solve a placement from a routing trace, report its
collaboration statistics against contiguous (table or JSON), optionally draw heat maps.

Nothing heavy is imported until a command runs: `PLACE_METHODS` and `DEFAULT_KAHYPAR_TOKENS`
mirror `occult.placement.solvers` so that building the parser imports neither numpy nor torch
(tests/cli/test_cli.py checks that they agree).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

from occult.cli.inputs import check_devices, load_placement, load_trace, reading
from occult.cli.place_report import nt_cols, nt_lists, print_json, print_table, why_chosen
from occult.cli.registry import (
    Command,
    CommandError,
    check_input,
    check_output,
    positive_int,
    seed_int,
    writing,
)

PLACE_METHODS = ("contiguous", "greedy", "hypergraph")
DEFAULT_KAHYPAR_TOKENS = 8_000


def _layer_list(text: str) -> list[int]:
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        layers = []
    if not layers or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices (0, 1, ...), got {text!r}")
    return layers


def _add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=positive_int, default=2048, help="hidden size for the byte counts (default 2048)")
    p.add_argument(
        "--dtype", default="bf16", help="activation dtype for the byte counts: bf16, fp16, fp32, fp8 (default bf16)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of the table")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw co-activation heat maps ordered by device, before and after (needs matplotlib; '-': "
        "stdout; default: none)",
    )
    p.add_argument("--plot-layers", type=_layer_list, metavar="I,J,...", help="layers to draw (default: the first 8)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def _progress(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def _load_ratio(text: str) -> float:
    """argparse type of --max-load: a finite max/mean load bound, at least 1."""
    try:
        ratio = float(text)
    except ValueError:
        ratio = float("nan")
    if not 1 <= ratio < float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected max/mean device load, a finite number >= 1 (e.g. 1.1), got {text!r}"
        )
    return ratio


def _plot_formats() -> dict[str, str]:
    """{suffix: description} of the image formats matplotlib writes (--plot FILE.suffix)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise CommandError(
            "--plot needs matplotlib, an optional extra: pip install 'occult[plots]' (or drop --plot)"
        ) from None
    return FigureCanvasBase.get_supported_filetypes()


def _check_report_flags(args: argparse.Namespace) -> None:
    """--dtype, --plot and --plot-layers of place / stats, before the trace is read or anything solved."""
    from occult.placement.stats import element_size

    with reading("--dtype", args.dtype):
        element_size(args.dtype)
    check_output("--plot", args.plot, "heatmap.png")
    if args.plot_layers is not None and not args.plot:
        raise CommandError("--plot-layers chooses the layers --plot draws: give --plot FILE.png too")
    if args.plot:
        suffix = os.path.splitext(str(args.plot))[1].lstrip(".").lower()
        formats = _plot_formats()
        if suffix and suffix not in formats:
            raise CommandError(
                f"--plot {args.plot}: matplotlib cannot write .{suffix} images; "
                f"give a file ending in .{', .'.join(sorted(formats))}"
            )


def _check_plot_layers(args: argparse.Namespace, trace: Any) -> None:
    """--plot-layers inside the trace, checked before anything is solved or written."""
    bad = [i for i in (args.plot_layers or []) if i >= trace.num_layers]
    if args.plot and bad:
        raise CommandError(f"--plot-layers: layer {bad[0]} is out of range: the trace has {trace.num_layers} layer(s)")


def _coacts(trace: Any, progress: bool) -> list[Any]:
    from occult.placement.stats import coactivation

    layers = range(trace.num_layers)
    if progress:
        from tqdm.auto import tqdm

        layers = tqdm(layers, desc="co-activation", unit="layer", file=sys.stderr, leave=False)
    return [coactivation(trace.layer(i), trace.num_experts) for i in layers]


def _maybe_plot(
    args: argparse.Namespace, trace: Any, coacts: list[Any], placement: Any, baseline: Any, labels: tuple[str, str]
) -> list[int] | None:
    if not args.plot:
        return None
    from occult.placement.plots import DEFAULT_MAX_LAYERS, coactivation_heatmaps

    with writing("--plot", args.plot):
        drawn = coactivation_heatmaps(
            args.plot, coacts, placement, baseline, layers=args.plot_layers, num_tokens=trace.num_tokens, labels=labels
        )
    if args.plot_layers is None and trace.num_layers > DEFAULT_MAX_LAYERS and not args.json:
        print(
            f"occult: plotted layers 0-{DEFAULT_MAX_LAYERS - 1} of {trace.num_layers}; "
            "choose others with --plot-layers",
            file=sys.stderr,
        )
    return drawn


# ------------------------------------------------------------------ place
def _add_place_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="routing trace (.safetensors; format: the README's Files section)")
    p.add_argument(
        "--devices", "-d", required=True, type=positive_int, help="expert-parallel devices (ranks), all nodes together"
    )
    p.add_argument(
        "--nodes",
        type=positive_int,
        default=1,
        help="nodes of D/M devices each: place experts on nodes first (fewest nodes per token, E[N_T]), "
        "then on each node's devices (E[C_T]); device ids node-major (default 1: flat)",
    )
    p.add_argument(
        "--method", "-m", choices=PLACE_METHODS, default="hypergraph", help="placement solver (default hypergraph)"
    )
    p.add_argument(
        "--out",
        "-o",
        help="write the placement JSON to this file ('-': stdout, the report then on stderr; "
        "a device or FIFO is written in place; default: none)",
    )
    p.add_argument(
        "--max-load",
        type=_load_ratio,
        metavar="RATIO",
        help="bound on max/mean per-device token-expert load, a finite number >= 1, e.g. 1.1",
    )
    p.add_argument(
        "--seed",
        type=seed_int,
        default=None,
        help="seed for Mt-KaHyPar and its token sample, --method hypergraph only (default 0)",
    )
    p.add_argument(
        "--jobs",
        "-j",
        type=positive_int,
        help="worker processes solving layers in parallel (default: one per CPU for large traces)",
    )
    p.add_argument(
        "--kahypar-tokens",
        type=positive_int,
        default=None,
        help="tokens per layer Mt-KaHyPar sees, --method hypergraph only; the refinement uses all "
        f"(default {DEFAULT_KAHYPAR_TOKENS})",
    )
    _add_report_args(p)


def _hypergraph_only(args: argparse.Namespace) -> None:
    """--seed and --kahypar-tokens tune Mt-KaHyPar: a warning when the method does not run it; defaults set."""
    given = [
        flag for flag, value in (("--seed", args.seed), ("--kahypar-tokens", args.kahypar_tokens)) if value is not None
    ]
    if given and args.method != "hypergraph":
        import warnings

        warnings.warn(
            f"{' and '.join(given)}: used by --method hypergraph only, ignored by --method {args.method}", stacklevel=2
        )
    args.seed = 0 if args.seed is None else args.seed
    args.kahypar_tokens = args.kahypar_tokens or DEFAULT_KAHYPAR_TOKENS


def _save(placement: Any, args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The placement JSON of --out, with how it was made and its per-layer E[C_T] (E[N_T] with nodes)."""
    placement.save(
        args.out,
        extra={
            "method": args.method,
            "trace": os.path.abspath(args.trace),
            "mean_ct": [layer["placement"]["mean_ct"] for layer in report["layers"]],
            "mean_ct_contiguous": [layer["baseline"]["mean_ct"] for layer in report["layers"]],
            **nt_lists(report),
            "max_load_ratio": args.max_load,
            "seed": args.seed,
        },
    )


def run_place(args: argparse.Namespace) -> int:
    """occult place: solve a placement for a trace and report it against contiguous."""
    from occult.placement import Placement
    from occult.placement.report import compare_placements
    from occult.placement.solvers import place

    _check_report_flags(args)  # before the long part
    check_output("--out", args.out, "placement.json")
    check_input("--trace", args.trace)
    _hypergraph_only(args)
    if args.devices % args.nodes:
        raise CommandError(f"--nodes {args.nodes} must divide --devices {args.devices} (every node holds D/M devices)")
    trace = load_trace(args.trace)
    check_devices(trace, args.devices)
    _check_plot_layers(args, trace)
    progress = _progress(args)
    coacts = _coacts(trace, progress)
    result = place(
        trace,
        args.devices,
        args.method,
        max_load_ratio=args.max_load,
        seed=args.seed,
        kahypar_tokens=args.kahypar_tokens,
        progress=progress,
        coacts_LEE=coacts,
        jobs=args.jobs,
        num_nodes=args.nodes,
    )
    placement = result.placement
    report = compare_placements(trace, placement, None, args.hidden, args.dtype, coacts)
    if args.out:
        with writing("--out", args.out):
            _save(placement, args, report)
    contiguous = Placement.contiguous(trace.num_experts, args.devices, trace.num_layers, args.nodes)
    plotted = _maybe_plot(args, trace, coacts, placement, contiguous, ("contiguous", args.method))
    report.update(
        command="place",
        trace=args.trace,
        method=args.method,
        max_load_ratio=args.max_load,
        seed=args.seed,
        seconds=result.seconds,
        jobs=result.jobs,
        out=args.out,
        plot=args.plot,
        plotted_layers=plotted,
    )
    for layer, res in zip(report["layers"], result.layers):
        layer["winner"] = res.method
        layer["candidates"] = res.candidates
        layer["seconds"] = res.seconds
    if args.json:
        print_json(report)
        return 0
    print(f"trace {args.trace}; method {args.method}, solved in {result.seconds:.1f} s ({result.jobs} process(es))")
    extra = {"chosen": [r.method for r in result.layers]} if args.method == "hypergraph" else {}
    print_table(report, "contiguous", args.method, {**nt_cols(report, args.method), **extra})
    if args.method == "hypergraph":
        print("\n".join(why_chosen(result.layers, args.max_load)))
    if args.out:
        print(f"wrote {args.out}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


# ------------------------------------------------------------------ stats
def _add_stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="routing trace (.safetensors)")
    p.add_argument("--placement", "-p", help="placement JSON (default: contiguous on --devices)")
    p.add_argument(
        "--devices", "-d", type=positive_int, help="devices, when no --placement is given (must match it otherwise)"
    )
    p.add_argument(
        "--nodes",
        type=positive_int,
        help="nodes, when no --placement is given (default 1; a placement's own num_nodes otherwise)",
    )
    _add_report_args(p)


def run_stats(args: argparse.Namespace) -> int:
    """occult stats: collaboration statistics of a trace under a placement, against contiguous."""
    from occult.placement import Placement
    from occult.placement.report import compare_placements

    _check_report_flags(args)
    check_input("--trace", args.trace)
    check_input("--placement", args.placement)
    if args.placement is None and args.devices is None:
        raise CommandError("give --placement FILE, or --devices D for the contiguous layout")
    placement = load_placement(args.placement) if args.placement else None
    if placement is not None and args.devices is not None and args.devices != placement.num_devices:
        raise CommandError(
            f"--devices {args.devices} does not match the placement, which is for {placement.num_devices} devices"
        )
    if placement is not None and args.nodes is not None and args.nodes != placement.num_nodes:
        raise CommandError(
            f"--nodes {args.nodes} does not match the placement, which has {placement.num_nodes} node(s)"
        )
    nodes = args.nodes or 1
    if placement is None and args.devices % nodes:
        raise CommandError(f"--nodes {nodes} must divide --devices {args.devices}")
    trace = load_trace(args.trace)
    _check_plot_layers(args, trace)
    if placement is None:
        check_devices(trace, args.devices)
        placement = Placement.contiguous(trace.num_experts, args.devices, trace.num_layers, nodes)
    coacts = _coacts(trace, _progress(args))
    with reading("--placement", args.placement) if args.placement else contextlib.nullcontext():  # fits the trace?
        report = compare_placements(trace, placement, None, args.hidden, args.dtype, coacts)
    name = "placement" if args.placement else "contiguous"
    contiguous = Placement.contiguous(trace.num_experts, placement.num_devices, trace.num_layers, placement.num_nodes)
    plotted = _maybe_plot(args, trace, coacts, placement, contiguous, ("contiguous", name))
    report.update(
        command="stats", trace=args.trace, placement_file=args.placement, plot=args.plot, plotted_layers=plotted
    )
    if args.json:
        print_json(report)
        return 0
    print(f"trace {args.trace}; placement {args.placement or 'contiguous'}")
    intra = [f"{layer['placement']['intra_ratio']:.3f}" for layer in report["layers"]]
    print_table(report, "contiguous", name, {**nt_cols(report, name), "intra share": intra})
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


PLACE = Command(
    "place", "solve an expert placement from a routing trace and report E[C_T] and bytes", _add_place_args, run_place
)
STATS = Command("stats", "collaboration statistics of a trace under a placement", _add_stats_args, run_stats)
