"""Does a decode step capture in a CUDA graph? Prints the full traceback where it does not.

    python scripts/capture_check.py            (one GPU, single rank: no collectives involved)

Needs a CUDA GPU: without one it says so and exits with status 2 (`--help` works anywhere).

Checks, each on its own: a sync-free `OccultMoE` layer; a tiny transformers OLMoE model,
unconverted; the same converted (one rank) with `set_sync_free`; and the converted model with
explicit position ids and cache positions (in case the model builds them on the host).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def capture(name: str, step, *inputs) -> None:
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(3):
                step(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = step(*inputs)
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            ref = step(*inputs)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"[ok]   {name}: captured, replay vs eager rel err {err:.2e}")
    except Exception:
        print(f"[FAIL] {name}:\n{traceback.format_exc()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        epilog="Needs a CUDA GPU; exit status 0 when every check ran (each prints [ok] or [FAIL]), 2 without a GPU.",
    )
    parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "capture_check: error: needs a CUDA GPU (CUDA graphs are a GPU feature); none is visible here",
            file=sys.stderr,
        )
        return 2
    from occult import OccultMoE, set_sync_free
    from occult.integrations import hf

    dev = torch.device("cuda")
    torch.manual_seed(0)
    layer = OccultMoE(256, 128, 16, 4, sync_free=True, dtype=torch.bfloat16, device=dev)
    capture("OccultMoE sync-free layer", layer, torch.randn(8, 256, dtype=torch.bfloat16, device=dev))

    model = hf.tiny_random_model("olmoe", seed=0).to(dev, torch.bfloat16).eval()
    ids = torch.randint(3, 90, (8, 1), device=dev)
    capture("transformers OLMoE, unconverted", lambda i: model(input_ids=i, use_cache=False).logits, ids)
    hf.convert(model)
    set_sync_free(model)
    capture("transformers OLMoE, converted, sync-free", lambda i: model(input_ids=i, use_cache=False).logits, ids)
    pos = torch.zeros_like(ids)
    cache_pos = torch.zeros(1, dtype=torch.long, device=dev)
    capture(
        "converted, explicit position ids and cache position",
        lambda i: model(input_ids=i, position_ids=pos, cache_position=cache_pos, use_cache=False).logits,
        ids,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
