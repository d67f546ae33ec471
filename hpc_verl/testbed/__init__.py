"""A real SLURM cluster on this machine for tests and demos (munge, slurmctld, two slurmd).

Not shipped for production use: it exists so that the launcher, the Ray bootstrap
and the ops verbs are tested against a real scheduler, not mocks. GPUs are faked
(gres with ``File=`` pointing at empty files); everything else is real.
"""
from hpc_verl.testbed.cluster import TestBed, TestBedError

__all__ = ["TestBed", "TestBedError"]
