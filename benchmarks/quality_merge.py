"""Merge runs of the quality study that measured different rows of the same seeds into one run directory.

A seed of the one-GPU study at the issue's size does not fit one device call with every row (N = 3/2/1 x score /
similarity x plain / distilled), so it runs as several `quality_ranks.py` runs, one call each, that share the seed's
base training, placement and standard fine-tunes and differ in `--max-devices/--methods/--recipes/--recipe-methods`.
This script checks that the shared part really is the same (the same best base validation loss, the same placement, and
every row the runs share to `--tol` in validation loss and E[C_T]: a seed repeats exactly on one machine, so a
difference means a different configuration, not noise), then writes one `seedS/` per seed with the union of the rows.
Aggregate the merged directory as usual (`quality_ranks.py --resume --out OUT`, flags covering the merged rows).

  python benchmarks/quality_merge.py --out DIR RUN_A RUN_B     # each RUN holds seed0/, seed1/, ...
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

METHOD_ORDER = {"score": 0, "similarity": 1}
KEPT = ("job.json", "placement.json", "train.json")  # copied from the first run (equal where it matters: checked)
SAME_WORK = ("train", "profile+place", "evaluate")  # every run repeats these: the merged seed needs them once


def row_order(row: dict) -> tuple:
    """Sort key: rows without fine-tuning, then each fine-tuning reference's rows (the reference first), by N
    descending, then method; a stable sort keeps the runs' own order among equals."""
    n = row.get("max_devices")
    reference = (row.get("reference") or "") if row["finetuned"] else ""
    return (row["finetuned"], reference, n is not None, -(n or 0), METHOD_ORDER.get(row.get("method"), 9))


def _differ(a: dict, b: dict, tol: float) -> list[str]:
    return [k for k in ("val_loss", "mean_ct") if a.get(k) is not None and abs(a[k] - b[k]) > tol]


def merge_seed(results: list[dict], dirs: list[Path], tol: float) -> dict:
    """One seed's result.json from several runs' (the rows' union); SystemExit when the runs disagree."""
    first = results[0]
    rows = {r["name"]: r for r in first["rows"]}
    problems = []
    for res, d in zip(results[1:], dirs[1:]):
        if abs(res["best_train_val"] - first["best_train_val"]) > tol:
            problems.append(f"{d}: base best validation loss {res['best_train_val']!r} != {first['best_train_val']!r}")
        for r in res["rows"]:
            if r["name"] not in rows:
                rows[r["name"]] = r
            elif bad := _differ(r, rows[r["name"]], tol):
                problems.append(f"{d}: row {r['name']!r} differs in {', '.join(bad)}")
    if problems:
        raise SystemExit(
            f"seed {first['seed']}: the runs are not the same seed and configuration "
            f"(shared rows must agree to --tol {tol:g}):\n  " + "\n  ".join(problems)
        )
    merged = dict(first, rows=sorted(rows.values(), key=row_order))
    for key in ("ft_curves", "ft_seconds"):
        merged[key] = {k: v for res in reversed(results) for k, v in res.get(key, {}).items()}
    merged["env"] = next((res["env"] for res in results if res.get("env")), None)
    seconds = {
        k: min(res["seconds"][k] for res in results if k in res["seconds"])
        for k in SAME_WORK
        if any(k in res["seconds"] for res in results)
    }  # the fastest run: runs may have shared the GPU
    later = dict.fromkeys(k for res in results for k in res["seconds"] if k not in SAME_WORK and k != "total")
    for k in later:
        seconds[k] = sum(res["seconds"].get(k, 0.0) for res in results)  # every run's fine-tunes, references included
    seconds["total"] = sum(seconds.values())
    merged["seconds"] = seconds
    merged["merged_from"] = [_run_spec(d) for d in dirs]
    merged["merge_tol"] = tol
    return merged


def _run_spec(seed_dir: Path) -> dict:
    """What a merged run measured (its job.json's row choices), for the report."""
    job = json.loads((seed_dir / "job.json").read_text()) if (seed_dir / "job.json").exists() else {}
    return {"dir": str(seed_dir), **{k: job.get(k) for k in ("max_devices", "methods", "recipes", "recipe_methods")}}


def _placement(seed_dir: Path) -> dict:
    return json.loads((seed_dir / "placement.json").read_text()) if (seed_dir / "placement.json").exists() else {}


def merge(runs: list[Path], out: Path, tol: float) -> list[int]:
    """Merge every seed that each of `runs` holds into `out`/seedS/; the seeds merged."""
    seeds = sorted(
        set.intersection(*({int(p.name[4:]) for p in r.glob("seed*") if (p / "result.json").exists()} for r in runs))
    )
    if not seeds:
        raise SystemExit(f"no seed has a result.json in every run ({', '.join(map(str, runs))}): nothing to merge")
    for s in seeds:
        dirs = [r / f"seed{s}" for r in runs]
        if any(_placement(d) != _placement(dirs[0]) for d in dirs[1:]):
            raise SystemExit(f"seed {s}: the runs' placement.json differ: not the same seed and configuration")
        merged = merge_seed([json.loads((d / "result.json").read_text()) for d in dirs], dirs, tol)
        dest = out / f"seed{s}"
        dest.mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            if (dirs[0] / name).exists():
                shutil.copyfile(dirs[0] / name, dest / name)
        tmp = dest / "result.json.tmp"
        tmp.write_text(json.dumps(merged, indent=1) + "\n")
        tmp.replace(dest / "result.json")
        print(f"seed {s}: {len(merged['rows'])} rows from {len(dirs)} runs -> {dest}")
    return seeds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (each holds seedS/result.json)")
    p.add_argument("--out", type=Path, required=True, help="where the merged seedS/ directories go")
    p.add_argument(
        "--tol",
        type=float,
        default=1e-9,
        help="largest difference allowed in a shared row's "
        "validation loss and E[C_T] (default 1e-9: a seed repeats exactly on one kind of machine)",
    )
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        p.error("give at least two run directories to merge")
    merge(args.runs, args.out, args.tol)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
