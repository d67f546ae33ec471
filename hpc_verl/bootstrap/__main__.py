"""``python3 -m hpc_verl.bootstrap VERB``: the node-side commands of a job.

plan       (batch script, once) expand the node list, make the token, write plan.json;
           prints shell assignments (HPCV_RAY_HEAD, HPCV_RAY_WORKERS, HPCV_RAY_NNODES)
node|head|worker  (under srun, one per node) start and supervise this node's Ray
wait       (batch script) the readiness barrier; writes ray/env.sh (RAY_ADDRESS, token vars)
watch      (batch script, while the trainer runs) exit 1 with the diagnosis as soon as a node fails
stop       (any node) stop this node's supervisor and everything it started
hostnames  expand a SLURM hostlist (pure Python fallback for scontrol)
ports      print a job's port layout
Exit codes: 0 ok, 1 bring-up failed (diagnostics printed), 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time

from hpc_verl.bootstrap.timing import WATCH_POLL_S
from hpc_verl.errors import FAILURE_FILE_NAME, BootstrapError, HpcVerlError, record_failure
from hpc_verl.profiles.schema import RaySection  # the defaults of the profile's ray section: one place


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m hpc_verl.bootstrap")
    sub = p.add_subparsers(dest="verb", required=True)
    plan = sub.add_parser("plan")
    plan.add_argument("--job-dir", required=True)
    plan.add_argument("--job-id", type=int, default=int(os.environ.get("SLURM_JOB_ID", "0") or 0))
    plan.add_argument("--nodelist", default=os.environ.get("SLURM_JOB_NODELIST", ""))
    plan.add_argument("--gpus-per-node", type=int, default=0)
    plan.add_argument("--node-hosts", default="", help="'node1=hostA,node2=hostA' (from scontrol on the host)")
    plan.add_argument("--num-cpus", type=int, default=None, help="CPUs per Ray node (0 or unset: Ray detects)")
    _add_port_layout(plan)
    plan.add_argument("--interface", default=None)
    plan.add_argument("--allow-loopback", type=_bool, default=False)
    plan.add_argument("--temp-dir-root", default=RaySection.temp_dir_root)
    plan.add_argument("--dashboard", type=_bool, default=False)
    plan.add_argument("--dashboard-host", default="127.0.0.1")
    plan.add_argument("--client-server", type=_bool, default=False)
    plan.add_argument("--timeout-s", type=float, default=RaySection.readiness_timeout_s)
    plan.add_argument("--python", default=sys.executable)
    for verb in ("node", "head", "worker"):
        n = sub.add_parser(verb)
        n.add_argument("--job-dir", required=True)
        n.add_argument("--node", default=None, help="SLURM node name (default: $SLURMD_NODENAME)")
    w = sub.add_parser("wait")
    w.add_argument("--job-dir", required=True)
    w.add_argument("--srun-pids", default="", help="'PID:head PID:workers' background steps to watch")
    w.add_argument("--timeout-s", type=float, default=None)
    wa = sub.add_parser("watch")
    wa.add_argument("--job-dir", required=True)
    wa.add_argument("--poll-s", type=float, default=WATCH_POLL_S)
    s = sub.add_parser("stop")
    s.add_argument("--job-dir", required=True)
    s.add_argument("--node", default=None)
    h = sub.add_parser("hostnames")
    h.add_argument("nodelist")
    pr = sub.add_parser("ports")
    pr.add_argument("--job-id", type=int, required=True)
    _add_port_layout(pr)
    pr.add_argument("--nodes-per-host", type=int, default=1)
    return p


def _add_port_layout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port-base", type=int, default=RaySection.port_base)
    parser.add_argument("--port-stride", type=int, default=RaySection.port_stride)
    parser.add_argument("--port-slots", type=int, default=RaySection.port_slots)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except HpcVerlError as exc:
        if getattr(args, "job_dir", None) and os.path.isdir(args.job_dir):
            record_failure(f"{args.verb}: {exc}", os.path.join(args.job_dir, FAILURE_FILE_NAME))
        print(f"hpc_verl.bootstrap: error: {exc}", file=sys.stderr, flush=True)
        return 1 if args.verb in ("wait", "watch", "node", "head", "worker") else 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.verb == "plan":
        from hpc_verl.bootstrap.raydir import write_plan

        plan = write_plan(args.job_dir, args.job_id, args.nodelist, gpus_per_node=args.gpus_per_node,
                          num_cpus=args.num_cpus, port_base=args.port_base, port_stride=args.port_stride,
                          port_slots=args.port_slots, interface=args.interface,
                          allow_loopback=args.allow_loopback, temp_dir_root=args.temp_dir_root,
                          dashboard=args.dashboard, dashboard_host=args.dashboard_host,
                          client_server=args.client_server,
                          timeout_s=args.timeout_s, python=args.python, node_hosts=args.node_hosts)
        workers = [n for n in plan["nodes"] if n != plan["head"]]
        print(f"HPCV_RAY_HEAD={shlex.quote(plan['head'])}")
        print(f"HPCV_RAY_WORKERS={shlex.quote(','.join(workers))}")
        print(f"HPCV_RAY_NNODES={len(plan['nodes'])}")
        return 0
    if args.verb in ("node", "head", "worker"):
        from hpc_verl.bootstrap.node import NodeSupervisor

        role = None if args.verb == "node" else args.verb
        return NodeSupervisor(args.job_dir, args.node, role).run()
    if args.verb == "wait":
        from hpc_verl.bootstrap.barrier import Barrier, parse_pids

        # The barrier shares the head node with the Ray start-up it waits for: yield the CPU to it
        # (this matters where cores are few; a poll is a few ms either way).
        try:
            os.nice(10)
        except OSError:
            pass
        Barrier(args.job_dir, parse_pids(args.srun_pids), args.timeout_s).wait()
        return 0
    if args.verb == "watch":
        return _watch(args.job_dir, args.poll_s)
    if args.verb == "stop":
        return _stop(args.job_dir, args.node)
    if args.verb == "hostnames":
        from hpc_verl.bootstrap.hostlist import expand_hostlist

        print("\n".join(expand_hostlist(args.nodelist)))
        return 0
    if args.verb == "ports":
        from hpc_verl.bootstrap.ports import port_block

        blocks = [port_block(args.job_id, port_base=args.port_base, port_stride=args.port_stride,
                             port_slots=args.port_slots, node_slot=i, nodes_per_host=args.nodes_per_host)
                  .to_dict() for i in range(args.nodes_per_host)]
        print(json.dumps(blocks, indent=2))
        return 0
    raise AssertionError(args.verb)


def _watch(job_dir: str, poll_s: float) -> int:
    """While the trainer runs: return 1 with the failed node's diagnosis as soon as a node's
    supervisor reports a failure; 0 when the job stops Ray (``ray/stop``) or on SIGTERM."""
    from hpc_verl.bootstrap.raydir import node_states, ray_dir

    stop = {"now": False}

    def on_term(*_: object) -> None:
        stop["now"] = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_term)
    stop_file = ray_dir(job_dir) / "stop"
    while not stop["now"] and not stop_file.exists():
        for node, st in sorted(node_states(job_dir).items()):
            if st.get("state") == "failed":
                why = st.get("error") or f"node {node} failed without a diagnosis; see logs/node-{node}.log"
                raise BootstrapError(f"Ray failed under the trainer: {why}")
        time.sleep(poll_s)
    return 0


def _stop(job_dir: str, node: str | None) -> int:
    """Fallback teardown: TERM this node's supervisor (it stops its own tree), then KILL what is left."""
    from hpc_verl.util import procs
    from hpc_verl.bootstrap.node import this_node
    from hpc_verl.bootstrap.raydir import node_states

    node = node or this_node()
    st = node_states(job_dir).get(node, {})
    pid = st.get("supervisor_pid")
    if not pid or not procs.alive(pid):
        print(f"hpc_verl.bootstrap: node {node}: no running supervisor", file=sys.stderr)
        return 0
    kids = procs.descendants(pid)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while procs.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in [pid, *kids]:
        if procs.alive(p):
            os.kill(p, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
