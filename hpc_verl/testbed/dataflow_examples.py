"""Small node implementations and example graphs for the dataflow runtime's tests,
its benchmark and docs (test helpers, outside the runtime package; they are in
the installed package only so Ray workers can import them).

The PPO graph is the design seed's example (actor_rollout -> reward_score ->
critic_train, with the updated policy going back to the rollout over a strong
control edge), scaled down so it fits a given number of (possibly fake) GPUs.
The "work" is simulated: nodes report where they ran and which policy version
they used, which is what placement and consistency tests need.
"""
from __future__ import annotations

import os
import time
from typing import Any

from hpc_verl.dataflow.context import ControlMessage, current_context
from hpc_verl.dataflow.graph import DataflowGraph, Edge, Node


def where() -> dict[str, Any]:
    """Where the current instance runs, as the instance itself sees it."""
    ctx = current_context()
    return {"instance": ctx.instance_id, "ray_node_id": ctx.ray_node_id,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "pid": os.getpid()}


def identity(item: Any) -> Any:
    """Trivial work (benchmarks)."""
    return item


class Stage:
    """Trivial or slow work that reports where it ran: ``delay_s`` of sleep per item."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.ulysses = True

    def process(self, item: Any) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)
        trail = list(item.get("trail", [])) if isinstance(item, dict) else []
        trail.append(where())
        out = dict(item) if isinstance(item, dict) else {"value": item}
        out["trail"] = trail
        return out

    def set_ulysses(self, enabled: bool) -> None:
        self.ulysses = enabled


class RolloutSim:
    """Stands in for actor_rollout: 'generates' with the policy version it holds."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.version = -1
        self.weights: Any = None
        self.delay_s = delay_s

    def on_control(self, msg: ControlMessage) -> None:
        self.version = msg.version
        self.weights = msg.payload

    def process(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.delay_s:
            time.sleep(self.delay_s)
        out = dict(batch)
        out["policy_version"] = self.version
        out["ctx_version"] = current_context().versions.get("updated_policy", -1)
        out["rollout"] = where()
        out["responses"] = [f"response to {p}" for p in batch.get("prompts", [])]
        return out

    def get_version(self) -> int:
        return self.version


def reward_score(batch: dict[str, Any]) -> dict[str, Any]:
    """Stands in for reward_score: a rule-based score per response."""
    out = dict(batch)
    out["rewards"] = [float(len(r) % 3) for r in batch.get("responses", [])]
    out["reward"] = where()
    return out


class CriticSim:
    """Stands in for critic_train; the item flagged ``last`` publishes the next policy."""

    def __init__(self) -> None:
        self.steps = 0

    def process(self, batch: dict[str, Any]) -> dict[str, Any]:
        self.steps += 1
        out = dict(batch)
        out["critic"] = where()
        if batch.get("last"):
            version = int(batch["iteration"]) + 1
            current_context().emit_control({"policy_step": version}, version=version)
        return out

    def save_checkpoint(self, path: str) -> str:
        return f"{path}/{current_context().instance_id}:{self.steps}"


class PolicyUpdater:
    """Stands in for the actor update: a service node driven by call_all that
    publishes each new policy over its control edge."""

    def __init__(self) -> None:
        self.version = 0

    def process(self, item: Any) -> Any:  # never fed: a service node
        return item

    def update(self, batch: list) -> int:
        self.version += 1
        current_context().emit_control({"trained_on": len(batch)}, version=self.version)
        return self.version


def ppo_example_graph(name: str = "ppo_training", total_gpus: int = 8, rollout_delay_s: float = 0.0) -> DataflowGraph:
    """The seed's PPO graph scaled to ``total_gpus`` (8 -> rollout 4 x GPU:1,
    reward 4 x GPU:0.5 co-located with rollout, critic 2 x GPU:1)."""
    scale = max(1, total_gpus // 8)
    graph = DataflowGraph(name)
    with graph:
        actor = Node("actor_rollout", RolloutSim, resources={"GPU": 1}, parallelism=4 * scale,
                     init_kwargs={"delay_s": rollout_delay_s})
        critic = Node("critic_train", CriticSim, resources={"GPU": 1}, parallelism=2 * scale, ulysses=True)
        reward = Node("reward_score", reward_score, resources={"GPU": 0.5}, parallelism=4 * scale)
        Edge(actor, reward, data_type="rollout_batch", co_locate=True, max_size_bytes=10_000_000)
        Edge(reward, critic, data_type="rewarded_batch")
        Edge(critic, actor, data_type="updated_policy", control=True, consistency="strong")
    return graph


def three_stage_graph(name: str, parallelism: int = 1, capacity: int = 256) -> DataflowGraph:
    """The benchmark pipeline: three trivial function stages."""
    graph = DataflowGraph(name)
    with graph:
        a = Node("stage_a", identity, parallelism=parallelism)
        b = Node("stage_b", identity, parallelism=parallelism)
        c = Node("stage_c", identity, parallelism=parallelism)
        Edge(a, b, capacity=capacity)
        Edge(b, c, capacity=capacity)
    return graph
