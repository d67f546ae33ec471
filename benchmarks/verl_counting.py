"""Counts of upstream verl's work, taken inside its own processes (benchmark only).

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` in every process
(``import verl``), so ``vs_verl.py`` names this one after the CPU plugin. It hooks,
process-wide and without changing anything verl does:

- every forward of a Hugging Face causal LM (the actor; vLLM's own model classes
  are not Hugging Face models, so generation is not counted here): the sequences
  it carried, read from ``input_ids`` or, for verl's packed (remove-padding)
  inputs, from the starts of ``position_ids``;
- the backward of those forwards: a gradient hook on the logits counts the rows
  whose gradient really flowed back;
- every optimizer step (torch's global step hook).

Each process writes its totals to ``$HPCV_BENCH_COUNT_DIR/<pid>.json`` (atomically,
after every event); the benchmark adds the files up. Without that variable it does
nothing.
"""
from __future__ import annotations

import json
import os
from typing import Any

_DIR = os.environ.get("HPCV_BENCH_COUNT_DIR")
_totals = {"fwd_rows": 0, "bwd_rows": 0, "optim_steps": 0}


def _write() -> None:
    path = os.path.join(str(_DIR), f"{os.getpid()}.json")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(_totals, fh)
    os.replace(tmp, path)


def _rows(args: tuple, kwargs: dict) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None or not hasattr(ids, "shape") or ids.dim() != 2:
        return 0
    pos = kwargs.get("position_ids")
    if ids.shape[0] == 1 and pos is not None and hasattr(pos, "shape"):
        starts = int((pos.reshape(-1, pos.shape[-1])[0] == 0).sum())  # packed: one 0 per sequence
        if starts > 1:
            return starts
    return int(ids.shape[0])


def _is_hf_causal_lm(module: Any) -> bool:
    import sys

    transformers = sys.modules.get("transformers")
    if transformers is None or not type(module).__name__.endswith("ForCausalLM"):
        return False
    return isinstance(module, transformers.PreTrainedModel)


def _on_forward(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
    if not _is_hf_causal_lm(module):
        return
    rows = _rows(args, kwargs)
    if not rows:
        return
    _totals["fwd_rows"] += rows
    logits = getattr(output, "logits", None)
    if logits is not None and getattr(logits, "requires_grad", False):
        def on_grad(grad: Any, rows: int = rows) -> None:
            _totals["bwd_rows"] += rows
            _write()
        logits.register_hook(on_grad)
    _write()


def _on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _totals["optim_steps"] += 1
    _write()


def install() -> None:
    if not _DIR:
        return
    from torch.nn.modules.module import register_module_forward_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_module_forward_hook(_on_forward, with_kwargs=True)
    register_optimizer_step_post_hook(_on_step)


install()
