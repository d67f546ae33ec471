"""The scheduler's router: pushes items through the graph and calls methods.

Data path: the driver chains actor calls by ObjectRef (like hand-written Ray
code), so items move worker to worker through the object store and the driver
only waits on the results it has to see; at most ``window`` items (the smallest
edge capacity) are in flight. A routed node's item goes to one instance (its
co-located partner's, else the least busy); a split or spmd node's item goes to
every rank of its group (the shards are cut on the worker side), and a consumer
of a split node is handed the list of shard refs to gather in rank order.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Iterator, Sequence

from hpc_verl.dataflow import pieces, spmd
from hpc_verl.dataflow.board import ControlBoard
from hpc_verl.dataflow.graph import DataflowGraph, DataflowRunError
from hpc_verl.dataflow.pool import Instance, InstancePool
from hpc_verl.errors import DataflowError
from hpc_verl.util.suggest import did_you_mean


class Track:
    """One in-flight micro-batch: the ref(s) and instance(s) of every node it passes."""

    __slots__ = ("key", "size", "refs", "insts", "waiting")

    def __init__(self, key: int, size: int) -> None:
        self.key, self.size = key, size
        self.refs: dict[str, list[Any]] = {}
        self.insts: dict[str, list[Instance]] = {}
        self.waiting = 0


class Router:
    def __init__(self, graph: DataflowGraph, pool: InstancePool, board: ControlBoard, lock: threading.RLock,
                 edge_stats: dict[str, dict[str, Any]]) -> None:
        self.graph = graph
        self.pool = pool
        self.board = board
        self.lock = lock
        self.edge_stats = edge_stats
        self.live: dict[int, Track] = {}
        self.items_in = 0
        self.items_out = 0
        self.step_lock = threading.RLock()   # held by run(): group resizes wait for the step boundary
        self._ids = itertools.count()
        self._flow = graph.flow_nodes()
        self._in_data = {n: graph.in_edges(n) for n in graph.nodes}
        self._coloc_in = {n: [e.src_name for e in self._in_data[n] if e.colocated] for n in graph.nodes}
        self._emitters = [n for n in graph.nodes if graph.out_edges(n, control=True)]
        self._watch = set(graph.sinks()) | (set(self._emitters) & set(self._flow)) | {
            n for n in self._flow if graph.nodes[n].group is not None}
        self.window = min((e.capacity for e in graph.data_edges()), default=256)
        # split nodes that cut their outputs for take_rows consumers (pieces): those consumers' groups
        self._planned = {n: [(e.dst_name, graph.nodes[e.dst_name].group.name) for e in graph.out_edges(n)
                             if graph.nodes[e.dst_name].take_rows is not None]
                         for n, nd in graph.nodes.items() if nd.dispatch == "split"}

    # ---- run -----------------------------------------------------------------------
    def run(self, inputs: dict[str, Sequence[Any]] | Sequence[Any], sinks_only: bool = True,
            micro_batch: int | str = "auto") -> dict[str, list[Any]]:
        import ray

        sources = self.graph.sources()
        if not isinstance(inputs, dict):
            if len(sources) != 1:
                raise DataflowError(f"graph '{self.graph.name}' has {len(sources)} source nodes "
                                    f"({', '.join(sources)}); pass run({{source: items}})")
            inputs = {sources[0]: inputs}
        for name in inputs:
            if name not in sources:
                raise DataflowError(f"run(): '{name}' is not a source node of graph '{self.graph.name}'"
                                    f"{did_you_mean(name, sources)}; sources: {', '.join(sources)}")
        missing = [s for s in sources if s not in inputs]
        if missing:
            raise DataflowError(f"run(): no items given for source node(s) {', '.join(missing)}")
        items = {k: list(v) for k, v in inputs.items()}
        counts = {len(v) for v in items.values()}
        if len(counts) != 1:
            sizes = {k: len(v) for k, v in items.items()}
            raise DataflowError(f"run(): sources got different numbers of items ({sizes}); item i of every "
                                f"source shares one id, so give each the same count")
        n = counts.pop()
        with self.step_lock:
            mb = self._micro_batch(n, micro_batch)
            keep = list(self._flow) if not sinks_only else self.graph.sinks()
            result: dict[str, list[Track]] = {k: [] for k in keep}
            waiting: dict[Any, Track] = {}
            pos = active = 0
            try:
                while pos < n or active:
                    while pos < n and active < self.window:
                        size = min(mb, n - pos, max(1, self.window - active))
                        track = self._submit({s: items[s][pos:pos + size] for s in sources}, size)
                        for name in keep:
                            result[name].append(track)
                        self._watch_refs(track, waiting)
                        pos += size
                        active += size
                    refs = list(waiting)
                    ready, _ = ray.wait(refs, num_returns=max(1, len(refs) // 4), fetch_local=False)
                    active -= sum(t.size for t in self._settle(ready, waiting))
                out = {name: self._gather(name, result[name]) for name in keep}
                self.board.wait_pending()
            except Exception as exc:  # noqa: BLE001 - turned into one clear error
                tracks = {id(t): t for ts in result.values() for t in ts}
                tracks.update({id(t): t for t in waiting.values()})
                raise self.run_error(exc, list(tracks.values())) from None
            finally:
                self._abandon({id(t): t for t in waiting.values()}.values())
        with self.lock:
            self.items_out += n
        return out

    def stream(self, produce: Callable[[], Any], depth: int) -> Iterator[dict[str, Any]]:
        """Items from ``produce()`` (one per call; None: no more) into the single source, at most
        ``depth`` in flight; yields each item's sink outputs, in input order, as it completes. An
        item is submitted with the control versions published when it is submitted, so with
        depth 2 an item may be generated one version behind the one it is trained at (the
        caller's one-step-off-policy mode). Holds the step lock while it runs."""
        import ray

        sources = self.graph.sources()
        if len(sources) != 1:
            raise DataflowError(f"stream(): graph '{self.graph.name}' has {len(sources)} sources; it needs one")
        if not isinstance(depth, int) or depth < 1:
            raise DataflowError(f"stream(): depth={depth!r} must be an int >= 1")
        sinks = self.graph.sinks()
        with self.step_lock:
            pending: list[Track] = []
            waiting: dict[Any, Track] = {}
            exhausted = False
            try:
                while True:
                    while not exhausted and len(pending) < depth:
                        item = produce()
                        if item is None:
                            exhausted = True
                            break
                        track = self._submit({sources[0]: [item]}, 1)
                        pending.append(track)
                        self._watch_refs(track, waiting)
                    if not pending:
                        return
                    head = pending[0]
                    while head.key in self.live:
                        ready, _ = ray.wait(list(waiting), num_returns=1, fetch_local=False)
                        self._settle(ready, waiting)
                    pending.pop(0)
                    out = {name: self._gather(name, [head])[0] for name in sinks}
                    with self.lock:
                        self.items_out += 1
                    yield out
            except GeneratorExit:
                raise
            except Exception as exc:  # noqa: BLE001 - turned into one clear error
                raise self.run_error(exc, pending) from None
            finally:
                self._abandon(pending)
                if not pending:
                    self.board.wait_pending()   # the last snapshot transfer, before anyone saves

    def _watch_refs(self, track: Track, waiting: dict[Any, Track]) -> None:
        """The refs that tell when ``track`` is done (sinks, emitters, every rank of a group)."""
        for name in self._watch:
            for ref in track.refs[name]:
                waiting[ref] = track
                track.waiting += 1

    def _settle(self, ready: list[Any], waiting: dict[Any, Track]) -> list[Track]:
        """Count ready refs off their tracks; complete (publish the controls of) the finished ones."""
        done = []
        for ref in ready:
            track = waiting.pop(ref)
            track.waiting -= 1
            if track.waiting == 0:
                self._complete(track)
                done.append(track)
        return done

    def _gather(self, name: str, tracks: list[Track]) -> list[Any]:
        """The node's outputs in input order (split shards collected, spmd: rank 0's), fetched by
        one ``ray.get`` for all tracks."""
        import ray

        node = self.graph.nodes[name]
        if node.dispatch == "split":
            per = [len(track.refs[name]) for track in tracks]
            flat = ray.get([ref for track in tracks for ref in track.refs[name]])
            vals: list[Any] = []
            pos = 0
            for n in per:
                vals.extend(spmd.gather_items([pieces.outputs(e) for e in flat[pos:pos + n]], node.collect))
                pos += n
            return vals
        return [v for env in ray.get([track.refs[name][0] for track in tracks]) for v in env[1]]

    def _abandon(self, tracks: Any) -> None:
        """Forget items a failed run left in flight (their instances may be drained)."""
        with self.lock:
            for track in tracks:
                if self.live.pop(track.key, None) is not None:
                    for insts in track.insts.values():
                        for inst in insts:
                            inst.outstanding -= track.size

    def _micro_batch(self, n: int, micro_batch: int | str) -> int:
        if micro_batch == "auto":
            if any(self.graph.nodes[x].group is not None for x in self._flow):
                return 1  # a worker group's ranks take every item together: batches, not packed items
            slots = sum(max(1, len(self.pool.routable[node])) for node in self._flow)
            return max(1, min(32, n // (8 * slots), self.window // (2 * slots)))
        if not isinstance(micro_batch, int) or micro_batch < 1:
            raise DataflowError(f"run(): micro_batch={micro_batch!r} must be an int >= 1 or 'auto'")
        return min(micro_batch, self.window)

    def _arg(self, track: Track, src: str) -> Any:
        dispatch = self.graph.nodes[src].dispatch
        if dispatch == "split":
            return list(track.refs[src])   # nested: the consumer gathers the shards
        return track.refs[src][0]           # routed, or rank 0 of an spmd group (resolved by Ray)

    def _submit(self, values: dict[str, list], size: int) -> Track:
        import ray

        track = Track(next(self._ids), size)
        with self.lock:
            self.items_in += size
            for node in self._flow:
                nd = self.graph.nodes[node]
                ins = self._in_data[node]
                required = self.board.required_for(node)
                if ins:
                    args = [self._arg(track, e.src_name) for e in ins]
                elif nd.group is not None:
                    args = [ray.put(values[node])]   # once, for every rank
                else:
                    args = [values[node]]
                if nd.group is None:
                    insts = [self._choose(node, track)]
                else:
                    insts = list(self.pool.routable[node])
                    if not insts:
                        raise DataflowError(f"node '{node}' has no live ranks")
                planned = self._planned.get(node)
                if required is None and nd.group is None and len(insts[0].proc.nodes) == 1:
                    track.refs[node] = [insts[0].handle.run_sole.remote(*args)]
                elif planned:   # the consumers' current sizes: the producer cuts their rows out
                    sizes = {dst: self.pool.world[group] for dst, group in planned}
                    track.refs[node] = [i.handle.run.remote(node, required, *args, plans=sizes) for i in insts]
                else:
                    track.refs[node] = [i.handle.run.remote(node, required, *args) for i in insts]
                track.insts[node] = insts
                for inst in insts:
                    inst.outstanding += size
            self.live[track.key] = track
        return track

    def _choose(self, node: str, track: Track) -> Instance:
        cands = self.pool.routable[node]
        if not cands:
            raise DataflowError(f"node '{node}' has no live instance to take items; raise its parallelism")
        partners = self._coloc_in[node]
        if partners and len(cands) > 1:
            up = track.insts[partners[0]][0]
            same = [c for c in cands if c.plan.bundle == up.plan.bundle]
            if not same:
                same = [c for c in cands if c.ray_node_id == up.ray_node_id]
            if same:
                cands = same
            else:
                self.edge_stats[f"{partners[0]}->{node}"]["cross_node"] += track.size
        if len(cands) == 1:
            return cands[0]
        return min(cands, key=lambda c: c.outstanding)

    def _complete(self, track: Track) -> None:
        import ray

        with self.lock:
            if self.live.pop(track.key, None) is None:
                return
            for insts in track.insts.values():
                for inst in insts:
                    inst.outstanding -= track.size
            for e in self.graph.data_edges():
                self.edge_stats[e.key]["items"] += track.size
        for node in self._emitters:
            if node not in track.refs:
                continue
            for ref in track.refs[node]:
                self.publish_emitted(node, ray.get(ref)[2])

    def publish_emitted(self, node: str, emitted: list | None) -> None:
        for data_type, version, payload in emitted or ():
            edge = next(e for e in self.graph.out_edges(node, control=True) if (e.data_type or e.key) == data_type)
            self.board.publish(edge, payload, version, src=node, strict=False, is_ref=True)

    # ---- method calls --------------------------------------------------------------
    def call(self, node_name: str, method: str, args_per_instance: list[tuple], kwargs: dict) -> list[Any]:
        with self.step_lock:   # never in the middle of a resize (the driver's own thread re-enters)
            return self._call(node_name, method, args_per_instance, kwargs)

    def _call(self, node_name: str, method: str, args_per_instance: list[tuple], kwargs: dict) -> list[Any]:
        import ray

        insts = sorted(self.pool.routable[node_name], key=lambda i: i.index)
        if len(args_per_instance) == 1 and len(insts) > 1:
            args_per_instance = args_per_instance * len(insts)
        if len(args_per_instance) != len(insts):
            raise DataflowError(f"call_each('{node_name}', '{method}'): {len(args_per_instance)} argument tuples "
                                f"for {len(insts)} instances; give one per instance")
        required = self.board.required_for(node_name)
        refs = [i.handle.call.remote(node_name, method, tuple(a), kwargs, required)
                for i, a in zip(insts, args_per_instance)]
        try:
            pairs = ray.get(refs)
        except Exception as exc:  # noqa: BLE001
            raise self.run_error(exc, [], calls=list(zip(refs, insts))) from None
        for _, emitted in pairs:
            self.publish_emitted(node_name, emitted)
        return [result for result, _ in pairs]

    # ---- errors --------------------------------------------------------------------
    def run_error(self, exc: BaseException, tracks: list[Track], calls: list | None = None) -> DataflowError:
        """One line for a failed run or call; a rank that died is named before the ranks
        that failed because of it (a collective broken by the dead peer)."""
        import ray

        pairs = list(calls or [])
        for t in tracks:
            for node, refs in t.refs.items():
                pairs.extend(zip(refs, t.insts[node]))
        dead, failed = [], []
        if pairs:
            ready, _ = ray.wait([r for r, _ in pairs], num_returns=len(pairs), timeout=1.0, fetch_local=False)
            ready_set = set(ready)
            for ref, inst in pairs:
                if ref not in ready_set:
                    continue
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError as e:
                    dead.append((inst, e))
                except Exception as e:  # noqa: BLE001
                    failed.append((inst, e))
        if dead:
            inst, e = dead[0]
            return DataflowRunError(f"graph '{self.graph.name}': {inst.where()} died ({_death_cause(e)}); "
                                    f"the step was stopped")
        cause_exc = failed[0][1] if failed else exc
        where_inst = failed[0][0] if failed else self._find(str(exc))
        cause = (cause_exc.cause if isinstance(cause_exc, ray.exceptions.RayTaskError)
                 and cause_exc.cause is not None else cause_exc)
        if isinstance(cause, DataflowError):
            return cause
        where = f" in {where_inst.where()}" if where_inst is not None else ""
        text = str(cause).strip()
        first = text.splitlines()[-1] if text else type(cause).__name__
        return DataflowRunError(f"graph '{self.graph.name}': a node failed{where}: {type(cause).__name__}: {first}")

    def _find(self, text: str) -> Instance | None:
        for inst in self.pool.all_instances():
            if inst.handle._actor_id.hex() in text:
                return inst
        return None


def _death_cause(exc: BaseException) -> str:
    text = str(exc)
    if "node has died" in text or "node died" in text:
        return "its Ray node is gone"
    for marker in ("Worker exit type: ", "exit_type="):
        if marker in text:
            kind = text.split(marker, 1)[1].split()[0].strip(",.")
            return f"process exited: {kind}; killed, out of memory or crashed"
    return "process exited"
