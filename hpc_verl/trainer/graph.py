"""The PPO loop as a DataflowGraph, placed by the HybridScheduler on Ray.

``build_ppo_graph`` declares the nodes (roles) and edges; ``role_resources`` is
the device mapping (3D-HybridEngine's first dimension: which GPU group each role
gets). ``DataflowRunner`` runs one step as one item through the graph.
``InlineRunner`` executes the same graph object in this process, in topological
order, for fast unit tests of the nodes' logic (no Ray, no scheduler).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

from hpc_verl.errors import ConfigError
from hpc_verl.trainer import nodes as N

log = logging.getLogger("hpc_verl.trainer")


def roles_for(cfg: Mapping) -> tuple[str, ...]:
    roles = ["rollout", "actor", "reward"]
    if cfg["algorithm"]["use_kl_in_reward"] or cfg["actor_rollout_ref"]["actor"]["use_kl_loss"]:
        roles.append("ref")
    if cfg["critic"]["enable"]:
        roles.append("critic")
    return tuple(roles)


def role_resources(cfg: Mapping, roles: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per-instance Ray resources of each role from ``hpc_verl.device_mapping``.

    On CPU (trainer.device=cpu) roles ask for no GPU. Roles that share a GPU group
    split it: k roles on g GPUs get g/k each (whole GPUs when g >= k, a fraction
    below one otherwise), so the scheduler co-locates them on the same devices as
    verl's hybrid engine does. A rule-based reward never takes a GPU. The vLLM
    rollout needs ``tensor_model_parallel_size`` whole GPUs.
    """
    t = cfg["trainer"]
    if t["device"] == "cpu" or t["n_gpus_per_node"] == 0:
        return {r: {} for r in roles}
    n_gpus = t["n_gpus_per_node"]
    mapping = cfg["hpc_verl"]["device_mapping"] or {}
    gpu_roles = [r for r in roles if r != "reward" or cfg["reward_model"]["enable"]]
    groups: dict[str, tuple[int, ...]] = {}
    for r in gpu_roles:
        groups[r] = tuple(mapping.get(r, range(n_gpus)))
    out: dict[str, dict[str, float]] = {r: {} for r in roles}
    for r in gpu_roles:
        group = groups[r]
        sharing = [o for o in gpu_roles if set(groups[o]) & set(group)]
        share = len(group) / len(sharing)
        out[r] = {"GPU": float(int(share)) if share >= 1 else round(share, 4)}
    rollout = cfg["actor_rollout_ref"]["rollout"]
    if "rollout" in roles and rollout["name"] == "vllm":
        tp = rollout["tensor_model_parallel_size"]
        if tp > len(groups["rollout"]):
            raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} is more than the "
                              f"{len(groups['rollout'])} GPU(s) mapped to the rollout")
        out["rollout"] = {"GPU": float(tp)}
    return out


def build_ppo_graph(cfg: Mapping, total_steps: int, name: str = "ppo") -> Any:
    """Declare the PPO dataflow for ``cfg`` (a plain dict)."""
    from hpc_verl.dataflow import DataflowGraph, Edge, Node

    roles = roles_for(cfg)
    res = role_resources(cfg, roles)
    grpo = cfg["algorithm"]["adv_estimator"] == "grpo"
    graph = DataflowGraph(name)
    with graph:
        rollout = Node("actor_rollout", N.RolloutNode, resources=res["rollout"], init_args=(cfg,))
        reward = Node("reward_score", N.RewardNode, resources=res["reward"], init_args=(cfg,))
        if "ref" in roles:
            ref = Node("ref_logprob", N.RefNode, resources=res["ref"], init_args=(cfg,))
        if grpo:
            adv = Node("advantage", N.AdvantageNode, resources={}, init_args=(cfg,), max_parallelism=1)
        else:
            adv = Node("critic", N.CriticNode, resources=res["critic"], init_args=(cfg, total_steps),
                       max_parallelism=1)
        # stateful (weights, optimiser, KL controller): one instance, never scaled by backpressure
        actor = Node("actor_update", N.ActorNode, resources=res["actor"], init_args=(cfg, total_steps),
                     max_parallelism=1)
        # scores are a few bytes per response: keep reward next to the rollout
        Edge(rollout, reward, data_type="rollout_batch", co_locate=True)
        Edge(rollout, adv, data_type="rollout_batch")
        Edge(reward, adv, data_type="scores", max_size_bytes=1_000_000)
        if "ref" in roles:
            Edge(rollout, ref, data_type="rollout_batch")
            Edge(ref, adv, data_type="ref_log_prob")
        Edge(rollout, actor, data_type="rollout_batch")
        Edge(adv, actor, data_type="advantages")
        Edge(actor, rollout, data_type=N.POLICY_EDGE, control=True, consistency="strong")
    return graph


def adv_node_name(cfg: Mapping) -> str:
    return "advantage" if cfg["algorithm"]["adv_estimator"] == "grpo" else "critic"


class DataflowRunner:
    """Runs the PPO graph under the HybridScheduler on Ray (joins or starts Ray)."""

    def __init__(self) -> None:
        self.sched: Any = None
        self._started_ray = False

    def start(self, cfg: Mapping, total_steps: int) -> None:
        import ray

        from hpc_verl.dataflow import HybridScheduler

        hv = cfg["hpc_verl"]
        if not ray.is_initialized():
            address = hv["ray_address"] or os.environ.get("RAY_ADDRESS")
            pkg_parent = str(Path(__file__).resolve().parents[2])
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [pkg_parent, os.environ.get("PYTHONPATH")])),
                   "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            if address:
                ray.init(address=address, namespace="hpc_verl", runtime_env={"env_vars": env},
                         log_to_driver=True)
            else:  # a private single-node Ray on random ports; never joins someone else's cluster
                os.environ.update(env)
                ray.init(address="local", num_cpus=hv["ray_num_cpus"] or os.cpu_count(), include_dashboard=False,
                         namespace="hpc_verl", log_to_driver=True)
                self._started_ray = True
        graph = build_ppo_graph(cfg, total_steps, name=f"ppo-{cfg['trainer']['experiment_name']}")
        run_dir = Path(os.path.expanduser(cfg["hpc_verl"]["run_dir"]))
        self.sched = HybridScheduler(graph, status_file=str(run_dir / "dataflow_status.json"))
        self.sched.start()
        log.info("dataflow plan:\n%s", self.sched.placement)  # (the one start() placed by; planned once)

    def run_step(self, batch: dict) -> dict:
        out = self.sched.run({"actor_rollout": [batch]})
        return out["actor_update"][0]

    def call(self, node: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.sched.call_all(node, method, *args, **kwargs)[0]

    def publish_policy(self, weights: dict, version: int) -> None:
        self.sched.send_control("actor_update->actor_rollout", weights, version)

    def status(self) -> dict:
        return self.sched.get_status() if self.sched else {}

    def shutdown(self) -> None:
        try:
            if self.sched is not None:
                self.sched.shutdown()
        finally:
            self.sched = None
            if self._started_ray:
                import ray
                ray.shutdown()
                self._started_ray = False


class InlineRunner:
    """The same graph, executed in this process in topological order (tests only: no Ray)."""

    def __init__(self) -> None:
        self.instances: dict[str, Any] = {}
        self.graph: Any = None

    def start(self, cfg: Mapping, total_steps: int) -> None:
        self.graph = build_ppo_graph(cfg, total_steps)
        for name in self.graph.topo_order():
            node = self.graph.nodes[name]
            inst = node.target(*node.init_args, **node.init_kwargs)
            self.instances[name] = inst
        for edge in self.graph.control_edges():
            src = self.instances[edge.src_name]
            dst = self.instances[edge.dst_name]

            def hook(payload: Any, version: int, dst: Any = dst, edge: Any = edge) -> None:
                from hpc_verl.dataflow.context import ControlMessage
                getattr(dst, "on_control")(ControlMessage(edge.key, edge.data_type, version, payload,
                                                          edge.src_name))
            src._emit_hook = hook

    def run_step(self, batch: dict) -> dict:
        outputs: dict[str, Any] = {}
        for name in self.graph.topo_order():
            ins = self.graph.in_edges(name)
            node = self.graph.nodes[name]
            if not ins:
                item = batch
            elif len(ins) == 1:
                item = outputs[ins[0].src_name]
            else:
                item = {e.src_name: outputs[e.src_name] for e in ins}
            outputs[name] = getattr(self.instances[name], node.method)(item)
        return outputs["actor_update"]

    def call(self, node: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.instances[node], method)(*args, **kwargs)

    def publish_policy(self, weights: dict, version: int) -> None:
        self.instances["actor_rollout"].load_weights(weights, version)

    def status(self) -> dict:
        return {}

    def shutdown(self) -> None:
        self.instances.clear()
