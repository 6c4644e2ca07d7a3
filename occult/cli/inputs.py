"""Input files of the commands, read with errors that name the flag and the path.

`reading(flag, path)` turns what a reader raises for a bad file (a `ValueError` such as
`TraceError`, `PlacementError`, `CheckpointError`, or an `OSError`) into one `CommandError`,
`--trace /x/t.safetensors: not a readable safetensors file (...)`, the shape README's "Exit
status" promises. `--data` (calibration text or token ids of a transformers model) is read
here too: `read_token_ids`, `read_texts`, `check_token_ids`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from occult.cli.registry import CommandError, check_input

DATA_FORMATS = ".txt, .jsonl (a \"text\" field per line), .safetensors (input_ids), .npy, .pt, or 'random'"


def _reason(message: str, path: str) -> str:
    """`message` without a leading `PATH: ` or `PATH is ` (the flag and path are said in front)."""
    for head in (f"{path}: ", f"{path} is ", f"{path} "):
        if message.startswith(head):
            return message[len(head) :]
    return message


def input_error(flag: str, path: str | os.PathLike | None, exc: BaseException) -> CommandError:
    """`flag path: reason` for an error a reader raised about the input `path` of `flag`."""
    if isinstance(exc, CommandError):
        return exc
    if isinstance(exc, OSError) and exc.strerror:
        message = exc.strerror if exc.filename in (None, str(path)) else f"{exc.filename}: {exc.strerror}"
    else:
        message = one_line(str(exc)) or type(exc).__name__
    if path is None:
        return CommandError(f"{flag}: {message}")
    return CommandError(f"{flag} {path}: {_reason(message, str(path))}")


@contextlib.contextmanager
def reading(flag: str, path: str | os.PathLike | None) -> Iterator[None]:
    """Re-raise a bad input's `ValueError` / `OSError` as a `CommandError` naming `flag` and `path`."""
    try:
        yield
    except CommandError:
        raise
    except (ValueError, OSError) as exc:
        raise input_error(flag, path, exc) from None


def check_data(path: str | None) -> None:
    """--data: a file, or the word 'random'."""
    if path is not None and str(path).lower() != "random":
        check_input("--data", path)


def read_token_ids(data: str, model_dir: str, vocab_size: int) -> Any:
    """`hf.token_stream` of --data, with one clear error naming --data for a file that is
    unreadable, empty, or holds ids outside the model's vocabulary."""
    from occult.integrations import hf

    try:
        ids = hf.token_stream(data, model_dir, vocab_size)
    except ValueError as exc:
        if str(exc).startswith("--data"):
            raise
        raise CommandError(
            f"--data {data} is not readable calibration data ({one_line(str(exc))}); give {DATA_FORMATS}"
        ) from None
    except Exception as exc:  # safetensors, numpy, torch.load, tokenizer: whatever the file made them raise
        raise CommandError(
            f"--data {data} is not readable calibration data ({type(exc).__name__}: {one_line(str(exc))}); "
            f"give {DATA_FORMATS}"
        ) from None
    return check_token_ids(ids, data, vocab_size)


def check_token_ids(ids: Any, data: str, vocab_size: int) -> Any:
    """Refuse no tokens, or ids outside [0, vocab_size), naming --data."""
    if ids.dim() not in (1, 2):
        raise CommandError(
            f"--data {data} holds token ids of shape {list(ids.shape)}: give a 1-D stream or [N, S] rows"
        )
    if ids.numel() == 0:
        raise CommandError(f"--data {data} holds no tokens")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise CommandError(
            f"--data {data} holds token ids in [{lo}, {hi}], outside the model's vocabulary [0, {vocab_size})"
        )
    return ids


def read_texts(data: str) -> list[str]:
    """The documents of a .txt file (one) or a .jsonl file (a "text" field per line), errors naming the line."""
    try:
        lines = Path(data).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise CommandError(f"--data {data} is not UTF-8 text; give {DATA_FORMATS}") from None
    if not data.endswith(".jsonl"):
        return ["\n".join(lines)]
    texts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            text = None
        if not isinstance(text, str):
            raise CommandError(f'--data {data} line {i}: expected a JSON object with a "text" field (a string)')
        texts.append(text)
    return texts


def one_line(text: str) -> str:
    """`text` on one line (a third-party message may span several)."""
    return " ".join(text.split())


@contextlib.contextmanager
def loading_model(flag: str, path: str | os.PathLike, keep: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """A model directory being loaded by transformers (or occult over it): whatever a bad directory
    makes them raise becomes one `CommandError` naming `flag` and `path` (OCCULT_DEBUG=1: the cause);
    errors of the `keep` types (about other inputs, e.g. a placement that does not fit) pass unchanged."""
    try:
        yield
    except (CommandError, *keep):
        raise
    except Exception as exc:
        reason = one_line(_reason(str(exc), str(path))) or type(exc).__name__
        raise CommandError(f"{flag} {path}: cannot load this model ({type(exc).__name__}: {reason})") from exc


def read_hf_config(flag: str, path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object of the model directory's config.json (with a `model_type`), or a `CommandError`."""
    cfg = Path(path) / "config.json"
    try:
        doc = json.loads(cfg.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CommandError(f"{flag} {path}: not a transformers model directory (no config.json)") from None
    except (OSError, ValueError, RecursionError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(str(exc)) or type(exc).__name__
        raise CommandError(f"{flag} {path}: config.json is not readable JSON ({reason})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        raise CommandError(f"{flag} {path}: config.json is not a transformers config (a JSON object with a model_type)")
    return doc


def check_checkpoint(flag: str, path: str) -> Any:
    """The `ModelConfig` of an occult weights file, its tensors checked against it (errors name `flag`)."""
    from occult.lm.checkpoint import check_sizes, config_from_metadata, read_checkpoint

    with reading(flag, path):
        tensors, meta = read_checkpoint(path, prefixes=("model.",))
        cfg = config_from_metadata(meta, path)
        check_sizes(cfg, tensors, path)
    return cfg


def load_token_data(args: Any) -> Any:
    """`occult.lm.data.load_dataset` of --corpus-dir / --tokenizer, errors naming the flag."""
    from occult.lm.data import load_dataset

    try:
        return load_dataset(args.corpus_dir, args.tokenizer)
    except (ValueError, OSError) as exc:
        if args.tokenizer is not None and str(args.tokenizer) in str(exc):
            raise input_error("--tokenizer", args.tokenizer, exc) from None
        raise input_error("--corpus-dir", args.corpus_dir or "(the cached corpus)", exc) from None


MAX_EXPERTS = 16384  # co-activation matrices are E x E int64 per layer: 2 GiB each at this size


def load_trace(path: str) -> Any:
    """The trace of --trace, errors naming the flag; refused when its E x E matrices would not fit."""
    from occult.placement.trace import read_trace

    with reading("--trace", path):
        trace = read_trace(path)
    if trace.num_experts > MAX_EXPERTS:
        raise CommandError(
            f"--trace {path}: num_experts {trace.num_experts} is more than occult place / stats handle "
            f"({MAX_EXPERTS}: their co-activation matrices are E x E per layer)"
        )
    return trace


def check_devices(trace: Any, devices: int) -> None:
    """--devices must split the trace's experts evenly."""
    from occult.placement import check_divisible

    with reading("--devices", str(devices)):
        check_divisible(trace.num_experts, devices)


def load_placement(path: str) -> Any:
    """The placement JSON of --placement, errors naming the flag."""
    from occult.placement import Placement

    with reading("--placement", path):
        return Placement.load(path)
