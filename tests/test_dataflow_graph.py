"""Graph validation and the pure placement plan: no Ray, clusters described by hand."""
from __future__ import annotations

import json

import pytest

from hpc_verl import DataflowGraph, Edge, HybridScheduler, Node
from hpc_verl.dataflow import ClusterNode, make_plan
from hpc_verl.testbed.dataflow_examples import Stage, identity, ppo_example_graph
from hpc_verl.errors import DataflowError, HpcVerlError


def two_by_four() -> list[ClusterNode]:
    return [ClusterNode(f"id{i}", f"gpu-node-{i}", {"CPU": 8.0, "GPU": 4.0}) for i in (1, 2)]


def test_dataflow_error_is_a_user_error():
    assert issubclass(DataflowError, HpcVerlError)


def test_edge_to_unknown_node_names_it_and_suggests():
    g = DataflowGraph("g")
    with g:
        Node("reward_score", identity)
        Edge("reward_scor", "reward_score")
    with pytest.raises(DataflowError, match=r"unknown src node 'reward_scor'.*did you mean 'reward_score'"):
        g.validate()


def test_cycle_of_data_edges_is_rejected_but_control_edges_close_the_loop():
    g = DataflowGraph("loop")
    with g:
        a, b, c = Node("a", identity), Node("b", identity), Node("c", identity)
        Edge(a, b)
        Edge(b, c)
        loop = Edge(c, a)
    with pytest.raises(DataflowError, match=r"cycle .*a -> b -> c -> a.*control edge"):
        g.validate()
    g.edges.remove(loop)
    g.add(Edge(c, a, control=True, consistency="strong"))
    g.validate()
    assert g.sources() == ["a"] and g.sinks() == ["c"]


def test_seed_style_keywords():
    g = DataflowGraph("seed")
    with g:
        actor = Node(name="actor_rollout", func=identity, resources={"GPU": 2}, parallelism=8)
        reward = Node(name="reward_score", func=identity, resources={"GPU": 0.5}, parallelism=16)
        Edge(src=actor, dst=reward, data_type="rollout_batch")
    g.validate()
    assert g.nodes["reward_score"].gpus == 0.5 and g.edge("rollout_batch").dst_name == "reward_score"


def test_bad_values_give_one_line_errors():
    with pytest.raises(DataflowError, match="parallelism=0"):
        Node("x", identity, parallelism=0)
    with pytest.raises(DataflowError, match="GPU=1.5 per instance"):
        Node("x", identity, resources={"GPU": 1.5})
    with pytest.raises(DataflowError, match="consistency='strongest'.*did you mean 'strong'"):
        Edge("a", "b", control=True, consistency="strongest")
    with pytest.raises(DataflowError, match="'strong' is for control edges"):
        Edge("a", "b", consistency="strong")
    with pytest.raises(DataflowError, match="has no method 'process'"):
        Node("x", dict)


def test_resources_no_node_can_hold_are_rejected():
    g = DataflowGraph("big")
    with g:
        Node("critic", Stage, resources={"GPU": 8})
    with pytest.raises(DataflowError, match=r"node 'critic' asks for GPU=8 .*largest: GPU=4"):
        make_plan(g, two_by_four())


def test_cluster_full_is_a_clear_error():
    g = DataflowGraph("full")
    with g:
        Node("rollout", Stage, resources={"GPU": 2}, parallelism=5)
    with pytest.raises(DataflowError, match=r"cannot place rollout_4 .*no free room"):
        make_plan(g, two_by_four())


def test_ppo_plan_colocates_stages_and_shares_bundles():
    plan = HybridScheduler(ppo_example_graph(), cluster=two_by_four()).plan()
    inst = plan.instances
    assert len(inst) == 10
    # co-location: rollout_i and reward_i share one bundle on one node, for every i
    for i in range(4):
        r, s = inst[f"actor_rollout_{i}"], inst[f"reward_score_{i}"]
        assert r.bundle == s.bundle and r.ray_node_id == s.ray_node_id
        assert plan.bundle(r.bundle).resources["GPU"] == 1.5
        assert f"Scheduling decision: co-located actor_rollout_{i} and reward_score_{i} on node {r.ray_node_name}" \
            in "\n".join(plan.decisions)
    # staged: 4 rollouts on 2 x 4 GPUs -> 2 stages of 2, distinct GPU slots within a stage
    stages: dict[int, list] = {}
    for r in plan.for_node("actor_rollout"):
        stages.setdefault(r.stage, []).append(r)
    assert sorted(stages) == [0, 1]
    for members in stages.values():
        assert len({m.ray_node_id for m in members}) == 1
        slots = [g for m in members for g in m.gpu_slots]
        assert len(slots) == len(set(slots)) == 2
    # no GPU slot over-committed on any node
    for node_id in ("id1", "id2"):
        load: dict[int, float] = {}
        for i in inst.values():
            if i.ray_node_id == node_id:
                for g in i.gpu_slots:
                    load[g] = load.get(g, 0) + ppo_example_graph().nodes[i.node].gpus / len(i.gpu_slots)
        assert all(v <= 1.0 + 1e-9 for v in load.values()), load
    text = str(plan)
    assert "actor_rollout_3" in text and "staged actor_rollout into 2 stage(s)" in text
    json.dumps(plan.to_dict())


def test_eight_rollouts_on_two_by_four_form_two_stages():
    g = DataflowGraph("staged")
    with g:
        Node("actor_rollout", Stage, resources={"GPU": 1}, parallelism=8)
    plan = make_plan(g, two_by_four())
    by_stage: dict[int, list] = {}
    for inst in plan.for_node("actor_rollout"):
        by_stage.setdefault(inst.stage, []).append(inst)
    assert sorted(by_stage) == [0, 1]
    for members in by_stage.values():
        assert len({m.ray_node_id for m in members}) == 1
        assert sorted(g for m in members for g in m.gpu_slots) == [0, 1, 2, 3]


def test_small_items_colocate_like_co_locate():
    g = DataflowGraph("small")
    with g:
        a = Node("a", identity, resources={"CPU": 1}, parallelism=2)
        b = Node("b", identity, resources={"CPU": 1}, parallelism=2)
        Edge(a, b, max_size_bytes=4096)
    plan = make_plan(g, two_by_four())
    assert plan.instances["a_1"].bundle == plan.instances["b_1"].bundle
    g2 = DataflowGraph("big_items")
    with g2:
        a = Node("a", identity, parallelism=2)
        b = Node("b", identity, parallelism=2)
        Edge(a, b, max_size_bytes=10**9)
    plan2 = make_plan(g2, two_by_four())
    assert plan2.instances["a_1"].bundle != plan2.instances["b_1"].bundle


def test_status_before_start_is_json():
    s = HybridScheduler(ppo_example_graph(), cluster=two_by_four())
    status = s.get_status()
    json.dumps(status)
    assert set(status["nodes"]) == {"actor_rollout", "reward_score", "critic_train"}
    with pytest.warns(UserWarning, match="no sequence-parallel"):
        assert s.disable_ulysses("reward_score") is False
    assert s.disable_ulysses("critic_train") is True
    assert s.get_status()["nodes"]["critic_train"]["ulysses"] is False
    with pytest.raises(DataflowError, match="not started"):
        s.run([1])
