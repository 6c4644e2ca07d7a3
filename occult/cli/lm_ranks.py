"""The ranks and placements of `occult train / finetune` (and `finetune --hf`): the process group under
torchrun, the experts' placement on the EP ranks (`--ep-placement`, `--nodes` for dedup2) and the routing
rule's placement and similarity tables (`--placement`, `--max-devices`, `--similarity`)."""

from __future__ import annotations

from typing import Any

from occult.cli.inputs import reading
from occult.cli.run_checks import check_max_devices


def parallel_from_args(args: Any) -> Any:
    """`Parallel` under torchrun with more than one rank (joining the group), else None."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if args.ep_size not in (None, 1):
            raise ValueError(f"--ep-size {args.ep_size} needs that many ranks: run under torchrun --nproc-per-node N")
        return None
    from occult.distributed import init_distributed
    from occult.lm.parallel import setup_parallel

    init_distributed()
    return setup_parallel(args.ep_size)


def ep_placement_from_args(args: Any, par: Any, num_experts: int, fallback: Any = None) -> Any:
    """The experts' placement on the EP ranks (None: contiguous), with nodes for --dispatcher dedup2."""
    from occult.moe.registry import capabilities
    from occult.placement import Placement

    with reading("--ep-placement", args.ep_placement):
        placement = Placement.load(args.ep_placement) if args.ep_placement else None
    if placement is None and fallback is not None and par is not None and fallback.num_devices == par.ep_size:
        placement = fallback
    nodes = getattr(args, "nodes", None)
    if not capabilities(args.dispatcher).two_level:
        if nodes is not None:
            raise ValueError("--nodes applies to --dispatcher dedup2 only")
        return placement
    if par is None:
        raise ValueError("--dispatcher dedup2 needs several ranks: run under torchrun --nproc-per-node N")
    if getattr(args, "replace_every", 0) or getattr(args, "replace_drift", 0.0):
        raise ValueError(
            "re-placing experts while training (--replace-every / --replace-drift) does not support "
            "--dispatcher dedup2 yet: use dedup, or train without re-placement"
        )
    if placement is not None and placement.num_nodes > 1:
        if nodes is not None and nodes != placement.num_nodes:
            raise ValueError(
                f"--nodes {nodes} but the placement {args.ep_placement or args.placement} has "
                f"{placement.num_nodes} nodes: give one or make them agree"
            )
        return placement
    if nodes is None:
        raise ValueError(
            "--dispatcher dedup2 needs the ranks' nodes: --nodes M (M nodes of EP_SIZE/M ranks, "
            "node-major), or an --ep-placement solved with occult place --nodes M"
        )
    if nodes < 2 or par.ep_size % nodes:
        raise ValueError(f"--nodes {nodes} must be >= 2 and divide the EP size {par.ep_size}")
    if placement is None:
        return Placement.contiguous(num_experts, par.ep_size, num_nodes=nodes)
    return Placement(placement.expert_device_LE, placement.num_devices, nodes)


def finish_ranks(par: Any, ok: bool) -> None:
    """Leave the process groups (`occult.distributed.finish_distributed`) after a run on several ranks."""
    if par is not None:
        from occult.distributed import finish_distributed

        finish_distributed(ok)


def load_routing_args(args: Any, num_experts: int, num_layers: int) -> tuple[Any, Any]:
    """(placement, similarity) from --placement/--similarity, with the beside-the-placement default."""
    from occult.moe.pruning import PruningError, load_similarity, similarity_path
    from occult.placement import Placement

    with reading("--placement", args.placement):
        placement = Placement.load(args.placement) if args.placement else None
    if args.max_devices is not None and placement is None:
        raise PruningError("--max-devices needs --placement (which device holds each expert)")
    check_max_devices(args.max_devices, placement, args.placement)
    if args.prune_method != "similarity" or args.max_devices is None:
        return placement, None
    path = args.similarity or similarity_path(args.placement)
    with reading("--similarity", path):
        return placement, load_similarity(path, num_experts=num_experts, num_layers=num_layers)
