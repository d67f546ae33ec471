"""What the roles that hold a model share (the graph's nodes wrap the roles).

A role runs as one rank of its worker group (``engine.parallel.Parallel``). A rank gets
the whole batch (from the object store, shared by the ranks of a Ray node), or
for the actor's update only the rows it trains on (``minibatch.actor_rows``, fetched as
pieces), and computes only its share:

- forward-only passes (old log-probs, values) take this rank's contiguous rows,
  then all ranks' rows are gathered in order;
- an update goes over the same global mini-batches as one rank would (same
  order, same shuffle), each rank taking its slice of each; a part's loss is its
  sum over the mini-batch's global token (or sequence) count, so the parts add up
  to the one-rank loss and DP=W gives the same update as DP=1 on that batch.

Counters (``fwd_rows``, ``bwd_rows``, ``optim_steps``) count sequences through a
forward or backward and optimizer steps over all ranks, for the benchmarks.
Rank processes; torch is loaded through ``engine.logprobs.torch_mod`` when a role is built.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

from hpc_verl.errors import HpcVerlError
from hpc_verl.trainer import core_algos as A
from hpc_verl.trainer.engine import ulysses
from hpc_verl.trainer.engine.logprobs import chunks, response_log_probs, sub_batch
from hpc_verl.trainer.engine.device import torch_mod
from hpc_verl.trainer.engine.parallel import Parallel, TrainModel, full_tensors, offload_optimizer
from hpc_verl.trainer.engine.sharded import load_sharded, save_sharded
from hpc_verl.trainer.roles.minibatch import minibatches


def rank_counts(par: Parallel, fwd: int = 0, bwd: int = 0, steps: int = 0) -> dict[str, int]:
    torch = torch_mod()
    t = par.all_reduce_sum(torch.tensor([float(fwd), float(bwd)]))
    return {"fwd_rows": int(t[0]), "bwd_rows": int(t[1]), "optim_steps": int(steps)}


class SequenceParallelRole:
    """A role's Ulysses sequence parallelism: ``sp`` consecutive ranks of the group split each
    sequence (configured size), switched off by ``set_ulysses(False)`` from the next step on
    (``HybridScheduler.disable_ulysses``); the forward passes below take the current size."""

    par: Parallel
    device: str
    sp_configured: int = 1
    sp_on: bool = True
    share_prompts: bool = False   # lm.response_log_probs runs a repeated prompt once (set where it applies)

    def _init_sp(self, module: Any, sp: int) -> None:
        self.sp_configured = int(sp or 1)
        self.sp_on = True
        if self.sp_configured > 1:
            view = self.par.with_sp(self.sp_configured)   # the SP groups, made by every rank at start-up
            ulysses.enable(module, view.sp_group)

    @property
    def sp(self) -> int:
        return self.sp_configured if self.sp_on else 1

    def view(self) -> Parallel:
        """This rank as the current step sees it (data-parallel x sequence-parallel)."""
        return self.par.with_sp(self.sp)

    def set_ulysses(self, enabled: bool) -> None:
        if self.sp_configured <= 1:
            return
        self.sp_on = bool(enabled)
        ulysses.set_group(self._sp_module(), self.view().sp_group)

    def _sp_module(self) -> Any:
        raise NotImplementedError

    def _log_probs(self, model: Any, mb: dict, temperature: float, with_entropy: bool = False) -> Any:
        view = self.view()
        if view.sp > 1:
            return ulysses.response_log_probs(model, mb, temperature, with_entropy=with_entropy,
                                              group=view.sp_group, device=self.device)
        if self.share_prompts and isinstance(model, TrainModel):
            # a GRPO group's prompt runs once: with gradients as one forward of what trains (DDP's
            # hooks), without them on the module itself (FSDP2: the sharded module either way)
            if torch_mod().is_grad_enabled():
                return model.run(response_log_probs, mb, temperature, with_entropy=with_entropy,
                                 device=self.device, share_prompts=True)
            model = model.forward_module if model.sharded else model.module
        return response_log_probs(model, mb, temperature, with_entropy=with_entropy, device=self.device,
                                  share_prompts=self.share_prompts)

    def _forward_rows(self, batch: dict, micro: int | None, fn: Callable[[dict], Any],
                      eval_module: Any = None, held: bool = False) -> tuple[Any, int]:
        """``fn`` (no grad) on this data-parallel rank's rows in micro-batches, then every
        data-parallel rank's rows in order; returns (rows, this rank's row count). With ``held``
        ``batch`` is this rank's own rows: all of them, nothing gathered."""
        torch = torch_mod()
        view = self.view()
        n = batch["responses"].shape[0]
        start, stop = (0, n) if held else view.rows(n)
        mine = sub_batch(batch, slice(start, stop))
        if eval_module is not None:
            eval_module.eval()
        outs = []
        with torch.no_grad():
            for sl in chunks(stop - start, micro):
                outs.append(fn(sub_batch(mine, sl)).float())
        own = torch.cat(outs)
        return (own if held else view.all_gather_rows(own)).cpu(), (stop - start if view.sp_rank == 0 else 0)


class TrainableRole(SequenceParallelRole):
    """Model, optimiser and schedule of a role that trains (actor, critic), and the one PPO
    update loop they share."""

    model: TrainModel
    par: Parallel
    device: str

    def _init_training(self, module: Any, strategy: str, fsdp_cfg: dict, optim_cfg: dict, total_steps: int) -> None:
        torch = torch_mod()
        self.model = TrainModel(module, strategy, self.par, param_offload=bool(fsdp_cfg.get("param_offload")),
                                reshard_after_forward=bool(fsdp_cfg.get("reshard_after_forward", True)),
                                ddp_bucket_mb=float(self.cfg["hpc_verl"]["ddp_bucket_mb"]))
        # with param_offload the parameters, so the optimizer state too, already live on the CPU
        self.optimizer_offload = (bool(fsdp_cfg.get("optimizer_offload")) and self.device == "cuda"
                                  and not fsdp_cfg.get("param_offload"))
        # one fused kernel per step (what transformers' Trainer picks on torch >= 2.8) instead of a
        # Python loop over every tensor; sharded (DTensor) or offloaded state keeps the default
        fused = not self.model.sharded and not self.optimizer_offload and not fsdp_cfg.get("param_offload")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim_cfg["lr"],
                                           betas=tuple(optim_cfg["betas"]), weight_decay=optim_cfg["weight_decay"],
                                           fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, A.lr_lambda(optim_cfg, total_steps))

    # ---- the shared update loop --------------------------------------------------------
    def _updates(self, batch: dict, mini_rows: int, micro: int | None, epochs: int, shuffle: bool, gen: Any,
                 grad_clip: float, agg_mode: str, loss_scale_factor: float | None,
                 loss_fn: Callable[[dict, float, float], tuple[Any, list[Any]]], names: list[str],
                 prefix: str, held: tuple[list[int], Any] | None = None) -> dict[str, float]:
        """PPO epochs over global mini-batches (one optimiser step each); this rank's slice of
        each in micro-batches with gradient accumulation; clipping on the global norm.
        ``loss_fn(micro_batch, denom, token_denom) -> (loss, [stats...])`` returns this
        part's share (see ``algorithms.agg_loss``)."""
        torch = torch_mod()
        par = self.view()
        # held: (the rows of the whole batch that ``batch`` holds, the whole batch's response mask)
        full_mask = batch["response_mask"] if held is None else held[1]
        at = None if held is None else {int(g): i for i, g in enumerate(held[0])}
        n_rows = full_mask.shape[0]
        mini_rows = min(mini_rows, n_rows)
        if mini_rows % par.dp_world:
            raise HpcVerlError(f"{prefix}: a mini-batch of {mini_rows} responses does not split over "
                               f"{par.dp_world} data-parallel ranks; make ppo_mini_batch_size x rollout.n a "
                               f"multiple of {par.dp_world}")
        per_rank = mini_rows // par.dp_world
        micro = micro or per_rank
        self.model.train()
        if self.optimizer_offload:
            offload_optimizer(self.optimizer, self.device)
        sums: list[list[float]] = []
        norms: list[float] = []
        skipped = fwd = 0
        clock = self.model.phases
        clock.reset()
        for idx, local in minibatches(n_rows, mini_rows, epochs, shuffle, gen, par.dp_rank, par.dp_world):
            mask = full_mask[idx]
            denom = A.loss_denominator(mask, agg_mode, loss_scale_factor)
            token_denom = A.loss_denominator(mask, "token-mean")
            if at is not None:   # the rows' places in what this rank holds
                local = torch.tensor([at[int(g)] for g in local], dtype=torch.long)
            parts = list(chunks(len(local), micro))
            acc = torch.zeros(len(names), dtype=torch.float64)
            for j, sl in enumerate(parts):
                mb = sub_batch(batch, local[sl])
                with self.model.grad_sync(j == len(parts) - 1):
                    t0 = time.perf_counter()
                    loss, stats = loss_fn(mb, denom, token_denom)
                    clock.add("forward", time.perf_counter() - t0)
                    # DDP/FSDP average over all world ranks; the SP ranks of a group each hold their
                    # share of one loss's gradient (ulysses.gather_seq), so x world is the sum
                    clock.backward(loss * par.world)
                acc += torch.tensor([float(s) for s in stats], dtype=torch.float64)
                fwd += len(local[sl]) if par.sp_rank == 0 else 0
            sums.append((par.all_reduce_sum(acc) / par.sp).tolist())   # the SP ranks computed the same
            t0 = time.perf_counter()
            norm, ok = self._step(grad_clip)
            clock.add("optimizer", time.perf_counter() - t0)
            norms.append(norm)
            skipped += 0 if ok else 1
        self.scheduler.step()   # once per training step (verl), not per PPO epoch or mini-batch
        if self.optimizer_offload:
            offload_optimizer(self.optimizer, "cpu")
        out = {f"{prefix}/{name}": sum(s[i] for s in sums) / len(sums) for i, name in enumerate(names)}
        out[f"{prefix}/grad_norm"] = sum(norms) / len(norms)
        out[f"{prefix}/lr"] = self.scheduler.get_last_lr()[0]
        out[f"{prefix}/ulysses_sp"] = par.sp
        out["counts"] = rank_counts(par, fwd, fwd, len(norms))
        out.update(clock.metrics(par, f"update_{prefix}"))
        if prefix == "actor":
            out["actor/skipped_steps"] = float(skipped)
        return out

    def _step(self, grad_clip: float) -> tuple[float, bool]:
        torch = torch_mod()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=grad_clip if grad_clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        ok = bool(torch.isfinite(norm))
        if ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm), ok

    # ---- checkpoints -------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict()}

    def _load_extra(self, extra: dict) -> None:
        self.scheduler.load_state_dict(extra["scheduler"])

    def save_checkpoint(self, path: str) -> None:
        """Sharded model + optimizer (any world size can load it) and rank 0's extras."""
        save_sharded(path, self.model.module, self.optimizer, self._extra_state(), self.par)

    def load_checkpoint(self, path: str) -> None:
        self._load_extra(load_sharded(path, self.model.module, self.optimizer, self.par))

    def export_tensors(self) -> Any:
        """Full parameters, gathered one at a time (collective under FSDP)."""
        return full_tensors(self.model.module)

    def _sp_module(self) -> Any:
        return self.model.module

    def weights_digest(self) -> str | None:
        """SHA-256 of this rank's replicated parameters (DDP), to prove ranks have not drifted;
        None under FSDP, where each rank holds a different shard by design."""
        if self.model.sharded:
            return None
        h = hashlib.sha256()
        for name, t in full_tensors(self.model.module):
            h.update(name.encode())
            h.update(t.detach().contiguous().cpu().view(-1).view(torch_mod().uint8).numpy().tobytes())
        return h.hexdigest()
