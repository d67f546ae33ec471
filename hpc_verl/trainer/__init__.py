"""The built-in PPO/GRPO trainer, by process and concern (docs/development.md, "Layers").

``python -m hpc_verl.trainer.main`` is the entry point. Sub-packages, lowest first:
``core_algos`` (the maths), ``config/`` (which config is valid), ``models/`` (model files),
``observe/`` (metrics, trackers), ``engine/`` (a rank's device, parallelism, sharded state),
``rollout/`` (generation engines), ``roles/`` (what each graph node does in a rank) and
``driver/`` (the PPO loop, its graph, Ray). Each ``__init__`` says which process runs it and
whether torch may be imported at its top. Importing this package imports nothing.
"""
