"""The PPO graph on Ray: ``DataflowRunner`` joins the job's Ray (or starts a private one,
private_ray.py) and runs each step as one item under the HybridScheduler.

Driver; no torch. Ray is imported in a thread of its own while the driver loads its data
(``begin``), so nothing heavy is imported at this module's top.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from hpc_verl.errors import BootstrapError, install_stop_signals
from hpc_verl.trainer.config.topology import topology
from hpc_verl.trainer.driver.ppo_graph import POLICY_EDGE_KEY, build_ppo_graph
from hpc_verl.dataflow.context import TENSORS
from hpc_verl.trainer.roles.nodes import ACTOR_NODE, ROLLOUT_NODE
from hpc_verl.trainer.driver import private_ray
from hpc_verl.util import procs, rayready

log = logging.getLogger("hpc_verl.trainer")
#: starts of a private Ray whose raylet missed Ray's registration bound (private_ray.SlowRegistration)
PRIVATE_RAY_TRIES = 2


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
        self._head: Any = None   # trainer.private_ray.PrivateRay: the head process of a private Ray

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
        import hpc_verl.dataflow  # noqa: F401 - lazy: the scheduler loads in the Ray-up thread, beside the driver

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
        in a process of its own that ends all of it when this driver dies (driver/private_ray.py)."""
        hv = cfg["hpc_verl"]
        os.environ.update({**env, **rayready.RAYLET_ENV})   # (the head's raylet passes them to the ranks)
        cpus = hv["ray_num_cpus"] or max(os.cpu_count() or 1, _ray_cpus_needed(cfg))
        # short and unique: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
        root = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
        _remove_stale_private_rays(root)
        self._run_dir = Path(os.path.expanduser(hv["run_dir"]))
        self._started_ray = True
        _quiet_late_log_subscriber()
        deadline = time.monotonic() + float(hv["start_timeout_s"])
        for attempt in range(1, PRIVATE_RAY_TRIES + 1):
            self._ray_temp = tempfile.mkdtemp(prefix=f"{PRIVATE_RAY_PREFIX}{os.getpid()}-", dir=root)
            imported = "ray" in sys.modules
            head = private_ray.launch(self._ray_temp, int(cpus), str(self._run_dir / "logs" / "ray"), attempt)
            import ray  # noqa: F401 - while the head starts (after the token variables are set: Ray reads them now)
            if imported:   # (a retry's token is another file)
                _refresh_ray_auth()
            self._imports_done()
            try:
                if private_ray.wait_ready(head, max(deadline - time.monotonic(), 1.0), abort=self._abort):
                    self._head = head
                return
            except private_ray.SlowRegistration:
                if attempt == PRIVATE_RAY_TRIES:
                    raise
                kept: Path | str = self._run_dir / "logs" / f"private-ray-head-{attempt}.log"
                try:
                    kept.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(Path(self._ray_temp) / private_ray.HEAD_LOG, kept)
                except OSError as err:
                    kept = f"not kept: {err}"
                log.warning("the private Ray's raylet missed Ray's fixed registration bound (a loaded machine); "
                            "starting it once more (the first head's log: %s)", kept)
                shutil.rmtree(self._ray_temp, ignore_errors=True)

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
        from hpc_verl.dataflow import HybridScheduler   # lazy: imported in the Ray-up thread (begin)

        hv = cfg["hpc_verl"]
        run_dir = Path(os.path.expanduser(hv["run_dir"]))
        graph = build_ppo_graph(cfg, total_steps, name=f"ppo-{cfg['trainer']['experiment_name']}")
        return HybridScheduler(graph, status_file=str(run_dir / "dataflow_status.json"),
                               bucket_bytes=int(hv["weight_sync_bucket_mb"] * 2**20),
                               scratch_dir=str(run_dir), start_timeout_s=float(hv["start_timeout_s"]))

    def run_step(self, batch: dict) -> dict:
        out = self.sched.run({ROLLOUT_NODE: [batch]})
        return out[ACTOR_NODE][0]

    def stream(self, produce: Any, depth: int) -> Any:
        """Steps from ``produce()`` with ``depth`` in flight; each step's actor metrics in order."""
        for out in self.sched.stream(produce, depth):
            yield out[ACTOR_NODE]

    def call(self, node: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on every rank of the node (SPMD); rank 0's result."""
        return self.sched.call_all(node, method, *args, **kwargs)[0]

    def call_all(self, node: str, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` on every rank of the node; every rank's result, in rank order."""
        return self.sched.call_all(node, method, *args, **kwargs)

    def publish_policy(self, version: int) -> None:
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
    for d in Path(root).glob(f"{PRIVATE_RAY_PREFIX}*-*"):
        pid = d.name[len(PRIVATE_RAY_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not procs.alive(int(pid)) and not procs.pids_using(str(d)):
            shutil.rmtree(d, ignore_errors=True)
