"""From a profile and a job config to a running job.

``spec/`` says what will run (job config, render, launch plan, trainer checks) and
runs nothing; ``backends/`` run it (SLURM, this machine, a Ray cluster's Jobs API)
behind one interface; ``registry`` records every job. ``cluster`` holds Ray clusters
in SLURM allocations; ``checks`` and ``hold`` are steps the rendered script runs
inside a job; ``submit`` is the Python API (``hpc_verl.submit``).
"""
