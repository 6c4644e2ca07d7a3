"""One seed of the multi-rank quality study, on every rank of a torchrun job (`benchmarks/quality_ranks.py`).

    torchrun --nproc-per-node R benchmarks/_quality_ranks_job.py train|tune|recipes SEED_DIR/job.json

The phases of `benchmarks/quality_study.py`, with every training and fine-tuning run a real
R-rank job (`occult.lm.parallel`: experts sharded over the R ranks, everything else data
parallel, the load-balancing loss over the global batch):

  train     base model on R ranks (experts contiguous: no placement exists yet) -> SEED_DIR/train.json
            (then the driver profiles and places in one process: `quality_study.phase_profile/phase_place`)
  tune: evaluate  the base weights sharded by the contiguous placement (standard routing) and by the
            study's placement (placement only, pruned N x method); the routers are limited against
            the layers' own rank map (checked equal to the placement), so the dedup dispatcher
            really sends every token to at most N ranks
  tune: finetune  standard and every pruned variant on R ranks, experts placed by the study's placement

  recipes   (only with `recipes` in the job) the no-fine-tuning pruned rows and the pruning-aware
            fine-tuning recipes (`RECIPES`, `occult.lm.distill`) for every N x method, on the tune
            phase's base and placement -> SEED_DIR/recipes.json (the driver merges its rows)

E[C_T] is measured from the dispatcher: the rows each MoE layer's dedup dispatch sent
(`OccultMoE.last_comm_stats.dispatch_rows`, one per (token, destination rank), itself included)
summed over ranks, layers and validation batches, divided by tokens x layers. `mean_ct_observed`
is the same quantity counted from the routed ids on the placement (what the one-process study
reports); the two agree exactly. Rank 0 writes SEED_DIR/tune.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_study as qs  # noqa: E402  (puts the repository root on sys.path)

from occult.distributed import finish_distributed, init_distributed  # noqa: E402
from occult.lm.checkpoint import config_from_metadata, load_weights, read_checkpoint  # noqa: E402
from occult.lm.evaluate import evaluate  # noqa: E402
from occult.lm.model import ModelConfig  # noqa: E402
from occult.lm.parallel import full_model, setup_parallel, shard_model  # noqa: E402
from occult.lm.train import BEST, FINAL, finetune, train  # noqa: E402
from occult.moe.pruning import load_similarity, similarity_path  # noqa: E402
from occult.placement import Placement  # noqa: E402

RECIPES = {  # pruning-aware fine-tuning recipes (occult finetune's options), by the name the rows carry
    "distill": dict(distill_weight=1.0, distill_temperature=1.0),
    "distill-T2": dict(distill_weight=1.0, distill_temperature=2.0),
    "distill-0.1": dict(distill_weight=0.1, distill_temperature=1.0),
    # the teacher: the standard-routing fine-tune of the same base (its run directory's final weights)
    "distill-ft": dict(distill_weight=1.0, distill_temperature=1.0, distill_from="ft-standard"),
    "distill-ft-0.3": dict(distill_weight=0.3, distill_temperature=1.0, distill_from="ft-standard"),
    "routers": dict(train_part="routers"),
    "experts": dict(train_part="experts"),
    # `length`: the schedule is that many times --ft-steps ("long" twice, "-x4" four times, ...)
    "long": dict(length=2),
    "experts-long": dict(train_part="experts", length=2),
    "experts-x4": dict(train_part="experts", length=4),
    # experts only, longer, distilled from the standard fine-tune of the same length
    "distill-ft-experts-long": dict(
        train_part="experts", length=2, distill_weight=1.0, distill_temperature=1.0, distill_from="ft-standard"
    ),
    "distill-ft-experts-x4": dict(
        train_part="experts", length=4, distill_weight=1.0, distill_temperature=1.0, distill_from="ft-standard"
    ),
    "distill-ft-x4": dict(
        length=4,  # routers and experts
        distill_weight=1.0,
        distill_temperature=1.0,
        distill_from="ft-standard",
    ),
    "distill-ft-experts-x8": dict(
        train_part="experts", length=8, distill_weight=1.0, distill_temperature=1.0, distill_from="ft-standard"
    ),
}


def schedule(args, length: int = 1) -> dict:
    """The TrainConfig schedule of a fine-tune `length` times --ft-steps long: evaluated 4 times, and saved at
    every evaluation, so a run cut by a call's time limit loses at most a quarter of itself."""
    steps = length * args.ft_steps
    return {"steps": steps, "eval_every": max(1, steps // 4), "save_every": max(1, steps // 4)}


def parse_recipe(spec: str, max_devices: list[int]) -> tuple[str, list[int]]:
    """`NAME` (every N of `max_devices`) or `NAME@N,N` (only those): the recipe and the device limits it runs at."""
    name, at, ns = spec.partition("@")
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r} in {spec!r}: choose from {', '.join(RECIPES)}")
    try:
        only = [int(n) for n in ns.split(",")] if at else list(max_devices)
    except ValueError:
        raise ValueError(f"{spec!r}: after @ give device limits, e.g. {name}@2,1") from None
    if not only or any(n not in max_devices for n in only):
        raise ValueError(f"{spec!r}: every N after @ must be one of --max-devices {' '.join(map(str, max_devices))}")
    return name, only


def recipe_cells(args) -> list[tuple[str, int, str]]:
    """(recipe, N, method) of every recipe row of the job (`parse_recipe` of each `--recipes` entry)."""
    specs = [parse_recipe(s, args.max_devices) for s in getattr(args, "recipes", None) or []]
    methods = getattr(args, "recipe_methods", None) or args.methods
    return [(r, n, m) for r, only in specs for n in args.max_devices if n in only for m in methods]


def finetune_runs(args, recipes: bool) -> list[tuple]:
    """(row name, run directory, N, method, TrainConfig changes) of the tune phase (standard and plain
    pruned fine-tuning) or of the recipes phase (every recipe of the job x its N x method)."""
    cells = [(n, m) for n in args.max_devices for m in args.methods]
    plain = [(f"pruned N={n} ({m}) + fine-tuning", f"ft-n{n}-{m}", n, m, {}) for n, m in cells]
    if not recipes:
        return [("standard fine-tuning", "ft-standard", None, "score", {})] + plain
    rows = recipe_cells(args)
    return (
        plain
        + reference_runs(args, list(dict.fromkeys(r for r, _, _ in rows)))
        + [
            (f"pruned N={n} ({m}) + fine-tuning [{r}]", f"ft-n{n}-{m}-{r}", n, m, recipe_changes(args, r))
            for r, n, m in rows
        ]
    )


def reference_of(args, changes: dict) -> str:
    """The reference row of a fine-tuned row with these TrainConfig changes (its schedule's length)."""
    steps = changes.get("steps", args.ft_steps)
    return "standard fine-tuning" if steps == args.ft_steps else f"standard fine-tuning ({steps} steps)"


def reference_runs(args, names: list[str]) -> list[tuple]:
    """Standard fine-tuning as long as each recipe that changes the schedule (the rows' reference and
    the `distill_from` teacher of such a recipe), once per length."""
    runs = {}
    for r in names:
        length = RECIPES[r].get("length", 1)
        if length != 1:
            changes = schedule(args, length)
            runs[length] = (reference_of(args, changes), f"ft-standard-s{changes['steps']}", None, "score", changes)
    return list(runs.values())


def recipe_changes(args, name: str) -> dict:
    """`RECIPES[name]` as TrainConfig changes: `length` becomes the schedule (`schedule`); a `distill_from`
    run directory becomes its final weights' path, "ft-standard" the standard fine-tune of the recipe's length."""
    changes = dict(RECIPES[name])
    length = changes.pop("length", 1)
    if length != 1:
        changes.update(schedule(args, length))
    if "distill_from" in changes:
        steps = changes.get("steps", args.ft_steps)
        run = changes["distill_from"] + ("" if steps == args.ft_steps else f"-s{steps}")
        changes["distill_from"] = str(Path(args.out) / run / FINAL)
    return changes


def dispatcher_eval(model, data, args, par, placement=None) -> dict:
    """`evaluate` on every rank, plus E[C_T] from the rows the real dispatcher sent."""
    sent = torch.zeros(2, dtype=torch.float64)  # dispatch rows, tokens x layers

    def hook(layer, inputs, _output):
        x = inputs[0]
        sent[0] += layer.last_comm_stats.dispatch_rows
        sent[1] += x.numel() // x.shape[-1]

    hooks = [m.register_forward_hook(hook) for m in model.moe_layers()]
    try:
        ev = evaluate(
            model, data.val, args.batch_size, args.seq_len, args.eval_tokens or None, placement=placement, parallel=par
        )
    finally:
        for h in hooks:
            h.remove()
    dev = next(model.parameters()).device
    sums = sent.to(dev)
    dist.all_reduce(sums, group=par.world_group)
    ev["mean_ct_observed"] = ev.pop("mean_ct", None)
    ev["mean_ct"] = float(sums[0] / sums[1])
    ev["dispatch_rows"], ev["routed_tokens"] = int(sums[0]), int(sums[1])
    return ev


def row(name, ev, **kw) -> dict:
    """`quality_study.row` plus the dispatcher's counts and the E[C_T] counted from the routed ids."""
    out = qs.row(name, ev, **kw)
    out.update(
        mean_ct_observed=ev["mean_ct_observed"],
        dispatch_rows=ev["dispatch_rows"],
        routed_tokens=ev["routed_tokens"],
        val_tokens=ev["val_tokens"],
    )
    return out


def check_rank_map(model, placement: Placement) -> None:
    """The routers are limited against the ranks that really hold the experts."""
    for i, (moe, router) in enumerate(zip(model.moe_layers(), model.routers())):
        want = torch.as_tensor(placement.expert_device(i if placement.num_layers > 1 else 0).copy(), dtype=torch.int64)
        if not torch.equal(moe.expert_device_E.cpu().to(torch.int64), want):
            raise RuntimeError(f"layer {i}: the experts are not on the ranks of the pruning placement")
        limit = getattr(router, "expert_device_E", None)
        if limit is not None and not torch.equal(limit.cpu(), want):
            raise RuntimeError(f"layer {i}: the router is limited against another device map than the dispatcher's")


def sharded_base(base: Path, par, placement: Placement):
    tensors, meta = read_checkpoint(base, prefixes=("model.",))
    full = full_model(config_from_metadata(meta, str(base)), par)
    load_weights(full, tensors, str(base))
    return shard_model(full, par, placement, "dedup")


def phase_train(args, data, par, log):
    run = args.out / "base"
    if args.resume and (run / FINAL).exists():
        log(f"train: reusing {run / BEST}")
        return run / BEST, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()], 0.0
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
    model = shard_model(full_model(mcfg, par), par, None, "dedup")
    log(f"train: {args.experts} experts top-{args.top_k} over {par.world_size} ranks, up to {args.train_steps} steps")
    t0 = time.perf_counter()
    res = train(
        model,
        data,
        qs.train_config(args, finetune_=False),
        run,
        resume=args.resume and run.exists(),
        progress=False,
        log=log,
        parallel=par,
    )
    secs = time.perf_counter() - t0
    log(f"train: {res.step} steps in {secs:.0f} s, best val loss {res.best_val_loss:.4f}")
    return run / BEST, res.history, secs


def phase_evaluate(args, data, par, base, placement, sims, log, pruned_only=False):
    cont = Placement.contiguous(args.experts, par.world_size, args.layers)
    rows = []
    if not pruned_only:
        model = sharded_base(base, par, cont)
        rows.append(
            row(
                "standard routing (contiguous placement)",
                dispatcher_eval(model, data, args, par, cont),
                group="no fine-tuning",
            )
        )
    model = sharded_base(base, par, placement)
    if not pruned_only:
        rows.append(row("placement only", dispatcher_eval(model, data, args, par, placement), group="no fine-tuning"))
    for n in args.max_devices:
        for m in args.methods:
            model.set_routing(n, placement, m, sims)
            check_rank_map(model, placement)
            rows.append(
                row(
                    f"pruned N={n} ({m})",
                    dispatcher_eval(model, data, args, par),
                    n=n,
                    method=m,
                    group="no fine-tuning",
                )
            )
            log(f"evaluate: N={n} {m}: val loss {rows[-1]['val_loss']:.4f}, E[C_T] {rows[-1]['mean_ct']:.3f}")
    return rows


def phase_finetune(args, data, par, base, placement, sims, log, recipes=False):
    rows, curves, secs = [], {}, {}
    for name, run_dir, n, m, changes in finetune_runs(args, recipes):
        cfg = dataclasses.replace(qs.train_config(args, finetune_=True), **changes)
        run = args.out / run_dir
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
            resume=(args.resume or recipes) and run.exists(),
            progress=False,
            log=log,
            parallel=par,
            ep_placement=placement,
            dispatcher="dedup",
        )
        secs[name] = time.perf_counter() - t0
        if n is not None:
            check_rank_map(model, placement)
        rows.append(
            row(
                name,
                dispatcher_eval(model, data, args, par, placement),
                n=n,
                method=m if n else None,
                finetuned=True,
                group="fine-tuned",
            )
        )
        rows[-1].update(recipe=changes, reference=reference_of(args, changes))
        curves[name] = [(h["step"], h["val_loss"]) for h in res.history]
        log(f"finetune: {name}: val loss {rows[-1]['val_loss']:.4f}, E[C_T] {rows[-1]['mean_ct']:.3f}")
    return rows, curves, secs


def train_result(history: list[dict], secs: float, data) -> dict:
    """What the train phase of a seed reports (SEED_DIR/train.json)."""
    return {
        "train_curve": [(h["step"], h["val_loss"]) for h in history],
        "train_steps_done": history[-1]["step"] if history else 0,
        "best_train_val": min(h["val_loss"] for h in history),
        "seconds": {"train": secs},
        "vocab": data.vocab_size,
        "train_tokens": int(data.train.numel()),
        "val_tokens": int(data.val.numel()),
    }


def run_job(phase: str, job: Path) -> int:
    """`train` (base model), `tune` (evaluation and fine-tuning) or `recipes` of one seed, on every rank."""
    args = argparse.Namespace(**json.loads(job.read_text()))
    args.out = Path(args.out)
    _, world = init_distributed()
    par = setup_parallel(None)
    torch.set_num_threads(max(1, int(args.threads)))
    log = qs.log if par.is_main else (lambda _msg: None)
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be divisible by the {world} ranks")
    data, _corpus = qs.phase_data(args) if par.is_main else _quiet(qs.phase_data, args)
    t0 = time.perf_counter()
    if phase == "train":
        _, history, secs = phase_train(args, data, par, log)
        result = train_result(history, secs, data)
    else:
        base = args.out / "base" / BEST
        placement = Placement.load(args.out / "placement.json")
        sims = load_similarity(similarity_path(args.out / "placement.json"), args.experts, args.layers)
        rows = phase_evaluate(args, data, par, base, placement, sims, log, pruned_only=phase == "recipes")
        t = time.perf_counter()
        ft_rows, curves, ft_secs = phase_finetune(args, data, par, base, placement, sims, log, phase == "recipes")
        result = {
            "rows": rows + ft_rows,
            "ft_curves": curves,
            "ranks": world,
            "ft_seconds": ft_secs,
            "seconds": {"evaluate": t - t0, "fine-tuning": sum(ft_secs.values())},
        }
    if par.is_main:
        path = args.out / f"{phase}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(path)
        log(f"{phase}: {time.perf_counter() - t0:.0f} s on {world} ranks -> {path}")
    finish_distributed()
    return 0


def simulate(phase: str, spec: dict) -> dict:
    """`run_job`'s result for one seed in ONE process, the R devices simulated (`quality_ranks.py --simulate`,
    for one GPU): the routers limited against the study's R-device placement, every expert local
    (`quality_study`'s phases), so E[C_T] is counted from the routed ids on the placement (the quantity
    the R-rank runs' dispatchers were shown to send, `mean_ct_observed` there); no dispatcher rows."""
    args = argparse.Namespace(**spec)
    args.out = Path(args.out)
    torch.set_num_threads(max(1, int(args.threads)))
    data, _corpus = qs.phase_data(args)
    t0 = time.perf_counter()
    if phase == "train":
        _, history, secs = qs.phase_train(args, data)
        return train_result(history, secs, data)
    base = args.out / "base" / BEST
    placement = Placement.load(args.out / "placement.json")
    sims = load_similarity(similarity_path(args.out / "placement.json"), args.experts, args.layers)
    rows = [
        _simulated(r)
        for r in qs.phase_evaluate(args, data, base, placement, sims)
        if phase != "recipes" or r["max_devices"] is not None
    ]
    t = time.perf_counter()
    kw = dict(batch_size=args.batch_size, seq_len=args.seq_len, max_tokens=args.eval_tokens or None)
    curves, secs = {}, {}
    for name, run_dir, n, m, changes in finetune_runs(args, phase == "recipes"):
        cfg = dataclasses.replace(qs.train_config(args, finetune_=True), **changes)
        run = args.out / run_dir
        t1 = time.perf_counter()
        model, res = finetune(
            base,
            data,
            cfg,
            run,
            max_devices=n,
            placement=placement if n else None,
            method=m,
            similarity=sims if n else None,
            resume=(args.resume or phase == "recipes") and run.exists(),
            progress=False,
            log=qs.log,
        )
        secs[name] = time.perf_counter() - t1
        ev = evaluate(model, data.val, placement=placement, **kw)
        rows.append(
            dict(
                _simulated(qs.row(name, ev, n=n, method=m if n else None, finetuned=True, group="fine-tuned")),
                recipe=changes,
                reference=reference_of(args, changes),
            )
        )
        curves[name] = [(h["step"], h["val_loss"]) for h in res.history]
        qs.log(f"finetune: {name}: val loss {ev['val_loss']:.4f}, E[C_T] {ev['mean_ct']:.3f} ({secs[name]:.0f} s)")
    return {
        "rows": rows,
        "ft_curves": curves,
        "ranks": 1,
        "ft_seconds": secs,
        "seconds": {"evaluate": t - t0, "fine-tuning": sum(secs.values())},
    }


def _simulated(r: dict) -> dict:
    """A one-process row in the R-rank rows' shape: E[C_T] counted from the ids, no dispatcher rows."""
    return dict(r, mean_ct_observed=r["mean_ct"], dispatch_rows=None, routed_tokens=None, val_tokens=None)


def _quiet(fn, *a):
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*a)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("train", "tune", "recipes"):
        raise SystemExit(__doc__)
    raise SystemExit(run_job(sys.argv[1], Path(sys.argv[2])))
