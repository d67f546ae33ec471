"""One check's verdict (OK / WARN / FAIL / SKIP, a line of detail, a line of fix): shared by
``hpc-verl doctor``'s node checks (:mod:`hpc_verl.ops.doctor`) and its job checks
(:mod:`hpc_verl.ops.doctor_job`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"


@dataclass
class CheckResult:
    name: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)
