"""Check the issues' numeric targets (the open 52 and 53; the closed 36, 37, 38) against the JSON the benchmarks
wrote (one table).

    python scripts/targets_report.py OUT [OUT2 ...] [--md targets.md]

Reads every `*.json` under the given files or directories and recognises these kinds by content:

- `benchmarks/e2e.py` (whole models), issue 36: the best dedup variant over the best replicated one
  (any compile / graph / transport suffix), per phase and link; at the Qwen3 shape TorchTitan's own
  model over the best dedup variant and over TorchTitan with occult's dispatcher (`torchtitan+occult*`: eager
  over eager, `torchtitan/compile` over the compiled ones, TorchTitan's fastest over the recorded (`/stepgraph`)
  ones, a row each where the job timed both sides);
  issues 52 and 53: the same ratios per model, GPU count and link (`EP_TARGETS`, `TT_TARGETS`), and on
  one GPU transformers compiled (`native/compile`) over occult's fastest compiled one-rank variant; and every
  variant's peak reserved memory against an 80 GB card (`H100_GIB`), where the report records it;
- `occult bench` (one layer), issue 36: each dedup variant's forward (the count exchange, `@device`,
  `@device/graph`) over its floor (experts + all-to-alls) at 8192+ tokens per GPU, and the host time
  of a forward at 512 tokens;
- `benchmarks/serve.py`, issue 37: the best expert-parallel decode step over the floor's
  (`replicated+compile+graph`, else `replicated+graph`, else `replicated`) at B = 1 and 64 per GPU, and
  transformers' compiled generate over that step;
- `scripts/two_gpu_training.sh`'s `train_{link}_2xGPU.json` and its re-placement report, issue 38.

Only variants whose output check passed count, and per target only the newest file's verdict (by the
commit date in the nearest provenance.json, see scripts/current_numbers.py; else the file's time; files
merged from several jobs are skipped): never the best of several runs. For each target it prints what was measured, the
verdict (met / MISSED; "n/a (1 GPU)" where one GPU has no expert-parallel traffic) and the file. A
target with nothing measured is listed as "not measured" with what measures it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_phases import phase_label  # noqa: E402
from result_provenance import LINKS, SKIP_DIRS, own_record  # noqa: E402
from train_report import TARGETS as TRAIN_TARGETS  # noqa: E402  (scripts/train_report.py: issue 38's ratios)

WHOLE_MODEL = {
    ("nvlink", "prefill"): 1.05,
    ("nvlink", "train"): 1.03,
    ("slow", "prefill"): 1.30,
    ("slow", "train"): 1.12,
}
TORCHTITAN = {
    ("nvlink", "prefill"): 3.0,
    ("nvlink", "train"): 1.8,  # TorchTitan / best dedup, Qwen3: at least
    ("slow", "prefill"): 3.5,
    ("slow", "train"): 2.2,
}
TT_OVER_TT_OCCULT = {"nvlink": 1.2, "slow": 2.0}  # TorchTitan / TorchTitan + occult's dispatcher: at least
# issues 52 (training at the floor) and 53 (hiding the all-to-alls): (issue, GPUs, link, model, phase, at most)
# for the best dedup variant over the best replicated one of the same job
EP_TARGETS = [
    ("52", 2, "nvlink", "olmoe", "train", 1.03),
    ("52", 4, "nvlink", "olmoe", "train", 1.06),
    ("52", 2, "nvlink", "qwen3", "train", 1.00),
    ("52", 4, "nvlink", "qwen3", "train", 1.00),
    ("53", 4, "nvlink", "olmoe", "prefill", 1.08),
    ("53", 4, "nvlink", "olmoe", "train", 1.04),
    ("53", 2, "slow", "olmoe", "prefill", 1.30),
    ("53", 2, "slow", "olmoe", "train", 1.10),
    ("53", 2, "slow", "qwen3", "prefill", 1.30),
    ("53", 2, "slow", "qwen3", "train", 1.05),
    ("53", 4, "slow", "olmoe", "prefill", 1.5),
    ("53", 4, "slow", "qwen3", "prefill", 1.5),
]
# (issue, GPUs, link, phase, "occult" | "torchtitan+occult", at least): TorchTitan's Qwen3 over occult's best dedup
# variant, or over TorchTitan with occult's dispatcher
TT_TARGETS = [
    ("52", 2, "nvlink", "train", "occult", 2.2),
    ("52", 2, "nvlink", "train", "torchtitan+occult", 1.2),
    ("53", 2, "slow", "prefill", "occult", 4.0),
    ("53", 2, "slow", "train", "occult", 2.5),
]
ONE_GPU_TRAIN = 1.25  # issue 52: transformers + compile_layers / occult's fastest compiled one-rank variant, at least
TRAIN_HOST_MS = 0.3  # issue 52: host ms per MoE layer call of a training step (forward and backward), at most
LAYER_FORWARD, HOST_MS, HOST_TOKENS = 1.15, 0.3, 512
DECODE = {("nvlink", 1): 1.35, ("nvlink", 64): 1.12, ("slow", 1): 1.8}  # EP step / floor step: at most
NATIVE_OVER_EP = {1: 2.0, 64: 12.0}  # transformers' compiled generate / EP step, NVLink: at least
SERVE_FLOORS = ("replicated+compile+graph", "replicated+graph", "replicated")
NATIVE = "native-generate+compile"
MIGRATION_SHARE = 0.02
H100_GIB = 78  # an 80 GB card's room for one process (tests/gpu/run.sh's OCCULT_GPU_SUITE_MEMORY_GIB)


def json_files(folder: Path) -> list[Path]:
    """The JSON files below `folder`, in path order, but for those in folders of superseded results
    (`history/`: docs/results keeps old runs there)."""
    return [f for f in sorted(folder.rglob("*.json")) if f.relative_to(folder).parts[0] not in SKIP_DIRS]


def load_reports(paths: Iterable[str]) -> list[tuple[str, dict]]:
    """Every JSON object under `paths` (files or directories), named by its path below the directory
    given (or its file name); unreadable ones are skipped."""
    files: list[tuple[str, Path]] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such file or directory")
        files += [(str(f.relative_to(p)), f) for f in json_files(p)] if p.is_dir() else [(p.name, p)]
    out = []
    for name, f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out.append((name, doc))
    return out


def kind(doc: dict) -> str | None:
    config = doc.get("config", {})
    if "variants" in doc and "env" in doc and isinstance(config, dict) and "model" in config:
        return "serve" if "new_tokens" in config else "e2e"
    if "ceilings" in doc and "runs" in doc:
        return "bench"
    if "ratios" in doc and "link" in doc and "variants" in doc:
        return "train"
    if "migration_share_of_training" in doc:
        return "replace"
    return None


def link_of(env: dict) -> str:
    return "slow" if str(env.get("NCCL_P2P_DISABLE") or "0") not in ("0", "None", "") else "nvlink"


def _gpus(world: Any) -> str:
    return f"{world} GPU" + ("" if world == 1 else "s")


def _verdict(met: bool, world: Any) -> str:
    """One GPU has no expert-parallel traffic: a ratio there says nothing about the targets."""
    return "n/a (1 GPU)" if world == 1 else ("met" if met else "MISSED")


def _whole_model_run(name: str, doc: dict) -> tuple[str, Any, str, str]:
    """(model, GPUs, link, source label) of an e2e.py or serve.py report."""
    env = doc["env"]
    world, link = env.get("world_size"), link_of(env)
    return doc["config"]["model"], world, link, f"{name} ({_gpus(world)}" + (")" if world == 1 else f", {link})")


def best_variant(timed: dict[str, float], prefix: str) -> tuple[str, float] | None:
    named = [(n, ms) for n, ms in timed.items() if n.startswith(prefix)]
    return min(named, key=lambda x: x[1]) if named else None


def titan_pairs(timed: dict[str, float]) -> list[tuple[str, float, tuple[str, float]]]:
    """TorchTitan against TorchTitan with occult's dispatcher, like with like: (how, TorchTitan's ms, the fastest
    `torchtitan+occult*` run the same way), where the job timed both sides: eager against eager, compiled
    (`/compile`) against compiled, and recorded (`/stepgraph`: the forward+backward one CUDA graph, as TorchTitan's
    trainer records a step) against TorchTitan's fastest, which cannot be recorded (its all-to-all reads the counts
    back to the host: its trainer needs `--training.disable_cuda_graphs`)."""
    pairs = []
    for how, peers in (
        ("eager", ("torchtitan",)),
        ("compiled", ("torchtitan/compile",)),
        ("recorded", ("torchtitan", "torchtitan/compile")),
    ):
        mine = {v: ms for v, ms in timed.items() if v.startswith("torchtitan+occult") and titan_run_how(v) == how}
        theirs = [timed[p] for p in peers if p in timed]
        if theirs and mine:
            pairs.append((how, min(theirs), min(mine.items(), key=lambda kv: kv[1])))
    return pairs


def titan_run_how(variant: str) -> str:
    """How e2e.py ran a TorchTitan variant: 'recorded' (/stepgraph), 'compiled' (/compile) or 'eager'."""
    return "recorded" if variant.endswith("/stepgraph") else "compiled" if variant.endswith("/compile") else "eager"


def phase_ms(doc: dict, phase: str) -> dict[str, float]:
    """e2e.py: variant -> median ms of `phase`, for variants whose check passed."""
    out = {}
    for name, v in doc["variants"].items():
        t = v.get("phases", {}).get(phase) if v.get("check", {}).get("passed", False) else None
        if t and t.get("ms_median"):
            out[name] = float(t["ms_median"])
    return out


def e2e_rows(name: str, doc: dict) -> list[list[str]]:
    """Issue 36, whole models: best dedup / best replicated; Qwen3: TorchTitan / best dedup, and TorchTitan /
    TorchTitan with occult's dispatcher."""
    rows, (model, world, link, where) = [], _whole_model_run(name, doc)
    for phase in ("prefill", "train"):
        timed = phase_ms(doc, phase)
        floor, best = best_variant(timed, "replicated"), best_variant(timed, "dedup")
        if floor and best:
            limit, r = WHOLE_MODEL[(link, phase)], best[1] / floor[1]
            rows.append(
                [
                    f"36: whole model ({model}), best dedup / best replicated, {phase_label(doc, phase)}, {link}: "
                    f"<= {limit}",
                    f"{r:.3f}x ({best[0]} {best[1]:.2f} vs {floor[0]} {floor[1]:.2f} ms)",
                    _verdict(r <= limit, world),
                    where,
                ]
            )
        peer = timed.get("torchtitan")
        if model == "qwen3" and peer and best:
            need, s = TORCHTITAN[(link, phase)], peer / best[1]
            rows.append(
                [
                    f"36: TorchTitan / best dedup (qwen3), {phase}, {link}: >= {need}",
                    f"{s:.2f}x ({best[0]} {best[1]:.2f} vs {peer:.2f} ms)",
                    _verdict(s >= need, world),
                    where,
                ]
            )
        for how, peer_ms, mine in titan_pairs(timed) if model == "qwen3" else []:
            need, s = TT_OVER_TT_OCCULT[link], peer_ms / mine[1]
            rows.append(
                [
                    f"36: TorchTitan / TorchTitan + occult (qwen3), {how}, {phase}, {link}: >= {need}",
                    f"{s:.2f}x ({mine[0]} {mine[1]:.2f} vs {peer_ms:.2f} ms)",
                    _verdict(s >= need, world),
                    where,
                ]
            )
    return rows


def open_issue_rows(name: str, doc: dict) -> list[list[str]]:
    """Issues 52 and 53, whole models: best dedup / best replicated per (GPUs, link, model, phase); TorchTitan's
    Qwen3 over occult and over TorchTitan with occult's dispatcher; on one GPU, transformers compiled over
    occult's fastest compiled one-rank variant (train)."""
    rows, (model, world, link, where) = [], _whole_model_run(name, doc)
    for phase in ("prefill", "train"):
        timed = phase_ms(doc, phase)
        floor, best = best_variant(timed, "replicated"), best_variant(timed, "dedup")
        for issue, gpus, at, which, when, limit in EP_TARGETS:
            if (gpus, at, which, when) == (world, link, model, phase) and floor and best:
                r = best[1] / floor[1]
                label = phase_label(doc, phase)  # "train x4": a step of accumulated micro-batches, floor alike
                what = f"{issue}: whole model ({model}), best dedup / best replicated, {label}, {gpus} GPUs {link}"
                cell = f"{r:.3f}x ({best[0]} {best[1]:.2f} vs {floor[0]} {floor[1]:.2f} ms)"
                rows.append([f"{what}: <= {limit}", cell, "met" if r <= limit else "MISSED", where])
        rows += host_rows(doc, phase, best, (model, world, link, where))
        for issue, gpus, at, when, over, need in TT_TARGETS:
            if (gpus, at, when) != (world, link, phase) or model != "qwen3":
                continue
            pairs = titan_pairs(timed)  # TorchTitan over occult: TorchTitan as it runs by default, eager
            if over == "occult":
                pairs = [("", timed["torchtitan"], best)] if "torchtitan" in timed and best else []
            for how, peer_ms, ours in pairs:
                s = peer_ms / ours[1]
                what = f"{issue}: TorchTitan / {over} (qwen3), {how + ', ' if how else ''}{phase}, {gpus} GPUs {link}"
                cell = f"{s:.2f}x ({ours[0]} {ours[1]:.2f} vs {peer_ms:.2f} ms)"
                rows.append([f"{what}: >= {need}", cell, "met" if s >= need else "MISSED", where])
        compiled = {v: ms for v, ms in timed.items() if v.startswith("replicated") and "/compile" in v}  # (/stepgraph)
        ours = min(compiled.items(), key=lambda kv: kv[1]) if compiled else None
        if world == 1 and phase == "train" and "native/compile" in timed and ours:
            s = timed["native/compile"] / ours[1]
            what = f"52: one GPU ({model}), transformers + compile_layers / occult compiled, train"
            cell = f"{s:.3f}x ({timed['native/compile']:.2f} vs {ours[0]} {ours[1]:.2f} ms)"
            rows.append([f"{what}: >= {ONE_GPU_TRAIN}", cell, "met" if s >= ONE_GPU_TRAIN else "MISSED", where])
            rows += back_to_back_rows(doc, what, ("native/compile", ours[0]), where)
    return rows


def back_to_back_rows(doc: dict, what: str, sides: tuple[str, str], where: str) -> list[list[str]]:
    """The one-GPU ratio again with both sides' steps issued back to back (e2e.py since session 47, where the file
    has them): the pace of a sustained run, where a step no longer starts from an idle GPU (at the card's power cap
    that is the slower measure for the side that draws more: docs/training.md)."""
    steady = [doc["variants"][v]["phases"]["train"].get("ms_back_to_back_median") for v in sides]
    if not all(steady):
        return []
    s = steady[0] / steady[1]
    cell = f"{s:.3f}x ({steady[0]:.2f} vs {sides[1]} {steady[1]:.2f} ms)"
    return [[f"{what}, back to back: >= {ONE_GPU_TRAIN}", cell, "met" if s >= ONE_GPU_TRAIN else "MISSED", where]]


def host_rows(doc: dict, phase: str, best: tuple[str, float] | None, run: tuple) -> list[list[str]]:
    """Issue 52: the host's ms per MoE layer call (a training step's forward and backward calls both counted,
    e2e.py's `host_ms_per_moe_call`, issued from an idle GPU) of the fastest dedup variant, on several GPUs."""
    model, world, link, where = run
    host = doc["variants"][best[0]]["phases"][phase].get("host_ms_per_moe_call") if best else None
    if phase != "train" or host is None or world < 2:
        return []
    label = phase_label(doc, phase)  # "train x8": a step of accumulated micro-batches, its calls all counted
    what = f"52: host ms per MoE layer call, {label}, fastest dedup ({model}), {world} GPUs {link}: <= {TRAIN_HOST_MS}"
    return [[what, f"{host:.3f} ms ({best[0]})", "met" if host <= TRAIN_HOST_MS else "MISSED", where]]


def bench_rows(name: str, doc: dict) -> list[list[str]]:
    """Issue 36, one layer: dedup forward / (experts + all-to-alls) at 8192+ tokens; host ms at 512 tokens
    (each dedup variant: the count exchange, the device transport, replayed from the layer's graphs)."""
    rows = []
    for r in doc["runs"]:
        if not str(r.get("variant")).startswith("dedup") or "+" in str(r.get("variant")) or not r.get("forward_ms"):
            continue
        world, tokens, what = r.get("world"), int(r.get("tokens") or 0), f"{r.get('shape')}, {r.get('variant')}"
        where = f"{name} ({_gpus(world)})"
        if tokens >= 8192 and r.get("floor_ms"):
            ratio = float(r["forward_ms"]) / float(r["floor_ms"])
            rows.append(
                [
                    f"36: layer forward / (experts + all-to-alls), {tokens} tokens ({what}): <= {LAYER_FORWARD}",
                    f"{ratio:.2f}x",
                    _verdict(ratio <= LAYER_FORWARD, world),
                    where,
                ]
            )
        if tokens == HOST_TOKENS and r.get("host_ms_fwd") is not None:
            host = float(r["host_ms_fwd"])
            rows.append(
                [
                    f"36: host ms per layer forward, {HOST_TOKENS} tokens ({what}): <= {HOST_MS}",
                    f"{host:.2f} ms",
                    _verdict(host <= HOST_MS, world),
                    where,
                ]
            )
    return rows


def step_ms(doc: dict, batch: int) -> dict[str, float]:
    """serve.py: variant -> decode step p50 at `batch` per GPU, for checked results."""
    out = {}
    for name, per_batch in doc["variants"].items():
        r = per_batch.get(str(batch)) if isinstance(per_batch, dict) else None
        if isinstance(r, dict) and r.get("ms_p50") and r.get("check", {}).get("passed", True):
            out[name] = float(r["ms_p50"])
    return out


def serve_rows(name: str, doc: dict) -> list[list[str]]:
    """Issue 37: the best expert-parallel step / the floor's, and transformers' compiled generate / it."""
    rows, (model, world, link, where) = [], _whole_model_run(name, doc)
    for batch in (1, 64):
        timed = step_ms(doc, batch)
        floor = next(((f, timed[f]) for f in SERVE_FLOORS if f in timed), None)
        ep = [(n, ms) for n, ms in timed.items() if not n.startswith(("replicated", "native", "hf-ep"))]
        best = min(ep, key=lambda x: x[1]) if ep else None
        if floor and best and (link, batch) in DECODE:
            limit, r = DECODE[(link, batch)], best[1] / floor[1]
            rows.append(
                [
                    f"37: EP decode step / floor ({model}), B={batch}, {link}: <= {limit}",
                    f"{r:.2f}x ({best[0]} {best[1]:.2f} vs {floor[0]} {floor[1]:.2f} ms)",
                    _verdict(r <= limit, world),
                    where,
                ]
            )
        if NATIVE in timed and best and link == "nvlink":
            need, s = NATIVE_OVER_EP[batch], timed[NATIVE] / best[1]
            rows.append(
                [
                    f"37: transformers' compiled generate / EP step ({model}), B={batch}, nvlink: >= {need}",
                    f"{s:.2f}x ({timed[NATIVE]:.2f} vs {best[0]} {best[1]:.2f} ms)",
                    _verdict(s >= need, world),
                    where,
                ]
            )
    return rows


ISSUE52_TRAIN = {  # ratio key in train_{link}_{G}xGPU.json -> (what it is, {link: target}), issue 52's `occult train`
    "best_dedup_over_best_floor_per_gpu": (
        "occult train, fastest EP dedup / fastest data-parallel floor, tokens/s per GPU",
        {"nvlink": 0.97},
    ),
    "dedup_fsdp_over_dedup_ddp": ("occult train, FSDP2 / DDP tokens/s per GPU, eager steps", {"nvlink": 0.95}),
    "dedup_fsdp_model_over_dedup_ddp": (
        "occult train, FSDP2 one unit (--fsdp-units model) / DDP tokens/s per GPU, eager steps",
        {"nvlink": 0.95},
    ),
    "dedup_fsdp_agreestep_over_dedup_ddp": (
        "occult train, FSDP2 agreeing once a step / DDP tokens/s per GPU, eager steps",
        {"nvlink": 0.95},
    ),
    "dedup_fsdp_captured_over_dedup_captured_explicit": (
        "occult train, FSDP2 / explicit sync tokens/s per GPU, both steps recorded",
        {"nvlink": 0.95},
    ),
}


def train_rows(name: str, doc: dict) -> list[list[str]]:
    """Issues 38 and 52: two_gpu_training.sh's ratios against their targets (scripts/train_report.py's table)."""
    rows, link = [], doc["link"]
    env = doc.get("env") if isinstance(doc.get("env"), dict) else {}
    where = f"{env.get('world_size') or 2} GPUs {link}"  # issue 52 asks 2 and 4 GPUs (GPUS=N)
    shape = train_shape(doc)
    where += f", {shape}" if shape else ""
    for issue, table in (("38", TRAIN_TARGETS), ("52", ISSUE52_TRAIN)):
        for key, (what, targets) in table.items():
            value, target = doc["ratios"].get(key), targets.get(link)
            if value is not None and target is not None:
                verdict = "met" if value >= target else "MISSED"
                label = f"{issue}: {what}, {where if issue == '52' else link}: >= {target}"
                rows.append([label, f"{value:.3f}", verdict, name])
    return rows


# two_gpu_training.sh's default size since it was written (be95537): what its runs before session 31 trained
SMALL_SHAPE = {"num_layers": 4, "hidden_size": 1024, "num_experts": 64, "expert_ffn_size": 512}


def train_shape(doc: dict) -> str | None:
    """The model a report's runs trained ("4 layers, hidden 2048, 64 experts x 1024": two_gpu_training.sh's
    SIZE=olmoe beside the default size): the one they all record, the script's default size where none records
    one (runs before session 31, when the script had one size), None where they record different ones."""
    variants = doc.get("variants", {}).values()
    shapes = {tuple(sorted(r["model"].items())) for r in variants if r.get("model")}
    if not shapes and variants:
        shapes = {tuple(sorted(SMALL_SHAPE.items()))}
    if len(shapes) != 1:
        return None
    m = dict(next(iter(shapes)))
    return f"{m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_experts']} experts x {m['expert_ffn_size']}"


def replace_rows(name: str, doc: dict) -> list[list[str]]:
    """Issue 38: one migration's share of the training time it serves."""
    share = float(doc["migration_share_of_training"])
    return [
        [
            f"38: one migration, amortised over --replace-every: <= {MIGRATION_SHARE:.0%}",
            f"{share:.2%}",
            "met" if share <= MIGRATION_SHARE else "MISSED",
            name,
        ]
    ]


def whole_model_rows(name: str, doc: dict) -> list[list[str]]:
    """An e2e.py report's rows: issue 36's, the open issues' (52, 53), then whether it fits an 80 GB card."""
    return e2e_rows(name, doc) + open_issue_rows(name, doc) + fit_rows(name, doc)


def fit_rows(name: str, doc: dict) -> list[list[str]]:
    """Every variant of an e2e.py report must fit an H100 (80 GB): the largest peak reserved memory of any variant
    that records it (`peak_reserved_gib`: allocated tensors and every cached block, a CUDA graph pool's free ones
    too), against `H100_GIB` (what the GPU suite caps each process at). The row names the phases the report ran
    ("prefill+train", "train x4"): a prefill-only job's peak never stands in for a training job's."""
    model, world, link, where = _whole_model_run(name, doc)
    peaks = {v: r["peak_reserved_gib"] for v, r in doc["variants"].items() if r.get("peak_reserved_gib") is not None}
    if not peaks:
        return []
    worst = max(peaks, key=peaks.get)
    phases = "+".join(phase_label(doc, p) for p in doc.get("config", {}).get("phases", ["prefill", "train"]))
    what = f"fit: whole model ({model}), {phases}, peak reserved per GPU, {_gpus(world)}"
    what += "" if world == 1 else f" {link}"
    cell = f"{peaks[worst]:.1f} GiB ({worst})"
    return [[f"{what}: <= {H100_GIB} GiB", cell, "met" if peaks[worst] <= H100_GIB else "MISSED", where]]


ROWS = {
    "e2e": whole_model_rows,
    "bench": bench_rows,
    "serve": serve_rows,
    "train": train_rows,
    "replace": replace_rows,
}
EXPECTED = [  # (target prefix, what measures it): listed as "not measured" when nothing matched
    ("52: whole model", "benchmarks/e2e.py --phases train on 2 and 4 GPUs, NVLink (olmoe, qwen3)"),
    ("52: one GPU", "benchmarks/e2e.py --variants native/compile,replicated/compile on 1 GPU"),
    ("52: TorchTitan", "benchmarks/e2e.py --model qwen3 ...,torchtitan,torchtitan+occult@device on 2 GPUs"),
    ("52: occult train", "scripts/two_gpu_training.sh OUT nvlink train"),
    ("53: whole model", "benchmarks/e2e.py on 4 GPUs, and NCCL_P2P_DISABLE=1 on 2 and 4 GPUs"),
    ("53: TorchTitan", "NCCL_P2P_DISABLE=1 benchmarks/e2e.py --model qwen3 ...,torchtitan on 2 GPUs"),
    ("36: whole model", "benchmarks/e2e.py (multi_gpu_runs.sh graph / e2e / e2e-slow)"),
    ("36: TorchTitan", "benchmarks/e2e.py --model qwen3 ...,torchtitan (multi_gpu_runs.sh graph)"),
    ("36: layer forward", "occult bench --world-size 2 --tokens 8192 (multi_gpu_runs.sh probe)"),
    ("36: host ms", "occult bench --world-size 2 --tokens 512"),
    ("37: EP decode step", "benchmarks/serve.py (multi_gpu_runs.sh serve / serve-slow)"),
    ("37: transformers' compiled generate", "benchmarks/serve.py (multi_gpu_runs.sh serve)"),
    ("38: EP dedup", "scripts/two_gpu_training.sh OUT 'nvlink slow' train"),
    ("38: 2-GPU", "scripts/two_gpu_training.sh OUT nvlink train"),
    ("38: one migration", "scripts/two_gpu_training.sh OUT nvlink more"),
]


def file_order(paths: Iterable[str]) -> dict[str, tuple]:
    """name -> (date, run, link), newest last: the run's date and link the file records (occult/tools/run_record.py),
    else the commit date (and `run`) in the nearest `provenance.json` at or above the files (docs/results/ has
    one: scripts/current_numbers.py --stamp), else the file's modification time."""
    order: dict[str, tuple] = {}
    for p in map(Path, paths):
        here = (p if p.is_dir() else p.parent).resolve()
        folder = next((d for d in (here, *here.parents) if (d / "provenance.json").is_file()), here)
        provenance = folder / "provenance.json"
        known = json.loads(provenance.read_text()) if provenance.is_file() else {}
        files = json_files(p) if p.is_dir() else [p]
        for f in files:
            name = str(f.relative_to(p)) if p.is_dir() else p.name
            entry = known.get(f.resolve().relative_to(folder).as_posix())
            mtime = datetime.fromtimestamp(f.stat().st_mtime, timezone.utc).isoformat()
            order[name] = (entry["date"], entry.get("run", 0), entry["link"]) if entry else (mtime, 0, "")
            try:
                doc = json.loads(f.read_text())
            except (OSError, ValueError):
                continue  # load_reports names an unreadable file
            own = own_record(doc) if isinstance(doc, dict) else None
            if own is not None:
                link = entry["link"] if entry else LINKS.get(own.get("link"), "")
                order[name] = (datetime.fromisoformat(own["date"]).astimezone(timezone.utc).isoformat(), 0, link)
    return order


def report(paths: Iterable[str]) -> str:
    """One row per target: the newest file's (never the best of several; merged files, holding ratios across
    jobs, are skipped). Two files of one date and run both stay."""
    paths = list(paths)
    reports = load_reports(paths)
    order, newest = file_order(paths), {}
    for name, doc in reports:
        k = kind(doc)
        if k is None or "sources" in doc:
            continue
        for row in ROWS[k](name, doc):
            when, link = order.get(name, ("", 0, ""))[:2], order.get(name, ("", 0, ""))[2]
            if k == "bench" and link not in ("", "-"):  # occult bench's JSON does not record the link
                row[0] = row[0].replace("): <=", f"), {link.lower()}: <=")
            kept = newest.get(row[0])
            if kept is None or kept[0] < when:
                newest[row[0]] = (when, [row])
            elif kept[0] == when:
                kept[1].append(row)
    rows = [r for _, (_, group) in sorted(newest.items()) for r in group]
    for prefix, how in EXPECTED:
        if not any(r[0].startswith(prefix) and not r[2].startswith("n/a") for r in rows):
            rows.append([prefix + " ...", "-", "not measured", how])
    lines = ["| target | measured | verdict | source |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="JSON files or directories holding them")
    p.add_argument("--md", default=None, help="also write the table to this Markdown file")
    args = p.parse_args(argv)
    try:
        table = report(args.paths)
    except FileNotFoundError as e:
        print(f"targets_report.py: error: {e}", file=sys.stderr)
        return 2
    print(table)
    if args.md:
        tmp = Path(args.md).with_suffix(".tmp")
        tmp.write_text(table + "\n")
        tmp.replace(args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
