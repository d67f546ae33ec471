"""``hpc-verl check-model PATH``: config + tokenizer load offline, weights present (the job's model stage)."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("check-model", help="check that a local model loads offline (config, tokenizer)")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--no-weights", action="store_true", help="do not require weight files")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hpc_verl.trainer.models.check import check_model
    from hpc_verl.trainer.models.check import quiet_transformers
    quiet_transformers()
    info = check_model(args.path, need_weights=not args.no_weights)
    print(f"check-model: ok {info['path']} ({info['model_type']}, vocab {info['vocab_size']}, "
          f"chat template: {'yes' if info['chat_template'] else 'no'})")
    return 0
