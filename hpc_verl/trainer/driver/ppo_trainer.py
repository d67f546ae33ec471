"""The PPO driver: data, steps through the dataflow graph (``driver.ppo_graph``), metrics, checkpoints.

One step is one item through the graph (see ``trainer.nodes``): rollout with the
current policy version → reward, reference log-probs (concurrently) → advantages
(critic/GAE or GRPO) → actor update, which publishes the next policy version to
the rollout over a strongly consistent control edge. The driver only samples
prompts, checks the version the rollout used, logs metrics, checkpoints and
watches for the preemption signal.
"""
from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol

from hpc_verl.errors import REQUEUE_EXIT_CODE, CheckpointError, ConfigError, HpcVerlError
from hpc_verl.trainer.driver.checkpoint import (CHECKPOINT_FORMAT, clean_leftovers, latest_checkpoint, load_checkpoint,
                                                save_checkpoint, verify_checkpoint)
from hpc_verl.trainer.driver.early_stop import StopDecision, StopRule, StopWhen
from hpc_verl.trainer.driver.preemption import PreemptionFlag
from hpc_verl.trainer.config.topology import topology
from hpc_verl.trainer.config.environment import check_loggers
from hpc_verl.trainer.config.schema import Section, to_yaml, validate_for_run
from hpc_verl.trainer.driver.ppo_graph import adv_node_name
from hpc_verl.trainer.observe.metrics import MetricsLog, StepProgress, read_metrics, summary_table
from hpc_verl.trainer.roles.nodes import ACTOR_NODE, ADVANTAGE_NODE, CRITIC_NODE, ROLLOUT_NODE
from hpc_verl.data.dataset import ResumableSampler, RLDataset
from hpc_verl.trainer.models.check import check_model_files, load_driver_tokenizer
from hpc_verl.data.prompt_tokenizer import PromptTokenizer, probe_samples
from hpc_verl.util.fs import atomic_write_text
from hpc_verl.trainer.driver.ray_runner import DataflowRunner
from hpc_verl.trainer.observe.trackers import Tracking

log = logging.getLogger("hpc_verl.trainer")


class StepError(HpcVerlError):
    """A step broke an invariant of the run (a policy version out of order)."""


class Runner(Protocol):
    """Where the graph runs (``ray_runner.DataflowRunner`` on Ray; ``inline_runner.InlineRunner`` in tests)."""

    def start(self, cfg: Mapping, total_steps: int) -> None: ...

    def run_step(self, batch: dict) -> dict: ...

    def stream(self, produce: Any, depth: int) -> Iterator[dict]: ...

    def call(self, node: str, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def call_all(self, node: str, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...

    def publish_policy(self, version: int) -> None: ...

    def shutdown(self) -> None: ...


class PPOTrainer:
    """Drives the PPO steps; owns the data position, metrics, checkpoints and the preemption check."""

    def __init__(self, cfg: Section, runner: Runner | None = None, progress: bool | None = None) -> None:
        # no torch here: the driver only tokenises the data set (its ranks import torch, and at
        # start-up they, Ray's daemons and this process share the node's cores)
        validate_for_run(cfg)
        self.cfg = cfg
        self.run_dir = Path(os.path.expanduser(cfg.hpc_verl.run_dir))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        mcfg = cfg.actor_rollout_ref.model
        check_model_files(mcfg.path)
        self.tokenizer = load_driver_tokenizer(mcfg.tokenizer_path or mcfg.path, mcfg.custom_chat_template,
                                               fast=bool(cfg.hpc_verl.fast_prompt_tokenizer),
                                               trust_remote_code=bool(mcfg.trust_remote_code))
        d = cfg.data
        self.dataset = RLDataset(d.train_files, self.tokenizer, d.max_prompt_length, d.prompt_key,
                                 d.filter_overlong_prompts, d.truncation, d.train_max_samples,
                                 require_ground_truth=not cfg.reward_model.enable)
        self.sampler = ResumableSampler(len(self.dataset), d.train_batch_size, d.seed, d.shuffle)
        t = cfg.trainer
        self.total_steps = t.total_training_steps or t.total_epochs * self.sampler.batches_per_epoch
        self.n = cfg.actor_rollout_ref.rollout.n
        self.overlap = bool(cfg.hpc_verl.one_step_off_policy)
        # every device of the job (verl's perf/throughput divides by them): CPU ranks on trainer.device=cpu
        self.n_devices = max(1, cfg.trainer.nnodes * max(1, cfg.trainer.n_gpus_per_node))
        self.step = 0
        self.version = 0
        random.seed(t.seed)   # (the driver draws from Python's RNG only; the ranks seed torch themselves)
        self.runner = runner
        self.adv_node = adv_node_name(cfg)
        self.loggers = check_loggers(cfg.trainer.logger)   # an unknown or missing logger: before any training
        self.progress_enabled = (cfg.hpc_verl.progress if progress is None else progress) and "console" in self.loggers
        self.preempt = PreemptionFlag()
        self.last_checkpoint: Path | None = None
        self.resumed_from: Path | None = None
        self.history: list[dict] = []
        self.start_step = 0
        when = StopWhen.from_config(t.stop_when)
        self.stop_rule = StopRule(when) if when else None   # trainer.stop_when
        self.stopped: StopDecision | None = None
        self._in_flight: list[tuple[dict, float]] = []   # one-step-off-policy: steps submitted, not finished

    @property
    def scheduler(self) -> Any:
        """The HybridScheduler running the graph (``adjust_parallelism``, ``get_status``, ...), once started."""
        return getattr(self.runner, "sched", None)

    # ------------------------------------------------------------------ resume / save
    def _resume_path(self) -> Path | None:
        """The checkpoint to continue from, verified against its manifest. ``auto``: the newest
        intact one (a damaged newer one is named in a warning and skipped); ``resume_path``: that
        one or a one-line error. Partial directories of interrupted saves are removed first."""
        t = self.cfg.trainer
        clean_leftovers(self.run_dir, warn=log.warning)
        if t.resume_mode == "disable":
            return None
        if t.resume_mode == "resume_path":
            p = Path(os.path.expanduser(t.resume_from_path))
            if not (p / "trainer_state.json").is_file():
                raise ConfigError(f"trainer.resume_from_path={p} is not a checkpoint directory (global_step_N)")
            verify_checkpoint(p)
            return p
        return latest_checkpoint(self.run_dir, verify=True, warn=log.warning)

    def _restore(self, path: Path) -> None:
        """Load a checkpoint ``_resume_path`` chose (and verified) into the driver and every rank."""
        state, parts = load_checkpoint(path, verify=False)
        self.step = int(state["step"])
        self.version = int(state["policy_version"])
        self.sampler.load_state_dict(state["data"])
        random.setstate(_tuplify(state["python_rng"]))
        # (older checkpoints also hold the driver's torch RNG state, which the driver never drew from)
        for node, sub in self._sharded_parts().items():   # every rank loads its shards (any world size)
            if not (path / sub).is_dir():
                raise CheckpointError(f"checkpoint {path}: {sub}/ is missing; not a complete checkpoint of this "
                                      f"run (pick another global_step_N or set trainer.resume_mode=disable)")
            self.runner.call(node, "load_checkpoint", str(path / sub))
        if "adv" in parts:
            self.runner.call(self.adv_node, "load_state_dict", parts["adv"])
        version = self.runner.call(ACTOR_NODE, "get_version")
        if version != self.version:
            raise CheckpointError(f"checkpoint {path}: the actor's state is policy version {version} but the "
                                  f"trainer state says {self.version}; the checkpoint is inconsistent")
        if self.version > 0:
            self.runner.publish_policy(self.version)
        self.resumed_from = path
        log.info("resumed from %s (step %d, policy version %d)", path, self.step, self.version)

    def _check_prompt_tokenizer(self) -> None:
        """The driver's torch-free tokenizer against the rollout's transformers one, on the first prompts."""
        if isinstance(self.tokenizer, PromptTokenizer):
            samples = probe_samples(self.tokenizer, [s.raw_prompt for s in self.dataset.samples])
            self.runner.call(ROLLOUT_NODE, "check_prompt_ids", samples,
                             self.cfg.actor_rollout_ref.model.custom_chat_template)

    def _sharded_parts(self) -> dict[str, str]:
        """Nodes that save themselves (every rank of their group writes its shards) -> sub-directory."""
        parts = {ACTOR_NODE: "actor"}
        if self.adv_node == CRITIC_NODE:
            parts[CRITIC_NODE] = "critic"
        return parts

    def save(self) -> Path:
        parts: dict[str, Any] = {}
        if self.adv_node == ADVANTAGE_NODE:
            parts["adv"] = self.runner.call(ADVANTAGE_NODE, "state_dict")
        writers = {sub: (lambda d, node=node: self.runner.call(node, "save_checkpoint", str(d)))
                   for node, sub in self._sharded_parts().items()}
        digests = self.runner.call_all(ACTOR_NODE, "weights_digest")
        if len({d for d in digests if d is not None}) > 1:
            raise HpcVerlError(f"step {self.step}: the actor's data-parallel ranks hold different weights "
                               f"(digests {', '.join(d[:12] for d in digests)}); the replicas drifted, refusing to "
                               f"checkpoint them")
        state = {"step": self.step, "policy_version": self.version, "data": self.sampler.state_dict(),
                 "python_rng": random.getstate(), "total_steps": self.total_steps,
                 "adv_estimator": self.cfg.algorithm.adv_estimator, "format": CHECKPOINT_FORMAT,
                 "world_sizes": {g.name: g.world_size for g in topology(self.cfg).groups.values()},
                 "actor_weight_digests": digests}
        keep = self.cfg.trainer.max_actor_ckpt_to_keep
        self.last_checkpoint = save_checkpoint(self.run_dir, self.step, parts, state, keep_last=keep,
                                               writers=writers)
        return self.last_checkpoint

    # ------------------------------------------------------------------ one step
    def _make_batch(self, step: int) -> dict:
        """The prompts of ``step`` (drawn in step order, so the data position is the step's)."""
        idx = self.sampler.next_batch()
        samples = [self.dataset.samples[i] for i in idx for _ in range(self.n)]
        return {"prompt_ids": [s.prompt_ids for s in samples], "data_source": [s.data_source for s in samples],
                "prompt_width": max(len(s.prompt_ids) for s in samples),
                "ground_truth": [s.ground_truth for s in samples], "extra_info": [s.extra_info for s in samples],
                "uid": [f"{self.sampler.epoch}:{s.index}" for s in samples], "sample_index": idx,
                "required_version": self.version, "step": step, "epoch": self.sampler.epoch}

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        batch = self._make_batch(self.step + 1)
        return self._finish(dict(self.runner.run_step(batch)), batch, t0)

    def _finish(self, m: dict, batch: dict, t0: float) -> dict:
        """A step's bookkeeping: the policy-version checks, the counters, the metrics."""
        used = m.get("rollout/policy_version")
        after = int(m.get("actor/policy_version", self.version))
        trained_at = after - 1 if "actor/pg_loss" in m else after   # (trainer.critic_warmup: no update)
        if used != batch["required_version"]:
            raise StepError(f"step {batch['step']}: rollout used policy version {used}, expected "
                            f"{batch['required_version']}")
        staleness = trained_at - int(used)
        if staleness > (1 if self.overlap else 0):
            raise StepError(f"step {batch['step']}: trained on samples of policy version {used} at version "
                               f"{trained_at} ({staleness} behind; the bound is {1 if self.overlap else 0})")
        self.version = int(m.get("actor/policy_version", self.version))
        self.step += 1
        dt = time.perf_counter() - t0
        tokens = m.get("n_response_tokens", 0)
        total = m.get("n_total_tokens", tokens)
        m.update({"step": self.step, "epoch": batch["epoch"], "training/global_step": self.step,
                  "training/epoch": batch["epoch"], "run/start_step": self.start_step,
                  "policy_version": self.version, "rollout/staleness": staleness,
                  "data/first_index": batch["sample_index"][0], "timing_s/step": dt,
                  "perf/time_per_step": dt, "perf/total_num_tokens": total,   # verl: prompt + response tokens
                  "perf/throughput": total / dt / self.n_devices,   # verl: those per second per device
                  "perf/samples_per_s": m.get("n_responses", 0) / dt, "perf/tokens_per_s": tokens / dt})
        m.update(self._dataflow_metrics())
        return m

    def _going(self) -> bool:
        """No reason to stop before the next step: steps left, no preemption, no stop_when decision."""
        return self.step < self.total_steps and not self.preempt.requested and self.stopped is None

    def _steps(self) -> Iterator[dict]:
        """The run's steps as they finish, until done, preempted or stopped (``trainer.stop_when``).
        One-step-off-policy mode (``hpc_verl.one_step_off_policy``) keeps two steps in flight: the
        rollout of step k+1 runs while step k trains, on weights one version behind. Nothing is in
        flight at a checkpoint step (the stream drains there); after a preemption request or a stop
        decision no new step starts and the one in flight finishes (its update is already under
        way), so nothing is left running when the run ends."""
        if not self.overlap:
            while self._going():
                yield self.train_step()
            return
        while self._going():
            end = self._segment_end()
            queue = self._in_flight = []

            def produce() -> dict | None:
                nxt = self.step + len(queue) + 1
                if self.preempt.requested or self.stopped is not None or nxt > end:
                    return None
                batch = self._make_batch(nxt)
                queue.append((batch, time.perf_counter()))
                return batch

            for out in self.runner.stream(produce, depth=2):
                batch, t0 = queue.pop(0)
                yield self._finish(dict(out), batch, t0)

    def _segment_end(self) -> int:
        """The next step that checkpoints (or the last)."""
        freq = self.cfg.trainer.save_freq
        if freq and freq > 0:
            return min(self.total_steps, (self.step // freq + 1) * freq)
        return self.total_steps

    def _dataflow_metrics(self) -> dict:
        """The runtime's own figures under dataflow/: edge latency p95, queue peaks, decisions."""
        sched = self.scheduler
        if sched is None:
            return {}
        status = sched.monitor.snapshot()
        out: dict = {"dataflow/decisions": len(status["decisions"])}
        for key, e in status["edges"].items():
            name = key.replace("->", "_to_")
            if e.get("latency_ms_p95") is not None:
                out[f"dataflow/{name}/latency_p95_ms"] = e["latency_ms_p95"]
            if not e["control"]:
                out[f"dataflow/{name}/peak_queue"] = e["peak_queue_length"]
            elif e.get("transfer"):
                out[f"dataflow/{name}/sync_s"] = e["transfer"]["seconds"]
        return out

    # ------------------------------------------------------------------ the run
    def fit(self) -> int:
        """Train to ``total_steps`` (or to a ``trainer.stop_when`` decision, which ends the run the same
        way); 0 when done, REQUEUE_EXIT_CODE after a preemption checkpoint."""
        if self.runner is None:
            self.runner = DataflowRunner()
        atomic_write_text(self.run_dir / "config.yaml", to_yaml(self.cfg))
        self.preempt.install()
        progress = None
        metrics_log = None
        tracking = None
        try:
            resume = self._resume_path()   # before Ray starts: a damaged run fails in a second, not a minute
            self.runner.start(self.cfg.to_dict(), self.total_steps)
            self._check_prompt_tokenizer()
            if resume is not None:
                self._restore(resume)
            self.start_step = self.step
            metrics_log = MetricsLog(self.run_dir, resume_step=self.step)
            tracking = Tracking(self.loggers, self.run_dir, self.cfg, resume_step=self.step,
                                progress_bar=self.progress_enabled)
            progress = StepProgress(self.total_steps, self.step, self.progress_enabled)
            save_freq = self.cfg.trainer.save_freq
            self._seed_stop_rule()
            for m in self._steps():
                metrics_log.write(m)
                tracking.log(m, self.step)
                self.history.append(m)
                progress.update(self.step, m)
                if save_freq and save_freq > 0 and self.step % save_freq == 0:
                    self.save()
                self._observe_stop(m)
            if self.preempt.requested and self.step < self.total_steps and self.stopped is None:
                if not self._saved_now():
                    self.save()
                log.warning("preemption signal: checkpointed step %d, exiting with %d (requeue)",
                            self.step, REQUEUE_EXIT_CODE)
                return REQUEUE_EXIT_CODE
            if not self._saved_now():
                self.save()
            progress.close()
            progress = None
            if self.progress_enabled:
                summary_table(self.history, self.run_dir)
            return 0
        finally:
            if progress:
                progress.close()
            if metrics_log:
                metrics_log.close()
            if tracking:
                tracking.close()
            self.preempt.uninstall()
            if self.runner is not None:
                self.runner.shutdown()

    def _seed_stop_rule(self) -> None:
        """A resumed run's stop window starts with the recorded steps before the checkpoint; a target
        they already meet ends the run before another step."""
        if self.stop_rule is None or not self.step:
            return
        by_step = {r["step"]: r for r in read_metrics(self.run_dir) if isinstance(r.get("step"), int)}
        self.stop_rule.seed(by_step[s] for s in sorted(by_step) if s <= self.step)
        self.stopped = self.stop_rule.check(self.step)
        if self.stopped is not None:
            log.info("%s (met before this resume: no further step)", self.stopped.line(self.total_steps))

    def _observe_stop(self, m: Mapping) -> None:
        """``trainer.stop_when`` on the step just recorded (a missing metric: one line, the run ends)."""
        if self.stop_rule is None or self.stopped is not None:
            return
        self.stopped = self.stop_rule.observe(self.step, m)
        if self.stopped is not None:
            busy = [b["step"] for b, _ in self._in_flight]
            log.info("%s%s", self.stopped.line(self.total_steps),
                     f" after step {busy[-1]} (already in flight)" if busy else "")

    def _saved_now(self) -> bool:
        return bool(self.last_checkpoint and self.last_checkpoint.name == f"global_step_{self.step}"
                    and self.last_checkpoint.exists())


def _tuplify(obj: Any) -> Any:
    if isinstance(obj, list):
        return tuple(_tuplify(x) for x in obj)
    return obj
