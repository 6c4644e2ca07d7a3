"""Re-placing experts while training (docs/replacement.md): E[C_T] over training with and without,
time per migration, solver time, tokens/s. Runs `occult train` under torchrun on N ranks (gloo on
CPU, NCCL on GPUs), then summarises each run's `replace.jsonl`.

    python benchmarks/replacement.py --data DATA --root /tmp/rp --ranks 4 --out docs/results/replacement_cpu.json \\
        --plot docs/replacement_ct.png [--summarise-only] [-- extra occult train flags]

Runs (same model, data, seed, steps):
    off       no re-placement (the throughput reference; no E[C_T] log)
    fixed     solves every --every steps but never migrates (min gain 0.99): E[C_T] of the placement
              it starts with, measured the same way, and the solver's in-sample predictions
    every     solve every --every steps, migrate when E[C_T] of the sample drops by >= 2%
    drift     solve only when the measured E[C_T] rises 3% above its level after the last solve
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from occult.tools.run_record import run_record

RUNS = {
    "off": [],
    "fixed": ["--replace-every", "{every}", "--replace-min-gain", "0.99"],
    "every": ["--replace-every", "{every}"],
    "drift": ["--replace-drift", "0.03"],
}


def cuda_available() -> bool:
    """Whether the `occult train` runs this starts have GPUs (torch imported only here: the runs are processes)."""
    import torch

    return torch.cuda.is_available()


def model_args(a) -> list[str]:
    return [
        "--corpus-dir",
        a.data,
        "--hidden",
        str(a.hidden),
        "--layers",
        str(a.layers),
        "--heads",
        str(a.heads),
        "--experts",
        str(a.experts),
        "--top-k",
        str(a.top_k),
        "--expert-ffn",
        str(a.ffn),
        "--seq-len",
        str(a.seq_len),
        "--batch-size",
        str(a.batch_size),
        "--steps",
        str(a.steps),
        "--eval-every",
        str(a.steps // 4),
        "--eval-tokens",
        "8192",
        "--save-every",
        str(a.steps // 2),
        "--lr",
        "3e-3",
        "--warmup",
        "20",
        "--replace-check-every",
        "10",
        "--no-progress",
    ]


def run(a, name: str, extra: list[str]) -> float:
    out = Path(a.root) / name
    if out.exists():
        import shutil

        shutil.rmtree(out)
    flags = [f.format(every=a.every) for f in RUNS[name]]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(a.ranks),
        "-m",
        "occult",
        "train",
        *model_args(a),
        "--out",
        str(out),
        *flags,
        *extra,
    ]
    t0 = time.time()
    log = open(Path(a.root) / f"{name}.log", "w")
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.time() - t0
    (out / "wall_s.txt").write_text(f"{wall}\n")
    return wall


def summarise(a, name: str) -> dict:
    out = Path(a.root) / name
    summary: dict = {"run": name, "wall_s": float((out / "wall_s.txt").read_text())}
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary["val_loss"] = metrics[-1]["val_loss"]
    log = out / "replace.jsonl"
    events = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    measures = [e for e in events if e["event"] == "measure"]
    summary["ct"] = [(e["step"], e["mean_ct"]) for e in measures]
    summary["migrations"] = [
        {
            k: e[k]
            for k in (
                "step",
                "solve_started",
                "old_ct",
                "new_ct",
                "gain",
                "experts_moved",
                "bytes_sent",
                "migrate_s",
                "solve_s",
                "wall_s",
            )
        }
        for e in events
        if e["event"] == "migrate"
    ]
    summary["kept"] = [
        {k: e[k] for k in ("step", "old_ct", "new_ct", "gain", "solve_s", "wall_s")}
        for e in events
        if e["event"] == "keep"
    ]
    summary["solves"] = sum(e["event"] == "solve" for e in events)
    tokens = a.batch_size * a.seq_len
    rates = [
        10 * tokens / (m2["time"] - m1["time"])
        for m1, m2 in zip(measures, measures[1:])
        if m2["step"] - m1["step"] == 10 and m2["step"] % (a.steps // 4)
    ]  # windows without an evaluation
    if rates:
        rates.sort()
        summary["tokens_per_s_median"] = rates[len(rates) // 2]
    summary["tokens_per_s_overall"] = a.steps * tokens / summary["wall_s"]
    return summary


def window_means(ct: list[tuple[int, float]], width: int, steps: int) -> list[float | None]:
    out = []
    for lo in range(0, steps, width):
        vals = [v for s, v in ct if lo < s <= lo + width]
        out.append(sum(vals) / len(vals) if vals else None)
    return out


def plot(results: list[dict], path: str, ranks: int, experts: int, top_k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.placement.stats import analytic_mean_ct

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        if r["ct"]:
            s, v = zip(*r["ct"])
            ax.plot(s, v, label=r["run"], lw=1.2)
            for m in r["migrations"]:
                ax.axvline(m["step"], color=ax.lines[-1].get_color(), ls=":", lw=0.8)
    ax.axhline(analytic_mean_ct(experts, top_k, ranks), color="grey", ls="--", lw=0.8, label="uniform routing")
    ax.set_xlabel("step")
    ax.set_ylabel("E[C_T] (10-step windows, all layers)")
    ax.set_title(f"OccultLM on Shakespeare, {experts} experts top-{top_k} over {ranks} ranks (dotted: migrations)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="occult data prepare output")
    p.add_argument("--root", required=True, help="directory for the runs")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--summarise-only", action="store_true")
    p.add_argument("--out", default=None, help="JSON summary to write")
    p.add_argument("--plot", default=None, help="E[C_T] plot to write (matplotlib)")
    a, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    Path(a.root).mkdir(parents=True, exist_ok=True)
    names = a.runs.split(",")
    if not a.summarise_only:
        for name in names:
            print(f"{name}: {run(a, name, extra):.1f} s", flush=True)
    results = [summarise(a, n) for n in names]
    width = max(a.every, 10)
    print(f"E[C_T] per {width}-step window:")
    for r in results:
        if r["ct"]:
            print(
                f"  {r['run']:6s} "
                + " ".join("  -  " if v is None else f"{v:.3f}" for v in window_means(r["ct"], width, a.steps))
            )
    for r in results:
        tps = r.get("tokens_per_s_median")
        print(
            f"{r['run']}: wall {r['wall_s']:.1f} s, val loss {r['val_loss']:.4f}, tok/s median "
            f"{'-' if tps is None else f'{tps:,.0f}'}, solves {r['solves']}, migrations {len(r['migrations'])}"
        )
        for m in r["migrations"]:
            print(
                f"    step {m['step']} (solve from {m['solve_started']}): sample E[C_T] {m['old_ct']:.3f} -> "
                f"{m['new_ct']:.3f}, {m['experts_moved']} experts, {m['bytes_sent'] / 1e6:.2f} MB sent by rank 0, "
                f"migrate {1e3 * m['migrate_s']:.1f} ms, solve {m['solve_s']:.2f} s ({m['wall_s']:.1f} s wall)"
            )
    if a.out:
        doc = {
            "settings": {k: v for k, v in vars(a).items() if k not in ("out", "plot", "summarise_only")},
            "extra": extra,
            "window": width,
            # `occult train` takes the GPUs where there are any; the code's commit, the date, the link
            "env": run_record(a.ranks, cuda_available()),
            "results": [dict(r, windows=window_means(r["ct"], width, a.steps)) for r in results],
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))
    if a.plot:
        plot(results, a.plot, a.ranks, a.experts, a.top_k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
