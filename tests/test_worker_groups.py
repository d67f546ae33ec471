"""Worker groups in the dataflow runtime: splitting items over ranks and gathering them back,
SPMD nodes as one torch.distributed group (gloo, real processes), tensors moved inside the
process or by a bucketed broadcast, live group resizes that carry state, and a dead rank that
ends the step with one line instead of a hang. Ray runs as a simulated two-node cluster
(``ray.cluster_utils``); placement is checked from what each actor reports about itself.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from hpc_verl.dataflow import ClusterNode, DataflowGraph, Edge, HybridScheduler, Node, WorkerGroup, make_plan
from hpc_verl.dataflow.placement import place_group
from hpc_verl.dataflow import spmd
from hpc_verl.errors import DataflowError

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---- pure: splitting, gathering, placement ----------------------------------------------------
def test_split_bounds_keep_groups_together_and_balance_rows():
    item = {"uid": ["a", "a", "b", "b", "b", "c", "d", "d"], "x": list(range(8)), "step": 3}
    assert spmd.split_bounds(item, 2) == [(0, 4), (4, 8)]
    assert spmd.split_bounds(item, 2, "uid") == [(0, 5), (5, 8)]   # the group boundary nearest the middle
    assert spmd.split_bounds(item, 3, "uid") == [(0, 2), (2, 5), (5, 8)]
    shards = [spmd.take_rows(item, a, z) for a, z in spmd.split_bounds(item, 3, "uid")]
    assert all(s["step"] == 3 for s in shards)
    assert spmd.concat(shards) == item
    with pytest.raises(DataflowError, match="not adjacent"):
        spmd.split_bounds({"uid": ["a", "b", "a"]}, 2, "uid")
    with pytest.raises(DataflowError, match="no field 'gid'"):
        spmd.split_bounds(item, 2, "gid")


def test_concat_gathers_tensors_and_lists_and_refuses_differing_values():
    a = {"t": torch.ones(2, 3), "l": [1, 2], "v": 7, "per_shard": [0.5]}
    b = {"t": torch.zeros(1, 3), "l": [3], "v": 7, "per_shard": [0.25]}
    out = spmd.concat([a, b])
    assert out["t"].shape == (3, 3) and out["l"] == [1, 2, 3] and out["v"] == 7 and out["per_shard"] == [0.5, 0.25]
    with pytest.raises(DataflowError, match=r"item\.v differs between shards"):
        spmd.concat([a, dict(b, v=8)])


def _hybrid_graph(name: str, world: int, per_node: int | None = None, hosted: bool = False,
                  resources: dict | None = None) -> DataflowGraph:
    g = DataflowGraph(name)
    wg = WorkerGroup("hybrid", world, resources or {"GPU": 1}, ranks_per_node=per_node)
    with g:
        r = Node("rollout", Rollout, group=wg, dispatch="split", split_key="uid")
        t = Node("train", Trainer, group=wg)
        s = Node("score", Scorer, host=wg) if hosted else Node("score", score)
        Edge(r, s, co_locate=True)
        Edge(r, t)
        Edge(s, t)
        Edge(t, r, control=True, consistency="strong", data_type="policy")
    return g


def test_group_placement_one_process_per_rank_filled_in_rank_order():
    cluster = [ClusterNode(f"id{i}", f"n{i}", {"CPU": 8.0, "GPU": 4.0}) for i in range(3)]
    plan = make_plan(_hybrid_graph("p", 6, per_node=2), cluster)
    groups = plan.groups()
    assert groups["hybrid"]["world_size"] == 6 and groups["hybrid"]["nodes"] == ["rollout", "train"]
    # ranks_per_node=2: ranks 0-1 on n0, 2-3 on n1, 4-5 on n2 (though n0 has room for 4)
    assert [r["ray_node"] for r in groups["hybrid"]["ranks"]] == ["n0", "n0", "n1", "n1", "n2", "n2"]
    procs = plan.processes()
    assert len([k for k in procs if k.startswith("hybrid_")]) == 6
    assert {i.node for i in procs["hybrid_3"]} == {"rollout", "train"}   # one process hosts both
    assert plan.instances["score_0"].bundle == plan.instances["rollout_0"].bundle   # co-located with rank 0
    text = str(plan)
    assert "worker group hybrid: world size 6" in text and "ranks 0-1 on n0; ranks 2-3 on n1" in text
    with pytest.raises(DataflowError, match="rank 4 of worker group 'hybrid'.*at most 2 rank"):
        make_plan(_hybrid_graph("p2", 6, per_node=2), cluster[:2])


def test_a_hosted_node_has_one_instance_in_rank_0s_process_also_after_a_resize():
    cluster = [ClusterNode(f"id{i}", f"n{i}", {"CPU": 8.0, "GPU": 4.0}) for i in range(3)]
    graph = _hybrid_graph("h", 4, per_node=2, hosted=True)
    plan = make_plan(graph, cluster)
    assert plan.instances["score_0"].process == "hybrid_0" and "score_1" not in plan.instances
    assert plan.instances["score_0"].bundle == plan.instances["rollout_0"].bundle
    assert sorted(plan.processes()) == [f"hybrid_{r}" for r in range(4)]          # no process of its own
    assert {i.node for i in plan.processes()["hybrid_0"]} == {"rollout", "train", "score"}
    assert len(plan.bundles) == 4 and plan.bundles[0].resources == {"GPU": 1.0, "CPU": 0.01}  # on rank 0's resources
    text = str(plan)
    assert "score_0 runs in worker group hybrid's rank 0 process" in text and "b0 (in process hybrid_0)" in text
    resized = place_group(graph, "hybrid", 2, cluster, "hybrid.g2.r")
    assert sorted(resized.processes()) == ["hybrid_0", "hybrid_1"]
    assert {i.node for i in resized.processes()["hybrid_0"]} == {"rollout", "train", "score"}
    assert {i.node for i in resized.processes()["hybrid_1"]} == {"rollout", "train"}
    unhosted = make_plan(_hybrid_graph("u", 4, per_node=2), cluster)
    assert "score_0" in unhosted.processes()                                        # the default: its own


def test_group_and_dispatch_mistakes_are_one_line():
    wg = WorkerGroup("w", 2, {"CPU": 1})
    with pytest.raises(DataflowError, match="dispatch='splt'.*did you mean 'split'"):
        Node("a", Trainer, group=wg, dispatch="splt")
    with pytest.raises(DataflowError, match="come from its worker group"):
        Node("a", Trainer, group=wg, parallelism=3)
    with pytest.raises(DataflowError, match="needs a worker group with dist=True"):
        Node("a", Trainer, group=WorkerGroup("r", 2, dist=False), dispatch="spmd")
    with pytest.raises(DataflowError, match="world_size=0"):
        WorkerGroup("w", 0)
    g = DataflowGraph("dup")
    g.add(Node("a", Trainer, group=WorkerGroup("w", 2)))
    g.add(Node("b", Trainer, group=WorkerGroup("w", 2)))
    with pytest.raises(DataflowError, match="two different worker groups are named 'w'"):
        g.validate()
    with pytest.raises(DataflowError, match="has one instance in rank 0's process.*leave parallelism"):
        Node("s", score, host=wg, parallelism=2)
    with pytest.raises(DataflowError, match="host= takes a WorkerGroup, for a routed node"):
        Node("s", Trainer, group=wg, host=wg)
    g2 = DataflowGraph("stray_host")
    g2.add(Node("a", Trainer, group=WorkerGroup("w", 2)))
    g2.add(Node("s", score, host=WorkerGroup("elsewhere", 1)))
    with pytest.raises(DataflowError, match="hosted in worker group 'elsewhere', which hosts no node of this graph"):
        g2.validate()


# ---- node classes that run in the workers -----------------------------------------------------
class Trainer:
    """An SPMD rank: all-reduces, 'trains' (adds the batch sum to its weights), publishes TENSORS."""

    def __init__(self, delay_s: float = 0.0) -> None:
        torch.manual_seed(0)
        self.w = torch.nn.Linear(4, 3)
        self.version = 0
        self.delay_s = delay_s

    def process(self, joined: dict) -> dict:
        import torch.distributed as dist

        from hpc_verl.dataflow import TENSORS, current_context
        ctx = current_context()
        batch = joined["rollout"]
        if self.delay_s:
            time.sleep(self.delay_s)
        total = torch.tensor([float(len(batch["x"]))])
        dist.all_reduce(total)
        with torch.no_grad():
            self.w.weight.add_(float(torch.tensor(batch["x"]).sum()) / 100)
        self.version += 1
        ctx.emit_control(TENSORS, self.version)
        return {"rank": ctx.rank, "world": ctx.world_size, "all_rows": float(total), "scores": joined["score"]}

    def export_tensors(self, data_type: str):
        for n, p in self.w.named_parameters():
            yield n, p.detach()

    def save_checkpoint(self, path: str) -> None:
        from hpc_verl.dataflow import current_context
        if current_context().rank == 0:
            os.makedirs(path, exist_ok=True)
            torch.save({"w": self.w.state_dict(), "v": self.version}, os.path.join(path, "t.pt"))

    def load_checkpoint(self, path: str) -> None:
        state = torch.load(os.path.join(path, "t.pt"))
        self.w.load_state_dict(state["w"])
        self.version = state["v"]

    def weight_sum(self) -> float:
        return float(self.w.weight.double().sum())

    def pid(self) -> int:
        return os.getpid()


class Rollout:
    """A replica: reports which rows it got and the weights it holds."""

    def __init__(self, dtype: str | None = None) -> None:
        self.w = torch.nn.Linear(4, 3)
        self.version = 0
        self.dtype = dtype
        self.buckets = 0

    def process(self, shard: dict) -> dict:
        from hpc_verl.dataflow import current_context
        ctx = current_context()
        n = len(shard["x"])
        return {"x": shard["x"], "uid": shard["uid"], "replica": [ctx.index] * n, "version": [self.version] * n,
                "weight_sum": [float(self.w.weight.double().sum())] * n, "rows": [ctx.shard_rows] * n,
                "t": [time.time()] * n}

    def load_tensors(self, data_type: str, named, version: int) -> None:
        params = dict(self.w.named_parameters())
        for name, t in named:
            self.buckets += 1
            params[name].data.copy_(t)
        self.version = version

    def tensor_dtype(self, data_type: str) -> str | None:
        return self.dtype

    def seen(self) -> tuple[int, int]:
        return self.version, self.buckets


def score(batch: dict) -> dict:
    return {"n": len(batch["x"])}


class Scorer:
    """``score`` with state (calls so far) and the pid it runs in: a node hosted in rank 0."""

    def __init__(self) -> None:
        self.calls = 0

    def process(self, batch: dict) -> dict:
        self.calls += 1
        return {"n": len(batch["x"])}

    def pid(self) -> int:
        return os.getpid()

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]


def _batch(n_groups: int = 3, per: int = 2) -> dict:
    uid = [f"g{g}" for g in range(n_groups) for _ in range(per)]
    return {"x": [[float(i)] * 4 for i in range(len(uid))], "uid": uid}


@pytest.fixture(scope="module")
def cluster():
    from hpc_verl.testbed.simcluster import start_sim_cluster, stop_sim_cluster
    c = start_sim_cluster([(2, 2), (2, 2)])
    try:
        yield c
    finally:
        stop_sim_cluster(c)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hybrid_group_splits_items_runs_spmd_and_hands_weights_over_in_process(cluster):
    graph = _hybrid_graph("wg_hybrid", 2, per_node=1)
    sched = HybridScheduler(graph, backpressure=False, stats_interval_s=0.2)
    try:
        sched.start()
        for step in range(1, 3):
            out = sched.run({"rollout": [_batch()]}, sinks_only=False)
            t, r = out["train"][0], out["rollout"][0]
            # spmd: every rank gets the whole item (2 x 6 rows all-reduced); the result is rank 0's
            assert t["world"] == 2 and t["all_rows"] == 12 and t["rank"] == 0
            assert r["x"] == _batch()["x"] and r["uid"] == _batch()["uid"]     # gathered in input order
            assert r["replica"] in ([0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1])    # groups of 2 kept together
            assert set(r["version"]) == {step - 1}                               # the latest policy, always
            assert t["scores"] == {"n": 6}
        train_sums = sched.call_all("train", "weight_sum")
        assert train_sums[0] == train_sums[1]   # SPMD ranks stay identical
        # in-process hand-over: every replica holds the trainer's weights and version
        assert sched.call_all("rollout", "seen")[0][0] == 2
        out = sched.run({"rollout": [_batch()]}, sinks_only=False)
        assert out["rollout"][0]["weight_sum"] == pytest.approx([train_sums[0]] * 6, rel=1e-6)
        status = sched.get_status()
        nodes = status["nodes"]
        assert nodes["train"]["world_size"] == 2 and nodes["train"]["dispatch"] == "spmd"
        assert nodes["train"]["dist_backend"] == "gloo"
        workers = nodes["rollout"]["workers"]
        assert [w["rank"] for w in workers] == [0, 1] and all(w["rows"] > 0 for w in workers)
        assert sum(w["rows"] for w in workers) == 18 and workers[0]["process"] == "hybrid_0"
        assert len({w["ray_node_id"] for w in workers}) == 2        # ranks_per_node=1: one rank per node
        assert {w["pid"] for w in workers} == {w["pid"] for w in nodes["train"]["workers"]}   # shared processes
        transfer = status["edges"]["train->rollout"]["transfer"]
        assert transfer["mode"] == "in-process" and transfer["version"] == 3 and transfer["receivers"] == 2
    finally:
        sched.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_separate_groups_get_weights_by_bucketed_broadcast_in_their_dtype(cluster):
    graph = DataflowGraph("wg_separate")
    tg = WorkerGroup("train", 2, {"CPU": 0.5}, timeout_s=30)
    rg = WorkerGroup("roll", 2, {"CPU": 0.5}, dist=False)
    with graph:
        r = Node("rollout", Rollout, group=rg, dispatch="split", split_key="uid", init_kwargs={"dtype": "float16"})
        s = Node("score", score)
        t = Node("train", Trainer, group=tg)
        Edge(r, s)
        Edge(r, t)
        Edge(s, t)
        Edge(t, r, control=True, consistency="strong", data_type="policy")
    sched = HybridScheduler(graph, backpressure=False, bucket_bytes=16)   # several buckets per sync
    try:
        sched.start()
        for _ in range(2):
            out = sched.run({"rollout": [_batch()]}, sinks_only=False)
        expected = sched.call_all("train", "weight_sum")[0]
        got = sched.run({"rollout": [_batch()]}, sinks_only=False)["rollout"][0]
        assert set(got["version"]) == {2}
        # float16 on the wire, as the receivers asked: close to, not bit-equal with, the float32 source
        assert got["weight_sum"][0] == pytest.approx(expected, rel=1e-3)
        status = sched.get_status()
        transfer = status["edges"]["train->rollout"]["transfer"]
        assert transfer["mode"] == "broadcast" and transfer["bytes"] == (12 + 3) * 2 and transfer["receivers"] == 2
        assert any("sync group for train->rollout: train_0 broadcasts to roll_0, roll_1" in d
                   for d in status["decisions"])
        assert out["train"][0]["world"] == 2
    finally:
        sched.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resizing_a_group_carries_its_state_and_replicas_take_items(cluster):
    graph = _hybrid_graph("wg_resize", 2)
    graph.nodes["train"].max_parallelism = 2
    sched = HybridScheduler(graph, backpressure=False)
    try:
        sched.start()
        sched.run({"rollout": [_batch()]})
        before = sched.call_all("train", "weight_sum")[0]
        assert sched.adjust_parallelism("rollout", 1, "test: shrink") == 1   # the whole group: shared processes
        assert sched.instances("train") == ["train_0"] and sched.instances("rollout") == ["rollout_0"]
        assert sched.call_all("train", "weight_sum") == [before]          # state carried over
        assert sched.call_all("rollout", "seen")[0][0] == 1              # latest version re-delivered
        out = sched.run({"rollout": [_batch()]}, sinks_only=False)
        assert out["train"][0]["world"] == 1 and set(out["rollout"][0]["replica"]) == {0}
        assert sched.adjust_parallelism("train", 2, "test: grow") == 2
        out = sched.run({"rollout": [_batch()]}, sinks_only=False)
        assert out["train"][0]["world"] == 2 and set(out["rollout"][0]["replica"]) == {0, 1}   # the new rank works
        with pytest.raises(DataflowError, match="outside train's min/max parallelism 1..2; refused"):
            sched.adjust_parallelism("train", 3)
        decisions = sched.get_status()["decisions"]
        assert any("resized worker group hybrid (rollout, train) 2 -> 1 (test: shrink): new process group; "
                   "state of train carried over" in d for d in decisions)
    finally:
        sched.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_hosted_node_runs_in_rank_0_gives_the_same_results_and_keeps_its_state_over_a_resize(cluster):
    """Node(host=group): the same results as in a process of its own (the graph above), one process
    fewer, in rank 0's pid; a resize of the group carries its state (state_dict); it never scales."""
    graph = _hybrid_graph("wg_hosted", 2, hosted=True, resources={"CPU": 0.5})
    graph.nodes["train"].max_parallelism = 2
    sched = HybridScheduler(graph, backpressure=False)
    try:
        sched.start()
        for _ in range(2):
            out = sched.run({"rollout": [_batch()]}, sinks_only=False)
            assert out["train"][0]["scores"] == {"n": 6} and out["score"][0] == {"n": 6}
            assert out["train"][0]["world"] == 2 and out["train"][0]["all_rows"] == 12
        rank_pids = sched.call_all("train", "pid")
        assert sched.call_all("score", "pid") == [rank_pids[0]]
        assert sched.call_all("score", "state_dict") == [{"calls": 2}]
        assert sched.adjust_parallelism("train", 1, "test: shrink") == 1
        assert sched.instances("score") == ["score_0"]
        assert sched.call_all("score", "state_dict") == [{"calls": 2}]       # carried over
        assert sched.call_all("score", "pid") == sched.call_all("train", "pid")   # in the new rank 0
        out = sched.run({"rollout": [_batch()]}, sinks_only=False)
        assert out["train"][0]["scores"] == {"n": 6} and out["train"][0]["world"] == 1
        assert sched.call_all("score", "state_dict") == [{"calls": 3}]
        with pytest.raises(DataflowError, match="outside score's min/max parallelism 1..1; refused"):
            sched.adjust_parallelism("score", 2)
        assert any("score_0 runs in worker group hybrid's rank 0 process" in d
                   for d in sched.get_status()["decisions"])
    finally:
        sched.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_dead_rank_ends_the_step_with_one_line_and_no_hang(cluster):
    graph = DataflowGraph("wg_dead")
    wg = WorkerGroup("train", 2, {"CPU": 0.5}, timeout_s=20)
    with graph:
        Node("train", Dying, group=wg)
    sched = HybridScheduler(graph, backpressure=False)
    try:
        sched.start()
        pids = sched.call_all("train", "pid")
        box: dict = {}

        def step() -> None:
            try:
                sched.run([{"x": [1.0]}])
            except DataflowError as exc:
                box["error"] = exc

        t0 = time.monotonic()
        th = threading.Thread(target=step)
        th.start()
        time.sleep(2.0)               # rank 0 waits in all_reduce for rank 1, which sleeps
        os.kill(pids[1], signal.SIGKILL)
        th.join(timeout=60)
        took = time.monotonic() - t0
        assert not th.is_alive(), "the step hung after a rank died"
        msg = str(box["error"])
        assert "\n" not in msg and "train_1 rank 1/2 of group 'train'" in msg and "died" in msg, msg
        assert f"pid {pids[1]}" in msg and took < 40
    finally:
        sched.shutdown()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(pids[0]):
        time.sleep(0.2)
    assert not _alive(pids[0]) and not _alive(pids[1])   # the survivor, stuck in its collective, is gone too


class Dying:
    def __init__(self) -> None:
        pass

    def process(self, item: dict) -> dict:
        import torch.distributed as dist

        from hpc_verl.dataflow import current_context
        if current_context().rank == 1:
            time.sleep(60)
        t = torch.ones(1)
        dist.all_reduce(t)
        return {"sum": float(t)}

    def pid(self) -> int:
        return os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


class SnapTrainer(Trainer):
    """A trainer that freezes each version (SNAPSHOT) and takes its time, so two items overlap."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen: dict[int, list] = {}
        self.sums: dict[int, float] = {}

    def process(self, joined: dict) -> dict:
        from hpc_verl.dataflow import SNAPSHOT, current_context
        t0 = time.time()
        time.sleep(0.4)
        with torch.no_grad():
            self.w.weight.add_(1.0)
        self.version += 1
        self.frozen[self.version] = [(n, p.detach().clone()) for n, p in self.w.named_parameters()]
        self.sums[self.version] = float(self.w.weight.double().sum())
        current_context().emit_control(SNAPSHOT, self.version)
        return {"trained_at": self.version - 1, "used": joined["version"][0], "held": joined["weight_sum"][0],
                "rolled_at": joined["t"][0], "t0": t0, "t1": time.time()}

    def export_snapshot(self, data_type: str, version: int):
        return iter(self.frozen[version])

    def sums_by_version(self) -> dict:
        return self.sums


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_snapshots_let_two_items_overlap_with_the_right_weights_for_each_version(cluster):
    graph = DataflowGraph("wg_snapshot")
    with graph:
        r = Node("rollout", Rollout, group=WorkerGroup("roll", 1, {"CPU": 0.5}, dist=False), dispatch="split")
        t = Node("train", SnapTrainer, group=WorkerGroup("train", 1, {"CPU": 0.5}, timeout_s=30))
        Edge(r, t)
        Edge(t, r, control=True, consistency="strong", data_type="policy")
    sched = HybridScheduler(graph, backpressure=False)
    try:
        sched.start()
        left = iter(range(8))
        outs, roll = [], []
        for out in sched.stream(lambda: {"x": [[1.0] * 4], "uid": ["a"]} if next(left, None) is not None else None,
                                depth=2):
            outs.append(out["train"])
        sums = sched.call_all("train", "sums_by_version")[0]
        transfer = sched.get_status()["edges"]["train->rollout"]["transfer"]
    finally:
        sched.shutdown()
    assert len(outs) == 8 and [o["trained_at"] for o in outs] == list(range(8))
    stale = [o["trained_at"] - o["used"] for o in outs]
    assert set(stale) <= {0, 1} and stale.count(1) >= 6                  # one version behind, never more
    assert transfer["mode"] == "broadcast (snapshot, overlapped)" and transfer["version"] == 8
    # every item was generated with exactly the weights of the version it names (not a newer copy)
    for o in outs:
        if o["used"] > 0:
            assert o["held"] == pytest.approx(sums[o["used"]], rel=1e-9), o
    # overlap: the rollout of item k+1 ran while item k was training (stale == 1 above says the same
    # from the versions; by the clock, a loaded CI machine may delay a rollout, so half suffices)
    assert sum(outs[i + 1]["rolled_at"] < outs[i]["t1"] for i in range(1, 7)) >= 3
    del roll


# ---- take_rows: each rank fetches only the rows it uses ------------------------------------------
def every_other_row(n: int, rank: int, world: int, item: dict) -> list[int]:
    """Rank r uses rows r, r + world, ... : rows from every producer shard, so a rank needs a piece of each."""
    return list(range(rank, n, world))


class RowsUser:
    """An SPMD rank that keeps what it was handed: its row numbers and the rows' x values."""

    def __init__(self) -> None:
        self.last: tuple | None = None

    def process(self, joined: dict) -> dict:
        from hpc_verl.dataflow import current_context
        ctx = current_context()
        batch = joined["rollout"]
        self.last = (ctx.rank, ctx.row_ids, [x[0] for x in batch["x"]], list(batch["replica"]))
        return {"rows": len(batch["x"]), "scores": joined["score"]}

    def seen(self) -> tuple | None:
        return self.last


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_take_rows_ranks_fetch_only_their_rows_and_everyone_else_gets_whole_items(cluster):
    g = DataflowGraph("take_rows")
    wg = WorkerGroup("hybrid", 2, {"GPU": 1}, ranks_per_node=1)
    with g:
        r = Node("rollout", Rollout, group=wg, dispatch="split", split_key="uid")
        t = Node("train", RowsUser, group=wg, take_rows=every_other_row)
        s = Node("score", score)
        Edge(r, s, co_locate=True)
        Edge(r, t)
        Edge(s, t)
    sched = HybridScheduler(g, backpressure=False)
    try:
        sched.start()
        out = sched.run({"rollout": [_batch()]}, sinks_only=False)
        # the driver and a whole-item consumer (score) see every row; the spmd result is rank 0's
        assert out["rollout"][0]["x"] == _batch()["x"] and out["train"][0] == {"rows": 3, "scores": {"n": 6}}
        seen = sched.call_all("train", "seen")
        status = sched.get_status()
        assert [w["fetched_rows"] for w in status["nodes"]["train"]["workers"]] == [3, 3]
        assert all(w["fetched_rows"] == 0 for w in status["nodes"]["score"]["workers"])
        xs = [x[0] for x in _batch()["x"]]
        for rank, (r_rank, rows, got, replicas) in enumerate(seen):
            assert r_rank == rank and rows == list(range(rank, 6, 2))
            assert got == [xs[i] for i in rows]                   # those rows' values, in order
            assert set(replicas) == {0, 1}                        # a piece from each producer shard
    finally:
        sched.shutdown()
    # a producer whose outputs are not its input rows one to one cuts nothing: whole shards then
    from hpc_verl.dataflow import pieces
    assert pieces.cut([{"x": [1, 2, 3]}], [(0, 2, 4)], {"train": every_other_row}, {"train": 2}) is None
    with pytest.raises(DataflowError, match="take_rows is a function"):
        Node("bad", RowsUser, group=WorkerGroup("w", 2, dist=False), dispatch="split", take_rows=every_other_row)
