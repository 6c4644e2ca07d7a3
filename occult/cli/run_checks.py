"""Checks of the flags of `occult train / finetune / profile` (occult checkpoints and `--hf`) that need
more than argparse: the device, sizes that cannot be allocated, and the run
directory's life (made when the run starts writing, removed again when a run fails before it wrote
anything). Each refusal is a `CommandError` naming the flag, before any work.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from occult.cli.inputs import input_error, one_line
from occult.cli.registry import CommandError

GIB = 1 << 30


def check_device(value: str | None, flag: str = "--device") -> None:
    """`auto`, `cpu`, `cuda` or `cuda:N` of a GPU that is here; anything else is refused naming `flag`."""
    if value in (None, "auto"):
        return
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise CommandError(f"{flag} {value} is not a device: give auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise CommandError(f"{flag} {value}: occult runs on cpu or cuda; give auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise CommandError(f"{flag} {value}: {why}; give --device cpu (or auto)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise CommandError(f"{flag} {value}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


def resolved_device(device: str | None) -> str:
    """`device`, with auto resolved as the commands do (cuda if present, else cpu)."""
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def available_bytes(device: str) -> int | None:
    """Memory a run on `device` could hold: a GPU's total memory (the same figure on every rank, so every
    rank decides alike, and no CUDA context made for it); the host's MemAvailable bounded by the cgroup
    (`occult.tools.preflight`) for one process, its physical memory for several ranks (again the same on
    every rank of the host). None when it cannot be told."""
    import torch

    if torch.device(device).type == "cuda":
        index = torch.device(device).index
        return int(
            torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).total_memory
        )
    if world_size() > 1:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    from occult.tools.preflight import available_host_bytes  # MemAvailable, bounded by the cgroup

    return available_host_bytes()


def check_fits(what: str, need: int, device: str | None, fix: str) -> None:
    """Refuse a run whose smallest allocation (`need` bytes, a lower bound) exceeds what `device` has."""
    device = resolved_device(device)
    have = available_bytes(device)
    if have is not None and need > have:
        raise CommandError(
            f"{what} needs at least {need / GIB:,.1f} GiB, but {have / GIB:,.1f} GiB are free on {device}: {fix}"
        )


def world_size() -> int:
    """The ranks of this run (torchrun's WORLD_SIZE; 1 for one process)."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1")))


def check_fsdp_reshard(args: Any) -> None:
    """--fsdp-reshard and --fsdp-units shape FSDP2's units: given without --grad-sync fsdp they would do nothing, and
    one unit for the whole model frees nothing between its forward and backward."""
    for flag, value in (
        ("--fsdp-reshard", getattr(args, "fsdp_reshard", None)),
        ("--fsdp-units", getattr(args, "fsdp_units", None)),
    ):
        if value is not None and getattr(args, "grad_sync", None) != "fsdp":
            raise CommandError(
                f"{flag} {value} applies to FSDP2's sharded weights only: add --grad-sync fsdp, or leave {flag} out"
            )
    if getattr(args, "fsdp_units", None) == "model" and getattr(args, "fsdp_reshard", None) == "after-forward":
        raise CommandError(
            "--fsdp-reshard after-forward frees a block's weights between its forward and backward; with "
            "--fsdp-units model one unit holds them all and frees them only after the backward: drop one of the two"
        )


def check_layer_graphs(args: Any) -> None:
    """--layer-graphs records CUDA graphs: a CUDA device, and on several ranks neither FSDP2 (it frees the
    dense weights a recording reads) nor the count exchange (a host wait a graph cannot record)."""
    if not getattr(args, "layer_graphs", False):
        return
    device = resolved_device(args.device)
    if not device.startswith("cuda"):
        raise CommandError(f"--layer-graphs records CUDA graphs: it needs a CUDA device, not --device {device}")
    if world_size() == 1:
        return
    if args.grad_sync == "fsdp":
        raise CommandError(
            "--layer-graphs with --grad-sync fsdp: FSDP2 frees and gathers again the dense weights (the routers' "
            "among them) around every block, so a recorded call would read memory they no longer hold; use "
            "--grad-sync ddp or explicit"
        )
    if args.transport in ("counts", "host") and args.ep_size != 1:
        raise CommandError(
            f"--layer-graphs with --transport {args.transport}: the count exchange reads row counts on the host, "
            "which a CUDA graph cannot record; use --transport device (or auto)"
        )


def check_captured_step(args: Any, hf: bool = False) -> None:
    """--captured-step records the whole step in one CUDA graph: a CUDA device, not with --layer-graphs (the
    layers are recorded inside the step) or re-placement (it moves experts between steps); on several ranks
    the explicit gradient sync or FSDP2 (DDP's reducer keeps host state; `hf`: `finetune --hf` has no
    --grad-sync and syncs its routers explicitly in a captured step) and no count exchange (a host wait;
    --two-batch and --pair-micro-batches make the layers sync-free, which the count exchange then runs without
    one)."""
    if not getattr(args, "captured_step", False):
        return
    sync_free = getattr(args, "two_batch", False) or getattr(args, "pair_micro_batches", False)
    device = resolved_device(args.device)
    if not device.startswith("cuda"):
        raise CommandError(f"--captured-step records a CUDA graph: it needs a CUDA device, not --device {device}")
    if getattr(args, "layer_graphs", False):
        raise CommandError("--captured-step records every MoE layer inside the step: drop --layer-graphs")
    if getattr(args, "replace_every", 0) or getattr(args, "replace_drift", 0):
        raise CommandError(
            "--captured-step with --replace-every / --replace-drift: a migration moves experts between steps, "
            "which a recorded step cannot follow; drop one of them"
        )
    if world_size() == 1:
        return
    if not hf and getattr(args, "grad_sync", "explicit") == "ddp":
        raise CommandError(
            "--captured-step on several ranks with --grad-sync ddp: DDP's reducer keeps host state a replayed "
            "step would skip; use --grad-sync explicit, overlap or fsdp (their collectives are recorded with the "
            "step)"
        )
    transport = getattr(args, "transport", "auto")
    if transport in ("counts", "host") and getattr(args, "ep_size", 1) != 1 and not sync_free:
        raise CommandError(
            f"--captured-step with --transport {transport}: the count exchange reads row counts on the host, which a "
            "CUDA graph cannot record; use --transport device (or auto)"
        )


def check_two_batch_args(args: Any, hf: bool = False) -> None:
    """--two-batch runs two halves of each step interleaved: an even batch per rank; not beside the flags whose
    parts expect one forward per backward (several ranks: --grad-sync ddp or fsdp; --layer-graphs, re-placement,
    --distill-weight). The same rules `occult.lm.step_options.prepare_two_batch` applies, before any work (`hf`:
    `finetune --hf` has no --grad-sync and syncs its routers after the backward with --two-batch)."""
    if not getattr(args, "two_batch", False):
        return
    ranks = world_size()
    _refuse_flags_beside_threads(args, "--two-batch", "two halves make two", hf)
    rows = args.batch_size // ranks
    if args.batch_size % ranks == 0 and rows % 2:
        raise CommandError(
            f"--two-batch splits each rank's {rows} rows of --batch-size {args.batch_size} in halves: give an even "
            "number of rows per rank"
        )


def check_micro_batch_args(args: Any, hf: bool = False) -> None:
    """--micro-batches K and --pair-micro-batches: the rules `occult.lm.step_options.prepare_micro_batches` (and
    `hf.finetune`'s) apply, before any work (`hf`: `finetune --hf` has no --grad-sync: with pairing its routers are
    synced after the backward, as with --two-batch)."""
    count, paired = getattr(args, "micro_batches", 1), getattr(args, "pair_micro_batches", False)
    if count < 1:
        raise CommandError(f"--micro-batches {count}: give a count >= 1")
    if paired and count < 2:
        raise CommandError(
            "--pair-micro-batches pairs a forward with the previous micro-batch's backward: give "
            "--micro-batches 2 or more"
        )
    if count == 1:
        return
    if getattr(args, "two_batch", False):
        raise CommandError("--micro-batches and --two-batch both split the step: choose one")
    ranks = world_size()
    rows = args.batch_size // ranks
    if args.batch_size % ranks == 0 and rows % count:
        raise CommandError(
            f"--micro-batches {count} split each rank's {rows} rows of --batch-size {args.batch_size}: give a "
            f"--batch-size of a multiple of {count} rows per rank"
        )
    if not paired:
        return
    _refuse_flags_beside_threads(args, "--pair-micro-batches", "a paired step runs a forward beside a backward", hf)


def _refuse_flags_beside_threads(args: Any, flag: str, why: str, hf: bool) -> None:
    """What `flag` (micro-batches on threads beside each other) cannot run with: several ranks with --grad-sync
    ddp or fsdp (their hooks expect one forward per backward: `why` not; `hf` has no --grad-sync), --layer-graphs,
    re-placement, --distill-weight (`occult.lm.step_options`' rules)."""
    sync = getattr(args, "grad_sync", "explicit")
    if world_size() > 1 and not hf and sync not in ("explicit", "overlap"):
        raise CommandError(
            f"{flag} on several ranks with --grad-sync {sync}: its hooks expect one forward per backward, and {why}; "
            "use --grad-sync explicit or overlap"
        )
    others = {
        "--layer-graphs": getattr(args, "layer_graphs", False),
        "--replace-every / --replace-drift": getattr(args, "replace_every", 0) or getattr(args, "replace_drift", 0),
        "--distill-weight": getattr(args, "distill_weight", 0) > 0,
    }
    for other, asked in others.items():
        if asked:
            raise CommandError(f"{flag} does not run with {other}: drop one of them")


def check_train_sizes(args: Any, vocab_size: int) -> None:
    """Refuse a model (its weights, gradients and AdamW state) or a batch (its logits and activations)
    that cannot be allocated, naming the flags to lower. Both sums are lower bounds."""
    h, layers, e, f = args.hidden, args.layers, args.experts, args.expert_ffn
    params = vocab_size * h + layers * (4 * h * h + e * (h + 3 * h * f) + 2 * h)  # embedding tied to the head
    check_fits(
        f"the model of --hidden {h}, --layers {layers}, --experts {e}, --expert-ffn {f} ({params:,} parameters)",
        4 * params + 12 * params // world_size(),  # fp32 weights on every rank; gradients and AdamW state shared out
        args.device,
        "make it smaller",
    )
    check_batch(args, vocab_size, h, layers, args.top_k * f)


def check_batch(args: Any, vocab_size: int, hidden: int, layers: int, ffn: int) -> None:
    """The activations one rank keeps for the backward of its rows of a --batch-size x --seq-len batch
    (`ffn`: the expert width times top-k, the SwiGLU activations of a token)."""
    tokens = max(1, args.batch_size // world_size()) * args.seq_len
    need = 4 * tokens * (2 * vocab_size + layers * (8 * hidden + 3 * ffn))
    check_fits(
        f"--batch-size {args.batch_size} x --seq-len {args.seq_len} ({tokens:,} tokens per rank and step)",
        need,
        args.device,
        "lower --batch-size (or --seq-len)",
    )


@contextlib.contextmanager
def allocation_named(flag: str, value: Any) -> Iterator[None]:
    """An allocation that fails (host or GPU out of memory) becomes a `CommandError` naming `flag`."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise CommandError(f"{flag} {value}: out of memory ({one_line(str(exc))[:200]}); lower {flag}") from None
    except RuntimeError as exc:
        if "can't allocate memory" not in str(exc) and "out of memory" not in str(exc):
            raise
        raise CommandError(f"{flag} {value}: out of memory ({one_line(str(exc))[:200]}); lower {flag}") from None


@contextlib.contextmanager
def run_dir(path: str | os.PathLike) -> Iterator[None]:
    """A run's output directory: when the run fails and the directory did not exist before, the
    empty folders it left (nothing written) are removed; a file written is never removed."""
    out = Path(path)
    existed = out.exists()
    try:
        yield
    except BaseException:
        if not existed and out.is_dir():
            remove_empty_tree(out)
        raise


def remove_empty_tree(root: Path) -> None:
    """Remove `root` and the folders under it bottom-up, as long as they hold no file."""
    for folder, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        with contextlib.suppress(OSError):  # not empty (a file was written), or another rank removed it
            os.rmdir(folder)


def check_max_devices(max_devices: int | None, placement: Any, path: str | None) -> None:
    """--max-devices N must leave a choice: at most the devices of --placement (N = all is plain routing)."""
    if max_devices is not None and placement is not None and max_devices > placement.num_devices:
        raise CommandError(
            f"--max-devices {max_devices} is more than the {placement.num_devices} devices of --placement {path}: "
            f"give 1 to {placement.num_devices}"
        )


@contextlib.contextmanager
def writing_named(*outputs: tuple[str, str | None]) -> Iterator[None]:
    """An output that cannot be written (a full disk, /dev/full) becomes a `CommandError` naming its flag:
    `outputs` are (flag, path) pairs; a file beside a path (OUT.similarity.safetensors) counts as that path's."""
    try:
        yield
    except OSError as exc:
        for flag, path in outputs:
            if path is not None and str(exc.filename or "").startswith(str(path)):
                raise input_error(flag, path, exc) from None
        raise


@contextlib.contextmanager
def diverged_named(lr: float) -> Iterator[None]:
    """A run whose loss or weights became non-finite (the loop's `FloatingPointError`, or the router's NaN
    gates that non-finite weights make) becomes a `CommandError` naming --lr."""
    from occult.moe.counts import STATUS_MESSAGES, RoutingError

    try:
        yield
    except (FloatingPointError, RoutingError) as exc:
        if isinstance(exc, RoutingError) and STATUS_MESSAGES[1] not in str(exc):
            raise
        raise CommandError(
            f"--lr {lr:g}: training diverged, the loss or the weights became non-finite ({one_line(str(exc))}); "
            "give a smaller --lr"
        ) from None
