"""``ray start`` with Ray's CLI already imported while the node waits for the head.

Importing Ray's CLI costs a second or two; a worker does it while the head is still
starting, so only the daemons' own start-up is left on the critical path once the
head is there. "There" means registered in the GCS, not just ``head.json``: Ray's
worker start-up first looks up the head node and, while it is missing, sleeps 2 s
between lookups (``get_all_node_info_until_retrieved``), which costs a worker up to
2 s for nothing. So we poll the GCS ourselves every 50 ms and call ``ray start`` the
moment the head's raylet is alive.

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


def _read_address(head_file: str) -> str | None:
    try:
        with open(head_file) as f:
            return json.load(f)["address"]
    except (OSError, ValueError, KeyError):
        return None


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
    deadline = time.monotonic() + timeout_s
    from ray.scripts import scripts  # the slow import, done before the address is known

    if head_file:
        try:
            address = str(_until(deadline, stop_file, f"no head address in {head_file}",
                                 lambda: _read_address(head_file)))
            _until(deadline, stop_file, f"the head at {address} never registered in its GCS",
                   head_alive(address))
        except _Stopped as exc:
            print(str(exc), file=sys.stderr)
            return 3
        ray_args = [a.replace("@ADDRESS@", address) for a in ray_args]
    sys.argv = ["ray", "start", *ray_args]
    try:
        scripts.cli.main(args=["start", *ray_args], prog_name="ray", standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # noqa: BLE001 - report as ray start would
        print(f"ray start failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
