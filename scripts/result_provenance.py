"""Where each result file in docs/results/ came from: its own record, else provenance.json's entry (commit,
date, card, link).

A file written since the benchmarks record it (occult/tools/run_record.py) names the commit of the code that
ran and the run's date in its env block (`occult bench`: its config): those win. For older files
scripts/current_numbers.py reads provenance.json and `--stamp`s new files from git history: the oldest commit
whose version of the file is byte-identical to it now (followed across renames), that commit's date, the card
from the document (else the file name) and the link (`slow` when the name says so or NCCL_P2P_DISABLE was
set; `-` on one GPU).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = ("history", "quality_gpu_1xH200")  # folders of superseded results: no page or report reads them
LINKS = {"nvlink": "NVLink", "pcie-or-slow: NCCL_P2P_DISABLE=1": "slow", "single-gpu": "-", "cpu": "-"}


def own_record(doc: dict) -> dict | None:
    """The commit and date a document records itself (its env block; `occult bench`'s config), or None
    (a file from before the benchmarks recorded them, or without a commit or a dated UTC time)."""
    for block in (doc.get("env"), doc.get("config")):
        if isinstance(block, dict) and block.get("commit") and block.get("date"):
            try:
                if datetime.fromisoformat(block["date"]).utcoffset() is None:
                    return None
            except (TypeError, ValueError):
                return None
            return block
    return None


def recorded_provenance(rel: str, doc: dict, entry: dict | None) -> dict | None:
    """A provenance entry from the document's own record: its commit (`-dirty` where the tree had
    uncommitted changes) and date; card and link from provenance.json's `entry` where there is one, else from
    the document. None without an own record. A folder's job (one-variant training runs) needs one for every
    file, all of one commit; its date is the newest."""
    records = [own_record(d) for d in doc["runs"].values()] if rel.endswith("/") else [own_record(doc)]
    if not records or None in records or len({r["commit"] for r in records}) != 1:
        return None
    newest = max(records, key=lambda r: datetime.fromisoformat(r["date"]))
    commit = newest["commit"][:7] + ("-dirty" if any(r.get("dirty") for r in records) else "")
    if entry is None:  # the card and link of the job's widest run (a folder may hold a one-GPU reference)
        one = max(doc["runs"].values(), key=lambda d: d.get("gpus") or 0) if rel.endswith("/") else doc
        world, card = gpu_count_and_name(rel, one)
        entry = {"card": f"{world} x {card}", "link": LINKS.get(own_record(one).get("link"), "?")}
    return {**entry, "commit": commit, "date": newest["date"]}


def job_provenance(rel: str, doc: dict, provenance: dict[str, dict]) -> dict:
    """The provenance of a file, or of a folder's job (its files must agree on commit and link): the
    document's own record where it has one (`recorded_provenance`), else provenance.json's."""
    files = doc.get("files", [rel]) if rel.endswith("/") else [rel]
    own = recorded_provenance(rel, doc, provenance.get(files[0]))
    if own is not None:
        return own
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
    world = env.get("world_size") or config.get("world") or max(config.get("worlds") or [0]) or doc.get("gpus") or 0
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
        if recorded_provenance(rel, doc, None) is not None:
            continue  # the file says itself
        for one, one_doc in doc["runs"].items() if rel.endswith("/") else [(rel, doc)]:
            if one not in provenance:
                provenance[one] = provenance_from_git(results, one, one_doc)
                added += 1
    tmp = provenance_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(sorted(provenance.items())), indent=1) + "\n")
    tmp.replace(provenance_path)
    print(f"current_numbers.py: {added} entries added to {provenance_path}")
    return 0
