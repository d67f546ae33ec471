"""Checks run inside a job: ``python -m hpc_verl.launch.checks model PATH``.

The model-check stage loads the model config and tokenizer offline, so a wrong
path or a missing tokenizer fails in seconds on one node instead of after the
Ray cluster is up. It is the quick check: config.json and tokenizer_config.json
must parse, and a fast tokenizer (tokenizer.json) is loaded with the
``tokenizers`` library, whose import takes a fraction of a second where
``transformers`` takes seconds (on a loaded 2-core machine 7 s). Only a
directory without tokenizer.json (a slow, e.g. sentencepiece, tokenizer) goes
through ``transformers``. ``hpc-verl check-model`` is the full check
(``hpc_verl.trainer.models.check.check_model``); the trainer's ranks load the model itself.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _json_file(path: Path) -> dict:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return data


def check_model(path: str) -> str:
    """Load config + tokenizer from a local directory (no hub access); return a one-line summary."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p / 'config.json'} does not exist")
    config = _json_file(p / "config.json")
    if not config.get("model_type"):
        raise ValueError("config.json has no model_type")
    if (p / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(p / "tokenizer.json"))
        tok_cfg = _json_file(p / "tokenizer_config.json") if (p / "tokenizer_config.json").is_file() else {}
        kind, size = tok_cfg.get("tokenizer_class") or "Tokenizer", tokenizer.get_vocab_size(with_added_tokens=True)
    else:
        from transformers import AutoConfig, AutoTokenizer

        AutoConfig.from_pretrained(path, local_files_only=True)
        slow = AutoTokenizer.from_pretrained(path, local_files_only=True)
        kind, size = type(slow).__name__, len(slow)
    return (f"model {path}: {config['model_type']}, vocab {config.get('vocab_size', '?')}, "
            f"tokenizer {kind} ({size} tokens)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_verl.launch.checks")
    sub = parser.add_subparsers(dest="what", required=True)
    p_model = sub.add_parser("model", help="load a model's config and tokenizer offline")
    p_model.add_argument("path")
    args = parser.parse_args(argv)
    try:
        print(check_model(args.path), flush=True)
    except Exception as exc:  # any load failure is the one thing to report
        print(f"model-check: cannot load {args.path} offline: {type(exc).__name__}: {exc}".splitlines()[0],
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
