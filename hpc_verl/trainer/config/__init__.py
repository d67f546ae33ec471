"""Which trainer config is valid: the schema and defaults (ppo_default.yaml), refusals,
derived values and the worker-group topology.

Runs in the driver (and in the launcher, which asks it about a job's trainer config).
No torch, transformers or vLLM at any module top here (tests/test_layers.py): loading a
config must stay fast on a login node.
"""
