"""The report of `benchmarks/quality_ranks.py`: markdown table (mean ± std, [min, max] over seeds) and an SVG
plot whose error bars span each row's min..max over the seeds (no plotting library needed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

QUALITY_DOC = Path(__file__).resolve().parents[1] / "docs" / "quality.md"  # where the targets were set


def quality_doc_link(doc: Path) -> str:
    """The link from the report at `doc` to docs/quality.md (reports are written to several folders)."""
    return Path(os.path.relpath(QUALITY_DOC, doc.resolve().parent)).as_posix()


COLORS = [
    "#1f77b4",
    "#7f7f7f",
    "#2ca02c",
    "#17becf",
    "#d62728",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#bcbd22",
    "#e377c2",
    "#000000",
    "#aec7e8",
    "#98df8a",
    "#ff9896",
]


def _fmt(s: dict | None, digits: int = 3, pct: bool = False) -> str:
    if s is None:
        return "—"
    f = (lambda v: f"{v * 100:+.{digits}f}%") if pct else (lambda v: f"{v:.{digits}f}")
    if len(s["values"]) == 1:
        return f(s["mean"])
    return f"{f(s['mean'])} ± {abs(s['std']) * (100 if pct else 1):.{digits}f} [{f(s['min'])}, {f(s['max'])}]"


def svg_plot(results: dict) -> str:
    """Three panels: base validation loss per seed; ppl vs E[C_T] (all rows); Δ ppl vs E[C_T] (fine-tuned)."""
    W, H, pad = 1320, 400, 58
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
    ]

    def panel(x0, w, title, series, xlabel, ylabel, points=False, front=()):
        xs = [v for _, pts in series for p in pts for v in ((p[0],) if not points else (p[0]["min"], p[0]["max"]))] or [
            0,
            1,
        ]
        ys = [v for _, pts in series for p in pts for v in ((p[1],) if not points else (p[1]["min"], p[1]["max"]))] or [
            0,
            1,
        ]
        xlo, xhi, ylo, yhi = min(xs), max(xs), min(ys), max(ys)
        if xhi == xlo:
            xlo, xhi = xlo - 0.5, xhi + 0.5
        if yhi == ylo:
            ylo, yhi = ylo - 0.5, yhi + 0.5
        ym, xm = (yhi - ylo) * 0.08, (xhi - xlo) * (0.08 if points else 0.0)
        ylo, yhi, xlo, xhi = ylo - ym, yhi + ym, xlo - xm, xhi + xm
        top, bottom, left, right = 30, H - 45, x0 + pad, x0 + w - 25

        def px(x):
            return left + (x - xlo) / (xhi - xlo) * (right - left)

        def py(y):
            return bottom - (y - ylo) / (yhi - ylo) * (bottom - top)

        out.append(f'<text x="{(left + right) / 2}" y="18" text-anchor="middle" font-size="13">{title}</text>')
        out.append(
            f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#444"/>'
        )
        for i in range(5):
            yv, xv = ylo + (yhi - ylo) * i / 4, xlo + (xhi - xlo) * i / 4
            out.append(f'<text x="{left - 4}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:.3g}</text>')
            out.append(f'<text x="{px(xv):.1f}" y="{bottom + 14}" text-anchor="middle">{xv:.3g}</text>')
            out.append(f'<line x1="{left}" x2="{right}" y1="{py(yv):.1f}" y2="{py(yv):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{(left + right) / 2}" y="{H - 12}" text-anchor="middle">{xlabel}</text>')
        mid = (top + bottom) / 2
        out.append(
            f'<text x="{x0 + 12}" y="{mid}" transform="rotate(-90 {x0 + 12} {mid})" '
            f'text-anchor="middle">{ylabel}</text>'
        )
        for i, (label, pts) in enumerate(series):
            c = COLORS[i % len(COLORS)]
            if points:
                for sx, sy, filled in pts:
                    x, y = px(sx["mean"]), py(sy["mean"])
                    out.append(
                        f'<line x1="{px(sx["min"]):.1f}" x2="{px(sx["max"]):.1f}" y1="{y:.1f}" y2="{y:.1f}" '
                        f'stroke="{c}"/>'
                    )
                    out.append(
                        f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{py(sy["min"]):.1f}" y2="{py(sy["max"]):.1f}" '
                        f'stroke="{c}"/>'
                    )
                    out.append(
                        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="{c}"/>'
                        if filled
                        else f'<rect x="{x - 4.5:.1f}" y="{y - 4.5:.1f}" width="9" height="9" fill="white" '
                        f'stroke="{c}" stroke-width="2"/>'
                    )
            else:
                d = " ".join(f"{'M' if j == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for j, (x, y) in enumerate(pts))
                out.append(f'<path d="{d}" fill="none" stroke="{c}" stroke-width="1.8"/>')
            ly, lx = top + 14 + 13 * i, right - max(150, 6 * max(len(s[0]) for s in series) + 20)
            out.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="10" fill="{c}"/>')
            out.append(f'<text x="{lx + 14}" y="{ly + 1}">{label}</text>')
        if front:  # the Pareto front: lower E[C_T] and lower perplexity cannot both be had beyond it
            d = " ".join(f"{'M' if j == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for j, (x, y) in enumerate(front))
            out.append(f'<path d="{d}" fill="none" stroke="#000" stroke-width="1.2" stroke-dasharray="5,4"/>')

    third = W // 3
    panel(
        0,
        third,
        "validation loss during base training",
        [(f"seed {s['seed']}", [tuple(p) for p in s["train_curve"]]) for s in results["seeds"]],
        "step",
        "val loss",
    )
    kinds: dict[str, list] = {}
    for r in results["rows"]:
        kind = (
            f"N={r['max_devices']} {r['method']}"
            if r["max_devices"] is not None
            else "placement only"
            if r["name"] == "placement only"
            else "standard"
        )
        kinds.setdefault(kind, []).append((r["mean_ct"], r["val_ppl"], r["finetuned"]))
    ct_label = (
        "E[C_T] (routed ids on the placement)"
        if results["args"].get("simulate")
        else "E[C_T] measured by the dispatcher"
    )
    panel(
        third,
        third,
        "ppl vs E[C_T] (square: as trained, dot: fine-tuned; dashed: front)",
        list(kinds.items()),
        ct_label,
        "val perplexity",
        points=True,
        front=[(r["mean_ct"]["mean"], r["val_ppl"]["mean"]) for r in pareto_front(results["rows"])],
    )
    tuned = []
    for r in results["rows"]:
        if r["finetuned"]:
            tag = (
                r["name"][r["name"].index("[") :] if "[" in r["name"] else ""
            )  # a recipe's rows apart from the plain ones
            label = (
                r["name"].replace("standard fine-tuning", "standard FT")
                if r["max_devices"] is None
                else f"N={r['max_devices']} {r['method']} {tag}".strip()
            )
            rel = {k: (v * 100 if k != "values" else v) for k, v in r["rel_ppl"].items()}
            tuned.append((label, [(r["mean_ct"], rel, True)]))
    panel(
        2 * third,
        third,
        "fine-tuned: Δ ppl vs standard FT (bars: min..max)",
        tuned,
        ct_label,
        "Δ perplexity, %",
        points=True,
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _seed_minutes(seeds: list[dict]) -> float:
    """Minutes of every seed's phases (its own run, whether now or reused from an earlier one)."""
    return sum(v for sd in seeds for k, v in sd["seconds"].items() if k != "total") / 60


def _where_seeds_ran(env: dict, seeds: list[dict]) -> str:
    """Which machine ran the seeds, when that is not the machine that wrote this report."""
    ran = {f"{sd['env']['device']} (torch {sd['env']['torch']})" for sd in seeds if sd.get("env")}
    unrecorded = [str(sd["seed"]) for sd in seeds if not sd.get("env")]
    here = f"{env['device']} (torch {env['torch']})"
    text = "" if ran <= {here} else f"The seeds ran on {'; '.join(sorted(ran))}. "
    if unrecorded:
        text += (
            f"Seed(s) {', '.join(unrecorded)} came from a run that did not record its machine "
            "(the report's text or notes beside it say where)."
        )
    return text.strip()


def _run_flags(spec: dict) -> str:
    """A merged run's row choices as quality_ranks.py flags."""
    flags = [
        f"--max-devices {' '.join(map(str, spec.get('max_devices') or []))}",
        f"--methods {' '.join(spec.get('methods') or [])}",
    ]
    if spec.get("recipes"):
        flags.append(f"--recipes {' '.join(spec['recipes'])}")
    if spec.get("recipe_methods"):
        flags.append(f"--recipe-methods {' '.join(spec['recipe_methods'])}")
    return " ".join(flags)


def _merged_run_flags(seeds: list[dict]) -> list[str]:
    """The distinct runs merged into the seeds (`quality_merge.py`), as their flags; empty when none was merged."""
    return list(dict.fromkeys(_run_flags(spec) for sd in seeds for spec in sd.get("merged_from") or []))


def _merged_runs(seeds: list[dict]) -> list[str]:
    """Where seeds were merged from several runs (`quality_merge.py`): what each run measured."""
    merged = [sd for sd in seeds if sd.get("merged_from")]
    if not merged:
        return []
    runs = _merged_run_flags(merged)
    tol = max(sd.get("merge_tol", 0.0) for sd in merged)
    return [
        f"Seed(s) {', '.join(str(sd['seed']) for sd in merged)}: rows merged from {len(runs)} runs of the same seed "
        "(`benchmarks/quality_merge.py`; separate device calls), which share the base training, placement and standard "
        f"fine-tunes, checked equal (every shared row's validation loss and E[C_T] to {tol:g}): "
        + "; ".join(f"`{r}`" for r in runs)
        + ". A seed's time adds up every run's fine-tunes (the standard references "
        "were fine-tuned again in each run); base training, profiling and evaluation count once (the fastest run's).",
        "",
    ]


def render(results: dict, doc: Path) -> None:
    a, env, seeds = results["args"], results["env"], results["seeds"]
    doc.parent.mkdir(parents=True, exist_ok=True)
    plot = doc.with_suffix(".svg")
    plot.write_text(svg_plot(results))
    s0, n = seeds[0], len(seeds)
    steps = ", ".join(str(s["train_steps_done"]) for s in seeds)
    best = ", ".join(f"{s['best_train_val']:.4f}" for s in seeds)
    simulated = bool(a.get("simulate"))
    lines = [
        "# Collaboration pruning: quality study "
        + ("with simulated devices" if simulated else "on real ranks")
        + (" (CPU-sized)" if a["tiny"] else ""),
        "",
        f"Generated by `benchmarks/quality_ranks.py` on {env['device']} (torch {env['torch']}, Python "
        f"{env['python']}), {env['date']}; {n} seed(s) ({a['seeds']}), every phase once per seed, "
        f"{_seed_minutes(seeds):.1f} min of phases in all. {_where_seeds_ran(env, seeds)}",
        "",
        *_merged_runs(seeds),
        f"Model: `OccultLM`, {a['layers']} layers, hidden {a['hidden']}, {a['heads']} heads, **{a['experts']} experts "
        f"top-{a['top_k']}** (expert SwiGLU width {a['expert_ffn']}), vocab {s0['vocab']}; {s0['train_tokens']:,} "
        f"training / {s0['val_tokens']:,} validation tokens, sequences of {a['seq_len']}, global batches of "
        f"{a['batch_size']}" + ("." if simulated else f" ({a['batch_size'] // a['ranks']} rows per rank)."),
        "",
        *(_simulated_method(a, s0, steps, best) if simulated else _ranks_method(a, s0, steps, best)),
        "",
        f"Cells: mean ± standard deviation [min, max] over the {n} seeds. Δ ppl is computed per seed against that "
        "seed's reference (standard routing for rows without fine-tuning, standard fine-tuning of the same length for "
        "fine-tuned rows), then summarised.",
        "",
        "| routing | fine-tuned | val loss | perplexity | Δ ppl vs reference | E[C_T] "
        + ("(routed ids on the placement) |" if simulated else "(dispatcher) |"),
        "|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        ref = r["name"] in ("standard fine-tuning", "standard routing (contiguous placement)")
        lines.append(
            f"| {r['name']} | {'yes' if r['finetuned'] else 'no'} | {_fmt(r['val_loss'], 4)} | {_fmt(r['val_ppl'])} | "
            f"{'reference' if ref else _fmt(r['rel_ppl'], 2, pct=True)} | {_fmt(r['mean_ct'])} |"
        )
    obs = [
        abs(x - y)
        for r in results["rows"]
        if r.get("mean_ct_observed")
        for x, y in zip(r["mean_ct"]["values"], r["mean_ct_observed"]["values"])
    ]
    if obs and not simulated:  # simulated rows copy the routed-ids count: nothing to compare
        worst = max(obs)
        lines += [
            "",
            "E[C_T] counted from the routed ids on the placement (what the one-process study reports) "
            + (
                "equals the dispatcher's rows exactly in every row and seed."
                if worst == 0
                else f"differs from the dispatcher's rows by up to {worst:.1e}."
            ),
        ]
    checks = results.get("simulation_check") or []
    if checks:
        dl = max(c["max_abs_val_loss"] for c in checks)
        dc = max(c["max_abs_mean_ct"] for c in checks)
        lines += [
            "The one-process simulated study (`quality_study.phase_evaluate`, routers limited against the same "
            "placement as virtual devices) on each seed's base weights gives the rows without fine-tuning to within "
            f"{dl:.1e} in validation loss (fp32 summation order) and {dc:.1e} in E[C_T]: on the same weights the "
            "simulation computes what the ranks compute; what the real runs add is training on R ranks (sharded "
            "experts, DDP, global-batch load balancing) and dispatch that really goes to at most N ranks."
        ]
    cmp = [s["placement_comparison"] for s in seeds if s.get("placement_comparison")]
    if cmp:
        lines += [
            "",
            f"E[C_T] of each seed's base routing (the profiled calibration trace) on {a['ranks']} devices, by solver:",
            "",
            "| placement | E[C_T] | rows vs standard (k = " + str(a["top_k"]) + ") |",
            "|---|---|---|",
        ]
        for m in cmp[0]:
            vals = [c[m] for c in cmp]
            st = {"mean": sum(vals) / len(vals), "std": _std(vals), "min": min(vals), "max": max(vals), "values": vals}
            lines.append(f"| {m} | {_fmt(st)} | {st['mean'] / a['top_k']:.1%} |")
    lines += [
        "",
        "**Targets** (perplexity after fine-tuning relative to standard fine-tuning of the same length): "
        "N=2 within 0.3% on the mean, 0.5% on the worst seed; N=1 within 3%, 4%.",
        "",
    ]
    for t in results["targets"]:
        if t["limit"] is None:
            lines.append(
                f"- {t['name']}: mean {t['rel_ppl_mean'] * 100:+.2f}%, worst seed {t['rel_ppl_max'] * 100:+.2f}%"
            )
            continue
        verdict = (
            "met on every seed"
            if t["met_every_seed"] and t["met_mean"]
            else ("met on the mean, **not on every seed**" if t["met_mean"] else "**missed**")
        )
        worst = t.get("limit_worst", t["limit"])
        lines.append(
            f"- {t['name']}: mean {t['rel_ppl_mean'] * 100:+.2f}%, worst seed {t['rel_ppl_max'] * 100:+.2f}% "
            f"(limits {t['limit'] * 100:g}%, {worst * 100:g}%): {verdict}"
        )
    placed = next((r["mean_ct"]["mean"] for r in results["rows"] if r["name"] == "placement only"), None)
    if placed is not None:
        more = (
            "so pruning to N replaces more of each token's experts"
            if placed > 2.05
            else "so pruning to N replaces fewer of each token's experts"
        )
        lines += [
            "",
            f"The targets were set on [quality.md]({quality_doc_link(doc)}) (32 experts top-4, hidden 256, one "
            "process, one seed), "
            f"where a token's plain top-4 spanned 2.05 of 4 devices on the placement. Here the plain top-{a['top_k']} "
            f"spans {placed:.2f} of {a['ranks']} {'devices' if simulated else 'ranks'}, {more}.",
        ]
    front = pareto_front(results["rows"])
    lines += [
        "",
        "Pareto front of the fine-tuned rows (no other fine-tuned row has both a lower mean E[C_T] and a lower "
        "mean perplexity), the dashed line in the plot: "
        + "; ".join(f"{r['name']} (E[C_T] {r['mean_ct']['mean']:.3f}, ppl {r['val_ppl']['mean']:.3f})" for r in front)
        + ".",
        "",
        "![base training curves, ppl vs E[C_T] with the Pareto front, fine-tuned Δ ppl with min..max "
        f"bars]({plot.name})",
        "",
        "Time per seed (s): "
        + "; ".join(
            f"seed {s['seed']}: "
            + ", ".join(f"{k} {v:.0f}" for k, v in s["seconds"].items() if k != "total")
            + f"; total {s['seconds'].get('total', sum(s['seconds'].values())):.0f}"
            for s in seeds
        )
        + ".",
        "",
        "## Command",
        "",
        "```bash",
    ]
    if a.get("corpus_dir"):
        sources = results.get("corpus_sources") or []
        corpus = f" --corpus {','.join(sources)}" if sources and sources != ["shakespeare"] else ""
        lines.append(f"occult data prepare{corpus} --out {a['corpus_dir']} --vocab-size {s0['vocab']}   # once")
    runs = _merged_run_flags(seeds)
    if runs:
        lines += [
            "# the aggregation of the merged seeds; they ran as these runs (separate device calls), merged with",
            "#   python benchmarks/quality_merge.py --out OUT RUN_DIR_1 RUN_DIR_2 ...",
            *(f"#   quality_ranks.py <the flags below, one seed> {r}" for r in runs),
        ]
    lines += [results["command"], "```", ""]
    tmp = doc.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(doc)
    print(f"[{time.strftime('%H:%M:%S')}] report: {doc} (+ {plot.name})", flush=True)


def _std(vals: list[float]) -> float:
    if len(vals) < 2:
        return 0.0
    m = sum(vals) / len(vals)
    return (sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5


def _ranks_method(a: dict, s0: dict, steps: str, best: str) -> list[str]:
    """How the study ran when every training and fine-tuning run is a real R-rank job."""
    return [
        f"Every training and fine-tuning run is a real {a['ranks']}-rank job (`torchrun`, `occult.lm.parallel`): the "
        f"experts of every MoE layer sharded over the {a['ranks']} ranks ({a['experts'] // a['ranks']} each), "
        "attention, embeddings, norms and routers data parallel (DDP), the load-balancing loss over the global batch. "
        f"Base training: experts contiguous, AdamW, warm-up {a['warmup']} then cosine from {a['lr']:g}, early stop "
        f"(patience {a['patience']}); steps per seed: {steps}; best validation loss per seed: {best}. Between the two "
        f"jobs of a seed, one process profiles the base ({a['profile_tokens']:,} training tokens) and solves the "
        f"placement (`{s0['placement_method']}`, {a['ranks']} devices = the ranks), as `quality_study.py` does. "
        "Evaluation and fine-tuning run with the experts on the ranks the placement names; the routers of pruned rows "
        "are limited against the ranks that hold the experts (checked equal), so the dedup dispatcher sends every "
        f"token to at most N ranks. Fine-tuning: {a['ft_steps']} steps, MoE blocks only, peak LR {a['ft_lr']:g}, "
        f"warm-up {a['ft_warmup']}, the same batches for every row of a seed.",
        "",
        "**E[C_T]** is measured from the dispatcher: the rows each MoE layer's dedup all-to-all sent "
        "(`last_comm_stats.dispatch_rows`, one per (token, destination rank), the rank itself included), summed over "
        "ranks, layers and validation batches, divided by tokens x layers. Standard dispatch would send k = "
        f"{a['top_k']}.",
    ]


def _simulated_method(a: dict, s0: dict, steps: str, best: str) -> list[str]:
    """How the study ran with `--simulate`: one process, the devices a placement of the experts."""
    return [
        f"Every run is one process with {a['ranks']} devices simulated (`--simulate`, `quality_study.py`'s way): every "
        f"expert is local, and the routers of pruned rows are limited against a {a['ranks']}-device placement of the "
        f"experts ({a['experts'] // a['ranks']} per device), so each token's experts lie on at most N of them; the "
        "R-rank runs (docs/quality_ranks.md) showed the dedup dispatcher sends exactly these rows. Base training: "
        f"AdamW, warm-up {a['warmup']} then cosine from {a['lr']:g}, early stop (patience {a['patience']}); steps per "
        f"seed: {steps}; best validation loss per seed: {best}. Then the base is profiled ({a['profile_tokens']:,} "
        f"training tokens) and the placement solved (`{s0['placement_method']}`, {a['ranks']} devices). Fine-tuning: "
        f"{a['ft_steps']} steps (recipes: multiples of it), MoE blocks only, peak LR {a['ft_lr']:g}, warm-up "
        f"{a['ft_warmup']}, the same batches for every row of a seed.",
        "",
        "**E[C_T]** is counted from the routed ids: per validation token and MoE layer, the number of devices of the "
        "placement that hold any of its chosen experts (what deduplicated dispatch sends), averaged over tokens x "
        f"layers. Standard dispatch would send k = {a['top_k']}.",
    ]


def pareto_front(rows: list[dict]) -> list[dict]:
    """The fine-tuned rows no other fine-tuned row beats on both mean E[C_T] and mean perplexity, by E[C_T]."""
    tuned = sorted((r for r in rows if r["finetuned"]), key=lambda r: (r["mean_ct"]["mean"], r["val_ppl"]["mean"]))
    front: list[dict] = []
    for r in tuned:
        if not front or r["val_ppl"]["mean"] < front[-1]["val_ppl"]["mean"]:
            front.append(r)
    return front
