"""``ray start`` with Ray's CLI already imported while the node waits for the head.

Importing Ray's CLI costs a second or two; a worker does it while the head is still
starting, so only the daemons' own start-up is left on the critical path. Ray's worker
start-up then looks the head node up in the GCS, sleeping 2 s between lookups while it
is missing (``get_all_node_info_until_retrieved``), and it needs from it only the head's
temp and session dirs. With our per-node ``--temp-dir`` the first is in ``head.json``,
and the session name is in the GCS right after the GCS starts, before the head's raylet
and agents. So a worker polls the GCS every 50 ms for the session name and starts at
once, its lookup answered from what the job knows (``start_before_head_registers``):
the two nodes' raylets and agents start side by side (Ray ready 4.5-5.2 s after the
batch script on the 2-node test bed, against 6.6 s when the worker waited for the
head's registration). Where a Ray does not look the head up that way, or ``head.json``
has no temp dir, the worker waits for the head's raylet to be alive, as before.

The head has nothing to wait for, so what its ``ray start`` does is on the job's critical
path. Two things it does by default that a job does not need:

* Importing the CLI's ``serve``, ``job`` and state subcommands: about 1 s of the CLI's
  1.4 s here. Ray's CLI adds each one only if it imports, so this process makes them
  unimportable (``skip_optional_cli``, run as a script only).
* The Ray Client server, which ``ray start --head`` always starts when Ray's client
  extras are installed: one more Python process booting beside the dashboard and the
  agents the raylet waits for (about 0.5 s to the head's registration on 2 cores).
  ``--no-client-server`` (profile ``ray.client_server: false``) leaves it out.

Usage (internal, from the node supervisor):
``python -m hpc_verl.bootstrap.raystart --head-file FILE --stop-file FILE --timeout-s T -- ARGS``
where ``@ADDRESS@`` in ARGS is replaced by the head's GCS address.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

POLL_S = 0.05
#: Ray CLI subcommand groups that ``ray start`` does not use; Ray's CLI skips each one that fails
#: to import (ray.serve alone pulls in fastapi and pandas).
OPTIONAL_CLI_MODULES = ("ray.serve.scripts", "ray.dashboard.modules.job.cli", "ray.util.state.state_cli")
CLIENT_PORT_OPTION = "--ray-client-server-port"
SESSION_NAMESPACE = b"session"   # where the head puts its session name (ray_constants.KV_NAMESPACE_SESSION)


class _Stopped(Exception):
    """The wait ended without a head (timeout or stop file); the message says which."""


def _until(deadline: float, stop_file: str | None, what: str, probe: Callable[[], object]) -> object:
    """Call ``probe`` every POLL_S until it returns something truthy; bounded by the deadline."""
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise _Stopped(f"{what}: gave up at the readiness deadline")
        if stop_file and os.path.exists(stop_file):
            raise _Stopped(f"{what}: the job is stopping")
        time.sleep(POLL_S)


def _read_head(head_file: str) -> dict | None:
    try:
        with open(head_file) as f:
            head = json.load(f)
        return head if head.get("address") else None
    except (OSError, ValueError, AttributeError):
        return None


def session_named(address: str) -> Callable[[], str | None]:
    """A probe: the session name the head wrote to its GCS (right after the GCS started, before
    its raylet and agents), or None while it is not there."""
    from hpc_verl.bootstrap.barrier import gcs_call  # Ray is already imported with its CLI

    def probe() -> str | None:
        got, _ = gcs_call(address, 1.0, lambda c: c.internal_kv_get(b"session_name", SESSION_NAMESPACE, timeout=1.0))
        return got.decode() if got else None

    return probe


def start_before_head_registers(head_temp_dir: str, session_name: str) -> bool:
    """Let this worker's ``ray start`` go before the head's raylet has registered.

    Ray's worker start-up looks the head node up only for its temp and session dirs (the temp
    dir is the default for a worker without ``--temp-dir``; ours always has one, and the session
    dir is compared with the spill path). Both are known from ``head.json`` and the session name
    in the GCS, so the lookup answers from them while the head is not registered yet: the
    worker's raylet and agents start beside the head's instead of after them. False (and Ray's
    own lookup) where this Ray does not look the head up that way."""
    import types

    from ray._private import node as ray_node

    if not hasattr(ray_node, "get_all_node_info_until_retrieved"):
        return False
    head = types.SimpleNamespace(state=0, temp_dir=head_temp_dir,   # 0 = ALIVE
                                 session_dir=os.path.join(head_temp_dir, session_name))

    def lookup(gcs_client: object, *args: object, **kwargs: object) -> list:
        try:
            infos = list(gcs_client.get_all_node_info(timeout=1.0, node_selectors=kwargs.get("node_selectors"),
                                                      ).values())  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the head is not registered (or the GCS is busy): use what we know
            infos = []
        return infos or [head]

    ray_node.get_all_node_info_until_retrieved = lookup
    return True


def head_alive(address: str) -> Callable[[], bool]:
    """A probe: is the head node's raylet registered and alive in the GCS at ``address``?"""
    from hpc_verl.bootstrap.barrier import gcs_node_infos  # Ray is already imported with its CLI

    def probe() -> bool:
        infos, _ = gcs_node_infos(address, 1.0)
        return bool(infos) and any(i.is_head_node and i.state == 0 for i in infos.values())  # 0 = ALIVE

    return probe


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    opts, ray_args = argv[:sep], argv[sep + 1:]
    head_file = opts[opts.index("--head-file") + 1] if "--head-file" in opts else None
    stop_file = opts[opts.index("--stop-file") + 1] if "--stop-file" in opts else None
    timeout_s = float(opts[opts.index("--timeout-s") + 1]) if "--timeout-s" in opts else 300.0
    no_client = "--no-client-server" in opts
    deadline = time.monotonic() + timeout_s
    from ray.scripts import scripts  # the slow import, done before the address is known

    if head_file:
        try:
            head: dict = _until(deadline, stop_file, f"no head address in {head_file}",  # type: ignore[assignment]
                                lambda: _read_head(head_file))
            address, temp_dir = str(head["address"]), head.get("temp_dir")
            early = False
            if temp_dir:   # (a head that names its temp dir) start once its session name is in the GCS
                session = _until(deadline, stop_file, f"the head at {address} never wrote its session name",
                                 session_named(address))
                early = start_before_head_registers(str(temp_dir), str(session))
            if not early:
                _until(deadline, stop_file, f"the head at {address} never registered in its GCS",
                       head_alive(address))
        except _Stopped as exc:
            print(str(exc), file=sys.stderr)
            return 3
        ray_args = [a.replace("@ADDRESS@", address) for a in ray_args]
    if no_client:
        ray_args = without_client_server(scripts, ray_args)
    sys.argv = ["ray", "start", *ray_args]
    try:
        scripts.cli.main(args=["start", *ray_args], prog_name="ray", standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # noqa: BLE001 - report as ray start would
        print(f"ray start failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def without_client_server(scripts: object, ray_args: list[str]) -> list[str]:
    """``ray start`` arguments and CLI state for a head without Ray's Client server.

    ``ray start`` gives the server a port (10001 unless told) whenever Ray's client extras import,
    and no port value turns it off; so the CLI is told they do not. Where this Ray's CLI has no
    such check, the server keeps the job's own port: never Ray's fixed 10001, which two jobs on
    one node would both take."""
    if not callable(getattr(scripts, "get_ray_client_dependency_error", None)):
        return ray_args
    scripts.get_ray_client_dependency_error = lambda: "not started: ray.client_server is off"  # type: ignore[attr-defined]
    return [a for a in ray_args if a.split("=", 1)[0] != CLIENT_PORT_OPTION]


def skip_optional_cli() -> None:
    """Make OPTIONAL_CLI_MODULES unimportable in this process (only in the ``ray start`` process:
    a None in sys.modules makes every later import of that module fail)."""
    for name in OPTIONAL_CLI_MODULES:
        sys.modules.setdefault(name, None)


if __name__ == "__main__":
    skip_optional_cli()
    sys.exit(main(sys.argv[1:]))
