"""The quality study of collaboration pruning as real R-rank training, over several seeds.

`benchmarks/quality_study.py` simulates D devices in one process (the routers limited against a
virtual placement). This script runs the same phases with every training and fine-tuning run a
real R-rank job under torchrun (`benchmarks/_quality_ranks_job.py`, one job per seed): experts
sharded over the R ranks by the study's placement, everything else data parallel, the device
limit N enforced against the ranks that hold the experts (the dedup dispatcher sends each token
to at most N ranks), E[C_T] measured from the rows the dispatcher sent. Each seed runs every
phase (base training, profile, placement, evaluation, 1 + |N| x |methods| fine-tunings); the
report gives mean, standard deviation and [min, max] over the seeds per row, and the plot draws
the spread.

  python benchmarks/quality_ranks.py --ranks 4 --seeds 0,1,2 --corpus-dir out/shakespeare   # GPUs (NCCL)
  python benchmarks/quality_ranks.py --tiny --ranks 4 --seeds 0,1,2    # CPU gloo ranks, the bundled slice
  python benchmarks/quality_ranks.py --simulate --ranks 4 --seeds 0,1,2 --corpus-dir out/shakespeare --hidden 512 \
      --layers 8 --max-devices 3 2 1 --recipes distill --expert-backend auto    # one GPU, 4 devices simulated
  python benchmarks/quality_ranks.py --render-only --results docs/results/quality_ranks.json

Default model: 64 experts top-8 (OLMoE's ratios: k/E = 1/8, 16 experts per rank on 4 ranks).
After the jobs, the no-fine-tuning rows of every seed are re-evaluated by the one-process
simulation (`quality_study.phase_evaluate` on the same weights and placement) and the largest
differences are reported (`--no-check-sim` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import quality_study as qs  # noqa: E402  (puts the repository root on sys.path)
from _quality_ranks_job import RECIPES, parse_recipe, recipe_cells, simulate  # noqa: E402
from _quality_ranks_report import render  # noqa: E402

JOB = HERE / "_quality_ranks_job.py"
# 64 experts top-8, sized for GPUs (the full study) and for a 2-core CPU (--tiny)
REAL = dict(qs.REAL, experts=64, top_k=8, expert_ffn=128, batch_size=64)
TINY = dict(
    qs.TINY,
    hidden=64,
    layers=4,
    heads=2,
    experts=64,
    top_k=8,
    expert_ffn=32,
    seq_len=64,
    batch_size=32,
    train_steps=800,
    lr=3e-3,
    warmup=40,
    eval_every=100,
    patience=3,
    ft_steps=100,
    ft_lr=1e-3,
    ft_warmup=10,
    profile_tokens=16384,
    eval_tokens=16384,
    vocab=1024,
)
TARGETS = {2: (0.003, 0.005), 1: (0.03, 0.04)}  # N -> Δ ppl after fine-tuning: (mean, worst seed), issue 28
METRICS = ("val_loss", "val_ppl", "mean_ct", "mean_ct_observed", "rel_ppl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="ranks of every training and fine-tuning job (= devices)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; every phase runs once per seed")
    p.add_argument("--tiny", action="store_true", help="CPU-sized model and steps (64 experts top-8 still)")
    p.add_argument(
        "--corpus-dir",
        default=None,
        help="prepared directory (occult data prepare --out DIR); default with --tiny: the bundled slice",
    )
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--out", default=None, help="run directory (default out/quality-ranks[-tiny])")
    p.add_argument("--doc", default=None, help="report (default OUT/quality_ranks.md)")
    p.add_argument("--results", default=None, help="aggregated JSON (default beside --doc, .json)")
    p.add_argument("--max-devices", type=int, nargs="+", default=[2, 1])
    p.add_argument("--methods", nargs="+", default=["score", "similarity"], choices=["score", "similarity", "mass"])
    p.add_argument(
        "--recipes",
        nargs="*",
        default=[],
        metavar="RECIPE[@N,...]",
        help="also fine-tune every N x method with these pruning-aware recipes (_quality_ranks_job.RECIPES: "
        "distillation from the unpruned model, routers or experts only; longer schedules), or only at the "
        "N after @ (distill-ft-x4@3,2); rows named '... [RECIPE]'. Recipes: " + ", ".join(RECIPES),
    )
    p.add_argument(
        "--recipe-methods",
        nargs="+",
        default=None,
        choices=["score", "similarity", "mass"],
        help="the pruning methods the recipes run with (default: every --methods); the plain rows keep --methods",
    )
    p.add_argument("--placement-method", default="auto", choices=["auto", "hypergraph", "greedy", "contiguous"])
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per rank (default 1, on every machine: the thread count changes the fp32 "
        "summation order of the CPU kernels, and a changed order moves a seed's numbers; docs/quality_ranks.md)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="one process simulating --ranks devices (routers limited against the placement, every expert "
        "local: quality_study.py's way, for one GPU); E[C_T] counted from the routed ids, no dispatcher",
    )
    p.add_argument("--resume", action="store_true", help="skip seeds with a result.json; resume their runs")
    p.add_argument(
        "--drop-weights",
        action="store_true",
        help="when a seed is done, delete its fine-tuning runs' weights and resume states (ft-*/: about 2 GB a "
        "run at hidden 512), keeping base/, the placement and every JSON and metrics file: what a "
        "disk-limited GPU machine needs (adding recipes to such a seed later trains its runs again)",
    )
    p.add_argument("--render-only", action="store_true", help="only re-write the report from --results")
    p.add_argument("--no-check-sim", action="store_true", help="skip the one-process re-evaluation of the base")
    p.add_argument("--expert-backend", default="torch", choices=["torch", "triton", "auto"])
    p.add_argument("--job-timeout", type=int, default=0, help="seconds per seed job, 0 = none")
    for k, v in REAL.items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"default {v} (tiny: {TINY[k]})")
    args = p.parse_args(argv)
    for k, v in (TINY if args.tiny else REAL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.seed_list = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    if not args.seed_list:
        p.error("--seeds needs at least one seed")
    for spec in args.recipes:
        try:
            parse_recipe(spec, args.max_devices)
        except ValueError as exc:
            p.error(f"--recipes: {exc}")
    args.out = Path(args.out or ("out/quality-ranks-tiny" if args.tiny else "out/quality-ranks"))
    args.doc = Path(args.doc) if args.doc else args.out / "quality_ranks.md"
    args.results = Path(args.results) if args.results else args.doc.with_suffix(".json")
    return args


def job_spec(args, seed: int) -> dict:
    """What `_quality_ranks_job.py` reads: quality_study's argument names, this seed's directory."""
    keys = list(REAL) + [
        "tiny",
        "corpus_dir",
        "tokenizer",
        "max_devices",
        "methods",
        "placement_method",
        "device",
        "resume",
        "expert_backend",
        "threads",
        "recipes",
        "recipe_methods",
    ]
    spec = {k: getattr(args, k) for k in keys}
    if spec["corpus_dir"] is None and args.tiny:
        spec["corpus_dir"] = str(qs.TINY_CORPUS)
    spec.update(seed=seed, out=str(args.out / f"seed{seed}"), no_progress=True, devices=args.ranks)
    return spec


def _torchrun(args, phase: str, job: Path, seed: int) -> dict:
    if args.simulate:  # one process, the ranks simulated (one GPU): _quality_ranks_job.simulate
        qs.log(f"seed {seed}: {phase} in one process, {args.ranks} devices simulated")
        result = simulate(phase, json.loads(job.read_text()))
        _write(job.parent / f"{phase}.json", result)
        return result
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        str(JOB),
        phase,
        str(job),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(qs.ROOT), env.get("PYTHONPATH", "")])
    qs.log(f"seed {seed}: torchrun --nproc-per-node={args.ranks} {JOB.name} {phase} {job}")
    done = job.parent / f"{phase}.json"
    done.unlink(missing_ok=True)
    proc = subprocess.run(cmd, env=env, timeout=args.job_timeout or None, check=False)
    if proc.returncode != 0 or not done.exists():
        raise SystemExit(f"seed {seed}: the {args.ranks}-rank {phase} job failed (exit {proc.returncode}); see above")
    return json.loads(done.read_text())


def run_seed(args, seed: int) -> dict:
    """Base training on R ranks, profile + placement here (one process), evaluation and fine-tuning on R ranks."""
    out = args.out / f"seed{seed}"
    done = out / "result.json"
    job = out / "job.json"
    if args.resume and done.exists():
        qs.log(f"seed {seed}: reusing {done}")
        job.write_text(json.dumps(job_spec(args, seed), indent=1) + "\n")
        return with_recipes(args, seed, json.loads(done.read_text()))
    if out.exists() and not args.resume:
        raise SystemExit(f"{out} exists: pass --resume to continue it, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    spec = job_spec(args, seed)
    job.write_text(json.dumps(spec, indent=1) + "\n")
    trained = _torchrun(args, "train", job, seed)
    t = time.perf_counter()
    sargs = argparse.Namespace(**dict(spec, out=out))
    data, _ = qs.phase_data(sargs)
    trace, sim_path = qs.phase_profile(sargs, data, out / "base" / "best.safetensors")
    qs.phase_place(sargs, trace, sim_path)
    comparison = qs.compare_placements(sargs, trace)
    secs = time.perf_counter() - t
    tuned = _torchrun(args, "tune", job, seed)
    placement_method = json.loads((out / "placement.json").read_text()).get("method", args.placement_method)
    result = dict(trained, **tuned, seed=seed, placement_method=placement_method, placement_comparison=comparison)
    result["seconds"] = dict(trained["seconds"], **{"profile+place": secs}, **tuned["seconds"])
    result["seconds"]["total"] = sum(result["seconds"].values())
    result["env"] = run_env(args)  # where this seed ran: a later aggregation may run elsewhere
    _write(done, result)
    return with_recipes(args, seed, result)


def drop_weights(seed_dir: Path) -> int:
    """Delete the `*.safetensors` files and checkpoint directories of `seed_dir`'s fine-tuning runs (ft-*/); bytes
    freed. Its base model, placement, trace and every JSON/metrics/plot file stay."""
    freed = 0
    for run in sorted(seed_dir.glob("ft-*")):
        for f in run.iterdir() if run.is_dir() else ():
            if f.is_dir():
                freed += sum(p.stat().st_size for p in f.rglob("*") if p.is_file())
                shutil.rmtree(f)
            elif f.suffix == ".safetensors":
                freed += f.stat().st_size
                f.unlink()
    return freed


def _write(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def with_recipes(args, seed: int, result: dict) -> dict:
    """`result` with the rows of `--recipes` (run on this seed's base and placement when any is missing)."""
    wanted = [f"pruned N={n} ({m}) + fine-tuning [{r}]" for r, n, m in recipe_cells(args)]
    have = {r["name"] for r in result["rows"]}
    if all(w in have for w in wanted) and all(
        f"pruned N={n} ({m})" in have for n in args.max_devices for m in args.methods
    ):
        return result
    extra = _torchrun(args, "recipes", args.out / f"seed{seed}" / "job.json", seed)
    new = {r["name"]: r for r in extra["rows"]}
    rows = [new.pop(r["name"], r) for r in result["rows"]]
    at = max((i for i, r in enumerate(rows) if not r["finetuned"]), default=-1) + 1
    rows[at:at] = [r for r in new.values() if not r["finetuned"]]  # no-fine-tuning rows before the fine-tuned ones
    rows += [r for r in new.values() if r["finetuned"]]
    result.update(rows=rows, ft_curves=dict(result.get("ft_curves", {}), **extra["ft_curves"]))
    result["seconds"]["recipes"] = (
        result["seconds"].get("recipes", 0.0)  # recipes added in several runs: every run's time
        + extra["seconds"]["evaluate"]
        + extra["seconds"]["fine-tuning"]
    )
    result["seconds"]["total"] = sum(v for k, v in result["seconds"].items() if k != "total")
    _write(args.out / f"seed{seed}" / "result.json", result)
    return result


def check_simulation(args, seed: int, result: dict) -> dict:
    """The one-process simulated study on this seed's base weights and placement: its no-fine-tuning rows."""
    import torch

    from occult.moe.pruning import load_similarity, similarity_path
    from occult.placement import Placement

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    sargs = argparse.Namespace(**job_spec(args, seed))
    sargs.out = Path(sargs.out)
    data, _ = qs.phase_data(sargs)
    pl_path = sargs.out / "placement.json"
    placement = Placement.load(pl_path)
    sims = load_similarity(similarity_path(pl_path), args.experts, args.layers)
    sim_rows = qs.phase_evaluate(sargs, data, sargs.out / "base" / "best.safetensors", placement, sims)
    real = {r["name"]: r for r in result["rows"] if not r["finetuned"]}
    diffs = {"val_loss": 0.0, "mean_ct": 0.0}
    for r in sim_rows:
        diffs["val_loss"] = max(diffs["val_loss"], abs(r["val_loss"] - real[r["name"]]["val_loss"]))
        diffs["mean_ct"] = max(diffs["mean_ct"], abs(r["mean_ct"] - real[r["name"]]["mean_ct"]))
    qs.log(
        f"seed {seed}: one-process simulation vs {args.ranks} ranks (no fine-tuning rows): "
        f"max |d val loss| {diffs['val_loss']:.2e}, max |d E[C_T]| {diffs['mean_ct']:.2e}"
    )
    return {
        "seed": seed,
        "max_abs_val_loss": diffs["val_loss"],
        "max_abs_mean_ct": diffs["mean_ct"],
        "rows": [{k: r[k] for k in ("name", "val_loss", "val_ppl", "mean_ct")} for r in sim_rows],
    }


def spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def aggregate(per_seed: list[dict]) -> list[dict]:
    """One row per routing: every metric's mean / std / min / max over the seeds (Δ ppl per seed first)."""
    names = [
        r["name"]
        for r in per_seed[0]["rows"]  # the rows every seed has
        if all(any(x["name"] == r["name"] for x in res["rows"]) for res in per_seed)
    ]
    out = []
    for name in names:
        rows = []
        for res in per_seed:
            r = next(x for x in res["rows"] if x["name"] == name)
            ref_name = (
                (r.get("reference") or "standard fine-tuning")
                if r["finetuned"]
                else "standard routing (contiguous placement)"
            )
            ref = next(x for x in res["rows"] if x["name"] == ref_name)
            rows.append(dict(r, rel_ppl=r["val_ppl"] / ref["val_ppl"] - 1))
        agg = {k: rows[0].get(k) for k in ("name", "group", "max_devices", "method", "finetuned", "recipe")}
        for m in METRICS:
            vals = [r[m] for r in rows if r.get(m) is not None]
            agg[m] = spread(vals) if vals else None
        out.append(agg)
    return out


def targets(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["finetuned"] and r["max_devices"] is not None:
            limit, worst = TARGETS.get(r["max_devices"], (None, None))
            rel = r["rel_ppl"]
            out.append(
                {
                    "name": r["name"],
                    "rel_ppl_mean": rel["mean"],
                    "rel_ppl_max": rel["max"],
                    "limit": limit,
                    "limit_worst": worst,
                    "met_mean": None if limit is None else rel["mean"] <= limit,
                    "met_every_seed": None if limit is None else rel["max"] <= worst,
                }
            )
    return out


def run_env(args) -> dict:
    """The machine, versions, code's commit, date (UTC, ISO-8601) and link of this process (a seed's run, or
    the aggregation)."""
    import torch

    from occult.tools.run_record import run_record

    cuda = torch.cuda.is_available() and args.device != "cpu"
    gpu = torch.cuda.get_device_name(0) if cuda else None
    device = (
        f"one process, {args.ranks} devices simulated, on {gpu or f'{os.cpu_count()} CPU cores'}"
        if args.simulate
        else f"{args.ranks} x {gpu} (NCCL)"
        if cuda
        else f"{args.ranks} CPU gloo ranks on {os.cpu_count()} cores ({platform.machine()})"
    )
    return {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        **run_record(1 if args.simulate else args.ranks, cuda),
        "threads_per_rank": args.threads,
        "grad_sync": "ddp",
    }


def corpus_sources(corpus_dir) -> list[str]:
    """The `occult data prepare --corpus` names a prepared directory was made from (its manifest's source)."""
    from occult.lm.data import SOURCES

    manifest = Path(corpus_dir or "") / "manifest.json"
    if not corpus_dir or not manifest.exists():
        return []
    source = json.loads(manifest.read_text()).get("source", "")
    return [name for name, (_, description) in SOURCES.items() if description in source]


def command_line(args) -> str:
    parts = ["python benchmarks/quality_ranks.py", f"--ranks {args.ranks}", f"--seeds {args.seeds}"]
    if args.simulate:
        parts.append("--simulate")
    if args.tiny:
        parts.append("--tiny")
    if args.corpus_dir:
        parts.append(f"--corpus-dir {args.corpus_dir}")
    defaults = TINY if args.tiny else REAL
    parts += [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in REAL if getattr(args, k) != defaults[k]]
    parts += [f"--max-devices {' '.join(map(str, args.max_devices))}", f"--methods {' '.join(args.methods)}"]
    if args.recipes:
        parts.append(f"--recipes {' '.join(args.recipes)}")
    if args.recipe_methods:
        parts.append(f"--recipe-methods {' '.join(args.recipe_methods)}")
    if args.expert_backend != "torch":
        parts.append(f"--expert-backend {args.expert_backend}")
    if args.threads != 1:  # the thread count moves a seed's numbers (the fp32 summation order)
        parts.append(f"--threads {args.threads}")
    return " ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render_only:
        render(json.loads(args.results.read_text()), args.doc)
        return 0
    if args.experts % args.ranks:
        raise SystemExit(f"--experts {args.experts} must be divisible by --ranks {args.ranks}")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    per_seed = []
    for s in args.seed_list:
        per_seed.append(run_seed(args, s))
        if args.drop_weights:
            freed = drop_weights(args.out / f"seed{s}")
            qs.log(f"seed {s}: dropped the fine-tuning runs' weights ({freed / 1e9:.1f} GB)")
    checks = (
        []
        if args.no_check_sim or args.simulate
        else [check_simulation(args, s, r) for s, r in zip(args.seed_list, per_seed)]
    )
    rows = aggregate(per_seed)
    results = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "env": run_env(args),
        "seeds": per_seed,
        "rows": rows,
        "targets": targets(rows),
        "simulation_check": checks,
        "wall_seconds": time.perf_counter() - t0,
        "command": command_line(args),
        "corpus_sources": corpus_sources(args.corpus_dir),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.results.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(args.results)
    render(results, args.doc)
    for r in rows:
        ct = r["mean_ct"]
        print(
            f"{r['name']:42s} {'FT' if r['finetuned'] else '  '} ppl {r['val_ppl']['mean']:9.3f} "
            f"[{r['val_ppl']['min']:.3f}, {r['val_ppl']['max']:.3f}]  d {r['rel_ppl']['mean'] * 100:+6.2f}% "
            f"E[C_T] {ct['mean']:.3f} [{ct['min']:.3f}, {ct['max']:.3f}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
