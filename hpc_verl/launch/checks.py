"""Checks run inside a job: ``python -m hpc_verl.launch.checks model PATH``.

The model-check stage loads the model config and tokenizer offline, so a wrong
path or a missing tokenizer fails in seconds on one node instead of after the
Ray cluster is up.
"""
from __future__ import annotations

import argparse
import sys


def check_model(path: str) -> str:
    """Load config + tokenizer from a local directory (no hub access); return a one-line summary."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return (f"model {path}: {config.model_type}, vocab {getattr(config, 'vocab_size', '?')}, "
            f"tokenizer {type(tokenizer).__name__} ({len(tokenizer)} tokens)")


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
