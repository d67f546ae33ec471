"""Declaring an RL dataflow: nodes (functions or classes with resources and a
parallelism) joined by data edges and versioned control edges.

Pure Python, no Ray: a graph can be built, validated and planned anywhere.
"""
from __future__ import annotations

import inspect
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Union

from hpc_verl.errors import DataflowError
from hpc_verl.util.suggest import did_you_mean

# Items at or below this size are "small": their edge is co-located like co_locate=True.
SMALL_ITEM_BYTES = 10_000_000
CONSISTENCIES = ("eventual", "strong")

_current = threading.local()


def _graph_in_scope() -> "DataflowGraph | None":
    stack = getattr(_current, "stack", None)
    return stack[-1] if stack else None


def _check_name(kind: str, name: Any) -> str:
    if not isinstance(name, str) or not name or not name.replace("_", "a").replace("-", "a").isalnum():
        raise DataflowError(f"{kind} name {name!r} is invalid: use letters, digits, '_' or '-'")
    return name


class DataflowRunError(DataflowError):
    """A node's handler failed while the graph ran (names the node and instance)."""


class Node:
    """One stage of the dataflow: ``parallelism`` instances of a function or a class."""

    def __init__(self, name: str, target: Union[Callable[..., Any], type, None] = None, resources: dict[str, float] | None = None,
                 parallelism: int = 1, *, init_args: Iterable[Any] = (), init_kwargs: dict[str, Any] | None = None,
                 method: str = "process", control_method: str = "on_control", ulysses: bool | None = None,
                 min_parallelism: int = 1, max_parallelism: int | None = None, func: Any = None) -> None:
        self.name = _check_name("node", name)
        if target is None and func is not None:
            target = func
        if not callable(target):
            raise DataflowError(f"node '{name}': target {target!r} is neither a function nor a class")
        self.target = target
        self.is_class = inspect.isclass(target)
        res = dict(resources or {})
        for key, value in res.items():
            if not isinstance(value, (int, float)) or value < 0 or math.isnan(value):
                raise DataflowError(f"node '{name}': resource {key}={value!r} must be a number >= 0")
        gpu = float(res.get("GPU", 0))
        if gpu > 1 and gpu != int(gpu):
            raise DataflowError(f"node '{name}': GPU={gpu} per instance: above 1 it must be a whole number")
        self.resources = {k: float(v) for k, v in res.items() if float(v) > 0}
        if not isinstance(parallelism, int) or parallelism < 1:
            raise DataflowError(f"node '{name}': parallelism={parallelism!r} must be an int >= 1")
        if min_parallelism < 1 or min_parallelism > parallelism:
            raise DataflowError(f"node '{name}': min_parallelism={min_parallelism} must be in 1..parallelism")
        if max_parallelism is not None and max_parallelism < parallelism:
            raise DataflowError(f"node '{name}': max_parallelism={max_parallelism} is below parallelism={parallelism}")
        self.parallelism = parallelism
        self.min_parallelism = min_parallelism
        self.max_parallelism = max_parallelism
        self.init_args = tuple(init_args)
        self.init_kwargs = dict(init_kwargs or {})
        if self.is_class and not hasattr(target, method):
            raise DataflowError(f"node '{name}': class {target.__name__} has no method '{method}' "
                                f"(set Node(method=...) to the method that takes an item)")
        self.method = method
        self.control_method = control_method
        self.ulysses = ulysses
        graph = _graph_in_scope()
        if graph is not None:
            graph.add(self)

    @property
    def gpus(self) -> float:
        return self.resources.get("GPU", 0.0)

    def __repr__(self) -> str:
        kind = self.target.__name__ if hasattr(self.target, "__name__") else repr(self.target)
        return f"Node({self.name!r}, {kind}, resources={self.resources}, parallelism={self.parallelism})"


@dataclass(eq=False)
class Edge:
    """A data edge (items) or a control edge (versioned state, broadcast to every dst instance)."""

    src: Union[Node, str]
    dst: Union[Node, str]
    data_type: str = ""
    control: bool = False
    co_locate: bool = False
    max_size_bytes: int | None = None
    consistency: str = "eventual"
    capacity: int = 256
    threshold: int | None = None

    def __post_init__(self) -> None:
        if self.consistency not in CONSISTENCIES:
            raise DataflowError(f"edge {self.src_name}->{self.dst_name}: consistency={self.consistency!r}"
                                f"{did_you_mean(str(self.consistency), CONSISTENCIES)}; use 'eventual' or 'strong'")
        if self.consistency == "strong" and not self.control:
            raise DataflowError(f"edge {self.src_name}->{self.dst_name}: consistency='strong' is for control "
                                f"edges; add control=True")
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise DataflowError(f"edge {self.src_name}->{self.dst_name}: capacity={self.capacity!r} must be an int >= 1")
        if self.threshold is None:
            self.threshold = max(1, (3 * self.capacity) // 4)
        if not 1 <= self.threshold <= self.capacity:
            raise DataflowError(f"edge {self.src_name}->{self.dst_name}: threshold={self.threshold} must be in "
                                f"1..capacity ({self.capacity})")
        if self.max_size_bytes is not None and self.max_size_bytes <= 0:
            raise DataflowError(f"edge {self.src_name}->{self.dst_name}: max_size_bytes must be > 0")
        graph = _graph_in_scope()
        if graph is not None:
            graph.add(self)

    @property
    def src_name(self) -> str:
        return self.src.name if isinstance(self.src, Node) else str(self.src)

    @property
    def dst_name(self) -> str:
        return self.dst.name if isinstance(self.dst, Node) else str(self.dst)

    @property
    def key(self) -> str:
        return f"{self.src_name}->{self.dst_name}"

    @property
    def colocated(self) -> bool:
        """Producer and consumer share a node: asked for, or the items are small."""
        if self.control:
            return False
        return self.co_locate or (self.max_size_bytes is not None and self.max_size_bytes <= SMALL_ITEM_BYTES)


class DataflowGraph:
    """A named set of nodes and edges; ``with graph:`` adds Nodes/Edges made inside it."""

    def __init__(self, name: str) -> None:
        self.name = _check_name("graph", name)
        self.nodes: dict[str, Node] = {}
        self.edges: list[Edge] = []

    def __enter__(self) -> "DataflowGraph":
        if not hasattr(_current, "stack"):
            _current.stack = []
        _current.stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _current.stack.pop()

    def add(self, item: Union[Node, Edge]) -> Any:
        """Add a node or an edge; returns it (so ``x = graph.add(Node(...))`` reads well)."""
        if isinstance(item, Node):
            if item.name in self.nodes and self.nodes[item.name] is not item:
                raise DataflowError(f"graph '{self.name}': two nodes are named '{item.name}'; names must be unique")
            self.nodes[item.name] = item
        elif isinstance(item, Edge):
            if not any(e is item for e in self.edges):
                self.edges.append(item)
        else:
            raise DataflowError(f"graph '{self.name}': cannot add {item!r}; add a Node or an Edge")
        return item

    # ---- queries -------------------------------------------------------------------
    def data_edges(self) -> list[Edge]:
        return [e for e in self.edges if not e.control]

    def control_edges(self) -> list[Edge]:
        return [e for e in self.edges if e.control]

    def in_edges(self, node: str, control: bool | None = False) -> list[Edge]:
        return [e for e in self.edges if e.dst_name == node and (control is None or e.control == control)]

    def out_edges(self, node: str, control: bool | None = False) -> list[Edge]:
        return [e for e in self.edges if e.src_name == node and (control is None or e.control == control)]

    def services(self) -> list[str]:
        """Nodes without any data edge in a graph that has data edges: driven only by
        ``call_all``/control messages (e.g. the actor update), never fed by ``run``."""
        if not self.data_edges():
            return []
        return [n for n in self.nodes if not self.in_edges(n) and not self.out_edges(n)]

    def flow_nodes(self) -> list[str]:
        """Nodes that items pass through, in topological order."""
        services = set(self.services())
        return [n for n in self.topo_order() if n not in services]

    def sources(self) -> list[str]:
        """Nodes fed by the driver: no incoming data edge (services excluded)."""
        services = set(self.services())
        return [n for n in self.nodes if not self.in_edges(n) and n not in services]

    def sinks(self) -> list[str]:
        """Nodes whose outputs go back to the driver: no outgoing data edge (services excluded)."""
        services = set(self.services())
        return [n for n in self.nodes if not self.out_edges(n) and n not in services]

    def edge(self, ref: Union[Edge, str]) -> Edge:
        """Find an edge by object, ``"src->dst"`` or the data_type of a control edge."""
        if isinstance(ref, Edge):
            return ref
        for e in self.edges:
            if e.key == ref:
                return e
        matches = [e for e in self.edges if e.data_type == ref]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise DataflowError(f"graph '{self.name}': data_type '{ref}' names {len(matches)} edges; "
                                f"use 'src->dst' instead")
        names = [e.key for e in self.edges] + [e.data_type for e in self.edges if e.data_type]
        raise DataflowError(f"graph '{self.name}': no edge '{ref}'{did_you_mean(str(ref), names)}; "
                            f"edges: {', '.join(e.key for e in self.edges)}")

    def topo_order(self) -> list[str]:
        """Nodes in data-edge order (validate() guarantees there is one)."""
        indeg = {n: 0 for n in self.nodes}
        for e in self.data_edges():
            indeg[e.dst_name] += 1
        ready = [n for n in self.nodes if indeg[n] == 0]
        order: list[str] = []
        while ready:
            n = ready.pop(0)
            order.append(n)
            for e in self.out_edges(n):
                indeg[e.dst_name] -= 1
                if indeg[e.dst_name] == 0:
                    ready.append(e.dst_name)
        return order

    # ---- validation ----------------------------------------------------------------
    def validate(self) -> None:
        """Raise DataflowError (one line) for the first problem found."""
        if not self.nodes:
            raise DataflowError(f"graph '{self.name}' has no nodes; add Node(...) objects to it")
        seen: set[str] = set()
        for e in self.edges:
            for end, ref in (("src", e.src), ("dst", e.dst)):
                name = ref.name if isinstance(ref, Node) else str(ref)
                if name not in self.nodes:
                    raise DataflowError(f"graph '{self.name}': edge {e.key} names unknown {end} node '{name}'"
                                        f"{did_you_mean(name, self.nodes)}; add the node or fix the name")
                if isinstance(ref, Node) and self.nodes[name] is not ref:
                    raise DataflowError(f"graph '{self.name}': edge {e.key} points at a different Node object "
                                        f"named '{name}' than the graph's; reuse the graph's node")
            if e.src_name == e.dst_name and not e.control:
                raise DataflowError(f"graph '{self.name}': data edge {e.key} loops on itself; a node cannot "
                                    f"feed itself (use a control edge for state)")
            if e.key in seen:
                raise DataflowError(f"graph '{self.name}': edge {e.key} is declared twice (a data and a control "
                                    f"edge between the same nodes in the same direction count as twice)")
            seen.add(e.key)
        order = self.topo_order()
        if len(order) != len(self.nodes):
            cycle = self._find_cycle(set(self.nodes) - set(order))
            raise DataflowError(f"graph '{self.name}': data edges form a cycle {' -> '.join(cycle)}; the RL loop "
                                f"must close through a control edge (Edge(..., control=True))")

    def _find_cycle(self, remaining: set[str]) -> list[str]:
        start = sorted(remaining)[0]
        path, node = [start], start
        while True:
            nxt = next(e.dst_name for e in self.out_edges(node) if e.dst_name in remaining)
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            path.append(nxt)
            node = nxt

    def __repr__(self) -> str:
        return f"DataflowGraph({self.name!r}, nodes={list(self.nodes)}, edges={[e.key for e in self.edges]})"
