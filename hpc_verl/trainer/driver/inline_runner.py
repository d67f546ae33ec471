"""The PPO graph in this process, one rank per worker group (``dataflow.inline``): the nodes'
logic without Ray or torch.distributed, for unit tests and one-rank profiling. Driver; no
torch at import (the nodes load it when built)."""
from __future__ import annotations

from typing import Any, Mapping

from hpc_verl.dataflow.context import TENSORS
from hpc_verl.dataflow.inline import InlineRunner as _GraphRunner
from hpc_verl.errors import ConfigError
from hpc_verl.trainer.driver.ppo_graph import build_ppo_graph
from hpc_verl.trainer.roles.nodes import ACTOR_NODE, POLICY_EDGE


class InlineRunner:
    """A runner of PPOTrainer (as ray_runner.DataflowRunner is) that builds the graph here."""

    def __init__(self) -> None:
        self.graph: Any = None
        self._run: _GraphRunner | None = None

    @property
    def instances(self) -> dict[str, Any]:
        return self._run.instances if self._run else {}

    def start(self, cfg: Mapping, total_steps: int) -> None:
        self.graph = build_ppo_graph(cfg, total_steps)
        for g in self.graph.groups().values():
            if g.world_size != 1:
                raise ConfigError(f"InlineRunner runs one rank per worker group; group {g.name} has "
                                  f"{g.world_size} (set trainer.nnodes=1 trainer.n_gpus_per_node=1)")
        self._run = _GraphRunner(self.graph).start()

    def run_step(self, batch: dict) -> dict:
        return self._run.run(batch)[ACTOR_NODE]

    def call(self, node: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._run.call(node, method, *args, **kwargs)

    def call_all(self, node: str, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [self.call(node, method, *args, **kwargs)]

    def publish_policy(self, version: int) -> None:
        self._run.deliver(ACTOR_NODE, [(POLICY_EDGE, version, TENSORS)])

    def stream(self, produce: Any, depth: int) -> Any:
        raise ConfigError("hpc_verl.one_step_off_policy needs the Ray runner (two steps in flight); the "
                          "in-process InlineRunner runs one step at a time")

    def status(self) -> dict:
        return {}

    def shutdown(self) -> None:
        if self._run is not None:
            self._run.shutdown()
