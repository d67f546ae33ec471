"""The PPO roles as dataflow node classes (``process(item)`` per batch, ``on_control(msg)`` for weights).

Item flow of one step (one item = one batch of prompts x rollout.n)::

    actor_rollout ──► reward_score ──┐
          │  └──────► ref_logprob ───┤ (when a KL term is used)
          │                          ▼
          ├───────────────► critic (GAE: values, advantages, value update)
          │                 or advantage (GRPO: group-normalised advantages)
          ▼                          │
    actor_update ◄───────────────────┘  old log-probs, PPO update, emits the new
          ╰──── policy (control edge, strong consistency) ───► actor_rollout

The actor publishes its weights with a version number from inside its handler;
the runtime guarantees no later item reaches the rollout before that version is
applied, and the rollout stamps each batch with the version it used.
"""
from __future__ import annotations

from typing import Any

from hpc_verl.trainer import algorithms as A
from hpc_verl.trainer import workers as W

POLICY_EDGE = "policy"  # data_type of the actor -> rollout control edge


def _quiet() -> None:
    from hpc_verl.trainer.model import _quiet_transformers
    _quiet_transformers()


def _emit(node: Any, payload: Any, version: int) -> None:
    """Publish on the node's outgoing control edge (the runtime's context, or a test harness hook)."""
    try:
        from hpc_verl.dataflow import current_context
        current_context().emit_control(payload, version)
    except Exception:
        hook = getattr(node, "_emit_hook", None)
        if hook is None:
            raise
        hook(payload, version)


def _version_from_context(default: int) -> int:
    try:
        from hpc_verl.dataflow import current_context
        versions = current_context().versions
        return int(versions.get(POLICY_EDGE, default)) if versions else default
    except Exception:
        return default


class RolloutNode:
    """Generates responses with the latest policy version it was sent."""

    def __init__(self, cfg: dict) -> None:
        _quiet()
        self.worker = W.make_rollout_worker(cfg)
        self.cfg = cfg
        self.need_log_prob = bool(cfg["algorithm"]["use_kl_in_reward"])
        self.sampler_log_prob_ok = bool(cfg["hpc_verl"]["old_log_prob_from_rollout"])

    def process(self, batch: dict) -> dict:
        required = batch.get("required_version")
        out = self.worker.generate(batch, required_version=required)
        merged = dict(batch)
        merged.update(out)
        merged["policy_version"] = self.worker.version
        merged["context_version"] = _version_from_context(self.worker.version)
        if self.need_log_prob and not (self.sampler_log_prob_ok and "rollout_log_prob" in merged):
            # KL-in-reward needs the sampling policy's log-probs before the actor runs
            import torch
            with torch.no_grad():
                m = self.worker.model
                lp = W.response_log_probs(m, merged, float(self.cfg["actor_rollout_ref"]["rollout"]["temperature"]))
            merged["rollout_log_prob"] = lp.float().cpu()
        return merged

    def on_control(self, msg: Any) -> None:
        self.worker.load_weights(msg.payload, msg.version)

    def load_weights(self, weights: dict, version: int) -> int:
        return self.worker.load_weights(weights, version)

    def get_version(self) -> int:
        return self.worker.version

    def rng_state(self) -> Any:
        return self.worker.rng_state()

    def set_rng_state(self, state: Any) -> None:
        self.worker.set_rng_state(state)


class RewardNode:
    def __init__(self, cfg: dict) -> None:
        _quiet()
        self.worker = W.RewardWorker(cfg)

    def process(self, batch: dict) -> dict:
        return self.worker.score(batch)


class RefNode:
    def __init__(self, cfg: dict) -> None:
        _quiet()
        self.worker = W.RefWorker(cfg)

    def process(self, batch: dict) -> dict:
        return self.worker.compute_ref_log_prob(batch)


class _AdvantageMixin:
    """Token rewards (outcome score + optional KL penalty) and the KL controller state."""

    cfg: dict
    kl_ctrl: Any

    def _init_kl(self, cfg: dict) -> None:
        self.cfg = cfg
        self.kl_ctrl = A.make_kl_controller(cfg["algorithm"]["kl_ctrl"])

    def _token_rewards(self, batch: dict, scores: Any, ref: dict | None) -> tuple[Any, dict]:
        algo = self.cfg["algorithm"]
        mask = batch["response_mask"]
        token_scores = A.scores_to_token_rewards(scores, mask)
        metrics: dict[str, float] = {}
        if algo["use_kl_in_reward"] and ref is not None:
            rewards, kl = A.apply_kl_penalty(token_scores, batch["rollout_log_prob"], ref["ref_log_prob"], mask,
                                             self.kl_ctrl, algo["kl_penalty"])
            metrics["kl/mean"] = kl
        else:
            rewards = token_scores
        metrics["kl/coef"] = self.kl_ctrl.value
        return rewards, metrics

    def kl_state(self) -> dict:
        return self.kl_ctrl.state_dict()

    def load_kl_state(self, state: dict) -> None:
        self.kl_ctrl.load_state_dict(state)


class AdvantageNode(_AdvantageMixin):
    """GRPO: advantages from each prompt group's scores (no critic)."""

    def __init__(self, cfg: dict) -> None:
        self._init_kl(cfg)

    def process(self, joined: dict) -> dict:
        batch = joined["actor_rollout"]
        scores = joined["reward_score"]["scores"]
        ref = joined.get("ref_logprob")
        rewards, metrics = self._token_rewards(batch, scores, ref)
        mask = batch["response_mask"]
        seq_reward = (rewards * mask).sum(-1)
        adv = A.compute_grpo_advantages(seq_reward, batch["uid"], mask,
                                        self.cfg["algorithm"]["norm_adv_by_std_in_grpo"])
        out = {"advantages": adv, "scores": scores, "metrics": metrics}
        if ref is not None:
            out["ref_log_prob"] = ref["ref_log_prob"]
        return out

    def state_dict(self) -> dict:
        return {"kl_ctrl": self.kl_state()}

    def load_state_dict(self, state: dict) -> None:
        self.load_kl_state(state["kl_ctrl"])


class CriticNode(_AdvantageMixin):
    """GAE: values of the batch, advantages and returns, then the critic's own update."""

    def __init__(self, cfg: dict, total_steps: int = 0) -> None:
        _quiet()
        self._init_kl(cfg)
        self.worker = W.CriticWorker(cfg, total_steps)

    def process(self, joined: dict) -> dict:
        batch = dict(joined["actor_rollout"])
        scores = joined["reward_score"]["scores"]
        ref = joined.get("ref_logprob")
        batch.update(self.worker.compute_values(batch))
        rewards, metrics = self._token_rewards(batch, scores, ref)
        algo = self.cfg["algorithm"]
        adv, returns = A.compute_gae(rewards, batch["values"], batch["response_mask"], algo["gamma"], algo["lam"])
        batch["advantages"], batch["returns"] = adv, returns
        metrics.update(self.worker.update_critic(batch))
        metrics["critic/values/mean"] = float(A.masked_mean(batch["values"], batch["response_mask"]))
        out = {"advantages": adv, "scores": scores, "metrics": metrics}
        if ref is not None:
            out["ref_log_prob"] = ref["ref_log_prob"]
        return out

    def state_dict(self) -> dict:
        state = self.worker.state_dict()
        state["kl_ctrl"] = self.kl_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.worker.load_state_dict(state)
        self.load_kl_state(state["kl_ctrl"])


class ActorNode:
    """Old log-probs (current weights), the PPO update, then publishes the new weights."""

    def __init__(self, cfg: dict, total_steps: int = 0) -> None:
        _quiet()
        self.worker = W.ActorWorker(cfg, total_steps)
        self.cfg = cfg

    def process(self, joined: dict) -> dict:
        batch = dict(joined["actor_rollout"])
        adv_src = joined.get("critic") or joined.get("advantage")
        batch["advantages"] = adv_src["advantages"]
        if "ref_log_prob" in adv_src:
            batch["ref_log_prob"] = adv_src["ref_log_prob"]
        mask = batch["response_mask"]
        if self.cfg["hpc_verl"]["old_log_prob_from_rollout"] and "rollout_log_prob" in batch:
            # same weights (the version check guarantees it), same float32 maths: skip the extra forward
            batch["old_log_prob"] = batch["rollout_log_prob"]
        else:
            batch.update(self.worker.compute_log_prob(batch))
        metrics = dict(adv_src.get("metrics", {}))
        if "ref_log_prob" in batch and "kl/mean" not in metrics:
            metrics["kl/mean"] = float(A.masked_mean(
                A.kl_penalty(batch["old_log_prob"], batch["ref_log_prob"], "kl"), mask, dim=-1).mean())
        metrics.update(self.worker.update_policy(batch))
        weights, version = self.worker.get_weights()
        _emit(self, weights, version)
        scores = adv_src["scores"]
        metrics.update({
            "reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min()),
            "response_length/mean": float(mask.sum(-1).mean()),
            "advantages/mean": float(A.masked_mean(batch["advantages"], mask)),
            "rollout/policy_version": int(batch["policy_version"]),
            "n_responses": int(mask.shape[0]), "n_response_tokens": int(mask.sum()),
            "timing_s/gen": float(batch.get("gen_time_s", 0.0)),
        })
        return metrics

    def get_weights(self) -> tuple[dict, int]:
        return self.worker.get_weights()

    def get_version(self) -> int:
        return self.worker.version

    def state_dict(self) -> dict:
        return self.worker.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.worker.load_state_dict(state)
