"""The driver process: the PPO loop, the PPO graph's declaration, the Ray runner and the
private Ray session, the checkpoint format and preemption.

No torch, transformers or vLLM at any module top here (tests/test_layers.py): the driver
starts Ray while the ranks load torch, and ``import hpc_verl.trainer.driver`` imports nothing.
"""
