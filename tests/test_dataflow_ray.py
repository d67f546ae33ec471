"""The dataflow runtime on a simulated Ray cluster: 2 nodes x 4 fake GPUs
(``ray.cluster_utils.Cluster``; the GPUs are fake: Ray only hands out GPU ids
and sets CUDA_VISIBLE_DEVICES). Placement is checked from what each actor
reports about itself, never from the plan alone.
"""
from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from hpc_verl import DataflowGraph, Edge, HybridScheduler, Node
from hpc_verl.testbed.dataflow_examples import RolloutSim, Stage, ppo_example_graph
from hpc_verl.errors import DataflowError

ray = pytest.importorskip("ray")
# node functions defined in this module travel to the workers by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    from hpc_verl.testbed.simcluster import start_sim_cluster, stop_sim_cluster

    c = start_sim_cluster([(2, 4), (2, 4)])
    try:
        yield c
    finally:
        stop_sim_cluster(c)


def _alive_actor_ids() -> set[str]:
    from ray.util.state import list_actors

    return {a.actor_id for a in list_actors(filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)}


def test_ppo_graph_places_as_planned_runs_iterations_and_shows_on_dashboard(cluster, cli):
    graph = ppo_example_graph("ppo_sim")
    sched = HybridScheduler(graph, stats_interval_s=0.2)
    try:
        sched.start()
        status = sched.get_status()
        workers = {w["id"]: w for n in status["nodes"].values() for w in n["workers"]}
        assert len(workers) == 10
        # co-located: rollout_i and reward_i report the same Ray node; reward shares the bundle's GPUs
        for i in range(4):
            r, s = workers[f"actor_rollout_{i}"], workers[f"reward_score_{i}"]
            assert r["ray_node_id"] == s["ray_node_id"] and r["bundle"] == s["bundle"]
            assert len(r["gpu_ids"]) == 1 and len(s["gpu_ids"]) == 1
        # staged: two stages, one per Ray node, distinct CUDA_VISIBLE_DEVICES inside each
        stages: dict[int, list] = {}
        for i in range(4):
            w = workers[f"actor_rollout_{i}"]
            stages.setdefault(w["stage"], []).append(w)
        assert sorted(stages) == [0, 1]
        assert len({ws[0]["ray_node_id"] for ws in stages.values()}) == 2
        for ws in stages.values():
            assert len({w["ray_node_id"] for w in ws}) == 1
            assert len({w["cuda_visible_devices"] for w in ws}) == len(ws)
        # no fake GPU handed to two whole-GPU instances
        whole = [(w["ray_node_id"], g) for w in workers.values() if not w["id"].startswith("reward")
                 for g in w["gpu_ids"]]
        assert len(whole) == len(set(whole)) == 6
        assert any(line.startswith("Scheduling decision: co-located actor_rollout_0 and reward_score_0 on node")
                   for line in status["decisions"])

        # PPO iterations: the critic publishes policy v(it+1) over the strong control edge;
        # every rollout of iteration it must have used exactly v(it). The item that publishes runs
        # alone, after the others: a version published mid-run may reach a rollout whose item is
        # still queued (strong = never older than the last published, docs/dataflow.md), and with
        # all four in one run the critic of item 3 can finish before the rollout of item 2 starts
        sched.send_control("updated_policy", {"policy_step": 0}, version=0)
        for it in range(3):
            batches = [{"prompts": [f"q{it}.{i}"], "iteration": it, "last": i == 3} for i in range(4)]
            out = sched.run({"actor_rollout": batches[:3]})["critic_train"]
            out += sched.run({"actor_rollout": batches[3:]})["critic_train"]
            assert [b["prompts"] for b in out] == [x["prompts"] for x in batches]
            assert {b["policy_version"] for b in out} == {it}
            assert {b["ctx_version"] for b in out} == {it}
            for b in out:  # the co-located edge never crossed nodes
                assert b["rollout"]["ray_node_id"] == b["reward"]["ray_node_id"]
        assert sched.call_all("actor_rollout", "get_version") == [3, 3, 3, 3]
        saved = sched.call_all("critic_train", "save_checkpoint", "/ckpt")   # in instance order, all 12 items
        assert [s.rsplit(":", 1)[0] for s in saved] == ["/ckpt/critic_train_0", "/ckpt/critic_train_1"]
        steps = [s.rsplit(":", 1)[1] for s in saved]
        assert sum(map(int, steps)) == 12 and min(map(int, steps)) > 0
        assert sched.call_each("critic_train", "save_checkpoint", [("/a",), ("/b",)]) == [
            f"/a/critic_train_0:{steps[0]}", f"/b/critic_train_1:{steps[1]}"]

        with pytest.warns(UserWarning):
            assert sched.disable_ulysses("reward_score") is False
        assert sched.disable_ulysses("critic_train") is True

        status = sched.get_status()
        json.dumps(status)
        assert status["items_in"] == status["items_out"] == 12
        edge = status["edges"]["actor_rollout->reward_score"]
        assert edge["items"] == 12 and edge["cross_node_items"] == 0 and edge["latency_ms_p95"] is not None
        assert status["edges"]["critic_train->actor_rollout"]["version"] == 3
        assert status["nodes"]["critic_train"]["ulysses"] is False

        # the monitor publishes every stats interval: poll the dashboard (bounded) until it shows
        # this graph whole, not after a fixed sleep (a loaded machine publishes later)
        address = cluster.address
        deadline = time.monotonic() + 60
        while True:
            res = cli("dashboard", "--address", address, "--once", "--json", timeout=120)
            assert res.returncode == 0, res.stderr
            snap = {g["graph"]: g for g in json.loads(res.stdout)["graphs"]}.get("ppo_sim")
            if (snap and set(snap["nodes"]) == set(graph.nodes) and set(snap["edges"]) == {e.key for e in graph.edges}
                    and all(len(snap["nodes"][n]["workers"]) == graph.nodes[n].parallelism for n in graph.nodes)):
                break
            assert time.monotonic() < deadline, f"the dashboard never showed graph ppo_sim whole: {res.stdout[:800]}"
            time.sleep(0.2)
        assert any(row["memory"] == "n/a" for row in snap["gpus"].values())
        # the standalone verl-scheduler-dashboard (installed console script when
        # present, else the same main via -m) sees the same graph
        import os
        import subprocess
        from pathlib import Path

        script = Path(sys.executable).parent / "verl-scheduler-dashboard"
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "hpc_verl.ops.dashboard"]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        res = subprocess.run([*cmd, "--address", address, "--once", "--json"], capture_output=True, text=True,
                             env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        snap = {g["graph"]: g for g in json.loads(res.stdout)["graphs"]}["ppo_sim"]
        assert set(snap["nodes"]) == set(graph.nodes) and set(snap["edges"]) == {e.key for e in graph.edges}
        # the rich view renders too (one frame)
        res = cli("dashboard", "--address", address, "--once", "--graph", "ppo_sim", timeout=120,
                  env={"COLUMNS": "200"})
        assert res.returncode == 0 and "actor_rollout->reward_score" in res.stdout, res.stderr
    finally:
        sched.shutdown()
    # shutdown killed exactly this graph's actors and placement groups
    pgs = [p for p in ray.util.placement_group_table().values() if p["name"].startswith("ppo_sim.")]
    assert all(p["state"] == "REMOVED" for p in pgs)
    with pytest.raises(ValueError):
        ray.get_actor("hpc_verl.dataflow/ppo_sim", namespace="hpc_verl")


def test_backpressure_adds_consumers_with_bounded_queue_and_no_loss(cluster):
    graph = DataflowGraph("bp")
    with graph:
        prod = Node("producer", Stage, init_kwargs={"delay_s": 0.01})
        cons = Node("consumer", Stage, init_kwargs={"delay_s": 0.04}, max_parallelism=4)  # 4x slower
        Edge(prod, cons, capacity=16)  # threshold: 3/4 of capacity = 12
    sched = HybridScheduler(graph, backpressure_window_s=0.4, monitor_interval_s=0.05)
    items = [{"id": i} for i in range(200)]
    try:
        sched.start()
        out = sched.run(items, micro_batch=1)["consumer"]
        status = sched.get_status()
    finally:
        sched.shutdown()
    assert [o["id"] for o in out] == list(range(200))  # every item once, in order
    edge = status["edges"]["producer->consumer"]
    assert edge["threshold"] == 12
    assert 12 < edge["peak_queue_length"] < 1.5 * 12
    assert status["nodes"]["consumer"]["parallelism"] > 1
    assert any("backpressure" in d and "raised consumer parallelism" in d for d in status["decisions"])
    assert len({o["trail"][1]["instance"] for o in out}) > 1  # the added consumers did take items
    assert status["items_in"] == status["items_out"] == 200
    assert status["nodes"]["consumer"]["processed"] == 200


def test_backpressure_lowers_the_producer_when_the_consumer_cannot_grow(cluster):
    graph = DataflowGraph("bp_down")
    with graph:
        prod = Node("producer", Stage, init_kwargs={"delay_s": 0.01}, parallelism=2)
        cons = Node("consumer", Stage, init_kwargs={"delay_s": 0.03}, max_parallelism=1)
        Edge(prod, cons, capacity=12)
    sched = HybridScheduler(graph, backpressure_window_s=0.3, monitor_interval_s=0.05)
    try:
        sched.start()
        out = sched.run([{"id": i} for i in range(80)], micro_batch=1)["consumer"]
        status = sched.get_status()
    finally:
        sched.shutdown()
    assert [o["id"] for o in out] == list(range(80))
    assert status["nodes"]["producer"]["parallelism"] == 1
    assert any("lowered producer parallelism 2 -> 1 (backpressure" in d for d in status["decisions"])
    assert status["nodes"]["producer"]["processed"] == 80


def test_live_scale_up_and_down_loses_nothing(cluster):
    graph = DataflowGraph("scale")
    with graph:
        a = Node("a", Stage, init_kwargs={"delay_s": 0.005})
        b = Node("b", Stage, init_kwargs={"delay_s": 0.02}, parallelism=2, resources={"GPU": 1})
        Edge(a, b, capacity=32)
    sched = HybridScheduler(graph, backpressure=False)
    result: dict = {}
    try:
        sched.start()
        before = set(sched.instances("b"))

        def work() -> None:
            result["out"] = sched.run([{"id": i} for i in range(300)], micro_batch=1)["b"]

        t = threading.Thread(target=work)
        t.start()
        time.sleep(0.5)
        assert sched.adjust_parallelism("b", 4, reason="test: scale up") == 4
        time.sleep(0.5)
        up = sched.get_status()["nodes"]["b"]["workers"]
        gpus = [(w["ray_node_id"], g) for w in up for g in w["gpu_ids"]]
        assert len(gpus) == len(set(gpus)) == 4
        assert sched.adjust_parallelism("b", 1, reason="test: scale down") == 1
        t.join(timeout=120)
        assert not t.is_alive()
        status = sched.get_status()
        with pytest.raises(DataflowError, match="must be an int >= 1"):
            sched.adjust_parallelism("b", 0, "bad")
    finally:
        sched.shutdown()
    out = result["out"]
    assert [o["id"] for o in out] == list(range(300))
    used = {o["trail"][1]["instance"] for o in out}
    assert used - before, "the instances added live never received items"
    assert status["nodes"]["b"]["parallelism"] == 1 and len(status["nodes"]["b"]["workers"]) == 1
    assert status["nodes"]["b"]["processed"] == 300
    assert any("raised b parallelism 2 -> 4 (test: scale up)" in d for d in status["decisions"])
    assert any("lowered b parallelism 4 -> 1 (test: scale down)" in d for d in status["decisions"])


def _trainer(batch):
    return batch


def test_strong_consistency_rejects_stale_versions_under_delays(cluster):
    graph = DataflowGraph("consistency")
    with graph:
        rollout = Node("rollout", RolloutSim, parallelism=2)
        trainer = Node("trainer", _trainer)
        Edge(rollout, trainer, data_type="rollout_batch")
        Edge(trainer, rollout, data_type="updated_policy", control=True, consistency="strong")
    sched = HybridScheduler(graph, stats_interval_s=0.2)
    try:
        sched.start()
        # v1 is delayed in delivery (injected), v2 overtakes it; then items are submitted
        t_sent = time.monotonic()
        sched.send_control("updated_policy", {"w": 1}, version=1, _delay_s=4.0)
        sched.send_control("updated_policy", {"w": 2}, version=2)
        out = sched.run([{"prompts": [i]} for i in range(6)], micro_batch=1)["trainer"]
        assert {o["policy_version"] for o in out} == {2}
        assert {o["ctx_version"] for o in out} == {2}
        assert time.monotonic() - t_sent < 4.0, "too slow to order the delayed v1 after v2; rerun on a quieter host"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the delayed v1 arrives after ~4 s and must be rejected as stale
            status = sched.get_status()
            if status["edges"]["trainer->rollout"]["stale_rejected"] >= 2:
                break
            time.sleep(0.2)
        assert sched.call_all("rollout", "get_version") == [2, 2]
        assert status["edges"]["trainer->rollout"]["stale_rejected"] == 2
        assert sum("rejected stale control v1 on trainer->rollout (holds v2)" in d for d in status["decisions"]) == 2
        # a delayed broadcast cannot make an item run stale: v3 is slow to arrive,
        # yet items submitted after it carry v3 and the instances catch up themselves
        sched.send_control("updated_policy", {"w": 3}, version=3, _delay_s=1.0)
        out = sched.run([{"prompts": [i]} for i in range(4)], micro_batch=1)["trainer"]
        assert {o["policy_version"] for o in out} == {3}
        with pytest.raises(DataflowError, match="not newer"):
            sched.send_control("updated_policy", {"w": 0}, version=3)
        # a scaled-up instance starts from the latest version before its first item
        sched.adjust_parallelism("rollout", 3, "test")
        assert sched.call_all("rollout", "get_version") == [3, 3, 3]
    finally:
        sched.shutdown()


def test_service_node_publishes_policy_through_call_all(cluster, tmp_path):
    from hpc_verl.testbed.dataflow_examples import PolicyUpdater

    graph = DataflowGraph("service")
    with graph:
        rollout = Node("rollout", RolloutSim, parallelism=2)
        reward = Node("reward", _trainer)
        updater = Node("actor_update", PolicyUpdater)
        Edge(rollout, reward, co_locate=True)
        Edge(updater, rollout, data_type="policy", control=True, consistency="strong")
    assert graph.sources() == ["rollout"] and graph.sinks() == ["reward"]
    assert graph.services() == ["actor_update"]
    status_file = tmp_path / "run" / "dataflow_status.json"
    sched = HybridScheduler(graph, backpressure=False, status_file=str(status_file), stats_interval_s=0.2)
    try:
        sched.start()
        for step in range(1, 4):
            out = sched.run({"rollout": [{"prompts": [i]} for i in range(4)]}, sinks_only=False)
            assert set(out) == {"rollout", "reward"}
            assert sched.call_all("actor_update", "update", out["reward"]) == [step]
            out = sched.run([{"prompts": [0]}, {"prompts": [1]}])["reward"]
            assert {o["policy_version"] for o in out} == {step}
        assert sched.get_status()["edges"]["actor_update->rollout"]["version"] == 3
        time.sleep(0.5)  # the monitor rewrites the status file (atomically) as it goes
        on_disk = json.loads(status_file.read_text())
        assert on_disk["graph"] == "service" and on_disk["edges"]["actor_update->rollout"]["version"] == 3
    finally:
        sched.shutdown()


def test_handler_error_is_one_clear_line(cluster):
    def boom(item):
        raise ValueError(f"bad item {item}")

    graph = DataflowGraph("errors")
    with graph:
        Node("explode", boom)
    sched = HybridScheduler(graph, backpressure=False)
    try:
        sched.start()
        with pytest.raises(DataflowError, match=r"a node failed in explode_0: ValueError: bad item 1"):
            sched.run([1])
        with pytest.raises(DataflowError, match="already running"):
            HybridScheduler(graph, backpressure=False).start()
    finally:
        sched.shutdown()

    class BadInit:
        def __init__(self):
            raise RuntimeError("no model at /nowhere")

        def process(self, item):
            return item

    bad = DataflowGraph("bad_init")
    bad.add(Node("rollout", BadInit))
    sched = HybridScheduler(bad, backpressure=False)
    with pytest.raises(DataflowError, match=r"rollout_0 failed to start: .*no model at /nowhere"):
        sched.start()
    assert not sched.pool.instances["rollout"] and not sched.pool.procs and not sched.pool._pgs  # cleaned up


class _Preloading:
    """Records, in its process, whether ``preload`` ran before the object was built."""

    preloaded = False

    @staticmethod
    def preload() -> None:
        _Preloading.preloaded = True

    def __init__(self, value: int) -> None:
        self.value = value
        self.saw_preload = _Preloading.preloaded

    def process(self, item: int) -> tuple:
        return item, self.value, self.saw_preload


def test_spawn_then_set_init_args_then_start_builds_with_the_late_arguments(cluster):
    """spawn() creates the processes (their preload runs there at once) before the caller knows an
    init argument; start() builds the objects with the value set in between, and runs."""
    g = DataflowGraph("late_init")
    with g:
        Node("late", _Preloading, init_args=(0,), resources={"CPU": 0.1})
    sched = HybridScheduler(g)
    try:
        sched.spawn()
        assert not sched.started
        sched.set_init_args("late", 42)
        sched.start()
        assert sched.run([1, 2])["late"] == [(1, 42, True), (2, 42, True)]
        with pytest.raises(DataflowError, match="already started"):
            sched.set_init_args("late", 7)
        with pytest.raises(DataflowError, match="no node 'lat'"):
            HybridScheduler(g).set_init_args("lat", 1)
    finally:
        sched.shutdown()


def test_an_envelope_of_plain_items_travels_without_pickle(cluster):
    """Every hop's envelope is packed by Ray's msgpack, not cloudpickle: a tuple envelope cost
    ~40 us of pickling per actor call (what made ours slower than hand-written Ray)."""
    from ray._private.ray_constants import OBJECT_METADATA_TYPE_PYTHON

    graph = DataflowGraph("envelopes")
    with graph:
        a = Node("first", _double)
        b = Node("second", _double)
        Edge(a, b)
    sched = HybridScheduler(graph, backpressure=False)
    try:
        sched.start()
        assert sched.run([1, 2, 3], micro_batch=3) == {"second": [4, 8, 12]}
        env = ray.get(sched.pool.routable["first"][0].handle.run_sole.remote([5, 6]))
        assert env[1] == [10, 12] and env[2] is None
        packed = ray._private.worker.global_worker.get_serialization_context().serialize(env)
        assert packed.metadata != OBJECT_METADATA_TYPE_PYTHON, "the envelope fell back to pickle"
    finally:
        sched.shutdown()


def _double(item: int) -> int:
    return 2 * item
