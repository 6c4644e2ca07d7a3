"""The reports of `occult place` and `occult stats`: the per-layer table of E[C_T] and bytes against
contiguous (with E[N_T] columns when there are nodes), the JSON document, and why `--method
hypergraph` chose each layer's candidate. numpy is imported only when a report is written.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def to_jsonable(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def print_json(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, default=to_jsonable) + "\n")


def print_table(
    report: dict[str, Any], base_name: str, new_name: str, extra_cols: dict[str, list[str]] | None = None
) -> None:
    """Per-layer and overall E[C_T] and dispatch+combine bytes, baseline vs placement."""
    h = report
    print(
        f"{h['num_layers']} layer(s) x {h['num_tokens'] // h['num_layers']} tokens (avg), {h['num_experts']} experts, "
        f"top-{h['top_k']}, {h['num_devices']} devices; bytes: dispatch+combine, hidden {h['hidden']} {h['dtype']}"
    )
    print(
        f"uniform routing would give E[C_T] = {h['analytic_uniform_mean_ct']:.3f}; "
        f"standard dispatch sends {h['top_k']} copies"
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
        ("busiest share", 13),
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
            fmt_bytes(n["bytes_standard"]),
            fmt_bytes(b["bytes_dedup"]),
            fmt_bytes(n["bytes_dedup"]),
            f"{n['load_imbalance']:.3f}",
            f"{n['busiest_device_share']:.3f}",
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
        f"standard dispatch ({fmt_bytes(n['bytes_standard'])} -> {fmt_bytes(n['bytes_dedup'])}; remote, "
        f"expected: {fmt_bytes(n['bytes_standard_remote'])} -> {fmt_bytes(n['bytes_dedup_remote'])})"
    )
    print(
        f"busiest share: the fraction of the tokens that use the busiest device, the least sync_free_capacity "
        f"(ExecConfig) that drops none of these tokens' copies: {n['busiest_device_share']:.3f} over every layer "
        f"({o['baseline']['busiest_device_share']:.3f} {base_name}); a sync-free exchange sends that share of T rows "
        "to each device instead of T"
    )


def nt_lists(report: dict[str, Any]) -> dict[str, Any]:
    """Per-layer E[N_T] for the placement file's metadata (nothing without nodes)."""
    if report.get("num_nodes", 1) == 1:
        return {}
    return {
        "mean_nt": [layer["placement"]["mean_nt"] for layer in report["layers"]],
        "mean_nt_contiguous": [layer["baseline"]["mean_nt"] for layer in report["layers"]],
    }


def nt_cols(report: dict[str, Any], name: str) -> dict[str, list[str]]:
    """E[N_T] table columns (nodes per token), contiguous and placement, when there are nodes."""
    lists = nt_lists(report)
    if not lists:
        return {}
    o = report["overall"]
    print(
        f"{report['num_nodes']} nodes x {report['num_devices'] // report['num_nodes']} devices; "
        "E[N_T] (nodes per token) "
        f"{o['baseline']['mean_nt']:.4f} (contiguous) -> {o['placement']['mean_nt']:.4f} ({name}); "
        f"uniform routing would give {report['analytic_uniform_mean_nt']:.3f}"
    )
    return {
        "E[N_T] contiguous": [f"{v:.4f}" for v in lists["mean_nt_contiguous"]],
        f"E[N_T] {name}": [f"{v:.4f}" for v in lists["mean_nt"]],
    }


MAX_WHY_LAYERS = 8


def ranked(candidates: dict[str, float]) -> str:
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
        parts = [(f"{g} " if g else "") + ranked(c) for g, c in groups.items()]
        lines.append(f"  layer {i}: chosen {res.method}: " + "; ".join(parts))
    if len(layers) > MAX_WHY_LAYERS:
        lines.append(f"  ... {len(layers) - MAX_WHY_LAYERS} more layer(s): every layer's candidates are in --json")
    return lines
