"""Ray bring-up on the SLURM test bed: our launcher against scripts that poll, by one external probe.

For every side the clock starts when the benchmark calls ``sbatch`` and stops
when the cluster is usable: the side has declared Ray ready (its workload has
started) AND an external probe - a process outside the job polling the head's
GCS every 50 ms - has seen all N nodes and N x 4 GPUs alive. Sides:

  * ours: the script ``hpc-verl render --profile testbed-local`` writes (job-derived
    ports, token, head and workers at once, bounded barrier);
  * poll: what a careful engineer writes: start the head; the moment its GCS port
    answers start all workers in one ``srun`` step; poll ``ray.nodes()`` every
    0.25 s until every node and GPU is there;
  * sleep (reference row only, never the ratio's baseline): head, ``sleep 10``,
    each worker then ``sleep 5`` (verl's public SLURM example);
  * symmetric: ``ray symmetric-run`` where this Ray has it and it can run (see the
    report: on a one-host test bed it cannot, and the report says why).

The workload of every side is the same: ``python -m benchmarks.bringup --hold
DIR`` notes the moment it starts (the side's "ready") and holds the cluster
until the benchmark releases it. Sides alternate, ``--repeats`` times, for each
``--nodes`` size (the test bed runs up to 4 slurmd), after ``--warmup`` untimed
jobs of ours and poll on each fresh test bed (its first job starts cold, and
ours would always be that job; the warm-up times are in the report's settings). The top-level ratio is ours
over the faster of poll and symmetric-run, the worst over the sizes.

    .venv/bin/python benchmarks/bringup.py --json bringup.json            # N = 2 and 4
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import benchlib as B  # noqa: E402
from hpc_verl.errors import report_errors  # noqa: E402

GPUS = 4  # per test bed node (hpc_verl.testbed.cluster.GPUS_PER_NODE)
PROBE_S = 0.05
SIDES = {"ours": "hpc-verl rendered script (barrier)", "poll": "careful script: GCS port, one srun, ray.nodes()",
         "sleep": "sleep 10 + sleep 5 per worker (reference)", "symmetric": "ray symmetric-run"}

_HEAD = r"""#!/bin/bash
#SBATCH --nodes={n}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --gpus-per-node={gpus}
date +%s.%N > {dir}/t0
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
PY={py}
P=$((10000 + (SLURM_JOB_ID % 30) * 300))
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head=${{nodes[0]}}
ip=$(hostname -I 2>/dev/null | awk '{{print $1}}'); ip=${{ip:-127.0.0.1}}
echo "$ip:$P" > {dir}/address.tmp && mv {dir}/address.tmp {dir}/address
# one host carries every test bed "node": each node its own ports and temp dir
node_args() {{  # $1: node index -> NODE_ARGS
  local q=$((P + 50 * $1))
  NODE_ARGS=(--node-ip-address="$ip" --num-cpus=1 --num-gpus={gpus} --node-manager-port=$((q + 3))
    --object-manager-port=$((q + 4)) --dashboard-agent-listen-port=$((q + 5))
    --dashboard-agent-grpc-port=$((q + 6)) --runtime-env-agent-port=$((q + 7)) --metrics-export-port=$((q + 8))
    --min-worker-port=$((q + 10)) --max-worker-port=$((q + 40)) --temp-dir={tmp}/b"$SLURM_JOB_ID-$1"
    --disable-usage-stats)
}}
node_args 0
srun --overlap --nodes=1 --ntasks=1 -w "$head" "$PY" -m ray.scripts.scripts start --head --block --port=$P \
  --include-dashboard=false --dashboard-port=$((P + 1)) --ray-client-server-port=$((P + 2)) \
  "${{NODE_ARGS[@]}}" >{dir}/head.log 2>&1 &
pids=($!)
"""
_HOLD = r"""
"$PY" -m benchmarks.bringup --hold {dir}
kill -TERM "${{pids[@]}}" 2>/dev/null; wait
"""
POLL_SCRIPT = _HEAD + r"""
until (exec 3<>"/dev/tcp/$ip/$P") 2>/dev/null; do sleep 0.1; done   # the GCS port answers
if ((${{#nodes[@]}} > 1)); then
  # all workers in one step; each picks its ports by its rank in the step
  export -f node_args; export P ip
  # shellcheck disable=SC2016  # expanded by the step's shell, on its node
  srun --overlap --nodes=$((${{#nodes[@]}} - 1)) --ntasks=$((${{#nodes[@]}} - 1)) --ntasks-per-node=1 \
    --exclude="$head" bash -c 'node_args $((SLURM_PROCID + 1))
      exec "$0" -m ray.scripts.scripts start --block --address="$ip:$P" "${{NODE_ARGS[@]}}"' "$PY" \
    >{dir}/workers.log 2>&1 &
  pids+=($!)
fi
"$PY" - "$ip:$P" {n} {gpus} <<'EOF'
import sys, time
import ray
addr, n, g = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ray.init(address=addr, logging_level="ERROR", log_to_driver=False)
while True:
    alive = [x for x in ray.nodes() if x["Alive"]]
    if len(alive) >= n and sum(x["Resources"].get("GPU", 0) for x in alive) >= n * g:
        break
    time.sleep(0.25)
EOF
""" + _HOLD
SLEEP_SCRIPT = _HEAD + r"""
sleep 10
i=1
for node in "${{nodes[@]:1}}"; do
  node_args "$i"
  srun --overlap --nodes=1 --ntasks=1 -w "$node" "$PY" -m ray.scripts.scripts start --block --address="$ip:$P" \
    "${{NODE_ARGS[@]}}" >{dir}/worker-"$i".log 2>&1 &
  pids+=($!)
  sleep 5
  i=$((i + 1))
done
""" + _HOLD


def baseline_script(side: str, n: int, d: Path, temp_root: str) -> str:
    """The poll or sleep script for n nodes; every value that reaches the shell is quoted."""
    text = {"poll": POLL_SCRIPT, "sleep": SLEEP_SCRIPT}[side]
    return text.format(n=int(n), gpus=GPUS, dir=shlex.quote(str(d)), py=shlex.quote(sys.executable),
                       tmp=shlex.quote(temp_root))


SYMMETRIC_WHY = ("ray symmetric-run cannot run on this test bed: every SLURM node of it is the same host, and "
                 "symmetric-run tells head from worker by whether the GCS address is one of the host's own IPs (so "
                 "all N tasks would be heads, or all workers), passes the same ray start options (ports, temp "
                 "dir) to every node, and ends with 'ray stop', which stops every Ray process on the host, other "
                 "users' clusters included; it needs N real hosts")


# ---------------------------------------------------------------- inside the job / beside it
def hold(d: Path, timeout_s: float = 300) -> int:
    """The workload of every side: note "ready now", then keep the cluster until released."""
    (d / "declared.tmp").write_text(f"{time.time()}\n")
    os.replace(d / "declared.tmp", d / "declared")
    deadline = time.monotonic() + timeout_s
    while not (d / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


def probe(d: Path, n: int, gpus: int, job_root: str | None, timeout_s: float = 300) -> int:
    """Poll the GCS from outside until n nodes and gpus GPUs are alive; write the moment to d/probe."""
    import ray._raylet  # noqa: F401 - the heavy import before arming, not inside the measurement

    from hpc_verl.bootstrap.barrier import gcs_node_infos
    from hpc_verl.bootstrap.raydir import ray_env
    (d / "armed").write_text("1\n")
    deadline = time.monotonic() + timeout_s
    address = None
    while time.monotonic() < deadline:
        if address is None:
            address = _find_address(d, job_root)
            if address is None:
                time.sleep(PROBE_S)
                continue
            if job_root:  # ours: the job's token, read by Ray's config (loaded at import: load it again)
                os.environ.update(ray_env(Path(address[1])))
                from ray._raylet import AuthenticationTokenLoader, Config
                Config.initialize("")
                AuthenticationTokenLoader.instance().reset_cache()
            address = address[0]
        infos, _ = gcs_node_infos(address, 1.0)
        if infos is not None:
            alive = [i for i in infos.values() if i.state == 0]
            if len(alive) >= n and sum(dict(i.resources_total).get("GPU", 0.0) for i in alive) >= n * gpus:
                (d / "probe").write_text(f"{time.time()}\n")
                return 0
        time.sleep(PROBE_S)
    (d / "probe_error").write_text(f"not {n} nodes / {n * gpus} GPUs within {timeout_s:.0f}s (address {address})\n")
    return 1


def _find_address(d: Path, job_root: str | None) -> tuple[str, str] | None:
    if job_root is None:
        f = d / "address"
        return (f.read_text().strip(), "") if f.exists() else None
    for head in glob.glob(os.path.join(job_root, "*", "ray", "head.json")):
        try:
            return json.loads(Path(head).read_text())["address"], str(Path(head).parents[1])
        except (OSError, ValueError, KeyError):
            return None
    return None


# ---------------------------------------------------------------- one run
def _wait_done(env: dict, job_id: int, timeout_s: float = 300) -> str:
    from hpc_verl.launch.backends import slurm

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = slurm.job_info(job_id, env=env)
        if info is None or info.terminal:
            return info.state if info else "GONE"
        time.sleep(0.5)
    slurm.scancel(job_id, env=env)
    return "TIMEOUT"


def _read_time(f: Path) -> float | None:
    try:
        return float(f.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def prepare(side: str, n: int, d: Path, ctx: dict) -> Path:
    """The side's batch script for n nodes, written before the clock starts."""
    script = d / "job.sbatch"
    if side == "ours":
        (d / "jobs").mkdir()  # sbatch opens the --output file there (hpc-verl submit makes it)
        job = d / "job.yaml"
        job.write_text(json.dumps({"name": "bench", "trainer": {"module": "benchmarks.bringup",
                                                                  "args": ["--hold", str(d)],
                                                                  "derive_overrides": False}}))
        proc = subprocess.run([sys.executable, "-m", "hpc_verl", "render", "--profile", "testbed-local",
                               "--config", str(job), "--set", f"slurm.nodes={n}",
                               "--set", f"paths.job_root={d / 'jobs'}", "-o", str(script)],
                              env=ctx["env"], capture_output=True, text=True, cwd=str(d))
        if proc.returncode != 0:
            raise B.BenchError(f"hpc-verl render failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
    else:
        script.write_text(baseline_script(side, n, d, ctx["temp_root"]))
    return script


def run_once(side: str, n: int, d: Path, ctx: dict) -> dict[str, Any]:
    from hpc_verl.launch.backends import slurm

    env = ctx["env"]
    d.mkdir(parents=True)
    script = prepare(side, n, d, ctx)
    job_root = str(d / "jobs") if side == "ours" else None
    prober = subprocess.Popen([sys.executable, "-m", "benchmarks.bringup", "--probe", str(d), "--nodes", str(n),
                               *(["--job-root", job_root] if job_root else [])],
                              env={**env, "RAY_AUTH_MODE": "disabled"}, cwd=str(B.REPO),
                              stdout=subprocess.DEVNULL, stderr=open(d / "probe.log", "w"))
    try:
        while not (d / "armed").exists():
            if prober.poll() is not None:
                raise B.BenchError(f"the probe exited before arming; see {d / 'probe.log'}")
            time.sleep(0.02)
        load = B.loadavg()
        t_submit = time.time()
        job_id = slurm.sbatch(str(script), env=env, extra_args=None if side == "ours" else [f"--output={d}/job.out"])
        deadline = time.monotonic() + 240
        next_state = 0.0
        while time.monotonic() < deadline and not ((d / "declared").exists() and prober.poll() is not None):
            if time.monotonic() >= next_state:  # squeue is a process: ask twice a second, not on every look
                info = slurm.job_info(job_id, env=env)
                if info is not None and info.terminal:
                    break
                next_state = time.monotonic() + 0.5
            time.sleep(0.05)
        (d / "release").write_text("1\n")
        state = _wait_done(env, job_id)
    finally:
        if prober.poll() is None:
            prober.kill()
        prober.wait()
    declared, seen, t0 = _read_time(d / "declared"), _read_time(d / "probe"), _read_time(d / "t0")
    if declared is None or seen is None:
        why = (d / "probe_error").read_text().strip() if (d / "probe_error").exists() else "no probe result"
        raise B.BenchError(f"{side} N={n}: job {job_id} {state}; declared={declared}, probe: {why}; see {d}")
    out = {"ready_s": round(max(declared, seen) - t_submit, 3), "declared_s": round(declared - t_submit, 3),
           "probe_s": round(seen - t_submit, 3), "declared_before_all_alive": declared + PROBE_S < seen,
           "batch_start_s": round(t0 - t_submit, 3) if t0 else None, "job_state": state, "loadavg": load}
    if side == "ours":
        logs = glob.glob(str(d / "jobs" / "*.out")) + glob.glob(str(d / "jobs" / "*" / "*.out"))
        text = "".join(Path(p).read_text(errors="replace") for p in logs)
        m = re.search(r"Ray ready ([\d.]+)s after the batch script started", text)
        out["self_reported_s"] = float(m.group(1)) if m else None
    return out


# ---------------------------------------------------------------- report
def warmup_sides(sides: Sequence[str]) -> list[str]:
    """The sides an untimed warm-up job runs for: the timed ones that poll (the sleep script's
    time is its fixed sleeps, and it never runs first on a fresh test bed)."""
    return [s for s in sides if s != "sleep"]


def build_report(a: argparse.Namespace, runs: dict[int, dict[str, list[dict]]], env: dict,
                 poll_ms: dict[int, float] | None, sym: dict[str, Any],
                 warm: dict[int, dict[str, list[float]]] | None = None) -> dict[str, Any]:
    rows, worst, notes = [], None, list(a.notes)
    for n, by_side in runs.items():
        med = {s: statistics.median(r["ready_s"] for r in rs) for s, rs in by_side.items() if rs}
        baselines = {s: med[s] for s in ("poll", "symmetric") if s in med}
        best = min(baselines, key=baselines.get) if baselines else None
        for side, rs in by_side.items():
            st = B.summary([r["ready_s"] for r in rs])
            row = {"name": f"{side}_n{n}", "kind": {"ours": "ours", "sleep": "reference"}.get(side, "baseline"),
                   "side": side, "label": SIDES[side], "nodes": n, "ready_s": round(st["median"], 3),
                   "spread_s": [round(st["min"], 3), round(st["max"], 3)],
                   "declared_before_all_alive": sum(r["declared_before_all_alive"] for r in rs), "runs": rs}
            if side == "ours":
                row["ratio_vs_baseline"] = round(st["median"] / med[best], 4) if best else None
                row["baseline"] = best
                row["ratio_vs_sleep"] = round(st["median"] / med["sleep"], 4) if "sleep" in med else None
                if row["ratio_vs_baseline"] is not None:
                    worst = max(worst or 0.0, row["ratio_vs_baseline"])
            rows.append(row)
        rows.append({"name": f"symmetric_n{n}", "kind": "baseline", "side": "symmetric", "nodes": n,
                     "label": SIDES["symmetric"], **sym})
    if poll_ms:
        rows.append({"name": "barrier_poll", "kind": "extra", "label": "one barrier poll (GCS query), median ms",
                     "ms_by_nodes": poll_ms})
    early = sum(r["declared_before_all_alive"] for r in rows if r.get("side") == "sleep")
    if early:
        notes.append(f"the sleep script declared Ray ready before every node had joined in {early} run(s); its "
                     "ready time is then the probe's")
    settings = {"nodes": a.node_sizes, "repeats": a.repeats, "warmup": a.warmup,
                "warmup_ready_s": {str(n): w for n, w in (warm or {}).items()},
                "gpus_per_node": GPUS, "probe_interval_s": PROBE_S,
                "clock": "from the sbatch call to max(side's declared ready, probe saw all nodes and GPUs)"}
    return B.make_report("bringup", ratio=worst, baseline="the faster of poll and symmetric-run", rows=rows,
                         ratio_definition="ours / the faster polling baseline, ready time, worst over node counts; "
                                          "lower is better (the sleep script is a reference row only)",
                         settings=settings, env=env, equal_work_ok=None,
                         refused=None if worst is not None else "no polling baseline ran", notes=notes)


def show(con: Any, report: dict) -> None:
    con.print(B.table("sbatch -> cluster usable (declared ready and all nodes + GPUs alive by the probe)",
                      ["row", "nodes", "median s", "min", "max", "declared early", "ours/best", "ours/sleep"],
                      [[r["name"], r.get("nodes"), r.get("ready_s"), *(r.get("spread_s") or [None, None]),
                        r.get("declared_before_all_alive"), r.get("ratio_vs_baseline"), r.get("ratio_vs_sleep")]
                       for r in report["rows"] if r["name"] != "barrier_poll"]))
    for r in report["rows"]:
        if r.get("side") == "symmetric" and not r.get("ran"):
            con.print(f"{r['name']}: not run: {r['why']}")
            break
    for note in report["notes"]:
        con.print(f"note: {note}")
    con.print(B.ratio_line(report))


def symmetric_status() -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "--help"], capture_output=True, text=True)
    if "symmetric-run" not in proc.stdout:
        return {"available": False, "ran": False, "why": "this Ray has no 'ray symmetric-run' (ray --help)"}
    return {"available": True, "ran": False, "why": SYMMETRIC_WHY}


def poll_scaling() -> dict[int, float]:
    """Median time of one barrier poll (GCS node query) on Ray clusters of 1, 2 and 4 nodes."""
    import ray
    from ray.cluster_utils import Cluster

    from hpc_verl.bootstrap.barrier import gcs_view

    os.environ["RAY_AUTH_MODE"] = "disabled"
    out = {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 1, "include_dashboard": False})
    try:
        for n in (1, 2, 4):
            while len(cluster.list_all_nodes()) < n:
                cluster.add_node(num_cpus=0, num_gpus=1)
            cluster.wait_for_nodes()
            times = []
            for _ in range(30):
                t = time.perf_counter()
                view = gcs_view(cluster.address, 2.0)
                times.append(time.perf_counter() - t)
                assert not view.error and view.gpus == n, view
            out[n] = round(statistics.median(times) * 1000, 3)
    finally:
        cluster.shutdown()
        ray.shutdown()
    return out


def build_parser() -> argparse.ArgumentParser:
    from hpc_verl.testbed.cluster import MAX_NODES
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default=f"2,{MAX_NODES}", help=f"node counts, each 2..{MAX_NODES} (default: %(default)s)")
    p.add_argument("--sides", default="ours,poll,sleep", help="(default: %(default)s)")
    p.add_argument("--testbed-dir", default=None, help="reuse a running test bed of that size (scripts/testbed.sh up)")
    p.add_argument("--poll-scaling", action="store_true", help="also time one barrier poll on 1, 2, 4 Ray nodes")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed jobs of each polling side per test bed before the timed ones; the first job on "
                        "a fresh test bed starts cold, and ours always runs first (default: %(default)s)")
    B.add_common_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from hpc_verl.testbed.cluster import MAX_NODES
    p, a = B.parse(build_parser(), argv)
    try:
        a.node_sizes = sorted({int(x) for x in a.nodes.split(",") if x.strip()})
    except ValueError:
        p.error(f"--nodes {a.nodes!r}: expected numbers like 2,4")
    if not a.node_sizes or a.node_sizes[0] < 2 or a.node_sizes[-1] > MAX_NODES:
        p.error(f"--nodes {a.nodes!r}: each count must be within 2..{MAX_NODES} (the test bed's slurmd on this host)")
    a.side_list = [s.strip() for s in a.sides.split(",") if s.strip()]
    bad = [s for s in a.side_list if s not in ("ours", "poll", "sleep")]
    if bad or "ours" not in a.side_list or "poll" not in a.side_list:
        p.error(f"--sides {a.sides!r}: give ours and poll, optionally sleep (symmetric-run is reported, "
                "not run, on this test bed)")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if a.testbed_dir and len(a.node_sizes) > 1:
        p.error("--testbed-dir reuses one running test bed: give a single --nodes count of its size")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--hold"]:
        return hold(Path(argv[1]))
    if argv[:1] == ["--probe"]:
        ap = argparse.ArgumentParser(prog="bringup --probe")
        ap.add_argument("--probe", type=Path)
        ap.add_argument("--nodes", type=int)
        ap.add_argument("--job-root")
        pa = ap.parse_args(argv)
        return probe(pa.probe, pa.nodes, GPUS, pa.job_root)
    a = parse_args(argv)
    from hpc_verl.testbed import TestBed
    from hpc_verl.testbed.profiles import write_profiles

    env0 = B.environment(("ray",))
    con = B.console()
    sym = symmetric_status()
    work = Path(tempfile.mkdtemp(prefix="hpcv-bench-"))
    temp_root = tempfile.mkdtemp(prefix="hpcvb", dir="/tmp")
    runs: dict[int, dict[str, list[dict]]] = {}
    warm: dict[int, dict[str, list[float]]] = {}
    bed = None
    try:
        prof = write_profiles(work / "profiles", sys.executable, temp_root=temp_root)
        per_size = len(B.alternating(a.side_list, a.repeats)) + a.warmup * len(warmup_sides(a.side_list))
        with B.progress(con) as prog:
            task = prog.add_task("bring-up runs", total=per_size * len(a.node_sizes))
            for n in a.node_sizes:
                prog.update(task, description=f"test bed: {n} nodes")
                if a.testbed_dir:
                    bed, owned = TestBed(a.testbed_dir), False
                    if len(bed.nodes) != n or not bed.is_up():
                        raise B.BenchError(f"--testbed-dir {a.testbed_dir}: not a running {n}-node test bed "
                                           f"(bash scripts/testbed.sh up --nodes {n})")
                else:
                    bed, owned = TestBed(work / "testbed", n), True
                    bed.up()
                ctx = {"env": {**os.environ, **bed.env(), "HPC_VERL_HOME": str(work / "home"),
                               "HPC_VERL_PROFILE_PATH": str(prof), "PYTHONPATH": str(B.REPO)},
                       "temp_root": temp_root}
                runs[n] = {s: [] for s in a.side_list}
                for w in range(a.warmup):   # untimed: the first jobs on a fresh test bed pay its cold start
                    for side in warmup_sides(a.side_list):
                        prog.update(task, description=f"{n} nodes, warm-up {w + 1}/{a.warmup}: {side}")
                        rec = run_once(side, n, work / f"n{n}-warmup{w}-{side}", ctx)
                        warm.setdefault(n, {}).setdefault(side, []).append(rec["ready_s"])
                        prog.console.print(f"N={n} warm-up {w + 1} {side}: {rec['ready_s']:.2f}s (not timed)")
                for rep, side in B.alternating(a.side_list, a.repeats):
                    prog.update(task, description=f"{n} nodes, repeat {rep + 1}/{a.repeats}: {side}")
                    rec = run_once(side, n, work / f"n{n}-{rep}-{side}", ctx)
                    runs[n][side].append(rec)
                    prog.console.print(f"N={n} repeat {rep + 1} {side}: usable after {rec['ready_s']:.2f}s "
                                       f"(declared {rec['declared_s']:.2f}s, probe {rec['probe_s']:.2f}s, "
                                       f"load {rec['loadavg'][0]:.1f})")
                    prog.advance(task)
                if owned:
                    bed.down()
                    bed = None
        poll_ms = poll_scaling() if a.poll_scaling else None
        shutil.rmtree(work, ignore_errors=True)  # kept when a run failed: its error names files in it
    finally:
        if bed is not None and not a.testbed_dir:
            bed.down()
        shutil.rmtree(temp_root, ignore_errors=True)
    report = build_report(a, runs, B.finish(env0), poll_ms, sym, warm)
    return B.publish(con, report, a.json, show)


if __name__ == "__main__":
    sys.exit(report_errors(main))
