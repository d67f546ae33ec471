"""What a node's handler sees: its context and the control messages it gets.
Ray-free, so ``from hpc_verl.dataflow import current_context`` stays light."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class _Marker:
    """A payload sentinel: one instance per class, kept through pickling (``is`` comparisons hold
    in every process)."""

    _instance: "_Marker | None" = None

    def __new__(cls) -> "_Marker":
        if cls.__dict__.get("_instance") is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> tuple:
        return (type(self), ())

    def __repr__(self) -> str:
        return self.label

    label = "MARKER"


class _TensorsMarker(_Marker):
    """Emitted instead of a payload: "my tensors, by the edge's tensor transport".

    The source class implements ``export_tensors(data_type)`` (an iterator of
    ``(name, tensor)``, run on every rank of its group together, so FSDP can
    gather shard by shard) and the destination ``load_tensors(data_type,
    named_tensors, version)``. The runtime moves them inside the process when
    both nodes share a worker group, else by a bucketed broadcast over a sync
    process group, never through the driver or the object store.
    """

    label = "TENSORS"


TENSORS = _TensorsMarker()


class _SnapshotMarker(_Marker):
    """Emitted instead of TENSORS: "I have frozen a copy of my tensors of this version; ship it
    without waiting". The source implements ``export_snapshot(data_type, version)``; the
    broadcast runs in the source's control thread, beside its next item, so a pipeline of two
    items overlaps (one-step-off-policy training). Only for a destination in another worker group."""

    label = "SNAPSHOT"


SNAPSHOT = _SnapshotMarker()


@dataclass
class ControlMessage:
    """What a class instance's ``on_control`` receives."""

    edge: str
    data_type: str
    version: int
    payload: Any
    src: str


@dataclass
class WorkerContext:
    """Where a handler runs and which control versions it runs with."""

    node_name: str
    instance_id: str
    index: int
    ray_node_id: str = ""
    gpu_ids: list[str] = field(default_factory=list)
    versions: dict[str, int] = field(default_factory=dict)
    control: dict[str, Any] = field(default_factory=dict)
    out_control: list[str] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1
    group: str | None = None
    process_group: Any = None   # the torch.distributed group of a dist worker group (None otherwise)
    shard_rows: tuple[int, int] | None = None   # split nodes: the rows [start, stop) of the current item
    row_ids: list[int] | None = None   # take_rows nodes: the item's rows this rank got (None: all of them)
    _emitted: list[tuple[str, int, Any]] = field(default_factory=list)

    def emit_control(self, payload: Any, version: int, data_type: str | None = None) -> None:
        """Publish ``payload`` as ``version`` on one of this node's control edges."""
        from hpc_verl.errors import DataflowError

        if not self.out_control:
            raise DataflowError(f"node '{self.node_name}' has no outgoing control edge; add "
                                f"Edge({self.node_name!r}, dst, control=True) to emit control")
        if data_type is None:
            if len(self.out_control) > 1:
                raise DataflowError(f"node '{self.node_name}' has several control edges "
                                    f"({', '.join(self.out_control)}); pass data_type=")
            data_type = self.out_control[0]
        elif data_type not in self.out_control:
            raise DataflowError(f"node '{self.node_name}': no outgoing control edge with data_type "
                                f"'{data_type}' (has {', '.join(self.out_control)})")
        self._emitted.append((data_type, int(version), payload))

    def take_emitted(self) -> list[tuple[str, int, Any]]:
        """The control messages emitted since the last call, ``(data_type, version, payload)``;
        the list starts empty again (a runner delivers them after each handler)."""
        out, self._emitted = self._emitted, []
        return out


_CONTEXT: "WorkerContext | None" = None


def activate(ctx: "WorkerContext | None") -> None:
    """Make ``ctx`` the context ``current_context()`` returns (a runner, before a handler runs)."""
    global _CONTEXT
    _CONTEXT = ctx


def current_context() -> WorkerContext:
    """The context of the instance running the current handler."""
    if _CONTEXT is None:
        from hpc_verl.errors import DataflowError

        raise DataflowError("current_context() is only available inside a dataflow node's handler")
    return _CONTEXT
