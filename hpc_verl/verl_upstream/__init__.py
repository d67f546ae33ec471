"""Upstream verl (``python3 -m verl.trainer.main_ppo``) as a trainer choice.

``config``: where verl is installed and the full set of dotted keys of its
``ppo_trainer`` config (composed with Hydra, without importing verl, whose
package pulls GPU-side dependencies). ``overrides``: parsing and validation of
Hydra overrides against that key set. ``command``: the main_ppo command line
with the overrides derived from the profile and the allocation. ``cpu``: verl on a
CPU profile (a smoke run): the launcher's rules and the plugin verl loads.
"""
