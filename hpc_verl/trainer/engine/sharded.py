"""Sharded state I/O: a role's model + optimizer as a ``torch.distributed.checkpoint``
directory that every rank of its group writes and that loads at any world size, and the
same directory read back as one full state dict (offline: conversion, tests).

The checkpoint's layout, manifest and rotation are the driver's (driver/checkpoint.py);
this module only writes and reads one part. torch is imported in the functions.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpc_verl.trainer.engine.parallel import Parallel
from hpc_verl.errors import CheckpointError
import tempfile


def save_sharded(path: str, module: Any, optimizer: Any, extra: dict, par: Parallel) -> None:
    """A ``torch.distributed.checkpoint`` of model + optimizer (every rank writes its shards)
    and rank 0's ``extra.pt`` (scheduler, versions, generators): loadable at any world size."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    os.makedirs(path, exist_ok=True)
    model_sd, optim_sd = get_state_dict(module, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path,
             process_group=par.group if par.distributed else None)
    if par.rank == 0:
        torch.save(extra, os.path.join(path, "extra.pt"))
    par.barrier()


def load_sharded(path: str, module: Any, optimizer: Any, par: Parallel) -> dict:
    """Load ``save_sharded``'s checkpoint into this rank's shards (any world size); returns extra."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=par.group if par.distributed else None)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return torch.load(os.path.join(path, "extra.pt"), map_location="cpu", weights_only=False)


def read_sharded(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A sharded part (e.g. ``global_step_N/actor``) as one full state dict in this process:
    ``{"model": {name: tensor}, "optim": {...}}``, whatever world size wrote it (tools, tests,
    export)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    p = Path(path)
    if not (p / ".metadata").is_file():
        raise CheckpointError(f"{p} is not a sharded checkpoint part (no .metadata); expected global_step_N/actor")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(p), str(out))
        return torch.load(out, map_location="cpu", weights_only=False)
