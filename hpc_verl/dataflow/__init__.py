"""The RL dataflow runtime: declare a graph, plan it, run it on Ray.

Nothing here imports Ray at import time; see docs/dataflow.md.
"""
from __future__ import annotations

from hpc_verl.dataflow.context import SNAPSHOT, TENSORS, ControlMessage, WorkerContext, current_context
from hpc_verl.dataflow.graph import DataflowGraph, DataflowRunError, Edge, Node, WorkerGroup
from hpc_verl.dataflow.placement import ClusterNode, PlacementPlan, make_plan
from hpc_verl.dataflow.scheduler import HybridScheduler

__all__ = ["SNAPSHOT", "TENSORS", "ClusterNode", "ControlMessage", "DataflowGraph", "DataflowRunError", "Edge", "HybridScheduler", "Node",
           "PlacementPlan", "WorkerContext", "WorkerGroup", "current_context", "make_plan"]
