"""Summaries for scripts/two_gpu_training.sh (issue 38), one subcommand per job:

    peak OUT.json                     the matmul ceiling: median of an 8192^3 bf16 product (CPU: 1024^3 fp32)
    run RUN_DIR OUT.json --link L --variant V --gpus G   one `occult train` run: tokens/s, MFU, per-step losses
    link OUT LINK [--gpus G]          the runs of one link -> OUT/train_{LINK}_{G}xGPU.json with the issue's ratios
                                      (G: the multi-GPU runs' count, 2 by default; a variant run in several rounds:
                                      its median run, every round's tokens/s beside it)
    replace OFF_DIR EVERY_DIR OUT.json   re-placement: migrations, E[C_T] and tokens/s before/after, losses vs off
    graphs EAGER GRAPHS EAGER_AGAIN EAGER_PROFILE GRAPHS_PROFILE OUT.json   `--layer-graphs` against the eager layers
                                      (one GPU): tokens/s, MFU, losses step by step (and two eager runs' drift),
                                      host ms per MoE call (the --profile-steps runs)
    ab OUT.json NAME=RUN_DIR ...      runs of one job in the order they ran (NAME: eager, captured, graphs, with a
                                      round suffix, e.g. eager_1; profile_NAME for --profile-steps runs): tokens/s
                                      of each mode (median over its rounds) over eager's, losses against the first
                                      eager run, each profile's wall / GPU busy / host ms per step and per MoE call

MFU = model FLOPs per token x tokens/s per GPU / measured matmul peak. Model FLOPs per token of a
training step: 3 x the forward, whose matmuls are 2 x (attention projections + router + top-k experts'
SwiGLU + tied LM head) per token plus the causal attention scores and values (4 x hidden per
(query, key) pair per layer, (seq + 1) / 2 keys per query on average).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from occult.tools.run_record import run_record


def measure_peak() -> dict[str, Any]:
    """TFLOP/s of one large matmul on this process's device (the median of 20)."""
    cuda = torch.cuda.is_available()
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    dev = torch.device("cuda" if cuda else "cpu")
    a_NN, b_NN = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    times = []
    for i in range(23 if cuda else 5):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a_NN, b_NN)
        if cuda:
            torch.cuda.synchronize()
        if i >= 3 or not cuda:
            times.append(time.perf_counter() - t0)
    s = sorted(times)[len(times) // 2]
    return {
        "device": card_name(),
        "matmul_n": n,
        "dtype": str(dtype).replace("torch.", ""),
        "tflops": 2 * n**3 / s / 1e12,
    }


def card_name() -> str:
    """The card's name, or "cpu"."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def jobs_env(runs: dict[str, dict], gpus: int) -> dict[str, Any] | None:
    """The `gpus`-GPU runs' env blocks as one: their card, commit and link where all agree (else None), dirty if
    any was, the newest date; None when no run recorded one."""
    envs = [r["env"] for r in runs.values() if r.get("env") and r.get("gpus") == gpus]
    if not envs:
        return None

    def common(key: str) -> Any:
        values = {e.get(key) for e in envs}
        return values.pop() if len(values) == 1 else None

    dirty = [e.get("dirty") for e in envs]
    dates = [e["date"] for e in envs if e.get("date")]
    return {
        "world_size": gpus,
        "gpu": common("gpu"),
        "commit": common("commit"),
        "dirty": True if True in dirty else None if None in dirty else False,
        "date": max(dates) if dates else None,
        "link": common("link"),
    }


def flops_per_token(cfg: dict[str, Any], seq_len: int) -> float:
    """Training FLOPs per token of an OccultLM config (module docstring)."""
    h, f, e, k, layers = cfg["hidden_size"], cfg["expert_ffn_size"], cfg["num_experts"], cfg["top_k"], cfg["num_layers"]
    per_layer = 4 * h * h + h * e + k * 3 * h * f
    forward = 2 * (layers * per_layer + cfg["vocab_size"] * h) + layers * 4 * h * (seq_len + 1) / 2
    return 3 * forward


def read_meta(path: Path) -> dict[str, str]:
    """The metadata of a safetensors file (header only)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def summarise_run(run_dir: Path, link: str, variant: str, gpus: int, peak: dict | None) -> dict[str, Any]:
    """tokens/s (steady: the last evaluation window, after the first), MFU, per-step losses of one run."""
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    meta = read_meta(run_dir / "model.safetensors")
    cfg, tcfg = json.loads(meta["model_config"]), json.loads(meta["train_config"])
    tps = metrics[-1]["train_tokens_per_s"]
    r = {
        "link": link,
        "variant": variant,
        "gpus": gpus,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / gpus,
        "tokens_per_s_first_window": metrics[0].get("train_tokens_per_s"),
        "val_loss": metrics[-1]["val_loss"],
        "flops_per_token": flops_per_token(cfg, tcfg["seq_len"]),
        "model": {
            k: cfg[k] for k in ("hidden_size", "num_layers", "num_experts", "top_k", "expert_ffn_size") if k in cfg
        },
        "losses": json.loads(meta["train_losses"]),
        "batch_size": tcfg["batch_size"],
        "seq_len": tcfg["seq_len"],
        "steps": tcfg["steps"],
        # where and from what code (run right after the run, in its environment: NCCL_P2P_DISABLE gives the link)
        "env": {"world_size": gpus, "gpu": card_name(), **run_record(gpus, torch.cuda.is_available())},
    }
    if peak:
        r["mfu"] = r["flops_per_token"] * r["tokens_per_s_per_gpu"] / (peak["tflops"] * 1e12)
    return r


def loss_agreement(runs: dict[str, dict], ref: str) -> dict[str, float]:
    """Largest relative difference of each run's per-step losses from the reference run's."""
    base = runs[ref]["losses"]
    return {v: max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base)) for v, r in runs.items() if v != ref}


def ratio(runs: dict[str, dict], a: str, b: str, key: str) -> float | None:
    return runs[a][key] / runs[b][key] if a in runs and b in runs else None


RATIOS = {  # ratio key -> (numerator variant, denominator variant, the runs' field they divide)
    "dedup_over_floor_per_gpu": ("dedup_ddp", "floor", "tokens_per_s_per_gpu"),
    "dedup_over_standard": ("dedup_ddp", "standard_ddp", "tokens_per_s"),
    "dedup_fsdp_over_standard_fsdp": ("dedup_fsdp", "standard_fsdp", "tokens_per_s"),
    "two_gpu_dedup_over_one_gpu_job": ("dedup_ddp", "1gpu", "tokens_per_s"),
    "two_gpu_floor_over_one_gpu_job": ("floor", "1gpu", "tokens_per_s"),
    "dedup_layer_graphs_over_dedup": ("dedup_graphs_ddp", "dedup_device_ddp", "tokens_per_s"),
    "dedup_captured_step_over_dedup": ("dedup_captured_explicit", "dedup_device_ddp", "tokens_per_s"),
    "dedup_captured_step_over_floor_per_gpu": ("dedup_captured_explicit", "floor", "tokens_per_s_per_gpu"),
    "dedup_two_batch_captured_over_floor_per_gpu": ("dedup_twobatch_captured", "floor", "tokens_per_s_per_gpu"),
    "dedup_two_batch_captured_over_captured_floor_per_gpu": (
        "dedup_twobatch_captured",
        "floor_captured",
        "tokens_per_s_per_gpu",
    ),
    "dedup_two_batch_captured_over_dedup": ("dedup_twobatch_captured", "dedup_ddp", "tokens_per_s"),
    # issue 53: 4 accumulated micro-batches a step, recorded, paired (combined 1F1B) over in turn and the floor
    "dedup_paired_captured_over_dedup_accum_captured": (
        "dedup_paired_captured",
        "dedup_accum_captured",
        "tokens_per_s",
    ),
    "dedup_paired_captured_over_captured_floor_per_gpu": (
        "dedup_paired_captured",
        "floor_captured",
        "tokens_per_s_per_gpu",
    ),
    # issue 52: FSDP2 against the replicated dense weights, each eager and each recorded
    "dedup_fsdp_over_dedup_ddp": ("dedup_fsdp", "dedup_ddp", "tokens_per_s_per_gpu"),
    "dedup_fsdp_model_over_dedup_ddp": ("dedup_fsdp_model", "dedup_ddp", "tokens_per_s_per_gpu"),
    "dedup_fsdp_agreestep_over_dedup_ddp": ("dedup_fsdp_agreestep", "dedup_ddp", "tokens_per_s_per_gpu"),
    "dedup_fsdp_captured_over_dedup_captured_explicit": (
        "dedup_fsdp_captured",
        "dedup_captured_explicit",
        "tokens_per_s_per_gpu",
    ),
}


CAPTURED_EAGER = (("dedup_fsdp_captured", "dedup_fsdp"), ("floor_captured", "floor"))  # (recorded, its eager run)


def best_ratio(runs: dict[str, dict], numerator: str, denominator: str) -> float | None:
    """tokens/s per GPU of the fastest run whose variant starts with `numerator` over the fastest starting with
    `denominator` (e.g. every EP dedup mode over the eager and the recorded floor); None where either is missing."""

    def best(prefix: str) -> float | None:
        rates = [r["tokens_per_s_per_gpu"] for v, r in runs.items() if v.startswith(prefix)]
        return max(rates) if rates else None

    a, b = best(numerator), best(denominator)
    return a / b if a and b else None


def per_round(rounds: dict[str, list[dict]], a: str, b: str, field: str) -> list[float]:
    """`a`'s runs over `b`'s of the same round (ROUNDS=N: every variant once a round, rounds in turn; a round a
    variant skipped for the time budget is one of the last, so the first rounds pair up): the ratio without the
    drift between rounds that `median_round`'s runs, each the median of its own variant, keep."""
    return [ra[field] / rb[field] for ra, rb in zip(rounds.get(a, []), rounds.get(b, []))]


def median_round(rounds: list[dict]) -> dict:
    """One variant's runs of a job (ROUNDS=N in two_gpu_training.sh: every variant once a round, the rounds in
    turn) as the run of median tokens/s (the lower one of the middle two for an even count), with every round's
    tokens/s per GPU beside it; one run as it is."""
    if len(rounds) == 1:
        return rounds[0]
    ordered = sorted(rounds, key=lambda r: r["tokens_per_s_per_gpu"])
    each = [r["tokens_per_s_per_gpu"] for r in rounds]
    return dict(ordered[(len(ordered) - 1) // 2], rounds_tokens_per_s_per_gpu=each)


def link_report(out: Path, link: str, gpus: int = 2) -> dict[str, Any]:
    """Every run of one link (and the 1-GPU reference) with the issue 38 targets' ratios; `gpus`: how many the
    multi-GPU runs had."""
    rounds: dict[str, list[dict]] = {}
    for p in sorted((out / "runs").glob("train_*.json")):
        r = json.loads(p.read_text())
        if r["link"] == link or (r["variant"] == "1gpu" and link != "nvlink"):
            rounds.setdefault(r["variant"], []).append(r)
    runs = {variant: median_round(rs) for variant, rs in rounds.items()}
    skipped = (out / "skipped.txt").read_text().split("\n") if (out / "skipped.txt").exists() else []
    ratios: dict[str, float | None] = {k: ratio(runs, a, b, field) for k, (a, b, field) in RATIOS.items()}
    # issue 52: the fastest EP dedup run over the fastest data-parallel floor of the job, however each ran
    ratios["best_dedup_over_best_floor_per_gpu"] = best_ratio(runs, "dedup", "floor")
    # the loss reference: the floor trains on the same global batch as the EP runs; the 1-GPU run on half
    # of it (8 sequences per GPU everywhere), so its losses differ from the first step on
    ref = next((v for v in ("floor", "1gpu") if v in runs), None)
    peak_p = out / "peak.json"
    return {
        "link": link,
        "env": jobs_env(runs, gpus),
        "peak": json.loads(peak_p.read_text()) if peak_p.exists() else None,
        "variants": runs,
        "ratios": ratios,
        # each ratio of a job with ROUNDS >= 2 round by round (numerator and denominator from the same round)
        "ratios_per_round": {
            k: r for k, (a, b, field) in RATIOS.items() if len(r := per_round(rounds, a, b, field)) >= 2
        },
        "loss_max_rel_diff_vs": ref,
        "loss_max_rel_diff": loss_agreement(runs, ref) if ref else {},
        # issue 52: a recorded step's losses against the same settings' eager steps, step by step
        "captured_loss_max_rel_diff_vs_eager": {
            captured: loss_agreement({eager: runs[eager], captured: runs[captured]}, eager)[captured]
            for captured, eager in CAPTURED_EAGER
            if captured in runs and eager in runs
        },
        "skipped": [s.split()[1] for s in skipped if s.startswith(link + " ")],
    }


def measures(run_dir: Path) -> list[dict]:
    p = run_dir / "replace.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def window_rate(events: list[dict], tokens: int, lo: int, hi: int) -> float | None:
    """Median tokens/s over the measurement windows with lo < step <= hi (evaluation windows included)."""
    m = [e for e in events if e["event"] == "measure"]
    rates = sorted(
        (b["step"] - a["step"]) * tokens / (b["time"] - a["time"])
        for a, b in zip(m, m[1:])
        if lo < a["step"] and b["step"] <= hi and b["time"] > a["time"]
    )
    return rates[len(rates) // 2] if rates else None


def replace_report(off: Path, every: Path) -> dict[str, Any]:
    """Migrations of the re-placing run against the run without: time, E[C_T], tokens/s, losses."""
    meta_off, meta_on = read_meta(off / "model.safetensors"), read_meta(every / "model.safetensors")
    tcfg = json.loads(meta_on["train_config"])
    tokens = tcfg["batch_size"] * tcfg["seq_len"]
    events = measures(every)
    migs = [e for e in events if e["event"] == "migrate"]
    l_off, l_on = json.loads(meta_off["train_losses"]), json.loads(meta_on["train_losses"])
    first = migs[0]["step"] if migs else len(l_on)
    rel = [abs(a - b) / abs(b) for a, b in zip(l_on, l_off)]
    ct = [(e["step"], e["mean_ct"]) for e in events if e["event"] == "measure"]
    report = {
        "steps": tcfg["steps"],
        "replace_every": tcfg.get("replace_every"),
        "tokens_per_step": tokens,
        "migrations": [
            {k: m[k] for k in ("step", "old_ct", "new_ct", "experts_moved", "bytes_sent", "migrate_s")} for m in migs
        ],
        "ct_first_window": ct[0][1] if ct else None,
        "ct_last_window": ct[-1][1] if ct else None,
        "ct_before_first_migration": next((v for s, v in reversed(ct) if s <= first), None),
        "ct_after_first_migration": next((v for s, v in ct if s > first), None) if migs else None,
        "tokens_per_s_before": window_rate(events, tokens, 0, first),
        "tokens_per_s_after": window_rate(events, tokens, first, tcfg["steps"]) if migs else None,
        "loss_max_rel_diff_before_first_migration": max(rel[:first], default=None),
        "loss_max_rel_diff_after": max(rel[first:], default=None),
        "loss_max_rel_diff_first_10_steps": max(rel[: min(first, 10)], default=None),
        # bit-equal on CPU; on GPUs two runs of the same seed differ in the last bits (atomic adds in the
        # backward), and the difference grows over the steps: read the first 10 steps' figure there
        "losses_equal_before_first_migration": rel[:first] == [0.0] * first,
        "losses_off": l_off,
        "losses_every": l_on,
    }
    if migs and report["tokens_per_s_before"]:
        step_s = tokens / report["tokens_per_s_before"]
        report["migration_share_of_training"] = max(m["migrate_s"] for m in migs) / (
            step_s * (tcfg.get("replace_every") or 1)
        )
    return report


def graphs_report(paths: list[Path]) -> dict[str, Any]:
    """`occult train --layer-graphs` against the same run with eager layers (one job, one GPU), `paths`: the
    eager run, the graphs run, the eager run again (how far two eager runs of one seed drift apart: the
    kernels' atomic adds), and the two `--profile-steps` runs. Both summaries, the tokens/s ratio, the largest
    relative loss difference over the steps (graphs and the repeat against eager), and each profile's host time
    per MoE layer call (`step_profile_rank0.json`: `moe_host_ms_per_call`, GPU busy)."""
    peak = measure_peak() if torch.cuda.is_available() else None
    names = ("eager", "graphs", "eager_repeat")
    runs = {name: summarise_run(p, "none", name, 1, peak) for name, p in zip(names, paths[:3])}
    agreement = loss_agreement(runs, "eager")
    report: dict[str, Any] = {
        "env": runs["graphs"]["env"],
        "peak": peak,
        "variants": runs,
        "graphs_over_eager_tokens_per_s": ratio(runs, "graphs", "eager", "tokens_per_s"),
        "loss_max_rel_diff": agreement["graphs"],
        "loss_max_rel_diff_eager_repeat": agreement["eager_repeat"],
        "loss_max_rel_diff_first_25_steps": {
            name: max(abs(a - b) / abs(b) for a, b in zip(runs[name]["losses"][:25], runs["eager"]["losses"][:25]))
            for name in ("graphs", "eager_repeat")
        },
        "val_loss_rel_diff": abs(runs["graphs"]["val_loss"] - runs["eager"]["val_loss"]) / runs["eager"]["val_loss"],
    }
    for name, p in zip(("eager", "graphs"), paths[3:5]):
        prof = json.loads((p / "step_profile_rank0.json").read_text())
        keys = ("moe_host_ms_per_call", "wall_ms_per_step", "gpu_busy_ms_per_step", "gpu_busy_share")
        report[f"profile_{name}"] = {k: prof.get(k) for k in (*keys, "idle_ms_per_step", "device_ops_per_step")}
    return report


def ab_report(named: dict[str, Path]) -> dict[str, Any]:
    """Modes of one job alternated (`ab` in the module docstring): each run's summary, each mode's median
    tokens/s over eager's, the largest relative loss difference against the first eager run (all steps and
    the first 25), and each profile run's step figures."""
    peak = measure_peak() if torch.cuda.is_available() else None
    runs = {n: summarise_run(p, "none", n, 1, peak) for n, p in named.items() if not n.startswith("profile_")}
    modes: dict[str, list[float]] = {}
    for name, r in runs.items():
        modes.setdefault(name.rsplit("_", 1)[0], []).append(r["tokens_per_s"])
    median = {
        m: sorted(v)[len(v) // 2] if len(v) % 2 else sum(sorted(v)[len(v) // 2 - 1 : len(v) // 2 + 1]) / 2
        for m, v in modes.items()
    }
    ref = next(n for n in runs if n.startswith("eager"))
    base = runs[ref]["losses"]

    def gap(losses: list[float], upto: int | None = None) -> float:
        pairs = list(zip(losses, base))[:upto]
        return max(abs(a - b) / abs(b) for a, b in pairs)

    report: dict[str, Any] = {
        "env": runs[ref]["env"],
        "peak": peak,
        "order": list(named),
        "variants": runs,
        "tokens_per_s_median": median,
        "over_eager_tokens_per_s": {m: v / median["eager"] for m, v in median.items() if "eager" in median},
        "loss_max_rel_diff_vs": ref,
        "loss_max_rel_diff": {n: gap(r["losses"]) for n, r in runs.items() if n != ref},
        "loss_max_rel_diff_first_25_steps": {n: gap(r["losses"], 25) for n, r in runs.items() if n != ref},
    }
    keys = ("wall_ms_per_step", "gpu_busy_ms_per_step", "gpu_busy_share", "idle_ms_per_step", "device_ops_per_step")
    for name, p in named.items():
        if name.startswith("profile_"):
            prof = json.loads((p / "step_profile_rank0.json").read_text())
            report[name] = {k: prof.get(k) for k in (*keys, "step_host_ms", "moe_host_ms_per_call")}
    return report


def write(path: str | Path, doc: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", choices=["peak", "run", "link", "replace", "graphs", "ab"])
    p.add_argument("paths", nargs="+")
    p.add_argument("--link", default="nvlink")
    p.add_argument("--variant", default="")
    p.add_argument("--gpus", type=int, default=None, help="run: the run's GPUs (1); link: the multi-GPU runs' (2)")
    a = p.parse_args()
    if a.job == "peak":
        write(a.paths[0], measure_peak())
    elif a.job == "run":
        run_dir, dest = Path(a.paths[0]), Path(a.paths[1])
        peak_p = dest.parent.parent / "peak.json"
        peak = json.loads(peak_p.read_text()) if peak_p.exists() else None
        write(dest, summarise_run(run_dir, a.link, a.variant, a.gpus or 1, peak))
    elif a.job == "link":
        out = Path(a.paths[0])
        gpus = a.gpus or 2
        write(out / f"train_{a.paths[1]}_{gpus}xGPU.json", link_report(out, a.paths[1], gpus))
    elif a.job == "ab":
        named = dict(arg.split("=", 1) for arg in a.paths[1:])
        write(a.paths[0], ab_report({n: Path(p) for n, p in named.items()}))
    elif a.job == "graphs":
        write(a.paths[-1], graphs_report([Path(p) for p in a.paths[:-1]]))
    else:
        write(a.paths[2], replace_report(Path(a.paths[0]), Path(a.paths[1])))


if __name__ == "__main__":
    main()
