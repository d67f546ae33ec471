"""Where a training update's time goes, on every rank: forward, backward (compute), the gradient
reduction the backward waited for, and the optimizer step; reported as the slowest rank's value
under verl's timing names, with the fastest rank's beside it and their ratio.

The reduction is measured where it happens:

- DDP: a communication hook that runs DDP's own averaging all-reduce and notes when the last bucket
  was handed over; the backward's wall time after that moment is the reduction nobody overlapped.
- FSDP2: its reduce-scatter, wrapped (``set_custom_reduce_scatter``) to time each call; on a CPU
  the call is the communication, on CUDA it only queues NCCL work on a side stream.
- One rank: none.
"""
from __future__ import annotations

import time
from typing import Any

PHASES = ("forward", "backward", "allreduce", "optimizer")


class CommTimer:
    """DDP communication hook: DDP's default all-reduce, noting when the last bucket started."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.last_start = 0.0

    def hook(self, state, bucket):  # noqa: ANN001,ANN201 - DDP checks these annotations: none is allowed
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.last_start = time.perf_counter()
        return allreduce_hook(self.group, bucket)


def timed_reduce_scatter(module: Any, clock: "PhaseClock") -> bool:
    """FSDP2: time every reduce-scatter of ``module`` and its sharded children into ``clock``;
    False where this torch has no such hook (the reduction then stays inside the backward)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:
        return False

    class _Timed(DefaultReduceScatter):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().__call__(*args, **kwargs)
            finally:
                clock.comm_s += time.perf_counter() - t0

    comm = _Timed()
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(comm)
    return True


class PhaseClock:
    """One update's phase times on this rank."""

    def __init__(self) -> None:
        self.times = dict.fromkeys(PHASES, 0.0)
        self.last: dict[str, float] = {}      # the last finished update's, this rank's (the dashboard's)
        self.comm: CommTimer | None = None   # DDP
        self.comm_s = 0.0                    # FSDP2: time inside its reduce-scatters
        self.measures_comm = False

    def reset(self) -> None:
        self.times = dict.fromkeys(PHASES, 0.0)
        self.comm_s = 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.times[phase] += seconds

    def backward(self, loss: Any) -> None:
        """``loss.backward()``, split into compute and the reduction it waited for."""
        comm_before = self.comm_s
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        waited = self.comm_s - comm_before
        if self.comm is not None and self.comm.last_start >= t0:
            waited = t1 - self.comm.last_start
        self.times["allreduce"] += waited
        self.times["backward"] += (t1 - t0) - waited

    def metrics(self, par: Any, name: str) -> dict[str, float]:
        """``timing_s/<name>/<phase>`` (slowest rank), ``.../<phase>_min`` (fastest) and
        ``perf/rank_imbalance`` (the actor's slowest over fastest rank's whole update; the critic's
        ``perf/rank_imbalance_update_critic``); a collective: every rank calls it."""
        import torch

        self.last = dict(self.times)
        own = [self.times[p] for p in PHASES]
        local = torch.tensor(own + [sum(own)], dtype=torch.float64)
        hi, lo = local.clone(), -local
        if par.distributed:
            import torch.distributed as dist
            both = torch.cat([hi, lo])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=par.group)
            hi, lo = both[:len(local)], both[len(local):]
        lo = -lo
        out: dict[str, float] = {}
        for i, phase in enumerate(PHASES):
            if phase == "allreduce" and par.distributed and not self.measures_comm:
                continue   # (a reduction this torch gives no hook for stays in the backward)
            out[f"timing_s/{name}/{phase}"] = float(hi[i])
            out[f"timing_s/{name}/{phase}_min"] = float(lo[i])
        key = "perf/rank_imbalance" if name == "update_actor" else f"perf/rank_imbalance_{name}"
        out[key] = float(hi[-1] / lo[-1]) if float(lo[-1]) > 0 else 1.0
        return out
