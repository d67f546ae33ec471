"""Splitting an item over the instances of a ``split`` node and gathering the
shards back (pure: no Ray, torch only when the item holds tensors).

An item is "row-shaped" when it is a list, a tensor/array, or a dict whose
tensors, arrays and lists share a first dimension (the rows); other dict values
(scalars, strings) ride along unchanged. ``split_bounds`` cuts the rows into
contiguous, balanced shards - with ``split_key``, never inside a run of rows
that share that key's value (a GRPO prompt group stays on one replica) - and
``concat`` puts shards back together in rank order, which is the input order.
"""
from __future__ import annotations

from typing import Any, Sequence

from hpc_verl.errors import DataflowError


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "__getitem__") and len(getattr(value, "shape", ())) > 0


def num_rows(item: Any, split_key: str | None = None) -> int:
    """Rows of a row-shaped item (see the module docstring)."""
    if isinstance(item, dict):
        if split_key is not None:
            if split_key not in item:
                raise DataflowError(f"split: the item has no field '{split_key}' to keep rows together by "
                                    f"(fields: {', '.join(map(str, item))})")
            return len(item[split_key])
        for value in item.values():
            if isinstance(value, list) or _is_array(value):
                return len(value)
        raise DataflowError("split: the item has no list or tensor field to split by rows")
    if isinstance(item, list) or _is_array(item):
        return len(item)
    raise DataflowError(f"split: cannot split a {type(item).__name__} by rows; pass a dict of tensors/lists")


def rows_or_one(item: Any) -> int:
    """``num_rows`` for the statistics: 1 for an item that is not row-shaped (no exception raised,
    so it costs next to nothing per item)."""
    if isinstance(item, dict):
        for value in item.values():
            if isinstance(value, list) or _is_array(value):
                return len(value)
        return 1
    if isinstance(item, list) or _is_array(item):
        return len(item)
    return 1


def split_bounds(item: Any, world: int, split_key: str | None = None) -> list[tuple[int, int]]:
    """``world`` contiguous ``[start, stop)`` row ranges covering the item, balanced by rows."""
    n = num_rows(item, split_key)
    if split_key is None:
        base, extra = divmod(n, world)
        bounds, start = [], 0
        for r in range(world):
            stop = start + base + (1 if r < extra else 0)
            bounds.append((start, stop))
            start = stop
        return bounds
    keys = item[split_key]
    starts = [0]  # start row of each run of equal keys
    seen = {_hashable(keys[0])} if n else set()
    for i in range(1, n):
        if keys[i] != keys[i - 1]:
            k = _hashable(keys[i])
            if k in seen:
                raise DataflowError(f"split: rows with {split_key}={keys[i]!r} are not adjacent; rows that must "
                                    f"stay together have to be next to each other")
            seen.add(k)
            starts.append(i)
    if not n:
        starts = []
    cuts = [0]
    for r in range(1, world):  # the run boundary nearest to r/world of the rows, never moving backwards
        target = r * n / world
        best = min((s for s in starts + [n] if s >= cuts[-1]), key=lambda s: (abs(s - target), s))
        cuts.append(best)
    cuts.append(n)
    return [(cuts[r], cuts[r + 1]) for r in range(world)]


def _hashable(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def take_rows(item: Any, start: int, stop: int, n: int | None = None) -> Any:
    """Rows ``[start, stop)`` of every row-shaped field of ``item``."""
    if isinstance(item, dict):
        n = num_rows(item) if n is None else n
        out = {}
        for key, value in item.items():
            if (isinstance(value, list) or _is_array(value)) and len(value) == n:
                out[key] = value[start:stop]
            else:
                out[key] = value
        return out
    return item[start:stop]


def take_index(item: Any, idx: Sequence[int], n: int) -> Any:
    """Rows ``idx`` (positions, in order) of every row-shaped field of ``item`` (``n`` rows); other
    fields ride along unchanged."""
    if isinstance(item, dict):
        return {k: (take_index(v, idx, n) if (isinstance(v, list) or _is_array(v)) and len(v) == n else v)
                for k, v in item.items()}
    if isinstance(item, list):
        return [item[i] for i in idx]
    if type(item).__module__.split(".")[0] == "torch":
        import torch
        return item[torch.as_tensor(list(idx), dtype=torch.long)]
    return item[list(idx)]


def gather_items(outputs: Sequence[Sequence[Any]], collect: Any = None) -> list[Any]:
    """``outputs[rank][j]``: rank's shard of item j -> item j gathered (``collect``, default concat)."""
    merge = collect or concat
    return [merge([out[j] for out in outputs]) for j in range(len(outputs[0]))]


def concat(shards: Sequence[Any]) -> Any:
    """Shards (in rank order) back into one item: tensors/arrays along rows, lists
    concatenated, dicts field by field; any other value must be equal in every shard."""
    if not shards:
        raise DataflowError("collect: no shards to gather")
    return _merge("item", list(shards))


def _merge(where: str, values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        keys = list(first)
        for v in values[1:]:
            if not isinstance(v, dict) or list(v) != keys:
                raise DataflowError(f"collect: shards of {where} have different fields; every shard must "
                                    f"return the same keys")
        return {k: _merge(f"{where}.{k}", [v[k] for v in values]) for k in keys}
    if isinstance(first, list):
        out: list[Any] = []
        for v in values:
            out.extend(v)
        return out
    if _is_array(first):
        mod = type(first).__module__.split(".")[0]
        if mod == "torch":
            import torch
            return torch.cat(list(values), dim=0)
        import numpy as np
        return np.concatenate(values, axis=0)
    for v in values[1:]:
        if not _equal(v, first):
            raise DataflowError(f"collect: {where} differs between shards ({first!r} vs {v!r}); return it as a "
                                f"list (one entry per shard) to have the shards concatenated")
    return first


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - 0-dim tensors and odd types
        try:
            return bool((a == b).all())
        except Exception:  # noqa: BLE001
            return a is b
