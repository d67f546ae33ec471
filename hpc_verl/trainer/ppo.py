"""The PPO loop. Roles run behind a backend: the dataflow graph on Ray (``trainer.graph``),
or in this process for unit tests of the loop's own logic.

One step: sample a batch of prompts (x rollout.n) → rollout (with the current
policy version) → reward, reference log-probs, critic values and old log-probs
(concurrently) → KL penalty and advantages (GAE or GRPO) on the driver → critic and
actor updates (concurrently) → weight sync actor → rollout (next version) →
metrics, checkpoint, preemption check.
"""
from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Protocol

from hpc_verl.errors import ConfigError
from hpc_verl.trainer import algorithms as A
from hpc_verl.trainer.checkpoint import (REQUEUE_EXIT_CODE, PreemptionFlag, latest_checkpoint, load_checkpoint,
                                         save_checkpoint)
from hpc_verl.trainer.config import Section, to_yaml, validate_for_run
from hpc_verl.trainer.metrics import MetricsLog, StepProgress, summary_table

log = logging.getLogger("hpc_verl.trainer")


class RoleBackend(Protocol):
    """Where the roles run. ``submit`` returns a handle; ``wait`` turns handles into results."""

    roles: tuple[str, ...]

    def start(self, cfg: Section, roles: tuple[str, ...], total_steps: int) -> None: ...

    def submit(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def wait(self, handles: list[Any]) -> list[Any]: ...

    def sync_weights(self, version: int) -> None: ...

    def shutdown(self) -> None: ...


class InProcessBackend:
    """All roles as plain objects in this process (unit tests of the loop; no Ray)."""

    def __init__(self) -> None:
        self.workers: dict[str, Any] = {}
        self.roles: tuple[str, ...] = ()

    def start(self, cfg: Section, roles: tuple[str, ...], total_steps: int) -> None:
        from hpc_verl.trainer import workers as W
        self.roles = roles
        plain = cfg.to_dict()
        makers = {"rollout": lambda: W.make_rollout_worker(plain),
                  "actor": lambda: W.ActorWorker(plain, total_steps),
                  "ref": lambda: W.RefWorker(plain),
                  "critic": lambda: W.CriticWorker(plain, total_steps),
                  "reward": lambda: W.RewardWorker(plain)}
        for r in roles:
            self.workers[r] = makers[r]()

    def submit(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.workers[role], method)(*args, **kwargs)

    def wait(self, handles: list[Any]) -> list[Any]:
        return list(handles)

    def sync_weights(self, version: int) -> None:
        weights, actor_version = self.workers["actor"].get_weights()
        assert actor_version == version, (actor_version, version)
        self.workers["rollout"].load_weights(weights, version)

    def shutdown(self) -> None:
        self.workers.clear()


def roles_for(cfg: Section) -> tuple[str, ...]:
    roles = ["rollout", "actor", "reward"]
    if cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss:
        roles.append("ref")
    if cfg.critic.enable:
        roles.append("critic")
    return tuple(roles)


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass


class PPOTrainer:
    """Drives the PPO steps; owns data position, KL controller, metrics and checkpoints."""

    def __init__(self, cfg: Section, backend: RoleBackend | None = None, progress: bool | None = None) -> None:
        import torch
        from transformers import AutoTokenizer

        from hpc_verl.data.dataset import ResumableSampler, RLDataset

        _quiet_transformers()
        validate_for_run(cfg)
        self.cfg = cfg
        self.run_dir = Path(os.path.expanduser(cfg.hpc_verl.run_dir))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        mcfg = cfg.actor_rollout_ref.model
        from hpc_verl.trainer.model import check_model
        check_model(mcfg.path)
        self.tokenizer = AutoTokenizer.from_pretrained(mcfg.tokenizer_path or mcfg.path, local_files_only=True)
        if cfg.actor_rollout_ref.model.custom_chat_template:
            self.tokenizer.chat_template = cfg.actor_rollout_ref.model.custom_chat_template
        d = cfg.data
        self.dataset = RLDataset(d.train_files, self.tokenizer, d.max_prompt_length, d.prompt_key,
                                 d.filter_overlong_prompts, d.truncation, d.train_max_samples)
        self.sampler = ResumableSampler(len(self.dataset), d.train_batch_size, d.seed, d.shuffle)
        t = cfg.trainer
        self.total_steps = t.total_training_steps or t.total_epochs * self.sampler.batches_per_epoch
        self.n = cfg.actor_rollout_ref.rollout.n
        self.kl_ctrl = A.make_kl_controller(cfg.algorithm.kl_ctrl)
        self.step = 0
        self.version = 0
        random.seed(t.seed)
        torch.manual_seed(t.seed)
        self.roles = roles_for(cfg)
        self.backend = backend
        self.progress_enabled = cfg.hpc_verl.progress if progress is None else progress
        self.preempt = PreemptionFlag()
        self.last_checkpoint: Path | None = None
        self.resumed_from: Path | None = None

    # ------------------------------------------------------------------ set-up / resume
    def _resume_path(self) -> Path | None:
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return None
        if t.resume_mode == "resume_path":
            p = Path(os.path.expanduser(t.resume_from_path))
            if not (p / "trainer_state.json").is_file():
                raise ConfigError(f"trainer.resume_from_path={p} is not a checkpoint directory (global_step_N)")
            return p
        return latest_checkpoint(self.run_dir)

    def _restore(self, path: Path) -> None:
        import torch
        state, parts = load_checkpoint(path)
        self.step = int(state["step"])
        self.version = int(state["policy_version"])
        self.sampler.load_state_dict(state["data"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        random.setstate(_tuplify(state["python_rng"]))
        rng = parts.get("driver_rng")
        if rng is not None:
            torch.set_rng_state(rng["torch"])
        self.backend.wait([self.backend.submit("actor", "load_state_dict", parts["actor"])])
        if "critic" in self.roles and "critic" in parts:
            self.backend.wait([self.backend.submit("critic", "load_state_dict", parts["critic"])])
        if rng is not None and "rollout_gen" in rng:
            self.backend.wait([self.backend.submit("rollout", "set_rng_state", rng["rollout_gen"])])
        self.backend.sync_weights(self.version)
        self.resumed_from = path
        log.info("resumed from %s (step %d, policy version %d)", path, self.step, self.version)

    def save(self) -> Path:
        import torch
        handles = [self.backend.submit("actor", "state_dict"),
                   self.backend.submit("rollout", "rng_state")]
        if "critic" in self.roles:
            handles.append(self.backend.submit("critic", "state_dict"))
        results = self.backend.wait(handles)
        parts: dict[str, Any] = {"actor": results[0],
                                 "driver_rng": {"torch": torch.get_rng_state(), "rollout_gen": results[1]}}
        if "critic" in self.roles:
            parts["critic"] = results[2]
        state = {"step": self.step, "policy_version": self.version, "data": self.sampler.state_dict(),
                 "kl_ctrl": self.kl_ctrl.state_dict(), "python_rng": random.getstate(),
                 "total_steps": self.total_steps}
        keep = self.cfg.trainer.max_actor_ckpt_to_keep
        self.last_checkpoint = save_checkpoint(self.run_dir, self.step, parts, state, keep_last=keep)
        return self.last_checkpoint

    # ------------------------------------------------------------------ one step
    def _make_batch(self) -> dict:
        idx = self.sampler.next_batch()
        samples = [self.dataset.samples[i] for i in idx for _ in range(self.n)]
        return {"prompt_ids": [s.prompt_ids for s in samples], "data_source": [s.data_source for s in samples],
                "ground_truth": [s.ground_truth for s in samples], "extra_info": [s.extra_info for s in samples],
                "uid": [f"{self.sampler.epoch}:{s.index}" for s in samples], "sample_index": idx}

    def train_step(self) -> dict:
        import torch
        cfg, be = self.cfg, self.backend
        t0 = time.perf_counter()
        batch = self._make_batch()
        gen = be.wait([be.submit("rollout", "generate", batch, required_version=self.version)])[0]
        t_gen = time.perf_counter() - t0
        if gen["policy_version"] != self.version:
            raise RuntimeError(f"rollout used policy version {gen['policy_version']}, expected {self.version}")
        batch.update(gen)
        jobs = {"reward": be.submit("reward", "score", batch), "actor": be.submit("actor", "compute_log_prob", batch)}
        if "ref" in self.roles:
            jobs["ref"] = be.submit("ref", "compute_ref_log_prob", batch)
        if "critic" in self.roles:
            jobs["critic"] = be.submit("critic", "compute_values", batch)
        for out in be.wait(list(jobs.values())):
            batch.update(out)
        t_fwd = time.perf_counter() - t0 - t_gen
        mask = batch["response_mask"]
        scores = batch["scores"]
        token_scores = A.scores_to_token_rewards(scores, mask)
        metrics: dict[str, Any] = {}
        if cfg.algorithm.use_kl_in_reward:
            token_rewards, cur_kl = A.apply_kl_penalty(token_scores, batch["old_log_prob"], batch["ref_log_prob"],
                                                       mask, self.kl_ctrl, cfg.algorithm.kl_penalty)
            metrics["kl/mean"] = cur_kl
        else:
            token_rewards = token_scores
            if "ref_log_prob" in batch:
                metrics["kl/mean"] = float(A.masked_mean(
                    A.kl_penalty(batch["old_log_prob"], batch["ref_log_prob"], "kl"), mask, dim=-1).mean())
        metrics["kl/coef"] = self.kl_ctrl.value
        if cfg.algorithm.adv_estimator == "gae":
            adv, returns = A.compute_gae(token_rewards, batch["values"], mask, cfg.algorithm.gamma, cfg.algorithm.lam)
            batch["returns"] = returns
        else:
            seq_reward = (token_rewards * mask).sum(-1)
            adv = A.compute_grpo_advantages(seq_reward, batch["uid"], mask, cfg.algorithm.norm_adv_by_std_in_grpo)
        batch["advantages"] = adv
        updates = {}
        if "critic" in self.roles:
            updates["critic"] = be.submit("critic", "update_critic", batch)
        if self.step >= cfg.trainer.critic_warmup:
            updates["actor"] = be.submit("actor", "update_policy", batch)
        for out in be.wait(list(updates.values())):
            metrics.update(out)
        if "actor" in updates:
            self.version += 1
            be.sync_weights(self.version)
        self.step += 1
        dt = time.perf_counter() - t0
        n_tokens = int(mask.sum())
        rows = mask.shape[0]
        metrics.update({
            "step": self.step, "epoch": self.sampler.epoch, "policy_version": self.version,
            "reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min()),
            "response_length/mean": float(mask.sum(-1).mean()), "advantages/mean": float(A.masked_mean(adv, mask)),
            "timing_s/step": dt, "timing_s/gen": t_gen, "timing_s/forward": t_fwd,
            "perf/samples_per_s": rows / dt, "perf/tokens_per_s": n_tokens / dt,
            "perf/gen_tokens_per_s": n_tokens / max(t_gen, 1e-9),
        })
        if "values" in batch:
            metrics["critic/values/mean"] = float(A.masked_mean(batch["values"], mask))
        return metrics

    # ------------------------------------------------------------------ the run
    def fit(self) -> int:
        """Train to ``total_steps``; returns 0, or REQUEUE_EXIT_CODE after a preemption checkpoint."""
        if self.backend is None:
            from hpc_verl.trainer.graph import DataflowBackend
            self.backend = DataflowBackend()
        from hpc_verl.util.fs import atomic_write_text
        atomic_write_text(self.run_dir / "config.yaml", to_yaml(self.cfg))
        self.preempt.install()
        progress = None
        metrics_log = None
        try:
            self.backend.start(self.cfg, self.roles, self.total_steps)
            resume = self._resume_path()
            if resume is not None:
                self._restore(resume)
            metrics_log = MetricsLog(self.run_dir, resume_step=self.step)
            progress = StepProgress(self.total_steps, self.step, self.progress_enabled)
            save_freq = self.cfg.trainer.save_freq
            rows: list[dict] = []
            while self.step < self.total_steps:
                m = self.train_step()
                metrics_log.write(m)
                rows.append(m)
                progress.update(self.step, m)
                if save_freq and save_freq > 0 and self.step % save_freq == 0:
                    self.save()
                if self.preempt.requested:
                    if not (self.last_checkpoint and self.last_checkpoint.name == f"global_step_{self.step}"):
                        self.save()
                    progress.close()
                    log.warning("preemption signal: checkpointed step %d, exiting %d", self.step,
                                REQUEUE_EXIT_CODE)
                    return REQUEUE_EXIT_CODE
            if not (self.last_checkpoint and self.last_checkpoint.name == f"global_step_{self.step}"):
                self.save()
            progress.close()
            progress = None
            if self.progress_enabled:
                summary_table(rows, self.run_dir)
            self.history = rows
            return 0
        finally:
            if progress:
                progress.close()
            if metrics_log:
                metrics_log.close()
            self.preempt.uninstall()
            self.backend.shutdown()


def _tuplify(obj: Any) -> Any:
    if isinstance(obj, list):
        return tuple(_tuplify(x) for x in obj)
    return obj
