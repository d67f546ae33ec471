#!/usr/bin/env python
"""Dataflow overhead: a 3-stage pipeline of trivial work, run through
hpc_verl's dataflow and hand-written with plain Ray actors + ``ray.get`` on
chained calls, in the same run and on the same local Ray instance.

Prints per-item time and throughput of both, the ratio ours/hand (target
<= 1.15), and throughput as parallelism grows 1 -> 2 -> 4. Rounds alternate
between the two so background load hits both alike; medians are reported.

    PYTHONPATH=. python benchmarks/dataflow_overhead.py [--items 2000] [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def hand_written(stages: list[list], items: list) -> float:
    """Chained actor calls, round-robin over each stage's actors; seconds."""
    import ray

    t0 = time.perf_counter()
    refs = []
    for i, x in enumerate(items):
        ref = x
        for actors in stages:
            ref = actors[i % len(actors)].f.remote(ref)
        refs.append(ref)
    ray.get(refs)
    return time.perf_counter() - t0


def ours(sched, items: list, micro_batch) -> float:
    t0 = time.perf_counter()
    out = sched.run(items, micro_batch=micro_batch)
    dt = time.perf_counter() - t0
    assert out["stage_c"] == items, "dataflow lost or reordered items"
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-cpus", type=int, default=4)
    ap.add_argument("--parallelism", default="1,2,4")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    import ray

    from hpc_verl.dataflow import HybridScheduler
    from hpc_verl.dataflow.examples import three_stage_graph

    @ray.remote(num_cpus=0)
    class Plain:
        def f(self, x):
            return x

    from hpc_verl.dataflow.simcluster import start_sim_cluster, stop_sim_cluster

    cluster = start_sim_cluster([(args.num_cpus, 0)])
    items = list(range(args.items))
    results: dict = {"items": args.items, "rounds": args.rounds, "parallelism": {}}
    try:
        for p in [int(x) for x in args.parallelism.split(",")]:
            stages = [[Plain.remote() for _ in range(p)] for _ in range(3)]
            ray.get([a.f.remote(0) for s in stages for a in s])
            sched = HybridScheduler(three_stage_graph(f"bench_p{p}", parallelism=p)).start()
            hand_written(stages, items[:200])
            ours(sched, items[:200], 1)
            t_hand, t_ours1, t_auto = [], [], []
            for _ in range(args.rounds):
                t_hand.append(hand_written(stages, items))
                t_ours1.append(ours(sched, items, 1))
                t_auto.append(ours(sched, items, "auto"))
            sched.shutdown()
            for s in stages:
                for a in s:
                    ray.kill(a)
            n = args.items
            med = {k: statistics.median(v) for k, v in
                   {"hand": t_hand, "ours_unbatched": t_ours1, "ours_auto": t_auto}.items()}
            # per-round ratios (same background load), then their median
            r1 = statistics.median(o / h for o, h in zip(t_ours1, t_hand))
            ra = statistics.median(o / h for o, h in zip(t_auto, t_hand))
            results["parallelism"][p] = {
                "per_item_us": {k: round(v / n * 1e6, 1) for k, v in med.items()},
                "items_per_s": {k: round(n / v, 1) for k, v in med.items()},
                "overhead_per_item_us": {"ours_unbatched": round((med["ours_unbatched"] - med["hand"]) / n * 1e6, 1),
                                         "ours_auto": round((med["ours_auto"] - med["hand"]) / n * 1e6, 1)},
                "ratio_ours_over_hand": {"ours_unbatched": round(r1, 3), "ours_auto": round(ra, 3)},
            }
    finally:
        stop_sim_cluster(cluster)

    print(f"3-stage trivial pipeline, {args.items} items, median of {args.rounds} alternating rounds")
    print(f"{'par':>3} {'hand us/item':>13} {'ours(mb=1)':>11} {'ours(auto)':>11} {'hand it/s':>10} "
          f"{'ours(mb=1) it/s':>16} {'ours(auto) it/s':>16} {'ratio mb=1':>10} {'ratio auto':>10}")
    for p, r in results["parallelism"].items():
        u, s, q = r["per_item_us"], r["items_per_s"], r["ratio_ours_over_hand"]
        print(f"{p:>3} {u['hand']:>13} {u['ours_unbatched']:>11} {u['ours_auto']:>11} {s['hand']:>10} "
              f"{s['ours_unbatched']:>16} {s['ours_auto']:>16} {q['ours_unbatched']:>10} {q['ours_auto']:>10}")
    first = results["parallelism"][next(iter(results["parallelism"]))]["ratio_ours_over_hand"]
    print(f"target ratio ours/hand <= 1.15: unbatched {first['ours_unbatched']} "
          f"({'met' if first['ours_unbatched'] <= 1.15 else 'NOT met'}), "
          f"auto micro-batching {first['ours_auto']} ({'met' if first['ours_auto'] <= 1.15 else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
