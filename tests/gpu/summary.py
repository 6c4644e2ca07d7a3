"""Summarise a GPU-suite run: versions, then every case with its outcome on every rank (Markdown).

Usage: python tests/gpu/summary.py OUT   (reads OUT/rank*.xml, OUT/single.xml, OUT/single3.xml, OUT/olmoe_scale_*.json;
where a stage was cut before pytest wrote its report, OUT/progress-*.tsv; writes OUT/summary.md and prints it)

The versions are probed once and kept in OUT/versions.txt (run.sh writes a partial summary after
stage 1), so a summary made later, or on another machine from a copy of OUT, names the GPU run's.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import sys
import xml.etree.ElementTree as ET


def _versions() -> list[str]:
    lines = [f"python {platform.python_version()}"]
    try:
        import torch

        lines.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
            lines.append(f"{torch.cuda.device_count()} x {', '.join(names)}")
            lines.append("NCCL " + ".".join(str(v) for v in torch.cuda.nccl.version()))
    except Exception as exc:  # the summary must never fail the run
        lines.append(f"torch: {exc}")
    for mod in ("triton", "transformers"):
        try:
            lines.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            lines.append(f"{mod} not installed")
    try:  # (test_collective_megatron.py skips without it)
        from megatron.core import package_info

        lines.append(f"megatron-core {package_info.__version__}")
    except Exception:
        lines.append("megatron-core not installed")
    lines.append(
        "collectives: "
        + (
            "gloo (CPU)"
            if os.environ.get("OCCULT_GPU_SUITE_ON_CPU") == "1"
            else os.environ.get("OCCULT_GPU_SUITE_BACKEND", "nccl")
        )
    )
    for var in ("NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE", "OCCULT_GPU_SUITE_NPROC", "OCCULT_GPU_SUITE_MEMORY_GIB"):
        if os.environ.get(var):
            lines.append(f"{var}={os.environ[var]}")
    return lines


def _outcomes(path: str) -> dict[str, tuple[str, float]]:
    """test id -> (passed / failed / error / skipped, seconds)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                state = "FAILED" if child.tag == "failure" else "ERROR"
            elif child.tag == "skipped" and state == "passed":
                state = "skipped"
        out[name] = (state, float(case.get("time", 0.0)))
    return out


def _progress(path: str) -> dict[str, tuple[str, float]]:
    """The same from OUT/progress-*.tsv (conftest.py appends a line per finished case): a stage cut
    before pytest wrote its JUnit report."""
    out = {}
    with open(path) as f:
        for line in f:
            nodeid, state, secs = line.rstrip("\n").split("\t")
            module, _, test = nodeid.partition("::")
            out[f"{os.path.basename(module).removesuffix('.py')}::{test}"] = (state, float(secs))
    return out


def _stage(out: str, report: str, progress: str) -> tuple[dict[str, tuple[str, float]], bool] | None:
    """(outcomes, cut) of one pytest process: its JUnit report, else its progress file (cut: True)."""
    if os.path.exists(report):
        return _outcomes(report), False
    if os.path.exists(progress):
        return _progress(progress), True
    return None


def _rank_indices(out: str) -> list[int]:
    found = glob.glob(os.path.join(out, "rank*.xml")) + glob.glob(os.path.join(out, "progress-rank*.tsv"))
    return sorted({int(re.findall(r"\d+", os.path.basename(p))[0]) for p in found})


def _kept_versions(out: str) -> list[str]:
    """OUT/versions.txt's lines, probing (and writing) them first if the file is not there."""
    path = os.path.join(out, "versions.txt")
    if os.path.exists(path):
        with open(path) as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    lines = _versions()
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)
    return lines


def _single_stage(
    stage: int, suffix: str, single: tuple[dict[str, tuple[str, float]], bool], counts: dict[str, int]
) -> list[str]:
    """One single-process stage's table (and its counts added to `counts`)."""
    cut = f" (cut before its end: the cases that finished, from progress-single{suffix}.tsv)" if single[1] else ""
    lines = [f"## Stage {stage}: single-process GPU tests{cut}", "", "| case | result | s |", "|---|---|---|"]
    for name, (state, secs) in sorted(single[0].items()):
        if state == "skipped":
            continue
        counts["passed" if state == "passed" else "failed"] += 1
        lines.append(f"| `{name}` | {state} | {secs:.1f} |")
    return [*lines, ""]


def main(out: str) -> int:
    lines = ["# GPU suite run", "", "- " + "\n- ".join(_kept_versions(out)), ""]
    stages = [
        _stage(out, os.path.join(out, f"rank{r}.xml"), os.path.join(out, f"progress-rank{r}.tsv"))
        for r in _rank_indices(out)
    ]
    per_rank = [s[0] for s in stages if s is not None]
    collective = sorted({n for r in per_rank for n, (s, _) in r.items() if s != "skipped"})
    counts = {"passed": 0, "failed": 0}
    if per_rank:
        cut = (
            " (cut before its end: the cases that finished, from progress-rank*.tsv)"
            if any(s is not None and s[1] for s in stages)
            else ""
        )
        lines += [
            f"## Stage 1: collective tests, {len(per_rank)} ranks{cut}",
            "",
            "| case | " + " | ".join(f"rank {i}" for i in range(len(per_rank))) + " | s (rank 0) |",
            "|---|" + "---|" * len(per_rank) + "---|",
        ]
        for name in collective:
            states = [r.get(name, ("missing", 0.0))[0] for r in per_rank]
            ok = all(s == "passed" for s in states)
            counts["passed" if ok else "failed"] += 1
            lines.append(f"| `{name}` | " + " | ".join(states) + f" | {per_rank[0].get(name, ('', 0.0))[1]:.1f} |")
        lines.append("")
    for stage, suffix in ((2, ""), (3, "3")):
        single = _stage(
            out, os.path.join(out, f"single{suffix}.xml"), os.path.join(out, f"progress-single{suffix}.tsv")
        )
        if single is not None:
            lines += _single_stage(stage, suffix, single, counts)
    for path in sorted(glob.glob(os.path.join(out, "olmoe_scale_*.json"))):
        with open(path) as f:
            res = json.load(f)
        lines.append(
            f"- OLMoE-1B-7B shape, bf16, {res.pop('dispatcher')}: "
            + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items())
        )
    lines += ["", f"{counts['passed']} passed, {counts['failed']} failed"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md.tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(out, "summary.md.tmp"), os.path.join(out, "summary.md"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu-suite-results"))
