"""The actor role: log-probs of sampled responses and the clipped PPO update (rank processes)."""
from __future__ import annotations

from typing import Any

from hpc_verl.trainer import core_algos as A
from hpc_verl.trainer.engine.logprobs import can_share_prompts
from hpc_verl.trainer.engine.device import cpu_linears, load_causal_lm, pick_device, setup_threads, torch_mod
from hpc_verl.trainer.engine.parallel import Parallel
from hpc_verl.trainer.roles.base import TrainableRole
from hpc_verl.trainer.roles.minibatch import ACTOR_SEED_OFFSET, update_generator


class ActorWorker(TrainableRole):
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
