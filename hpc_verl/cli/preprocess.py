"""``hpc-verl preprocess gsm8k|digits``: data files → verl-schema train/test parquet."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("preprocess", help="turn data into verl-schema parquet (gsm8k, digits)")
    sub = p.add_subparsers(dest="dataset", metavar="DATASET", required=True)
    g = sub.add_parser("gsm8k", help="gsm8k-style question/answer jsonl or parquet → train/test parquet")
    g.add_argument("--input", required=True, metavar="FILE", help=".jsonl or .parquet with question/answer fields")
    g.add_argument("--output", required=True, metavar="DIR")
    g.add_argument("--test-input", metavar="FILE", help="a separate test file (else a split of --input)")
    g.add_argument("--test-fraction", type=float, default=0.1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--skip-existing", action="store_true", help="do nothing when both outputs exist")
    g.set_defaults(func=_gsm8k)
    d = sub.add_parser("digits", help="the synthetic digit task (answer with the prompt's first digits)")
    d.add_argument("--output", required=True, metavar="DIR")
    d.add_argument("--n-train", type=int, default=1024)
    d.add_argument("--n-test", type=int, default=128)
    d.add_argument("--n-digits", type=int, default=5)
    d.add_argument("--answer-digits", type=int, default=3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--skip-existing", action="store_true")
    d.set_defaults(func=_digits)


def _done(out: str) -> bool:
    return (Path(out) / "train.parquet").is_file() and (Path(out) / "test.parquet").is_file()


def _gsm8k(args: argparse.Namespace) -> int:
    from hpc_verl.data.preprocess import preprocess_gsm8k
    if args.skip_existing and _done(args.output):
        print(f"preprocess: {args.output} already has train.parquet and test.parquet; skipped")
        return 0
    r = preprocess_gsm8k(args.input, args.output, args.test_input, args.test_fraction, args.seed)
    print(f"preprocess: wrote {r['train']} ({r['n_train']} rows) and {r['test']} ({r['n_test']} rows)")
    return 0


def _digits(args: argparse.Namespace) -> int:
    from hpc_verl.data.preprocess import preprocess_digits
    if args.skip_existing and _done(args.output):
        print(f"preprocess: {args.output} already has train.parquet and test.parquet; skipped")
        return 0
    r = preprocess_digits(args.output, args.n_train, args.n_test, args.seed, args.n_digits, args.answer_digits)
    print(f"preprocess: wrote {r['train']} ({r['n_train']} rows) and {r['test']} ({r['n_test']} rows)")
    return 0
