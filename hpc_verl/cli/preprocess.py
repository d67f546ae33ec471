"""``hpc-verl preprocess gsm8k|digits``: data files → verl-schema train/test parquet."""
from __future__ import annotations

import argparse
from pathlib import Path

HELP = {"gsm8k": "gsm8k-style question/answer jsonl or parquet → train/test parquet",
        "digits": "the synthetic digit task (answer with the prompt's first digits)"}


def register(subparsers: argparse._SubParsersAction) -> None:
    from hpc_verl.data.preprocess import DATASETS, add_arguments

    p = subparsers.add_parser("preprocess", help="turn data into verl-schema parquet (gsm8k, digits)")
    sub = p.add_subparsers(dest="dataset", metavar="DATASET", required=True)
    for dataset in DATASETS:
        d = sub.add_parser(dataset, help=HELP[dataset])
        add_arguments(d, dataset)
        d.add_argument("--skip-existing", action="store_true", help="do nothing when both outputs exist")
        d.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hpc_verl.data.preprocess import run

    out = Path(args.output)
    if args.skip_existing and (out / "train.parquet").is_file() and (out / "test.parquet").is_file():
        print(f"preprocess: {args.output} already has train.parquet and test.parquet; skipped")
        return 0
    print(run(args.dataset, args))
    return 0
