"""Rows cut out for the ranks that use them (``Node(take_rows=...)``).

A worker group's ranks often use only part of each item: a data-parallel update trains every rank
on its own rows. Without a plan, each rank fetches every shard of the split producer and
deserialises all of them. With one, the producer cuts each output shard into one piece per
consumer rank (the rows that rank's ``take_rows`` names, in order) and puts each piece in the
object store; a rank fetches only its pieces. The whole shard is stored once beside them, for
the consumers that need all of it (and the driver).

An envelope (a worker's ``run`` result) is ``[time, outputs, emitted]``, or with pieces
``[time, None, emitted, planned]``: ``planned = {"full": ref of the outputs, "by": {consumer:
{"world": ranks, "items": [[(rows, ref) per rank] per item]}}}``.

A producer whose output rows are not its input rows one to one cuts nothing (its consumers
fetch whole shards), nor for a one-rank consumer; a consumer whose group changed size since
the cut fetches whole shards too.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from hpc_verl.dataflow import spmd


def cut(outs: list[Any], spans: list[tuple[int, int, int]], plans: Mapping[str, Callable[..., Sequence[int]]],
        worlds: Mapping[str, int]) -> dict[str, Any] | None:
    """The pieces of this shard's outputs for every rank of every planned consumer; ``spans``: per
    item this shard's input rows ``(start, stop, n)``. None where an output has other rows."""
    import ray

    plans = {dst: fn for dst, fn in plans.items() if int(worlds[dst]) > 1}   # (one rank uses every row)
    if not plans or any(spmd.rows_or_one(out) != stop - start for out, (start, stop, _) in zip(outs, spans)):
        return None
    by: dict[str, Any] = {}
    for dst, fn in plans.items():
        world = int(worlds[dst])
        items = []
        for out, (start, stop, n) in zip(outs, spans):
            ranks = []
            for r in range(world):
                rows = [int(g) for g in fn(n, r, world, out) if start <= g < stop]
                ranks.append((rows, ray.put(spmd.take_index(out, [g - start for g in rows], stop - start))))
            items.append(ranks)
        by[dst] = {"world": world, "items": items}
    return {"full": ray.put(outs), "by": by}


def outputs(env: list) -> list[Any]:
    """An envelope's outputs (fetched from the store where they were kept apart from it)."""
    if env[1] is None and len(env) > 3 and env[3]:
        import ray
        return ray.get(env[3]["full"])
    return env[1]


def fetch(envs: list[list], node: str, rank: int, world: int,
          collect: Callable[[list[Any]], Any] | None = None) -> tuple[list[Any], list[list[int]]] | None:
    """This rank's rows of every item (the pieces of all shards, in rank order) and their row
    numbers in the whole item; None where the producer cut nothing for ``node`` at this size."""
    import ray

    plans = [env[3]["by"].get(node) if len(env) > 3 and env[3] else None for env in envs]
    if any(p is None or p["world"] != world for p in plans):
        return None
    n_items = len(plans[0]["items"])
    got = ray.get([p["items"][j][rank][1] for j in range(n_items) for p in plans])
    merge = collect or spmd.concat
    values, rows = [], []
    for j in range(n_items):
        values.append(merge(got[j * len(plans):(j + 1) * len(plans)]))
        rows.append([g for p in plans for g in p["items"][j][rank][0]])
    return values, rows
