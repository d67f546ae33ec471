"""Turn question/answer files into verl's RL parquet schema.

One row: ``data_source`` (selects the reward function), ``prompt`` (chat messages),
``ability``, ``reward_model`` ({style, ground_truth}), ``extra_info`` (split, index,
original fields). Outputs are written to a temp file and renamed, so a crash
never leaves a half-written parquet that a later "already there?" check accepts.
"""
from __future__ import annotations

import inspect
import json
import os
import random
import re
from pathlib import Path
from typing import Any, Iterable

from hpc_verl.errors import DataError
from hpc_verl.util.fs import atomic_target

GSM8K_SOURCE = "openai/gsm8k"
DIGITS_SOURCE = "hpc_verl/digits"
DATASETS = ("gsm8k", "digits")
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SAMPLES_DIR = Path(__file__).with_name("samples")
SAMPLE_GSM8K = SAMPLES_DIR / "gsm8k_sample.jsonl"

_ANSWER = re.compile(r"####\s*(-?[0-9.,]+)")


def gsm8k_final_answer(text: str) -> str | None:
    """The number after ``####`` with thousands separators removed, or None."""
    m = _ANSWER.search(text)
    if not m:
        return None
    return m.group(1).replace(",", "").rstrip(".")


def read_records(path: str | os.PathLike[str]) -> list[dict]:
    """Rows of a .jsonl/.json or .parquet file; one-line DataError when it is not readable."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file {p} not found; pass an existing .jsonl or .parquet file")
    suffix = "".join(p.suffixes[-1:]).lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
            return pq.read_table(p).to_pylist()
        except Exception as exc:
            raise DataError(f"data file {p}: not a readable parquet file ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if suffix in (".jsonl", ".json"):
        rows = []
        with open(p, encoding="utf-8") as fh:
            text = fh.read()
        if suffix == ".json" and text.lstrip().startswith("["):
            try:
                data = json.loads(text)
            except ValueError as exc:
                raise DataError(f"data file {p}: not valid JSON ({exc})") from None
            return [dict(r) for r in data]
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DataError(f"data file {p} line {n}: not valid JSON ({exc.args[0] if exc.args else exc}); "
                                "expected one JSON object per line") from None
            if not isinstance(row, dict):
                raise DataError(f"data file {p} line {n}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
        return rows
    raise DataError(f"data file {p}: unknown format '{suffix or p.name}'; use .jsonl or .parquet")


def gsm8k_rows(records: Iterable[dict], split: str, source_file: str = "") -> list[dict]:
    rows = []
    for i, rec in enumerate(records):
        where = f"{source_file} record {i + 1}" if source_file else f"record {i + 1}"
        missing = [k for k in ("question", "answer") if not isinstance(rec.get(k), str)]
        if missing:
            raise DataError(f"{where}: missing text field(s) {', '.join(missing)}; gsm8k-style data needs "
                            "'question' and 'answer' (the answer ending in '#### <number>')")
        truth = gsm8k_final_answer(rec["answer"])
        if truth is None:
            raise DataError(f"{where}: the answer has no '#### <number>' final answer")
        rows.append({
            "data_source": GSM8K_SOURCE,
            "prompt": [{"role": "user", "content": f"{rec['question'].strip()} {GSM8K_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": i, "question": rec["question"], "answer": rec["answer"]},
        })
    return rows


def digit_rows(n: int, seed: int, split: str, n_digits: int = 5, answer_digits: int = 3) -> list[dict]:
    """The synthetic copy task: the prompt is ``n_digits`` digits, the answer its first ``answer_digits``.

    A random policy over a char vocabulary scores ~1% per digit, so a rise to 0.9
    is learning, not luck; the reward is the fraction of answer digits right.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(n_digits))
        rows.append({
            "data_source": DIGITS_SOURCE,
            "prompt": [{"role": "user", "content": digits}],
            "ability": "copy",
            "reward_model": {"style": "rule", "ground_truth": digits[:answer_digits]},
            "extra_info": {"split": split, "index": i, "question": digits, "answer": digits[:answer_digits]},
        })
    return rows


def write_parquet(rows: list[dict], path: str | os.PathLike[str]) -> Path:
    """Write rows to parquet atomically (temp file in the same directory, then rename)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(path)
    with atomic_target(out) as tmp:
        pq.write_table(pa.Table.from_pylist(rows), str(tmp))
    return out


def preprocess_gsm8k(input_path: str | os.PathLike[str], output_dir: str | os.PathLike[str],
                     test_input: str | os.PathLike[str] | None = None, test_fraction: float = 0.1,
                     seed: int = 0) -> dict[str, Any]:
    """gsm8k-style question/answer file(s) → ``train.parquet`` and ``test.parquet`` in verl's schema.

    Without ``test_input`` a seeded ``test_fraction`` of the input becomes the test split.
    """
    records = read_records(input_path)
    if not records:
        raise DataError(f"data file {input_path}: no records")
    if test_input is not None:
        train_recs, test_recs = records, read_records(test_input)
    else:
        if not 0 <= test_fraction < 1:
            raise DataError(f"--test-fraction must be within [0, 1), got {test_fraction}")
        order = list(range(len(records)))
        random.Random(seed).shuffle(order)
        n_test = int(round(len(records) * test_fraction))
        test_idx = set(order[:n_test])
        train_recs = [r for i, r in enumerate(records) if i not in test_idx]
        test_recs = [r for i, r in enumerate(records) if i in test_idx]
    train = gsm8k_rows(train_recs, "train", str(input_path))
    test = gsm8k_rows(test_recs, "test", str(test_input or input_path))
    out = Path(output_dir)
    write_parquet(test, out / "test.parquet")
    write_parquet(train, out / "train.parquet")
    return {"train": str(out / "train.parquet"), "test": str(out / "test.parquet"),
            "n_train": len(train), "n_test": len(test)}


def preprocess_digits(output_dir: str | os.PathLike[str], n_train: int = 1024, n_test: int = 128,
                      seed: int = 0, n_digits: int = 5, answer_digits: int = 3) -> dict[str, Any]:
    """Write the synthetic digit task as train/test parquet."""
    if not 1 <= answer_digits <= n_digits:
        raise DataError(f"--answer-digits must be within 1..{n_digits}, got {answer_digits}")
    out = Path(output_dir)
    write_parquet(digit_rows(n_test, seed + 1, "test", n_digits, answer_digits), out / "test.parquet")
    write_parquet(digit_rows(n_train, seed, "train", n_digits, answer_digits), out / "train.parquet")
    return {"train": str(out / "train.parquet"), "test": str(out / "test.parquet"),
            "n_train": n_train, "n_test": n_test}


def _default(func: Any, name: str) -> Any:
    return inspect.signature(func).parameters[name].default


def add_arguments(parser: Any, *datasets: str) -> None:
    """The options of the datasets' preprocessing, their defaults the functions' own (one place):
    ``hpc-verl preprocess DATASET`` and ``python -m hpc_verl.data.preprocess`` (the job's stage) share them."""
    parser.add_argument("--output", required=True, metavar="DIR")
    if "gsm8k" in datasets:
        parser.add_argument("--input", required=datasets == ("gsm8k",), metavar="FILE",
                            help=".jsonl or .parquet with question/answer fields")
        parser.add_argument("--test-input", metavar="FILE", help="a separate test file (else a split of --input)")
        parser.add_argument("--test-fraction", type=float, default=_default(preprocess_gsm8k, "test_fraction"))
    if "digits" in datasets:
        for name in ("n_train", "n_test", "n_digits", "answer_digits"):
            parser.add_argument("--" + name.replace("_", "-"), type=int, default=_default(preprocess_digits, name))
    parser.add_argument("--seed", type=int, default=_default(preprocess_gsm8k, "seed"))


def run(dataset: str, args: Any) -> str:
    """Preprocess ``dataset`` ("gsm8k" | "digits") with parsed options; returns the line to print."""
    if dataset == "digits":
        r = preprocess_digits(args.output, args.n_train, args.n_test, args.seed, args.n_digits, args.answer_digits)
    else:
        if not args.input:
            raise DataError("--input FILE is required for --dataset gsm8k (a .jsonl or .parquet file)")
        r = preprocess_gsm8k(args.input, args.output, args.test_input, args.test_fraction, args.seed)
    return f"preprocess: wrote {r['train']} ({r['n_train']} rows) and {r['test']} ({r['n_test']} rows)"


def main(argv: list[str] | None = None) -> int:
    """``python -m hpc_verl.data.preprocess --input FILE --output DIR`` (the launcher's preprocess stage).

    ``--dataset gsm8k`` (default) converts question/answer files; ``--dataset digits``
    generates the synthetic task (``--input`` is then ignored).
    """
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m hpc_verl.data.preprocess",
                                description="Write train/test parquet in verl's schema.")
    p.add_argument("--dataset", choices=DATASETS, default="gsm8k")
    add_arguments(p, *DATASETS)
    a = p.parse_args(argv)
    try:
        print(run(a.dataset, a))
    except DataError as exc:
        print(f"hpc-verl: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
