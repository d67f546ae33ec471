"""Every Ray port of a job, laid out from a base derived from the job id.

Job ``J`` owns ``[port_base + (J % port_slots) * port_stride, ... + port_stride)``.
Inside that block:

- offsets 0..2: the head's GCS, dashboard and Ray client ports;
- the rest is split into ``nodes_per_host`` equal sub-blocks, one per node of
  the job that shares a host with other nodes of the same job (1 on a real
  cluster, 2 on the test bed where two slurmd run on one machine). Each sub-block
  holds node manager, object manager, dashboard agent (HTTP and gRPC),
  runtime-env agent and metrics ports, then the worker port range, whose top
  ``DIST_PORTS`` ports are kept from Ray for the trainer's torch.distributed
  rendezvous (exported to the node's Ray as ``HPC_VERL_DIST_PORTS``).

Two jobs on one node therefore never collide unless their ids are equal modulo
``port_slots``; for that case :func:`pick_node_ports` probes the ports and moves
to the next free block (the head publishes what it chose in ``head.json``, and
node-local ports need no agreement between nodes).
"""
from __future__ import annotations

import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc_verl.errors import BootstrapError
from hpc_verl.profiles.schema import RaySection  # the profile's defaults: one place

HEAD_FIXED = 3   # gcs, dashboard, client
NODE_FIXED = 6   # node manager, object manager, agent http, agent grpc, runtime env, metrics
MIN_WORKER_PORTS = 8
DIST_PORTS = 4   # the top of each node's worker range: the trainer's torch.distributed rendezvous stores


@dataclass(frozen=True)
class PortBlock:
    """The ports one node of one job uses (head-only ports are set on every node, used on the head)."""

    block_start: int
    gcs: int
    dashboard: int
    client: int
    node_manager: int
    object_manager: int
    dashboard_agent_listen: int
    dashboard_agent_grpc: int
    runtime_env_agent: int
    metrics_export: int
    min_worker: int
    max_worker: int

    def node_ports(self) -> list[int]:
        """Ports bound on this node by a worker node (not counting the worker range)."""
        return [self.node_manager, self.object_manager, self.dashboard_agent_listen,
                self.dashboard_agent_grpc, self.runtime_env_agent, self.metrics_export]

    @property
    def dist_ports(self) -> tuple[int, int]:
        """The ports (lo, hi) kept for torch.distributed stores of this node's ranks."""
        return self.max_worker - DIST_PORTS + 1, self.max_worker

    def head_ports(self) -> list[int]:
        return [self.gcs, self.dashboard, self.client]

    def all_ports(self, head: bool) -> list[int]:
        ports = self.node_ports() + list(range(self.min_worker, self.max_worker + 1))
        return (self.head_ports() + ports) if head else ports

    def ray_start_args(self, head: bool) -> list[str]:
        """The ``ray start`` options that pin every port to this block."""
        args = [f"--node-manager-port={self.node_manager}",
                f"--object-manager-port={self.object_manager}",
                f"--dashboard-agent-listen-port={self.dashboard_agent_listen}",
                f"--dashboard-agent-grpc-port={self.dashboard_agent_grpc}",
                f"--runtime-env-agent-port={self.runtime_env_agent}",
                f"--metrics-export-port={self.metrics_export}",
                f"--min-worker-port={self.min_worker}",
                f"--max-worker-port={self.max_worker - DIST_PORTS}"]
        if head:
            args = [f"--port={self.gcs}", f"--dashboard-port={self.dashboard}",
                    f"--ray-client-server-port={self.client}", *args]
        return args

    def to_dict(self) -> dict:
        return asdict(self)


def port_block(job_id: int, *, port_base: int = RaySection.port_base, port_stride: int = RaySection.port_stride,
               port_slots: int = RaySection.port_slots, node_slot: int = 0, nodes_per_host: int = 1,
               slot_shift: int = 0) -> PortBlock:
    """The port block of node sub-slot ``node_slot`` of job ``job_id`` (pure arithmetic)."""
    if port_slots < 1 or port_stride < 1:
        raise BootstrapError(f"port layout: port_slots ({port_slots}) and port_stride ({port_stride}) "
                             "must be positive; fix the profile's ray section")
    if not 0 <= node_slot < nodes_per_host:
        raise BootstrapError(f"port layout: node slot {node_slot} outside 0..{nodes_per_host - 1}")
    per_node = (port_stride - HEAD_FIXED) // nodes_per_host
    workers = per_node - NODE_FIXED - DIST_PORTS
    if workers < MIN_WORKER_PORTS:
        raise BootstrapError(
            f"port layout: ray.port_stride={port_stride} leaves {max(workers, 0)} worker ports per node "
            f"for {nodes_per_host} node(s) per host; raise ray.port_stride to at least "
            f"{HEAD_FIXED + nodes_per_host * (NODE_FIXED + DIST_PORTS + MIN_WORKER_PORTS)}")
    slot = (job_id + slot_shift) % port_slots
    start = port_base + slot * port_stride
    if start + port_stride - 1 > 65535:
        raise BootstrapError(f"port layout: block {start}..{start + port_stride - 1} passes 65535; "
                             "lower ray.port_base or ray.port_slots")
    node0 = start + HEAD_FIXED + node_slot * per_node
    return PortBlock(block_start=start, gcs=start, dashboard=start + 1, client=start + 2,
                     node_manager=node0, object_manager=node0 + 1, dashboard_agent_listen=node0 + 2,
                     dashboard_agent_grpc=node0 + 3, runtime_env_agent=node0 + 4,
                     metrics_export=node0 + 5, min_worker=node0 + NODE_FIXED,
                     max_worker=node0 + per_node - 1)


def busy_ports(ports: list[int], host: str = "") -> list[int]:
    """The ports of ``ports`` that a server cannot bind right now on ``host`` (all addresses by default).

    The probe sets ``SO_REUSEADDR`` as Ray's servers (gRPC, aiohttp, http.server) do: a port left in
    TIME_WAIT by a job that just ended is free to them, and counting it as taken pushed a job off
    its block and, with few blocks, off all of them. A listening socket still makes a port busy.
    """
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


def ephemeral_range(proc: Path = Path("/proc")) -> tuple[int, int]:
    """The kernel's ephemeral port range (outgoing connections take ports from it)."""
    try:
        lo, hi = (proc / "sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def block_shift(job_id: int, block: PortBlock, *, port_base: int = 20000, port_stride: int = 100,
                port_slots: int = 120, **_node: int) -> int:
    """How many blocks ``block`` lies past job ``job_id``'s own block (0 = its own)."""
    return ((block.block_start - port_base) // port_stride - job_id % port_slots) % port_slots


def pick_node_ports(job_id: int, *, head: bool, max_tries: int = 8, start_shift: int = 0, **layout: int) -> PortBlock:
    """The job's block for this node (or the ``start_shift``-th after it), moved on only if a port is taken."""
    shift = start_shift
    for _ in range(max_tries):
        block = port_block(job_id, slot_shift=shift, **layout)
        if not busy_ports(block.all_ports(head)):
            return block
        shift += 1
    first = port_block(job_id, slot_shift=start_shift, **layout)
    raise BootstrapError(
        f"ports: job {job_id}'s block at {first.block_start} and the next {max_tries - 1} blocks all have "
        "ports in use on this node; check 'ss -ltnp' or change ray.port_base")
