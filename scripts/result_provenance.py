"""Where each result file in docs/results/ came from: provenance.json's entries (commit, date, card, link).

scripts/current_numbers.py orders results by these entries (newest figure per question) and `--stamp`s new
files from git history: the oldest commit whose version of the file is byte-identical to it now (followed
across renames), that commit's date, the card from the document (else the file name) and the link
(`slow` when the name says so or NCCL_P2P_DISABLE was set; `-` on one GPU).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def job_provenance(rel: str, doc: dict, provenance: dict[str, dict]) -> dict:
    """The provenance of a file, or of a folder's job (its files must agree on commit and link)."""
    files = doc.get("files", [rel]) if rel.endswith("/") else [rel]
    missing = [f for f in files if f not in provenance]
    if missing:
        raise SystemExit(f"current_numbers.py: error: {missing[0]}: not in provenance.json; run --stamp")
    entries = {json.dumps(provenance[f], sort_keys=True) for f in files}
    if len(entries) != 1:
        raise SystemExit(f"current_numbers.py: error: {rel}: its files' provenance entries differ")
    return provenance[files[0]]


def gpu_count_and_name(rel: str, doc: dict) -> tuple[int, str]:
    """(GPUs used, card name) from the document, else from the file name (`..._2xH200.json`)."""
    config, env = doc.get("config") or {}, doc.get("env") or {}
    world = env.get("world_size") or config.get("world") or max(config.get("worlds") or [0]) or 0
    name = env.get("gpu") or config.get("device") or (doc.get("peak") or {}).get("device") or ""
    m = re.search(r"(\d+)x(H\d00)", rel)
    world = int(world or (m.group(1) if m else 1))
    card = "H200" if "H200" in name else "H100" if "H100" in name else (m.group(2) if m else "?")
    return world, card


def first_commit_with_this_content(path: Path) -> tuple[str, str]:
    """(short hash, ISO date) of the oldest commit whose version of `path` (followed across renames) is
    byte-identical to the file now: when this result was added, even if it was renamed later."""
    blob = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=True).stdout
    log = subprocess.run(
        ["git", "log", "--follow", "--format=@%h %cI", "--name-only", "--", str(path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    found = None
    for entry in log.split("@")[1:]:  # newest first; keep going while the content is the same
        lines = [x for x in entry.splitlines() if x.strip()]
        (commit, date), old_path = lines[0].split(" "), lines[-1]
        shown = subprocess.run(["git", "rev-parse", f"{commit}:{old_path}"], capture_output=True, text=True, cwd=ROOT)
        if shown.stdout.strip() != blob.strip():
            break
        found = (commit, date)
    if found is None:
        raise SystemExit(f"current_numbers.py: error: {path}: not committed yet; commit it, then --stamp")
    return found


def provenance_from_git(results: Path, rel: str, doc: dict) -> dict:
    """One file's provenance entry: the commit that added its content and that commit's date (git), the card
    and link from the document (else its name)."""
    world, card = gpu_count_and_name(rel, doc)
    slow = "slow" in rel or str((doc.get("env") or {}).get("NCCL_P2P_DISABLE") or "0") not in ("0", "None")
    commit, date = first_commit_with_this_content(results / rel)
    link = "-" if world == 1 else "slow" if slow else "NVLink"
    return {"commit": commit, "date": date, "card": f"{world} x {card}", "link": link}


def stamp(results: Path, provenance_path: Path, jobs: Iterable[tuple[str, dict, str]]) -> int:
    """Add provenance entries from git for the result files of `jobs` (current_numbers.result_files) that
    have none."""
    provenance = json.loads(provenance_path.read_text()) if provenance_path.exists() else {}
    added = 0
    for rel, doc, _ in jobs:
        for one, one_doc in doc["runs"].items() if rel.endswith("/") else [(rel, doc)]:
            if one not in provenance:
                provenance[one] = provenance_from_git(results, one, one_doc)
                added += 1
    tmp = provenance_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(sorted(provenance.items())), indent=1) + "\n")
    tmp.replace(provenance_path)
    print(f"current_numbers.py: {added} entries added to {provenance_path}")
    return 0
