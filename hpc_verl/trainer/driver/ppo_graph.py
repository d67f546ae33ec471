"""The PPO loop as a DataflowGraph, placed by the HybridScheduler on Ray.

``build_ppo_graph`` declares the nodes (roles) in the worker groups that
``topology`` derives from verl's keys, and the edges between them.
``DataflowRunner`` runs one step as one item through the graph. ``InlineRunner``
executes the same graph object in this process, one rank per group, for fast
unit tests of the nodes' logic (no Ray, no scheduler).
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Mapping

from hpc_verl.errors import BootstrapError, ConfigError, install_stop_signals
from hpc_verl.util import rayready
from hpc_verl.trainer.config.topology import Topology, topology

log = logging.getLogger("hpc_verl.trainer")

POLICY_EDGE_KEY = "actor_update->actor_rollout"
_DIST_ROLES = {"actor", "critic", "ref"}


def worker_groups(cfg: Mapping, topo: Topology) -> dict[str, Any]:
    """One WorkerGroup per group of the topology (a torch.distributed group where a role trains
    or shards; rollout-only and reward-model groups are independent replicas)."""
    from hpc_verl.dataflow import WorkerGroup

    timeout = float(cfg["hpc_verl"]["collective_timeout_s"])
    return {g.name: WorkerGroup(g.name, g.world_size, g.resources, ranks_per_node=g.ranks_per_node,
                                dist=bool(_DIST_ROLES & set(g.roles)), timeout_s=timeout)
            for g in topo.groups.values()}


def build_ppo_graph(cfg: Mapping, total_steps: int, name: str = "ppo") -> Any:
    """Declare the PPO dataflow for ``cfg`` (a plain dict)."""
    from hpc_verl.dataflow import DataflowGraph, Edge, Node
    from hpc_verl.trainer.roles import nodes as N   # (torch: not at import, so Ray can start before it loads)
    from hpc_verl.trainer.roles.workers import actor_rows

    topo = topology(cfg)
    groups = worker_groups(cfg, topo)

    def group(role: str) -> Any:
        spec = topo.group_of(role)
        return groups[spec.name] if spec else None

    def light_host(role: str) -> Any:
        """Where a light routed node lives: the role's group's rank 0 (one process fewer to start)."""
        return group(role) if cfg["hpc_verl"]["light_nodes_in_rank0"] else None

    grpo = cfg["algorithm"]["adv_estimator"] != "gae"   # a critic-free estimator: GRPO, RLOO, REINFORCE++
    graph = DataflowGraph(name)
    with graph:
        # a GRPO group's n samples stay on one replica
        rollout = Node("actor_rollout", N.RolloutNode, group=group("rollout"), dispatch="split", split_key="uid",
                       init_args=(cfg,))
        if group("reward") is not None:   # a reward model: rows split over its group
            reward = Node("reward_score", N.RewardNode, group=group("reward"), dispatch="split", init_args=(cfg,))
        else:                             # rule-based: no device; in the rollout's rank 0 unless asked not to
            reward = Node("reward_score", N.RewardNode, init_args=(cfg,), host=light_host("rollout"))
        if group("ref") is not None:
            ref = Node("ref_logprob", N.RefNode, group=group("ref"), dispatch="spmd", init_args=(cfg,),
                       ulysses=_sp(cfg, "ref") > 1)
        if grpo:
            adv = Node("advantage", N.AdvantageNode, init_args=(cfg,), max_parallelism=1,
                       host=light_host("actor"))
        else:
            adv = Node("critic", N.CriticNode, group=group("critic"), dispatch="spmd", init_args=(cfg, total_steps),
                       ulysses=_sp(cfg, "critic") > 1)
        # each rank fetches only the rollout rows it trains on (the rollout cuts them out)
        actor = Node("actor_update", N.ActorNode, group=group("actor"), dispatch="spmd",
                     init_args=(cfg, total_steps), ulysses=_sp(cfg, "actor") > 1,
                     take_rows=functools.partial(actor_rows, cfg))
        # scores are a few bytes per response: keep reward next to the rollout
        Edge(rollout, reward, data_type="rollout_batch", co_locate=True)
        Edge(rollout, adv, data_type="rollout_batch")
        Edge(reward, adv, data_type="scores", max_size_bytes=1_000_000)
        if group("ref") is not None:
            Edge(rollout, ref, data_type="rollout_batch")
            Edge(ref, adv, data_type="ref_log_prob")
        Edge(rollout, actor, data_type="rollout_batch")
        Edge(adv, actor, data_type="advantages")
        Edge(actor, rollout, data_type=N.POLICY_EDGE, control=True, consistency="strong")
    return graph


def _sp(cfg: Mapping, role: str) -> int:
    """The role's Ulysses sequence-parallel size (verl 0.9's keys, resolved by load_config)."""
    if role == "critic":
        return int(cfg["critic"]["fsdp"]["ulysses_sequence_parallel_size"])
    return int(cfg["actor_rollout_ref"][role]["fsdp_config"]["ulysses_sequence_parallel_size"])


def adv_node_name(cfg: Mapping) -> str:
    return "critic" if cfg["algorithm"]["adv_estimator"] == "gae" else "advantage"


def synthetic_cluster(cfg: Mapping) -> list[Any]:
    """The cluster ``trainer.nnodes x n_gpus_per_node`` describes (plans without Ray: --dry-run)."""
    from hpc_verl.dataflow import ClusterNode

    t = cfg["trainer"]
    per = float(t["n_gpus_per_node"])
    res = {"CPU": per + 8.0} if t["device"] == "cpu" else {"CPU": 8.0 * per + 8.0, "GPU": per}
    return [ClusterNode(f"node{i}", f"node{i}", dict(res)) for i in range(int(t["nnodes"]))]


def describe_placement(cfg: Mapping) -> str:
    """What ``--dry-run`` prints: the worker groups and the placement plan on the cluster the
    config describes (batch arithmetic checked against the groups first)."""
    from hpc_verl.dataflow import make_plan
    from hpc_verl.trainer.config.schema import batch_problems_for

    problems = batch_problems_for(cfg)
    if problems:
        raise ConfigError(problems[0])
    topo = topology(cfg)
    t = cfg["trainer"]
    unit = "CPU rank(s)" if t["device"] == "cpu" else "GPU(s)"
    graph = build_ppo_graph(cfg, 1, name=f"ppo-{t['experiment_name']}")
    plan = make_plan(graph, synthetic_cluster(cfg))
    head = [f"Trainer layout: {t['nnodes']} node(s) x {t['n_gpus_per_node']} {unit}; rollout replicas: "
            f"{topo.rollout_replicas}; actor strategy {cfg['actor_rollout_ref']['actor']['strategy']}"]
    head += [f"  {line}" for line in topo.lines()]
    return "\n".join(head + [str(plan)])


def _ray_cpus_needed(cfg: Mapping) -> int:
    topo = topology(cfg)
    return int(sum(g.world_size * g.resources.get("CPU", 0.0) for g in topo.groups.values())) + 1


class DataflowRunner:
    """Runs the PPO graph under the HybridScheduler on Ray (joins or starts Ray).

    A private Ray (no address given) lives in a temp dir of its own, not ``/tmp/ray``: at
    shutdown its logs are copied to ``<run dir>/logs/ray``, every process that names that
    dir (Ray's agents outlive ``ray.shutdown()`` by a minute or two) is stopped, and the dir
    is removed."""

    def __init__(self) -> None:
        self.sched: Any = None
        self._started_ray = False
        self._ray_temp: str | None = None
        self._run_dir: Path | None = None
        self._connecting: threading.Event | None = None   # set once begin()'s thread has connected
        self._connect_error: BaseException | None = None
        self._abort = threading.Event()     # shutdown() before Ray was ready: stop waiting for it
        self._joined_here = False
        self._imported: threading.Event | None = None   # set once begin()'s thread has imported Ray
        self._head: Any = None   # trainer.privateray.PrivateRay: the head process of a private Ray

    def begin(self, cfg: Mapping) -> None:
        """Start (or join) Ray and spawn the graph's processes in a thread now: they come up
        while the driver reads the tokenizer and data (on
        a small machine these are most of the start-up); ``start`` waits for it. (Ray installs
        no signal handler outside the main thread; ours go in when ``start`` joins it.)"""
        ray = sys.modules.get("ray")   # (not imported here: see _connect)
        if self._connecting is not None or (ray is not None and ray.is_initialized()):
            return

        up = threading.Event()
        self._imported = threading.Event()

        def connect() -> None:
            try:
                self._connect(cfg)
                if self._abort.is_set():
                    return
                # the actor processes start now too: they import torch and transformers while
                # the driver does; start() gives them the step count and builds the nodes
                self.sched = self._scheduler(cfg, 0).spawn()
            except BaseException as exc:  # noqa: BLE001 - re-raised by start()
                self._connect_error = exc
            finally:
                self._imported.set()
                up.set()
        self._connecting = up
        threading.Thread(target=connect, name="hpc-verl-ray-up", daemon=True).start()
        # Two threads importing the same package tree at once can trip CPython's import deadlock
        # detector (a child module's lock taken before its parent's, gh-83065; seen with
        # importlib.abc against importlib.resources): the driver goes on once Ray and the
        # scheduler are imported. The head's start and the connect still overlap its loading.
        self._imported.wait()

    def _imports_done(self) -> None:
        """Ray and the scheduler are imported: begin() lets the driver import again."""
        import hpc_verl.dataflow  # noqa: F401

        if self._imported is not None:
            self._imported.set()

    def _await_connection(self) -> None:
        pending, self._connecting = self._connecting, None
        if pending is not None:
            pending.wait()
        err, self._connect_error = self._connect_error, None
        if err is not None:
            raise err

    def _connect(self, cfg: Mapping) -> None:
        """Join the job's Ray (``hpc_verl.ray_address`` or RAY_ADDRESS) or start a private one."""
        hv = cfg["hpc_verl"]
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            return
        address = hv["ray_address"] or os.environ.get("RAY_ADDRESS")
        if not address and os.environ.get(rayready.READY_FILE_ENV):
            # started by the job script before Ray was up: connect once its barrier has passed. Ray
            # reads the token variables when it is imported, and they are known now (the token sits
            # next to the record): import it while the cluster starts, not after
            ready_file = os.environ[rayready.READY_FILE_ENV]
            auth = rayready.auth_env(Path(ready_file).parent)
            os.environ.update(auth)
            import ray  # noqa: F401
            self._imports_done()
            ready = rayready.wait_ready(ready_file, float(os.environ.get(rayready.READY_TIMEOUT_ENV) or 600),
                                        stop=self._abort)
            if ready is None:   # shut down while waiting: connect to nothing
                return
            differ = sorted(k for k, v in auth.items() if ready.get(k, v) != v)
            if differ:
                raise BootstrapError(f"Ray readiness record {ready_file} names other token settings "
                                     f"({', '.join(differ)}) than its job's ray dir; was it written by another job?")
            os.environ.update(ready)   # RAY_ADDRESS (and the same token variables), as the script's env.sh has them
            address = ready["RAY_ADDRESS"]
        env = rayready.worker_env()
        if not address:
            self._start_private_ray(cfg, env)
            if self._head is None:   # shut down while it came up: connect to nothing
                return
            address = self._head.address
        import ray

        self._imports_done()

        self._joined_here = True
        if self._head is not None:
            ray.init(address=address, namespace="hpc_verl", log_to_driver=True, logging_level=logging.WARNING)
            log.info("private Ray in %s (removed at the end; its logs go to %s)", self._ray_temp,
                     self._run_dir / "logs" / "ray")
            return
        if address:   # our job's raylets have env already; another cluster's workers get it per job
            own = os.environ.get(rayready.WORKER_ENV_MARK) == "1"
            ray.init(address=address, namespace="hpc_verl", runtime_env=None if own else {"env_vars": env},
                     log_to_driver=True)
            return
        raise AssertionError("unreachable: no address and no private Ray")

    def _start_private_ray(self, cfg: Mapping, env: dict[str, str]) -> None:
        """A private single-node Ray on random ports, never someone else's cluster: its head runs
        in a process of its own that ends all of it when this driver dies (trainer.privateray)."""
        import tempfile

        from hpc_verl.trainer.driver import private_ray as privateray

        hv = cfg["hpc_verl"]
        os.environ.update({**env, **rayready.RAYLET_ENV})   # (the head's raylet passes them to the ranks)
        cpus = hv["ray_num_cpus"] or max(os.cpu_count() or 1, _ray_cpus_needed(cfg))
        # short and unique: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
        root = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
        _remove_stale_private_rays(root)
        self._ray_temp = tempfile.mkdtemp(prefix=f"{PRIVATE_RAY_PREFIX}{os.getpid()}-", dir=root)
        self._run_dir = Path(os.path.expanduser(hv["run_dir"]))
        self._started_ray = True
        _quiet_late_log_subscriber()
        imported = "ray" in sys.modules
        head = privateray.launch(self._ray_temp, int(cpus), str(self._run_dir / "logs" / "ray"))
        import ray  # noqa: F401 - while the head starts (after the token variables are set: Ray reads them now)
        if imported:
            _refresh_ray_auth()
        self._imports_done()
        if privateray.wait_ready(head, float(hv["start_timeout_s"]), abort=self._abort):
            self._head = head

    def start(self, cfg: Mapping, total_steps: int) -> None:
        self._await_connection()
        self._connect(cfg)
        if self._joined_here:
            install_stop_signals()   # ray.init (in the main thread) put its own SIGTERM handler (sys.exit) in place
        if self.sched is None:
            self.sched = self._scheduler(cfg, total_steps)
        else:   # spawned by begin() before the step count was known: the nodes' arguments with it
            for name, node in build_ppo_graph(cfg, total_steps).nodes.items():
                self.sched.set_init_args(name, *node.init_args, **node.init_kwargs)
        self.sched.start()
        self.log_placement()

    def log_placement(self) -> None:
        """The plan start() placed the graph by (planned once), without its decisions: the
        scheduler logged each of them as it made it."""
        log.info("dataflow plan:\n%s", self.sched.placement.describe(decisions=False))

    @staticmethod
    def _scheduler(cfg: Mapping, total_steps: int) -> Any:
        from hpc_verl.dataflow import HybridScheduler

        hv = cfg["hpc_verl"]
        run_dir = Path(os.path.expanduser(hv["run_dir"]))
        graph = build_ppo_graph(cfg, total_steps, name=f"ppo-{cfg['trainer']['experiment_name']}")
        return HybridScheduler(graph, status_file=str(run_dir / "dataflow_status.json"),
                               bucket_bytes=int(hv["weight_sync_bucket_mb"] * 2**20),
                               scratch_dir=str(run_dir), start_timeout_s=float(hv["start_timeout_s"]))

    def run_step(self, batch: dict) -> dict:
        out = self.sched.run({"actor_rollout": [batch]})
        return out["actor_update"][0]

    def stream(self, produce: Any, depth: int) -> Any:
        """Steps from ``produce()`` with ``depth`` in flight; each step's actor metrics in order."""
        for out in self.sched.stream(produce, depth):
            yield out["actor_update"]

    def call(self, node: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on every rank of the node (SPMD); rank 0's result."""
        return self.sched.call_all(node, method, *args, **kwargs)[0]

    def call_all(self, node: str, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` on every rank of the node; every rank's result, in rank order."""
        return self.sched.call_all(node, method, *args, **kwargs)

    def publish_policy(self, version: int) -> None:
        from hpc_verl.dataflow import TENSORS
        self.sched.send_control(POLICY_EDGE_KEY, TENSORS, version)

    def status(self) -> dict:
        return self.sched.get_status() if self.sched else {}

    def shutdown(self) -> None:
        try:
            self._abort.set()
            try:
                self._await_connection()   # a Ray still coming up (begin) is stopped like one that is up
            except BaseException:  # noqa: BLE001 - its error was (or is being) reported by start()
                pass
            if self.sched is not None:
                self.sched.shutdown()
        finally:
            self.sched = None
            if self._started_ray:
                import ray
                try:
                    ray.shutdown()
                finally:
                    self._started_ray = False
                    self._remove_private_ray()

    def _remove_private_ray(self) -> None:
        """Keep the private Ray's logs, stop what of it is left, remove its temp dir."""
        import shutil

        from hpc_verl.util import procs

        temp, self._ray_temp = self._ray_temp, None
        head, self._head = self._head, None
        if head is not None:
            head.stop()   # its Ray: TERM, KILL what is left after a grace period
        if not temp:
            return
        logs = Path(temp) / "session_latest" / "logs"
        if self._run_dir is not None and logs.is_dir():
            try:
                shutil.copytree(logs, self._run_dir / "logs" / "ray", symlinks=True, dirs_exist_ok=True)
            except shutil.Error as exc:   # one (src, dst, why) per file that failed
                why = exc.args[0][0][2] if exc.args and exc.args[0] else exc
                log.warning("%d of Ray's log files could not be kept in %s (%s)", len(exc.args[0]),
                            self._run_dir / "logs" / "ray", why)
            except OSError as exc:
                log.warning("Ray's logs could not be kept in %s (%s)", self._run_dir / "logs" / "ray",
                            exc.strerror or exc)
        procs.end_pids(procs.pids_using(temp), grace_s=5.0)
        shutil.rmtree(temp, ignore_errors=True)


def _refresh_ray_auth() -> None:
    """Ray reads its token settings when it is imported; where this process imported it before
    the private Ray's token was set, let it read them again."""
    if "ray" not in sys.modules:
        return
    try:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):
        pass


def _quiet_late_log_subscriber() -> None:
    """Ray's log-printing thread subscribes to the GCS a moment after ``ray.init`` returns. A run
    that fails while its private Ray comes up (a read-only run dir) shuts that Ray down first,
    and the late subscribe dies with a traceback under the run's one error line. The GCS of a
    private Ray goes away only at our shutdown, so that thread's RpcError is dropped; any other
    thread's error is reported as before."""
    if getattr(threading.excepthook, "_hpcv_quiet", False):
        return
    prev = threading.excepthook

    def hook(args: Any) -> None:
        if getattr(args.thread, "name", "") == "ray_print_logs" and type(args.exc_value).__name__ == "RpcError":
            return
        prev(args)
    hook._hpcv_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


PRIVATE_RAY_PREFIX = "hpcv-train-"   # <tmp>/hpcv-train-<driver pid>-<random>/: a private Ray's temp dir


def _remove_stale_private_rays(root: str) -> None:
    """Temp dirs of private Rays whose trainer was killed (SIGKILL leaves them): its pid is gone and
    no process holds a file in them."""
    import shutil

    from hpc_verl.util import procs

    for d in Path(root).glob(f"{PRIVATE_RAY_PREFIX}*-*"):
        pid = d.name[len(PRIVATE_RAY_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not procs.alive(int(pid)) and not procs.pids_using(str(d)):
            shutil.rmtree(d, ignore_errors=True)


class InlineRunner:
    """The same graph, executed in this process in topological order, one rank per worker
    group (tests only: no Ray, no torch.distributed)."""

    def __init__(self) -> None:
        self.instances: dict[str, Any] = {}
        self.contexts: dict[str, Any] = {}
        self.graph: Any = None

    def start(self, cfg: Mapping, total_steps: int) -> None:
        from hpc_verl.dataflow import context as C

        self.graph = build_ppo_graph(cfg, total_steps)
        for g in self.graph.groups().values():
            if g.world_size != 1:
                raise ConfigError(f"InlineRunner runs one rank per worker group; group {g.name} has "
                                  f"{g.world_size} (set trainer.nnodes=1 trainer.n_gpus_per_node=1)")
        for name in self.graph.topo_order():
            node = self.graph.nodes[name]
            ctx = C.WorkerContext(node_name=name, instance_id=f"{name}_0", index=0,
                                  out_control=[e.data_type or e.key for e in self.graph.out_edges(name, control=True)],
                                  group=node.group.name if node.group else None)
            for e in self.graph.in_edges(name, control=True):
                ctx.versions[e.key] = -1
            self.contexts[name] = ctx
            C._CONTEXT = ctx
            self.instances[name] = node.target(*node.init_args, **node.init_kwargs)

    def _enter(self, name: str) -> Any:
        from hpc_verl.dataflow import context as C
        ctx = self.contexts[name]
        C._CONTEXT = ctx
        ctx._emitted = []
        return ctx

    def _deliver(self, src: str, emitted: list) -> None:
        from hpc_verl.dataflow import TENSORS
        for data_type, version, payload in emitted:
            edge = next(e for e in self.graph.out_edges(src, control=True) if (e.data_type or e.key) == data_type)
            assert payload is TENSORS, "the PPO graph's control edge carries tensors"
            self._enter(edge.dst_name)
            self.instances[edge.dst_name].load_tensors(data_type, self.instances[src].export_tensors(data_type),
                                                       version)
            self.contexts[edge.dst_name].versions.update({edge.key: version, data_type: version})

    def run_step(self, batch: dict) -> dict:
        from hpc_verl.dataflow import spmd

        outputs: dict[str, Any] = {}
        for name in self.graph.topo_order():
            ins = self.graph.in_edges(name)
            node = self.graph.nodes[name]
            if not ins:
                item = batch
            elif len(ins) == 1:
                item = outputs[ins[0].src_name]
            else:
                item = {e.src_name: outputs[e.src_name] for e in ins}
            ctx = self._enter(name)
            if node.dispatch == "split":
                ctx.shard_rows = (0, spmd.num_rows(item, node.split_key))
            outputs[name] = getattr(self.instances[name], node.method)(item)
            self._deliver(name, list(ctx._emitted))
        return outputs["actor_update"]

    def call(self, node: str, method: str, *args: Any, **kwargs: Any) -> Any:
        self._enter(node)
        return getattr(self.instances[node], method)(*args, **kwargs)

    def call_all(self, node: str, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [self.call(node, method, *args, **kwargs)]

    def publish_policy(self, version: int) -> None:
        from hpc_verl.dataflow import TENSORS
        from hpc_verl.trainer.roles.nodes import POLICY_EDGE
        self._deliver("actor_update", [(POLICY_EDGE, version, TENSORS)])

    def stream(self, produce: Any, depth: int) -> Any:
        raise ConfigError("hpc_verl.one_step_off_policy needs the Ray runner (two steps in flight); the "
                          "in-process InlineRunner runs one step at a time")

    def status(self) -> dict:
        return {}

    def shutdown(self) -> None:
        self.instances.clear()
