"""Mini-batch rules of the trainable roles: the update order of a step's rows and which rows
each data-parallel rank trains on. One rule for the update loop (roles/base.py) and for the
rows a rank fetches before it (``actor_rows``, the actor node's ``take_rows``).

torch-free at import: the driver declares the graph with ``actor_rows``; the rollout rank that
cuts the rows runs it (torch is loaded there).
"""
from __future__ import annotations

from typing import Any

from hpc_verl.trainer.engine.device import torch_mod


ACTOR_SEED_OFFSET = 101   # the actor's shuffle seed: trainer.seed + this


def update_generator(seed: int, step: int) -> Any:
    """The shuffle generator of a role's update at ``step`` (the same on every rank)."""
    return torch_mod().Generator().manual_seed(seed * 1_000_003 + step)


def minibatches(n_rows: int, mini_rows: int, epochs: int, shuffle: bool, gen: Any, dp_rank: int,
                dp_world: int) -> Any:
    """``(rows of the mini-batch, this data-parallel rank's rows of it)`` in update order: one rule
    for the update loop and for the rows a rank fetches before it (``actor_rows``)."""
    torch = torch_mod()
    mini_rows = min(mini_rows, n_rows)
    per_rank = mini_rows // dp_world
    for _ in range(epochs):
        order = torch.randperm(n_rows, generator=gen) if shuffle else torch.arange(n_rows)
        for start in range(0, n_rows, mini_rows):
            idx = order[start:start + mini_rows]
            yield idx, idx[dp_rank * per_rank:(dp_rank + 1) * per_rank]


def actor_rows(cfg: dict, n_rows: int, rank: int, world: int, item: Any) -> list[int]:
    """The rows rank ``rank`` of the actor trains on at the item's step (its ``take_rows``): known
    before the batch is fetched, so a rank fetches only these. Every row where Ulysses splits
    sequences (its data-parallel size may change at run time) or the batch does not split evenly
    (the update then says why)."""
    a = cfg["actor_rollout_ref"]["actor"]
    mini = int(a["ppo_mini_batch_size"]) * int(cfg["actor_rollout_ref"]["rollout"]["n"])
    sp = int(a["fsdp_config"].get("ulysses_sequence_parallel_size") or 1)
    if sp > 1 or world < 1 or min(mini, n_rows) % world:
        return list(range(n_rows))
    step = int(item.get("step", 0)) if isinstance(item, dict) else 0
    gen = update_generator(int(cfg["trainer"]["seed"]) + ACTOR_SEED_OFFSET, step)
    rows: set[int] = set()
    for _, local in minibatches(n_rows, mini, int(a["ppo_epochs"]), bool(a["shuffle"]), gen, rank, world):
        rows.update(int(g) for g in local)
    return sorted(rows)
