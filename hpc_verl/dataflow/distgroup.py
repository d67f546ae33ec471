"""torch.distributed for worker groups, on the worker side (imported in the Ray
actors, never by the driver): the rendezvous, the group's process group, and the
standalone "sync" groups that carry tensors between two worker groups.

Rendezvous: rank 0 opens a ``TCPStore`` on its node address, on the first free
port of ``$HPC_VERL_DIST_PORTS`` ("lo-hi": the top of the node's port block,
exported to its Ray by the job's bootstrap) or on a port the kernel picks; the driver hands (address, port) to
the other ranks. Every collective has a timeout, so a dead peer ends a step with
an error instead of a hang.

Tensor transport (``send_buckets`` / ``recv_buckets``): the sender streams
``(name, tensor)`` pairs, cast to the receivers' dtype, into buckets of about
``bucket_bytes``; each bucket is three broadcasts (a header, the names and
shapes, the bytes), so at most one bucket is in flight on any rank. Each tensor starts at a
multiple of ``ALIGN_BYTES`` in the bucket (zero padding between them): a receiver views its
bytes as the tensor's dtype in place, which needs an offset aligned to that dtype (a 2-byte
tensor of odd length before an int64 one would break it).
"""
from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any, Iterable, Iterator

PORT_RANGE_ENV = "HPC_VERL_DIST_PORTS"
DEFAULT_BUCKET_BYTES = 64 * 2**20
ALIGN_BYTES = 16   # covers every dtype's alignment (complex128 is the widest)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def resolve_backend(backend: str) -> str:
    import torch
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def device_for(backend: str) -> Any:
    import torch
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _port_candidates() -> list[int]:
    """The node's ports for stores (``lo-hi``, from the job's port block), then one the kernel picks."""
    spec = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not spec:
        return [0]
    try:
        lo, hi = (int(x) for x in spec.split("-", 1))
        if not 0 < lo <= hi <= 65535:
            raise ValueError
    except ValueError:
        raise RuntimeError(f"${PORT_RANGE_ENV}={spec!r} is not a port range like 20090-20093") from None
    return list(range(lo, hi + 1)) + [0]


def open_store(host: str, world_size: int, timeout_s: float) -> tuple[Any, int]:
    """Rank 0's TCPStore (master) and the port it listens on."""
    import torch.distributed as dist

    last: Exception | None = None
    for port in _port_candidates():
        try:
            store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
            return store, int(store.port)
        except (RuntimeError, OSError) as exc:  # port taken: next one
            last = exc
    raise RuntimeError(f"no free port for the rendezvous store on {host}: {last}")


def connect_store(host: str, port: int, world_size: int, timeout_s: float) -> Any:
    import torch.distributed as dist
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def init_default_group(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    """This process's default process group (the worker group's ranks)."""
    import torch
    import torch.distributed as dist

    backend = resolve_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(0)  # Ray shows an actor only its own GPU(s)
        # CPU tensors (counters, statistics, CPU-offloaded FSDP shards) need a CPU backend too
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, store=dist.PrefixStore("group", store), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def new_sync_group(store: Any, prefix: str, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """A process group outside the default one (members of two worker groups)."""
    import torch.distributed as dist

    backend = resolve_backend(backend)
    pstore = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(pstore, rank, world_size, opts)
    return dist.ProcessGroupGloo(pstore, rank, world_size, timedelta(seconds=timeout_s))


def _bcast(pg: Any, tensor: Any) -> None:
    import torch.distributed as dist
    pg.broadcast([tensor], dist.BroadcastOptions()).wait()


def send_buckets(pg: Any, named: Iterable[tuple[str, Any]], device: Any, dtype: Any = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Broadcast ``named`` tensors from sync rank 0, bucket by bucket; returns the tensors' bytes."""
    sent = 0
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in named:
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.to(device).contiguous()
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            sent += _send_one(pg, bucket, device, last=False)
            bucket, size = [], 0
    sent += _send_one(pg, bucket, device, last=True)
    return sent


def _send_one(pg: Any, bucket: list[tuple[str, Any]], device: Any, last: bool) -> int:
    import torch

    meta = pickle.dumps([(name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in bucket])
    parts = []
    for _, t in bucket:
        raw = t.reshape(-1).view(torch.uint8)
        parts.append(raw)
        if _padded(raw.numel()) > raw.numel():
            parts.append(torch.zeros(_padded(raw.numel()) - raw.numel(), dtype=torch.uint8, device=raw.device))
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
    header = torch.tensor([len(meta), flat.numel(), int(last)], dtype=torch.int64, device=device)
    _bcast(pg, header)
    _bcast(pg, torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device))
    if flat.numel():
        _bcast(pg, flat)
    return sum(t.numel() * t.element_size() for _, t in bucket)   # the tensors' bytes (not the padding)


def recv_buckets(pg: Any, device: Any) -> Iterator[tuple[str, Any]]:
    """The receiving side of ``send_buckets``: yields ``(name, tensor)`` as buckets arrive."""
    import torch

    while True:
        header = torch.zeros(3, dtype=torch.int64, device=device)
        _bcast(pg, header)
        meta_len, data_len, last = (int(x) for x in header.tolist())
        meta_t = torch.zeros(meta_len, dtype=torch.uint8, device=device)
        _bcast(pg, meta_t)
        meta = pickle.loads(meta_t.cpu().numpy().tobytes())
        flat = torch.zeros(data_len, dtype=torch.uint8, device=device)
        if data_len:
            _bcast(pg, flat)
        offset = 0
        for name, shape, dtype_name in meta:
            dtype = getattr(torch, dtype_name)
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            yield name, flat[offset:offset + nbytes].view(dtype).reshape(shape)
            offset += _padded(nbytes)
        if last:
            return
