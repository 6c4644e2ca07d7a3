"""The `occult` command line: a thin front over the library.

    occult place --trace T --devices D [--method contiguous|greedy|hypergraph] [--out P] [--json] [--plot F]
    occult stats --trace T [--placement P | --devices D] [--json] [--plot F]
    occult demo  [--world-size N] [--tokens N] [--steps N] [--backend auto|gloo|nccl] ...
    occult bench [--world-size N] [--shapes olmoe,qwen3,deepseek,mixtral] [--tokens N] [--out F] ...
    occult data prepare --out DIR          occult train --out RUN [--corpus-dir DIR] ...
    occult profile --model CKPT|HF_DIR --out T [--data F]    occult finetune --init CKPT --out RUN [--max-devices N --placement P]

Adding a command is one entry in `COMMANDS`: a name, a help line, a function that adds its
arguments to an argparse parser, and a function that runs it with the parsed Namespace
(`lazy("occult.module")` imports a module's `main(args)` only when the command runs).
`lazy_command(name, help, "occult.module")` does both for a module that has
`add_arguments(parser)` and `main(args)`; the module is imported only when that command is
on the command line, so `occult --help` and the other commands do not pay for it.

Bad input (missing or corrupt files, mismatched shapes, impossible device counts) prints
`occult: error: <message>` on stderr and exits with status 2; set OCCULT_DEBUG=1 to get the
traceback instead. Progress bars go to stderr, and only when it is a terminal.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

EXIT_USAGE = 2
# Mirrors occult.placement_solvers, so that building the parser imports neither numpy nor
# torch (tests/test_cli.py checks that they agree).
PLACE_METHODS = ("contiguous", "greedy", "hypergraph")
DEFAULT_KAHYPAR_TOKENS = 8_000

RunFn = Callable[[argparse.Namespace], "int | None"]


class CommandError(Exception):
    """A problem with the user's input, reported as `occult: error: ...` (exit 2)."""


@dataclass(frozen=True)
class Command:
    """A subcommand: `add_arguments(parser)` defines its flags, `run(args)` runs it (exit status)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: RunFn
    lazy: bool = False  # add_arguments imports a heavy module: call it only when the command is chosen


def _import_optional(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise


def lazy(module: str, attr: str = "main") -> RunFn:
    """A run function that imports `module` when the command runs and calls `module.attr(args)`."""

    def run(args: argparse.Namespace) -> int | None:
        mod = _import_optional(module)
        if mod is None:
            raise CommandError(f"'occult {args.command}' is not available in this installation ({module} is missing)")
        return getattr(mod, attr)(args)

    return run


def lazy_command(
    name: str,
    help: str,
    module: str,
    fallback_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> Command:
    """A command run by `module.main(args)`, with the flags of `module.add_arguments(parser)`
    (or `fallback_arguments` while the module defines none)."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        mod = _import_optional(module)
        adder = getattr(mod, "add_arguments", None) if mod is not None else None
        adder = adder or fallback_arguments
        if adder is not None:
            adder(parser)

    return Command(name, help, add_arguments, lazy(module), lazy=True)


# ------------------------------------------------------------------ shared arguments
def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _layer_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


def _add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=_positive_int, default=2048, help="hidden size for the byte counts (default 2048)")
    p.add_argument("--dtype", default="bf16", help="activation dtype for the byte counts: bf16, fp16, fp32, fp8 (default bf16)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw co-activation heat maps ordered by device, before and after (needs matplotlib)")
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


def _print_table(report: dict[str, Any], base_name: str, new_name: str, extra_cols: dict[str, list[str]] | None = None) -> None:
    """Per-layer and overall E[C_T] and dispatch+combine bytes, baseline vs placement."""
    h = report
    print(
        f"{h['num_layers']} layer(s) x {h['num_tokens'] // h['num_layers']} tokens (avg), {h['num_experts']} experts, "
        f"top-{h['top_k']}, {h['num_devices']} devices; bytes: dispatch+combine, hidden {h['hidden']} {h['dtype']}"
    )
    print(f"uniform routing would give E[C_T] = {h['analytic_uniform_mean_ct']:.3f}; standard dispatch sends {h['top_k']} copies")
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
        line(str(layer["layer"]), layer["baseline"], layer["placement"], layer["reduction"],
             [v[i] for v in extra_cols.values()])
    o = h["overall"]
    line("overall", o["baseline"], o["placement"], o["reduction"], ["" for _ in extra_cols])
    n = o["placement"]
    print(
        f"E[C_T] {o['baseline']['mean_ct']:.4f} ({base_name}) -> {n['mean_ct']:.4f} ({new_name}): "
        f"{100 * o['reduction']:.1f}% fewer deduplicated rows; {100 * o['vs_standard']:.1f}% fewer bytes than "
        f"standard dispatch ({_fmt_bytes(n['bytes_standard'])} -> {_fmt_bytes(n['bytes_dedup'])}; remote, "
        f"expected: {_fmt_bytes(n['bytes_standard_remote'])} -> {_fmt_bytes(n['bytes_dedup_remote'])})"
    )


def _progress(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def _load_trace(path: str) -> Any:
    from occult.trace import read_trace

    return read_trace(path)


def _coacts(trace: Any, progress: bool) -> list[Any]:
    from occult.stats import coactivation

    layers = range(trace.num_layers)
    if progress:
        from tqdm.auto import tqdm

        layers = tqdm(layers, desc="co-activation", unit="layer", file=sys.stderr, leave=False)
    return [coactivation(trace.layer(i), trace.num_experts) for i in layers]


def _maybe_plot(args: argparse.Namespace, trace: Any, coacts: list[Any], placement: Any, baseline: Any, labels: tuple[str, str]) -> list[int] | None:
    if not args.plot:
        return None
    from occult.plots import DEFAULT_MAX_LAYERS, coactivation_heatmaps

    drawn = coactivation_heatmaps(
        args.plot, coacts, placement, baseline, layers=args.plot_layers, num_tokens=trace.num_tokens, labels=labels
    )
    if args.plot_layers is None and trace.num_layers > DEFAULT_MAX_LAYERS and not args.json:
        print(f"occult: plotted layers 0-{DEFAULT_MAX_LAYERS - 1} of {trace.num_layers}; choose others with --plot-layers", file=sys.stderr)
    return drawn


# ------------------------------------------------------------------ place
def _add_place_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="routing trace (.safetensors, see BRIEF.md)")
    p.add_argument("--devices", "-d", required=True, type=_positive_int, help="expert-parallel devices (ranks)")
    p.add_argument("--method", "-m", choices=PLACE_METHODS, default="hypergraph", help="placement solver (default hypergraph)")
    p.add_argument("--out", "-o", help="write the placement JSON here")
    p.add_argument("--max-load", type=float, metavar="RATIO", help="bound on max/mean per-device token-expert load, e.g. 1.1")
    p.add_argument("--seed", type=int, default=0, help="seed for Mt-KaHyPar and its token sample (default 0)")
    p.add_argument("--jobs", "-j", type=_positive_int, help="worker processes solving layers in parallel (default: one per CPU for large traces)")
    p.add_argument("--kahypar-tokens", type=_positive_int, default=DEFAULT_KAHYPAR_TOKENS,
                   help=f"tokens per layer Mt-KaHyPar sees; the refinement uses all (default {DEFAULT_KAHYPAR_TOKENS})")
    _add_report_args(p)


def run_place(args: argparse.Namespace) -> int:
    """occult place: solve a placement for a trace and report it against contiguous."""
    from occult.placement import Placement
    from occult.placement_solvers import place
    from occult.stats import compare_placements, element_size

    element_size(args.dtype)  # reject a bad dtype before the long part
    trace = _load_trace(args.trace)
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
                "max_load_ratio": args.max_load,
                "seed": args.seed,
            },
        )
    contiguous = Placement.contiguous(trace.num_experts, args.devices, trace.num_layers)
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
    extra = {"chosen": [r.method for r in result.layers]} if args.method == "hypergraph" else None
    _print_table(report, "contiguous", args.method, extra)
    if args.out:
        print(f"wrote {args.out}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


# ------------------------------------------------------------------ stats
def _add_stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="routing trace (.safetensors)")
    p.add_argument("--placement", "-p", help="placement JSON (default: contiguous on --devices)")
    p.add_argument("--devices", "-d", type=_positive_int, help="devices, when no --placement is given (must match it otherwise)")
    _add_report_args(p)


def run_stats(args: argparse.Namespace) -> int:
    """occult stats: collaboration statistics of a trace under a placement, against contiguous."""
    from occult.placement import Placement
    from occult.stats import compare_placements, element_size

    element_size(args.dtype)
    if args.placement is None and args.devices is None:
        raise CommandError("give --placement FILE, or --devices D for the contiguous layout")
    placement = Placement.load(args.placement) if args.placement else None
    if placement is not None and args.devices is not None and args.devices != placement.num_devices:
        raise CommandError(
            f"--devices {args.devices} does not match the placement, which is for {placement.num_devices} devices"
        )
    trace = _load_trace(args.trace)
    if placement is None:
        placement = Placement.contiguous(trace.num_experts, args.devices, trace.num_layers)
    coacts = _coacts(trace, _progress(args))
    report = compare_placements(trace, placement, None, args.hidden, args.dtype, coacts)
    name = "placement" if args.placement else "contiguous"
    contiguous = Placement.contiguous(trace.num_experts, placement.num_devices, trace.num_layers)
    plotted = _maybe_plot(args, trace, coacts, placement, contiguous, ("contiguous", name))
    report.update(command="stats", trace=args.trace, placement_file=args.placement, plot=args.plot, plotted_layers=plotted)
    if args.json:
        _print_json(report)
        return 0
    print(f"trace {args.trace}; placement {args.placement or 'contiguous'}")
    intra = [f"{layer['placement']['intra_ratio']:.3f}" for layer in report["layers"]]
    _print_table(report, "contiguous", name, {"intra share": intra})
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _train_cli(name: str) -> Callable[[argparse.ArgumentParser], None]:
    """Arguments of the data/train/finetune/profile commands, from occult.train_cli (torch-free)."""

    def add(p: argparse.ArgumentParser) -> None:
        from occult import train_cli

        getattr(train_cli, name)(p)

    return add


def _add_profile_args(p: argparse.ArgumentParser) -> None:
    """occult's own checkpoints (occult.train_cli) and transformers model directories (--data)."""
    _train_cli("add_profile_arguments")(p)
    from occult.integrations import hf_cli

    hf_cli.add_profile_arguments(p)  # adds only the flags not defined above


def run_profile(args: argparse.Namespace) -> int | None:
    """occult profile: a transformers model directory (a config.json) or an occult checkpoint."""
    from occult.integrations.hf_cli import is_transformers_model

    if is_transformers_model(args.model):
        return lazy("occult.integrations.hf_cli", "run_profile")(args)
    return lazy("occult.profile", "run_profile")(args)


COMMANDS: list[Command] = [
    Command("place", "solve an expert placement from a routing trace and report E[C_T] and bytes", _add_place_args, run_place),
    Command("stats", "collaboration statistics of a trace under a placement", _add_stats_args, run_stats),
    lazy_command("demo", "run a small expert-parallel MoE on CPU ranks (gloo) or GPUs", "occult.demo"),
    lazy_command("bench", "time one MoE layer on 1-N GPUs: standard vs dedup vs dedup+placement", "occult.bench"),
    Command("data", "fetch the Shakespeare corpus, train its tokenizer, write a directory to carry", _train_cli("add_prepare_arguments"), lazy("occult.data", "run_prepare")),
    Command("train", "train a small MoE language model (OccultLM)", _train_cli("add_train_arguments"), lazy("occult.train", "run_train")),
    Command("finetune", "fine-tune a checkpoint, optionally with tokens limited to N devices", _train_cli("add_finetune_arguments"), lazy("occult.train", "run_finetune")),
    Command("profile", "record a routing trace (and expert similarity) of a checkpoint or a transformers model", _add_profile_args, run_profile),
]


def build_parser(commands: Sequence[Command] | None = None, chosen: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser; lazy commands get their flags only when `chosen` names them."""
    parser = argparse.ArgumentParser(
        prog="occult",
        description="Expert-parallel MoE with deduplicated all-to-all and co-activation-aware expert placement.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in commands if commands is not None else COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if not cmd.lazy or cmd.name == chosen:
            cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def _chosen_command(argv: Sequence[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def _error(message: str) -> int:
    print(f"occult: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `occult` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(chosen=_chosen_command(argv))
    args = parser.parse_args(argv)  # usage errors: argparse prints `occult ...: error:` and exits 2
    debug = bool(os.environ.get("OCCULT_DEBUG"))

    def show_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        print(f"occult: warning: {message}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning
            status = args._run(args)
        return int(status or 0)
    except KeyboardInterrupt:
        print("occult: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `occult place ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (CommandError, ValueError, OSError, ImportError) as exc:
        if debug:
            raise
        return _error(str(exc) or type(exc).__name__)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
