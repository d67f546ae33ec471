"""Time to the first finished step: ``hpc-verl submit --profile local`` and ``hpc-verl train`` against TRL.

Same model, data and settings as ``ppo_throughput.py`` (``--size``, prompts x
group, forced response length, optimizer steps per round); every side is a
fresh process pinned to the same CPUs, order alternating, ``--repeats`` times.
"First step" is one round: a generation batch and its ``--updates-per-round``
optimizer steps (ours: step 1 in metrics.jsonl; TRL: its U-th optimizer step).
Measured from the moment the benchmark starts the command:

  * ``submit``: ``hpc-verl submit --profile local --config JOB.yaml`` (the whole local
    pipeline: render, validate, preprocess (skipped: data present), model check,
    Ray up through the bootstrap, train) until the run's metrics.jsonl has step 1;
  * ``train``: ``hpc-verl train ...`` (the same entry point, run with timers wrapped
    around it from outside: trainer set-up, Ray start, actor creation with each
    actor's ``__init__`` (model load) from Ray's timeline, the first step);
  * ``trl``: TRL's GRPOTrainer: imports, trainer construction, first round.

The top-level ratio is submit over TRL (the user's command); train over TRL is a row.

    .venv/bin/python benchmarks/startup.py --json startup.json
"""
from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import benchlib as B  # noqa: E402
from benchmarks.rl_common import (add_workload_args, check_workload_args, child_env, make_assets,  # noqa: E402
                                  ours_command, ours_overrides, run_child, trl_command, workload_settings)
from hpc_verl.errors import report_errors  # noqa: E402

SIDES = {"submit": "hpc-verl submit --profile local (whole local pipeline)",
         "train": "hpc-verl train (the trainer, own local Ray)",
         "trl": "TRL GRPOTrainer"}


# ---------------------------------------------------------------- the timed trainer (child process)
def timed_train(argv: list[str], marks_file: str) -> int:
    """Run ``hpc_verl.trainer.main`` with timers wrapped around its phases (nothing in it is changed)."""
    marks: dict[str, Any] = {"python_started": time.time()}

    def wrap(owner: Any, name: str, key: str) -> None:
        orig = getattr(owner, name, None)
        if orig is None:
            marks.setdefault("missing", []).append(f"{getattr(owner, '__name__', owner)}.{name}")
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.time()
            try:
                return orig(*args, **kwargs)
            finally:
                marks.setdefault(key, []).append([t, time.time()])
        setattr(owner, name, timed)

    import ray

    from hpc_verl.dataflow import HybridScheduler
    from hpc_verl.trainer.driver import ray_runner
    from hpc_verl.trainer import main
    from hpc_verl.trainer.driver import ppo_trainer as ppo
    marks["imports_done"] = time.time()
    wrap(ppo.PPOTrainer, "__init__", "trainer_init")
    wrap(ray, "init", "ray_init")
    wrap(HybridScheduler, "start", "actors_start")
    wrap(ppo.PPOTrainer, "train_step", "step")
    runner = getattr(ray_runner, "DataflowRunner", None)
    shutdown = getattr(runner, "shutdown", None)
    if shutdown is not None:
        def with_timeline(self: Any) -> None:
            try:
                marks["actor_inits"] = [[e["ts"] / 1e6, e["dur"] / 1e6] for e in ray.timeline()
                                        if e.get("cat", "").endswith(".__init__")]
            except Exception as exc:  # noqa: BLE001 - a missing timeline only loses a detail
                marks["timeline_error"] = str(exc)[:200]
            shutdown(self)
        runner.shutdown = with_timeline
    try:
        return main.main(argv)
    finally:
        Path(marks_file).write_text(json.dumps(marks))


# ---------------------------------------------------------------- the sides
def first_step_path(root: Path) -> Path | None:
    hits = glob.glob(str(root / "**" / "metrics.jsonl"), recursive=True)
    for hit in hits:
        if Path(hit).stat().st_size > 0:
            return Path(hit)
    return None


def run_submit(a: argparse.Namespace, model: Path, data: Path, work: Path) -> dict[str, Any]:
    """``hpc-verl submit --profile local``: stdout lines time-stamped as they come; step 1 by polling."""
    import yaml

    overrides = {k: str(v) for k, v in ours_overrides(workload_settings(a), model, data, Path("unused"), 1).items()}
    for key in ("actor_rollout_ref.model.path", "data.train_files", "hpc_verl.run_dir", "trainer.nnodes",
                "trainer.n_gpus_per_node"):
        overrides.pop(key)  # the launcher derives them from the job's model/data, its run dir and the allocation
    job = {"name": "startup-bench", "trainer": {"module": "hpc_verl.trainer.main", "overrides": overrides},
           "data": {"dir": str(data)}, "model": {"path": str(model)}}
    cfg = work / "job.yaml"
    cfg.write_text(yaml.safe_dump(job))
    env = child_env(a.threads)
    env["HPC_VERL_HOME"] = str(work / "home")
    lines: list[tuple[float, str]] = []
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "hpc_verl", "submit", "--profile", "local", "--config", str(cfg)],
                            cwd=str(work), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=B.pin_to(a.cpus))
    first = None
    assert proc.stdout is not None

    def read(out: Any) -> None:
        for line in out:
            lines.append((time.time() - t0, line.rstrip("\n")))
    reader = threading.Thread(target=read, args=(proc.stdout,), daemon=True)
    reader.start()
    while proc.poll() is None:
        if first is None and first_step_path(work) is not None:
            first = time.time() - t0
        if time.time() - t0 > a.timeout_s:
            proc.kill()
            raise B.BenchError(f"submit ran past {a.timeout_s:.0f}s")
        time.sleep(0.05)
    reader.join(timeout=10)
    (work / "submit.log").write_text("\n".join(f"{t:8.2f} {line}" for t, line in lines))
    if proc.returncode != 0 or first is None:
        raise B.BenchError(f"hpc-verl submit exited {proc.returncode} (first step seen: {first}); "
                           f"see {work / 'submit.log'}")

    def at(text: str) -> float | None:
        return next((t for t, line in lines if text in line), None)
    phases = {"at_first_stage_s": at("stage"), "at_model_check_s": at("stage model-check: start"),
              "at_ray_up_s": at("ray-up: head"), "at_ray_ready_s": at("Ray ready"),
              "at_train_stage_s": at("stage train: start")}
    return {"first_step_s": first, "phases": phases}


def run_train(a: argparse.Namespace, model: Path, data: Path, work: Path) -> dict[str, Any]:
    cmd = ours_command(workload_settings(a), model, data, work / "run", 1)
    marks_file = work / "marks.json"
    t0 = time.time()
    run_child([sys.executable, "-m", "benchmarks.startup", "--timed-train", str(marks_file), "--", *cmd[3:]],
              a.cpus, a.threads, work / "train.log", a.timeout_s)
    m = json.loads(marks_file.read_text())
    if not m.get("step"):
        raise B.BenchError(f"hpc-verl train finished no step; see {work / 'train.log'}")

    def span(key: str) -> float | None:
        return round(m[key][0][1] - m[key][0][0], 3) if m.get(key) else None
    inits = m.get("actor_inits") or []
    phases = {"python_and_imports_s": round(m["imports_done"] - t0, 3), "trainer_init_s": span("trainer_init"),
              "ray_start_s": span("ray_init"), "actors_start_s": span("actors_start"),
              "actor_init_max_s": round(max(d for _, d in inits), 3) if inits else None,
              "actor_init_sum_s": round(sum(d for _, d in inits), 3) if inits else None,
              "step1_s": span("step")}
    return {"first_step_s": m["step"][0][1] - t0, "phases": phases, "missing_timers": m.get("missing", [])}


def run_trl(a: argparse.Namespace, model: Path, data: Path, work: Path) -> dict[str, Any]:
    spec = {"settings": workload_settings(a), "steps": 1, "model": str(model), "data": str(data), "work": str(work)}
    spec_file, out_file = work / "trl.spec.json", work / "trl.out.json"
    spec_file.write_text(json.dumps(spec))
    t0 = time.time()
    run_child(trl_command(spec_file, out_file), a.cpus, a.threads, work / "trl.log", a.timeout_s)
    out = json.loads(out_file.read_text())
    if not out["round_ends"]:
        raise B.BenchError(f"TRL finished no round; see {work / 'trl.log'}")
    ph = out["phases"]
    return {"first_step_s": out["round_ends"][0] - t0, "versions": out["versions"],
            "phases": {"python_and_imports_s": round(out["t_start"] - t0 + ph["imports_s"], 3),
                       "trainer_init_s": round(ph["trainer_init_s"], 3),
                       "step1_s": round(ph["first_round_s"], 3)}}


RUNNERS = {"submit": run_submit, "train": run_train, "trl": run_trl}


# ---------------------------------------------------------------- orchestration
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--sides", default="submit,train,trl", help="(default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    B.add_common_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p, a = B.parse(build_parser(), argv)
    a.side_list = [s.strip() for s in a.sides.split(",") if s.strip()]
    bad = [s for s in a.side_list if s not in RUNNERS]
    if bad or "trl" not in a.side_list or len(a.side_list) < 2:
        p.error(f"--sides {a.sides!r}: give trl and at least one of submit, train (known: {', '.join(RUNNERS)})")
    check_workload_args(p, a)
    return a


def build_report(a: argparse.Namespace, runs: dict[str, list[dict]], env: dict) -> dict[str, Any]:
    rows = []
    trl = B.summary([r["first_step_s"] for r in runs["trl"]])["median"]
    for side, rs in runs.items():
        st = B.summary([r["first_step_s"] for r in rs])
        phases = {k: B.summary([r["phases"][k] for r in rs if r["phases"].get(k) is not None])["median"]
                  for k in rs[0]["phases"] if any(r["phases"].get(k) is not None for r in rs)}
        rows.append({"name": side, "kind": "baseline" if side == "trl" else ("ours" if side == "submit" else "extra"),
                     "label": SIDES[side], "first_step_s": round(st["median"], 3),
                     "spread_s": [round(st["min"], 3), round(st["max"], 3)],
                     "ratio_vs_baseline": None if side == "trl" else round(st["median"] / trl, 4),
                     "phases_median_s": {k: round(v, 3) for k, v in phases.items()}, "runs": rs})
    head = "submit" if "submit" in runs else "train"
    ratio = next(r["ratio_vs_baseline"] for r in rows if r["name"] == head)
    for r in rows:
        if r["name"] == head:
            r["kind"] = "ours"
    env["versions"].update(runs["trl"][0].get("versions", {}))
    return B.make_report("startup", ratio=ratio, baseline="trl", rows=rows, settings=workload_settings(a), env=env,
                         ratio_definition=f"{head}'s time to the first finished step over TRL's; lower is better",
                         equal_work_ok=True, notes=a.notes)


def show(con: Any, report: dict) -> None:
    keys = sorted({k for r in report["rows"] for k in r["phases_median_s"]})
    con.print(B.table("time to the first finished step (median over runs), and where it goes",
                      ["side", "first step s", "min", "max", "vs TRL"], [[r["name"], r["first_step_s"],
                                                                         *r["spread_s"], r["ratio_vs_baseline"]]
                                                                        for r in report["rows"]]))
    con.print(B.table("where the time goes (median s): at_* = when the submit log showed that stage; others = spans",
                      ["phase", *[r["name"] for r in report["rows"]]],
                      [[k, *[r["phases_median_s"].get(k) for r in report["rows"]]] for k in keys]))
    for note in report["notes"]:
        con.print(f"note: {note}")
    con.print(B.ratio_line(report))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--timed-train"]:  # the child of run_train
        return timed_train(argv[3:], argv[1])
    a = parse_args(argv)
    env = B.environment(("torch", "ray", "transformers", "trl"))
    con = B.console()
    runs: dict[str, list[dict]] = {s: [] for s in a.side_list}
    with tempfile.TemporaryDirectory(prefix="hpcv-startup-") as d:
        root = Path(d)
        model, data, params = make_assets(root / "assets", a.hidden, a.layers, a.heads, 256)
        con.print(f"model {a.size}: {params / 1e6:.1f}M parameters; CPUs {a.cpus}; load {env['loadavg_start']}")
        order = B.alternating(a.side_list, a.repeats)
        with B.progress(con) as prog:
            task = prog.add_task("runs", total=len(order))
            for i, (rep, side) in enumerate(order):
                prog.update(task, description=f"repeat {rep + 1}/{a.repeats}: {side}")
                work = root / f"{side}-{rep}"
                work.mkdir()
                before = B.loadavg()
                rec = RUNNERS[side](a, model, data, work)
                rec.update({"repeat": rep, "position": i, "loadavg_before": before, "loadavg_after": B.loadavg()})
                runs[side].append(rec)
                prog.console.print(f"repeat {rep + 1} {side}: first step after {rec['first_step_s']:.2f}s "
                                   f"(load {before[0]:.1f})")
                prog.advance(task)
    report = build_report(a, runs, B.finish(env))
    return B.publish(con, report, a.json, show)


if __name__ == "__main__":
    sys.exit(report_errors(main))
