"""``hpc-verl make-tiny-model OUT_DIR``: a tiny random causal LM + char tokenizer, made locally (no hub)."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("make-tiny-model", help="write a tiny random Llama model and tokenizer for tests/demo")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2,
                   help="attention heads (default 2: head_dim 32, the smallest vLLM's CPU attention serves)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hpc_verl.errors import ConfigError
    if args.hidden_size <= 0 or args.layers <= 0 or args.heads <= 0 or args.hidden_size % args.heads:
        raise ConfigError(f"--hidden-size ({args.hidden_size}) must be a positive multiple of --heads ({args.heads}), "
                          "and --layers positive")
    from hpc_verl.trainer.models.tiny import make_tiny_model
    from hpc_verl.trainer.models.check import quiet_transformers
    quiet_transformers()
    out = make_tiny_model(args.out_dir, hidden_size=args.hidden_size, num_layers=args.layers,
                          num_heads=args.heads, seed=args.seed, overwrite=args.overwrite)
    print(f"make-tiny-model: wrote {out}")
    return 0
