"""One page of current numbers: docs/results/CURRENT.md, generated from the result files under docs/results/.

    python scripts/current_numbers.py            # write docs/results/CURRENT.md
    python scripts/current_numbers.py --check    # exit 1 if CURRENT.md differs from what the files give
    python scripts/current_numbers.py --stamp    # add provenance.json entries for new result files (needs git)

Each result file answers some questions (one layer, whole-model prefill and training, decode, LM training,
Megatron-Core training, peers; per GPU count, link, shape, layers, batch). For every question the page shows
the figure of the NEWEST file that answers it, never the best of several: newest by the run's date that the
file records in its env block (occult/tools/run_record.py: the code's commit and the date, beside the card and
link), else by the date in docs/results/provenance.json (then its `run` number, for two jobs of one commit).
provenance.json records, per older file, the commit that added it, that commit's date, the card and the link;
`--stamp` fills it from git history for files that lack both (scripts/result_provenance.py). Both sides of
every ratio come from one job: one file, or one folder of one-variant training runs from one
scripts/two_gpu_training.sh call; files merged from several jobs (a `sources` key, benchmarks/serve_merge.py)
are not read. docs/results/history/ holds superseded files and is not read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _train_summary import RATIOS  # noqa: E402
from e2e_phases import phase_label  # noqa: E402
from result_provenance import SKIP_DIRS, job_provenance, stamp  # noqa: E402
from targets_report import SERVE_FLOORS, best_variant, phase_ms, step_ms, titan_pairs, train_shape  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGE, PROVENANCE = RESULTS / "CURRENT.md", RESULTS / "provenance.json"
LAYER_TOKENS, HOST_TOKENS = 8192, 512
REMOVED = ("@chunks",)  # variants of schedules no longer in the code (docs/overlap.md): not a current question


@dataclass(frozen=True)
class Figure:
    """One answer of one file: `key` names the question (the same key from two files: the same question)."""

    table: str
    key: tuple[str, ...]
    cells: tuple[str, ...]


TABLES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "layer": (
        f"One layer (`occult bench`), {LAYER_TOKENS} tokens per GPU, outputs checked against float32 first",
        ("GPUs", "link", "shape", "routing", "variant"),
        ("forward ms", "fwd+bwd ms", "forward / floor", "vs standard, fwd / fwd+bwd", "rows per token"),
    ),
    "host": (
        f"Host time of one layer forward (`occult bench`, {HOST_TOKENS} tokens per GPU)",
        ("GPUs", "link", "shape", "variant"),
        ("host ms per forward",),
    ),
    "peers": (
        "Peers, one layer side by side (`benchmarks/peers/run.py`: same weights and routing, outputs checked)",
        ("GPUs", "shape", "implementation"),
        ("fwd+bwd ms", "forward ms", "fwd+bwd / occult dedup's"),
    ),
    "ep": (
        "Whole models on several GPUs (`benchmarks/e2e.py`): occult's fastest expert-parallel variant / the "
        "fastest replicated floor (no expert traffic) of the same job (lower is better, 1.0 = the floor)",
        ("GPUs", "link", "model", "phase"),
        (
            "EP / floor",
            "fastest EP variant",
            "floor",
            "standard / fastest dedup",
            "host ms per MoE call (fastest EP)",
            "the same two back to back",
        ),
    ),
    "native": (
        "Whole models against plain transformers (`benchmarks/e2e.py`, `native`): transformers' time / occult's",
        ("GPUs", "link", "model", "phase"),
        (
            "both eager",
            "both compiled",
            "transformers eager / occult compiled",
            "transformers compiled / occult's fastest",
        ),
    ),
    "torchtitan": (
        "TorchTitan's own Qwen3-MoE (`benchmarks/e2e.py ...,torchtitan`, same weights): TorchTitan's time / occult's",
        ("GPUs", "link", "model", "phase"),
        ("TorchTitan / fastest occult",),
    ),
    "torchtitan_dispatcher": (
        "TorchTitan with occult's token dispatcher installed (`torchtitan+occult*`, same model and weights): "
        "TorchTitan's time / its time with occult's dispatcher",
        ("GPUs", "link", "model", "phase"),
        (
            "eager / eager",
            "compiled / compiled (`/compile`: blocks compiled)",
            "TorchTitan's fastest / recorded (`/stepgraph`: fwd+bwd one CUDA graph, which TorchTitan's own "
            "all-to-all cannot be)",
            "TorchTitan eager / fastest with occult's",
        ),
    ),
    "megatron": (
        "Megatron-Core with occult's token dispatcher (`benchmarks/megatron_train.py`): tokens/s per GPU, "
        "occult / Megatron's alltoall",
        ("GPUs", "link", "model", "layers", "micro-batches", "schedule"),
        ("expert module", "alltoall tokens/s/GPU", "occult tokens/s/GPU", "speed-up", "loss max rel. diff"),
    ),
    "decode": (
        "Decode steps on several GPUs (`benchmarks/serve.py`, `benchmarks/decode.py`): occult's fastest "
        "expert-parallel step / the replicated floor's step (p50)",
        ("GPUs", "link", "model", "batch per GPU"),
        ("EP step / floor",),
    ),
    "decode_native": (
        "Decode steps against transformers' own compiled `generate` (`benchmarks/serve.py`): its step / occult's",
        ("GPUs", "link", "model", "batch per GPU"),
        ("transformers compiled / occult",),
    ),
    "train": (
        "Training the small MoE LM (`occult train`, `scripts/two_gpu_training.sh`, `one_gpu_runs.sh layer_graphs`): "
        "tokens/s ratios",
        ("GPUs", "link", "model", "ratio"),
        ("value", "sides (tokens/s)"),
    ),
    "finetune": (
        "Fine-tuning a transformers model (`occult finetune --hf`), 2 GPUs against 1",
        ("GPUs", "link", "model"),
        ("steps/s, 2 GPUs / 1", "loss max rel. diff"),
    ),
}


def fmt_ratio(a: float, b: float, what_a: str = "", what_b: str = "") -> str:
    """`a / b` with both sides named: `1.09x (46.66 / 42.83)`."""
    names = f" ({what_a} {a:.2f} / {what_b} {b:.2f})" if what_a or what_b else f" ({a:.2f} / {b:.2f})"
    return f"{a / b:.2f}x" + names.replace("  ", " ").replace("( ", "(")


def result_kind(doc: dict) -> str | None:
    """Which tool wrote `doc` (by content); None for files this page does not read."""
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    if "sources" in doc:
        return None  # merged from several jobs: ratios across jobs
    if "ceilings" in doc and "runs" in doc:
        return "bench"
    if "variants" in doc and "env" in doc and "model" in config:
        return "e2e" if "phases" in config else "serve"
    if "args" in doc and "variants" in doc and "megatron_core" in (doc.get("env") or {}):
        return "megatron"
    if "runs" in doc and "peers" in config:
        return "peers"
    if "graphs_over_eager_tokens_per_s" in doc or "layer_graphs_over_eager_tokens_per_s" in doc:
        return "train_graphs"
    if "over_eager_tokens_per_s" in doc and "tokens_per_s_median" in doc:
        return "train_ab"
    if "ratios" in doc and "variants" in doc and "link" in doc:
        return "train"
    if "one_gpu" in doc and "two_gpus" in doc:
        return "finetune"
    if {"variant", "tokens_per_s", "link", "gpus"} <= set(doc) and doc.get("gpus") == 2:
        return "train_run"
    return None


def bench_figures(doc: dict, link: str) -> Iterator[Figure]:
    runs = [r for r in doc["runs"] if r.get("forward_ms") and not any(x in r["variant"] for x in REMOVED)]
    standard = {(r["shape"], r["routing"], r["tokens"]): r for r in runs if r["variant"] == "standard"}
    for r in runs:
        world, what = str(r["world"]), (r["shape"], r["routing"], r["variant"])
        if r["tokens"] == HOST_TOKENS and r.get("host_ms_fwd") is not None:
            yield Figure("host", (world, link, r["shape"], r["variant"]), (f"{r['host_ms_fwd']:.2f}",))
        if r["tokens"] != LAYER_TOKENS:
            continue
        floor = f"{r['forward_ms'] / r['floor_ms']:.2f}x" if r.get("floor_ms") and world != "1" else "-"
        std = standard.get((r["shape"], r["routing"], r["tokens"]))
        vs = "-"
        if std is not None and r is not std and r.get("fwd_bwd_ms") and std.get("fwd_bwd_ms"):
            vs = f"{std['forward_ms'] / r['forward_ms']:.2f}x / {std['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x faster"
        bwd = f"{r['fwd_bwd_ms']:.2f}" if r.get("fwd_bwd_ms") else "-"
        ct = f"{r['mean_ct']:.2f}" if r.get("mean_ct") is not None else "-"
        yield Figure("layer", (world, link, *what), (f"{r['forward_ms']:.2f}", bwd, floor, vs, ct))


def e2e_figures(doc: dict, link: str) -> Iterator[Figure]:
    model, world = doc["config"]["model"], str(doc["env"].get("world_size"))
    for phase in doc["config"].get("phases", ()):
        timed = {v: ms for v, ms in phase_ms(doc, phase).items() if not any(x in v for x in REMOVED)}
        key = (world, link, model, phase_label(doc, phase))
        floor, best = best_variant(timed, "replicated"), best_variant(timed, "dedup")
        if world != "1" and floor and best:
            std = fmt_ratio(timed["standard"], best[1]) if "standard" in timed else "-"
            host = doc["variants"][best[0]]["phases"][phase].get("host_ms_per_moe_call")  # (none before session 21)
            cells = (
                f"{best[1] / floor[1]:.3f}x",
                f"{best[0]} {best[1]:.2f} ms",
                f"{floor[0]} {floor[1]:.2f} ms",
                std,
                "-" if host is None else f"{host:.3f}",
                back_to_back_ratio(doc, phase, best[0], floor[0]),
            )
            yield Figure("ep", key, cells)
        eager = "native" in timed and "replicated" in timed
        both_compiled = "native/compile" in timed and "replicated/compile" in timed
        if eager or "native/compile" in timed:  # (a job of native/compile and a recorded step alone: the last cell)
            compiled = eager_over_compiled = "-"
            if both_compiled:
                compiled = fmt_ratio(timed["native/compile"], timed["replicated/compile"])
            if "native" in timed and "replicated/compile" in timed:
                eager_over_compiled = fmt_ratio(timed["native"], timed["replicated/compile"])
            plain = fmt_ratio(timed["native"], timed["replicated"]) if eager else "-"
            yield Figure("native", key, (plain, compiled, eager_over_compiled, fastest_one_rank(doc, timed, phase)))
        ours = best or (floor if world == "1" else None)
        if (tt := timed.get("torchtitan")) and ours:
            yield Figure("torchtitan", key, (fmt_ratio(tt, ours[1], "", ours[0]),))
        if cells := titan_dispatcher_cells(timed):
            yield Figure("torchtitan_dispatcher", key, cells)


def back_to_back_ratio(doc: dict, phase: str, mine: str, floor: str) -> str:
    """`mine` over `floor` timed back to back (e2e.py since session 47: the steps issued one after another, the
    host's issue hidden where it keeps ahead), "-" in files without it."""
    steady = [doc["variants"][v]["phases"][phase].get("ms_back_to_back_median") for v in (mine, floor)]
    return f"{steady[0] / steady[1]:.3f}x ({steady[0]:.2f} / {steady[1]:.2f} ms)" if all(steady) else "-"


def titan_dispatcher_cells(timed: dict[str, float]) -> tuple[str, ...] | None:
    """TorchTitan over TorchTitan with occult's dispatcher: eager over the fastest eager `torchtitan+occult*`,
    compiled over the fastest compiled one, TorchTitan's fastest over the fastest recorded one
    (targets_report.titan_pairs), eager over the fastest of all (each side named); None without both."""
    fastest = best_variant(timed, "torchtitan+occult")
    if fastest is None or not any(v in timed for v in ("torchtitan", "torchtitan/compile")):
        return None
    pairs = {how: fmt_ratio(peer_ms, mine[1], "", mine[0]) for how, peer_ms, mine in titan_pairs(timed)}
    overall = fmt_ratio(timed["torchtitan"], fastest[1], "", fastest[0]) if "torchtitan" in timed else "-"
    return pairs.get("eager", "-"), pairs.get("compiled", "-"), pairs.get("recorded", "-"), overall


def fastest_one_rank(doc: dict, timed: dict[str, float], phase: str) -> str:
    """transformers compiled / occult's fastest compiled one-rank variant (e.g. `/stepgraph`), named (and the same
    two timed back to back, where the file has them), with the optimizer and loss each side took where the file
    records them (e2e.py --optimizer adamw: occult's AdamW for occult's variants since session 22; --loss occult:
    occult's cross-entropy since session 43); "-" without both."""
    compiled = {v: ms for v, ms in timed.items() if v.startswith("replicated/compile")}
    if "native/compile" not in timed or not compiled:
        return "-"
    name, ms = min(compiled.items(), key=lambda kv: kv[1])
    cell = fmt_ratio(timed["native/compile"], ms, "", name)
    sides = []
    for v in ("native/compile", name):
        parts = [doc["variants"][v]["phases"][phase].get("optimizer"), doc["variants"][v].get("loss")]
        sides.append(" + ".join(p for p in parts if p))
    steady = [doc["variants"][v]["phases"][phase].get("ms_back_to_back_median") for v in ("native/compile", name)]
    if all(steady):  # (e2e.py since session 47: the steps also issued back to back)
        cell += f", back to back {fmt_ratio(*steady)}"
    return cell + (f", {sides[0]} / {sides[1]}" if all(sides) else "")


def megatron_figures(doc: dict, link: str) -> Iterator[Figure]:
    """One megatron_train.py job, both sides from this file: occult's dedup dispatcher against Megatron's alltoall
    with the same experts (plain steps; `+overlap`: Megatron's combined-1F1B all-to-all overlap; `+grouped`: both
    on occult's grouped experts), and occult's fastest variant against Megatron's `alltoall` with its own experts
    (what a Megatron user without Transformer Engine runs today) and, where Megatron's own overlap is faster,
    against that too."""
    runs, env, args = doc["variants"], doc["env"], doc["args"]
    pairs = [
        (f"occult{g}{o}", f"alltoall{g}{o}", (g + o).strip("+") or "plain")
        for g in ("", "+grouped")
        for o in ("", "+overlap")
    ]
    mine = [n for n in runs if n.startswith("occult") and "placement" not in n and "standard" not in n]
    own = [n for n in runs if n.startswith("alltoall") and "+grouped" not in n]  # Megatron's experts, with or without
    if own and any("+grouped" in n for n in mine):  # its overlap
        best = min(mine, key=lambda n: runs[n]["step_ms_median"])
        best_own = min(own, key=lambda n: runs[n]["step_ms_median"])
        if "alltoall" in runs:  # the question: against Megatron's alltoall as it ships
            pairs.append((best, "alltoall", f"fastest occult ({best}) / Megatron's alltoall"))
        if best_own != "alltoall":  # and against the fastest Megatron runs on its own experts
            pairs.append((best, best_own, f"fastest occult ({best}) / Megatron's fastest own ({best_own})"))
    for ours_name, theirs_name, schedule in pairs:
        ours, theirs = runs.get(ours_name), runs.get(theirs_name)
        if not ours or not theirs:
            continue
        modules = dict.fromkeys((theirs["expert_module"], ours["expert_module"]))  # one name where both agree
        module = " / ".join(modules) + (" (Transformer Engine)" if env.get("transformer_engine") else " (no TE)")
        gap = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
        a, b = ours["tokens_per_s_per_gpu"], theirs["tokens_per_s_per_gpu"]
        cells = (module, f"{b:,.0f}", f"{a:,.0f}", f"{a / b:.2f}x", f"{gap:.1e}")
        micro = str(args.get("micro_batches", 1))
        yield Figure(
            "megatron", (str(env.get("world_size")), link, args["model"], str(args["layers"]), micro, schedule), cells
        )


def serve_figures(doc: dict, link: str) -> Iterator[Figure]:
    model, world = doc["config"]["model"], str(doc["env"].get("world_size"))
    batches = doc["config"].get("batch") or []
    for batch in batches if isinstance(batches, list) else [batches]:
        timed = step_ms(doc, int(batch))
        floor = next(((f, timed[f]) for f in SERVE_FLOORS if f in timed), None)
        ours = [(n, ms) for n, ms in timed.items() if not n.startswith(("replicated", "native", "hf-ep"))]
        best = min(ours, key=lambda x: x[1]) if ours else None
        native = timed.get("native-generate+compile")
        key = (world, link, model, str(batch))
        if best and floor and world != "1":
            yield Figure("decode", key, (fmt_ratio(best[1], floor[1], best[0], floor[0]),))
        if best and native:
            yield Figure("decode_native", key, (fmt_ratio(native, best[1], "", best[0]),))


def peers_figures(doc: dict, link: str) -> Iterator[Figure]:
    ok = [r for r in doc["runs"] if r.get("status") == "ok" and r.get("fwd_bwd_ms")]
    ours = {(r["world"], r["shape"]): r for r in ok if r["peer"] == "occult-dedup"}
    for r in ok:
        ref = ours.get((r["world"], r["shape"]))
        vs = f"{r['fwd_bwd_ms'] / ref['fwd_bwd_ms']:.2f}x" if ref else "-"
        cells = (f"{r['fwd_bwd_ms']:.2f}", f"{r['forward_ms']:.2f}", vs)
        yield Figure("peers", (str(r["world"]), r["shape"], r.get("name") or r["peer"]), cells)


# the ratios of train_{link}_{G}xGPU.json the page shows: _train_summary.py's table (key -> numerator variant,
# denominator variant, per GPU), less the ones no target asks for
UNSHOWN_TRAIN_RATIOS = (
    "two_gpu_floor_over_one_gpu_job",
    "dedup_captured_step_over_dedup",
    "dedup_captured_step_over_floor_per_gpu",
)
TRAIN_RATIOS = {
    key: (a, b, field == "tokens_per_s_per_gpu")
    for key, (a, b, field) in RATIOS.items()
    if key not in UNSHOWN_TRAIN_RATIOS
}


def train_world(doc: dict) -> str:
    """How many GPUs a two_gpu_training.sh report's multi-GPU runs had (2 where it predates the record)."""
    env = doc.get("env") if isinstance(doc.get("env"), dict) else {}
    return str(env.get("world_size") or 2)


def train_model(doc: dict) -> str:
    """The model a report's runs trained (`targets_report.train_shape`; "-": runs that record none)."""
    return train_shape(doc) or "-"


def train_figures(doc: dict, link: str) -> Iterator[Figure]:
    variants = doc["variants"]
    world, model = train_world(doc), train_model(doc)
    for name, (a, b, per_gpu) in TRAIN_RATIOS.items():
        value = doc["ratios"].get(name)
        if value is None or a not in variants or b not in variants:
            continue
        col = "tokens_per_s_per_gpu" if per_gpu else "tokens_per_s"
        sides = f"{a} {variants[a][col]:,.0f} / {b} {variants[b][col]:,.0f}"
        yield Figure("train", (world, link, model, name.replace("_", " ")), (f"{value:.3f}x", sides))
    value = doc["ratios"].get("best_dedup_over_best_floor_per_gpu")
    if value is not None:  # issue 52: the fastest EP dedup mode over the fastest floor, tokens/s per GPU
        a, b = (
            max((v for v in variants if v.startswith(p)), key=lambda v: variants[v]["tokens_per_s_per_gpu"])
            for p in ("dedup", "floor")
        )
        sides = f"{a} {variants[a]['tokens_per_s_per_gpu']:,.0f} / {b} {variants[b]['tokens_per_s_per_gpu']:,.0f}"
        yield Figure("train", (world, link, model, "best dedup over best floor per gpu"), (f"{value:.3f}x", sides))


def train_job_figures(doc: dict, link: str) -> Iterator[Figure]:
    """One two_gpu_training.sh call's runs: the device transport (`auto` on NCCL GPUs) over the count exchange."""
    runs = doc["variants"]
    if "dedup_ddp" in runs and "dedup_counts_ddp" in runs:
        a, b = runs["dedup_ddp"]["tokens_per_s"], runs["dedup_counts_ddp"]["tokens_per_s"]
        sides = f"dedup_ddp (auto: device transport) {a:,.0f} / dedup_counts_ddp {b:,.0f}"
        world, model = str(runs["dedup_ddp"].get("gpus") or 2), train_model(doc)
        what = "dedup device transport over count exchange"
        yield Figure("train", (world, link, model, what), (f"{a / b:.3f}x", sides))


def train_graphs_figures(doc: dict, link: str) -> Iterator[Figure]:
    """`occult train --layer-graphs` over the eager layers, one GPU, one job (`scripts/_train_summary.py graphs`, or
    runs alternated: `runs`)."""
    if "runs" in doc:
        mine = [r["tokens_per_s"] for r in doc["runs"] if r["mode"] == "layer_graphs"]
        eager = [r["tokens_per_s"] for r in doc["runs"] if r["mode"] == "eager"]
        value = doc["layer_graphs_over_eager_tokens_per_s"]
    else:
        mine, eager = [doc["variants"]["graphs"]["tokens_per_s"]], [doc["variants"]["eager"]["tokens_per_s"]]
        value = doc["graphs_over_eager_tokens_per_s"]
    sides = f"--layer-graphs {' / '.join(f'{t:,.0f}' for t in mine)}; eager {' / '.join(f'{t:,.0f}' for t in eager)}"
    yield Figure("train", ("1", link, "-", "occult train --layer-graphs over eager layers"), (f"{value:.3f}x", sides))


AB_MODES = {
    "captured": "occult train --captured-step over eager steps",
    "graphs": "occult train --layer-graphs over eager layers",
}


def train_ab_figures(doc: dict, link: str) -> Iterator[Figure]:
    """`occult train` modes over eager steps, one GPU, runs alternated in one job (`scripts/_train_summary.py ab`):
    each mode's median tokens/s over eager's."""
    runs = doc["variants"]
    eager = [r["tokens_per_s"] for n, r in runs.items() if n.startswith("eager")]
    for mode, name in AB_MODES.items():
        if mode not in doc["over_eager_tokens_per_s"]:
            continue
        mine = [r["tokens_per_s"] for n, r in runs.items() if n.rsplit("_", 1)[0] == mode]
        sides = f"{' / '.join(f'{t:,.0f}' for t in mine)}; eager {' / '.join(f'{t:,.0f}' for t in eager)}"
        yield Figure(
            "train", ("1", link, train_model(doc), name), (f"{doc['over_eager_tokens_per_s'][mode]:.3f}x", sides)
        )


def finetune_figures(doc: dict, link: str) -> Iterator[Figure]:
    cells = (f"{doc['speedup_steps_per_s']:.2f}x", f"{doc['loss_max_rel_diff']:.4f}")
    yield Figure("finetune", ("2", link, "tiny transformers MoE"), cells)


FIGURES: dict[str, Callable[[dict, str], Iterator[Figure]]] = {
    "bench": bench_figures,
    "e2e": e2e_figures,
    "serve": serve_figures,
    "megatron": megatron_figures,
    "peers": peers_figures,
    "train": train_figures,
    "finetune": finetune_figures,
    "train_job": train_job_figures,
    "train_graphs": train_graphs_figures,
    "train_ab": train_ab_figures,
}


def result_files(results: Path) -> Iterator[tuple[str, dict, str]]:
    """(path below `results`, document, kind) of every result file this page reads, in path order. The
    one-variant files of one `scripts/two_gpu_training.sh` call (a folder of them) are one job: one entry,
    the folder's path with a trailing slash."""
    runs: dict[str, dict[str, dict]] = {}
    for f in sorted(results.rglob("*.json")):
        rel = f.relative_to(results).as_posix()
        if rel.split("/")[0] in SKIP_DIRS or f == results / PROVENANCE.name:
            continue
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"current_numbers.py: error: {rel}: not JSON ({e})") from None
        kind = result_kind(doc) if isinstance(doc, dict) else None
        if kind == "train_run":
            runs.setdefault(rel.rsplit("/", 1)[0] + "/", {})[rel] = doc
        elif kind is not None:
            yield rel, doc, kind
    for folder, docs in runs.items():
        links = {d["link"] for d in docs.values()}
        job = {"link": links.pop() if len(links) == 1 else "?", "files": sorted(docs), "runs": docs}
        yield folder, {**job, "variants": {d["variant"]: d for d in docs.values()}}, "train_job"


def newest_figures(results: Path, provenance: dict[str, dict]) -> dict[tuple[str, tuple[str, ...]], tuple]:
    """(table, key) -> (figure, path, provenance, (date, run)) of the newest file answering it. Two files of the same
    date and run answering one question differently is an error: give one of them a `run` number."""
    chosen: dict[tuple[str, tuple[str, ...]], tuple] = {}
    for rel, doc, kind in result_files(results):
        prov = {**job_provenance(rel, doc, provenance), "settings": ran_under(doc)}
        order = (datetime.fromisoformat(prov["date"]), prov.get("run", 0))
        for fig in FIGURES[kind](doc, prov["link"]):
            slot = (fig.table, fig.key)
            old = chosen.get(slot)
            if old is not None and old[3] == order and old[0].cells != fig.cells:
                raise SystemExit(f"current_numbers.py: error: {old[1]} and {rel} tie on {slot}; set a `run` number")
            if old is None or old[3] < order:
                chosen[slot] = (fig, rel, prov, order)
    return chosen


# NCCL variables every GPU run sets, the image sets (its version) or the link column already says: not a tuning
NCCL_EXPECTED = {"NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_VERSION"}
CUDA_INSTALL = {"CUDA_HOME", "CUDA_PATH", "CUDA_VERSION"}  # where the toolkit is, not how the driver runs


def ran_under(doc: dict) -> str:
    """The settings a result file records as changed from their defaults (`env.settings`, occult/tools/run_record.py)
    and any NCCL or CUDA driver tuning it ran under (`env.nccl`, less `NCCL_EXPECTED`; `env.cuda`, less
    `CUDA_INSTALL`), as `NAME=value, ...`; "" where none (or where the file predates the record)."""
    env = doc.get("env") if isinstance(doc.get("env"), dict) else {}
    changed = dict(env.get("settings")) if isinstance(env.get("settings"), dict) else {}
    nccl = env.get("nccl") if isinstance(env.get("nccl"), dict) else {}
    changed.update({name: value for name, value in nccl.items() if name not in NCCL_EXPECTED})
    cuda = env.get("cuda") if isinstance(env.get("cuda"), dict) else {}
    changed.update({name: value for name, value in cuda.items() if name not in CUDA_INSTALL})
    return ", ".join(f"{name}={value}" for name, value in sorted(changed.items()))


def natural(key: tuple[str, ...]) -> tuple:
    """Sort numbers as numbers (batch 8 before 64)."""
    return tuple((0, int(k), "") if k.isdigit() else (1, 0, k) for k in key)


def render(results: Path = RESULTS, provenance_path: Path = PROVENANCE) -> str:
    """The page's Markdown: one table per question group, rows in key order."""
    provenance = json.loads(provenance_path.read_text())
    chosen = newest_figures(results, provenance)
    out = [
        "# Current numbers",
        "",
        "Generated by `python scripts/current_numbers.py` from the result files in this folder; do not edit "
        "(`--check` fails when this page is stale; tests/tools/test_current_numbers.py runs it). For each "
        "question, the figure of the newest file that answers it (never the best of several runs). Both "
        "sides of every ratio come from one job (one file). `commit`: the commit of the code that ran where "
        "the file records it (`-dirty`: with uncommitted changes), else the commit that added the file (the "
        "code measured is that commit's or its parent's); `date`: the run's (UTC) where recorded, else that "
        "commit's; `link`: NVLink, or "
        "`slow` (`NCCL_P2P_DISABLE=1`: traffic through the host); `source`: the file, and the settings it ran under "
        "where it records them changed from their defaults (docs/settings.md). A ratio whose sides only different jobs "
        "measured is not listed (e.g. OLMoE decode at B=256 on NVLink: benchmarks/serve_merge.py's merged "
        "files hold those, marked by source). Older measurements: "
        "[../history.md](../history.md); how to run each benchmark: [../benchmarks.md](../benchmarks.md).",
    ]
    for table, (title, key_cols, cell_cols) in TABLES.items():
        rows = sorted(((slot[1], v) for slot, v in chosen.items() if slot[0] == table), key=lambda r: natural(r[0]))
        if not rows:
            continue
        cols = (*key_cols, *cell_cols, "card", "commit", "date", "source")
        out += ["", f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for key, (fig, rel, prov, _) in rows:
            src = f"[{rel}]({rel})" + (f" (under {prov['settings']})" if prov.get("settings") else "")
            cells = (*key, *fig.cells, prov["card"], f"`{prov['commit']}`", prov["date"][:10], src)
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the page differs from what the files give")
    mode.add_argument("--stamp", action="store_true", help="add provenance entries for new result files (git)")
    p.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default docs/results)")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        p.error(f"--results {args.results}: not a directory")
    page, provenance = args.results / PAGE.name, args.results / PROVENANCE.name
    if args.stamp:
        return stamp(args.results, provenance, result_files(args.results))
    if not provenance.is_file():
        p.error(f"--results {args.results}: no {PROVENANCE.name}; run --stamp first")
    text = render(args.results, provenance)
    if args.check:
        if not page.is_file() or page.read_text() != text:
            print(f"current_numbers.py: {page} is stale: run python scripts/current_numbers.py", file=sys.stderr)
            return 1
        return 0
    tmp = page.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(page)
    print(f"current_numbers.py: wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
