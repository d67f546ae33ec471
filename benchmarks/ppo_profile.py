"""Where a GRPO round goes, ours and TRL's, at ppo_throughput's workload: matrix products against the rest.

Each side runs in a fresh process pinned like ppo_throughput's sides (same model,
settings and threads; ``--size`` etc. as there). After ``--warmup`` rounds one
round is timed as it is, then one more runs under torch's profiler:

  * ours: one step of our trainer in the process (``InlineRunner``: the roles and
    the graph of ``hpc-verl train`` without Ray; the runtime around them costs about
    0.04 s a step, ``timing_s/*`` in ppo_throughput's runs);
  * trl: one round of TRL's GRPOTrainer (its generation and its optimizer steps).

Every operator's own time goes into one bucket: ``gemm`` (the linear layers'
matrix products, forward and both gradients; their FLOPs are read from the
shapes), ``attention`` (its batched products and SDPA kernels), ``optimizer``,
``other ops`` (norms, activations, copies, sampling, ...); ``outside ops`` is the
round's wall time not spent in any operator (Python, the framework, the
profiler's own cost). Then every distinct GEMM of the round is timed again alone,
hot, in the same process: ``gemm floor`` is what the round's products cost at
that rate, the least any code doing the same products with the same kernels
could spend. The top-level ratio is ours' unprofiled round over its GEMM floor
(1.0 would be nothing but matrix products); TRL's unprofiled round over ours'
floor bounds what ours/TRL could reach with ours' products at this rate.

A diagnostic: the profiler slows operator calls, TRL's much more than ours (its
``aten::cat`` of tensor lists above all); its cost, the profiled round less the
unprofiled one, sits in ``other ops`` and ``outside ops``, so read those as upper
bounds. The GEMM figures are what this is for; the speed ratio is ppo_throughput's.

    .venv/bin/python benchmarks/ppo_profile.py --json profile.json
    .venv/bin/python benchmarks/ppo_profile.py --size tiny --sides ours --repeats 1
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import benchlib as B  # noqa: E402
from benchmarks.rl_common import (add_workload_args, check_workload_args, make_assets,  # noqa: E402
                                  ours_overrides, run_child, trl_command, workload_settings)
from hpc_verl.errors import report_errors  # noqa: E402

SIDES = {"ours": "ours (the trainer's roles in one process, InlineRunner)", "trl": "TRL GRPOTrainer"}
BUCKETS = ("gemm", "attention", "optimizer", "other ops", "outside ops")
GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")


# ---------------------------------------------------------------- what a profile says
def bucket(op: str) -> str:
    """The bucket of a profiler event name."""
    if op in GEMM_OPS:
        return "gemm"
    if op in ("aten::bmm", "aten::baddbmm") or "scaled_dot_product" in op:
        return "attention"
    if "adam" in op or op.startswith("aten::_foreach_") or op.startswith("Optimizer."):
        return "optimizer"
    return "other ops"


def gemm_flops(op: str, shapes: Sequence[Sequence[int]]) -> int:
    """Multiply-adds x 2 of one GEMM call from its input shapes (0 for anything else)."""
    if op == "mkldnn::_linear_pointwise" and len(shapes) >= 2 and len(shapes[1]) == 2 and shapes[0]:
        x, w = shapes[0], shapes[1]                   # x [..., K] @ W[N, K]^T
        return 2 * math.prod(x[:-1]) * int(x[-1]) * int(w[0])
    if op == "aten::mm" and len(shapes) >= 2 and len(shapes[0]) == 2 and len(shapes[1]) == 2:
        return 2 * math.prod(shapes[0]) * int(shapes[1][1])
    if op == "aten::addmm" and len(shapes) >= 3 and len(shapes[1]) == 2 and len(shapes[2]) == 2:
        return 2 * math.prod(shapes[1]) * int(shapes[2][1])
    return 0


def summarise(prof: Any, wall_s: float) -> dict[str, Any]:
    """Buckets (seconds), the GEMMs' FLOPs and their distinct shapes, from a finished profile."""
    buckets = {b: 0.0 for b in BUCKETS}
    gemms: list[dict[str, Any]] = []
    others: dict[str, list[float]] = {}
    for ev in prof.key_averages(group_by_input_shape=True):
        self_s = ev.self_cpu_time_total / 1e6
        b = bucket(ev.key)
        buckets[b] += self_s
        if b in ("attention", "other ops"):
            calls_s = others.setdefault(ev.key, [0, 0.0])
            calls_s[0] += ev.count
            calls_s[1] += self_s
        if b == "gemm":
            shapes = [list(s) for s in ev.input_shapes]
            gemms.append({"op": ev.key, "shapes": shapes, "calls": ev.count, "self_s": self_s,
                          "gflop": gemm_flops(ev.key, shapes) * ev.count / 1e9})
    buckets["outside ops"] = max(0.0, wall_s - sum(v for k, v in buckets.items() if k != "outside ops"))
    top = sorted(others.items(), key=lambda kv: -kv[1][1])[:10]
    return {"round_s": wall_s, "buckets_s": buckets, "gemm_gflop": sum(g["gflop"] for g in gemms), "gemms": gemms,
            "top_non_gemm": [{"op": k, "calls": int(c), "self_s": round(t, 4)} for k, (c, t) in top]}


def hot_floor(gemms: list[dict[str, Any]], reps: int = 5) -> float:
    """Seconds the round's GEMMs take when each distinct one is timed alone, hot, in this process
    (best of ``reps``; each entry of ``gemms`` gets its ``hot_s``)."""
    import torch

    total = 0.0
    for g in gemms:
        shapes = g["shapes"]
        if g["op"] == "mkldnn::_linear_pointwise":
            x, w = torch.randn(*shapes[0]), torch.randn(*shapes[1])
            call = lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
        elif g["op"] == "aten::mm":
            a, b = torch.randn(*shapes[0]), torch.randn(*shapes[1])
            call = lambda: torch.mm(a, b)  # noqa: E731
        elif g["op"] == "aten::addmm":
            c, a, b = torch.randn(*shapes[0]), torch.randn(*shapes[1]), torch.randn(*shapes[2])
            call = lambda: torch.addmm(c, a, b)  # noqa: E731
        else:
            raise B.BenchError(f"no hot timing for GEMM op {g['op']}")
        call()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t)
        g["hot_s"] = best * g["calls"]
        total += g["hot_s"]
    return total


def finish_side(summary: dict[str, Any]) -> dict[str, Any]:
    """Add the hot GEMM floor (in the side's own process, after its round)."""
    floor = hot_floor(summary["gemms"])
    gemm_s = summary["buckets_s"]["gemm"]
    summary.update({"gemm_floor_s": floor, "gemm_gflops_in_round": summary["gemm_gflop"] / gemm_s if gemm_s else None,
                    "gemm_gflops_hot": summary["gemm_gflop"] / floor if floor else None})
    summary["gemms"] = sorted(summary["gemms"], key=lambda g: -g["self_s"])[:12]   # the report keeps the largest
    return summary


# ---------------------------------------------------------------- the sides (child processes)
def ours_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Warm-up steps, then one profiled step of our trainer in this process."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hpc_verl.trainer.config.schema import load_config
    from hpc_verl.trainer.driver.inline_runner import InlineRunner
    from hpc_verl.trainer.driver.ppo_trainer import PPOTrainer

    s = spec["settings"]
    torch.set_num_threads(int(s["threads"]))
    steps = int(s["warmup"]) + 2
    overrides = ours_overrides(s, Path(spec["model"]), Path(spec["data"]), Path(spec["work"]), steps)
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    trainer = PPOTrainer(cfg, runner=InlineRunner(), progress=False)
    trainer.runner.start(trainer.cfg.to_dict(), steps)
    for _ in range(int(s["warmup"])):
        trainer.train_step()
    t = time.perf_counter()
    trainer.train_step()
    plain = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t = time.perf_counter()
        trainer.train_step()
        wall = time.perf_counter() - t
    trainer.runner.shutdown()
    return {**finish_side(summarise(prof, wall)), "plain_round_s": plain}


def child_main(argv: list[str]) -> int:
    """``python -m benchmarks.ppo_profile ours SPEC.json OUT.json`` (the TRL side is rl_common's)."""
    if len(argv) != 3 or argv[0] != "ours":
        print("usage: python -m benchmarks.ppo_profile ours SPEC.json OUT.json", file=sys.stderr)
        return 2
    out = ours_child(json.loads(Path(argv[1]).read_text()))
    Path(argv[2]).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------- the benchmark
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--warmup", type=int, default=1, help="unprofiled rounds first (default: %(default)s)")
    p.add_argument("--sides", default="ours,trl", help="comma-separated, of: " + ", ".join(SIDES))
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run (default: %(default)s)")
    B.add_common_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p, a = B.parse(build_parser(), argv)
    check_workload_args(p, a, also=("warmup",))
    a.side_list = [x.strip() for x in a.sides.split(",") if x.strip()]
    bad = [x for x in a.side_list if x not in SIDES]
    if bad or "ours" not in a.side_list or len(set(a.side_list)) != len(a.side_list):
        p.error(f"--sides {a.sides!r}: give ours and optionally trl, each once")
    return a


def run_side(side: str, a: argparse.Namespace, model: Path, data: Path, work: Path, tag: str) -> dict[str, Any]:
    s = {**workload_settings(a), "warmup": a.warmup}
    spec_file, out_file, log = work / f"{tag}.spec.json", work / f"{tag}.out.json", work / f"{tag}.log"
    if side == "ours":
        spec = {"settings": s, "model": str(model), "data": str(data), "work": str(work / tag)}
        cmd = [sys.executable, "-m", "benchmarks.ppo_profile", "ours", str(spec_file), str(out_file)]
    else:
        spec = {"settings": s, "steps": a.warmup + 2, "model": str(model), "data": str(data),
                "work": str(work / tag), "profile_round": a.warmup + 1}
        cmd = trl_command(spec_file, out_file)
    spec_file.write_text(json.dumps(spec))
    before = B.loadavg()
    run_child(cmd, a.cpus, a.threads, log, a.timeout_s)
    out = json.loads(out_file.read_text())
    prof = out if side == "ours" else out.get("profile")
    if not prof:
        raise B.BenchError(f"{side}: the run wrote no profile; see {log}")
    if side == "trl":   # round k's time is the gap between the ends of rounds k-1 and k
        prof["plain_round_s"] = out["round_s"][a.warmup - 1]
    return {**prof, "loadavg_before": before, "loadavg_after": B.loadavg()}


def median_side(side: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    row = {"name": side, "kind": "ours" if side == "ours" else "baseline", "label": SIDES[side],
           "plain_round_s": round(med("plain_round_s"), 3), "round_s": round(med("round_s"), 3),
           "buckets_s": {b: round(statistics.median(r["buckets_s"][b] for r in runs), 3) for b in BUCKETS},
           "gemm_gflop": round(med("gemm_gflop"), 4), "gemm_floor_s": round(med("gemm_floor_s"), 3),
           "gemm_gflops_in_round": round(med("gemm_gflops_in_round"), 1),
           "gemm_gflops_hot": round(med("gemm_gflops_hot"), 1), "runs": runs}
    row["round_over_floor"] = round(row["plain_round_s"] / row["gemm_floor_s"], 3)
    row["profiler_cost_s"] = round(statistics.median(r["round_s"] - r["plain_round_s"] for r in runs), 3)
    return row


def build_report(a: argparse.Namespace, runs: dict[str, list[dict]], env: dict) -> dict[str, Any]:
    rows = [median_side(side, rs) for side, rs in runs.items()]
    by = {r["name"]: r for r in rows}
    notes = list(a.notes)
    if "trl" in by:
        bound = by["trl"]["plain_round_s"] / by["ours"]["gemm_floor_s"]
        by["trl"]["round_over_ours_floor"] = round(bound, 3)
        notes.append(f"trl's round / ours' GEMM floor = {bound:.2f}: the most ours/TRL could reach with ours' "
                     "products at this core's hot GEMM rate and nothing else")
    return B.make_report("ppo_profile", ratio=by["ours"]["round_over_floor"], baseline=None, rows=rows,
                         settings={**workload_settings(a), "warmup": a.warmup, "sides": a.side_list}, env=env,
                         ratio_definition="ours' round (unprofiled) over its GEMM floor (the round's matrix "
                                          "products timed alone, hot, on this core); 1.0 = nothing but GEMMs; "
                                          "lower is better",
                         notes=notes)


def show(con: Any, report: dict) -> None:
    rows = report["rows"]
    con.print(B.table("where a round goes (seconds, median over runs; buckets from the profiled round)",
                      ["side", "round", "profiled", "profiler cost", *BUCKETS, "GEMM GFLOP", "GFLOP/s in round",
                       "GFLOP/s hot", "GEMM floor", "round / floor"],
                      [[r["name"], r["plain_round_s"], r["round_s"], r["profiler_cost_s"],
                        *[r["buckets_s"][b] for b in BUCKETS], r["gemm_gflop"],
                        r["gemm_gflops_in_round"], r["gemm_gflops_hot"], r["gemm_floor_s"], r["round_over_floor"]]
                       for r in rows]))
    for r in rows:
        top = r["runs"][0]["top_non_gemm"][:6]
        con.print(f"{r['name']}, largest non-GEMM operators (first run): "
                  + "; ".join(f"{t['op']} {t['self_s']:.2f}s/{t['calls']}" for t in top))
    for note in report["notes"]:
        con.print(f"note: {note}")
    con.print(B.ratio_line(report))


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if "trl" in a.side_list:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("ppo_profile: TRL is not installed; pip install trl (the 'bench' extra), or --sides ours",
                  file=sys.stderr)
            return 2
    env = B.environment(("torch", "transformers", "trl"))
    con = B.console()
    with tempfile.TemporaryDirectory(prefix="hpcv-ppo-profile-") as d:
        work = Path(d)
        model, data, params = make_assets(work, a.hidden, a.layers, a.heads, max(256, a.prompts * (a.warmup + 2)))
        con.print(f"model: Llama hidden {a.hidden} x {a.layers} layers, {params / 1e6:.1f}M parameters; "
                  f"{a.prompts} prompts x {a.group}, {a.response_length} tokens; CPUs {a.cpus}, {a.threads} thread(s)")
        runs: dict[str, list[dict]] = {s: [] for s in a.side_list}
        order = B.alternating(a.side_list, a.repeats)
        with B.progress(con) as prog:
            task = prog.add_task("runs", total=len(order))
            for rep, side in order:
                prog.update(task, description=f"repeat {rep + 1}/{a.repeats}: {side}")
                rec = run_side(side, a, model, data, work, f"{side}-{rep}")
                runs[side].append(rec)
                prog.console.print(f"repeat {rep + 1} {side}: round {rec['plain_round_s']:.2f}s (profiled "
                                   f"{rec['round_s']:.2f}s), GEMM "
                                   f"{rec['buckets_s']['gemm']:.2f}s (floor {rec['gemm_floor_s']:.2f}s)")
                prog.advance(task)
    report = build_report(a, runs, B.finish(env))
    return B.publish(con, report, a.json, show)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "ours":
        sys.exit(child_main(sys.argv[1:]))
    sys.exit(report_errors(main))
