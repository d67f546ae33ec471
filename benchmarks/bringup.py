"""Ray bring-up time on the SLURM test bed: our bootstrap vs a sleep-based script.

Measures, in the same run and on the same two-node test bed, the time from the
batch script's first line to "Ray ready" for
  * ours: the rendered script (job-derived ports, token, parallel workers that
    join the moment the head registers, bounded barrier polling the GCS every 0.25 s), and
  * baseline: the style of verl's public SLURM example: start the head, `sleep 10`,
    then start each worker followed by `sleep 5`, then declare Ray ready.
Prints both medians and the ratio ours/baseline (target <= 0.5).

Why the barrier does not grow with node count: all workers start at once in one
`srun` step (not one after another), and each barrier poll is a single
GetAllNodeInfo RPC to the GCS plus a stat of a few local files; the script
waits for max(worker start), not the sum. A sleep-based script costs
10 + 5 * (N - 1) seconds whatever the nodes do. `--poll-scaling` measures the
barrier poll itself against Ray clusters of 1, 2 and 4 nodes (ray.cluster_utils)
to show it stays flat.

Usage: python benchmarks/bringup.py [--runs 5] [--testbed-dir DIR] [--poll-scaling]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BASELINE = r"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --gpus-per-node=4
#SBATCH --output={out}
# verl public example style: fixed sleeps instead of a readiness check
T0=$(date +%s.%N)
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
PY={py}
P=$((30000 + (SLURM_JOB_ID % 50) * 100))
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head=${{nodes[0]}}
ip=$("$PY" -c 'from hpc_verl.bootstrap.netif import select_ip; print(select_ip(None, True))')
srun --overlap --nodes=1 --ntasks=1 -w "$head" "$PY" -m ray.scripts.scripts start --head --block \
  --node-ip-address="$ip" --port=$P --num-cpus=1 --num-gpus=4 --include-dashboard=false --dashboard-port=$((P+1)) \
  --ray-client-server-port=$((P+2)) --node-manager-port=$((P+3)) --object-manager-port=$((P+4)) \
  --dashboard-agent-listen-port=$((P+5)) --dashboard-agent-grpc-port=$((P+6)) --runtime-env-agent-port=$((P+7)) \
  --metrics-export-port=$((P+8)) --min-worker-port=$((P+10)) --max-worker-port=$((P+40)) \
  --temp-dir={tmp}/b$SLURM_JOB_ID-0 --disable-usage-stats >/dev/null 2>&1 &
pids=($!)
sleep 10
i=1
for n in "${{nodes[@]:1}}"; do
  Q=$((P + 50 * i))
  srun --overlap --nodes=1 --ntasks=1 -w "$n" "$PY" -m ray.scripts.scripts start --block --address="$ip:$P" \
    --node-ip-address="$ip" --num-cpus=1 --num-gpus=4 --node-manager-port=$((Q)) --object-manager-port=$((Q+1)) \
    --dashboard-agent-listen-port=$((Q+2)) --dashboard-agent-grpc-port=$((Q+3)) --runtime-env-agent-port=$((Q+4)) \
    --metrics-export-port=$((Q+5)) --min-worker-port=$((Q+10)) --max-worker-port=$((Q+40)) \
    --temp-dir={tmp}/b$SLURM_JOB_ID-$i --disable-usage-stats >/dev/null 2>&1 &
  pids+=($!)
  sleep 5
  i=$((i + 1))
done
echo "BASELINE_READY $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{{printf "%.2f", b-a}}')"
"$PY" -c 'import ray; ray.init(address="'"$ip:$P"'", logging_level="ERROR"); print("ALIVE", sum(n["Alive"] for n in ray.nodes()))'
kill -TERM "${{pids[@]}}" 2>/dev/null; wait
"""


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


def run_ours(env: dict, cfg: str) -> float:
    proc = subprocess.run([sys.executable, "-m", "hpc_verl", "submit", "--profile", "testbed-local", "--config", cfg],
                          env=env, capture_output=True, text=True, check=True)
    job_id = int(re.search(r"submitted job (\d+)", proc.stdout).group(1))
    run_dir = re.search(r"run directory: (\S+)", proc.stdout).group(1)
    state = _wait_done(env, job_id)
    log = Path(run_dir + ".out").read_text()
    m = re.search(r"Ray ready ([\d.]+)s after the batch script started", log)
    if state != "COMPLETED" or not m:
        raise SystemExit(f"ours: job {job_id} {state}; log:\n{log[-2000:]}")
    return float(m.group(1))


def run_baseline(env: dict, work: Path, temp_root: str, i: int) -> tuple[float, int]:
    """Its claimed ready time, and how many nodes were really alive at that moment."""
    out = work / f"baseline-{i}.out"
    script = work / f"baseline-{i}.sbatch"
    script.write_text(BASELINE.format(out=out, py=sys.executable, tmp=temp_root))
    from hpc_verl.launch.backends import slurm

    job_id = slurm.sbatch(str(script), env=env)
    state = _wait_done(env, job_id)
    text = out.read_text() if out.exists() else ""
    m = re.search(r"BASELINE_READY ([\d.]+)", text)
    alive = re.search(r"ALIVE (\d+)", text)
    if state != "COMPLETED" or not m or not alive:
        raise SystemExit(f"baseline: job {job_id} {state}; output:\n{text[-2000:]}")
    return float(m.group(1)), int(alive.group(1))


def poll_scaling() -> dict[int, float]:
    """Median time of one barrier poll (GCS node query) on Ray clusters of 1, 2 and 4 nodes."""
    import ray
    from ray.cluster_utils import Cluster

    from hpc_verl.bootstrap.barrier import gcs_view

    os.environ["RAY_AUTH_MODE"] = "disabled"
    out = {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 1,
                                                            "include_dashboard": False})
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
            out[n] = statistics.median(times) * 1000
    finally:
        cluster.shutdown()
        ray.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--testbed-dir", default=None, help="reuse a running test bed (scripts/testbed.sh up)")
    ap.add_argument("--poll-scaling", action="store_true")
    args = ap.parse_args()
    from hpc_verl.testbed import TestBed
    from hpc_verl.testbed.profiles import write_profiles

    work = Path(tempfile.mkdtemp(prefix="hpcv-bench-"))
    temp_root = tempfile.mkdtemp(prefix="hpcvb", dir="/tmp")
    bed = TestBed(args.testbed_dir or work / "testbed")
    owned = not bed.is_up()
    bed.up()
    try:
        prof = write_profiles(work / "profiles", sys.executable, temp_root=temp_root)
        env = {**os.environ, **bed.env(), "HPC_VERL_HOME": str(work / "home"), "HPC_VERL_PROFILE_PATH": str(prof),
               "PYTHONPATH": str(REPO)}
        cfg = work / "job.yaml"
        cfg.write_text("name: bench\ntrainer:\n  module: hpc_verl.bootstrap.workload\n  args: [--steps, '0']\n"
                       "  derive_overrides: false\n")
        from rich.console import Console
        from rich.progress import Progress
        from rich.table import Table

        console = Console()
        table = Table(title="batch script start -> Ray ready, 2-node test bed")
        for col in ("run", "ours (s)", "sleep-based (s)", "ratio", "nodes up at sleep-based 'ready'"):
            table.add_column(col, justify="right")
        ours, base, early = [], [], 0
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("bring-up runs (ours, then sleep-based)", total=2 * args.runs)
            for i in range(args.runs):  # interleaved, so machine load hits both alike
                ours.append(run_ours(env, str(cfg)))
                progress.advance(task)
                t, alive = run_baseline(env, work, temp_root, i)
                progress.advance(task)
                base.append(t)
                early += alive < 2
                note = "" if alive >= 2 else f" (declared ready, but only {alive}/2 nodes alive right after)"
                progress.console.print(f"run {i + 1}: ours {ours[-1]:.2f}s  sleep-based {base[-1]:.2f}s{note}")
                table.add_row(str(i + 1), f"{ours[-1]:.2f}", f"{t:.2f}", f"{ours[-1] / t:.2f}", f"{alive}/2")
        mo, mb = statistics.median(ours), statistics.median(base)
        table.add_row("median", f"{mo:.2f}", f"{mb:.2f}", f"{mo / mb:.2f}", "", style="bold")
        console.print(table)
        print(json.dumps({"ours_median_s": round(mo, 2), "sleep_based_median_s": round(mb, 2),
                          "ratio": round(mo / mb, 3), "runs": args.runs, "ours": ours, "sleep_based": base,
                          "sleep_based_ready_too_early": early}))
        print(f"bring-up (batch start -> Ray ready, 2 nodes): ours {mo:.2f}s, sleep-based {mb:.2f}s, "
              f"ratio {mo / mb:.2f} (target <= 0.5)")
        if early:
            print(f"the sleep-based script declared Ray ready before all nodes had joined in {early} of "
                  f"{args.runs} runs (ours waits for every node and GPU)")
        if args.poll_scaling:
            scaling = poll_scaling()
            print("barrier poll (one GCS query) median by node count: "
                  + ", ".join(f"{n} nodes {ms:.1f} ms" for n, ms in scaling.items()))
    finally:
        if owned:
            bed.down()
        import shutil

        shutil.rmtree(temp_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)  # job dirs and profiles (a reused test bed lives elsewhere)
    return 0


if __name__ == "__main__":
    sys.exit(main())
