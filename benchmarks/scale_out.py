"""Scale-out of the built-in trainer on CPU: strong-scaling efficiency of W=2 data-parallel ranks
against one rank, and the cost of the actor -> rollout weight sync against model size.

Throughput: the same PPO job (GRPO on the digit task, responses forced to
``--response-length`` tokens with rollout.ignore_eos, the same global batch and mini-batches)
on three sides, each a fresh ``hpc-verl train`` process:

- ``W=1, 1 pinned core``: one rank, one torch thread, its process pinned to one core
  (``hpc_verl.pin_cpus``): the denominator;
- ``W=2, 1 pinned core each``: two ranks, one thread each, rank r pinned to core r;
- ``W=1, 2 threads``: one rank with two intra-op threads on both cores: the alternative to
  data parallelism on one machine, a labelled row (two 1-thread processes do about twice the
  GEMM work of one 1-thread process here; one 2-thread process does less), never the ratio.

The figure is strong-scaling efficiency, T1 / (W x T_W) = samples/s at W=2 over twice those
of W=1 (``"ratio"``). Sides alternate, ``--repeats`` runs each (median and interquartile
range). Both sides run a GRPO group's prompt once per group (prompt sharing, also under DDP),
and the trainer's counters (rows through a forward and a backward, optimizer steps,
generated tokens, tokens in the batches) are printed per side; a ratio is refused if they
differ. Each run's foreign CPU load (CPU time on the two cores that the run's own processes
did not spend, read from /proc) is measured; a run over ``--max-foreign-load`` cores is
marked and left out, and the ratio is refused without 3 clean runs a side.

The default shape is one where compute dominates: 32 prompts x 8 responses of 64 tokens a step
(128 rows a rank at W=2), 4 mini-batches, a 4-layer 256-wide model. Two costs do not halve with the
rows and set the shape: the gradient all-reduce (~10 MB per optimizer step, the same at any batch)
and the per-token fixed cost of decoding (each generated token runs every layer once however few
rows there are). Against the earlier 16 x 8 x 32 shape, the rows per optimizer step and the tokens
per row double; with it, those fixed costs held the efficiency near 0.7 (see docs/benchmarks.md).

``--bucket-sweep 1,2,8,25`` also runs the W=2 side at each DDP bucket size
(``hpc_verl.ddp_bucket_mb``), alternated, ``--bucket-repeats`` runs each: the measurement behind
the key's default.

Weight sync: the real transports of the runtime (``send_control(TENSORS)``) for
models of ``--sync-hidden`` sizes: colocated (actor and rollout in one process: an
in-place copy) and separate groups (a bucketed gloo broadcast from the actor's rank
0 to the rollout replica), each against its floor measured in the same run: one
memcpy of the same bytes, one gloo broadcast of one flat buffer of the same bytes.

    .venv/bin/python benchmarks/scale_out.py --json benchmarks/results/scale_out.json
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COUNT_KEYS = ("perf/fwd_rows", "perf/bwd_rows", "perf/optim_steps", "perf/gen_tokens", "n_total_tokens")
W1, W2, INTRA = "W=1, 1 pinned core", "W=2, 1 pinned core each", "W=1, 2 threads (intra-op alternative)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON (top-level 'ratio': W=2 over W=1)")
    p.add_argument("--repeats", type=int, default=5, help="runs per side, order alternated (>= 3 for a median)")
    p.add_argument("--steps", type=int, default=6, help="training steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps of a run left out of its figure")
    p.add_argument("--hidden", type=int, default=256, help="model hidden size (throughput)")
    p.add_argument("--layers", type=int, default=4, help="model layers (throughput)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (data.train_batch_size)")
    p.add_argument("--group", type=int, default=8, help="responses per prompt (rollout.n)")
    p.add_argument("--response-length", type=int, default=64, help="tokens per response (forced)")
    p.add_argument("--mini-batches", type=int, default=4,
                   help="optimizer steps per training step (ppo_mini_batch_size = prompts / this)")
    p.add_argument("--max-foreign-load", type=float, default=0.10,
                   help="cores of foreign CPU load above which a run is left out (read from /proc)")
    p.add_argument("--sync-hidden", default="64,256,1024", help="hidden sizes for the weight-sync sweep (2 layers)")
    p.add_argument("--sync-repeats", type=int, default=5, help="syncs timed per size and mode")
    p.add_argument("--bucket-sweep", default="", metavar="MB,MB,...",
                   help="also run W=2 at these hpc_verl.ddp_bucket_mb sizes (e.g. 1,2,8,25)")
    p.add_argument("--bucket-repeats", type=int, default=3, help="runs per bucket size in the sweep")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-sync", action="store_true")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps <= args.warmup:
        p.error("need --repeats >= 1 and --steps > --warmup")
    if len(os.sched_getaffinity(0)) < 2:
        p.error("needs two CPUs (one pinned core per rank)")
    try:
        args.sync_sizes = [int(x) for x in args.sync_hidden.split(",") if x.strip()]
    except ValueError:
        p.error(f"--sync-hidden {args.sync_hidden!r}: expected sizes like 64,256,512")
    try:
        args.buckets = [float(x) for x in args.bucket_sweep.split(",") if x.strip()]
    except ValueError:
        p.error(f"--bucket-sweep {args.bucket_sweep!r}: expected sizes in MB like 1,2,8,25")
    if any(b <= 0 for b in args.buckets):
        p.error(f"--bucket-sweep {args.bucket_sweep!r}: sizes must be > 0")
    return args


def _model(root: Path, hidden: int, layers: int) -> Path:
    from hpc_verl.trainer.models.check import quiet_transformers
    from hpc_verl.trainer.models.tiny import make_tiny_model
    quiet_transformers()
    out = root / f"model-h{hidden}-l{layers}"
    if not out.exists():
        make_tiny_model(out, hidden_size=hidden, num_layers=layers, num_heads=max(1, hidden // 64))
    return out


def _overrides(args: argparse.Namespace, model: Path, data: Path, run_dir: Path) -> list[str]:
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={data / 'train.parquet'}",
            "data.max_prompt_length=16", f"data.max_response_length={args.response_length}",
            f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.group}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={max(1, args.prompts // args.mini_batches)}",
            "actor_rollout_ref.rollout.ignore_eos=true", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.strategy=ddp", "trainer.device=cpu",
            f"trainer.total_training_steps={args.steps}", "trainer.save_freq=-1", "trainer.resume_mode=disable",
            f"hpc_verl.run_dir={run_dir}", "hpc_verl.progress=false"]


def run_side(args: argparse.Namespace, world: int, threads: int, pins: list[int] | None, model: Path, data: Path,
             work: Path, tag: str, cpus: list[int], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One fresh trainer process: ``world`` ranks of ``threads`` torch threads, pinned or not; its
    per-step figures and the foreign CPU load on ``cpus`` while it ran."""
    from benchmarks import proctree

    run_dir = work / f"run-{tag}"
    cmd = [sys.executable, "-m", "hpc_verl", "train", "--no-progress",
           *_overrides(args, model, data, run_dir), f"trainer.n_gpus_per_node={world}",
           f"hpc_verl.torch_threads={threads}", *extra] + ([f"hpc_verl.pin_cpus={pins}"] if pins else [])
    retried = []
    while True:
        mark = proctree.tag_env()
        env = dict(os.environ, PYTHONPATH=str(REPO), **mark)
        env.pop("RAY_ADDRESS", None)
        sampler = proctree.TreeSampler(mark[proctree.TAG], cpus)
        sampler.start()
        t0 = time.monotonic()
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        elapsed = time.monotonic() - t0
        seen = sampler.stop()
        proctree.kill_leftovers(mark[proctree.TAG])
        if res.returncode == 0:
            break
        last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"
        # a process start that failed in the kernel (EFAULT from exec, seen once in ~15 runs here) is
        # not a figure: run the side again once, and say so in the report
        if "(EFAULT)" not in last or retried:
            raise SystemExit(f"scale_out: the W={world} run failed ({res.returncode}): {res.stderr.strip()[-600:]}")
        retried.append(last)
        shutil.rmtree(run_dir, ignore_errors=True)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = recs[args.warmup:]
    rates = [r["n_responses"] / r["timing_s/step"] for r in steady]
    phases = {k: statistics.median(r[k] for r in steady) for k in steady[0]
              if k.startswith("timing_s/update_actor/") or k == "perf/rank_imbalance"}
    return {"world": world, "threads_per_rank": threads, "pinned": pins, "samples_per_s": statistics.median(rates),
            "step_s": statistics.median(r["timing_s/step"] for r in steady), "phases": phases,
            "foreign_cores": round(seen["foreign_cpu_s"] / max(elapsed, 1e-9), 3), "retried_after": retried,
            "counts": {k: sum(int(r.get(k, 0)) for r in steady) for k in COUNT_KEYS}}


def _iqr(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return [round(q[0], 2), round(q[2], 2)]


def throughput(args: argparse.Namespace, work: Path, progress: Any) -> dict[str, Any]:
    from benchmarks import benchlib as B
    from hpc_verl.data.preprocess import preprocess_digits

    model = _model(work, args.hidden, args.layers)
    data = work / "digits"
    if not data.exists():
        preprocess_digits(data, n_train=256, n_test=16, seed=0)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    sides = {W1: (1, 1, [cpus[0]]), W2: (2, 1, cpus), INTRA: (1, 2, None)}
    runs: dict[str, list[dict]] = {n: [] for n in sides}
    task = progress.add_task("throughput runs", total=len(sides) * args.repeats)
    for r, name in B.alternating(list(sides), args.repeats):
        world, threads, pins = sides[name]
        runs[name].append(run_side(args, world, threads, pins, model, data, work, f"{r}-w{world}-t{threads}", cpus))
        progress.advance(task)
    counts = {n: rs[0]["counts"] for n, rs in runs.items()}
    equal = all(run["counts"] == counts[W1] for rs in runs.values() for run in rs)
    out_sides = {}
    for n, rs in runs.items():
        clean = [x for x in rs if x["foreign_cores"] <= args.max_foreign_load]
        rates = [x["samples_per_s"] for x in clean]
        out_sides[n] = {"samples_per_s_median": statistics.median(rates) if rates else None,
                        "samples_per_s_iqr": _iqr(rates) if rates else None,
                        "samples_per_s_runs": [x["samples_per_s"] for x in rs],
                        "foreign_cores_runs": [x["foreign_cores"] for x in rs], "clean_runs": len(clean),
                        "retried_after": [r for x in rs for r in x["retried_after"]],
                        "threads_per_rank": rs[0]["threads_per_rank"], "pinned": rs[0]["pinned"],
                        "phases_median": {k: statistics.median(x["phases"][k] for x in rs)
                                          for k in rs[0]["phases"]},
                        "counts": counts[n]}
    enough = all(out_sides[n]["clean_runs"] >= min(3, args.repeats) for n in (W1, W2))
    ratio = (out_sides[W2]["samples_per_s_median"] / (2 * out_sides[W1]["samples_per_s_median"])
             if equal and enough else None)
    why = None if ratio is not None else ("the sides' counted work differs (unequal work)" if not equal else
                                          f"fewer than 3 runs a side under {args.max_foreign_load} cores of "
                                          "foreign CPU load")
    return {"ratio": ratio, "refused": why, "equal_work": equal, "sides": out_sides,
            "ratio_definition": "strong-scaling efficiency: W=2 samples/s / (2 x W=1 samples/s), one pinned core "
                                "per rank", "max_foreign_load_cores": args.max_foreign_load,
            "model": {"hidden": args.hidden, "layers": args.layers, "params": _param_count(model)},
            "batch": {"prompts": args.prompts, "group": args.group, "response_tokens": args.response_length},
            "steps_measured": args.steps - args.warmup}


def bucket_sweep(args: argparse.Namespace, work: Path, progress: Any) -> dict[str, Any]:
    """W=2 (one pinned core a rank) at each DDP bucket size, alternated: samples/s and the exposed
    all-reduce, median over the clean runs."""
    from benchmarks import benchlib as B

    model = _model(work, args.hidden, args.layers)
    data = work / "digits"
    cpus = sorted(os.sched_getaffinity(0))[:2]
    names = [f"{b:g}" for b in args.buckets]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    task = progress.add_task("DDP bucket sweep", total=len(names) * args.bucket_repeats)
    for r, name in B.alternating(names, args.bucket_repeats):
        runs[name].append(run_side(args, 2, 1, cpus, model, data, work, f"sweep{r}-b{name}", cpus,
                                   extra=(f"hpc_verl.ddp_bucket_mb={name}",)))
        progress.advance(task)
    rows = []
    for name, rs in runs.items():
        clean = [x for x in rs if x["foreign_cores"] <= args.max_foreign_load]
        rows.append({"ddp_bucket_mb": float(name), "clean_runs": len(clean),
                     "samples_per_s_median": statistics.median(x["samples_per_s"] for x in clean) if clean else None,
                     "samples_per_s_runs": [x["samples_per_s"] for x in rs],
                     "foreign_cores_runs": [x["foreign_cores"] for x in rs],
                     "allreduce_s_median": statistics.median(
                         x["phases"].get("timing_s/update_actor/allreduce", 0.0) for x in rs),
                     "backward_s_median": statistics.median(
                         x["phases"].get("timing_s/update_actor/backward", 0.0) for x in rs)})
    return {"rows": rows, "repeats": args.bucket_repeats}


def _param_count(model: Path) -> int:
    from transformers import AutoModelForCausalLM
    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(model)).parameters())


def _sync_once(sched: Any, version: int) -> tuple[float, dict]:
    from hpc_verl.dataflow import TENSORS
    from hpc_verl.trainer.driver.ppo_graph import POLICY_EDGE_KEY
    t0 = time.perf_counter()
    sched.send_control(POLICY_EDGE_KEY, TENSORS, version)
    return time.perf_counter() - t0, dict(sched.board.transfers[POLICY_EDGE_KEY])


def weight_sync(args: argparse.Namespace, work: Path, progress: Any) -> list[dict[str, Any]]:
    import ray

    from hpc_verl.trainer.config.schema import load_config
    from hpc_verl.trainer.driver.ray_runner import DataflowRunner

    rows = []
    task = progress.add_task("weight-sync sweep", total=2 * len(args.sync_sizes))
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        for hidden in args.sync_sizes:
            model = _model(work, hidden, 2)
            params = _param_count(model)
            for mode, extra in (("colocated", ["trainer.n_gpus_per_node=1"]),
                                ("separate", ["trainer.n_gpus_per_node=2",
                                              "hpc_verl.device_mapping={actor: [0], rollout: [1]}"])):
                cfg = load_config(None, [f"actor_rollout_ref.model.path={model}", "trainer.device=cpu",
                                         "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                                         f"hpc_verl.run_dir={work / ('sync-' + mode)}", "data.train_batch_size=2",
                                         "actor_rollout_ref.actor.ppo_mini_batch_size=2", *extra]).to_dict()
                runner = DataflowRunner()
                runner.start(cfg, 1)
                try:
                    times, seen = [], {}
                    for v in range(1, args.sync_repeats + 2):
                        dt, seen = _sync_once(runner.sched, v)
                        if v > 1:   # the first sync also builds the sync group
                            times.append(dt)
                finally:
                    runner.shutdown()
                nbytes = params * 4
                rows.append({"hidden": hidden, "params": params, "bytes": nbytes, "mode": mode,
                             "transport": seen.get("mode"), "sync_s_median": statistics.median(times),
                             "sync_s_runs": times})
                progress.advance(task)
    finally:
        ray.shutdown()
    for row in rows:   # the floors, measured in this run for the same byte counts
        row["floor"] = "memcpy" if row["mode"] == "colocated" else "gloo broadcast"
        row["floor_s"] = (memcpy_floor(row["bytes"], args.sync_repeats) if row["mode"] == "colocated"
                          else broadcast_floor(row["bytes"], args.sync_repeats))
        row["over_floor"] = row["sync_s_median"] / row["floor_s"] if row["floor_s"] else None
    return rows


def memcpy_floor(nbytes: int, repeats: int) -> float:
    import torch
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bcast_worker(rank: int, port: int, nbytes: int, repeats: int, out: Any) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    buf = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        pg.broadcast([buf], dist.BroadcastOptions()).wait()
        times.append(time.perf_counter() - t0)
    if rank == 1:
        out.put(statistics.median(times[1:]))


def broadcast_floor(nbytes: int, repeats: int) -> float:
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_bcast_worker, args=(r, port, nbytes, repeats, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    value = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return value


def report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    tp = result.get("throughput")
    if tp:
        t = Table(title=f"Throughput, {tp['model']['params'] / 1e6:.1f}M-parameter model, "
                        f"{tp['batch']['prompts']}x{tp['batch']['group']} responses of "
                        f"{tp['batch']['response_tokens']} tokens")
        for col in ("side", "samples/s", "IQR", "runs", "foreign cores", *(k.split("/")[-1] for k in COUNT_KEYS)):
            t.add_column(col)
        for name, side in tp["sides"].items():
            c = side["counts"]
            med = side["samples_per_s_median"]
            t.add_row(name, "-" if med is None else f"{med:.1f}",
                      "-" if side["samples_per_s_iqr"] is None else "-".join(f"{x:.1f}" for x in side["samples_per_s_iqr"]),
                      ", ".join(f"{x:.1f}" for x in side["samples_per_s_runs"]),
                      ", ".join(f"{x:.2f}" for x in side["foreign_cores_runs"]), *(str(c[k]) for k in COUNT_KEYS))
        console.print(t)
        ph = Table(title="Where an update goes (medians of the runs; the slowest rank's, and the fastest's)")
        for col in ("side", "forward s", "backward s", "allreduce s", "optimizer s", "rank imbalance"):
            ph.add_column(col)
        for name, side in tp["sides"].items():
            m = side["phases_median"]

            def cell(phase: str) -> str:
                k = f"timing_s/update_actor/{phase}"
                return f"{m[k]:.3f} / {m[k + '_min']:.3f}" if k in m else "-"
            ph.add_row(name, *(cell(x) for x in ("forward", "backward", "allreduce", "optimizer")),
                       f"{m.get('perf/rank_imbalance', 1.0):.2f}")
        console.print(ph)
        if tp["ratio"] is None:
            console.print(f"[red]no ratio: {tp['refused']}[/red]")
        else:
            console.print(f"strong-scaling efficiency at W=2 (one pinned core a rank): [bold]{tp['ratio']:.2f}[/bold]")
    sweep = result.get("ddp_bucket_sweep")
    if sweep:
        t = Table(title=f"W=2 at each DDP bucket size (hpc_verl.ddp_bucket_mb), {sweep['repeats']} runs each")
        for col in ("bucket MB", "samples/s", "runs", "allreduce s", "backward s", "foreign cores"):
            t.add_column(col)
        for r in sweep["rows"]:
            med = r["samples_per_s_median"]
            t.add_row(f"{r['ddp_bucket_mb']:g}", "-" if med is None else f"{med:.1f}",
                      ", ".join(f"{x:.1f}" for x in r["samples_per_s_runs"]), f"{r['allreduce_s_median']:.3f}",
                      f"{r['backward_s_median']:.3f}", ", ".join(f"{x:.2f}" for x in r["foreign_cores_runs"]))
        console.print(t)
    rows = result.get("weight_sync")
    if rows:
        t = Table(title="Weight sync actor -> rollout (the runtime's transports) against their floors")
        for col in ("hidden", "params", "MB", "mode", "transport", "sync ms", "floor", "floor ms", "x floor"):
            t.add_column(col)
        for r in rows:
            t.add_row(str(r["hidden"]), f"{r['params'] / 1e6:.2f}M", f"{r['bytes'] / 2**20:.1f}", r["mode"],
                      str(r["transport"]), f"{1000 * r['sync_s_median']:.1f}", r["floor"],
                      f"{1000 * r['floor_s']:.2f}", f"{r['over_floor']:.1f}")
        console.print(t)


def main(argv: list[str] | None = None) -> int:
    from rich.progress import Progress

    from benchmarks import benchlib as B

    args = parse_args(argv)
    env = B.environment(("torch", "ray"))
    result: dict[str, Any] = {"benchmark": "scale_out", "ratio": None}
    with tempfile.TemporaryDirectory(prefix="hpcv-scale-") as tmp, Progress() as progress:
        work = Path(tmp)
        if not args.skip_throughput:
            result["throughput"] = throughput(args, work, progress)
            result["ratio"] = result["throughput"]["ratio"]
            if args.buckets:
                result["ddp_bucket_sweep"] = bucket_sweep(args, work, progress)
        if not args.skip_sync:
            result["weight_sync"] = weight_sync(args, work, progress)
    if result["ratio"] is None:   # why, as every report says it
        result["refused"] = ("--skip-throughput: no throughput measured" if args.skip_throughput
                             else result["throughput"]["refused"])
    result = {"benchmark": "scale_out", "ratio": result["ratio"], **B.run_record(B.finish(env)),
              **{k: v for k, v in result.items() if k not in ("benchmark", "ratio")},
              "environment": {"python": env["python"], "versions": env["versions"]}}
    B.validate_record(result)
    report(result)
    if args.json:
        from hpc_verl.util.fs import atomic_write_json
        atomic_write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
