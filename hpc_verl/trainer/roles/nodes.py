"""The PPO roles as dataflow node classes (``process(item)`` per batch).

Item flow of one step (one item = one batch of prompts x rollout.n)::

    actor_rollout ──► reward_score ──┐       split by prompt group over the rollout replicas
          │  └──────► ref_logprob ───┤       SPMD over the reference ranks (KL only)
          │                          ▼
          ├───────────────► critic (GAE: values, advantages, value update; SPMD)
          │                 or advantage (GRPO, RLOO, REINFORCE++: no critic)
          ▼                          │
    actor_update ◄───────────────────┘  old log-probs, PPO update (SPMD, DDP/FSDP2), then
          ╰──── policy (control edge, strong consistency, TENSORS) ───► actor_rollout

The actor publishes a new version with the TENSORS marker: the runtime moves its
weights into the rollout inside each process (colocated, the default) or by a
bucketed broadcast (the rollout on its own GPUs), never through the driver; no
later batch reaches a rollout replica that does not hold that version.
"""
from __future__ import annotations

import time
from typing import Any

from hpc_verl.dataflow.context import SNAPSHOT, TENSORS
from hpc_verl.trainer.models.check import quiet_transformers
from hpc_verl.trainer.rollout import make_rollout_worker
from hpc_verl.dataflow import current_context
from hpc_verl.trainer.config.schema import check_batch_arithmetic
from hpc_verl.data.prompt_tokenizer import check_prompt_ids
from hpc_verl.trainer.engine.logprobs import can_share_prompts, response_log_probs
import copy
from hpc_verl.trainer.config.schema import batch_problems_for
from hpc_verl.trainer import core_algos as A
import os
from hpc_verl.errors import ConfigError

# core_algos' maths, the role workers, the rollouts and engine/ import torch: each method imports what it
# uses, so the driver, which imports this module for the node classes only (to build the graph), never does

# The PPO graph's node names (driver/ppo_graph.py declares the graph with them)
ROLLOUT_NODE = "actor_rollout"
REWARD_NODE = "reward_score"
REF_NODE = "ref_logprob"
ADVANTAGE_NODE = "advantage"   # critic-free estimators (GRPO, RLOO, REINFORCE++)
CRITIC_NODE = "critic"         # GAE: the critic computes values and advantages
ACTOR_NODE = "actor_update"
POLICY_EDGE = "policy"  # data_type of the actor -> rollout control edge


def _context() -> Any:
    return current_context()


def _sum_counts(*parts: dict | None) -> dict[str, int]:
    """Counters from several roles (ints, or per-shard lists from split nodes), added up."""
    out: dict[str, int] = {}
    for part in parts:
        for key, value in (part or {}).items():
            out[key] = out.get(key, 0) + (sum(value) if isinstance(value, list) else int(value))
    return out


def preload_model_stack() -> None:
    """What building a model-holding node imports: transformers' auto classes, seconds of CPU.
    The dataflow worker calls a node class's ``preload`` when its process starts, so this runs
    while the driver is still setting up instead of after it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


class RolloutNode:
    """A rollout replica: generates for its shard with the latest policy version it holds."""

    preload = staticmethod(preload_model_stack)

    def __init__(self, cfg: dict) -> None:
        quiet_transformers()
        self.worker = make_rollout_worker(cfg)
        self.cfg = cfg
        self.need_log_prob = bool(cfg["algorithm"]["use_kl_in_reward"])
        self.sampler_log_prob_ok = bool(cfg["hpc_verl"]["old_log_prob_from_rollout"])
        self.sync_s = 0.0
        if getattr(self.worker, "model", None) is None:   # vLLM: no model here to recompute with
            if self.need_log_prob and not getattr(self.worker, "log_probs_exact", False):
                raise ConfigError("algorithm.use_kl_in_reward with rollout.name=vllm takes the sampler's log-probs, "
                                  "which equal the policy's only without top-k/top-p filtering; set "
                                  "actor_rollout_ref.rollout.top_k=-1 and top_p=1.0")
            self.sampler_log_prob_ok = True

    def check_prompt_ids(self, samples: list, chat_template: str | None) -> int:
        """The driver's prompts, rendered and encoded again by this rollout's transformers
        tokenizer (``hpc_verl.data.prompt_tokenizer``); one line where they differ."""
        return check_prompt_ids(self.worker.tokenizer, samples, chat_template, ROLLOUT_NODE)

    def process(self, shard: dict) -> dict:
        ctx = _context()
        first_row = ctx.shard_rows[0] if ctx.shard_rows else 0
        out = self.worker.generate(shard, required_version=shard.get("required_version"), first_row=first_row)
        merged = dict(shard)
        merged.update(out)
        merged["policy_version"] = self.worker.version
        rows = len(shard["prompt_ids"])
        merged["replicas"] = [{"replica": ctx.index, "rows": rows, "gen_time_s": out["gen_time_s"][0],
                               "tokens": out["n_response_tokens"][0]}]
        merged["counts"] = {"gen_tokens": out["n_response_tokens"], "fwd_rows": [0]}
        merged["sync_time_s"] = [self.sync_s]   # installing the weights this rollout used (verl: update_weights)
        if self.need_log_prob and not (self.sampler_log_prob_ok and "rollout_log_prob" in merged):
            # KL-in-reward needs the sampling policy's log-probs before the actor runs
            import torch
            with torch.no_grad():
                lp = response_log_probs(self.worker.model, merged,
                                        float(self.cfg["actor_rollout_ref"]["rollout"]["temperature"]),
                                        share_prompts=can_share_prompts(self.worker.model))
            merged["rollout_log_prob"] = lp.float().cpu()
            merged["counts"]["fwd_rows"] = [rows]
        return merged

    def load_tensors(self, data_type: str, named: Any, version: int) -> int:
        t0 = time.perf_counter()
        try:
            return self.worker.load_tensors(named, version)
        finally:
            self.sync_s = time.perf_counter() - t0

    def tensor_dtype(self, data_type: str) -> str:
        return self.worker.tensor_dtype()

    def get_version(self) -> int:
        return self.worker.version


class RewardNode:
    def __init__(self, cfg: dict) -> None:
        from hpc_verl.trainer.roles.reward import RewardWorker   # torch: only in the rank that builds it
        if cfg["reward_model"]["enable"]:   # rule rewards score the rollout's text: no transformers import
            quiet_transformers()
        self.worker = RewardWorker(cfg)

    def process(self, batch: dict) -> dict:
        return self.worker.score(batch)


class _Ulysses:
    """``set_ulysses`` for HybridScheduler.disable_ulysses: the worker splits sequences again or not
    from its next step on."""

    worker: Any

    def set_ulysses(self, enabled: bool) -> None:
        self.worker.set_ulysses(enabled)

    def check_ulysses_off(self) -> str | None:
        """Why the batches could not be split over all ranks without Ulysses (None: they can)."""
        cfg = copy.deepcopy(self.worker.cfg)
        cfg["actor_rollout_ref"]["actor"]["fsdp_config"]["ulysses_sequence_parallel_size"] = 1
        cfg["actor_rollout_ref"]["actor"]["ulysses_sequence_parallel_size"] = 1
        cfg["critic"]["fsdp"]["ulysses_sequence_parallel_size"] = 1
        cfg["critic"]["ulysses_sequence_parallel_size"] = 1
        problems = batch_problems_for(cfg)
        return problems[0] if problems else None


class RefNode(_Ulysses):
    """One rank of the reference's group (SPMD: every rank gets the batch, computes its rows)."""

    preload = staticmethod(preload_model_stack)

    def __init__(self, cfg: dict) -> None:
        from hpc_verl.trainer.roles.ref import RefWorker   # torch: only in the rank that builds it
        quiet_transformers()
        self.worker = RefWorker(cfg)

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
            coef = self.kl_ctrl.value   # the coefficient this batch was penalised with (before the update)
            rewards, kl = A.apply_kl_penalty(token_scores, batch["rollout_log_prob"], ref["ref_log_prob"], mask,
                                             self.kl_ctrl, algo["kl_penalty"])
            metrics["actor/reward_kl_penalty"] = kl
            metrics["actor/reward_kl_penalty_coeff"] = coef
        else:
            rewards = token_scores
        seq = (rewards * mask).sum(-1)
        metrics.update({"critic/rewards/mean": float(seq.mean()), "critic/rewards/max": float(seq.max()),
                        "critic/rewards/min": float(seq.min())})
        return rewards, metrics

    @staticmethod
    def _passed_on(out: dict, ref: dict | None, counts: dict) -> dict:
        if ref is not None:
            out["ref_log_prob"] = ref["ref_log_prob"]
        out["counts"] = _sum_counts(counts, ref.get("counts") if ref else None)
        return out


class AdvantageNode(_AdvantageMixin):
    """A critic-free estimator (GRPO, RLOO, REINFORCE++): advantages from the token rewards and,
    for the group estimators, each prompt group's scores."""

    def __init__(self, cfg: dict) -> None:
        self._init_kl(cfg)

    def process(self, joined: dict) -> dict:
        batch = joined[ROLLOUT_NODE]
        scores = joined[REWARD_NODE]["scores"]
        ref = joined.get(REF_NODE)
        rewards, metrics = self._token_rewards(batch, scores, ref)
        algo = self.cfg["algorithm"]
        adv = A.outcome_advantages(algo["adv_estimator"], rewards, batch["response_mask"], batch["uid"],
                                   gamma=algo["gamma"], norm_adv_by_std_in_grpo=algo["norm_adv_by_std_in_grpo"])
        return self._passed_on({"advantages": adv, "scores": scores, "metrics": metrics,
                                "response_mask": batch["response_mask"],
                                "total_tokens": int(batch["attention_mask"].sum())}, ref, {})

    def state_dict(self) -> dict:
        return {"kl_ctrl": self.kl_ctrl.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])


class CriticNode(_AdvantageMixin, _Ulysses):
    """GAE, one rank of the critic's group: values (rows split, gathered), advantages and
    returns (the same on every rank), then the data-parallel value update."""

    preload = staticmethod(preload_model_stack)

    def __init__(self, cfg: dict, total_steps: int = 0) -> None:
        from hpc_verl.trainer.roles.critic import CriticWorker   # torch: only in the rank that builds it
        quiet_transformers()
        self._init_kl(cfg)
        self.worker = CriticWorker(cfg, total_steps)

    def timings(self) -> dict[str, float]:
        """This rank's phase times of its last value update (the dashboard's per-rank table)."""
        return {f"update_critic/{k}": v for k, v in self.worker.model.phases.last.items()}

    def process(self, joined: dict) -> dict:
        batch = dict(joined[ROLLOUT_NODE])
        scores = joined[REWARD_NODE]["scores"]
        ref = joined.get(REF_NODE)
        values, _ = self.worker.compute_values(batch)
        batch.update(values)
        rewards, metrics = self._token_rewards(batch, scores, ref)
        algo = self.cfg["algorithm"]
        adv, returns = A.compute_gae(rewards, batch["values"], batch["response_mask"], algo["gamma"], algo["lam"])
        batch["advantages"], batch["returns"] = adv, returns
        update = self.worker.update_critic(batch, step=int(batch.get("step", 0)))
        counts = update.pop("counts")
        counts["fwd_rows"] += batch["responses"].shape[0]   # the values pass, over all ranks
        metrics.update(update)
        metrics["critic/values/mean"] = float(A.masked_mean(batch["values"], batch["response_mask"]))
        return self._passed_on({"advantages": adv, "scores": scores, "metrics": metrics,
                                "response_mask": batch["response_mask"],
                                "total_tokens": int(batch["attention_mask"].sum())}, ref, counts)

    def save_checkpoint(self, path: str) -> None:
        self.worker.save_checkpoint(path)
        if self.worker.par.rank == 0:
            import torch
            torch.save({"kl_ctrl": self.kl_ctrl.state_dict()}, os.path.join(path, "kl_ctrl.pt"))
        self.worker.par.barrier()

    def load_checkpoint(self, path: str) -> None:
        import torch
        self.worker.load_checkpoint(path)
        self.kl_ctrl.load_state_dict(torch.load(os.path.join(path, "kl_ctrl.pt"), weights_only=False)["kl_ctrl"])

    def check_world_size(self, world: int) -> str | None:
        return _check_world(self.cfg, world)


class ActorNode(_Ulysses):
    """One rank of the actor's group: old log-probs, the PPO update, then the new version
    published (TENSORS: the runtime moves the weights to the rollout)."""

    preload = staticmethod(preload_model_stack)

    def __init__(self, cfg: dict, total_steps: int = 0) -> None:
        from hpc_verl.trainer.roles.actor import ActorWorker   # torch: only in the rank that builds it
        quiet_transformers()
        self.worker = ActorWorker(cfg, total_steps)
        self.cfg = cfg
        # one-step-off-policy: each version's weights frozen after its update (rank 0), so the
        # broadcast of version v can run while version v+1 trains
        self.overlap = bool(cfg["hpc_verl"]["one_step_off_policy"])
        self._snapshots: dict[int, list] = {}

    def timings(self) -> dict[str, float]:
        """This rank's phase times of its last policy update (the dashboard's per-rank table)."""
        return {f"update_actor/{k}": v for k, v in self.worker.model.phases.last.items()}

    def process(self, joined: dict) -> dict:
        import torch
        batch = dict(joined[ROLLOUT_NODE])
        adv_src = joined.get(CRITIC_NODE) or joined.get(ADVANTAGE_NODE)
        # the rows this rank fetched (its take_rows: the ones it trains on), or the whole batch
        mask = adv_src.get("response_mask", batch["response_mask"])
        rows = _context().row_ids
        held = None if rows is None or len(rows) == mask.shape[0] else (rows, mask)
        pick = (lambda t: t) if held is None else (lambda t: t[torch.as_tensor(rows, dtype=torch.long)])
        batch["advantages"] = pick(adv_src["advantages"])
        if "ref_log_prob" in adv_src:
            batch["ref_log_prob"] = pick(adv_src["ref_log_prob"])
        own_rows = 0
        t0 = time.perf_counter()
        if self.cfg["hpc_verl"]["old_log_prob_from_rollout"] and "rollout_log_prob" in batch:
            # the sampler's log-probs (the behaviour policy's, checked by version): skip the extra forward
            batch["old_log_prob"] = batch["rollout_log_prob"]
        else:
            lp, own = self.worker.compute_log_prob(batch, held=held is not None)
            batch.update(lp)
            own_rows = (int(self.worker.par.all_reduce_sum(torch.tensor([float(own)]))[0]) if held is not None
                        else mask.shape[0])
        t_old = time.perf_counter() - t0
        metrics = dict(adv_src.get("metrics", {}))
        step = int(batch.get("step", 0))
        t0 = time.perf_counter()
        if step > int(self.cfg["trainer"]["critic_warmup"]):
            update = self.worker.update_policy(batch, step=step, held=held)
            if self.overlap:
                self._freeze(self.worker.version)
                _context().emit_control(SNAPSHOT, self.worker.version)
            else:
                _context().emit_control(TENSORS, self.worker.version)
        else:  # trainer.critic_warmup: the critic learns first, the policy (and its version) stays
            update = {"counts": {}, "actor/policy_version": self.worker.version}
        t_update = time.perf_counter() - t0
        counts = _sum_counts(update.pop("counts"), {"fwd_rows": own_rows}, adv_src.get("counts"),
                             batch.get("counts"))
        metrics.update(update)
        scores = adv_src["scores"]
        lengths = mask.sum(-1)
        adv = adv_src["advantages"][mask.bool()]
        metrics.update({   # verl's names (verl/trainer/ppo/metric_utils.py) for what we compute
            "critic/score/mean": float(scores.mean()), "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "critic/advantages/mean": float(adv.mean()) if adv.numel() else 0.0,
            "critic/advantages/max": float(adv.max()) if adv.numel() else 0.0,
            "critic/advantages/min": float(adv.min()) if adv.numel() else 0.0,
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response_length/clip_ratio": float((lengths >= mask.shape[1]).float().mean()),
            "rollout/policy_version": int(batch["policy_version"]),
            "n_responses": int(mask.shape[0]), "n_response_tokens": int(mask.sum()),
            # prompt + response (verl's global_token_num), of the whole batch
            "n_total_tokens": int(adv_src.get("total_tokens", batch["attention_mask"].sum())),
            "timing_s/gen": float(max(batch.get("gen_time_s", [0.0]))),
            "timing_s/old_log_prob": t_old, "timing_s/update_actor": t_update,   # (this rank's, as verl)
            "timing_s/update_weights": float(max(batch.get("sync_time_s", [0.0]))),   # (the version it used)
            "rollout/replicas": len(batch.get("replicas", [])),
            "perf/fwd_rows": counts.get("fwd_rows", 0), "perf/bwd_rows": counts.get("bwd_rows", 0),
            "perf/optim_steps": counts.get("optim_steps", 0), "perf/gen_tokens": counts.get("gen_tokens", 0),
        })
        return metrics

    def export_tensors(self, data_type: str) -> Any:
        return self.worker.export_tensors()

    def _freeze(self, version: int) -> None:
        """A copy of this version's full weights (every rank takes part in the gathers; rank 0 keeps
        it); the versions two behind are dropped (at most one transfer is in flight)."""
        keep = _context().rank == 0
        frozen = [(n, t.detach().to("cpu", copy=True)) for n, t in self.worker.export_tensors() if keep]
        if keep:
            self._snapshots[version] = frozen
        for old in [v for v in self._snapshots if v < version - 1]:
            del self._snapshots[old]

    def export_snapshot(self, data_type: str, version: int) -> Any:
        return iter(self._snapshots.get(version, []))

    def get_version(self) -> int:
        return self.worker.version

    def weights_digest(self) -> str | None:
        return self.worker.weights_digest()

    def save_checkpoint(self, path: str) -> None:
        self.worker.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.worker.load_checkpoint(path)

    def check_world_size(self, world: int) -> str | None:
        return _check_world(self.cfg, world)


def _check_world(cfg: dict, world: int) -> str | None:
    """Why ``world`` data-parallel ranks cannot take this config's batches (None: they can)."""
    problems = check_batch_arithmetic(cfg, world)
    return problems[0] if problems else None
