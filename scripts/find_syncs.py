"""List every device-to-host synchronisation in one MoE forward (+ backward), with where it happens.

A synchronisation drains the GPU queue: the host waits, then every launch after it is exposed
until a long kernel lets the host get ahead again. The layer is meant to have exactly one per
forward (the count exchange); sync-free dispatch none. This runs CUDA's sync debug mode over
`OccultMoE` (both dispatchers, sync-free or not) and a converted transformers model of every
family (tiny shapes), and prints each synchronising call site inside occult or transformers.

    python scripts/find_syncs.py          (GPU)
"""

from __future__ import annotations

import collections
import traceback
import warnings

import torch

from occult.moe.layer import OccultMoE


def syncs_in(fn) -> collections.Counter:
    """Call fn under sync debug mode; count (file:line function) of the innermost project frame."""
    sites: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return original(message, category, filename, lineno, file, line)
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if ("occult" in f.filename or "transformers" in f.filename) and "find_syncs" not in f.filename
        ]
        where = frames[-1] if frames else None
        sites[
            f"{where.filename.split('site-packages/')[-1]}:{where.lineno} {where.name}: {where.line}" if where else "?"
        ] += 1

    torch.cuda.synchronize()
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = original
    return sites


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("find_syncs.py needs a GPU")
    dev = torch.device("cuda")
    report = {}
    for dispatcher in ("standard", "dedup"):
        for sync_free in (False, True):
            layer = OccultMoE(
                256, 128, 16, 4, dispatcher=dispatcher, sync_free=sync_free, dtype=torch.bfloat16, device=dev
            )
            x = torch.randn(512, 256, device=dev, dtype=torch.bfloat16)
            layer(x)  # warm-up (Triton compiles)
            layer(x.requires_grad_()).float().sum().backward()
            name = f"{dispatcher}{' sync_free' if sync_free else ''}"
            with torch.no_grad():
                report[f"{name} forward"] = syncs_in(lambda: layer(x))
            report[f"{name} fwd+bwd"] = syncs_in(lambda: layer(x).float().sum().backward())
    try:
        from occult.integrations import hf
        from occult.integrations.hf.families import FAMILIES
        from occult.integrations.hf.tiny import tiny_random_model

        for family in FAMILIES:
            model = hf.convert(tiny_random_model(family).to(dev, torch.bfloat16))
            ids = torch.randint(3, 90, (4, 64), device=dev)
            model(ids)
            with torch.no_grad():
                report[f"hf {family} forward"] = syncs_in(lambda: model(ids))
            report[f"hf {family} fwd+bwd"] = syncs_in(lambda: model(ids, labels=ids).loss.backward())
    except Exception as exc:  # transformers missing or a family not in this version
        print(f"(transformers models skipped: {type(exc).__name__}: {exc})")
    print(f"{'case':<40}{'syncs':>6}  where")
    for name, sites in report.items():
        print(f"{name:<40}{sum(sites.values()):>6}")
        for site, n in sites.most_common():
            print(f"{'':<40}{n:>6}  {site[:150]}")


if __name__ == "__main__":
    main()
