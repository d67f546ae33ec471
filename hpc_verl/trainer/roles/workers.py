"""The PPO roles that hold models, as plain classes (the graph's nodes wrap them).

A role runs as one rank of its worker group (``parallel.Parallel``). A rank gets
the whole batch (from the object store, shared by the ranks of a Ray node), or
for the actor's update only the rows it trains on (``actor_rows``, fetched as
pieces), and computes only its share:

- forward-only passes (old log-probs, values) take this rank's contiguous rows,
  then all ranks' rows are gathered in order;
- an update goes over the same global mini-batches as one rank would (same
  order, same shuffle), each rank taking its slice of each; a part's loss is its
  sum over the mini-batch's global token (or sequence) count, so the parts add up
  to the one-rank loss and DP=W gives the same update as DP=1 on that batch.

Counters (``fwd_rows``, ``bwd_rows``, ``optim_steps``) count sequences through a
forward or backward and optimizer steps over all ranks, for the benchmarks.
"""
from __future__ import annotations

import time

from typing import Any, Callable

from hpc_verl.errors import HpcVerlError
from hpc_verl.trainer import core_algos as A
from hpc_verl.trainer.engine import ulysses
from hpc_verl.trainer.engine.logprobs import (can_share_prompts, chunks, cpu_linears, load_causal_lm, pick_device,
                                 response_log_probs, setup_threads, sub_batch, torch_mod)
from hpc_verl.trainer.engine.parallel import (Parallel, TrainModel, full_tensors, load_sharded, offload_optimizer,
                                       save_sharded, shard_model, shards)


ACTOR_SEED_OFFSET = 101   # the actor's shuffle seed: trainer.seed + this


def update_generator(seed: int, step: int) -> Any:
    """The shuffle generator of a role's update at ``step`` (the same on every rank)."""
    return torch_mod().Generator().manual_seed(seed * 1_000_003 + step)


def minibatches(n_rows: int, mini_rows: int, epochs: int, shuffle: bool, gen: Any, dp_rank: int,
                dp_world: int) -> Any:
    """``(rows of the mini-batch, this data-parallel rank's rows of it)`` in update order: one rule
    for the update loop and for the rows a rank fetches before it (``actor_rows``)."""
    torch = torch_mod()
    mini_rows = min(mini_rows, n_rows)
    per_rank = mini_rows // dp_world
    for _ in range(epochs):
        order = torch.randperm(n_rows, generator=gen) if shuffle else torch.arange(n_rows)
        for start in range(0, n_rows, mini_rows):
            idx = order[start:start + mini_rows]
            yield idx, idx[dp_rank * per_rank:(dp_rank + 1) * per_rank]


def actor_rows(cfg: dict, n_rows: int, rank: int, world: int, item: Any) -> list[int]:
    """The rows rank ``rank`` of the actor trains on at the item's step (its ``take_rows``): known
    before the batch is fetched, so a rank fetches only these. Every row where Ulysses splits
    sequences (its data-parallel size may change at run time) or the batch does not split evenly
    (the update then says why)."""
    a = cfg["actor_rollout_ref"]["actor"]
    mini = int(a["ppo_mini_batch_size"]) * int(cfg["actor_rollout_ref"]["rollout"]["n"])
    sp = int(a["fsdp_config"].get("ulysses_sequence_parallel_size") or 1)
    if sp > 1 or world < 1 or min(mini, n_rows) % world:
        return list(range(n_rows))
    step = int(item.get("step", 0)) if isinstance(item, dict) else 0
    gen = update_generator(int(cfg["trainer"]["seed"]) + ACTOR_SEED_OFFSET, step)
    rows: set[int] = set()
    for _, local in minibatches(n_rows, mini, int(a["ppo_epochs"]), bool(a["shuffle"]), gen, rank, world):
        rows.update(int(g) for g in local)
    return sorted(rows)


def _counts(par: Parallel, fwd: int = 0, bwd: int = 0, steps: int = 0) -> dict[str, int]:
    torch = torch_mod()
    t = par.all_reduce_sum(torch.tensor([float(fwd), float(bwd)]))
    return {"fwd_rows": int(t[0]), "bwd_rows": int(t[1]), "optim_steps": int(steps)}


class _SequenceParallel:
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


class _Trainable(_SequenceParallel):
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
        out["counts"] = _counts(par, fwd, fwd, len(norms))
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
        import hashlib

        if self.model.sharded:
            return None
        h = hashlib.sha256()
        for name, t in full_tensors(self.model.module):
            h.update(name.encode())
            h.update(t.detach().contiguous().cpu().view(-1).view(torch_mod().uint8).numpy().tobytes())
        return h.hexdigest()


class ActorWorker(_Trainable):
    """The policy: log-probs of sampled responses and the clipped PPO update."""

    def __init__(self, cfg: dict, total_steps: int = 0) -> None:
        torch = torch_mod()
        setup_threads(cfg)
        torch.manual_seed(int(cfg["trainer"]["seed"]))
        self.cfg = cfg
        mcfg = cfg["actor_rollout_ref"]["model"]
        self.acfg = cfg["actor_rollout_ref"]["actor"]
        self.device = pick_device(cfg)
        self.par = Parallel.current(self.device)
        module = load_causal_lm(mcfg["path"], self.device, "float32", mcfg["trust_remote_code"])
        cpu_linears(cfg, module)
        if mcfg["enable_gradient_checkpointing"]:
            module.gradient_checkpointing_enable()
        self._init_sp(module, self.acfg["fsdp_config"]["ulysses_sequence_parallel_size"])
        self._init_training(module, self.acfg["strategy"], self.acfg["fsdp_config"], self.acfg["optim"],
                            total_steps)
        self.share_prompts = self.sp_configured == 1 and can_share_prompts(module)
        self.version = 0
        self.seed = int(cfg["trainer"]["seed"]) + ACTOR_SEED_OFFSET
        self.n = int(cfg["actor_rollout_ref"]["rollout"]["n"])
        self.temperature = float(cfg["actor_rollout_ref"]["rollout"]["temperature"])

    def compute_log_prob(self, batch: dict, held: bool = False) -> tuple[dict, int]:
        """Old log-probs of every row (each rank its share, then gathered), or with ``held`` of
        the rows this rank holds (its own rows: nothing to gather)."""
        micro = self.cfg["actor_rollout_ref"]["rollout"]["log_prob_micro_batch_size_per_gpu"]
        lp, rows = self._forward_rows(batch, micro, lambda mb: self._log_probs(self.model, mb, self.temperature),
                                      self.model, held=held)
        return {"old_log_prob": lp}, rows

    def update_policy(self, batch: dict, step: int = 0, held: tuple[list[int], Any] | None = None) -> dict:
        """PPO epochs over mini-batches (one optimiser step each), micro-batches accumulate grads."""
        a = self.acfg
        use_kl_loss = a["use_kl_loss"] and "ref_log_prob" in batch
        torch = torch_mod()
        gen = update_generator(self.seed, step)
        dev = self.device

        def loss_fn(m: dict, denom: float, token_denom: float) -> tuple[Any, list[Any]]:
            mask = m["response_mask"].to(dev)
            logp, ent = self._log_probs(self.model, m, self.temperature, with_entropy=True)
            pl = A.policy_loss(m["old_log_prob"].to(dev), logp, m["advantages"].to(dev), mask,
                               a["clip_ratio_low"], a["clip_ratio_high"], a["clip_ratio_c"], a["loss_agg_mode"],
                               denom=denom, token_denom=token_denom)
            entropy = A.agg_loss(ent, mask, a["loss_agg_mode"], denom)
            # no entropy bonus: the entropy is a figure only, kept out of the backward
            loss = pl.loss - a["entropy_coeff"] * entropy if a["entropy_coeff"] else pl.loss
            kl = torch.zeros(())
            if use_kl_loss:
                kl = A.agg_loss(A.kl_penalty(logp, m["ref_log_prob"].to(dev), a["kl_loss_type"]), mask,
                                a["loss_agg_mode"], denom)
                loss = loss + a["kl_loss_coef"] * kl
            return loss, [pl.loss.item(), entropy.item(), pl.clipfrac.item(), pl.approx_kl.item(),
                          float(pl.clipfrac_lower), kl.item()]

        names = ["pg_loss", "entropy", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "kl_loss"]
        out = self._updates(batch, a["ppo_mini_batch_size"] * self.n, a["ppo_micro_batch_size_per_gpu"],
                            a["ppo_epochs"], a["shuffle"], gen, a["grad_clip"], a["loss_agg_mode"],
                            a["loss_scale_factor"], loss_fn, names, "actor", held=held)
        if not use_kl_loss:
            out.pop("actor/kl_loss")
        self.version += 1
        out["actor/policy_version"] = self.version
        return out

    def _extra_state(self) -> dict:
        return {**super()._extra_state(), "version": self.version}

    def _load_extra(self, extra: dict) -> None:
        super()._load_extra(extra)
        self.version = int(extra.get("version", 0))


class CriticWorker(_Trainable):
    """A value model (the LM backbone with a scalar head) and its clipped value-loss update."""

    def __init__(self, cfg: dict, total_steps: int = 0) -> None:
        torch = torch_mod()
        from transformers import AutoModelForTokenClassification
        setup_threads(cfg)
        torch.manual_seed(int(cfg["trainer"]["seed"]) + 1)
        self.cfg = cfg
        self.ccfg = cfg["critic"]
        self.device = pick_device(cfg)
        self.par = Parallel.current(self.device)
        # classifier_dropout=0: the value head's default dropout (0.1) would make every value forward
        # random in training mode (verl zeroes it too)
        from transformers import AutoConfig
        trust = cfg["actor_rollout_ref"]["model"]["trust_remote_code"]
        path = self.ccfg["model"]["path"]
        mcfg = AutoConfig.from_pretrained(path, num_labels=1, local_files_only=True, trust_remote_code=trust)
        mcfg.classifier_dropout = 0.0
        module = AutoModelForTokenClassification.from_pretrained(path, config=mcfg, local_files_only=True,
                                                                 trust_remote_code=trust).to(self.device)
        cpu_linears(cfg, module)
        self._init_sp(module, self.ccfg["fsdp"]["ulysses_sequence_parallel_size"])
        self._init_training(module, self.ccfg["strategy"], self.ccfg["fsdp"], self.ccfg["optim"], total_steps)
        self.n = int(cfg["actor_rollout_ref"]["rollout"]["n"])
        self.seed = int(cfg["trainer"]["seed"]) + 211

    def _values(self, batch: dict) -> Any:
        dev = self.device
        view = self.view()
        ids, attn, pos = (batch[k].to(dev) for k in ("input_ids", "attention_mask", "position_ids"))
        if view.sp > 1:
            out, sb = ulysses.forward(self.model, ids, attn, pos, view.sp_group)
            logits = sb.gather(out.logits)
        else:
            logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        rlen = batch["responses"].shape[1]
        return logits[:, -rlen - 1:-1, 0].float() * batch["response_mask"].to(dev)

    def compute_values(self, batch: dict) -> tuple[dict, int]:
        values, rows = self._forward_rows(batch, self.ccfg["ppo_micro_batch_size_per_gpu"], self._values, self.model)
        return {"values": values}, rows

    def update_critic(self, batch: dict, step: int = 0) -> dict:
        """PPO epochs of the value loss; ``critic.shuffle`` reorders the rows each epoch (the same
        order on every rank, from the seed and ``step``)."""
        c = self.ccfg
        dev = self.device
        torch = torch_mod()
        gen = update_generator(self.seed, step)

        def loss_fn(m: dict, denom: float, token_denom: float) -> tuple[Any, list[Any]]:
            mask = m["response_mask"].to(dev)
            loss, frac = A.value_loss(self._values(m), m["values"].to(dev), m["returns"].to(dev), mask,
                                      c["cliprange_value"], c["loss_agg_mode"], denom=denom, token_denom=token_denom)
            return loss, [loss.item(), frac.item()]

        return self._updates(batch, c["ppo_mini_batch_size"] * self.n, c["ppo_micro_batch_size_per_gpu"],
                             c["ppo_epochs"], c["shuffle"], gen, c["grad_clip"], c["loss_agg_mode"],
                             c["loss_scale_factor"], loss_fn, ["vf_loss", "vf_clipfrac"], "critic")


class RefWorker(_SequenceParallel):
    """A frozen copy of the initial policy, for the KL term: one rank of its group (sharded like
    the actor under FSDP, sequence-parallel like the ref's fsdp_config says)."""

    def __init__(self, cfg: dict) -> None:
        setup_threads(cfg)
        self.cfg = cfg
        mcfg = cfg["actor_rollout_ref"]["model"]
        self.device = pick_device(cfg)
        self.par = Parallel.current(self.device)
        self.model = load_causal_lm(mcfg["path"], self.device, "float32", mcfg["trust_remote_code"])
        cpu_linears(cfg, self.model)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        fc = cfg["actor_rollout_ref"]["ref"]["fsdp_config"]
        self._init_sp(self.model, fc["ulysses_sequence_parallel_size"])
        if shards(cfg["actor_rollout_ref"]["actor"]["strategy"], self.par):
            shard_model(self.model, self.par, param_offload=bool(fc["param_offload"]),
                        reshard_after_forward=bool(fc["reshard_after_forward"]),
                        mixed_precision=self.device == "cuda")
        self.share_prompts = self.sp_configured == 1 and can_share_prompts(self.model)
        self.temperature = float(cfg["actor_rollout_ref"]["rollout"]["temperature"])

    def _sp_module(self) -> Any:
        return self.model

    def compute_ref_log_prob(self, batch: dict) -> dict:
        """Log-probs of the whole batch: this data-parallel rank's rows, gathered (SPMD)."""
        micro = self.cfg["actor_rollout_ref"]["ref"]["log_prob_micro_batch_size_per_gpu"]
        lp, rows = self._forward_rows(batch, micro, lambda mb: self._log_probs(self.model, mb, self.temperature))
        counts = _counts(self.par, rows, 0, 0)
        return {"ref_log_prob": lp, "counts": {"fwd_rows": counts["fwd_rows"]}}


class RewardWorker:
    """Scores responses: rule functions by ``data_source``, or a sequence-classification reward model."""

    def __init__(self, cfg: dict) -> None:
        from hpc_verl.trainer.roles.rewards import RuleReward
        setup_threads(cfg)
        self.cfg = cfg
        rm = cfg["reward_model"]
        cr = cfg["custom_reward_function"]
        self.rule = RuleReward(cr["path"], cr["name"])
        self.rm_model = None
        if rm["enable"]:
            from transformers import AutoModelForSequenceClassification
            path = rm["model"]["path"]
            if not path:
                raise HpcVerlError("reward_model.enable=true needs reward_model.model.path (a local "
                                   "sequence-classification model directory)")
            self.device = pick_device(cfg)
            self.rm_model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, local_files_only=True).to(self.device).eval()

    def score(self, batch: dict) -> dict:
        torch = torch_mod()
        if self.rm_model is not None:
            micro = self.cfg["reward_model"]["micro_batch_size_per_gpu"]
            outs = []
            with torch.no_grad():
                dev = self.device
                for sl in chunks(batch["input_ids"].shape[0], micro):
                    out = self.rm_model(input_ids=batch["input_ids"][sl].to(dev),
                                        attention_mask=batch["attention_mask"][sl].to(dev),
                                        position_ids=batch["position_ids"][sl].to(dev))
                    outs.append(out.logits[:, 0].float().cpu())
            scores = torch.cat(outs)
        else:
            scores = torch.tensor([self.rule.score(ds, text, gt, ex) for ds, text, gt, ex in zip(
                batch["data_source"], batch["response_text"], batch["ground_truth"], batch["extra_info"])],
                dtype=torch.float32)
        return {"scores": scores}
