"""`occult place` and `occult stats`: solve a placement from a routing trace, report its
collaboration statistics against contiguous (table or JSON), optionally draw heat maps.

Nothing heavy is imported until a command runs: `PLACE_METHODS` and `DEFAULT_KAHYPAR_TOKENS`
mirror `occult.placement.solvers` so that building the parser imports neither numpy nor torch
(tests/cli/test_cli.py checks that they agree).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from occult.cli.inputs import check_devices, load_placement, load_trace, reading
from occult.cli.registry import (
    Command,
    CommandError,
    check_input,
    check_output,
    positive_float,
    positive_int,
    seed_int,
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


# ------------------------------------------------------------------ formatting
def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _to_jsonable(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _print_json(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, default=_to_jsonable) + "\n")


def _print_table(
    report: dict[str, Any], base_name: str, new_name: str, extra_cols: dict[str, list[str]] | None = None
) -> None:
    """Per-layer and overall E[C_T] and dispatch+combine bytes, baseline vs placement."""
    h = report
    print(
        f"{h['num_layers']} layer(s) x {h['num_tokens'] // h['num_layers']} tokens (avg), {h['num_experts']} experts, "
        f"top-{h['top_k']}, {h['num_devices']} devices; bytes: dispatch+combine, hidden {h['hidden']} {h['dtype']}"
    )
    print(
        f"uniform routing would give E[C_T] = {h['analytic_uniform_mean_ct']:.3f}; standard dispatch sends {h['top_k']} copies"
    )
    cols = [
        ("layer", 7),
        (f"E[C_T] {base_name}", 19),
        (f"E[C_T] {new_name}", 19),
        ("change", 8),
        ("standard", 11),
        (f"dedup {base_name}", 17),
        (f"dedup {new_name}", 17),
        ("load max/mean", 13),
    ]
    extra_cols = extra_cols or {}
    cols += [(name, max(len(name), 8)) for name in extra_cols]
    print("  ".join(f"{c:>{w}}" for c, w in cols))

    def line(label: str, b: dict[str, Any], n: dict[str, Any], red: float, extra: list[str]) -> None:
        vals = [
            label,
            f"{b['mean_ct']:.4f}",
            f"{n['mean_ct']:.4f}",
            f"{-100 * red:+.1f}%",
            _fmt_bytes(n["bytes_standard"]),
            _fmt_bytes(b["bytes_dedup"]),
            _fmt_bytes(n["bytes_dedup"]),
            f"{n['load_imbalance']:.3f}",
        ] + extra
        print("  ".join(f"{v:>{w}}" for v, (_, w) in zip(vals, cols)))

    for i, layer in enumerate(h["layers"]):
        line(
            str(layer["layer"]),
            layer["baseline"],
            layer["placement"],
            layer["reduction"],
            [v[i] for v in extra_cols.values()],
        )
    o = h["overall"]
    line("overall", o["baseline"], o["placement"], o["reduction"], ["" for _ in extra_cols])
    n = o["placement"]
    print(
        f"E[C_T] {o['baseline']['mean_ct']:.4f} ({base_name}) -> {n['mean_ct']:.4f} ({new_name}): "
        f"{100 * o['reduction']:.1f}% fewer deduplicated rows; {100 * o['vs_standard']:.1f}% fewer bytes than "
        f"standard dispatch ({_fmt_bytes(n['bytes_standard'])} -> {_fmt_bytes(n['bytes_dedup'])}; remote, "
        f"expected: {_fmt_bytes(n['bytes_standard_remote'])} -> {_fmt_bytes(n['bytes_dedup_remote'])})"
    )


def _nt_lists(report: dict[str, Any]) -> dict[str, Any]:
    """Per-layer E[N_T] for the placement file's metadata (nothing without nodes)."""
    if report.get("num_nodes", 1) == 1:
        return {}
    return {
        "mean_nt": [layer["placement"]["mean_nt"] for layer in report["layers"]],
        "mean_nt_contiguous": [layer["baseline"]["mean_nt"] for layer in report["layers"]],
    }


def _nt_cols(report: dict[str, Any], name: str) -> dict[str, list[str]]:
    """E[N_T] table columns (nodes per token), contiguous and placement, when there are nodes."""
    lists = _nt_lists(report)
    if not lists:
        return {}
    o = report["overall"]
    print(
        f"{report['num_nodes']} nodes x {report['num_devices'] // report['num_nodes']} devices; E[N_T] (nodes per token) "
        f"{o['baseline']['mean_nt']:.4f} (contiguous) -> {o['placement']['mean_nt']:.4f} ({name}); "
        f"uniform routing would give {report['analytic_uniform_mean_nt']:.3f}"
    )
    return {
        "E[N_T] contiguous": [f"{v:.4f}" for v in lists["mean_nt_contiguous"]],
        f"E[N_T] {name}": [f"{v:.4f}" for v in lists["mean_nt"]],
    }


MAX_WHY_LAYERS = 8


def _ranked(candidates: dict[str, float]) -> str:
    """`a 2.0094 = b 2.0094 < c 3.6859`: candidates by score, ties in solving order."""
    order = sorted(candidates, key=lambda n: candidates[n])  # stable: ties stay in solving order
    text = f"{order[0]} {candidates[order[0]]:.4f}"
    for prev, name in zip(order, order[1:]):
        sign = "=" if abs(candidates[name] - candidates[prev]) < 5e-5 else "<"
        text += f" {sign} {name} {candidates[name]:.4f}"
    return text


def why_chosen(layers: list[Any], max_load: float | None) -> list[str]:
    """Why `occult place --method hypergraph` shows the `chosen` it does: it solves several
    candidates per layer and keeps the one with the lowest E[C_T] (E[N_T] first, with nodes)."""
    if not layers or not layers[0].candidates:
        return []
    bound = f" among those within --max-load {max_load}" if max_load else ""
    first = layers[0].candidates
    if any(":" in k for k in first):  # hierarchical: nodes by E[N_T], then each node's GPUs by E[C_T]
        head = (
            f"why chosen: per layer, the node split with the lowest E[N_T], then per node the GPU split with the "
            f"lowest E[C_T]{bound} (ties: the simpler, first solved; gpus: whole-layer E[C_T] of each candidate)"
        )
    else:
        head = (
            f"why chosen: hypergraph solves {', '.join(first)} and keeps the lowest E[C_T]{bound} "
            "(on a tie the simpler one, listed first)"
        )
    lines = [head]
    for i, res in enumerate(layers[:MAX_WHY_LAYERS]):
        groups: dict[str, dict[str, float]] = {}
        for name, v in res.candidates.items():
            group, _, short = name.rpartition(":")
            groups.setdefault(group, {})[short] = v
        parts = [(f"{g} " if g else "") + _ranked(c) for g, c in groups.items()]
        lines.append(f"  layer {i}: chosen {res.method}: " + "; ".join(parts))
    if len(layers) > MAX_WHY_LAYERS:
        lines.append(f"  ... {len(layers) - MAX_WHY_LAYERS} more layer(s): every layer's candidates are in --json")
    return lines


def _progress(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


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

    drawn = coactivation_heatmaps(
        args.plot, coacts, placement, baseline, layers=args.plot_layers, num_tokens=trace.num_tokens, labels=labels
    )
    if args.plot_layers is None and trace.num_layers > DEFAULT_MAX_LAYERS and not args.json:
        print(
            f"occult: plotted layers 0-{DEFAULT_MAX_LAYERS - 1} of {trace.num_layers}; choose others with --plot-layers",
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
        type=positive_float,
        metavar="RATIO",
        help="bound on max/mean per-device token-expert load, e.g. 1.1",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="seed for Mt-KaHyPar and its token sample (default 0)")
    p.add_argument(
        "--jobs",
        "-j",
        type=positive_int,
        help="worker processes solving layers in parallel (default: one per CPU for large traces)",
    )
    p.add_argument(
        "--kahypar-tokens",
        type=positive_int,
        default=DEFAULT_KAHYPAR_TOKENS,
        help=f"tokens per layer Mt-KaHyPar sees; the refinement uses all (default {DEFAULT_KAHYPAR_TOKENS})",
    )
    _add_report_args(p)


def run_place(args: argparse.Namespace) -> int:
    """occult place: solve a placement for a trace and report it against contiguous."""
    from occult.placement import Placement
    from occult.placement.report import compare_placements
    from occult.placement.solvers import place
    from occult.placement.stats import element_size

    element_size(args.dtype)  # reject a bad dtype before the long part
    check_output("--out", args.out, "placement.json")
    check_output("--plot", args.plot, "heatmap.png")
    check_input("--trace", args.trace)
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
        placement.save(
            args.out,
            extra={
                "method": args.method,
                "trace": os.path.abspath(args.trace),
                "mean_ct": [layer["placement"]["mean_ct"] for layer in report["layers"]],
                "mean_ct_contiguous": [layer["baseline"]["mean_ct"] for layer in report["layers"]],
                **_nt_lists(report),
                "max_load_ratio": args.max_load,
                "seed": args.seed,
            },
        )
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
        _print_json(report)
        return 0
    print(f"trace {args.trace}; method {args.method}, solved in {result.seconds:.1f} s ({result.jobs} process(es))")
    extra = {"chosen": [r.method for r in result.layers]} if args.method == "hypergraph" else {}
    _print_table(report, "contiguous", args.method, {**_nt_cols(report, args.method), **extra})
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
    from occult.placement.stats import element_size

    element_size(args.dtype)
    check_output("--plot", args.plot, "heatmap.png")
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
        _print_json(report)
        return 0
    print(f"trace {args.trace}; placement {args.placement or 'contiguous'}")
    intra = [f"{layer['placement']['intra_ratio']:.3f}" for layer in report["layers"]]
    _print_table(report, "contiguous", name, {**_nt_cols(report, name), "intra share": intra})
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


PLACE = Command(
    "place", "solve an expert placement from a routing trace and report E[C_T] and bytes", _add_place_args, run_place
)
STATS = Command("stats", "collaboration statistics of a trace under a placement", _add_stats_args, run_stats)
