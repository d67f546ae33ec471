"""A graph executed in this process, in topological order, one instance per node: the nodes'
logic without Ray, a scheduler or torch.distributed (unit tests, profiling one rank).

Each node runs with a ``WorkerContext`` of its own (``current_context()`` works in its
handlers); control edges are delivered after each handler, tensors from the source's
``export_tensors`` to the destination's ``load_tensors`` as the runtime does in one group.
"""
from __future__ import annotations

from typing import Any

from hpc_verl.dataflow import context as _context
from hpc_verl.dataflow import spmd
from hpc_verl.dataflow.context import TENSORS, WorkerContext
from hpc_verl.dataflow.graph import DataflowGraph
from hpc_verl.errors import DataflowError


class InlineRunner:
    """Runs ``graph`` in this process; every worker group must have one rank."""

    def __init__(self, graph: DataflowGraph) -> None:
        self.graph = graph
        self.instances: dict[str, Any] = {}
        self.contexts: dict[str, WorkerContext] = {}

    def start(self) -> "InlineRunner":
        """Check the groups and build every node's instance with its init arguments."""
        for g in self.graph.groups().values():
            if g.world_size != 1:
                raise DataflowError(f"the in-process runner runs one rank per worker group; group {g.name} "
                                    f"has {g.world_size}")
        for name in self.graph.topo_order():
            node = self.graph.nodes[name]
            ctx = WorkerContext(node_name=name, instance_id=f"{name}_0", index=0,
                                out_control=[e.data_type or e.key for e in self.graph.out_edges(name, control=True)],
                                group=node.group.name if node.group else None)
            for e in self.graph.in_edges(name, control=True):
                ctx.versions[e.key] = -1
            self.contexts[name] = ctx
            _context.activate(ctx)
            self.instances[name] = node.target(*node.init_args, **node.init_kwargs)
        return self

    def _enter(self, name: str) -> WorkerContext:
        ctx = self.contexts[name]
        _context.activate(ctx)
        ctx.take_emitted()
        return ctx

    def deliver(self, src: str, emitted: list[tuple[str, int, Any]]) -> None:
        """Hand ``src``'s control messages ``(data_type, version, TENSORS)`` to their destinations."""
        for data_type, version, payload in emitted:
            edge = next(e for e in self.graph.out_edges(src, control=True) if (e.data_type or e.key) == data_type)
            if payload is not TENSORS:
                raise DataflowError(f"the in-process runner moves tensors only; {src} emitted {payload!r} "
                                    f"on {edge.key}")
            self._enter(edge.dst_name)
            self.instances[edge.dst_name].load_tensors(data_type, self.instances[src].export_tensors(data_type),
                                                       version)
            self.contexts[edge.dst_name].versions.update({edge.key: version, data_type: version})

    def run(self, item: Any) -> dict[str, Any]:
        """One item through the graph from its sources; every node's output by node name."""
        outputs: dict[str, Any] = {}
        for name in self.graph.topo_order():
            ins = self.graph.in_edges(name)
            node = self.graph.nodes[name]
            if not ins:
                value = item
            elif len(ins) == 1:
                value = outputs[ins[0].src_name]
            else:
                value = {e.src_name: outputs[e.src_name] for e in ins}
            ctx = self._enter(name)
            if node.dispatch == "split":
                ctx.shard_rows = (0, spmd.num_rows(value, node.split_key))
            outputs[name] = getattr(self.instances[name], node.method)(value)
            self.deliver(name, ctx.take_emitted())
        return outputs

    def call(self, node: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the node's instance, in its context."""
        self._enter(node)
        return getattr(self.instances[node], method)(*args, **kwargs)

    def shutdown(self) -> None:
        self.instances.clear()
        _context.activate(None)
