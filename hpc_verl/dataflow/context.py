"""What a node's handler sees: its context and the control messages it gets.
Ray-free, so ``from hpc_verl.dataflow import current_context`` stays light."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


_CONTEXT: "WorkerContext | None" = None


def current_context() -> WorkerContext:
    """The context of the instance running the current handler."""
    if _CONTEXT is None:
        from hpc_verl.errors import DataflowError

        raise DataflowError("current_context() is only available inside a dataflow node's handler")
    return _CONTEXT
