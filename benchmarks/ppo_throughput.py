"""Throughput of our GRPO trainer (full dataflow on Ray) against TRL's GRPOTrainer, same run, same settings.

Both train the same tiny random model on the synthetic digit task with the same
prompts per step, group size, response length, learning rate, mini-batch split
and no reference model, on CPU. Start-up is excluded for both; the first
``--warmup`` generation rounds are not timed. Prints samples/s (completions) and
tokens/s (completion tokens) for each and the ratio ours / TRL.

    PYTHONPATH=. python benchmarks/ppo_throughput.py [--rounds 8] [--response-length 8]

TRL is a benchmark-only dependency (the ``bench`` extra: pip install trl).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_assets(tmp: Path, hidden: int, n_prompts: int) -> tuple[Path, Path]:
    from hpc_verl.data.preprocess import preprocess_digits
    from hpc_verl.trainer.model import make_tiny_model
    model = make_tiny_model(tmp / "model", hidden_size=hidden, num_layers=2, num_heads=4)
    preprocess_digits(tmp / "data", n_train=n_prompts, n_test=8, seed=0)
    return model, tmp / "data"


def run_ours(model: Path, data: Path, tmp: Path, a: argparse.Namespace) -> dict:
    from hpc_verl.trainer.config import load_config
    from hpc_verl.trainer.ppo import PPOTrainer
    rounds = a.warmup + a.rounds
    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data / 'train.parquet'}",
        "data.max_prompt_length=16", f"data.max_response_length={a.response_length}",
        f"data.train_batch_size={a.prompts}", f"actor_rollout_ref.rollout.n={a.group}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={a.prompts // a.updates_per_round}",
        "actor_rollout_ref.actor.optim.lr=1e-4", "algorithm.adv_estimator=grpo", "trainer.device=cpu",
        f"trainer.total_training_steps={rounds}", f"hpc_verl.run_dir={tmp / 'ours'}", "hpc_verl.progress=false",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", f"hpc_verl.torch_threads={a.threads}"])
    trainer = PPOTrainer(cfg, progress=False)
    t0 = time.perf_counter()
    rc = trainer.fit()
    total = time.perf_counter() - t0
    assert rc == 0
    timed = trainer.history[a.warmup:]
    secs = sum(m["timing_s/step"] for m in timed)
    return {"samples_per_s": sum(m["n_responses"] for m in timed) / secs,
            "tokens_per_s": sum(m["n_response_tokens"] for m in timed) / secs,
            "round_s_median": statistics.median(m["timing_s/step"] for m in timed),
            "wall_incl_startup_s": total,
            "reward_last": timed[-1]["reward/mean"]}


def run_trl(model: Path, data: Path, tmp: Path, a: argparse.Namespace) -> dict:
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpc_verl.trainer.rewards import digits_score

    rows = pq.read_table(data / "train.parquet").to_pylist()
    ds = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows])

    def reward(completions, ground_truth, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [digits_score("hpc_verl/digits", t, g) for t, g in zip(texts, ground_truth)]

    import torch
    # the same torch threads per process as our Ray workers (--threads; Ray's default is 1)
    torch.set_num_threads(a.threads)
    per_step = a.prompts * a.group // a.updates_per_round  # completions per optimizer step
    rounds = a.warmup + a.rounds
    stamps: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    cfg = GRPOConfig(
        output_dir=str(tmp / "trl"), per_device_train_batch_size=per_step,
        steps_per_generation=a.updates_per_round, num_generations=a.group,
        max_completion_length=a.response_length, learning_rate=1e-4, beta=0.0, num_iterations=1,
        temperature=1.0, use_cpu=True, bf16=False, logging_steps=1, report_to=[], save_strategy="no",
        max_steps=rounds * a.updates_per_round, dataloader_num_workers=0, disable_tqdm=True, seed=0)
    tok = AutoTokenizer.from_pretrained(model)
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    # one round = steps_per_generation optimizer steps (the first generates)
    ends = stamps[a.updates_per_round - 1::a.updates_per_round]
    timed = [e - s for s, e in zip(ends[a.warmup - 1:], ends[a.warmup:])] if a.warmup else []
    secs = sum(timed)
    n_rounds = len(timed)
    mean_len = statistics.mean(lengths[-n_rounds * a.updates_per_round:]) if lengths else a.response_length
    completions = n_rounds * a.prompts * a.group
    return {"samples_per_s": completions / secs, "tokens_per_s": completions * mean_len / secs,
            "round_s_median": statistics.median(timed), "wall_incl_startup_s": total}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8, help="timed generation rounds (steps of 'ours')")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16, help="prompts per round")
    p.add_argument("--group", type=int, default=16, help="completions per prompt (GRPO group size)")
    p.add_argument("--response-length", type=int, default=8)
    p.add_argument("--updates-per-round", type=int, default=4, help="optimizer steps per round (mini-batches)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process, both trainers")
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", choices=("ours", "trl"))
    a = p.parse_args()
    if a.warmup < 1:
        p.error("--warmup must be >= 1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from hpc_verl.trainer.model import _quiet_transformers
    _quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="hpc_verl_bench_") as d:
        tmp = Path(d)
        model, data = make_assets(tmp, a.hidden, max(256, a.prompts * (a.warmup + a.rounds)))
        res: dict = {"settings": {k: v for k, v in vars(a).items() if k not in ("json", "only")}}
        if a.only != "trl":
            res["ours"] = run_ours(model, data, tmp, a)
        if a.only != "ours":
            try:
                import trl  # noqa: F401
            except ImportError:
                print("ppo_throughput: TRL is not installed; pip install trl (the 'bench' extra)", file=sys.stderr)
                return 2
            res["trl"] = run_trl(model, data, tmp, a)
        if "ours" in res and "trl" in res:
            res["ratio_samples_per_s"] = res["ours"]["samples_per_s"] / res["trl"]["samples_per_s"]
            res["ratio_tokens_per_s"] = res["ours"]["tokens_per_s"] / res["trl"]["tokens_per_s"]
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for name in ("ours", "trl"):
            if name in res:
                r = res[name]
                print(f"{name:>5}: {r['samples_per_s']:8.1f} samples/s  {r['tokens_per_s']:9.1f} tokens/s  "
                      f"(median round {r['round_s_median']:.3f}s, wall incl. start-up {r['wall_incl_startup_s']:.0f}s)")
        if "ratio_samples_per_s" in res:
            print(f"ratio ours/TRL: samples/s {res['ratio_samples_per_s']:.2f}x, "
                  f"tokens/s {res['ratio_tokens_per_s']:.2f}x (target >= 1.0, aim 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
