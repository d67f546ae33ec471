"""The module verl imports in every process of a CPU job (``VERL_USE_EXTERNAL_MODULES``).

verl 0.9.1 imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` at the end of
``import verl`` (verl/__init__.py:49-52), before any of its workers exist. This one
checks the verl version, registers the ``cpu`` platform (selected by
``VERL_PLATFORM=cpu``, verl/plugin/platform/platform_manager.py:83-117) and applies
the corrections of :mod:`.patches`. A verl of another series stops here with one
line: its code may have moved under the corrections.
"""
from __future__ import annotations

from hpc_verl.verl_upstream.cpu import patches, rules


def install() -> None:
    """Check the version, then register the platform and apply the corrections (idempotent)."""
    rules.check_version(patches.verl_version())
    patches.engine_lookup_env()
    patches.vllm_distribution_alias()
    from hpc_verl.verl_upstream.cpu import platform  # noqa: F401  (registers "cpu")

    patches.gloo_process_group()
    patches.vllm_cpu_weight_update_on_import()


install()
