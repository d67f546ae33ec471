"""Data parallelism for the trainer's roles: where a worker runs in its group
(rank, world size, process group), DDP / FSDP2 wrapping, the collectives the
PPO maths needs and full tensors shard by shard (sharded checkpoint I/O: sharded.py).

Everything here also works without a process group (world size 1, e.g. the
in-process test runner): collectives become no-ops.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from hpc_verl.trainer.engine.phase_timing import CommTimer, PhaseClock, timed_reduce_scatter
from hpc_verl.dataflow import current_context
from hpc_verl.errors import HpcVerlError

STRATEGIES = ("ddp", "fsdp", "fsdp2")   # fsdp is FSDP2 (fully_shard) here


_SP_GROUPS: dict[tuple[int, int], list[Any]] = {}


@dataclass
class Parallel:
    """A role's place in its worker group: ``world`` ranks = ``world / sp`` data-parallel ranks x
    ``sp`` Ulysses sequence-parallel ranks (consecutive ranks share one sample stream)."""

    rank: int = 0
    world: int = 1
    group: Any = None          # torch.distributed group (None: single process)
    device: str = "cpu"
    sp: int = 1
    sp_group: Any = None       # this rank's sequence-parallel group (None: sp == 1)

    @classmethod
    def current(cls, device: str) -> "Parallel":
        """From the dataflow context when running in a worker group, else a single rank."""
        try:
            ctx = current_context()
        except Exception:  # noqa: BLE001 - outside the dataflow (tests, tools)
            return cls(device=device)
        return cls(ctx.rank, ctx.world_size, ctx.process_group, device)

    def with_sp(self, sp: int) -> "Parallel":
        """The same rank seen with ``sp``-way sequence parallelism (its SP group made on first use:
        every rank of the group asks in the same order, as torch.distributed.new_group needs)."""
        if sp <= 1:
            return Parallel(self.rank, self.world, self.group, self.device)
        if self.world % sp:
            raise HpcVerlError(f"ulysses_sequence_parallel_size={sp} does not divide the {self.world} ranks")
        key = (self.world, sp)
        if key not in _SP_GROUPS:
            import torch.distributed as dist
            _SP_GROUPS[key] = [dist.new_group(list(range(s, s + sp))) for s in range(0, self.world, sp)]
        return Parallel(self.rank, self.world, self.group, self.device, sp, _SP_GROUPS[key][self.rank // sp])

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world > 1

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def dp_world(self) -> int:
        return self.world // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    def rows(self, n: int) -> tuple[int, int]:
        """This data-parallel rank's contiguous share of ``n`` rows (``n`` divisible by them)."""
        if n % self.dp_world:
            raise HpcVerlError(f"{n} rows do not split evenly over {self.dp_world} data-parallel ranks; make the "
                               f"batch (data.train_batch_size x rollout.n) a multiple of {self.dp_world}")
        per = n // self.dp_world
        return self.dp_rank * per, (self.dp_rank + 1) * per

    def all_reduce_sum(self, tensor: Any) -> Any:
        if self.distributed:
            import torch.distributed as dist
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather_rows(self, tensor: Any) -> Any:
        """Every data-parallel rank's equal-sized rows, concatenated in order (the SP ranks of a
        group hold the same rows: one of them counts)."""
        if not self.distributed:
            return tensor
        import torch
        import torch.distributed as dist
        dev = torch.device(self.device if self.device != "cpu" else "cpu")
        local = tensor.to(dev).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts[::self.sp], dim=0).to(tensor.device)

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist
            dist.barrier(group=self.group)


def decoder_layers(model: Any) -> list[Any]:
    """The repeated transformer blocks of a Hugging Face model (the FSDP units)."""
    return [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))
            and not type(m).__name__.startswith("Model")]


def shards(strategy: str, par: Parallel) -> bool:
    """Whether a role with ``strategy`` runs FSDP2 here. Not for one CPU rank: with nothing to
    shard and no mixed precision on CPU, FSDP2 at world size 1 computes the same as the plain
    module plus an unshard/reshard per layer and pass. One CUDA rank keeps it (its bf16 compute
    is part of what the strategy means)."""
    return strategy in ("fsdp", "fsdp2") and par.group is not None and (par.world > 1 or par.device == "cuda")


def shard_model(model: Any, par: Parallel, *, param_offload: bool = False, reshard_after_forward: bool = True,
                mixed_precision: bool = False) -> Any:
    """FSDP2 (``fully_shard``) per decoder layer and on the root; bf16 compute on CUDA."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    import torch
    device_type = "cuda" if par.device == "cuda" else "cpu"
    mesh = init_device_mesh(device_type, (par.world,))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if param_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # the last block's parameters are the first the backward needs: keep them gathered
        last = i == len(layers) - 1
        fully_shard(layer, **{**kwargs, "reshard_after_forward": reshard_after_forward and not last})
    fully_shard(model, **kwargs)   # (FSDP2 keeps the root's gathered after forward itself)
    return model


#: DDP's gradient bucket (torch's default is 25 MB): small buckets start all-reducing while the
#: backward still runs, where one big bucket waits for the whole backward (hpc_verl.ddp_bucket_mb)
DDP_BUCKET_MB = 2.0


def _forward_wrapper(module: Any) -> Any:
    """What DDP wraps: ``module``'s own forward, or ``fn(module, ...)`` as one forward (a GRPO group's
    shared prompt runs the model twice, and DDP must see one forward per backward)."""
    import torch

    class ForwardAs(torch.nn.Module):
        def __init__(self, lm: Any) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, *args: Any, run: Any = None, **kwargs: Any) -> Any:
            return self.lm(*args, **kwargs) if run is None else run(self.lm, *args, **kwargs)

    return ForwardAs(module)


def ddp_wrap(module: Any, par: Parallel, bucket_mb: float = DDP_BUCKET_MB) -> Any:
    """DDP tuned for overlap: ``bucket_mb`` buckets, gradients that are views into them (no copy
    per step), and no buffer broadcast before every forward unless the module has persistent
    buffers (state that can change, e.g. norm statistics; a rotary table is not one)."""
    from torch.nn.parallel import DistributedDataParallel

    persistent = set(module.state_dict(keep_vars=True)) - {n for n, _ in module.named_parameters()}
    return DistributedDataParallel(_forward_wrapper(module), device_ids=[0] if par.device == "cuda" else None,
                                   bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
                                   broadcast_buffers=bool(persistent))


class TrainModel:
    """A role's model as it trains: the module itself (names, state dicts) and what runs
    forward/backward (DDP wrapper, FSDP2-sharded module, or the module at world size 1)."""

    def __init__(self, module: Any, strategy: str, par: Parallel, *, param_offload: bool = False,
                 reshard_after_forward: bool = True, ddp_bucket_mb: float = DDP_BUCKET_MB) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r}")
        self.module = module
        self.strategy = strategy
        self.par = par
        self.sharded = shards(strategy, par)
        self.phases = PhaseClock()
        if self.sharded:
            self.forward_module = shard_model(module, par, param_offload=param_offload,
                                              reshard_after_forward=reshard_after_forward,
                                              mixed_precision=par.device == "cuda")
            self.phases.measures_comm = timed_reduce_scatter(self.forward_module, self.phases)
        elif par.distributed:
            self.forward_module = ddp_wrap(module, par, ddp_bucket_mb)
            self.phases.comm = CommTimer(par.group)
            self.forward_module.register_comm_hook(None, self.phases.comm.hook)
            self.phases.measures_comm = True
        else:
            self.forward_module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_module(*args, **kwargs)

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(module, *args, **kwargs)`` as one forward of what trains (inside DDP's forward, so
        its gradient hooks fire once however often ``fn`` calls the module)."""
        if self.forward_module is self.module or self.sharded:
            return fn(self.forward_module, *args, **kwargs)
        return self.forward_module(*args, run=fn, **kwargs)

    def grad_sync(self, enabled: bool) -> Any:
        """Gradient reduction on this backward or not (accumulating micro-batches)."""
        if self.sharded:
            self.forward_module.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if not enabled and hasattr(self.forward_module, "no_sync"):
            return self.forward_module.no_sync()
        return contextlib.nullcontext()

    def parameters(self) -> Any:
        return self.module.parameters()

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()


def full_tensors(module: Any) -> Iterator[tuple[str, Any]]:
    """``(name, full tensor)`` for every parameter (once, shared ones too) and persistent
    buffer; FSDP shards are gathered one parameter at a time (a collective: every rank of
    the group iterates together)."""
    for name, p in module.named_parameters():
        yield name, (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
    persistent = set(module.state_dict(keep_vars=True))
    for name, b in module.named_buffers():
        if name in persistent:
            yield name, b.detach()


def load_named(module: Any, named: Any) -> int:
    """Copy ``(name, tensor)`` pairs into ``module``'s parameters/buffers of those names."""
    import torch

    targets = dict(module.named_parameters())
    targets.update(dict(module.named_buffers()))
    n = 0
    with torch.no_grad():
        for name, t in named:
            dst = targets.get(name)
            if dst is None:
                raise KeyError(f"weight sync: '{name}' is not a parameter of the receiving model")
            dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
            n += 1
    return n


def offload_optimizer(optimizer: Any, device: str) -> None:
    """Move the optimizer's state tensors to ``device`` (CPU between steps: fsdp_config.optimizer_offload)."""
    import torch

    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type != device:
                state[key] = value.to(device, non_blocking=True)
