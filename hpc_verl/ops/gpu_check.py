"""The GPU check: the trainer's roles on one GPU, without Ray or vLLM, in a few minutes.

``python -m hpc_verl.ops.gpu_check OUT_DIR`` (or ``scripts/gpu_check.sh OUT_DIR``) builds a
Qwen2-0.5B-shaped model from a config (random weights, the char tokenizer; no hub), then runs
the trainer's own worker classes in this process - a world-size-1 process group on NCCL stands
in for the worker group - and writes every check's pass/fail and figures to
``OUT_DIR/gpu_check.json`` (rewritten after each check, so a killed run keeps what it did).
A failing check is recorded and the next one runs. ``--device cpu --size tiny`` runs the same
code on a CPU (gloo), for the tests.

Not run on a GPU yet.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from hpc_verl.errors import HpcVerlError
from hpc_verl.ops import gpu_roles
from hpc_verl.ops.gpu_model import (H200_BF16_DENSE_FLOPS, SIZES, WORK, build_model, count_params,  # noqa: F401
                                    model_config, train_flops_per_token)

JSON_NAME = "gpu_check.json"
DEFAULT_BUDGET_S = 480


class GpuCheckError(HpcVerlError):
    """Bad arguments to the GPU check."""


class Report:
    """The JSON result: written atomically after every check."""

    def __init__(self, out_dir: Path, meta: dict) -> None:
        self.path = out_dir / JSON_NAME
        self.data: dict[str, Any] = {"meta": meta, "checks": {}, "order": [], "passed": 0, "failed": 0,
                                     "skipped": 0}
        self.write()

    def add(self, name: str, result: dict) -> None:
        self.data["checks"][name] = result
        self.data["order"].append(name)       # (the file's keys are sorted)
        status = result["status"]
        self.data[status] = self.data.get(status, 0) + 1
        self.write()

    def write(self) -> None:
        from hpc_verl.util.fs import atomic_write_json
        atomic_write_json(self.path, self.data)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _progress(text: str) -> Any:
    """A rich spinner on a terminal (the checks take minutes); nothing in a log."""
    import contextlib
    if not sys.stderr.isatty():
        return contextlib.nullcontext()
    try:
        from rich.console import Console
    except ImportError:
        return contextlib.nullcontext()
    return Console(stderr=True).status(text)


def run_checks(checks: list[tuple[str, Callable[[], dict]]], report: Report, budget_s: float,
               say: Callable[[str], None] = print) -> int:
    """Run each check, record it, print one line; a failure does not stop the others. Returns failures."""
    start = time.monotonic()
    for name, fn in checks:
        if time.monotonic() - start > budget_s:
            report.add(name, {"status": "skipped", "reason": f"time budget of {budget_s:.0f} s used up"})
            say(f"SKIP {name}: time budget used up")
            continue
        t0 = time.monotonic()
        try:
            with _progress(f"gpu_check: running {name} ..."):
                figures = fn() or {}
            result = {"status": "passed", **figures}
        except Exception as exc:  # noqa: BLE001 - every failure is a result here
            result = {"status": "failed", "error": _one_line(exc),
                      "where": traceback.format_exc().strip().splitlines()[-3:]}
        result["seconds"] = round(time.monotonic() - t0, 3)
        report.add(name, result)
        shown = ", ".join(f"{k}={v}" for k, v in result.items() if k not in ("status", "where")
                          and not isinstance(v, (dict, list)))
        say(f"{'PASS' if result['status'] == 'passed' else 'FAIL'} {name}: {shown}")
    return report.data["failed"]


def _meta(args: argparse.Namespace) -> dict:
    import torch
    import transformers
    meta = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "size": args.size, "device": args.device,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
            "peak_bf16_flops": H200_BF16_DENSE_FLOPS}
    if torch.cuda.is_available():
        meta.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    return meta


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description="the trainer's roles on one GPU, no Ray/vLLM")
    p.add_argument("out_dir", help="directory for gpu_check.json (and the generated model)")
    p.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="checks not started within this many seconds are skipped (default %(default)s)")
    p.add_argument("--only", action="append", default=[], help="run only these checks (repeatable)")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise GpuCheckError(f"gpu_check: {out} exists and is not a directory; name a directory for the results")
    if args.budget_s <= 0:
        raise GpuCheckError(f"gpu_check: --budget-s {args.budget_s:g} must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        names = gpu_roles.check_names()
        unknown = [n for n in args.only if n not in names]
        if unknown:
            raise GpuCheckError(f"gpu_check: unknown check {unknown[0]!r}; choose from {', '.join(names)}")
        if args.device == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise GpuCheckError("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); "
                                    "run it on the GPU machine, or --device cpu --size tiny to test the script")
    except GpuCheckError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from hpc_verl.trainer.models.check import quiet_transformers
    quiet_transformers()
    report = Report(out, _meta(args))
    suite = gpu_roles.Suite(out, args.size, args.device, report)
    checks = [(n, fn) for n, fn in suite.checks() if not args.only or n in args.only]
    failed = run_checks(checks, report, args.budget_s)
    suite.close()
    print(f"gpu_check: {report.data['passed']} passed, {failed} failed, {report.data['skipped']} skipped; "
          f"results in {report.path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
