"""Generation engines behind one interface: the transformers rollout (hf), vLLM
(vllm_worker, vllm_engine) and shared-prompt attention.

Runs in the rollout ranks. torch may be imported at a module's top here; ``ROLLOUTS``
names each engine's worker class (``actor_rollout_ref.rollout.name`` -> "module:Class"),
and importing this package imports no engine.
"""
