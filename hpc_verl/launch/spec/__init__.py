"""What will run: the job config, the rendered script and the launch plan. Pure: submits nothing.

``jobconfig`` (the job file, strict), ``render`` (one Jinja environment, the sbatch
template's context), ``launch_plan`` (``build_plan`` -> ``LaunchPlan``, the static
checks of a script), ``trainer_check`` (the trainer's keys and batch arithmetic on
the allocation, before anything is written).
"""
