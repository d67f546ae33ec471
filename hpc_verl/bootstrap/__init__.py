"""What runs on each node of a job: node list, port block, head IP, token, Ray start, barrier.

Called from the rendered batch script as ``python3 -m hpc_verl.bootstrap VERB``
(see ``templates/partials/ray.sh.j2``). Nothing here imports ray at module level:
the barrier and the node supervisor import it inside functions.
"""
