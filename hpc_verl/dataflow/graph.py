"""Declaring an RL dataflow: nodes (functions or classes with resources and a
parallelism) joined by data edges and versioned control edges.

A node is dispatched one of three ways:

- ``route`` (default): each item goes to one instance (the least busy); the
  instances are independent replicas (a rule reward, say);
- ``split``: each item is split over all instances (rows, or groups of rows that
  share ``split_key``), every instance handles its shard and the shards are
  gathered back in input order (rollout replicas, a reference forward);
- ``spmd``: every instance gets the whole item and runs the same method as one
  rank of a torch.distributed group; the result is rank 0's (a DDP/FSDP update).

Split and spmd nodes live in a :class:`WorkerGroup`: W processes, one rank per
resource bundle. Nodes that name the same group share its processes (verl's
hybrid engine: actor, rollout and reference in one process per GPU).

Pure Python, no Ray: a graph can be built, validated and planned anywhere.
"""
from __future__ import annotations

import inspect
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, Union

from hpc_verl.errors import DataflowError
from hpc_verl.util.suggest import did_you_mean

# Items at or below this size are "small": their edge is co-located like co_locate=True.
SMALL_ITEM_BYTES = 10_000_000
CONSISTENCIES = ("eventual", "strong")
DISPATCHES = ("route", "split", "spmd")
BACKENDS = ("auto", "gloo", "nccl")

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


def _check_resources(kind: str, resources: dict[str, float] | None) -> dict[str, float]:
    res = dict(resources or {})
    for key, value in res.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or math.isnan(value):
            raise DataflowError(f"{kind}: resource {key}={value!r} must be a number >= 0")
    gpu = float(res.get("GPU", 0))
    if gpu > 1 and gpu != int(gpu):
        raise DataflowError(f"{kind}: GPU={gpu} per instance: above 1 it must be a whole number")
    return {k: float(v) for k, v in res.items() if float(v) > 0}


class WorkerGroup:
    """W processes (ranks) that host one or more split/spmd nodes.

    With ``dist=True`` the ranks form one torch.distributed process group
    (``backend`` "auto": NCCL where CUDA is visible, gloo otherwise) whose
    rendezvous is rank 0's address; collectives time out after ``timeout_s``, so
    a dead rank ends a step instead of hanging it. ``ranks_per_node`` packs the
    ranks onto Ray nodes in order (verl's ``n_gpus_per_node``); None: first fit.
    """

    def __init__(self, name: str, world_size: int, resources: dict[str, float] | None = None, *,
                 ranks_per_node: int | None = None, dist: bool = True, backend: str = "auto",
                 timeout_s: float = 600.0) -> None:
        self.name = _check_name("worker group", name)
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise DataflowError(f"worker group '{name}': world_size={world_size!r} must be an int >= 1")
        if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
            raise DataflowError(f"worker group '{name}': ranks_per_node={ranks_per_node!r} must be an int >= 1")
        if backend not in BACKENDS:
            raise DataflowError(f"worker group '{name}': backend={backend!r}{did_you_mean(str(backend), BACKENDS)}; "
                                f"use one of {', '.join(BACKENDS)}")
        if not timeout_s or timeout_s <= 0:
            raise DataflowError(f"worker group '{name}': timeout_s={timeout_s!r} must be > 0")
        self.world_size = world_size
        self.resources = _check_resources(f"worker group '{name}'", resources)
        self.ranks_per_node = ranks_per_node
        self.dist = bool(dist)
        self.backend = backend
        self.timeout_s = float(timeout_s)

    @property
    def gpus(self) -> float:
        return self.resources.get("GPU", 0.0)

    def __repr__(self) -> str:
        return (f"WorkerGroup({self.name!r}, world_size={self.world_size}, resources={self.resources}, "
                f"dist={self.dist})")


class Node:
    """One stage of the dataflow: ``parallelism`` instances of a function or a class."""

    def __init__(self, name: str, target: Union[Callable[..., Any], type, None] = None, resources: dict[str, float] | None = None,
                 parallelism: int | None = None, *, init_args: Iterable[Any] = (), init_kwargs: dict[str, Any] | None = None,
                 method: str = "process", control_method: str = "on_control", ulysses: bool | None = None,
                 min_parallelism: int = 1, max_parallelism: int | None = None, func: Any = None,
                 group: WorkerGroup | None = None, dispatch: str | None = None, split_key: str | None = None,
                 collect: Callable[[list[Any]], Any] | None = None, host: WorkerGroup | None = None,
                 take_rows: Callable[[int, int, int, Any], Sequence[int]] | None = None) -> None:
        self.name = _check_name("node", name)
        if target is None and func is not None:
            target = func
        if not callable(target):
            raise DataflowError(f"node '{name}': target {target!r} is neither a function nor a class")
        self.target = target
        self.is_class = inspect.isclass(target)
        if dispatch is None:
            dispatch = ("spmd" if group.dist else "split") if group is not None else "route"
        if dispatch not in DISPATCHES:
            raise DataflowError(f"node '{name}': dispatch={dispatch!r}{did_you_mean(str(dispatch), DISPATCHES)}; "
                                f"use one of {', '.join(DISPATCHES)}")
        self.dispatch = dispatch
        res = _check_resources(f"node '{name}'", resources)
        if dispatch == "route":
            if group is not None:
                raise DataflowError(f"node '{name}': a node in worker group '{group.name}' is dispatched 'split' "
                                    f"or 'spmd', not 'route'")
        else:
            if group is None:  # a group of its own: its parallelism and resources
                group = WorkerGroup(name, parallelism or 1, res, dist=dispatch == "spmd")
            elif parallelism not in (None, group.world_size) or (res and res != group.resources):
                raise DataflowError(f"node '{name}': parallelism and resources come from its worker group "
                                    f"'{group.name}' (world_size={group.world_size}, {group.resources}); "
                                    f"leave them unset")
            if dispatch == "spmd" and not group.dist:
                raise DataflowError(f"node '{name}': dispatch='spmd' needs a worker group with dist=True "
                                    f"('{group.name}' has dist=False)")
            parallelism, res = group.world_size, dict(group.resources)
        if host is not None:
            # a light routed node in rank 0's process of a worker group: no process (start-up) of its own
            if dispatch != "route" or not isinstance(host, WorkerGroup):
                raise DataflowError(f"node '{name}': host= takes a WorkerGroup, for a routed node (no group=)")
            if parallelism not in (None, 1) or min_parallelism != 1 or max_parallelism not in (None, 1) or res:
                raise DataflowError(f"node '{name}': a node hosted in worker group '{host.name}' has one instance "
                                    f"in rank 0's process, on its resources; leave parallelism and resources unset")
            max_parallelism = 1
        if split_key is not None and dispatch != "split":
            raise DataflowError(f"node '{name}': split_key is for dispatch='split' nodes")
        if collect is not None and not callable(collect):
            raise DataflowError(f"node '{name}': collect={collect!r} must be a function of the list of shards")
        if take_rows is not None and (dispatch != "spmd" or not callable(take_rows)):
            raise DataflowError(f"node '{name}': take_rows is a function (rows, rank, world, item) -> the rows "
                                f"this rank consumes, for a dispatch='spmd' node")
        # the rows of an item from a split producer that each rank consumes: the producer cuts them out,
        # and a rank fetches only its own (None: every rank fetches every shard)
        self.take_rows = take_rows
        self.group = group
        self.host = host
        self.split_key = split_key
        self.collect = collect
        self.resources = res
        if parallelism is None:
            parallelism = 1
        if not isinstance(parallelism, int) or isinstance(parallelism, bool) or parallelism < 1:
            raise DataflowError(f"node '{name}': parallelism={parallelism!r} must be an int >= 1")
        if min_parallelism < 1 or (dispatch == "route" and min_parallelism > parallelism):
            raise DataflowError(f"node '{name}': min_parallelism={min_parallelism} must be in 1..parallelism")
        if max_parallelism is not None and max_parallelism < max(parallelism, min_parallelism):
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
        extra = f", group={self.group.name!r}, dispatch={self.dispatch!r}" if self.group is not None else ""
        return f"Node({self.name!r}, {kind}, resources={self.resources}, parallelism={self.parallelism}{extra})"


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
    def groups(self) -> dict[str, WorkerGroup]:
        """The worker groups of the split/spmd nodes, by name (first declared first)."""
        out: dict[str, WorkerGroup] = {}
        for node in self.nodes.values():
            if node.group is not None:
                out.setdefault(node.group.name, node.group)
        return out

    def group_nodes(self, group: str) -> list[str]:
        """The nodes a worker group hosts, in topological order."""
        return [n for n in self.topo_order() if self.nodes[n].group is not None and self.nodes[n].group.name == group]

    def hosted_nodes(self, group: str) -> list[str]:
        """The routed nodes that live in the group's rank-0 process (``Node(host=...)``)."""
        return [n for n in self.topo_order() if self.nodes[n].host is not None and self.nodes[n].host.name == group]

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
        groups: dict[str, WorkerGroup] = {}
        for node in self.nodes.values():
            g = node.group
            if g is not None and groups.setdefault(g.name, g) is not g:
                raise DataflowError(f"graph '{self.name}': two different worker groups are named '{g.name}'; "
                                    f"pass the same WorkerGroup object to every node it hosts")
        for node in self.nodes.values():
            if node.host is not None and groups.get(node.host.name) is not node.host:
                raise DataflowError(f"graph '{self.name}': node '{node.name}' is hosted in worker group "
                                    f"'{node.host.name}', which hosts no node of this graph; pass a group of it")
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
