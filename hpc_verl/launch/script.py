"""Render the SLURM batch script for a job (Ray bootstrap, preemption, trainer command).

Uses the full launcher template when ``hpc_verl.launch.render`` provides one, and
``templates/slurm_minimal.sbatch.j2`` (the same Ray and preemption partials, no
data/model stages) otherwise.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from hpc_verl._version import __version__
from hpc_verl.errors import RenderError

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"


def shquote(value: Any) -> str:
    """Quote any value for bash (booleans as true/false)."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    return shlex.quote(str(value))


def environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["shquote"] = shquote
    return env


def render_minimal(profile: Any, *, job_dir: str, submit_dir: str, job_name: str,
                   train_command: list[str], pre_stages: list[dict[str, Any]] | None = None,
                   env: dict[str, str] | None = None, hold: bool = False) -> str:
    """The minimal batch script: preemption, pre-stages with markers, Ray, trainer.

    ``hold``: instead of the trainer, keep the Ray cluster up for Ray Jobs
    submissions (``hpc-verl cluster up``; partials/hold.sh.j2)."""
    import jinja2

    try:
        return environment().get_template("slurm_minimal.sbatch.j2").render(
            profile=profile, job_dir=job_dir, submit_dir=submit_dir, job_name=job_name,
            train_command=train_command, pre_stages=pre_stages or [], env=env or {}, version=__version__,
            hold=hold)
    except jinja2.TemplateError as exc:
        raise RenderError(f"rendering the SLURM script for profile {profile.name}: {exc}") from None
