"""One RL workload, two trainers: the model, data and settings both sides of ppo_throughput/startup share.

- ``make_assets``: a random Llama from ``make_tiny_model`` (sizes in ``SIZES``) and
  the synthetic digit task. ``never_stop`` then gives the tokenizer an EOS id
  outside the model's vocabulary, so no response can end early on either side:
  every response is exactly ``response_length`` tokens (our trainer has no
  min-new-tokens key; this forces the length on both sides the same way).
- ``ours_command``: our trainer's real path, ``python -m hpc_verl.trainer.main``
  (what ``hpc-verl train`` runs), through Ray, with the settings as overrides.
- ``trl_worker``: TRL's GRPOTrainer in this process on the same model and data,
  with the same settings, timed per optimizer step and counted with hooks
  (``counting.PassCounter``). Run it in a fresh process:
  ``python -m benchmarks.rl_common trl SPEC.json OUT.json``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from benchmarks.benchlib import REPO, BenchError, cpu_set, pin_to, thread_env
from benchmarks.counting import PassCounter, delta

# name -> (hidden, layers, heads); intermediate is 2 x hidden (make_tiny_model's default)
SIZES = {"tiny": (64, 2, 4), "small": (256, 4, 4), "default": (512, 8, 8)}
NEVER_EOS = "<|no-eos|>"


def param_count(hidden: int, layers: int, vocab: int) -> int:
    """Parameters of make_tiny_model's Llama (tied embeddings, MLP 2 x hidden)."""
    per_layer = 4 * hidden * hidden + 3 * hidden * 2 * hidden + 2 * hidden
    return vocab * hidden + layers * per_layer + hidden


def make_assets(root: Path, hidden: int, layers: int, heads: int, n_prompts: int) -> tuple[Path, Path, int]:
    """(model dir, data dir, parameters): the model every side loads and the digit task's parquet."""
    import transformers

    from hpc_verl.data.preprocess import preprocess_digits
    from hpc_verl.trainer.models.tiny import make_tiny_model

    transformers.utils.logging.disable_progress_bar()  # (its shard-writing bar, once per benchmark)
    model = make_tiny_model(root / "model", hidden_size=hidden, num_layers=layers, num_heads=heads)
    never_stop(model)
    preprocess_digits(root / "data", n_train=n_prompts, n_test=8, seed=0)
    cfg = json.loads((model / "config.json").read_text())
    return model, root / "data", param_count(hidden, layers, int(cfg["vocab_size"]))


def never_stop(model_dir: Path) -> int:
    """Point the tokenizer's and model's EOS at a new token the model cannot emit (id = vocab size)."""
    from transformers import AutoTokenizer

    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tok.add_special_tokens({"eos_token": NEVER_EOS})
    eos = tok.convert_tokens_to_ids(NEVER_EOS)
    if eos < int(cfg["vocab_size"]):
        raise BenchError(f"{model_dir}: the new EOS id {eos} is inside the model's vocabulary")
    tok.save_pretrained(model_dir)
    cfg["eos_token_id"] = eos
    cfg_path.write_text(json.dumps(cfg, indent=2))
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text())
        gen["eos_token_id"] = eos
        gen_path.write_text(json.dumps(gen, indent=2))
    return eos


def add_workload_args(p: Any) -> None:
    """The workload both sides run (ppo_throughput and startup share it)."""
    p.add_argument("--size", choices=sorted(SIZES), default="default",
                   help="model size: " + ", ".join(f"{k} = hidden {v[0]} x {v[1]} layers" for k, v in SIZES.items()))
    p.add_argument("--hidden", type=int, help="override the size's hidden width")
    p.add_argument("--layers", type=int, help="override the size's layer count")
    p.add_argument("--heads", type=int, help="override the size's attention heads")
    p.add_argument("--prompts", type=int, default=16, help="prompts per round (default: %(default)s)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (default: %(default)s)")
    p.add_argument("--response-length", type=int, default=32, help="tokens per response, forced (default: %(default)s)")
    p.add_argument("--updates-per-round", type=int, default=4, help="optimizer steps per round (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process, every side (default: %(default)s)")
    p.add_argument("--cores", type=int, default=None, help="CPUs every side is pinned to (default: all usable)")


def check_workload_args(p: Any, a: Any, also: Sequence[str] = ()) -> None:
    """One line and exit 2 for a workload the trainers cannot run; fills in the size and ``a.cpus``."""
    hidden, layers, heads = SIZES[a.size]
    a.hidden, a.layers, a.heads = a.hidden or hidden, a.layers or layers, a.heads or heads
    for name in ("prompts", "response_length", "updates_per_round", "threads", "hidden", "layers", "heads", *also):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.group < 2:
        p.error(f"--group must be >= 2 (GRPO normalises within a group), got {a.group}")
    if a.prompts % a.updates_per_round:
        p.error(f"--prompts {a.prompts} must be a multiple of --updates-per-round {a.updates_per_round} "
                "(each optimizer step takes whole prompt groups)")
    if a.hidden % a.heads:
        p.error(f"--hidden {a.hidden} must be a multiple of --heads {a.heads}")
    try:
        a.cpus = cpu_set(a.cores)
    except BenchError as exc:
        p.error(str(exc))


def workload_settings(a: Any, shortcut: bool = False, cpu_matmul: str = "onednn") -> dict[str, Any]:
    """What both sides are told to do (and what the report records); ``cpu_matmul`` is ours only
    (``hpc_verl.cpu_matmul``: TRL runs ``F.linear``, i.e. MKL on a CPU, which is ours' ``torch``)."""
    return {"size": a.size, "hidden": a.hidden, "layers": a.layers, "heads": a.heads, "prompts": a.prompts,
            "group": a.group, "response_length": a.response_length, "updates_per_round": a.updates_per_round,
            "threads": a.threads, "cores": len(a.cpus), "cpus": a.cpus, "repeats": a.repeats,
            "old_log_prob_from_rollout": shortcut, "ppo_epochs": 1, "cpu_matmul": cpu_matmul}


def per_step(s: Mapping[str, Any]) -> int:
    """Completions per optimizer step."""
    return int(s["prompts"]) * int(s["group"]) // int(s["updates_per_round"])


def workload_overrides(s: Mapping[str, Any], model: Path, data: Path, steps: int) -> dict[str, Any]:
    """The workload under verl's key names, which our trainer and verl's main_ppo both read
    (vs_verl gives verl this very dict, so the two sides cannot drift apart)."""
    mini = int(s["prompts"]) // int(s["updates_per_round"])
    return {
        "actor_rollout_ref.model.path": model, "data.train_files": data / "train.parquet",
        "data.max_prompt_length": 16, "data.max_response_length": s["response_length"],
        "data.train_batch_size": s["prompts"], "actor_rollout_ref.rollout.n": s["group"],
        "actor_rollout_ref.actor.ppo_mini_batch_size": mini,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": per_step(s),
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": per_step(s),
        "actor_rollout_ref.actor.ppo_epochs": 1, "actor_rollout_ref.actor.optim.lr": 1e-4,
        "actor_rollout_ref.actor.use_kl_loss": "false", "algorithm.use_kl_in_reward": "false",
        "actor_rollout_ref.model.enable_gradient_checkpointing": "false",
        "actor_rollout_ref.rollout.temperature": 1.0, "actor_rollout_ref.rollout.top_k": -1,
        "actor_rollout_ref.rollout.top_p": 1.0, "algorithm.adv_estimator": "grpo", "trainer.device": "cpu",
        "trainer.nnodes": 1, "trainer.n_gpus_per_node": 1,   # one CPU rank, one process: as TRL
        "trainer.total_training_steps": steps, "trainer.save_freq": -1, "trainer.resume_mode": "disable",
    }


def ours_overrides(s: Mapping[str, Any], model: Path, data: Path, run_dir: Path, steps: int) -> dict[str, Any]:
    """Our trainer's config overrides (key -> value) for the benchmark's settings."""
    return {
        **workload_overrides(s, model, data, steps),
        "trainer.seed": 0, "hpc_verl.run_dir": run_dir, "hpc_verl.progress": "false",
        "hpc_verl.torch_threads": s["threads"], "hpc_verl.ray_num_cpus": s["cores"],
        "hpc_verl.old_log_prob_from_rollout": "true" if s["old_log_prob_from_rollout"] else "false",
        "hpc_verl.cpu_matmul": s["cpu_matmul"],
    }


def ours_command(s: Mapping[str, Any], model: Path, data: Path, run_dir: Path, steps: int) -> list[str]:
    """Our trainer, as ``hpc-verl train`` runs it, with the benchmark's settings."""
    return [sys.executable, "-m", "hpc_verl.trainer.main", "--no-progress",
            *[f"{k}={v}" for k, v in ours_overrides(s, model, data, run_dir, steps).items()]]


def child_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env.update(thread_env(threads))
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"})
    return env


def run_child(cmd: Sequence[str], cpus: Sequence[int], threads: int, log: Path, timeout_s: float) -> float:
    """Run one side in a fresh process pinned to ``cpus``; its wall time. Failures name the log."""
    t0 = time.time()
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(list(cmd), env=child_env(threads), stdout=fh, stderr=subprocess.STDOUT,
                                  preexec_fn=pin_to(cpus), cwd=str(REPO), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{cmd[2] if len(cmd) > 2 else cmd[0]} ran past {timeout_s:.0f}s; see {log}") from None
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise BenchError(f"{' '.join(cmd[1:3])} exited {proc.returncode}; see {log}: {' | '.join(tail)[-400:]}")
    return time.time() - t0


def trl_command(spec: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.rl_common", "trl", str(spec), str(out)]


# ---------------------------------------------------------------- the TRL side (runs in its own process)
def trl_worker(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Train with TRL's GRPOTrainer on the same model/data/settings; per-round times and counts."""
    t_start = time.time()
    import torch
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer

    from hpc_verl.trainer.roles.reward_rules import digits_score

    transformers.logging.set_verbosity_error()
    s = spec["settings"]
    torch.set_num_threads(int(s["threads"]))
    u = int(s["updates_per_round"])
    rounds = int(spec["steps"])
    rows = pq.read_table(Path(spec["data"]) / "train.parquet").to_pylist()
    ds = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                            for r in rows])

    def reward(completions: list, ground_truth: list, **_: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [digits_score("hpc_verl/digits", t, g) for t, g in zip(texts, ground_truth)]

    counter = PassCounter()
    stamps: list[float] = []
    round_counts: list[dict[str, int]] = []
    lengths: list[float] = []
    marks = {"before": counter.snapshot()}
    first_step_file = spec.get("first_round_file")
    profile_round = spec.get("profile_round")   # ppo_profile: round profile_round + 1 under torch's profiler
    profiled: dict[str, Any] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            stamps.append(time.time())
            if len(stamps) % u == 0:
                now = counter.snapshot()
                round_counts.append(delta(now, marks["before"]))
                marks["before"] = now
                if first_step_file and len(stamps) == u:
                    Path(first_step_file).write_text(f"{stamps[-1]}\n")
                if profile_round is not None:
                    profile_rounds(len(stamps) // u)

    def profile_rounds(done: int) -> None:
        from benchmarks.ppo_profile import finish_side, summarise

        if done == profile_round:
            profiled["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                      record_shapes=True)
            profiled["prof"].start()
            profiled["t"] = time.perf_counter()
        elif done == profile_round + 1 and "prof" in profiled:
            wall = time.perf_counter() - profiled["t"]
            profiled["prof"].stop()
            profiled["summary"] = finish_side(summarise(profiled.pop("prof"), wall))

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    cfg = GRPOConfig(
        output_dir=str(Path(spec["work"]) / "trl"), per_device_train_batch_size=per_step(s),
        steps_per_generation=u, num_generations=int(s["group"]), max_completion_length=int(s["response_length"]),
        learning_rate=1e-4, weight_decay=0.01, max_grad_norm=1.0, beta=0.0, num_iterations=1, epsilon=0.2,
        temperature=1.0, top_p=1.0, top_k=0, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, mask_truncated_completions=False, logging_steps=1, report_to=[],
        save_strategy="no", max_steps=rounds * u, dataloader_num_workers=0, disable_tqdm=True, seed=0,
        model_init_kwargs={"dtype": "float32"}, log_level="error")
    tok = AutoTokenizer.from_pretrained(spec["model"], local_files_only=True)
    t_import = time.time()
    trainer = GRPOTrainer(model=str(spec["model"]), reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])
    t_built = time.time()
    counter.attach(trainer.model).attach_optimizers()
    marks["before"] = counter.snapshot()
    trainer.train()
    t_end = time.time()
    ends = stamps[u - 1::u]
    return {"round_s": [b - a for a, b in zip(ends, ends[1:])], "round_ends": ends, "counts": round_counts,
            "first_step_s": stamps[0] - t_start if stamps else None,
            "phases": {"imports_s": t_import - t_start, "trainer_init_s": t_built - t_import,
                       "first_round_s": (ends[0] - t_built) if ends else None, "train_s": t_end - t_built},
            "t_start": t_start, "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing",
                                                                      False)),
            "recomputed_layer_rows": counter.layer_rows - counter.totals["fwd_rows"],
            "mean_completion_length": statistics.mean(lengths) if lengths else None,
            "profile": profiled.get("summary"),
            "versions": {"trl": trl.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__}}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "trl":
        print("usage: python -m benchmarks.rl_common trl SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    out = trl_worker(spec)
    Path(argv[2]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
