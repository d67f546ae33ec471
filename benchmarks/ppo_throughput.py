"""GRPO throughput at equal work: our trainer (its real path, through Ray) against TRL's GRPOTrainer.

Both sides train the same random Llama (``--size``: default ~21M parameters,
``tiny`` is the old 64-hidden model) on the synthetic digit task with the same
prompts x group per round, the same response length forced on both (the EOS id
lies outside the model's vocabulary, so every response is exactly
``--response-length`` tokens), the same optimizer steps per round (mini-batches),
the same learning rate, clip and weight decay, no reference model, gradient
checkpointing off on both, the same old-log-prob policy (a separate no-grad
forward on both: ours with ``hpc_verl.old_log_prob_from_rollout=false``), the same
torch threads per process and the same CPUs (every process of a side is pinned
to the first ``--cores`` CPUs).

Each side runs in a fresh process per repeat, the order alternating; the first
``--warmup`` rounds are not timed. Per round and side the script counts
sequences through full forwards, sequences through backwards, optimizer steps
and generated tokens (TRL: hooks in its process; ours: the trainer's ``perf/*``
metrics when present, else an analytic count from the config, labelled) and
refuses a ratio when they differ. Extra, labelled row: ours with the sampler's
log-probs as PPO's old log-probs (one forward fewer: not equal work, no ratio).

    .venv/bin/python benchmarks/ppo_throughput.py --json ppo.json            # default size
    .venv/bin/python benchmarks/ppo_throughput.py --size tiny --rounds 2 --repeats 1

TRL is a benchmark-only dependency (the ``bench`` extra: pip install trl).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import benchlib as B  # noqa: E402
from hpc_verl.errors import report_errors  # noqa: E402
from benchmarks.counting import ours_round_counts  # noqa: E402
from benchmarks.rl_common import (add_workload_args, check_workload_args, make_assets, ours_command,  # noqa: E402
                                  run_child, trl_command, workload_settings)

SIDES = {"ours": "ours (hpc-verl train, Ray; old log-probs by a separate forward)",
         "trl": "TRL GRPOTrainer (no gradient checkpointing, beta=0)",
         "ours-shortcut": "ours, old log-probs from the sampler (one forward fewer)",
         "ours-mkl": "ours with F.linear on MKL as TRL runs it (hpc_verl.cpu_matmul=torch)"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first rounds per run (default: %(default)s)")
    p.add_argument("--no-shortcut", action="store_true", help="skip the extra sampler-log-prob row of ours")
    p.add_argument("--no-mkl-row", action="store_true",
                   help="skip the extra row of ours with torch's own F.linear (MKL) instead of oneDNN")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per run (default: %(default)s)")
    B.add_common_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p, a = B.parse(build_parser(), argv)
    check_workload_args(p, a, also=("rounds", "warmup"))
    return a


def settings(a: argparse.Namespace, side: str = "ours") -> dict[str, Any]:
    return {**workload_settings(a, side == "ours-shortcut", "torch" if side == "ours-mkl" else "onednn"),
            "rounds": a.rounds, "warmup": a.warmup}


def run_side(side: str, a: argparse.Namespace, model: Path, data: Path, work: Path, tag: str) -> dict[str, Any]:
    """One fresh process of one side: per timed round its seconds and counts."""
    steps = a.warmup + a.rounds
    before = B.loadavg()
    log = work / f"{tag}.log"
    if side.startswith("ours"):
        s = settings(a, side)
        run_dir = work / tag
        wall = run_child(ours_command(s, model, data, run_dir, steps), a.cpus, a.threads, log, a.timeout_s)
        from hpc_verl.trainer.observe.metrics import read_metrics
        timed = read_metrics(run_dir)[a.warmup:]
        counted = [ours_round_counts(m, s) for m in timed]
        rec = {"round_s": [float(m["timing_s/step"]) for m in timed], "counts": [c for c, _ in counted],
               "count_source": counted[0][1] if counted else {}}
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints of a random model
    else:
        spec = {"settings": settings(a), "steps": steps, "model": str(model), "data": str(data),
                "work": str(work / tag)}
        spec_file, out_file = work / f"{tag}.spec.json", work / f"{tag}.out.json"
        spec_file.write_text(json.dumps(spec))
        wall = run_child(trl_command(spec_file, out_file), a.cpus, a.threads, log, a.timeout_s)
        out = json.loads(out_file.read_text())
        # round k's time is the gap between the ends of rounds k-1 and k: the first round has none
        rec = {"round_s": out["round_s"][a.warmup - 1:], "counts": out["counts"][a.warmup:],
               "count_source": {k: "measured (hooks)" for k in out["counts"][0]} if out["counts"] else {},
               "gradient_checkpointing": out["gradient_checkpointing"],
               "recomputed_layer_rows": out["recomputed_layer_rows"], "versions": out["versions"]}
    if len(rec["round_s"]) != a.rounds or len(rec["counts"]) != a.rounds:
        raise B.BenchError(f"{side}: expected {a.rounds} timed rounds, got {len(rec['round_s'])} times and "
                           f"{len(rec['counts'])} counts; see {log}")
    rec.update({"wall_s": round(wall, 2), "loadavg_before": before, "loadavg_after": B.loadavg(),
                "median_round_s": B.summary(rec["round_s"])["median"]})
    return rec


def summarise_side(side: str, runs: list[dict], a: argparse.Namespace) -> dict[str, Any]:
    med = B.summary([r["median_round_s"] for r in runs])
    rows = a.prompts * a.group
    counts = runs[0]["counts"][0]
    return {"name": side, "kind": {"ours": "ours", "trl": "baseline"}.get(side, "extra"), "label": SIDES[side],
            "median_round_s": round(med["median"], 4), "spread_round_s": [round(med["min"], 4), round(med["max"], 4)],
            "samples_per_s": round(rows / med["median"], 2),
            "tokens_per_s": round(counts["gen_tokens"] / med["median"], 1),
            "counts_per_round": counts, "count_source": runs[0]["count_source"], "runs": runs}


def build_report(a: argparse.Namespace, runs: dict[str, list[dict]], env: dict, params: int) -> dict[str, Any]:
    rows = [summarise_side(side, rs, a) for side, rs in runs.items()]
    by = {r["name"]: r for r in rows}
    counts = {side: [c for run in rs for c in run["counts"]] for side, rs in runs.items()}
    notes = list(a.notes)
    refused = B.equal_work({"ours": counts["ours"], "trl": counts["trl"]})
    if refused is None and any(r.get("gradient_checkpointing") for r in runs["trl"]):
        refused = "TRL ran with gradient checkpointing (it recomputes forwards in backward): not equal work"
    ratio = None if refused else by["trl"]["median_round_s"] / by["ours"]["median_round_s"]
    for row in rows:
        if row["kind"] == "extra":
            why = B.equal_work({"trl": counts["trl"], row["name"]: counts[row["name"]]})
            row["ratio_vs_baseline"] = None if why else round(by["trl"]["median_round_s"] / row["median_round_s"], 4)
            row["no_ratio_because"] = why
    if any(src == "analytic" for src in by["ours"]["count_source"].values()):
        notes.append("ours: forward/backward/optimizer counts are ANALYTIC (from the config: "
                     "counting.ours_counts_from_config) until the trainer writes perf/* metrics; "
                     "gen_tokens is measured")
    trl_versions = runs["trl"][0]["versions"]
    env["versions"].update(trl_versions)
    s = settings(a)
    s["parameters"] = params
    return B.make_report("ppo_throughput", ratio=ratio, baseline="trl", rows=rows, settings=s, env=env,
                         ratio_definition="ours samples/s over TRL samples/s at equal work "
                                          "(TRL median round time / ours); higher is better",
                         equal_work_ok=refused is None, refused=refused, notes=notes)


def sources(by_key: dict[str, str]) -> str:
    """``{"fwd_rows": "analytic", ...}`` -> "fwd_rows, bwd_rows, optim_steps: analytic; gen_tokens: measured"."""
    groups: dict[str, list[str]] = {}
    for key, src in by_key.items():
        groups.setdefault(src, []).append(key)
    return "; ".join(f"{', '.join(keys)}: {src}" for src, keys in groups.items())


def show(con: Any, report: dict) -> None:
    rows = report["rows"]
    con.print(B.table("work per round (equal on every side, or no ratio)",
                      ["side", "fwd rows", "bwd rows", "optim steps", "gen tokens", "counted by"],
                      [[r["name"], *[r["counts_per_round"][k] for k in ("fwd_rows", "bwd_rows", "optim_steps",
                                                                          "gen_tokens")],
                        sources(r["count_source"])] for r in rows]))
    con.print(B.table("round time (median over runs of each run's median round) and throughput",
                      ["side", "median s", "min s", "max s", "samples/s", "tokens/s", "vs TRL", "load at runs"],
                      [[r["name"], r["median_round_s"], *r["spread_round_s"], r["samples_per_s"], r["tokens_per_s"],
                        report["ratio"] if r["kind"] == "ours" else r.get("ratio_vs_baseline"),
                        " ".join(f"{run['loadavg_before'][0]:.1f}" for run in r["runs"])] for r in rows]))
    for r in rows:
        if r.get("no_ratio_because"):
            con.print(f"{r['name']}: no ratio ({r['no_ratio_because']})")
    for note in report["notes"]:
        con.print(f"note: {note}")
    con.print(B.ratio_line(report))


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        print("ppo_throughput: TRL is not installed; pip install trl (the 'bench' extra)", file=sys.stderr)
        return 2
    env = B.environment(("torch", "ray", "transformers", "trl"))
    con = B.console()
    sides = ["ours", "trl"] + ([] if a.no_shortcut else ["ours-shortcut"]) + ([] if a.no_mkl_row else ["ours-mkl"])
    v = env["versions"]
    con.print(f"TRL {v['trl']}, torch {v['torch']}, transformers {v['transformers']}, Ray {v['ray']}; "
              f"CPUs {a.cpus}, {a.threads} torch thread(s) per process; load {env['loadavg_start']}")
    with tempfile.TemporaryDirectory(prefix="hpcv-ppo-bench-") as d:
        work = Path(d)
        n_prompts = max(256, a.prompts * (a.warmup + a.rounds))
        model, data, params = make_assets(work, a.hidden, a.layers, a.heads, n_prompts)
        con.print(f"model: Llama hidden {a.hidden} x {a.layers} layers, {params / 1e6:.1f}M parameters; "
                  f"{a.prompts} prompts x {a.group}, {a.response_length} tokens, {a.updates_per_round} optimizer "
                  f"steps per round, {a.rounds} timed + {a.warmup} warm-up rounds, {a.repeats} repeat(s)")
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        order = B.alternating(sides, a.repeats)
        with B.progress(con) as prog:
            task = prog.add_task("runs", total=len(order))
            for i, (rep, side) in enumerate(order):
                prog.update(task, description=f"repeat {rep + 1}/{a.repeats}: {side}")
                rec = run_side(side, a, model, data, work, f"{side}-{rep}")
                rec.update({"repeat": rep, "position": i})
                runs[side].append(rec)
                prog.console.print(f"repeat {rep + 1} {side}: median round {rec['median_round_s']:.3f}s "
                                   f"(load {rec['loadavg_before'][0]:.1f})")
                prog.advance(task)
    report = build_report(a, runs, B.finish(env), params)
    return B.publish(con, report, a.json, show)


if __name__ == "__main__":
    sys.exit(report_errors(main))
